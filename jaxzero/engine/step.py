"""The jitted train step: any model's loss, the gradient over the micro-steps, the update.

Stages 2-3 reduce-scatter each micro-step's gradient into sharded buffers (their memory
saving); stages 0-1 keep each device's gradient unreduced and reduce once per step, as
DeepSpeed does. With gradient accumulation, a model that scans its layers through
``Hooks.scan`` has each layer's gradient added into the sum as the backward pass
produces it (jaxzero.engine.accumulate): one gradient-sized buffer, not two. Under
hybrid sharding the shards are reduced across ``replica`` once per step.
After each update the master weights are cast to the compute dtype and placed by the
``params`` role. A batch is any pytree of arrays [A, B, ...]: A micro-steps of B rows.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import optax
from jax.experimental import compute_on as compute_on_lib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.config import Config
from jaxzero.engine import loss_scale, one_f_one_b, pipeline
from jaxzero.engine.accumulate import AccumulatingScan
from jaxzero.engine.loss_scale import applied_updates
from jaxzero.engine.optimizer import clip_by_norm, join_clip, mean_grad, split_clip
from jaxzero.engine.remat import remat_wrapper
from jaxzero.engine.state import TrainState, dtype_of
from jaxzero.models.interface import Hooks, Model, is_spec
from jaxzero.sharding.mesh import AXES
from jaxzero.sharding.zero import Layout, local_sharding, on_device


def loss_fn(model: Model, params, batch, layout: Layout, remat, scan=None) -> jax.Array:
  """The model's mean loss over `batch`, with the layout's hooks (and `scan`, where given)."""
  hooks = Hooks(shard=layout.shard_activation, gather=layout.gather_for_compute, remat=remat)
  return model.loss(params, batch, hooks if scan is None else dataclasses.replace(hooks, scan=scan))


def accumulating_value_and_grad(model: Model, scales_loss: bool):
  """(params, batch, layout, remat, layers_sum, *scale) -> (value, other params'
  gradients, layers_sum + the stacked layers' gradients), each layer's gradient added
  into `layers_sum` as the backward pass produces it (jaxzero.engine.accumulate)."""
  key = model.layers_key
  layer_axes = jax.tree.map(lambda s: s.logical_axes[1:], model.specs[key], is_leaf=is_spec)

  def loss(other, layers_sum, layers, batch, layout, remat, *scale):
    place = None
    if layout.params_memory == "pinned_host":  # each layer's gradient comes back up to the sum
      place = lambda grads: jax.tree.map(lambda g, axes: jax.device_put(g, NamedSharding(
          layout.mesh, layout.spec(g.shape, axes, layout.reduce_role), memory_kind="device")),
          grads, layer_axes)
    scan = AccumulatingScan(layers_sum, place)
    params = {k: layers if k == key else other[k] for k in (*other, key)}
    value = loss_fn(model, params, batch, layout, remat, scan=scan)
    if scan.calls != 1:
      raise ValueError(f"the model declares layers_key={key!r} but its loss ran Hooks.scan "
                       f"{scan.calls} times: it must run params[{key!r}] through it once")
    return (value * scale[0], value) if scales_loss else value

  grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=scales_loss)

  def value_and_grad(params, batch, layout, remat, layers_sum, *scale):
    other = {k: v for k, v in params.items() if k != key}
    value, (other_grads, layers_sum) = grad(other, layers_sum, params[key], batch, layout,
                                            remat, *scale)
    return value, other_grads, layers_sum
  return value_and_grad


def make_grad_fn(cfg: Config, layout: Layout, state_sh: TrainState, model: Model):
  """(params, tokens [A, B, T+1]) -> (gradient sum, mean loss, gradient norm).

  A is the number of gradient-accumulation micro-steps; B the global
  micro-batch (split over every data-parallel device). The gradient sum is
  over the A micro-steps, in the grad dtype (float32 where it was reduced
  across groups), placed in the optimizer's layout on the device; divided by
  A in float32 where used (:func:`mean_grad`). The norm is that of the mean
  gradient in float32, taken as ‖sum‖ / A.
  """
  if layout.pipeline_size > 1:
    return _pipelined_grad_fn(cfg, layout, state_sh, model)
  remat = remat_wrapper(cfg.remat.policy)
  grad_dtype = dtype_of(cfg.zero.grad_dtype)
  specs = model.specs
  # Stages 2-3 reduce into their gradient shards, stage 1 into the optimizer's.
  reduced_sh = on_device(layout.tree_shardings(specs, layout.reduce_role))
  reduce_dtype = dtype_of(layout.reduce_dtype)
  master_on_device = on_device(state_sh.master)
  params_on_device = on_device(state_sh.params)
  # Offloaded weights stream: the decoder layers' shards stay in pinned_host and
  # move to the device one layer at a time (Layout.gather_for_compute).
  streams_weights = layout.params_memory == "pinned_host"
  # With gradient accumulation, each layer's gradient is added into the sum inside
  # the backward pass (one gradient-sized buffer), for a model that scans its layers
  # through Hooks.scan. Otherwise a micro-step's whole gradient is added after its
  # backward pass. With one micro-step that is the cheaper way: the gradient is then
  # built in the compute dtype and only the result widened to the grad dtype, where
  # the sum would be held in the grad dtype all through the backward pass.
  layers_key = model.layers_key
  accumulating = (None if layers_key is None
                  else accumulating_value_and_grad(model, cfg.precision.scales_loss))

  if cfg.precision.scales_loss:
    # float16: the gradient of loss x scale (jaxzero.engine.loss_scale), the loss itself as aux.
    def scaled(params, tokens, layout, remat, scale):
      loss = loss_fn(model, params, tokens, layout, remat)
      return loss * scale, loss
    value_and_grad = jax.value_and_grad(scaled, has_aux=True)
  else:
    value_and_grad = jax.value_and_grad(functools.partial(loss_fn, model))
  # Gradients kept apart per group of `local_axes` and reduced across them once
  # per step: per device for stages 0-1 (as DeepSpeed accumulates; with one
  # micro-step too, since the explicit reduce sends a tied embedding's two
  # gradients once, where XLA would reduce them apart); per replica group under
  # hybrid sharding, so that only gradient shards cross `replica`. A vmap over
  # a leading group axis that `spmd_axis_name` places one row per group does it.
  local_axes = layout.local_axes
  n_groups = math.prod(layout.mesh.shape[a] for a in local_axes)
  if local_axes:
    local_layout = dataclasses.replace(layout, vmapped_axes=local_axes)
    grouped = jax.vmap(lambda p, t, *scale: value_and_grad(p, t, local_layout, remat, *scale),
                       in_axes=(None, 0, None), spmd_axis_name=local_axes)
    vmapped = jax.vmap(lambda p, t: value_and_grad(p, t, local_layout, remat),
                       in_axes=(None, 0), spmd_axis_name=local_axes)
    grouped_grads = lambda p, t, *scale: grouped(p, t, *scale) if scale else vmapped(p, t)
    # Within a group, a gradient is whole (per device; split over `tensor` as its
    # weight is used) or in its reduce layout.
    compute_sh = layout.tree_shardings(specs, "compute")
    accum_sh = jax.tree.map(
        lambda r, c: local_sharding(layout, (r if layout.hybrid else c).spec), reduced_sh,
        compute_sh)
    accum_shape = lambda p: (n_groups, *p.shape)
  else:
    accum_sh, accum_shape = reduced_sh, lambda p: p.shape

  def micro_step(params, scale, per_layer, carry, batch):
    loss_sum, grad_sum = carry
    if local_axes:
      rows = tuple(a for a in AXES if a not in local_axes) or None
      grouped = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
          x.reshape(n_groups, -1, *x.shape[1:]),
          local_sharding(layout, P(rows, *[None] * (x.ndim - 1)))), batch)
      if per_layer:  # each group's sum is a row of the stacked sums
        losses_G, grads, layers_sum = jax.vmap(
            lambda p, t, acc, *s: accumulating(p, t, local_layout, remat, acc, *s),
            in_axes=(None, 0, 0, *[None] * len(scale)), spmd_axis_name=local_axes)(
                params, grouped, grad_sum[layers_key], *scale)
      else:
        losses_G, grads = grouped_grads(params, grouped, *scale)
      loss = _unscaled(losses_G).mean()  # equal rows per group: the mean of means is the mean
    elif per_layer:
      # Stages 2-3 accumulate into sharded buffers: each reduce is a reduce-scatter.
      # (Layout.gather_for_compute makes each gradient leave the layer reduced.)
      loss, grads, layers_sum = accumulating(params, batch, layout, remat,
                                             grad_sum[layers_key], *scale)
      loss = _unscaled(loss)
    else:
      loss, grads = value_and_grad(params, batch, layout, remat, *scale)
      loss = _unscaled(loss)
    if streams_weights:
      # The gradient of a weight left in pinned_host is typed pinned_host: each
      # layer's shard went down as the backward pass produced it; added up here.
      # (Accumulated in the backward pass, the layers' sum is already on the device.)
      # In the layout of the sum: under hybrid sharding, one row per replica group.
      grads = jax.device_put(grads, {k: accum_sh[k] for k in grads} if per_layer else accum_sh)
    grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    if per_layer:  # the layers' sum is already the new one
      grad_sum = {k: layers_sum if k == layers_key
                  else jax.tree.map(jnp.add, grad_sum[k], grads[k]) for k in grad_sum}
    else:
      grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
    grad_sum = jax.lax.with_sharding_constraint(grad_sum, accum_sh)
    return (loss_sum + loss, grad_sum), None

  def grad_fn(params, batch_Ax, *scale):
    """`scale`, under float16 only: the loss scale (the sum and the norm are then
    of the scaled gradients, and the norm unscaled)."""
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    if streams_weights:  # the embedding, head and final norm come over now
      params = {k: v if k == layers_key else jax.device_put(v, params_on_device[k])
                for k, v in params.items()}
    else:
      params = jax.device_put(params, params_on_device)
    zeros = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda p: jnp.zeros(accum_shape(p), grad_dtype), params), accum_sh)
    (loss_sum, grad_sum), _ = jax.lax.scan(
        functools.partial(micro_step, params, scale, layers_key is not None and accum > 1),
        (jnp.zeros((), jnp.float32), zeros),
        batch_Ax)
    if local_axes:  # the one reduce across groups (stage 1: into shards), in reduce_dtype
      grad_sum = jax.tree.map(
          lambda g, sh: jax.lax.with_sharding_constraint(g.astype(reduce_dtype).sum(axis=0), sh)
          .astype(jnp.float32) / n_groups, grad_sum, master_on_device)
    # To the optimizer's layout: for stage 1 a reduce-scatter or a local slice.
    grad_sum = jax.lax.with_sharding_constraint(grad_sum, master_on_device)
    # The norm of the sum, divided as a scalar: dividing every element first would
    # cost a pass over the gradients (on XLA:CPU a float32 copy of them).
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grad_sum)) / accum
    if scale:
      grad_norm = grad_norm / scale[0]
    return grad_sum, loss_sum / accum, grad_norm

  return grad_fn


def _pipelined_grad_fn(cfg: Config, layout: Layout, state_sh: TrainState, model: Model):
  """make_grad_fn's function with the layer stack pipelined over ``mesh.pipeline`` stages
  (jaxzero.engine.pipeline), the step's A micro-batches flowing through them. GPipe and
  interleaved: one pass of A x B rows, whose mean loss times A has, as its gradient, the
  sum of the A micro-steps' gradients (the sum make_grad_fn returns); 1F1B returns that
  sum itself."""
  remat = remat_wrapper(cfg.remat.policy)
  grad_dtype = dtype_of(cfg.zero.grad_dtype)
  master_on_device = on_device(state_sh.master)
  params_on_device = on_device(state_sh.params)
  stages = layout.pipeline_size

  def loss(params, rows, accum, *scale):
    scan = pipeline.gpipe_scan(stages, accum, pipeline.stage_constraint(layout.mesh),
                               cfg.pipeline.virtual_stages)
    value = loss_fn(model, params, rows, layout, remat, scan=scan)
    return value * accum * (scale[0] if scale else 1), value

  grad = jax.grad(loss, has_aux=True)

  def model_loss(params, batch, scan):
    return loss_fn(model, params, batch, layout, remat, scan=scan)

  def summed_grads(params, batch_Ax, *scale):  # (the micro-batches' gradient sum, mean loss)
    if cfg.pipeline.schedule == "1f1b":  # each stage's layer gradients summed reduced
      layer_reduce_specs = jax.tree.map(lambda sh: sh.spec, layout.tree_shardings(
          model.specs[model.layers_key], layout.reduce_role))
      return one_f_one_b.one_f_one_b(model_loss, model.layers_key, stages, layout.mesh,
                                     layer_reduce_specs, grad_dtype, params, batch_Ax, *scale)
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    # Row b x A + a is micro-batch a's row b (the scan's order): each device keeps its rows.
    rows = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), batch_Ax)
    return grad(params, rows, accum, *scale)

  def grad_fn(params, batch_Ax, *scale):
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    grads, mean_loss = summed_grads(jax.device_put(params, params_on_device), batch_Ax, *scale)
    grad_sum = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda g: g.astype(grad_dtype), grads), master_on_device)
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grad_sum)) / accum
    if scale:
      grad_norm = grad_norm / scale[0]
    return grad_sum, mean_loss, grad_norm

  return grad_fn


def _unscaled(value_and_aux):
  """The loss from value_and_grad's value: under loss scaling it is the aux."""
  return value_and_aux[1] if isinstance(value_and_aux, tuple) else value_and_aux


def make_train_step(cfg: Config, layout: Layout, state_sh: TrainState, model: Model,
                    unclipped: optax.GradientTransformation, schedule=None):
  """Returns the jitted step: (state, batch [A, B, ...]) -> (state, metrics).

  `unclipped` is the optimizer less its clipping (the step clips by the norm it
  computes); `schedule`, where known, gives the `lr` metric.
  """
  grad_fn = make_grad_fn(cfg, layout, state_sh, model)
  compute = dtype_of(cfg.precision.compute)
  optimizer_on_host = layout.optimizer_memory == "pinned_host"

  def update(grad_sum, grad_norm, master, opt_state, finite, accum, scale=None):
    """AdamW on the master weights; the new compute copy cast from them.

    A non-finite loss or gradient never reaches the state: the update is
    dropped (every process computes the same global flag, so all agree) and
    the loop decides, by train.nonfinite, whether to stop or go on. A cond,
    not a select of new against old: the update then runs in place, without
    a second copy of the optimizer state (12Φ/N) among the temporaries.
    """
    def apply(grad_sum, master, opt_state):
      # Clipped by the norm already computed for the metrics: the gradients are
      # not read a second time, and on the host optax's own norm cannot be
      # traced (jax.numpy's real-array `.imag` is a device constant).
      grads = mean_grad(grad_sum, accum)
      if scale is not None:  # float16: unscaled before clipping
        grads = jax.tree.map(lambda g: g / scale, grads)
      if cfg.train.clip_norm > 0:
        grads = clip_by_norm(grads, grad_norm, cfg.train.clip_norm)
      clip_state, inner_state = split_clip(cfg, opt_state)
      updates, inner_state = unclipped.update(grads, inner_state, master)
      return optax.apply_updates(master, updates), join_clip(clip_state, inner_state)

    master, opt_state = jax.lax.cond(finite, apply, lambda _, *old: old, grad_sum, master,
                                     opt_state)
    return master, opt_state, jax.tree.map(lambda w: w.astype(compute), master)

  if optimizer_on_host:
    # ZeRO-Offload: the update runs where the state lives. The gradient shards
    # go down to the host, AdamW runs there, and only the new compute copy
    # comes back; no master or moment leaf is ever moved to the device.
    grads_on_host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), state_sh.master)

    def host_update(grad_sum, grad_norm, master, opt_state, finite, accum, *scale):
      run = functools.partial(_on_host, lambda *a: update(*a[:5], accum, *a[5:]))
      return run(grad_sum, grad_norm, master, opt_state, finite, *scale)
  # The new compute copy leaves a host update in the optimizer's layout (its
  # shards: 2Φ/N up).
  cast_on_device = on_device(state_sh.master)

  def train_step(state: TrainState, batch_Ax):
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    scale = () if state.loss_scale is None else (state.loss_scale.scale,)
    grad_sum, loss, grad_norm = grad_fn(state.params, batch_Ax, *scale)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if optimizer_on_host:
      master, opt_state, params = host_update(jax.device_put(grad_sum, grads_on_host),
                                              grad_norm, state.master, state.opt_state, finite,
                                              accum, *scale)
      if layout.params_memory != "pinned_host":  # (else stage 3: already where it rests)
        params = jax.device_put(params, cast_on_device)
    else:
      master, opt_state, params = update(grad_sum, grad_norm, state.master, state.opt_state,
                                         finite, accum, *scale)
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
    if schedule is not None:
      metrics["lr"] = schedule(applied_updates(state.step, state.loss_scale))
    new_scale = state.loss_scale
    if new_scale is not None:
      new_scale, scale_metrics = loss_scale.after_step(new_scale, loss, grad_norm, cfg.precision)
      metrics.update(scale_metrics)
    # The step's out_shardings place the new compute copy by the params' layout:
    # for stages 1-2 an all-gather of the cast (compute dtype) shards.
    new_state = TrainState(state.step + 1, params, master, opt_state, new_scale)
    return new_state, metrics

  batch_sh = layout.batch_sharding(leading_dims=1)
  return jax.jit(train_step, in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, layout.replicated()), donate_argnums=0)


def _on_host(fn, *args):
  """`fn(*args)` computed on the host, its outputs left in host memory. JAX from 0.11
  spells the function transform `compute_on` (before, a context manager);
  earlier JAX has it as `compute_on2`."""
  transform = compute_on_lib.compute_on
  if "out_memory_spaces" not in inspect.signature(transform).parameters:
    transform = compute_on_lib.compute_on2
  return transform(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)
