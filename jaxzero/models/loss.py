"""Next-token cross-entropy that never holds all the [B, T, V] float32 logits.

`cross_entropy` maps over chunks of the vocabulary: each chunk's logits [B, T, C] are reduced to
a logsumexp per position (and the label's logit) and dropped, and each chunk is
rematerialised, so the backward pass also builds one chunk's logits at a time. Chunk k takes
entries k, k + n, ..., so a head split over devices along the vocabulary in contiguous blocks
keeps its own slice of every chunk and no device builds a chunk's full logits.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy(x_BxTxD: Array, head_DxV: Array, labels_BxT: Array, *, chunk: int,
                  shard: Callable[[Array, tuple], Array] | None = None,
                  weights_BxT: Array | None = None,
                  low_rank: tuple[Array, Array] | None = None) -> Array:
  """Mean over B×T of -log softmax(x @ head)[label], `chunk` vocabulary entries at a time
  (with `weights_BxT`, the weighted mean: 0 leaves a position out, e.g. a prompt's
  tokens in supervised fine-tuning).

  Args:
    x_BxTxD: final hidden states (Llama.hidden).
    head_DxV: the output projection (Llama.head_DxV).
    labels_BxT: int target token ids in [0, V).
    chunk: the most vocabulary entries per chunk; chunks are made equal, so
      V = 128256 with chunk 8192 gives 16 chunks of 8016 and no padding.
    shard: the model's activation hook, called on each chunk's logits.
    low_rank: (xa [B, T, r], b [r, V]) adding ``xa @ b`` to the logits (a LoRA head's
      ``x @ A @ B`` with A applied and the scale in xa), chunked as the head is: the
      [D, V] head never changes.

  Returns:
    The float32 scalar mean loss.
  """
  shard = shard or (lambda a, _logical_axes: a)
  D, V = head_DxV.shape
  C = -(-V // -(-V // chunk))  # equal chunks of at most `chunk`
  n = -(-V // C)  # the last chunk holds at least one real column
  # Column v = c * n + k is entry c of chunk k.
  by_chunk = lambda w_XxV: jnp.moveaxis(jnp.pad(w_XxV, ((0, 0), (0, n * C - V))).reshape(
      w_XxV.shape[0], C, n), 2, 0)
  head_NxDxC = by_chunk(head_DxV)
  xa_BxTxR, b_NxRxC = (None, None) if low_rank is None else (low_rank[0], by_chunk(low_rank[1]))
  # As x's: the gradient wrt xa sums over the chunks, carried in float32.
  xa32_BxTxR = None if xa_BxTxR is None else xa_BxTxR.astype(jnp.float32)
  # The gradient wrt x sums over the chunks: carry it in float32, rounded once.
  x32_BxTxD = x_BxTxD.astype(jnp.float32)

  # Saves nothing but its inputs: the backward recomputes this chunk's logits.
  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  def chunk_stats(head_DxC, k, b_RxC=None):
    # In the compute dtype, then widened, as a bf16 lm_head does in PyTorch: the
    # gradients then leave the matmul (and are reduced across devices) in it too.
    logits_BxTxC = jnp.einsum("btd,dc->btc", x32_BxTxD.astype(x_BxTxD.dtype), head_DxC)
    if b_RxC is not None:
      logits_BxTxC = logits_BxTxC + jnp.einsum("btr,rc->btc", xa32_BxTxR.astype(xa_BxTxR.dtype),
                                               b_RxC.astype(xa_BxTxR.dtype))
    logits_BxTxC = shard(logits_BxTxC.astype(jnp.float32), ("batch", "seq", "vocab"))
    columns_C = jnp.arange(C) * n + k
    logits_BxTxC = jnp.where(columns_C < V, logits_BxTxC, -jnp.inf)  # padding
    label_logit_BxT = jnp.take_along_axis(logits_BxTxC, (labels_BxT // n)[..., None],
                                          axis=-1)[..., 0]
    return (jax.nn.logsumexp(logits_BxTxC, axis=-1),
            jnp.where(labels_BxT % n == k, label_logit_BxT, 0.0))

  chunks = (head_NxDxC, jnp.arange(n)) + (() if b_NxRxC is None else (b_NxRxC,))
  lse_NxBxT, label_logit_NxBxT = jax.lax.map(lambda a: chunk_stats(*a), chunks)
  nll_BxT = jax.nn.logsumexp(lse_NxBxT, axis=0) - label_logit_NxBxT.sum(axis=0)
  if weights_BxT is None:
    return jnp.mean(nll_BxT)
  weights_BxT = weights_BxT.astype(jnp.float32)
  # (A batch with no weighted position has loss 0, and no gradient; weights summing
  # below 1 still give their weighted mean.)
  total = jnp.sum(weights_BxT)
  return jnp.where(total > 0, jnp.sum(weights_BxT * nll_BxT) / jnp.where(total > 0, total, 1.0),
                   0.0)
