"""The optimizer update inside the step, and where it runs.

:func:`make_update` is AdamW (or the user's optax optimizer) on the fp32 master weights,
after unscaling (float16) and clipping by the norm the gradient function computed; the
new compute copy is cast from the new masters. :func:`on_host` runs the same update
where a ZeRO-Offload state lives (pinned_host). A non-finite loss or gradient never
reaches the state: the update is dropped, and the loop decides whether to go on.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import optax
from jax.experimental import compute_on as compute_on_lib

from jaxzero.config import Config
from jaxzero.engine.optimizer import clip_by_norm, join_clip, mean_grad, split_clip
from jaxzero.engine.state import dtype_of
from jaxzero.parallel.zero import Layout, on_device

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


def on_host(update: Update, layout: Layout, state_sh) -> Update:
  """ZeRO-Offload: `update` runs where the state lives. The gradient shards go down to
  the host, the update runs there, and only the new compute copy comes back, in the
  optimizer's layout (its shards: 2Φ/N up); no master or moment leaf ever moves to the
  device. A compute copy that itself rests in pinned_host (stage 3) stays there."""
  grads_on_host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), state_sh.master)
  cast_on_device = on_device(state_sh.master)

  def host_update(grad_sum, grad_norm, master, opt_state, finite, accum, scale=None):
    run = functools.partial(_on_host, lambda g, n, m, o, f, *s: update(g, n, m, o, f, accum,
                                                                        *s))
    scale_args = () if scale is None else (scale,)
    master, opt_state, params = run(jax.device_put(grad_sum, grads_on_host), grad_norm,
                                    master, opt_state, finite, *scale_args)
    if layout.params_memory != "pinned_host":
      params = jax.device_put(params, cast_on_device)
    return master, opt_state, params
  return host_update


def _on_host(fn, *args):
  """`fn(*args)` computed on the host, its outputs left in host memory. JAX from 0.11
  spells the function transform `compute_on` (before, a context manager);
  earlier JAX has it as `compute_on2`."""
  transform = compute_on_lib.compute_on
  if "out_memory_spaces" not in inspect.signature(transform).parameters:
    transform = compute_on_lib.compute_on2
  return transform(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)
