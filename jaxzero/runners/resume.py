"""A checkpoint restored by any runner, whatever precision saved it: what
``jaxzero.train`` and ``jaxzero.Engine.restore`` both resume from.

A checkpoint saved with another ``precision.compute`` has its compute copy (and frozen
weights kept in the compute dtype) read as saved, so that its checksums verify; then the
compute copy is made anew from the float32 masters, as every step makes it (not the saved
copy cast up, which keeps the saved dtype's rounding), and the frozen weights are cast.
A float16 run that resumes another precision's checkpoint starts its loss scaler afresh.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from jaxzero import engine as engine_lib
from jaxzero.engine import loss_scale
from jaxzero.models.interface import is_spec

log = logging.getLogger(__name__)


def restore(runner, checkpoints, step: int) -> Any:
  """Checkpoint `step`, verified, as `runner`'s state in its program's precision."""
  program = runner.program
  compute = program.cfg.precision.compute
  target = program.abstract_state()
  saved_compute = checkpoints.info(step).get("compute_dtype", compute)
  recast = saved_compute != compute
  if recast:
    target = _as_saved(program, target, engine_lib.dtype_of(saved_compute))
  state = runner.restore(checkpoints, step, target)  # verified
  if recast:
    log.info("checkpoint %d was saved with precision.compute=%s: the compute copy is cast "
             "from the float32 masters to %s", step, saved_compute, compute)
    state = _in_compute_dtype(runner, state)
  if program.cfg.precision.scales_loss and not jax.tree.leaves(state.loss_scale):
    log.info("checkpoint %d has no loss scaler (not saved by a float16 run): it starts afresh",
             step)
    state = state._replace(loss_scale=jax.device_put(loss_scale.init(program.cfg.precision),
                                                     program.shardings.loss_scale))
  return state


def _as_saved(program, target, saved_dtype):
  """`target` reading the compute copy, and frozen weights kept in the compute dtype (not
  a quantized base's parts, whose dtypes are their own), in the dtype they were saved in."""
  frozen_specs = program.model.frozen_specs
  in_compute = (None if frozen_specs is None else jax.tree.map(
      lambda s: getattr(s, "dtype", None) is None, frozen_specs, is_leaf=is_spec))
  return target._replace(
      params=jax.tree.map(lambda a: a.update(dtype=saved_dtype), target.params),
      frozen=None if in_compute is None else jax.tree.map(
          lambda a, c: a.update(dtype=saved_dtype) if c else a, target.frozen, in_compute))


def _in_compute_dtype(runner, state):
  """The compute copy from the masters (runner.compute_copy), the frozen weights cast; only
  the fields the runner's state holds arrays in: an offload runner's state has no frozen
  weights, and ZeRO-Infinity's no compute copy (None at every leaf)."""
  program = runner.program
  if jax.tree.leaves(state.params):
    state = state._replace(params=runner.compute_copy(state))
  if jax.tree.leaves(getattr(state, "frozen", None)):
    want = program.abstract.frozen
    state = state._replace(frozen=jax.jit(
        lambda tree: jax.tree.map(lambda w, a: w.astype(a.dtype), tree, want),
        out_shardings=program.shardings.frozen, donate_argnums=0)(state.frozen))
  return state
