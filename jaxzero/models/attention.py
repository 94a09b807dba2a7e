"""Causal grouped-query attention, optionally in a sliding window, with a choice of kernel.

Queries are [B, T, H, E], keys and values [B, T, K, E] with K dividing H (query head h reads
key/value head h // (H / K)). With a window W > 0, query i sees keys j with i - W < j <= i
(Hugging Face Mistral's convention); W = 0 is full causal attention. The kernels: ``"xla"``
materialises the B×H×T×T scores (the reference); ``"cudnn"`` is cuDNN flash attention (GPU
only); ``"blockwise"`` is flash attention in plain JAX, one block × block tile of scores per
head at a time; ``"auto"`` picks ``"cudnn"`` where the default backend is a GPU and cuDNN
accepts the shapes, dtypes and window, otherwise ``"blockwise"``, at trace time.

Keys and values may be another part of the sequence than the queries: with context
parallelism a device's T queries are positions ``q_offset .. q_offset + T - 1`` of the S
keys gathered from every device, or (ring attention) of a block of keys from another
device, whose position is subtracted (a negative offset: keys after every query). With
``return_lse`` the result is partial, to be merged with other blocks' results by their
log-sum-exp (``"xla"`` and ``"blockwise"``; ``"auto"`` takes ``"blockwise"``).
"""

from __future__ import annotations

import functools
import logging
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array
Implementation = Literal["auto", "xla", "cudnn", "blockwise"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)
DEFAULT_BLOCK = 512

log = logging.getLogger(__name__)


