"""Sharding rules for any parameters pytree: each leaf's dimensions in jaxzero's
logical names, which the ZeRO layouts (jaxzero.parallel.zero) place.

Where a model names its dimensions (Flax NNX ``with_partitioning``, Linen
``with_logical_partitioning``), `rules` maps its names onto jaxzero's (``embed``,
``mlp``, ``vocab``, ``heads``, ``kv_heads``, ``head_dim``, ``layers``, ``none``);
names jaxzero knows map to themselves. A leaf left with no dimension ZeRO may
split gets one, as FSDP would: its largest dimension that divides the sharding
devices, else its largest (padded: jaxzero.parallel.padding), never a ``layers``
axis, which the layer scan slices, nor the leading dimension of a leaf of three or
more where only it divides and another is as large as the devices (an unnamed layer
stack's: split, the scan would gather every layer at once). Leaves under
`min_size` elements stay whole on every device (DeepSpeed's
stage3_param_persistence_threshold + 1). Invariant: every dimension of every leaf
has exactly one name.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax

from jaxzero.config.sections import ZeroConfig
from jaxzero.errors import ConfigError
from jaxzero.models.interface import Leaf
from jaxzero.parallel.zero import FSDP_DIM_PREFERENCE, KNOWN_LOGICAL_AXES, say_once

NONE = "none"  # a dimension ZeRO never splits
# Smaller parameters stay whole (DeepSpeed's stage3_param_persistence_threshold + 1).
DEFAULT_MIN_SIZE = ZeroConfig.min_shard_size


def leaf_axes(path: str, shape: tuple[int, ...], names: tuple | None, rules: Mapping[str, str],
              shard_size: int, min_size: int) -> tuple[str, ...]:
  """Jaxzero's logical names for one leaf of `shape` that the model named `names`
  (None: not annotated). Raises ConfigError for what cannot be placed."""
  if names is not None and len(names) != len(shape):
    raise ConfigError(f"parameter {path} of shape {shape} is annotated with {len(names)} names "
                      f"{tuple(names)}; it needs one per dimension")
  axes = [_map(path, shape, n, rules) for n in (names or (None,) * len(shape))]
  if math.prod(shape) < min_size:
    if shard_size > 1:
      say_once(f"keeping {path} {shape} whole on every device: {math.prod(shape):,} elements, "
                f"under zero.min_shard_size={min_size:,}")
    return tuple(a if a == "layers" else NONE for a in axes)
  if not any(a in FSDP_DIM_PREFERENCE for a in axes):
    free = [i for i, a in enumerate(axes) if a is None]  # unnamed, or a name jaxzero lacks
    divisible = [i for i in free if shard_size > 1 and shape[i] % shard_size == 0]
    # The leading axis of three or more may be a layer stack's: where it alone divides,
    # another is split, padded, if one is as large as the devices (its padding then
    # wastes under half of it).
    if (divisible == [0] and len(shape) >= 3
        and any(shape[i] >= shard_size for i in free if i != 0)):
      free, divisible = [i for i in free if i != 0], []
    if divisible or free:  # none dividing: the largest, padded (jaxzero.parallel.padding)
      axes[max(divisible or free, key=lambda i: (shape[i], -i))] = "embed"
  return tuple(a if a is not None else NONE for a in axes)


def _map(path: str, shape: tuple, name, rules: Mapping[str, str]):
  if name is None:
    return None
  target = rules.get(name, name if name in KNOWN_LOGICAL_AXES else None)
  if target is None:
    return None  # a name jaxzero does not know: placed as if unannotated
  if target not in KNOWN_LOGICAL_AXES:
    raise ConfigError(f"rules map {name!r} (parameter {path} of shape {shape}) to {target!r}; "
                      f"choose one of: {', '.join(sorted(KNOWN_LOGICAL_AXES))}")
  return target


def specs(abstract: Any, names: Any, rules: Mapping[str, str] | None, shard_size: int,
          min_size: int = DEFAULT_MIN_SIZE) -> Any:
  """A tree of :class:`Leaf` for `abstract` (arrays or ShapeDtypeStructs), with
  `names` a tree of the same structure holding each leaf's names or None."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  name_leaves = treedef.flatten_up_to(names) if names is not None else [None] * len(flat)
  leaves = [Leaf(tuple(a.shape), leaf_axes(jax.tree_util.keystr(path), tuple(a.shape), n,
                                            dict(rules or {}), shard_size, min_size))
            for (path, a), n in zip(flat, name_leaves)]
  return jax.tree.unflatten(treedef, leaves)
