"""What the engine asks of a model, whatever defines it.

A :class:`Model` declares every parameter once, as a leaf with a shape and
logical axis names (jaxzero's: ``embed``, ``mlp``, ``vocab``, ``heads``,
``kv_heads``, ``head_dim``, ``layers``, and ``none`` for a dimension never
split), draws its fp32 parameters from a key, and gives the mean loss of a
batch. It knows no mesh: the engine steers sharding and memory through the
:class:`Hooks` it passes to the loss, all no-ops for a model that ignores them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax

Array = jax.Array


def _same(x, _logical_axes=None):
  return x


def _no_remat(fn):
  return fn


@dataclasses.dataclass(frozen=True)
class Hooks:
  """The engine's hooks: `shard(x, logical_axes)` on an activation, `gather(w,
  logical_axes)` on a weight where it is used, `remat(fn)` on a layer's function."""
  shard: Callable[[Array, tuple], Array] = _same
  gather: Callable[[Array, tuple], Array] = _same
  remat: Callable[[Callable], Callable] = _no_remat


class Leaf(NamedTuple):
  """One parameter's declaration: its shape and a logical axis name per dimension."""
  shape: tuple[int, ...]
  logical_axes: tuple[str, ...]


def is_spec(x) -> bool:
  """`is_leaf` for trees of declarations (a NamedTuple, which jax would flatten)."""
  return hasattr(x, "logical_axes")


@dataclasses.dataclass(frozen=True)
class Model:
  """A model as the engine trains it.

  Attributes:
    specs: a pytree of leaves with `.shape` and `.logical_axes` (e.g. :class:`Leaf`),
      the structure of the parameters.
    init: key -> the fp32 parameters (the structure of `specs`).
    loss: (parameters in the compute dtype, batch, Hooks) -> the batch's mean loss.
    decay: a parameter's path ("layers/w_up_LxDxF") -> whether weight decay applies.
  """
  specs: Any
  init: Callable[[Array], Any]
  loss: Callable[[Any, Any, Hooks], Array]
  decay: Callable[[str], bool] = lambda path: "norm" not in path
