"""Padding, so that ZeRO shards every leaf whatever its shape.

A leaf none of whose ZeRO-able dimensions (jaxzero.parallel.zero.FSDP_DIM_PREFERENCE) divides
the sharding devices is stored with one of them padded with zeros to the next multiple, as
PyTorch FSDP2 pads dim 0 and DeepSpeed pads its flat partitions. Of the dimensions it could
pad, it pads the one that adds the fewest elements (the first preferred on a tie): padding a
dimension of d by p adds p/d of the leaf, so the largest dimension usually wastes least, and
a single dimension keeps the gathers and reduce-scatters as they are for a divisible leaf.

The padded model (:func:`pad_model`) is the one the engine trains: its leaves are stored,
gathered, reduced and updated at the padded shape, and its loss slices the padding off before
the model runs. So the model sees the true shape; the padding's gradient is zero, its AdamW
update (zero moments, zero weight) is zero, and it stays zero: it never reaches the loss or
the gradient norm. Checkpoints record each padded leaf's true shape (jaxzero.checkpoint), so
readers see the true shape and a restore pads anew for its own mesh.

A model's stacked layers (``Model.layers_key``) reach its ``Hooks.scan`` whole and padded,
and each layer's slice is unpadded as the scan hands it to the layer function; the gather
hook places a true-shaped weight by its padded shape's layout (jaxzero.engine.hooks), so its
gradient is still reduce-scattered. A leaf ``zero.min_shard_size`` keeps whole has no
ZeRO-able dimension (jaxzero.parallel.rules) and is never padded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxzero.models.interface import Leaf, Model, is_spec, merge, split_like
from jaxzero.parallel.zero import FSDP_DIM_PREFERENCE, Layout


def padded_shape(shape: tuple[int, ...], logical_axes: tuple[str, ...], size: int,
                 skip: int | None = None) -> tuple[int, ...]:
  """`shape` with the dimension that wastes least padded to a multiple of `size`; `shape`
  itself where a ZeRO-able dimension (never `skip`) already divides it, or none exists."""
  dims = [i for i, a in enumerate(logical_axes) if a in FSDP_DIM_PREFERENCE and i != skip]
  if size <= 1 or not dims or any(shape[i] % size == 0 for i in dims):
    return tuple(shape)
  added = lambda i: (-shape[i] % size) * math.prod(shape) // shape[i]
  rank = lambda i: (added(i), FSDP_DIM_PREFERENCE.index(logical_axes[i]), i)
  best = min(dims, key=rank)
  return tuple(d + (-d % size if i == best else 0) for i, d in enumerate(shape))


def unpad(x: jax.Array, true_shape: tuple[int, ...]) -> jax.Array:
  """`x` without its padding (a no-op for a leaf of its true shape)."""
  if tuple(x.shape) == tuple(true_shape):
    return x
  return jax.lax.slice(x, (0,) * x.ndim, tuple(true_shape))


def pad(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """`x` padded with zeros at the end of each dimension up to `shape`."""
  if tuple(x.shape) == tuple(shape):
    return x
  return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


@dataclasses.dataclass(frozen=True)
class Padding:
  """Each parameter's true shape, for a tree of the model's structure."""
  true_shapes: Any  # the model's specs' structure: each leaf's true shape (a tuple)
  padded_shapes: Any  # the same, as stored

  @property
  def any(self) -> bool:
    return any(t != p for t, p in zip(self.flat(self.true_shapes), self.flat(self.padded_shapes)))

  @staticmethod
  def flat(shapes) -> list[tuple[int, ...]]:
    return jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))

  def unpad(self, tree: Any) -> Any:
    """A tree of the model's structure at its true shapes."""
    return _map(unpad, tree, self.true_shapes)

  def pad(self, tree: Any) -> Any:
    """A tree of the model's structure at its stored (padded) shapes."""
    return _map(pad, tree, self.padded_shapes)

  def padded_leaves(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{"['w']": (true shape, stored shape)} for each padded leaf."""
    flat = jax.tree_util.tree_flatten_with_path(
        self.true_shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    return {jax.tree_util.keystr(path): (t, p) for (path, t), p in
            zip(flat, self.flat(self.padded_shapes)) if t != p}


def _map(fn, tree, shapes):
  treedef = jax.tree.structure(tree)
  return jax.tree.unflatten(treedef, [fn(x, s) for x, s in zip(
      jax.tree.leaves(tree), treedef.flatten_up_to(shapes))])


def pad_model(model: Model, layout: Layout) -> tuple[Model, Padding]:
  """`model` with every leaf outside its stacked layers stored padded where `layout`
  shards it and no dimension divides (the same model where none needs it)."""
  size = layout.shard_size if any(layout.is_sharded(r) for r in ("params", "optimizer")) else 1

  def stored(leaf):
    shape, axes = tuple(leaf.shape), tuple(leaf.logical_axes)
    return padded_shape(shape, axes, size, skip=layout.tensor_dim(shape, axes))

  true_shapes = jax.tree.map(lambda leaf: tuple(leaf.shape), model.specs, is_leaf=is_spec)
  padded_shapes = jax.tree.map(stored, model.specs, is_leaf=is_spec)
  padding = Padding(true_shapes, padded_shapes)
  if not padding.any:
    return model, padding
  specs = jax.tree.map(lambda leaf, shape: Leaf(shape, tuple(leaf.logical_axes)),
                       model.specs, padded_shapes, is_leaf=is_spec)
  inner_init, inner_loss, key = model.init, model.loss, model.layers_key
  # The loss gets the trained leaves merged with the frozen ones (Model.frozen_specs),
  # which are never padded: only the trained leaves lose their padding.
  trained_of = ((lambda params: split_like(params, true_shapes))
                if model.frozen_specs is not None else (lambda params: (params, None)))
  if key is None:
    def loss(params, batch, hooks):
      trained, frozen = trained_of(params)
      return inner_loss(merge(padding.unpad(trained), frozen), batch, hooks)
  else:
    # The stacked layers go to Hooks.scan whole, as stored (Model.layers_key's contract);
    # each layer's slice loses its padding as the scan hands it to the layer.
    layer_shapes = jax.tree.map(lambda shape: shape[1:], true_shapes[key],
                                is_leaf=lambda x: isinstance(x, tuple))

    def loss(params, batch, hooks):
      trained, frozen = trained_of(params)
      outer = {k: v for k, v in trained.items() if k != key}
      outer = _map(unpad, outer, {k: true_shapes[k] for k in outer})
      scan = _unpadding_scan(hooks.scan, layer_shapes)
      return inner_loss(merge({**outer, key: trained[key]}, frozen), batch,
                        dataclasses.replace(hooks, scan=scan))
  return dataclasses.replace(model, specs=specs, init=lambda k: padding.pad(inner_init(k)),
                             loss=loss), padding


def _unpadding_scan(scan, layer_shapes):
  """`scan` whose layer function gets each layer's weights at their true shapes."""
  def one_layer(weights):
    if not isinstance(weights, dict):
      return _map(unpad, weights, layer_shapes)
    trained, frozen = split_like(weights, layer_shapes)  # frozen leaves ride along
    return merge(_map(unpad, trained, layer_shapes), frozen or None)

  def run(layer, carry, stacked):
    return scan(lambda c, weights: layer(c, one_layer(weights)), carry, stacked)
  return run
