"""Checksums of the train state, computed on the devices where the shards live.

A checkpoint records one 32-bit checksum per state leaf; a restore recomputes
it on the state it read back and compares. The checksum of a leaf is

    sum over elements i of  fmix32(bits(x[i]) XOR position(i))   (mod 2**32)

where ``bits`` is the element's bit pattern and ``position`` a hash of its
global index (murmur3's finaliser mixes both). A sum does not depend on the
order it is added in, so every device adds up the elements of the shards it
holds and XLA adds the partial sums: the checksum of a leaf is the same under
any sharding, which lets a checkpoint written by one mesh and stage be verified
after it has been read into another. It costs one pass over the state on the
devices (the save copies it off them anyway) and a few bytes to the host.

Any change to a stored value (garbage written into a file, a truncated or
swapped chunk that still decodes) changes the checksum with probability
1 - 2**-32 per damaged leaf. The same pass reports whether each floating leaf
is finite, since damaged bytes can also decode to NaN or Inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Recorded with the checksums: a checkpoint whose checksums were made another
# way is not compared against these.
ALGORITHM = "fmix32-position-sum-v1"

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _fmix32(x: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser: every input bit affects every output bit."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """A uint32 checksum of `x` that does not depend on its sharding (see above)."""
  itemsize = jnp.dtype(x.dtype).itemsize
  if itemsize not in _UINT_OF_SIZE:
    raise ValueError(f"no checksum for {x.dtype} leaves")
  bits = jax.lax.bitcast_convert_type(x, _UINT_OF_SIZE[itemsize]).astype(jnp.uint32)
  # The global flat index, in wrapping uint32 arithmetic and without reshaping
  # (a reshape of a sharded array could make XLA move it).
  position, stride = jnp.zeros(x.shape, jnp.uint32), 1
  for dim in reversed(range(x.ndim)):
    index = jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim)
    position = position + index * jnp.uint32(stride % 2**32)
    stride *= x.shape[dim]
  return jnp.sum(_fmix32(bits ^ _fmix32(position + jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)


@jax.jit
def _checksums_and_finite(leaves: list[jax.Array]):
  checksums = [_leaf_checksum(x) for x in leaves]
  finite = [jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)
            for x in leaves]
  return checksums, finite


def leaf_name(path) -> str:
  """"master/layers/w_up_LxDxF": a leaf's path however the tree is nested (a
  saved TrainState comes back as dicts and lists)."""
  return "/".join(str(next((getattr(key, a) for a in ("key", "name", "idx") if hasattr(key, a)),
                           key)) for key in path)


def _named_leaves(state) -> tuple[list[str], list[jax.Array]]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  return [leaf_name(path) for path, _ in leaves], [leaf for _, leaf in leaves]


def fingerprint(state) -> tuple[dict[str, str], list[str]]:
  """({leaf name: checksum as 8 hex digits}, [names of non-finite leaves]) of `state`.

  Every process gets the same values (the sums are over the global arrays).
  """
  names, leaves = _named_leaves(state)
  checksums, finite = jax.device_get(_checksums_and_finite(leaves))
  return ({name: f"{int(c):08x}" for name, c in zip(names, checksums)},
          [name for name, ok in zip(names, finite) if not ok])


def record(state) -> dict:
  """What a checkpoint stores to be verified later."""
  checksums, _ = fingerprint(state)
  return {"algorithm": ALGORITHM, "checksums": checksums}


def mismatches(state, recorded: dict) -> tuple[list[str], list[str]]:
  """(leaves whose checksum differs from `recorded`, non-finite leaves) of `state`.

  A record made with another algorithm is not compared (its leaves are only
  checked to be finite).
  """
  checksums, nonfinite = fingerprint(state)
  if recorded.get("algorithm") != ALGORITHM:
    return [], nonfinite
  expected = recorded.get("checksums", {})
  differ = [name for name, value in checksums.items() if expected.get(name) != value]
  return differ, nonfinite
