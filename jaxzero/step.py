"""The train state, its sharded initialisation, and the jitted train step.

The state follows DeepSpeed's mixed-precision split:

* ``params``: the compute copy of the weights (bf16 or fp32), placed by the
  stage's ``params`` role (replicated for stages 0-2, sharded for stage 3);
* ``master``: the fp32 master weights, and ``opt_state``: AdamW's moments,
  both placed by the ``optimizer`` role (sharded from stage 1 on).

After each update the new master weights are cast to the compute dtype and
placed by the ``params`` role, which for stages 1-2 is the all-gather of the
updated shards.

Gradient accumulation: stages 2-3 reduce-scatter each micro-step into sharded
buffers (that is their memory saving). Stages 0-1 keep each device's gradient
unreduced across micro-steps and reduce once per step, as DeepSpeed does; for
stage 1 that one reduce lands directly in the optimizer's shards. Under hybrid
sharding the reduce-scatter stays inside ``fsdp`` and the shards are reduced
across ``replica`` once per step. The loss runs over vocabulary chunks
(models.loss), so no [B, T, V] float32 logits exist.

Fourth stop of the config's path (after ``zero``, before ``trainer``): an
:class:`Engine` is built once per run from the config and the Layout, and
holds everything derived from them: the optimizer, the state's shardings and
shapes, the initialiser and the jitted step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxzero.config import Config
from jaxzero.remat import remat_wrapper
from jaxzero.mesh import AXES
from jaxzero.zero import Layout, local_sharding, on_device
from models.llama import Llama, is_param_spec, param_specs
from models.loss import cross_entropy

# Vocabulary entries per chunk of the loss: V = 128256 gives 16 chunks of 8016,
# whose float32 logits are B x T x 8016 x 4 bytes (263 MB for seq 8192, B 1).
LOSS_CHUNK = 8192


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # compute copy, compute dtype
  master: Any  # fp32 master weights
  opt_state: Any  # optax state over `master`


def dtype_of(name: str):
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
  """The learning rate of each optimizer update (counted from 0), per train.schedule.

  DeepSpeed's schedules are tabulated per update in float64 from its own
  formulas (jaxzero.deepspeed.learning_rates) and rounded once to float32: a
  float32 evaluation of its log warmup and cosine would drift past 1e-7 of
  DeepSpeed's values. Past the table every one of them is constant. The table
  is a constant of the compiled step (4 bytes a step: 4 MB for a million).
  """
  t = cfg.train
  if t.schedule == "warmup_cosine":
    warmup = min(t.warmup_steps, t.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)
  from jaxzero import deepspeed  # pylint: disable=import-outside-toplevel
  lr_by_update = deepspeed.learning_rates(t)  # float32, one per update
  last = lr_by_update.shape[0] - 1
  return lambda count: jnp.asarray(lr_by_update)[jnp.minimum(count, last)]


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  t = cfg.train
  schedule = learning_rate_schedule(cfg)
  if t.optimizer == "adamw":
    adam = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                       mask=_decay_mask)
  else:
    # Adam with L2 regularisation: the decay term joins the gradient before the
    # moments see it, as torch.optim.Adam and DeepSpeed's adam_w_mode=false do.
    adam = optax.chain(optax.add_decayed_weights(t.weight_decay, mask=_decay_mask),
                       optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps),
                       optax.scale_by_learning_rate(schedule))
  if t.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(t.clip_norm), adam)
  return adam


def _decay_mask(params):
  # As in Llama and most LM recipes: no weight decay on norm gains.
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "norm" not in jax.tree_util.keystr(path), params)


class Engine:
  """The train step's pieces for one config on one layout, built once.

  Attributes:
    tx: the optimizer (AdamW, clipping, schedule).
    shardings: a TrainState of NamedShardings, where each leaf lives at rest.
    abstract: a TrainState of ShapeDtypeStructs (no sharding), for byte counts.
    train_step: the jitted step, (state, tokens [A, B, T+1]) -> (state, metrics).
  """

  def __init__(self, cfg: Config, layout: Layout):
    self.cfg, self.layout = cfg, layout
    self.tx = make_optimizer(cfg)
    self.shardings, self.abstract = _state_shardings(cfg, layout, self.tx)
    self.train_step = _make_train_step(cfg, layout, self.tx, self.shardings)

  def abstract_state(self) -> TrainState:
    """The state as shapes carrying their shardings: a restore target, or a
    stand-in for compiling ahead of time. Nothing is allocated."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self.abstract, self.shardings)

  def abstract_batch(self, micro_batch: int) -> jax.ShapeDtypeStruct:
    t = self.cfg.train
    shape = (t.grad_accum, micro_batch * self.layout.data_parallel_size, t.seq_len + 1)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

  @property
  def batch_sharding(self):
    """Of a step's tokens [A, B, T+1]: rows over every data-parallel device."""
    return self.layout.batch_sharding(leading_dims=1)

  def init(self, master: Any = None) -> TrainState:
    """Step 0, created directly into its shards: no device holds a full model.

    Args:
      master: fp32 master weights already placed by ``shardings.master`` (e.g.
        read from a Hugging Face checkpoint); None draws random weights from
        ``cfg.seed``. The compute copy is cast from them and Adam starts at zero.
    """
    cfg, sh, tx = self.cfg, self.shardings, self.tx
    compute = dtype_of(cfg.precision.compute)

    def derive(master):
      # Offloaded (pinned_host) master weights are used on the device, as in the step.
      master = jax.device_put(master, on_device(sh.master))
      params = jax.tree.map(lambda w: w.astype(compute), master)
      return TrainState(jnp.zeros((), jnp.int32), params, master, tx.init(master))

    if master is None:
      def init():
        model = Llama(cfg.model, rngs=nnx.Rngs(params=cfg.seed))
        return derive(nnx.to_pure_dict(nnx.split(model, nnx.Param)[1]))
      return jax.jit(init, out_shardings=sh)()
    return jax.jit(derive, out_shardings=sh)(master)


