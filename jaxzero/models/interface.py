"""What the engine asks of a model, whatever defines it.

A :class:`Model` declares every parameter once, as a leaf with a shape and
logical axis names (jaxzero's: ``embed``, ``mlp``, ``vocab``, ``heads``,
``kv_heads``, ``head_dim``, ``layers``, and ``none`` for a dimension never
split), draws its fp32 parameters from a key, and gives the mean loss of a
batch. It knows no mesh: the engine steers sharding and memory through the
:class:`Hooks` it passes to the loss, all no-ops for a model that ignores them.
A model may also declare frozen leaves (``frozen_specs``: e.g. a LoRA base): the
engine keeps them (in the compute dtype, or a dtype their spec declares), never
differentiates or updates them, and merges them into the trained parameters
(:func:`merge`) before the loss.
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


def _plain_scan(layer, carry, stacked):
  return jax.lax.scan(layer, carry, stacked)[0]


def _in_order(_T):
  return None


def _whole_sequence(attend):
  return lambda q, k, v, segment_ids=None: attend(q, k, v, segment_ids_BxT=segment_ids)


@dataclasses.dataclass(frozen=True)
class Hooks:
  """The engine's hooks: `shard(x, logical_axes)` on an activation, `gather(w,
  logical_axes)` on a weight where it is used, `remat(fn)` on a layer's function,
  `scan(layer, carry, stacked) -> carry`, ``jax.lax.scan(layer, carry,
  stacked)[0]`` over a model's stacked layers (see `Model.layers_key`), and
  `context(attend)` on an attention function ``attend(q, k, v, segment_ids_BxT=,
  kv_segment_ids_BxS=, q_offset=)`` (jaxzero.models.attention.attention's
  signature), giving ``(q, k, v, segment_ids=None) -> out`` over [B, T, ...] inputs:
  with context parallelism the engine runs it on each device's part of the sequence;
  and `sequence_order(T)`, the order the engine lays a sequence's T positions out in (a
  numpy permutation, or None for 0..T-1): the model takes its inputs, targets and
  positions in that order, and attention receives q, k and v in it."""
  shard: Callable[[Array, tuple], Array] = _same
  gather: Callable[[Array, tuple], Array] = _same
  remat: Callable[[Callable], Callable] = _no_remat
  scan: Callable[[Callable, Any, Any], Any] = _plain_scan
  context: Callable[[Callable], Callable] = _whole_sequence
  sequence_order: Callable[[int], Any] = _in_order


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
    layers_key: where the parameters are a dict, the key whose leaves are stacked
      per layer (leading axis) and which the loss runs once through `hooks.scan`,
      passing exactly ``params[layers_key]``. The engine then adds each layer's
      gradient into the accumulated sum as the backward pass produces it, so that
      gradient accumulation holds one gradient-sized buffer, not two. The loss calls
      `hooks.scan` itself, under no transform of its own (``jax.checkpoint``,
      ``custom_vjp``): the pipeline schedules and the NVMe tier run the layers apart
      from what comes before and after them, and take the stack's input or output
      from that call.
    frozen_specs: None, or a nested dict of leaves that are used but not trained
      (with `specs` also a nested dict): the loss receives ``merge(trained,
      frozen)``. Under `layers_key` both may have leaves.
    frozen_init: key -> the frozen leaves, where `frozen_specs` is given. A frozen
      leaf's spec may carry a `dtype` (e.g. quantized codes); the others are cast to
      the compute dtype.
    keyed_rows: the loss draws randomness (e.g. dropout): in training the engine passes
      it a :class:`KeyedBatch`, the batch with a key per row; evaluation passes the
      batch alone (no randomness, as in PyTorch's eval mode).
    batch_weight: batch -> its weight in the mean loss of a batch it is part of (its
      targets' count, where a loss mask makes rows count unequally); None: its rows.
      Where the engine takes a batch's loss as parts (the device groups of stages 0-1),
      it weighs each part's by this, so that the loss is the one of the whole batch.
    lora: the LoRA settings a checkpoint records ({"rank", "alpha", "targets"}: a restore
      under another alpha is refused) where the model's adapters are jaxzero.lora's.
  """
  specs: Any
  init: Callable[[Array], Any]
  loss: Callable[[Any, Any, Hooks], Array]
  decay: Callable[[str], bool] = lambda path: "norm" not in path
  layers_key: str | None = None
  frozen_specs: Any = None
  frozen_init: Callable[[Array], Any] | None = None
  keyed_rows: bool = False
  batch_weight: Callable[[Any], Array] | None = None
  lora: dict | None = None


class KeyedBatch(NamedTuple):
  """A training batch for a Model with `keyed_rows`: the batch and a PRNG key per row
  (raw uint32 key data [B, 2]). The engine draws row r's key from the run's seed, the
  step and r's index in the global batch, so a row's randomness is the same on any
  mesh and with any grad_accum: splitting the batch moves the keys with their rows."""
  batch: Any
  row_keys: Array


def merge(trained: Any, frozen: Any) -> Any:
  """The nested dicts `trained` and `frozen` as one (a leaf in both is an error);
  `trained` as it is where `frozen` is None."""
  if frozen is None:
    return trained
  if not (isinstance(trained, dict) and isinstance(frozen, dict)):
    raise ValueError("frozen leaves need the parameters to be nested dicts, and a leaf "
                     "cannot be both trained and frozen")
  merged = dict(frozen)
  for key, value in trained.items():
    merged[key] = merge(value, frozen[key]) if key in frozen else value
  return merged


def split_like(tree: dict, like: dict) -> tuple[dict, dict]:
  """(the part of nested dict `tree` with the keys of `like`, the rest): the inverse of
  :func:`merge` for ``like``'s structure."""
  part, rest = {}, {}
  for key, value in tree.items():
    if key not in like:
      rest[key] = value
    elif isinstance(like[key], dict):
      part[key], rest_value = split_like(value, like[key])
      if rest_value:
        rest[key] = rest_value
    else:
      part[key] = value
  return part, rest
