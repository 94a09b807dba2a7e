"""The train state and where each of its leaves lives.

The state follows DeepSpeed's mixed-precision split:

* ``params``: the compute copy of the weights (bf16 or fp32), placed by the
  stage's ``params`` role (replicated for stages 0-2, sharded for stage 3);
* ``master``: the fp32 master weights, and ``opt_state``: the optimizer's
  moments, both placed by the ``optimizer`` role (sharded from stage 1 on).

A model's frozen leaves (``frozen``) have no master, moments or gradient.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxzero.config import Config
from jaxzero.engine import loss_scale
from jaxzero.models.interface import Model, is_spec
from jaxzero.parallel.zero import Layout

log = logging.getLogger(__name__)


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # compute copy, compute dtype
  master: Any  # fp32 master weights
  opt_state: Any  # optax state over `master`
  # float16 compute only: the loss scaler (jaxzero.engine.loss_scale). None has
  # no leaves, so the state and checkpoints of other runs are as they were.
  loss_scale: Any = None
  # Weights the model uses but does not train (Model.frozen_specs: a LoRA base), in
  # the compute dtype or their declared one (a quantized base's parts), placed by the
  # ``frozen`` role; None (no leaves) for other runs.
  frozen: Any = None


def dtype_of(name: str):
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def abstract_state(cfg: Config, tx: optax.GradientTransformation, model: Model) -> TrainState:
  """The shapes and dtypes of every train-state leaf (no placement); allocates nothing."""
  compute = dtype_of(cfg.precision.compute)
  abstract_master = jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s.shape), jnp.float32),
                                 model.specs, is_leaf=is_spec)
  return TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32),
      params=jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, compute), abstract_master),
      master=abstract_master,
      opt_state=jax.eval_shape(tx.init, abstract_master),
      loss_scale=loss_scale.abstract(cfg.precision),
      frozen=frozen_abstract(model, compute))


def state_shardings(cfg: Config, layout: Layout, tx: optax.GradientTransformation,
                    model: Model) -> tuple[TrainState, TrainState]:
  """(shardings, abstract shapes) of every train-state leaf; allocates nothing."""
  specs = model.specs
  abstract = abstract_state(cfg, tx, model)
  abstract_master = abstract.master
  master_sh = layout.tree_shardings(specs, "optimizer")
  # Scalars (Adam's step count) stay on the device even when the moments are offloaded:
  # the update on the host reads it from there.
  opt_sh = opt_state_shardings(abstract.opt_state, abstract_master, master_sh,
                               layout.replicated("grads"))
  shardings = TrainState(step=layout.replicated("grads"),
                         params=layout.tree_shardings(specs, "params"),
                         master=master_sh, opt_state=opt_sh,
                         loss_scale=jax.tree.map(lambda _: layout.replicated("grads"),
                                                 abstract.loss_scale),
                         frozen=(None if model.frozen_specs is None else
                                 layout.tree_shardings(model.frozen_specs, "frozen")))
  return shardings, abstract


# An optimizer-state leaf this large placed whole is said once (Adafactor's factored rows
# and columns of a large embedding; a state nested unlike the weights).
_WHOLE_WARNING = 100_000


def opt_state_shardings(opt_state: Any, master: Any, master_sh: Any, other) -> Any:
  """Each optimizer-state leaf placed as the weight it belongs to: the one whose path ends
  its own path (``mu["layers"]["wq"]`` is ``master["layers"]["wq"]``'s), where their
  shapes agree; anything else (a step count, Adafactor's factored rows and columns) as
  `other`.

  By path rather than optax.tree_map_params: that reads the state as the optimizer's
  structure over the parameters, which optax.masked and multi_transform (MaskedNode in
  place of the weights they leave out) and Adafactor (statistics of other shapes) break.
  """
  weights = {}
  for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(master)[0],
                                    jax.tree.leaves(master_sh)):
    weights[tuple(path)] = (tuple(leaf.shape), sharding)

  def place(path, leaf):
    if not leaf.shape:  # a count or a scale: the device's, whatever a weight is named
      return other
    for start in range(len(path) + 1):  # the longest ending of `path` that names a weight
      shape, sharding = weights.get(tuple(path[start:]), (None, None))
      if shape is not None:
        return sharding if shape == tuple(leaf.shape) else other
    return other

  placed = jax.tree_util.tree_map_with_path(place, opt_state)
  whole = [jax.tree_util.keystr(path) for (path, leaf), sharding in zip(
      jax.tree_util.tree_flatten_with_path(opt_state)[0], jax.tree.leaves(placed))
           if leaf.size >= _WHOLE_WARNING and sharding is other]
  if whole:
    log.warning("%d optimizer-state leaves of no weight's shape stay whole on every device "
                "(e.g. opt_state%s): the optimizer keeps statistics of its own shapes",
                len(whole), whole[0])
  return placed


def frozen_abstract(model: Model, compute) -> Any:
  """The frozen leaves' shapes, in their declared dtype (a quantized weight's parts:
  jaxzero.models.quantize) or else the compute dtype (None for a model without)."""
  if model.frozen_specs is None:
    return None
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s.shape),
                                                     getattr(s, "dtype", None) or compute),
                      model.frozen_specs, is_leaf=is_spec)
