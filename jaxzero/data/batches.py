"""Batches addressed by step: seeded windows over a token stream, as global arrays.

Batches are windows of ``seq_len + 1`` tokens over a stream from
jaxzero.data.tokens, addressed by ``(seed, step)``: the batch of step ``s`` is the
same whatever the mesh, the process count or whether the run was resumed, so
the data position is just the step number. The stdlib corpus keeps its random
windows; file sources visit non-overlapping windows in a seeded order that
changes every epoch, so each token is a target once per epoch.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxzero.errors import DataError


class Batches:
  """Batches of shape [grad_accum, global_micro_batch, seq_len + 1], by step.

  ``order="random"``: each row is a window at a random offset drawn from
  ``(seed, step)``. ``order="epochs"``: sample ``i`` of the run (counting rows
  over steps) is window ``permutation_e(i mod n)`` of the ``n`` windows that
  tile the stream (consecutive windows share one token, so every token is a
  target once), with ``e = i // n`` the epoch and a fresh seeded permutation
  per epoch.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, grad_accum: int, micro_batch: int,
               seed: int, order: str = "random"):
    if tokens.size < seq_len + 2:
      raise DataError(f"corpus has {tokens.size} tokens, fewer than train.seq_len+2="
                      f"{seq_len + 2}")
    if order not in ("random", "epochs"):
      raise ValueError(f"order={order!r}; use 'random' or 'epochs'")
    self.tokens = tokens
    self.shape = (grad_accum, micro_batch, seq_len + 1)
    self.seed = seed
    self.order = order
    self.n_windows = (tokens.size - 1) // seq_len

  @property
  def rows_per_epoch(self) -> float:
    """Windows of seq_len + 1 tokens that cover the stream once."""
    return (self.tokens.size - 1) / (self.shape[2] - 1)

  def __call__(self, step: int, rows: slice = slice(None)) -> np.ndarray:
    """Batch for `step`; `rows` selects this process's share of the micro-batch."""
    starts = self._random_starts(step, rows) if self.order == "random" else \
        self._epoch_starts(step, rows)
    return np.asarray(self.tokens[starts[..., None] + np.arange(self.shape[2])], np.int32)

  def _random_starts(self, step: int, rows: slice) -> np.ndarray:
    rng = np.random.default_rng([self.seed, step])
    accum, batch, window = self.shape
    return rng.integers(0, self.tokens.size - window, size=(accum, batch))[:, rows]

  def _epoch_starts(self, step: int, rows: slice) -> np.ndarray:
    accum, batch, window = self.shape
    return epoch_order(step, accum, batch, rows, self.n_windows, self.seed) * (window - 1)


def epoch_order(step: int, accum: int, batch: int, rows: slice, n: int, seed: int
                ) -> np.ndarray:
  """Which of `n` items each row of `step`'s [accum, batch] batch holds (the `rows`
  slice of it): sample ``i`` of the run is item ``permutation_e(i mod n)``, ``e = i //
  n`` its epoch, with a fresh seeded permutation per epoch."""
  sample = (step * accum + np.arange(accum)[:, None]) * batch + np.arange(batch)[rows]
  epoch, position = np.divmod(sample, n)
  items = np.empty_like(position)
  for e in np.unique(epoch):  # a step straddles at most two epochs
    here = epoch == e
    items[here] = permute(position[here], n, (seed, int(e)))
  return items


def fixed_order(n_batches: int, batch: int, rows: slice, n: int) -> np.ndarray:
  """Items of fixed [n_batches, batch] batches (the `rows` slice of each): the first
  ``n_batches x batch`` items in order, from the start again if there are fewer."""
  return (np.arange(n_batches)[:, None] * batch + np.arange(batch)[rows]) % n


def global_batch(batches, sharding: jax.sharding.NamedSharding, step: int):
  """The batch of `step` (an array, or a dict of arrays of one shape) as global arrays
  laid out by `sharding`.

  Each process reads and supplies only the rows of the micro-batch axis (axis
  1) that its own devices hold.
  """
  shape = batches.shape
  index_map = sharding.addressable_devices_indices_map(shape)
  starts = [idx[1].start or 0 for idx in index_map.values()]
  stops = [idx[1].stop or shape[1] for idx in index_map.values()]
  local = batches(step, slice(min(starts), max(stops)))
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x, shape), local)


def permute(index: np.ndarray, n: int, key: tuple[int, ...]) -> np.ndarray:
  """A seeded permutation of ``range(n)``, evaluated at `index` without a table.

  A 4-round Feistel network is a bijection on ``[0, 4**h)`` for any round
  function; cycle-walking (re-applying it until the value is below ``n``)
  restricts it to ``[0, n)``. Memory is O(len(index)), whatever ``n``: a
  15T-token corpus has billions of windows.
  """
  half = max(1, ((n - 1).bit_length() + 1) // 2)
  mask = np.uint64((1 << half) - 1)
  keys = np.random.default_rng(list(key)).integers(0, 1 << 63, size=4, dtype=np.uint64)

  def feistel(x: np.ndarray) -> np.ndarray:
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
      left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << np.uint64(half)) | right

  out = feistel(np.asarray(index, np.uint64))
  outside = out >= n
  while outside.any():
    out[outside] = feistel(out[outside])
    outside = out >= n
  return out.astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: a well-mixed 64-bit hash (uint64 arithmetic wraps)."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))
