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
from jax.experimental.compute_on import compute_on
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


def make_optimizer(cfg: Config, clip: bool = True) -> optax.GradientTransformation:
  """AdamW (or Adam with L2) on the schedule, after global-norm clipping.

  `clip=False` leaves the clipping out (the state has the same leaves): the
  train step clips with :func:`clip_by_norm` by the norm it already computed.
  """
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
  if clip and t.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(t.clip_norm), adam)
  return adam


def clip_by_norm(grads: Any, grad_norm: jax.Array, max_norm: float) -> Any:
  """optax.clip_by_global_norm with the norm already computed, the scale applied
  as one multiply (g x max_norm/norm, as torch's clip_grad_norm_ does) where
  optax divides then multiplies: XLA recomputes a multiply inside each moment's
  update, but materialises a divide, a float32 clipped gradient per leaf
  (up to 4 bytes x Φ/N of temporaries at the update)."""
  trigger = grad_norm < max_norm
  return jax.tree.map(
      lambda g: jax.lax.select(trigger, g, g * (max_norm / grad_norm).astype(g.dtype)), grads)


def split_clip(cfg: Config, opt_state: Any) -> tuple[Any, Any]:
  """(the clipping's state or None, the state of `make_optimizer(cfg, clip=False)`)."""
  if cfg.train.clip_norm > 0:
    return opt_state[0], opt_state[1]
  return None, opt_state


def join_clip(clip_state: Any, inner_state: Any) -> Any:
  return inner_state if clip_state is None else (clip_state, inner_state)


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
    self.train_step = _make_train_step(cfg, layout, self.shardings)

  @functools.cached_property
  def grad_step(self):
    """Jitted (params, tokens [A, B, T+1]) -> (gradient sum, loss, norm): the
    step without its update, for an optimizer that runs outside it (see
    :func:`_make_grad_fn`; divide the sum by A with :func:`mean_grad`)."""
    grads_sh = on_device(self.shardings.master)
    return jax.jit(_make_grad_fn(self.cfg, self.layout, self.shardings),
                   in_shardings=(self.shardings.params, self.batch_sharding),
                   out_shardings=(grads_sh, self.layout.replicated(), self.layout.replicated()))

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
      # Scalars (Adam's step count) stay on the device even when the moments are
      # offloaded: the update on the host reads it from there.
      transform_non_params=lambda _: layout.replicated("grads"),
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


def _make_grad_fn(cfg: Config, layout: Layout, state_sh: TrainState):
  """(params, tokens [A, B, T+1]) -> (gradient sum, mean loss, gradient norm).

  A is the number of gradient-accumulation micro-steps; B the global
  micro-batch (split over every data-parallel device). The gradient sum is
  over the A micro-steps, in the grad dtype (float32 where it was reduced
  across groups), placed in the optimizer's layout on the device; divided by
  A in float32 where used (:func:`mean_grad`). The norm is that of the mean
  gradient in float32.
  """
  graphdef = model_graphdef(cfg)
  remat = remat_wrapper(cfg.remat.policy)
  grad_dtype = dtype_of(cfg.zero.grad_dtype)
  specs = param_specs(cfg.model)
  # Stages 2-3 reduce into their gradient shards, stage 1 into the optimizer's.
  reduced_sh = on_device(layout.tree_shardings(specs, layout.reduce_role))
  reduce_dtype = dtype_of(layout.reduce_dtype)
  master_on_device = on_device(state_sh.master)
  params_on_device = on_device(state_sh.params)
  # Offloaded weights stream: the decoder layers' shards stay in pinned_host and
  # move to the device one layer at a time (Layout.gather_for_compute).
  streams_weights = layout.params_memory == "pinned_host"

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
    if streams_weights:
      # The gradient of a weight left in pinned_host is typed pinned_host: each
      # layer's shard went down as the backward pass produced it; added up here.
      grads = jax.device_put(grads, reduced_sh)
    grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
    grad_sum = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grad_sum, grads),
                                                accum_sh)
    return (loss_sum + loss, grad_sum), None

  def grad_fn(params, tokens_AxBxT1: jax.Array):
    accum = tokens_AxBxT1.shape[0]
    if streams_weights:  # the embedding, head and final norm come over now
      params = {k: v if k == "layers" else jax.device_put(v, params_on_device[k])
                for k, v in params.items()}
    else:
      params = jax.device_put(params, params_on_device)
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
    grad_sum = jax.lax.with_sharding_constraint(grad_sum, master_on_device)
    grad_norm = optax.tree.norm(mean_grad(grad_sum, accum))
    return grad_sum, loss_sum / accum, grad_norm

  return grad_fn


def mean_grad(grad_sum: Any, accum: int) -> Any:
  """The mean gradient in float32, from a sum over `accum` micro-steps. Widened
  where used (the norm; the update), never all at once."""
  return jax.tree.map(lambda g: g.astype(jnp.float32) / accum, grad_sum)


def _make_train_step(cfg: Config, layout: Layout, state_sh: TrainState):
  """Returns the jitted step: (state, tokens [A, B, T+1]) -> (state, metrics)."""
  grad_fn = _make_grad_fn(cfg, layout, state_sh)
  schedule = learning_rate_schedule(cfg)
  compute = dtype_of(cfg.precision.compute)
  optimizer_on_host = layout.optimizer_memory == "pinned_host"
  unclipped = make_optimizer(cfg, clip=False)  # Engine.tx less its clipping: same state

  def update(grad_sum, grad_norm, master, opt_state, finite, accum):
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
    host_update = compute_on("device_host")(jax.jit(update, static_argnums=5))
  # The new compute copy leaves a host update in the optimizer's layout (its
  # shards: 2Φ/N up).
  cast_on_device = on_device(state_sh.master)

  def train_step(state: TrainState, tokens_AxBxT1: jax.Array):
    accum = tokens_AxBxT1.shape[0]
    grad_sum, loss, grad_norm = grad_fn(state.params, tokens_AxBxT1)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if optimizer_on_host:
      master, opt_state, params = host_update(jax.device_put(grad_sum, grads_on_host),
                                              grad_norm, state.master, state.opt_state, finite,
                                              accum)
      if layout.params_memory != "pinned_host":  # (else stage 3: already where it rests)
        params = jax.device_put(params, cast_on_device)
    else:
      master, opt_state, params = update(grad_sum, grad_norm, state.master, state.opt_state,
                                         finite, accum)
    # The step's out_shardings place the new compute copy by the params' layout:
    # for stages 1-2 an all-gather of the cast (compute dtype) shards.
    new_state = TrainState(state.step + 1, params, master, opt_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
               "nonfinite": (~finite).astype(jnp.int32)}
    return new_state, metrics

  batch_sh = layout.batch_sharding(leading_dims=1)
  return jax.jit(train_step, in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, layout.replicated()), donate_argnums=0)

