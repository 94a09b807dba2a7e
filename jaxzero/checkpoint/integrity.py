"""Checksums of the train state, computed on the devices where the shards live.

A checkpoint records one 32-bit checksum per state leaf, the sum over its elements of
fmix32(bits(x[i]) XOR (i * 0x9E3779B9)) with ``i`` the global flat index; a restore recomputes
and compares it. A sum does not depend on its order, so each device adds up the shards it holds
and the checksum does not depend on the sharding: a checkpoint written by one mesh and stage
verifies after it is read into another. A leaf stored padded (jaxzero.parallel.padding) is
summed over its true shape only, with that shape's positions: its checksum is the unpadded
leaf's, whatever padding a mesh gave it. The same pass reports whether each floating leaf is
finite.
"""

from __future__ import annotations

import collections
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxzero.parallel import mesh as mesh_lib

# Recorded with the checksums: a checkpoint whose checksums were made another
# way is not compared against these.
ALGORITHM = "fmix32-position-sum-v2"

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def bits(x: jax.Array) -> jax.Array:
  """`x`'s bit patterns, as unsigned integers of its width (a bitcast: free)."""
  if jnp.dtype(x.dtype).itemsize not in _UINT_OF_SIZE:
    raise ValueError(f"no unsigned integer as wide as {x.dtype}")
  return jax.lax.bitcast_convert_type(x, _UINT_OF_SIZE[jnp.dtype(x.dtype).itemsize])


def _fmix32(x: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: every input bit affects every output bit."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _leaf_checksum(x: jax.Array, offsets=None, leaf_shape=None, true_shape=None) -> jax.Array:
  """A uint32 checksum of `x` that does not depend on its sharding (see above).

  With `offsets` and `leaf_shape`, `x` is the box of a leaf of `leaf_shape`
  that starts at `offsets`: the sum over a partition of a leaf into boxes is
  the leaf's checksum (mod 2**32). With `true_shape`, the leaf is stored padded
  to `leaf_shape`: only the elements inside `true_shape` count.
  """
  if jnp.dtype(x.dtype).itemsize not in _UINT_OF_SIZE:
    raise ValueError(f"no checksum for {x.dtype} leaves")
  pattern = bits(x).astype(jnp.uint32)
  leaf_shape = x.shape if leaf_shape is None else leaf_shape
  true_shape = tuple(leaf_shape) if true_shape is None else tuple(true_shape)
  # The global flat index, in wrapping uint32 arithmetic and without reshaping
  # (a reshape of a sharded array could make XLA move it).
  position, stride, inside = jnp.zeros(x.shape, jnp.uint32), 1, None
  for dim in reversed(range(x.ndim)):
    index = jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim)
    if offsets is not None:
      index = index + offsets[dim].astype(jnp.uint32)
    position = position + index * jnp.uint32(stride % 2**32)
    stride *= true_shape[dim]
    if true_shape[dim] != leaf_shape[dim]:  # padding along `dim`: it does not count
      within = index < jnp.uint32(true_shape[dim])
      inside = within if inside is None else inside & within
  # Multiplying by an odd constant spreads neighbouring positions over all bits.
  mixed = _fmix32(pattern ^ (position * jnp.uint32(0x9E3779B9)))
  if inside is not None:
    mixed = jnp.where(inside, mixed, jnp.uint32(0))
  return jnp.sum(mixed, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnums=1)
def _checksums(leaves: list[jax.Array], true_shapes: tuple) -> jax.Array:
  """[n_leaves] uint32. One stacked result rather than a scalar per leaf: XLA
  then reduces all the devices' partial sums in one collective (half the cost)."""
  return jnp.stack([_leaf_checksum(x, true_shape=t) for x, t in zip(leaves, true_shapes)])


@functools.partial(jax.jit, static_argnums=1)
def _checksums_and_finite(leaves: list[jax.Array], true_shapes: tuple) -> jax.Array:
  """[2, n_leaves] uint32: each leaf's checksum, and 1 where it is finite."""
  finite = jnp.stack([jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.floating)
                      else jnp.bool_(True) for x in leaves]).astype(jnp.uint32)
  return jnp.stack([_checksums(leaves, true_shapes), finite])


