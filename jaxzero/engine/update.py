"""The optimizer update inside the step.

:func:`make_update` is AdamW (or the user's optax optimizer) on the fp32 master weights,
after unscaling (float16) and clipping by the norm the gradient function computed; the
new compute copy is cast from the new masters. A non-finite loss or gradient never
reaches the state: the update is dropped, and the loop decides whether to go on. (Where
the state lives off the device, the runners update it chunk by chunk with the same
math: jaxzero.offload.nvme_chunks.update_chunk.)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from jaxzero.config import Config
from jaxzero.engine.optimizer import clip_by_norm, join_clip, mean_grad, split_clip
from jaxzero.engine.state import dtype_of

# (grad_sum, grad_norm, master, opt_state, finite, accum, scale) -> (master, opt_state, params)
Update = Callable[..., tuple[Any, Any, Any]]


def make_update(cfg: Config, unclipped: optax.GradientTransformation) -> Update:
  """The update on the device. `unclipped` is the optimizer less its clipping."""
  compute = dtype_of(cfg.precision.compute)

  def apply(grad_sum, grad_norm, master, opt_state, accum, scale):
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

  def update(grad_sum, grad_norm, master, opt_state, finite, accum, scale=None):
    # A cond, not a select of new against old: the update then runs in place,
    # without a second copy of the optimizer state (12Φ/N) among the temporaries.
    master, opt_state = jax.lax.cond(
        finite, lambda g, m, o: apply(g, grad_norm, m, o, accum, scale),
        lambda _, *old: old, grad_sum, master, opt_state)
    return master, opt_state, jax.tree.map(lambda w: w.astype(compute), master)
  return update