def check_implementation(name: str, key: str = "attention implementation") -> None:
  """Raises ValueError, naming the valid choices, when `name` is not one."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"{key}={name!r} is unknown; choose one of: " + ", ".join(IMPLEMENTATIONS))


def check_runs_on(name: str, platform: str, compute: str) -> None:
  """Raises ValueError when implementation `name` cannot run on `platform`'s devices in
  `compute` dtype: cuDNN needs a GPU, and float16 or bfloat16."""
  if name != "cudnn":
    return
  if platform != "gpu":
    raise ValueError(f"model.attention=cudnn needs a GPU (cuDNN); these devices are {platform}:"
                     " use model.attention=auto (cuDNN where it can run) or blockwise")
  if compute == "float32":
    raise ValueError("model.attention=cudnn needs float16 or bfloat16 compute; "
                     "precision.compute=float32: use model.attention=auto or blockwise")


def attention(q_BxTxHxE: Array, k_BxSxKxE: Array, v_BxSxKxE: Array, *,
              implementation: str = "auto", block: int = DEFAULT_BLOCK, window: int = 0,
              segment_ids_BxT: Array | None = None, kv_segment_ids_BxS: Array | None = None,
              q_offset: Array | int = 0, return_lse: bool = False
              ) -> Array | tuple[Array, Array]:
  """Causal softmax(q kᵀ / √E) v, [B, T, H, E] in the dtype of q.

  Args:
    q_BxTxHxE: queries.
    k_BxSxKxE: keys; K divides H. S = T, or S > T with `q_offset`.
    v_BxSxKxE: values.
    implementation: one of IMPLEMENTATIONS (see the module docstring).
    block: query and key tile length of "blockwise" (capped at T).
    window: sliding window W (query i sees keys i - W < j <= i); 0, or W >= T, is full
      causal attention.
    segment_ids_BxT: packed sequences: a query sees only keys of its own segment id
      ("xla" and "blockwise"; "auto" takes "blockwise" for them).
    kv_segment_ids_BxS: the keys' segment ids where S > T (default `segment_ids_BxT`).
    q_offset: the position of the first query among the keys (an int or a traced
      scalar): query t is at position q_offset + t. "blockwise" needs it to be a
      multiple of its tile (a part of the sequence is whole tiles), e.g. c * T. It may
      be negative (the keys after the queries: with q_offset <= -S no query sees any), or
      past the keys (with q_offset >= S and no window every query sees every key).
    return_lse: also return each query's log-sum-exp of its visible scores, [B, T, H]
      float32 (-inf, with a zero output, where a query sees no key): the pair to merge
      attention over several blocks of keys ("xla" and "blockwise"). The output is then
      float32, so that merging loses nothing to rounding.

  Raises:
    ValueError: for an unknown implementation, K not dividing H, a negative window,
      or segment ids with "cudnn".
  """
  check_implementation(implementation)
  if q_BxTxHxE.shape[2] % k_BxSxKxE.shape[2]:
    raise ValueError(f"query heads {q_BxTxHxE.shape[2]} are not a multiple of key/value heads "
                     f"{k_BxSxKxE.shape[2]}")
  if window < 0:
    raise ValueError(f"attention window {window} must not be negative (0 = full causal)")
  T, S = q_BxTxHxE.shape[1], k_BxSxKxE.shape[1]
  if isinstance(q_offset, np.integer):  # a known offset, checked as one (not floored)
    q_offset = int(q_offset)
  offset = S != T or not (isinstance(q_offset, int) and q_offset == 0)
  if return_lse and implementation == "cudnn":
    raise ValueError("attention with return_lse (a part to be merged) is not supported with "
                     "'cudnn'; use 'blockwise' or 'auto'")
  if kv_segment_ids_BxS is None:
    kv_segment_ids_BxS = segment_ids_BxT
  # A window longer than every query-key distance masks nothing. (With a traced offset
  # the distances are not known: the window stays, which is always exact.)
  if window >= (S if not offset else q_offset + T if isinstance(q_offset, int) else math.inf):
    window = 0
  if implementation == "auto":
    implementation = ("blockwise" if segment_ids_BxT is not None or offset or return_lse
                      else _resolve_auto(q_BxTxHxE, k_BxSxKxE, window))
  if implementation == "blockwise":
    block = _dividing_block(T, block) if offset else min(block, T)
    if isinstance(q_offset, int) and q_offset % block:
      raise ValueError(f"q_offset={q_offset} is not a multiple of the {block}-position tile "
                       f"of {T} queries (a part of the sequence is whole tiles)")
    if offset and S % block and segment_ids_BxT is None:
      # The keys are padded to whole tiles, and a query past the keys (q_offset + t >= S)
      # would see the padding as earlier keys: one segment for all, the padding none.
      B = q_BxTxHxE.shape[0]
      segment_ids_BxT = jnp.zeros((B, T), jnp.int32)
      kv_segment_ids_BxS = jnp.zeros((B, S), jnp.int32)
    out, lse = _flash(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, segment_ids_BxT, kv_segment_ids_BxS,
                      q_offset // block if offset else 0, block, window, return_lse)
    return (out, lse) if return_lse else out
  if (segment_ids_BxT is not None or offset) and implementation == "cudnn":
    raise ValueError("attention over packed sequences (segment ids) or over a part of the "
                     "sequence (q_offset) is not supported with 'cudnn'; use 'blockwise' or "
                     "'auto'")
  mask = None
  if segment_ids_BxT is not None:
    mask = (segment_ids_BxT[:, None, :, None] == kv_segment_ids_BxS[:, None, None, :])
  if offset or return_lse:  # causal by position, the queries' starting at q_offset
    distance_TxS = q_offset + jnp.arange(T)[:, None] - jnp.arange(S)[None, :]
    visible_TxS = (distance_TxS >= 0) & ((distance_TxS < window) if window else True)
    mask = visible_TxS if mask is None else mask & visible_TxS
    if return_lse:
      return _reference_with_lse(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask)
    # A query that sees no key (q_offset < 0) gets 0, as from "blockwise", not the mean of
    # the values that jax's masked softmax gives.
    sees = mask.any(-1)  # [T], or [B, 1, T] with segment ids
    sees_BxTx1x1 = sees[None, :, None, None] if mask.ndim == 2 else sees[:, 0, :, None, None]
    out = jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask,
                                       implementation=implementation)
    return jnp.where(sees_BxTx1x1, out, jnp.zeros((), out.dtype))
  # jax's (left, right) local window counts the keys besides the query's own.
  return jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask,
                                     is_causal=True,
                                     local_window_size=(window - 1, 0) if window else None,
                                     implementation=implementation)


def _reference_with_lse(q_BxTxHxE: Array, k_BxSxKxE: Array, v_BxSxKxE: Array,
                        mask: Array) -> tuple[Array, Array]:
  """"xla"'s attention (float32) and log-sum-exp in plain JAX, the scores materialised;
  `mask` is [T, S] or [B, 1, T, S]. A query that sees no key gets 0 and -inf (no NaN, nor in
  the gradient)."""
  B, T, H, E = q_BxTxHxE.shape
  K = k_BxSxKxE.shape[2]
  f32 = jnp.float32
  s_BxKxGxTxS = jnp.einsum("btkge,bske->bkgts", _grouped(q_BxTxHxE, K), k_BxSxKxE,
                           preferred_element_type=f32) / math.sqrt(E)
  visible = mask if mask.ndim == 2 else mask[:, :, None]
  s_BxKxGxTxS = jnp.where(visible, s_BxKxGxTxS, -jnp.inf)
  m_BxKxGxT = jax.lax.stop_gradient(s_BxKxGxTxS.max(axis=-1))
  m_BxKxGxT = jnp.where(m_BxKxGxT == -jnp.inf, 0.0, m_BxKxGxT)
  p_BxKxGxTxS = jnp.where(visible, jnp.exp(s_BxKxGxTxS - m_BxKxGxT[..., None]), 0.0)
  l_BxKxGxT = p_BxKxGxTxS.sum(axis=-1)
  sees_nothing = l_BxKxGxT == 0
  l_BxKxGxT = jnp.where(sees_nothing, 1.0, l_BxKxGxT)
  out_BxTxKxGxE = jnp.einsum("bkgts,bske->btkge", p_BxKxGxTxS / l_BxKxGxT[..., None],
                             v_BxSxKxE.astype(f32))
  lse_BxKxGxT = jnp.where(sees_nothing, -jnp.inf, m_BxKxGxT + jnp.log(l_BxKxGxT))
  return (out_BxTxKxGxE.reshape(B, T, H, E),
          jnp.einsum("bkgt->btkg", lse_BxKxGxT).reshape(B, T, H))


def _dividing_block(T: int, block: int) -> int:
  """The largest tile length up to `block` that divides T: a part of the sequence is
  whole blocks of it, so that block indices count positions."""
  return max(d for d in range(1, min(block, T) + 1) if T % d == 0)


def _resolve_auto(q_BxTxHxE: Array, k_BxTxKxE: Array, window: int) -> str:
  if jax.default_backend() != "gpu":
    return "blockwise"
  reason = _cudnn_refusal(q_BxTxHxE.shape, k_BxTxKxE.shape, jnp.dtype(q_BxTxHxE.dtype), window)
  return "blockwise" if reason else "cudnn"


@functools.lru_cache(maxsize=None)
def _cudnn_refusal(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype,
                   window: int = 0) -> str | None:
  """Why cuDNN flash attention cannot take these inputs (None if it can); logged once."""
  if dtype not in (jnp.float16, jnp.bfloat16):
    reason = f"it needs float16 or bfloat16 inputs, not {dtype}"
  else:
    # jax checks cuDNN's constraints while tracing: trace it abstractly.
    cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                              local_window_size=(window - 1, 0) if window else None,
                              implementation="cudnn")
    q, kv = jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype)
    try:
      jax.eval_shape(cudnn, q, kv, kv)
      return None
    except (NotImplementedError, ValueError, RuntimeError, TypeError) as e:
      reason = f"{type(e).__name__}: {e}"
  log.warning("attention 'auto': using 'blockwise', not cuDNN flash attention, for queries "
              "%s and keys %s of %s (window %d): %s", q_shape, kv_shape, dtype, window, reason)
  return reason


# -----------------------------------------------------------------------------
# "blockwise": FlashAttention-2 in plain JAX.
#
# Shapes inside: N blocks of C positions; queries grouped as [.., K, G, E]
# with G = H / K query heads per key/value head. A window W > 0 skips the key
# blocks wholly outside it, as causality skips the later ones.
#
# A custom_vjp is needed: differentiating through the loops would make JAX
# save every iteration's probabilities and softmax carries for the backward
# pass, i.e. the full T×T scores again. The forward saves only q, k, v, the
# output and the per-row logsumexp; the backward recomputes each tile's
# probabilities from those.


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q_BxTxHxE: Array, k_BxSxKxE: Array, v_BxSxKxE: Array, seg_BxT: Array | None,
           seg_BxS: Array | None, q_block0: Array | int, block: int, window: int,
           part: bool) -> tuple[Array, Array]:
  """Blockwise attention of queries whose first block is key block `q_block0`, and its
  log-sum-exp [B, T, H]. A `part`, to be merged with others, is float32."""
  out_BxTxHxE, lse_NxBxKxGxC = _flash_forward(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, seg_BxT,
                                              seg_BxS, q_block0, block, window, part)
  return out_BxTxHxE, _lse_rows(lse_NxBxKxGxC, q_BxTxHxE.shape)


def _flash_fwd(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, seg_BxT, seg_BxS, q_block0, block, window,
               part):
  out_BxTxHxE, lse_NxBxKxGxC = _flash_forward(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, seg_BxT,
                                              seg_BxS, q_block0, block, window, part)
  # Named like the output, so that a remat policy saving "attention" keeps
  # these residuals instead of rerunning the whole forward in the backward. A part's
  # are recomputed: merged, the parts give that output once.
  name = "attention_part" if part else "attention"
  lse_NxBxKxGxC = checkpoint_name(lse_NxBxKxGxC, name)
  out_BxTxHxE = checkpoint_name(out_BxTxHxE, name)
  return ((out_BxTxHxE, _lse_rows(lse_NxBxKxGxC, q_BxTxHxE.shape)),
          (q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, seg_BxT, seg_BxS, q_block0, out_BxTxHxE,
           lse_NxBxKxGxC))


def _lse_rows(lse_NxBxKxGxC: Array, q_shape: tuple[int, ...]) -> Array:
  """The kernel's log-sum-exp by blocks as [B, T, H], each query's."""
  B, T, H, _ = q_shape
  return _unblock(jnp.einsum("nbkgq->nbqkg", lse_NxBxKxGxC), T).reshape(B, T, H)


def _blocks(x_BxTxS: Array, block: int) -> Array:
  """[B, T, ...] -> [N, B, C, ...], zero-padding T up to N * C."""
  B, T = x_BxTxS.shape[:2]
  n = -(-T // block)
  x_BxTxS = jnp.pad(x_BxTxS, [(0, 0), (0, n * block - T)] + [(0, 0)] * (x_BxTxS.ndim - 2))
  return jnp.moveaxis(x_BxTxS.reshape(B, n, block, *x_BxTxS.shape[2:]), 1, 0)


def _unblock(x_NxBxCxS: Array, T: int) -> Array:
  """[N, B, C, ...] -> [B, T, ...]: the inverse of `_blocks`."""
  n, B, C = x_NxBxCxS.shape[:3]
  return jnp.moveaxis(x_NxBxCxS, 0, 1).reshape(B, n * C, *x_NxBxCxS.shape[3:])[:, :T]


def _visible_CxC(i: Array, j: Array, block: int, window: int) -> Array:
  """Query block i may see key block j's position c from its row r: 0 <= i*C + r - (j*C + c),
  and, with a window, that distance < W."""
  r_C, c_C = jnp.arange(block), jnp.arange(block)
  distance_CxC = (i - j) * block + r_C[:, None] - c_C[None, :]
  visible_CxC = distance_CxC >= 0
  return visible_CxC & (distance_CxC < window) if window else visible_CxC


def _visible(i: Array, j: Array, block: int, window: int, seg_q_BxC: Array | None,
             seg_k_BxC: Array | None) -> Array:
  """`_visible_CxC` (i the query block's position among the key blocks), and with segment
  ids only within a segment: [C, C] or [B, 1, 1, C, C] (to mask scores [B, K, G, C, C])."""
  visible_CxC = _visible_CxC(i, j, block, window)
  if seg_q_BxC is None:
    return visible_CxC
  same_BxCxC = seg_q_BxC[:, :, None] == seg_k_BxC[:, None, :]
  return (visible_CxC & same_BxCxC)[:, None, None]


def _first_key_block(i: Array, block: int, window: int) -> Array:
  """The first key block that query block i's first row sees (0 without a window)."""
  return jnp.maximum(0, (i * block - window + 1) // block) if window else 0


def _last_query_block(j: Array, block: int, window: int) -> Array:
  """The last query block (counted from key block 0) that a window of W > 0 lets see key
  block j (without a window every later one sees it)."""
  return ((j + 1) * block + window - 2) // block


def _grouped(q_BxTxHxE: Array, K: int) -> Array:
  B, T, H, E = q_BxTxHxE.shape
  return q_BxTxHxE.reshape(B, T, K, H // K, E)


def _segment_blocks(seg_BxT: Array | None, block: int) -> Array | None:
  """Segment ids [N, B, C] (None without); positions past T get -1, a segment of their own."""
  if seg_BxT is None:
    return None
  return _blocks(seg_BxT[..., None] + 1, block)[..., 0] - 1


def _flash_forward(q_BxTxHxE: Array, k_BxSxKxE: Array, v_BxSxKxE: Array,
                   seg_BxT: Array | None, seg_BxS: Array | None, q_block0: Array | int,
                   block: int, window: int, part: bool = False) -> tuple[Array, Array]:
  """Online softmax over key blocks 0..q_block0 + i for each query block i (later ones are
  masked; with a window, from the first block the window reaches; none where q_block0 + i
  is negative). A row that sees no key gets 0, and -inf for its log-sum-exp. A `part`'s
  output is float32, else in the dtype of q."""
  out_dtype = jnp.float32 if part else q_BxTxHxE.dtype
  B, T, H, E = q_BxTxHxE.shape
  K = k_BxSxKxE.shape[2]
  G, scale = H // K, 1.0 / math.sqrt(E)
  q_NxBxCxKxGxE = _blocks(_grouped(q_BxTxHxE, K), block)
  k_MxBxCxKxE, v_MxBxCxKxE = _blocks(k_BxSxKxE, block), _blocks(v_BxSxKxE, block)
  (n, m), f32 = (q_NxBxCxKxGxE.shape[0], k_MxBxCxKxE.shape[0]), jnp.float32
  seg_NxBxC, seg_MxBxC = _segment_blocks(seg_BxT, block), _segment_blocks(seg_BxS, block)
  # A row may see nothing of a key block (outside its window or its segment).
  may_see_nothing = bool(window) or seg_BxT is not None

  def query_block(args):
    i, q_BxCxKxGxE = args
    at = q_block0 + i  # the query block's place among the key blocks

    def key_block(j, carry):
      o_BxKxGxCxE, m_BxKxGxC, l_BxKxGxC = carry
      s_BxKxGxCxC = scale * jnp.einsum("bqkge,bske->bkgqs", q_BxCxKxGxE, k_MxBxCxKxE[j],
                                       preferred_element_type=f32)
      visible = _visible(at, j, block, window, None if seg_NxBxC is None else seg_NxBxC[i],
                         None if seg_MxBxC is None else seg_MxBxC[j])
      s_BxKxGxCxC = jnp.where(visible, s_BxKxGxCxC, -jnp.inf)
      # Without a window or segments key 0 (block 0) is visible to every query: the max
      # is finite from j = 0 on.
      m_new_BxKxGxC = jnp.maximum(m_BxKxGxC, s_BxKxGxCxC.max(axis=-1))
      # With a window or segments a row may see nothing of its first blocks (max -inf):
      # it then shifts by 0, so that exp gives 0, not NaN, until it sees a key.
      shift_BxKxGxC = (jnp.where(m_new_BxKxGxC == -jnp.inf, 0.0, m_new_BxKxGxC)
                       if may_see_nothing else m_new_BxKxGxC)
      p_BxKxGxCxC = jnp.exp(s_BxKxGxCxC - shift_BxKxGxC[..., None])
      rescale_BxKxGxC = jnp.exp(m_BxKxGxC - shift_BxKxGxC)
      l_BxKxGxC = l_BxKxGxC * rescale_BxKxGxC + p_BxKxGxCxC.sum(axis=-1)
      pv_BxKxGxCxE = jnp.einsum("bkgqs,bske->bkgqe", p_BxKxGxCxC.astype(v_MxBxCxKxE.dtype),
                                v_MxBxCxKxE[j], preferred_element_type=f32)
      return o_BxKxGxCxE * rescale_BxKxGxC[..., None] + pv_BxKxGxCxE, m_new_BxKxGxC, l_BxKxGxC

    init = (jnp.zeros((B, K, G, block, E), f32), jnp.full((B, K, G, block), -jnp.inf, f32),
            jnp.zeros((B, K, G, block), f32))
    o_BxKxGxCxE, m_BxKxGxC, l_BxKxGxC = jax.lax.fori_loop(
        _first_key_block(at, block, window), jnp.minimum(at + 1, m), key_block, init)
    seen_BxKxGxC = jnp.where(l_BxKxGxC == 0, 1.0, l_BxKxGxC)  # (o is 0 where l is)
    out_BxCxKxGxE = jnp.einsum("bkgqe->bqkge", o_BxKxGxCxE / seen_BxKxGxC[..., None])
    return out_BxCxKxGxE.astype(out_dtype), m_BxKxGxC + jnp.log(l_BxKxGxC)

  out_NxBxCxKxGxE, lse_NxBxKxGxC = jax.lax.map(query_block, (jnp.arange(n), q_NxBxCxKxGxE))
  return _unblock(out_NxBxCxKxGxE, T).reshape(B, T, H, E), lse_NxBxKxGxC


def _flash_bwd(block, window, part, residuals, cotangents):
  """FlashAttention-2's backward: for each key block j, the query blocks that see it (from
  block j on; with a window, up to the last that sees block j). The log-sum-exp's
  cotangent adds to each score's: d lse / d s = p."""
  del part
  dout_BxTxHxE, dlse_BxTxH = cotangents
  q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, seg_BxT, seg_BxS, q_block0, out_BxTxHxE, lse_NxBxKxGxC = (
      residuals)
  seg_NxBxC, seg_MxBxC = _segment_blocks(seg_BxT, block), _segment_blocks(seg_BxS, block)
  B, T, H, E = q_BxTxHxE.shape
  S, K = k_BxSxKxE.shape[1:3]
  scale, f32 = 1.0 / math.sqrt(E), jnp.float32
  q_NxBxCxKxGxE = _blocks(_grouped(q_BxTxHxE, K), block)
  do_NxBxCxKxGxE = _blocks(_grouped(dout_BxTxHxE.astype(q_BxTxHxE.dtype), K), block)
  # delta = rowsum(dO * O), the softmax Jacobian's correction term.
  delta_BxTxKxG = jnp.einsum("btkge,btkge->btkg", _grouped(dout_BxTxHxE, K).astype(f32),
                             _grouped(out_BxTxHxE, K).astype(f32))
  # (A row that sees no key has lse -inf and no gradient, whatever its cotangent.)
  lse_BxTxH = _lse_rows(lse_NxBxKxGxC, q_BxTxHxE.shape)
  dlse_BxTxH = jnp.where(lse_BxTxH == -jnp.inf, 0.0, dlse_BxTxH.astype(f32))
  delta_BxTxKxG = delta_BxTxKxG - dlse_BxTxH.reshape(delta_BxTxKxG.shape)
  delta_NxBxKxGxC = jnp.einsum("nbqkg->nbkgq", _blocks(delta_BxTxKxG, block))
  k_MxBxCxKxE, v_MxBxCxKxE = _blocks(k_BxSxKxE, block), _blocks(v_BxSxKxE, block)
  n, m = q_NxBxCxKxGxE.shape[0], k_MxBxCxKxE.shape[0]

  def key_block(dq_NxBxCxKxGxE, args):
    j, k_BxCxKxE, v_BxCxKxE = args

    def query_block(i, carry):
      dk_BxCxKxE, dv_BxCxKxE, dq_NxBxCxKxGxE = carry
      q_BxCxKxGxE, do_BxCxKxGxE = q_NxBxCxKxGxE[i], do_NxBxCxKxGxE[i]
      s_BxKxGxCxC = scale * jnp.einsum("bqkge,bske->bkgqs", q_BxCxKxGxE, k_BxCxKxE,
                                       preferred_element_type=f32)
      visible = _visible(q_block0 + i, j, block, window,
                         None if seg_NxBxC is None else seg_NxBxC[i],
                         None if seg_MxBxC is None else seg_MxBxC[j])
      p_BxKxGxCxC = jnp.where(visible, jnp.exp(s_BxKxGxCxC - lse_NxBxKxGxC[i][..., None]), 0.0)
      dv_BxCxKxE += jnp.einsum("bkgqs,bqkge->bske", p_BxKxGxCxC.astype(do_BxCxKxGxE.dtype),
                               do_BxCxKxGxE, preferred_element_type=f32)
      dp_BxKxGxCxC = jnp.einsum("bqkge,bske->bkgqs", do_BxCxKxGxE, v_BxCxKxE,
                                preferred_element_type=f32)
      ds_BxKxGxCxC = (scale * p_BxKxGxCxC * (dp_BxKxGxCxC - delta_NxBxKxGxC[i][..., None])
                      ).astype(q_BxCxKxGxE.dtype)
      dk_BxCxKxE += jnp.einsum("bkgqs,bqkge->bske", ds_BxKxGxCxC, q_BxCxKxGxE,
                               preferred_element_type=f32)
      dq_BxCxKxGxE = jnp.einsum("bkgqs,bske->bqkge", ds_BxKxGxCxC, k_BxCxKxE,
                                preferred_element_type=f32)
      return dk_BxCxKxE, dv_BxCxKxE, dq_NxBxCxKxGxE.at[i].add(dq_BxCxKxGxE)

    zeros = jnp.zeros((B, block, K, E), f32)
    # This device's query blocks that see key block j (none: its gradient here is 0).
    first = jnp.maximum(j - q_block0, 0)
    last = (jnp.minimum(n - 1, _last_query_block(j, block, window) - q_block0)
            if window else n - 1)
    dk_BxCxKxE, dv_BxCxKxE, dq_NxBxCxKxGxE = jax.lax.fori_loop(
        first, last + 1, query_block, (zeros, zeros, dq_NxBxCxKxGxE))
    return dq_NxBxCxKxGxE, (dk_BxCxKxE, dv_BxCxKxE)

  dq_NxBxCxKxGxE, (dk_MxBxCxKxE, dv_MxBxCxKxE) = jax.lax.scan(
      key_block, jnp.zeros(q_NxBxCxKxGxE.shape, f32),
      (jnp.arange(m), k_MxBxCxKxE, v_MxBxCxKxE))
  dq_BxTxHxE = _unblock(dq_NxBxCxKxGxE, T).reshape(B, T, H, E).astype(q_BxTxHxE.dtype)
  return (dq_BxTxHxE, _unblock(dk_MxBxCxKxE, S).astype(k_BxSxKxE.dtype),
          _unblock(dv_MxBxCxKxE, S).astype(v_BxSxKxE.dtype), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
