"""The training program: everything one config on one layout derives, built once per run.

The optimizer, the state's shardings and shapes, the initialiser (the state is created
directly into its shards: no device ever holds a full model) and the jitted step
(jaxzero.engine.step). Every runner (jaxzero.runners) trains with one; the in-memory
runner runs its step as it is.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxzero.config import Config
from jaxzero.data import sft
from jaxzero.engine import loss_scale
from jaxzero.engine import state_bytes as state_bytes_lib
from jaxzero.engine.lr_schedule import learning_rate_schedule
from jaxzero.engine.optimizer import make_optimizer
from jaxzero.engine.state import TrainState, abstract_state, dtype_of, state_shardings
from jaxzero.engine.step import make_grad_fn, make_train_step
from jaxzero.models.interface import Model, is_spec
from jaxzero.parallel import padding as padding_lib
from jaxzero.parallel.zero import Layout, on_device


class TrainProgram:
  """The train step's pieces for one model, config and layout, built once.

  Attributes:
    model: the model as trained (jaxzero.models.interface.Model): the given one with
      its unshardable leaves padded (jaxzero.parallel.padding).
    padding: each parameter's true and stored shape.
    tx: the optimizer: `optimizer` (else AdamW on cfg.train's schedule), after
      global-norm clipping when cfg.train.clip_norm > 0.
    inner: `tx` less its clipping (the step clips by the norm it computes).
    shardings: a TrainState of NamedShardings, where each leaf lives at rest.
    abstract: a TrainState of ShapeDtypeStructs (no sharding), for byte counts.
    train_step: the jitted step, (state, batch [A, B, ...]) -> (state, metrics).
  """

  def __init__(self, cfg: Config, layout: Layout, model: Model,
               optimizer: optax.GradientTransformation | None = None):
    # Leaves no dimension of which divides the sharding devices are stored padded.
    self.unpadded_model = model
    self.model, self.padding = padding_lib.pad_model(model, layout)
    self.cfg, self.layout = cfg, layout
    schedule = None
    if optimizer is None:
      self.inner = make_optimizer(cfg, clip=False, decay=self.model.decay)
      schedule = learning_rate_schedule(cfg)
    else:
      self.inner = optimizer
    self.schedule = schedule  # the learning rate by update, where the optimizer is the config's
    clip = cfg.train.clip_norm
    self.tx = optax.chain(optax.clip_by_global_norm(clip), self.inner) if clip > 0 else self.inner
    self.shardings, self.abstract = state_shardings(cfg, layout, self.tx, self.model)
    self.train_step = make_train_step(cfg, layout, self.shardings, self.model, self.inner,
                                      schedule)

  @functools.cached_property
  def grad_step(self):
    """Jitted (params, tokens [A, B, T+1], scale[, frozen]) -> (gradient sum, loss,
    norm): the step without its update, for an optimizer that runs outside it (see
    jaxzero.engine.step.make_grad_fn; divide the sum by A with
    jaxzero.engine.optimizer.mean_grad). `scale`: float16's loss scale, else None;
    `frozen`: the state's frozen leaves, for a model that has them."""
    if self.model.keyed_rows:  # (the config refuses LoRA with optimizer offload)
      raise ValueError("a model that draws randomness per row (Model.keyed_rows: LoRA "
                       "dropout) trains through the device step (train_step) only")
    grads_sh = on_device(self.shardings.master)
    replicated = self.layout.replicated()
    frozen = () if self.shardings.frozen is None else (self.shardings.frozen,)
    return jax.jit(make_grad_fn(self.cfg, self.layout, self.shardings, self.model),
                   in_shardings=(self.shardings.params, self.batch_sharding, replicated,
                                 *frozen),
                   out_shardings=(grads_sh, replicated, replicated))

  def state_bytes(self) -> dict[str, int]:
    """Per-device bytes of the state by role, in pinned_host, and moved between host and
    device per step (jaxzero.engine.state_bytes)."""
    return state_bytes_lib.state_bytes(self)

  @property
  def n_params(self) -> int:
    """Φ: the model's parameter count (without padding)."""
    return sum(math.prod(s) for s in padding_lib.Padding.flat(self.padding.true_shapes))

  @property
  def n_frozen(self) -> int:
    """The model's frozen parameters (Model.frozen_specs: a LoRA base, quantized or
    not), 0 for most."""
    specs = jax.tree.leaves(self.model.frozen_specs, is_leaf=is_spec)
    return sum(math.prod(s.shape) * getattr(s, "params_per_element", 1) for s in specs)

  @property
  def frozen_bytes(self) -> int:
    """All the frozen leaves' bytes, unsharded (as stored: quantized parts included)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.abstract.frozen))

  @functools.cached_property
  def true_abstract(self) -> TrainState:
    """`abstract` at the model's true shapes: what checkpoints and readers see of a
    state whose leaves are stored padded (the same as `abstract` where none is)."""
    if not self.padding.any:
      return self.abstract
    # (Shapes only: placing the true shapes would say, falsely, they are replicated.)
    return abstract_state(self.cfg, self.tx, self.unpadded_model)

  def abstract_state(self) -> TrainState:
    """The state as shapes carrying their shardings: a restore target, or a
    stand-in for compiling ahead of time. Nothing is allocated."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self.abstract, self.shardings)

  def abstract_batch(self, micro_batch: int) -> Any:
    """A step's batch as shapes: token windows, or a fine-tuning format's dict of them."""
    t, d = self.cfg.train, self.cfg.data
    shape = (t.grad_accum, micro_batch * self.layout.data_parallel_size, t.seq_len + 1)
    array = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
    return array if d.format == "text" else dict.fromkeys(sft.batch_keys(d.packing), array)

  @property
  def batch_sharding(self):
    """Of a step's tokens [A, B, T+1]: rows over every data-parallel device."""
    return self.layout.batch_sharding(leading_dims=1)

  def compute_copy(self, master: Any) -> Any:
    """The compute-dtype weights cast from `master` (fp32, placed by ``shardings.master``),
    as init and every step make them; placed by ``shardings.params``."""
    compute = dtype_of(self.cfg.precision.compute)
    return jax.jit(lambda master: jax.tree.map(lambda w: w.astype(compute), master),
                   out_shardings=self.shardings.params)(master)

  def init(self, master: Any = None, key: jax.Array | None = None,
           frozen: Any = None) -> TrainState:
    """Step 0, created directly into its shards: no device holds a full model.

    Args:
      master: fp32 master weights already placed by ``shardings.master`` (e.g.
        read from a Hugging Face checkpoint); None draws random weights from
        `key` (default: from ``cfg.seed``). The compute copy is cast from them
        and the optimizer starts from its own init.
      frozen: a model's frozen leaves (Model.frozen_specs) placed by
        ``shardings.frozen`` (e.g. a LoRA base read from Hugging Face), consumed; None
        draws them with ``Model.frozen_init``. (With frozen leaves `key` is split in
        two: one for them, one for the trained parameters.)
    """
    cfg, sh, tx, model = self.cfg, self.shardings, self.tx, self.model
    compute = dtype_of(cfg.precision.compute)
    key = jax.random.key(cfg.seed) if key is None else key
    frozen_key, master_key = jax.random.split(key)

    def derive(master, frozen):
      # Offloaded (pinned_host) master weights are used on the device, as in the step;
      # fp32 whatever a model's init drew them in (a bf16 init of one's own).
      master = jax.tree.map(lambda w: w.astype(jnp.float32),
                            jax.device_put(master, on_device(sh.master)))
      params = jax.tree.map(lambda w: w.astype(compute), master)
      if model.frozen_specs is not None:
        frozen = model.frozen_init(frozen_key) if frozen is None else frozen
        frozen = jax.tree.map(lambda w, a: w.astype(a.dtype), frozen, self.abstract.frozen)
      return TrainState(jnp.zeros((), jnp.int32), params, master, tx.init(master),
                        loss_scale.init(cfg.precision), frozen)

    if model.frozen_specs is None:  # the key as it always was
      master_key = key
    # The given frozen leaves are donated: a base is not held twice at start-up.
    if master is None:
      return jax.jit(lambda key, frozen: derive(model.init(key), frozen),
                     out_shardings=sh, donate_argnums=1)(master_key, frozen)
    return jax.jit(derive, out_shardings=sh, donate_argnums=1)(master, frozen)
