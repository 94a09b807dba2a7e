"""Frozen weights stored quantized (QLoRA's base): NF4 with double-quantized block scales,
or int8, dequantized where a layer uses them.

A stacked weight [L, ...] is quantized per layer over its flattened elements, in blocks
of BLOCK = 64 consecutive values, each with its absolute maximum as scale (QLoRA,
Dettmers et al. 2023, and bitsandbytes' blockwise layout):

* ``nf4``: each value is the nearest of the 16 NormalFloat-4 levels (NF4_LEVELS) of
  value / absmax, two 4-bit codes a byte. Double quantization: the fp32 block scales,
  less their mean (one a layer), are quantized to 8 bits in groups of up to 256 with one
  fp32 scale a group. QLoRA quantizes them to 8-bit floats (bitsandbytes' dynamic 8-bit
  code); here they are linear int8: within half a step (1/254 of the group's largest
  distance from the mean) of their value, but one block far larger than the rest of its
  group coarsens the others' scales, which a non-linear code would not. About 0.52 bytes a
  parameter.
* ``int8``: round(127 · value / absmax), the block scales in fp32: 1.06 bytes a parameter.

A quantized weight is a dict of arrays (``codes``, ``absmax``, and for nf4 ``scale`` and
``offset``), each with a leading ``layers`` axis and a flat one (logical axis ``flat``)
that ZeRO shards like any other dimension; :func:`dequantize` gives one layer's weight.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64
SCALE_GROUP = 256
KINDS = ("int8", "nf4")

# QLoRA's NormalFloat-4 levels (the quantiles of N(0, 1) scaled to [-1, 1], with an exact
# zero), as bitsandbytes defines them.
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


class StoredSpec(NamedTuple):
  """One stored part of a quantized weight: shape, logical axes, dtype, and how many of
  the weight's parameters one element holds (2 for nf4's codes, 0 for scales)."""
  shape: tuple[int, ...]
  logical_axes: tuple[str, ...]
  dtype: str
  params_per_element: int = 0


def scale_group(n_blocks: int) -> int:
  """The double quantization's group: SCALE_GROUP, or the largest power of two that
  divides a layer's block count where SCALE_GROUP does not."""
  return math.gcd(n_blocks, SCALE_GROUP)


def check_quantizable(name: str, shape: tuple[int, ...], kind: str) -> None:
  """ValueError (one line) unless a stacked weight's layers split into whole blocks."""
  per_layer = math.prod(shape[1:])
  if per_layer % BLOCK:
    raise ValueError(f"lora.base_dtype={kind}: weight {name} has {per_layer:,} elements a "
                     f"layer ({' x '.join(map(str, shape[1:]))}), not a multiple of the "
                     f"{BLOCK}-value block; leave lora.base_dtype empty (the compute dtype) "
                     "for this model")


def stored_specs(shape: tuple[int, ...], kind: str) -> dict[str, StoredSpec]:
  """The stored parts of a stacked weight of `shape` [L, ...] quantized as `kind`."""
  L, n = shape[0], math.prod(shape[1:])
  blocks = n // BLOCK
  flat = ("layers", "flat")
  if kind == "int8":
    return {"codes": StoredSpec((L, n), flat, "int8", 1),
            "absmax": StoredSpec((L, blocks), flat, "float32")}
  groups = blocks // scale_group(blocks)
  return {"codes": StoredSpec((L, n // 2), flat, "uint8", 2),
          "absmax": StoredSpec((L, blocks), flat, "int8"),
          "scale": StoredSpec((L, groups), flat, "float32"),
          "offset": StoredSpec((L,), ("layers",), "float32")}


def quantize(w: jax.Array, kind: str) -> dict[str, jax.Array]:
  """A stacked weight [L, ...] (any float dtype) as `kind`'s stored parts."""
  L = w.shape[0]
  blocks = w.reshape(L, -1, BLOCK).astype(jnp.float32)
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  normed = blocks / jnp.where(absmax == 0, 1.0, absmax)[..., None]
  if kind == "int8":
    codes = jnp.round(normed * 127).astype(jnp.int8)
    return {"codes": codes.reshape(L, -1), "absmax": absmax}
  midpoints = jnp.asarray((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2)
  index = jnp.searchsorted(midpoints, normed.reshape(L, -1)).astype(jnp.uint8)
  codes = (index[:, 0::2] << 4) | index[:, 1::2]
  offset = jnp.mean(absmax, axis=-1)
  centred = (absmax - offset[:, None]).reshape(L, -1, scale_group(absmax.shape[-1]))
  scale = jnp.max(jnp.abs(centred), axis=-1) / 127
  q = jnp.round(centred / jnp.where(scale == 0, 1.0, scale)[..., None]).astype(jnp.int8)
  return {"codes": codes, "absmax": q.reshape(L, -1), "scale": scale, "offset": offset}


def dequantize(parts: dict[str, jax.Array], shape: tuple[int, ...], dtype) -> jax.Array:
  """One layer's weight of `shape` in `dtype` from its stored parts (one layer's:
  no leading ``layers`` axis)."""
  codes = parts["codes"]
  if "scale" in parts:  # nf4
    group = parts["absmax"].shape[-1] // parts["scale"].shape[-1]
    absmax = (parts["absmax"].reshape(-1, group).astype(jnp.float32)
              * parts["scale"][:, None]).reshape(-1) + parts["offset"]
    index = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(-1)
    values = jnp.asarray(NF4_LEVELS)[index]
  else:  # int8
    absmax = parts["absmax"]
    values = codes.astype(jnp.float32) / 127
  w = values.reshape(-1, BLOCK) * absmax[:, None]
  return w.reshape(shape).astype(dtype)


def stored_bytes(shape: tuple[int, ...], kind: str) -> int:
  """Bytes of a stacked weight of `shape` stored as `kind`."""
  return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
             for s in stored_specs(shape, kind).values())