@functools.partial(jax.jit, static_argnums=(2, 3))
def box_checksums(boxes: jax.Array, offsets: jax.Array, leaf_shape: tuple[int, ...],
                  true_shape: tuple[int, ...] | None = None) -> jax.Array:
  """[2, K] uint32 of K boxes [K, *box] of K leaves of `leaf_shape` (stored padded
  from `true_shape`), all starting at `offsets`: each box's part of its leaf's
  checksum, and 1 where it is finite. (The NVMe tier keeps its state in boxes:
  jaxzero.offload.nvme_store.)"""
  sums = jnp.stack([_leaf_checksum(box, offsets, leaf_shape, true_shape) for box in boxes])
  finite = jnp.stack([jnp.isfinite(box).all() for box in boxes]).astype(jnp.uint32)
  return jnp.stack([sums, finite])


def host_checksum(x: np.ndarray, start: int = 0) -> int:
  """`x`'s part of its leaf's checksum, on the host: `x` is the leaf's elements from
  flat position `start` on (a whole leaf at its true shape, or one layer of a stacked
  leaf), in the dtype the leaf was saved in. Summing the parts of a leaf gives its
  checksum (mod 2**32), as _leaf_checksum computes it on the devices.

  In chunks of 2**16 elements that stay in cache: about 3 GB/s on one core, where
  whole-array temporaries ran at 0.1 GB/s.
  """
  x = np.ascontiguousarray(x)
  if x.dtype.itemsize not in _UINT_OF_SIZE:
    raise ValueError(f"no checksum for {x.dtype} leaves")
  flat = x.reshape(-1).view(f"u{x.dtype.itemsize}")
  chunk, total = 1 << 16, 0
  with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as on the devices
    # (p + i) * c = p * c + i * c (mod 2**32): each chunk adds its first position's part.
    spread = np.arange(chunk, dtype=np.uint32) * np.uint32(0x9E3779B9)
    for first in range(0, flat.size, chunk):
      h = flat[first:first + chunk].astype(np.uint32)
      h ^= spread[:h.size] + np.uint32((start + first) * 0x9E3779B9 % 2**32)
      h ^= h >> 16
      h *= np.uint32(0x85EBCA6B)
      h ^= h >> 13
      h *= np.uint32(0xC2B2AE35)
      h ^= h >> 16
      total += int(h.sum(dtype=np.uint64))
  return total % 2**32


def recorded_checksum(recorded: dict, name: str) -> int | None:
  """Leaf `name`'s checksum in a checkpoint's record, or None where the record has none
  (an older checkpoint, or one whose checksums were made another way)."""
  if recorded.get("algorithm") != ALGORITHM or name not in recorded.get("checksums", {}):
    return None
  return int(recorded["checksums"][name], 16)


def leaf_name(path) -> str:
  """"master/layers/w_up_LxDxF": a leaf's path however the tree is nested (a
  saved TrainState comes back as dicts and lists)."""
  return "/".join(str(next((getattr(key, a) for a in ("key", "name", "idx") if hasattr(key, a)),
                           key)) for key in path)


def _named_leaves(state) -> tuple[list[str], list[jax.Array]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  return [leaf_name(path) for path, _ in leaves], [leaf for _, leaf in leaves]


def _in_device_memory(x: jax.Array) -> bool:
  return getattr(x.sharding, "memory_kind", None) in (None, "device")


def _dims_axes(x: jax.Array) -> tuple[tuple[str, ...], ...]:
  """The mesh axes that split each dimension of `x` (a NamedSharding's; JAX
  only makes even shards)."""
  return mesh_lib.axes_per_dimension(x.sharding, x.ndim)


# Why shard_map: in the global view every leaf's sum is its own cross-device
# reduction, which XLA combines into one all-reduce of a tuple of n_leaves
# scalars; XLA:CPU runs that operand by operand (12 of the 14 ms the tiny
# preset's checksums took, i.e. 5 % of its save). Here each device sums the
# elements it holds with their global positions, and the devices add one
# [2, n_leaves] vector.
@functools.lru_cache(maxsize=None)
def _per_shard_sums(mesh: jax.sharding.Mesh, leaf_axes: tuple, with_finite: bool,
                    true_shapes: tuple):
  """Jitted: (leaves) -> [2, n_leaves] uint32 (checksums; non-finite counts)."""

  def local(leaves):
    rows = []
    for x, axes, true_shape in zip(leaves, leaf_axes, true_shapes):
      offsets, leaf_shape = [], []
      for n, dim in zip(x.shape, axes):
        index = jnp.uint32(0)
        for a in dim:  # the shard's position along `dim` (major to minor, as JAX lays it out)
          index = index * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
        offsets.append(index * jnp.uint32(n))
        leaf_shape.append(n * math.prod(mesh.shape[a] for a in dim))
      # A replicated copy counts once: only its holder at index 0 of the unused axes adds it.
      used = {a for dim in axes for a in dim}
      first = functools.reduce(jnp.logical_and, (jax.lax.axis_index(a) == 0
                                                 for a in mesh.axis_names if a not in used),
                               jnp.bool_(True))
      checksum = jnp.where(first, _leaf_checksum(x, offsets, tuple(leaf_shape), true_shape),
                           jnp.uint32(0))
      nonfinite = (jnp.uint32(0) if not with_finite or not jnp.issubdtype(x.dtype, jnp.floating)
                   else (~jnp.isfinite(x).all()).astype(jnp.uint32))
      rows.append(jnp.stack([checksum, nonfinite]))
    return jax.lax.psum(jnp.stack(rows, axis=1), mesh.axis_names)

  specs = [P(*(dim or None for dim in axes)) for axes in leaf_axes]
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P()))


