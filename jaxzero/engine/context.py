"""Context parallelism: attention on each device's part of the sequence.

A sequence of T positions lies over the C devices of ``context`` in parts of T / C.
Load balanced (the default), it is cut into 2C chunks of L = T / 2C and device c holds
chunks c and 2C - 1 - c (MaxText's and ring-flash-attention's zigzag): under a causal
mask every device then does the same work. The model lays its inputs, targets and
positions out in that order (:func:`sequence_order`); a mean loss does not change.

Two strategies, both exact:
- ``all_gather``: each device gathers every key and value and attends its queries to them.
- ``ring``: the key/value parts circulate round ``context`` by ``ppermute``, C - 1 hops,
  each device attending its queries to the part in hand and merging the partial results
  by their log-sum-exp (online softmax). XLA may overlap a hop with the attention to the
  part in hand (on GPU the collective-permutes are asynchronous). The backward pass is the
  forward's gradient: the keys' and values' gradients travel the ring back the other way
  (ppermute's transpose); each hop's attention is recomputed from the part it had and
  the merged result before it, so that no hop's partial results are kept.

Both run inside a ``shard_map`` (jaxzero.engine.hooks.LayoutHooks.context), where
``axis_index(context)`` says which part a device holds.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config.mesh_checks import ATTENTION_TILE, CONTEXT_TILE, context_fits
from jaxzero.errors import ConfigError
from jaxzero.parallel.mesh import CONTEXT


def check_sequence(T: int, C: int, balanced: bool) -> None:
  """ConfigError (one line, naming the lengths that fit) where ``context`` of C devices
  cannot cut a sequence of T positions into equal pieces attention tiles whole: at most
  ATTENTION_TILE positions, or a multiple of CONTEXT_TILE (else its tiles would be as
  small as the piece's largest divisor). jaxzero.train's config checks train.seq_len
  likewise; here a model of one's own's sequences are checked as they are traced."""
  if context_fits(T, C, balanced):
    return
  chunks = C * (2 if balanced else 1)
  first = -(-T // chunks) * chunks
  fits = [t for t in range(first, first + chunks * CONTEXT_TILE + 1, chunks)
          if context_fits(t, C, balanced)][:1]
  raise ConfigError(
      f"a sequence of {T} positions over context={C}: attention cuts it into {chunks} equal "
      f"pieces{' (2 a device: load-balanced)' if balanced else ''} of at most "
      f"{ATTENTION_TILE} positions or a multiple of {CONTEXT_TILE}; give sequences of such a "
      f"length (the next is {fits[0]})"
      + (", or jaxzero.Context(load_balance=False)" if balanced else ""))


def sequence_order(T: int, C: int, balanced: bool) -> np.ndarray | None:
  """The positions of a sequence of T, in the order the devices of ``context`` hold them
  (device c's part is entries c*T/C .. (c+1)*T/C - 1); None for 0..T-1 (unbalanced)."""
  if C == 1 or not balanced:
    return None
  check_sequence(T, C, balanced)
  L = T // (2 * C)
  chunks = [chunk for d in range(C) for chunk in (d, 2 * C - 1 - d)]
  return np.concatenate([np.arange(chunk * L, (chunk + 1) * L) for chunk in chunks])


def _parts(x: jax.Array | None, device, C: int, balanced: bool) -> list:
  """Device `device`'s part of the sequence (axis 1) as (piece, position of its first
  entry) pairs: two chunks when balanced, else one (pieces None where `x` is)."""
  if x is None:
    return [(None, None)] * (2 if balanced else 1)
  T = x.shape[1]
  if not balanced:
    return [(x, device * T)]
  L = T // 2
  return [(x[:, :L], device * L), (x[:, L:], (2 * C - 1 - device) * L)]


def _in_position_order(x: jax.Array, C: int) -> jax.Array:
  """Parts gathered from devices 0..C-1 (each two chunks, balanced) -> positions 0..T-1."""
  B, T = x.shape[:2]
  chunks = x.reshape(B, C, 2, T // (2 * C), *x.shape[2:])
  first, second = chunks[:, :, 0], chunks[:, ::-1, 1]  # chunks 0..C-1, then C..2C-1
  return jnp.concatenate([first, second], axis=1).reshape(x.shape)


def all_gather_attention(attend: Callable, q, k, v, segment_ids, *, C: int,
                         balanced: bool) -> jax.Array:
  """This device's queries attended to every key and value, gathered over ``context``."""
  def gather(x):
    x = jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)
    return _in_position_order(x, C) if balanced else x

  device = jax.lax.axis_index(CONTEXT)
  k_all, v_all = gather(k), gather(v)
  seg_all = None if segment_ids is None else gather(segment_ids)
  outs = [attend(q_part, k_all, v_all, segment_ids_BxT=seg_part, kv_segment_ids_BxS=seg_all,
                 q_offset=offset)
          for (q_part, offset), (seg_part, _) in zip(_parts(q, device, C, balanced),
                                                     _parts(segment_ids, device, C, balanced))]
  return jnp.concatenate(outs, axis=1)


def _merge(a, b):
  """Two partial attentions (output, log-sum-exp) over disjoint keys -> over both. `a`'s
  log-sum-exp is finite (every query has seen a key); a row of `b` that sees no key
  (-inf) takes weight 0. (Both -inf would make the gradient NaN.)"""
  (o1, l1), (o2, l2) = a, b
  lse = jnp.logaddexp(l1, l2)
  finite = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w1, w2 = jnp.exp(l1 - finite)[..., None], jnp.exp(l2 - finite)[..., None]
  return o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2, lse


def ring_attention(attend: Callable, q, k, v, segment_ids, *, C: int,
                   balanced: bool) -> jax.Array:
  """This device's queries attended to the key/value parts as they come round the ring."""
  device = jax.lax.axis_index(CONTEXT)
  ring = [(d, (d + 1) % C) for d in range(C)]
  q_parts = _parts(q, device, C, balanced)
  q_segs = _parts(segment_ids, device, C, balanced)

  def attend_part(merged, in_hand, hop):
    """`merged` with the attention to the part in hand (device `device - hop`'s). At hop
    0 (`merged` None) each query part starts with its own chunk, where every query sees
    at least itself: a merged log-sum-exp is then never -inf."""
    source = (device - hop) % C
    k_hand, v_hand, *seg_hand = in_hand  # (the segment ids travel where there are some)
    pairs = list(zip(*(_parts(x, source, C, balanced)
                       for x in (k_hand, v_hand, seg_hand[0] if seg_hand else None))))
    first = merged is None
    merged = [None] * len(q_parts) if first else list(merged)
    for i, ((q_part, q_at), (q_seg, _)) in enumerate(zip(q_parts, q_segs)):
      for (k_part, k_at), (v_part, _), (kv_seg, _) in (
          [pairs[i]] + pairs[:i] + pairs[i + 1:] if first else pairs):
        o, lse = attend(q_part, k_part, v_part, segment_ids_BxT=q_seg,
                        kv_segment_ids_BxS=kv_seg, q_offset=q_at - k_at, return_lse=True)
        merged[i] = ((o.astype(jnp.float32), lse) if merged[i] is None
                     else _merge(merged[i], (o, lse)))
    return merged

  # Each hop's partial attentions are recomputed in the backward pass from what the hop
  # started with (the part in hand, and one float32 result for this device's queries):
  # kept, they and their merges would be several such results a hop.
  attend_part = jax.checkpoint(attend_part)
  pass_on = lambda in_hand: tuple(jax.lax.ppermute(x, CONTEXT, ring) for x in in_hand)

  def hop(carry, n):
    # Passing the part on does not wait for attending to it: XLA may overlap the two.
    merged, in_hand = carry
    return (attend_part(merged, in_hand, n), pass_on(in_hand)), None

  in_hand = (k, v) if segment_ids is None else (k, v, segment_ids)
  carry = (attend_part(None, in_hand, 0), pass_on(in_hand))
  # A loop, not C - 2 copies of the hop: the program does not grow with C.
  (merged, in_hand), _ = jax.lax.scan(hop, carry, jnp.arange(1, C - 1))
  merged = attend_part(merged, in_hand, C - 1)
  return jnp.concatenate([o.astype(q.dtype) for o, _ in merged], axis=1)


ATTENTION = {"all_gather": all_gather_attention, "ring": ring_attention}
