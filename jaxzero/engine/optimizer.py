"""The optimizer: AdamW (or Adam with L2) on the schedule, global-norm clipping.

The train step clips with the norm it already computed (:func:`clip_by_norm`)
and runs ``make_optimizer(cfg, clip=False)``, whose state has the same leaves
as the clipped chain's; :func:`split_clip` and :func:`join_clip` move between
the two. The NVMe tier runs the same math one chunk at a time.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.config import Config
from jaxzero.engine.lr_schedule import learning_rate_schedule


def make_optimizer(cfg: Config, clip: bool = True,
                   decay: Callable[[str], bool] = lambda path: "norm" not in path
                   ) -> optax.GradientTransformation:
  """AdamW (or Adam with L2) on the schedule, after global-norm clipping.

  `clip=False` leaves the clipping out (the state has the same leaves): the
  train step clips with :func:`clip_by_norm` by the norm it already computed.
  `decay` says, by a parameter's path, whether weight decay applies (the
  model's: jaxzero.models.interface.Model.decay).
  """
  t = cfg.train
  schedule = learning_rate_schedule(cfg)
  _decay_mask = functools.partial(decay_mask, decay)
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


def decay_mask(decay: Callable[[str], bool], params):
  """Whether weight decay applies to each leaf of `params` (Llama's: not on norm gains)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: decay(jax.tree_util.keystr(path)), params)


def mean_grad(grad_sum: Any, accum: int) -> Any:
  """The mean gradient in float32, from a sum over `accum` micro-steps. Widened
  where used (the norm; the update), never all at once."""
  return jax.tree.map(lambda g: g.astype(jnp.float32) / accum, grad_sum)


def trained_alone(tx: optax.GradientTransformation, params: Any, grads: list) -> Any:
  """`params` after `tx` updates them with each of `grads` in turn, from a fresh state:
  an optimizer probed on stand-ins (here, and jaxzero.offload.nvme_chunks)."""
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


def padding_changes_updates(tx: optax.GradientTransformation) -> bool:
  """Whether `tx` updates a weight stored padded with zeros (jaxzero.parallel.padding)
  otherwise than the weight itself: one that reads a weight's shape or norms (Adafactor's
  parameter scale, Muon's orthogonalization). Probed on one small weight over a few steps;
  an optimizer the probe cannot run (a mask given as a tree) counts as unchanged."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((7, 9)).astype(np.float32)
  grads = [k * rng.standard_normal((7, 9)).astype(np.float32) for k in (1.0, 3.0, 0.2)]
  pad = lambda x: np.pad(x, ((0, 1), (0, 0)))
  trained = jax.jit(lambda w, grads: trained_alone(tx, {"w": w}, [{"w": g} for g in grads])["w"])
  try:
    alone, padded = trained(w, grads), trained(pad(w), [pad(g) for g in grads])
  except Exception:  # pylint: disable=broad-except
    return False
  return not np.allclose(alone, np.asarray(padded)[:7], rtol=1e-5, atol=1e-7)