def _sums(leaves: list[jax.Array], with_finite: bool, true_shapes: list) -> np.ndarray:
  """[1 or 2, n_leaves]: checksums (and finite flags) of leaves in device memory,
  one per-shard call per mesh; leaves with other shardings in the global view."""
  out = np.zeros((2 if with_finite else 1, len(leaves)), np.uint32)
  by_mesh = collections.defaultdict(list)  # None: not a NamedSharding
  for i, x in enumerate(leaves):
    by_mesh[getattr(x.sharding, "mesh", None)].append(i)
  for mesh, group in by_mesh.items():
    arrays, trues = [leaves[i] for i in group], tuple(true_shapes[i] for i in group)
    if mesh is None:
      function = _checksums_and_finite if with_finite else _checksums
      out[:, group] = np.asarray(jax.device_get(function(arrays, trues))).reshape(-1, len(group))
      continue
    sums = _per_shard_sums(mesh, tuple(map(_dims_axes, arrays)), with_finite, trues)
    values = np.asarray(jax.device_get(sums(arrays)))
    out[0, group] = values[0]
    if with_finite:
      out[1, group] = values[1] == 0
  return out


def _compute(leaves: list[jax.Array], with_finite: bool, true_shapes: list
             ) -> list[list[int]]:
  """[checksums] or [checksums, finite flags] of `leaves`, as Python ints.

  Leaves in device memory go in one call. Offloaded (pinned_host) leaves are
  brought to the device one at a time, so that checking them never needs more
  device memory than one leaf's shards.
  """
  on_device = [i for i, x in enumerate(leaves) if _in_device_memory(x)]
  columns: dict[int, list[int]] = {}
  if on_device:
    values = _sums([leaves[i] for i in on_device], with_finite,
                   [true_shapes[i] for i in on_device])
    columns.update({i: values[:, k].tolist() for k, i in enumerate(on_device)})
  for i, x in enumerate(leaves):
    if i not in columns:
      moved = jax.device_put(x, x.sharding.with_memory_kind("device"))
      columns[i] = _sums([moved], with_finite, [true_shapes[i]])[:, 0].tolist()
  return [list(row) for row in zip(*(columns[i] for i in range(len(leaves))))]


def _hex(checksums) -> list[str]:
  return [f"{int(c):08x}" for c in checksums]


def _true(names: list[str], true_shapes: dict | None) -> list:
  return [tuple(true_shapes[n]) if true_shapes and n in true_shapes else None for n in names]


def record(state, true_shapes: dict | None = None) -> dict:
  """What a checkpoint stores to be verified later: every leaf's checksum
  (`true_shapes`: {leaf name: true shape} of the leaves stored padded).

  Every process gets the same values (the sums are over the global arrays).
  """
  names, leaves = _named_leaves(state)
  checksums = _hex(_compute(leaves, False, _true(names, true_shapes))[0])
  return {"algorithm": ALGORITHM, "checksums": dict(zip(names, checksums))}


def mismatches(state, recorded: dict, true_shapes: dict | None = None
               ) -> tuple[list[str], list[str]]:
  """(leaves whose checksum differs from `recorded`, non-finite leaves) of `state`.

  A record made with another algorithm is not compared (its leaves are only
  checked to be finite).
  """
  names, leaves = _named_leaves(state)
  checksums, finite = _compute(leaves, True, _true(names, true_shapes))
  nonfinite = [name for name, ok in zip(names, finite) if not ok]
  if recorded.get("algorithm") != ALGORITHM:
    return [], nonfinite
  expected = recorded.get("checksums", {})
  differ = [name for name, value in zip(names, _hex(checksums)) if expected.get(name) != value]
  return differ, nonfinite

