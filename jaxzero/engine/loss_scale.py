"""Loss scaling for float16 compute, with DeepSpeed's rules and defaults.

The scaler is part of the train state (checkpointed, restored exactly) and its
update is a pure function of the state and one flag, so it runs inside the
jitted step. :func:`update` follows ``DynamicLossScaler.update_scale`` of
deepspeed/runtime/fp16/loss_scaler.py (DeepSpeed 0.19.8) step for step; the
tests drive both through the same overflow sequences.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SCALE_FACTOR = 2.0  # DeepSpeed's: the scale halves and doubles


class LossScale(NamedTuple):
  """The scaler's state: DeepSpeed's cur_scale, cur_iter, last_overflow_iter,
  cur_hysteresis, and the engine's skipped_steps."""
  scale: jax.Array  # float32: the loss is multiplied by it before the backward pass
  iteration: jax.Array  # int32: steps seen
  last_overflow: jax.Array  # int32: the iteration of the last overflow, -1 for none
  hysteresis: jax.Array  # int32: overflows still tolerated before the scale halves
  skipped: jax.Array  # int32: steps whose update was skipped


def init(precision) -> LossScale | None:
  """The scaler at step 0 for a PrecisionConfig; None when the compute dtype needs none."""
  if not precision.scales_loss:
    return None
  scale = precision.loss_scale or 2.0 ** precision.initial_scale_power
  return LossScale(jnp.float32(scale), jnp.int32(0), jnp.int32(-1),
                   jnp.int32(precision.hysteresis), jnp.int32(0))


def abstract(precision) -> LossScale | None:
  return jax.eval_shape(lambda: init(precision))


def _halves(state: LossScale, overflow: jax.Array, precision) -> jax.Array:
  return overflow & ((precision.hysteresis == 1) | (state.hysteresis == 1))


def exhausted(state: LossScale, overflow: jax.Array, precision) -> jax.Array:
  """Whether this overflow is more than the scaler absorbs: under a static scale
  any overflow; under a dynamic one an overflow that would halve a scale
  already at min_loss_scale, where DeepSpeed stops the run with an error."""
  if precision.loss_scale:
    return overflow
  return _halves(state, overflow, precision) & (state.scale <= precision.min_loss_scale)


def update(state: LossScale, overflow: jax.Array, precision) -> LossScale:
  """The scaler after a step whose gradients overflowed (inf/NaN) or not.

  Dynamic: an overflow halves the scale (not below min_loss_scale) once the
  hysteresis is used up, else uses one; `loss_scale_window` steps after the
  last overflow the scale doubles and the hysteresis refills. Static: only
  the count of skipped steps moves.
  """
  if precision.loss_scale:
    return state._replace(iteration=state.iteration + 1)
  delayed_shift = precision.hysteresis
  halve = _halves(state, overflow, precision)
  scale = jnp.where(halve, jnp.maximum(state.scale / SCALE_FACTOR, precision.min_loss_scale),
                    state.scale)
  hysteresis = jnp.where(overflow & ~halve, state.hysteresis - 1, state.hysteresis)
  last_overflow = jnp.where(overflow, state.iteration, state.last_overflow)
  if precision.consecutive_hysteresis:
    hysteresis = jnp.where(overflow, hysteresis, delayed_shift)
  stable = state.iteration - state.last_overflow - 1
  grow = ~overflow & (stable > 0) & (stable % precision.loss_scale_window == 0)
  scale = jnp.where(grow, scale * SCALE_FACTOR, scale)
  if not precision.consecutive_hysteresis:
    hysteresis = jnp.where(grow, delayed_shift, hysteresis)
  return LossScale(scale.astype(jnp.float32), state.iteration + 1, last_overflow,
                   hysteresis.astype(jnp.int32), state.skipped)


def after_step(state: LossScale, loss: jax.Array, grad_norm: jax.Array, precision
               ) -> tuple[LossScale, dict[str, jax.Array]]:
  """The scaler after a step, and the step's metrics: the scale it used, the
  steps skipped so far, and whether it was non-finite for train.nonfinite.

  Gradients that overflow are expected under loss scaling: the step is skipped
  and the scale moves, and that is not a non-finite step. A non-finite loss
  is, and so is an overflow the scaler cannot absorb (see :func:`exhausted`).
  """
  overflow = ~jnp.isfinite(grad_norm)
  applied = jnp.isfinite(loss) & ~overflow
  nonfinite = ~jnp.isfinite(loss) | exhausted(state, overflow, precision)
  new = update(state, overflow, precision)
  new = new._replace(skipped=state.skipped + (~applied).astype(jnp.int32))
  return new, {"loss_scale": state.scale, "skipped_steps": new.skipped,
               "nonfinite": nonfinite.astype(jnp.int32)}


def applied_updates(step: jax.Array, state: LossScale | None) -> jax.Array:
  """Updates applied before `step` (the optimizer's and the schedule's count)."""
  return step if state is None else step - state.skipped