def _state_shardings(cfg: Config, layout: Layout, tx: optax.GradientTransformation
                     ) -> tuple[TrainState, TrainState]:
  """(shardings, abstract shapes) of every train-state leaf; allocates nothing."""
  specs = param_specs(cfg.model)
  compute = dtype_of(cfg.precision.compute)
  abstract_master = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs,
                                 is_leaf=is_param_spec)
  abstract = TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32),
      params=jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, compute), abstract_master),
      master=abstract_master,
      opt_state=jax.eval_shape(tx.init, abstract_master))
  master_sh = layout.tree_shardings(specs, "optimizer")
  opt_sh = optax.tree_map_params(
      tx, lambda _, sharding: sharding, abstract.opt_state, master_sh,
      transform_non_params=lambda _: layout.replicated("optimizer"),
      is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
  shardings = TrainState(step=layout.replicated("grads"),
                         params=layout.tree_shardings(specs, "params"),
                         master=master_sh, opt_state=opt_sh)
  return shardings, abstract


def loss_fn(graphdef, params, tokens_BxT1: jax.Array, layout: Layout, remat) -> jax.Array:
  """Mean next-token cross-entropy over a batch of sequences of T+1 tokens."""
  model = nnx.merge(graphdef, params)
  x_BxTxD, head_DxV = model.forward(tokens_BxT1[:, :-1], shard=layout.shard_activation,
                                    gather=layout.gather_for_compute, remat=remat)
  return cross_entropy(x_BxTxD, head_DxV, tokens_BxT1[:, 1:], chunk=LOSS_CHUNK,
                       shard=layout.shard_activation)


def model_graphdef(cfg: Config):
  abstract_model = nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0)))
  return nnx.split(abstract_model, nnx.Param)[0]


