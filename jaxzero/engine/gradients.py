"""The step's gradient, one short function per mode, chosen once by :func:`for_mode`.

Each mode maps (params, batch [A, B, ...], scale) to (the sum of the A micro-batches'
gradients in the grad dtype, their mean loss): a scan over the micro-steps (weights
resident or streamed from host memory), GPipe or interleaved, and 1F1B. `scale` is the
float16 loss scale (None otherwise): each micro-batch's loss is multiplied by it before
its gradient, so the sum is of the scaled gradients. With gradient accumulation, a
model that scans its layers through ``Hooks.scan`` has each layer's gradient added into
the sum as the backward pass produces it (jaxzero.engine.accumulate): one gradient-sized
buffer, not two. Stages 2-3 reduce-scatter each micro-step's gradient into sharded
buffers; stages 0-1 and hybrid groups reduce once (jaxzero.engine.groups).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxzero.config import Config
from jaxzero.engine.accumulate import AccumulatingScan
from jaxzero.engine.groups import Groups
from jaxzero.engine.hooks import LayoutHooks
from jaxzero.engine.remat import remat_wrapper
from jaxzero.engine.state import dtype_of
from jaxzero.models.interface import Model, is_spec, merge
from jaxzero.parallel import layer_cut, one_f_one_b, pipeline
from jaxzero.parallel.zero import Layout, on_device, weights_for_compute

# (params, batch [A, B, ...], scale or None, frozen or None) -> (gradient sum, mean loss)
GradSum = Callable[..., tuple[Any, jax.Array]]


def model_loss(model: Model, hooks: LayoutHooks, remat) -> Callable:
  """(params, batch, scale, scan=None, frozen=None) -> (the loss times `scale`, or the
  loss where `scale` is None; the loss): the value to differentiate, and the loss as
  aux. `frozen` (Model.frozen_specs' leaves) joins the parameters undifferentiated."""
  def loss(params, batch, scale, scan=None, frozen=None):
    value = model.loss(merge(params, frozen), batch, hooks.hooks(remat, scan))
    return (value if scale is None else value * scale), value
  return loss


def for_mode(cfg: Config, layout: Layout, state_sh, model: Model) -> GradSum:
  """The gradient function of `layout`'s mode: micro-steps, GPipe/interleaved or 1F1B."""
  if layout.pipeline_size == 1:
    return micro_steps(cfg, layout, state_sh, model)
  if cfg.pipeline.schedule == "1f1b":
    return one_f_one_b_steps(cfg, layout, state_sh, model)
  return gpipe_steps(cfg, layout, state_sh, model)


def whole_grads(loss: Callable) -> Callable:
  """One micro-batch's gradient, whole: (params, batch, None, scale) -> (loss, grads, None)."""
  grad = jax.value_and_grad(loss, has_aux=True)

  def micro(params, batch, layers_sum, scale):
    del layers_sum
    (_, value), grads = grad(params, batch, scale)
    return value, grads, None
  return micro


def per_layer_grads(loss: Callable, model: Model, place=None) -> Callable:
  """One micro-batch's gradient with each layer's added into `layers_sum` as the
  backward pass produces it: (params, batch, layers_sum, scale) -> (loss, the other
  parameters' gradients, layers_sum + the layers' gradients). `place` moves a layer's
  gradient to where the sum lives (jaxzero.engine.accumulate)."""
  key = model.layers_key

  def split_loss(other, layers_sum, layers, batch, scale):
    scan = AccumulatingScan(layers_sum, place, frozen=model.frozen_specs is not None)
    params = {k: layers if k == key else other[k] for k in (*other, key)}
    values = loss(params, batch, scale, scan)
    if scan.calls != 1:
      raise ValueError(f"the model declares layers_key={key!r} but its loss ran Hooks.scan "
                       f"{scan.calls} times: it must run params[{key!r}] through it once")
    return values

  grad = jax.value_and_grad(split_loss, argnums=(0, 1), has_aux=True)

  def micro(params, batch, layers_sum, scale):
    other = {k: v for k, v in params.items() if k != key}
    (_, value), (other_grads, layers_sum) = grad(other, layers_sum, params[key], batch, scale)
    return value, other_grads, layers_sum
  return micro


def _to_device_in_reduce_layout(layout: Layout, model: Model) -> Callable:
  """Moves a layer's gradients (of weights streamed from pinned_host, so typed
  pinned_host) to the device, in their reduce layout."""
  layer_axes = jax.tree.map(lambda s: s.logical_axes[1:], model.specs[model.layers_key],
                            is_leaf=is_spec)
  return lambda grads: jax.tree.map(lambda g, axes: jax.device_put(g, NamedSharding(
      layout.mesh, layout.spec(g.shape, axes, layout.reduce_role), memory_kind="device")),
      grads, layer_axes)


def micro_steps(cfg: Config, layout: Layout, state_sh, model: Model) -> GradSum:
  """A scan over the A micro-steps, each gradient added into the running sum. Weights
  in pinned_host stream: the layers' shards move to the device one layer at a time
  (LayoutHooks.gather), their gradients back into the sum."""
  groups, key = Groups.of(layout), model.layers_key
  streams = layout.params_memory == "pinned_host"
  grad_dtype = dtype_of(cfg.zero.grad_dtype)
  loss = model_loss(model, groups.hooks, remat_wrapper(cfg.remat.policy))
  sum_sh = groups.sum_shardings(on_device(layout.tree_shardings(model.specs, layout.reduce_role)),
                                layout.tree_shardings(model.specs, "compute"))
  place = _to_device_in_reduce_layout(layout, model) if streams and key is not None else None

  def add(micro, per_layer, params, scale, carry, batch):
    loss_sum, grad_sum = carry
    value, grads, layers_sum = micro(params, batch, grad_sum[key] if per_layer else None, scale)
    if streams:  # each weight's gradient, typed pinned_host, to the sum's layout
      grads = jax.device_put(grads, {k: sum_sh[k] for k in grads} if per_layer else sum_sh)
    grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    if per_layer:  # the layers' sum is already the new one
      grad_sum = {k: layers_sum if k == key else jax.tree.map(jnp.add, grad_sum[k], grads[k])
                  for k in grad_sum}
    else:
      grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
    return (loss_sum + value, jax.lax.with_sharding_constraint(grad_sum, sum_sh)), None

  def grad_sum_fn(params, batch_Ax, scale, frozen=None):
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    per_layer = key is not None and accum > 1
    # Streamed: the embedding, head and final norm come over now, the layers in the scan.
    params = weights_for_compute(layout, params, state_sh.params, key)
    frozen = weights_for_compute(layout, frozen, state_sh.frozen, key)
    bound = functools.partial(loss, frozen=frozen)
    micro = groups.per_group(per_layer_grads(bound, model, place) if per_layer
                             else whole_grads(bound), per_layer, model.batch_weight)
    zeros = jax.lax.with_sharding_constraint(jax.tree.map(
        lambda p: jnp.zeros(groups.sum_shape(p), grad_dtype), params), sum_sh)
    (loss_sum, grad_sum), _ = jax.lax.scan(
        lambda carry, batch: add(micro, per_layer, params, scale, carry, batch),
        (jnp.zeros((), jnp.float32), zeros), batch_Ax)
    reduced = groups.reduce(grad_sum, on_device(state_sh.master), dtype_of(layout.reduce_dtype))
    return reduced, loss_sum / accum
  return grad_sum_fn


def gpipe_steps(cfg: Config, layout: Layout, state_sh, model: Model) -> GradSum:
  """GPipe (interleaved with pipeline.virtual_stages > 1): the A micro-batches' rows
  pass the layer stack as one pipelined pass (jaxzero.parallel.pipeline); then the rest
  of the loss (final norm, head) runs on each micro-batch's rows apart, so that each
  micro-batch's loss is the mean over its own targets, as on one device (micro-batches
  with different numbers of target tokens weigh alike). The sum of the A losses has,
  as its gradient, the sum of the A micro-steps' gradients."""
  loss = model_loss(model, LayoutHooks(layout), remat_wrapper(cfg.remat.policy))
  stages, grad_dtype = layout.pipeline_size, dtype_of(cfg.zero.grad_dtype)

  def stack_output(params, rows, accum, frozen):
    """The layer stack's output for the merged rows; the model's own head on them is
    traced but unused (XLA drops it). The output is taken from inside the model's loss:
    the loss runs Hooks.scan at its top level, under no transform (Model.layers_key)."""
    pipelined = pipeline.gpipe_scan(stages, accum, pipeline.stage_constraint(layout.mesh),
                                     cfg.pipeline.virtual_stages)
    outputs = []

    def scan(layer, carry, stacked):
      outputs.append(pipelined(layer, carry, stacked))
      return outputs[-1]
    loss(params, rows, None, scan, frozen)
    if len(outputs) != 1:
      raise ValueError(f"a pipelined model runs its layers through Hooks.scan once; this "
                       f"one ran it {len(outputs)} times")
    return outputs[0]

  def micro_losses(params, batch_Ax, scale, frozen):
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    # Row b x A + a is micro-batch a's row b (the scan's order): each device keeps its rows.
    rows = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), batch_Ax)
    out = stack_output(params, rows, accum, frozen)
    out_Ax = jax.tree.map(lambda y: y.reshape(-1, accum, *y.shape[1:]).swapaxes(0, 1), out)
    unscaled = lambda p, batch, scan: loss(p, batch, None, scan, frozen)[1]
    # Vectorised over the micro-batches, not a loop: the head's and the final norm's
    # gradients are then reduced once a step, not once a micro-batch.
    values = jax.vmap(lambda batch, out: layer_cut.after_layers(unscaled, params, batch, out)
                      )(batch_Ax, out_Ax)
    total = values.sum()
    return (total if scale is None else total * scale), values.mean()

  grad = jax.grad(micro_losses, has_aux=True)

  def grad_sum_fn(params, batch_Ax, scale, frozen=None):
    grads, mean_loss = grad(jax.device_put(params, on_device(state_sh.params)), batch_Ax,
                            scale, frozen)
    return jax.tree.map(lambda g: g.astype(grad_dtype), grads), mean_loss
  return grad_sum_fn


def one_f_one_b_steps(cfg: Config, layout: Layout, state_sh, model: Model) -> GradSum:
  """1F1B (jaxzero.parallel.one_f_one_b): each stage's layer gradients summed in their
  reduce layout as its backward slots produce them."""
  loss = model_loss(model, LayoutHooks(layout), remat_wrapper(cfg.remat.policy))
  grad_dtype = dtype_of(cfg.zero.grad_dtype)
  layer_reduce_specs = jax.tree.map(lambda sh: sh.spec, layout.tree_shardings(
      model.specs[model.layers_key], layout.reduce_role))
  unscaled = lambda params, batch, scan: loss(params, batch, None, scan)[1]

  def grad_sum_fn(params, batch_Ax, scale, frozen=None):
    grads, mean_loss = one_f_one_b.one_f_one_b(
        unscaled, model.layers_key, layout.pipeline_size, layout.mesh, layer_reduce_specs,
        grad_dtype, jax.device_put(params, on_device(state_sh.params)), batch_Ax, scale,
        frozen)
    return jax.tree.map(lambda g: g.astype(grad_dtype), grads), mean_loss
  return grad_sum_fn
