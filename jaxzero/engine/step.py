"""The jitted train step, composed: the layout's shardings, the mode's gradient, the update.

The layout (jaxzero.parallel.zero: the stage table on a mesh) places every leaf;
jaxzero.engine.gradients gives the gradient sum of the mode (micro-steps, GPipe,
1F1B), :func:`with_norm` its global norm; jaxzero.engine.update applies the optimizer
(a state kept off the device is updated by its runner: jaxzero.runners). The float16
loss scale is one explicit argument, read from the state. After each update the master
weights are cast to the compute dtype and placed by the ``params`` role. A batch is any
pytree of arrays [A, B, ...]: A micro-steps of B rows; for a model that draws
randomness (Model.keyed_rows) the step adds a key per row (:func:`keyed_batch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxzero.config import Config
from jaxzero.engine import gradients, loss_scale, update
from jaxzero.engine.state import TrainState
from jaxzero.models.interface import KeyedBatch, Model
from jaxzero.parallel.zero import Layout, on_device


def with_norm(grad_sum_fn: gradients.GradSum, state_sh: TrainState):
  """(params, batch [A, B, ...], scale=None, frozen=None) -> (the gradient sum in the optimizer's
  layout on the device, the mean loss, the mean gradient's norm in float32). The norm
  is ‖sum‖ / A (dividing every element first would cost a pass over the gradients; on
  XLA:CPU a float32 copy), unscaled where `scale` is given."""
  master_on_device = on_device(state_sh.master)

  def grad_fn(params, batch_Ax, scale=None, frozen=None):
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    grad_sum, loss = grad_sum_fn(params, batch_Ax, scale, frozen)
    # To the optimizer's layout: for stage 1 a reduce-scatter or a local slice.
    grad_sum = jax.lax.with_sharding_constraint(grad_sum, master_on_device)
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grad_sum)) / accum
    return grad_sum, loss, grad_norm if scale is None else grad_norm / scale
  return grad_fn


def make_grad_fn(cfg: Config, layout: Layout, state_sh: TrainState, model: Model):
  """The step without its update: see :func:`with_norm`."""
  return with_norm(gradients.for_mode(cfg, layout, state_sh, model), state_sh)


# The stream of the run's seed that row keys are drawn from: a constant no split of the
# seed's key (the init's) gives.
ROW_KEYS_STREAM = 0x524F57


def keyed_batch(batch_Ax, seed: int, step, layout: Layout) -> KeyedBatch:
  """`batch_Ax` [A, B, ...] with a key per row (Model.keyed_rows): row a B + b's key is
  the (a B + b)-th of the step's keys, a function of the seed, the step and the row's
  place in the global batch alone. (With JAX's partitionable threefry, the default, the
  drawn values do not depend on how the computation is split either.)"""
  A, B = jax.tree.leaves(batch_Ax)[0].shape[:2]
  step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), ROW_KEYS_STREAM), step)
  keys = jax.random.key_data(jax.random.split(step_key, A * B)).reshape(A, B, -1)
  return KeyedBatch(batch_Ax, jax.lax.with_sharding_constraint(
      keys, layout.batch_sharding(leading_dims=1)))


def make_train_step(cfg: Config, layout: Layout, state_sh: TrainState, model: Model,
                    unclipped: optax.GradientTransformation, schedule=None):
  """The jitted step: (state, batch [A, B, ...]) -> (state, metrics). `unclipped` is the
  optimizer less its clipping (the step clips by the norm it computes); `schedule`,
  where known, gives the `lr` metric."""
  grad_fn = make_grad_fn(cfg, layout, state_sh, model)
  apply = update.make_update(cfg, unclipped)

  def train_step(state: TrainState, batch_Ax):
    accum = jax.tree.leaves(batch_Ax)[0].shape[0]
    scale = None if state.loss_scale is None else state.loss_scale.scale
    if model.keyed_rows:
      batch_Ax = keyed_batch(batch_Ax, cfg.seed, state.step, layout)
    grad_sum, loss, grad_norm = grad_fn(state.params, batch_Ax, scale, state.frozen)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    master, opt_state, params = apply(grad_sum, grad_norm, state.master, state.opt_state,
                                      finite, accum, scale)
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
    if schedule is not None:
      metrics["lr"] = schedule(loss_scale.applied_updates(state.step, state.loss_scale))
    new_scale = state.loss_scale
    if new_scale is not None:
      new_scale, scale_metrics = loss_scale.after_step(new_scale, loss, grad_norm, cfg.precision)
      metrics.update(scale_metrics)
    # The out_shardings place the new compute copy by the params' layout: for stages
    # 1-2 an all-gather of the cast (compute dtype) shards.
    return TrainState(state.step + 1, params, master, opt_state, new_scale,
                      state.frozen), metrics

  return jax.jit(train_step, in_shardings=(state_sh, layout.batch_sharding(leading_dims=1)),
                 out_shardings=(state_sh, layout.replicated()), donate_argnums=0)