def _make_train_step(cfg: Config, layout: Layout, tx: optax.GradientTransformation,
                     state_sh: TrainState):
  """Returns the jitted step: (state, tokens [A, B, T+1]) -> (state, metrics).

  A is the number of gradient-accumulation micro-steps; B the global
  micro-batch (split over every data-parallel device).
  """
  graphdef = model_graphdef(cfg)
  remat = remat_wrapper(cfg.remat.policy)
  grad_dtype = dtype_of(cfg.zero.grad_dtype)
  specs = param_specs(cfg.model)
  # Stages 2-3 reduce into their gradient shards, stage 1 into the optimizer's.
  reduced_sh = on_device(layout.tree_shardings(specs, layout.reduce_role))
  reduce_dtype = dtype_of(layout.reduce_dtype)
  master_on_device = on_device(state_sh.master)
  opt_on_device = on_device(state_sh.opt_state)
  params_on_device = on_device(state_sh.params)
  schedule = learning_rate_schedule(cfg)

  value_and_grad = jax.value_and_grad(functools.partial(loss_fn, graphdef))
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
    grouped_grads = jax.vmap(lambda p, t: value_and_grad(p, t, local_layout, remat),
                             in_axes=(None, 0), spmd_axis_name=local_axes)
    # Within a group, a gradient is whole (per device; split over `tensor` as its
    # weight is used) or in its reduce layout.
    compute_sh = layout.tree_shardings(specs, "compute")
    accum_sh = jax.tree.map(
        lambda r, c: local_sharding(layout, (r if layout.hybrid else c).spec), reduced_sh,
        compute_sh)
    accum_shape = lambda p: (n_groups, *p.shape)
  else:
    accum_sh, accum_shape = reduced_sh, lambda p: p.shape

  def micro_step(params, carry, tokens_BxT1):
    loss_sum, grad_sum = carry
    if local_axes:
      tokens_GxbxT1 = jax.lax.with_sharding_constraint(
          tokens_BxT1.reshape(n_groups, -1, tokens_BxT1.shape[-1]),
          local_sharding(layout, P(tuple(a for a in AXES if a not in local_axes) or None, None)))
      losses_G, grads = grouped_grads(params, tokens_GxbxT1)
      loss = losses_G.mean()  # equal rows per group: the mean of means is the mean
    else:
      # Stages 2-3 accumulate into sharded buffers: each reduce is a reduce-scatter.
      # (Layout.gather_for_compute makes each gradient leave the layer reduced.)
      loss, grads = value_and_grad(params, tokens_BxT1, layout, remat)
    grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    grad_sum = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grad_sum, grads),
                                                accum_sh)
    return (loss_sum + loss, grad_sum), None

  def train_step(state: TrainState, tokens_AxBxT1: jax.Array):
    accum = tokens_AxBxT1.shape[0]
    params = jax.device_put(state.params, params_on_device)
    zeros = jax.lax.with_sharding_constraint(
        jax.tree.map(lambda p: jnp.zeros(accum_shape(p), grad_dtype), params), accum_sh)
    (loss_sum, grad_sum), _ = jax.lax.scan(
        functools.partial(micro_step, params), (jnp.zeros((), jnp.float32), zeros),
        tokens_AxBxT1)
    if local_axes:  # the one reduce across groups (stage 1: into shards), in reduce_dtype
      grad_sum = jax.tree.map(
          lambda g, sh: jax.lax.with_sharding_constraint(g.astype(reduce_dtype).sum(axis=0), sh)
          .astype(jnp.float32) / n_groups, grad_sum, master_on_device)
    # To the optimizer's layout: for stage 1 a reduce-scatter or a local slice.
    # Widened to float32 where used (the norm; the update), never all at once.
    as_f32 = lambda grad_sum: jax.lax.with_sharding_constraint(
        jax.tree.map(lambda g: g.astype(jnp.float32) / accum, grad_sum), master_on_device)
    grad_norm = optax.tree.norm(as_f32(grad_sum))
    loss = loss_sum / accum
    master = jax.device_put(state.master, master_on_device)
    opt_state = jax.device_put(state.opt_state, opt_on_device)
    # A non-finite loss or gradient never reaches the state: the update is
    # dropped (every process computes the same global flag, so all agree) and
    # the loop decides, by train.nonfinite, whether to stop or go on. A cond,
    # not a select of new against old: the update then runs in place, without
    # a second copy of the optimizer state (12Φ/N) among the temporaries.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(grad_sum, master, opt_state):
      updates, opt_state = tx.update(as_f32(grad_sum), opt_state, master)
      return optax.apply_updates(master, updates), opt_state

    master, opt_state = jax.lax.cond(finite, update, lambda _, *old: old, grad_sum, master,
                                     opt_state)
    compute = dtype_of(cfg.precision.compute)
    params = jax.tree.map(lambda w: w.astype(compute), master)
    new_state = TrainState(state.step + 1, params, master, opt_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
               "nonfinite": (~finite).astype(jnp.int32)}
    return new_state, metrics

  batch_sh = layout.batch_sharding(leading_dims=1)
  return jax.jit(train_step, in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, layout.replicated()), donate_argnums=0)

