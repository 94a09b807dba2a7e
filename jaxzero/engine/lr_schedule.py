"""Learning-rate schedules: one function of the optimizer update, for every
``train.schedule``.

``warmup_cosine`` is jaxzero's own (optax's warmup + cosine). The others are DeepSpeed's
WarmupLR family with its formulas and its engine's timing (each update gets the value DeepSpeed
applies at that update), tabulated per update in float64 and rounded once to float32, and
constant past the table; the table is a constant of the compiled step.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax

DEEPSPEED_SCHEDULES = ("warmup_constant", "warmup_linear_decay", "warmup_cosine_ds")


def learning_rate_schedule(cfg) -> optax.Schedule:
  """The learning rate of each optimizer update (counted from 0), per cfg.train.schedule."""
  t = cfg.train
  if t.schedule == "warmup_cosine":
    warmup = min(t.warmup_steps, t.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)
  lr_by_update = deepspeed_learning_rates(t)  # float32, one per update
  last = lr_by_update.shape[0] - 1
  return lambda count: jnp.asarray(lr_by_update)[jnp.minimum(count, last)]


def deepspeed_learning_rates(t) -> np.ndarray:
  """The lr of optimizer updates 0, 1, ..., up to where the schedule turns constant.

  As DeepSpeed's engine runs them: it steps its scheduler after each applied
  update, so update n runs at the scheduler's ``last_batch_iteration = n - 1``,
  and update 0 at the value the scheduler starts with (warmup_min_lr; 0 for
  WarmupCosineLR). Computed in float64, returned in float32.
  """
  warmup = max(2, t.warmup_steps)  # as DeepSpeed: at least two warmup steps
  n = np.arange(max(t.steps, warmup) + 1, dtype=np.float64)
  gamma = np.log(n + 1) / math.log(warmup) if t.warmup_type == "log" else n / warmup
  after = n >= warmup
  if t.schedule == "warmup_constant":
    gamma = np.where(after, 1.0, gamma)
  elif t.schedule == "warmup_linear_decay":  # back down to the warmup's start at t.steps
    gamma = np.where(after, np.maximum(0.0, (t.steps - n) / max(1.0, t.steps - warmup)), gamma)
  elif t.schedule != "warmup_cosine_ds":
    raise ValueError(f"train.schedule={t.schedule!r} is not one of DeepSpeed's")
  ratio = t.warmup_min_ratio + (1 - t.warmup_min_ratio) * gamma
  if t.schedule == "warmup_cosine_ds":
    progress = np.minimum(1.0, (n - warmup + 1) / max(1, t.steps - warmup))
    cosine = t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + np.cos(math.pi * progress)) / 2
    ratio = np.where(after, np.maximum(0.0, cosine), ratio)
  first = 0.0 if t.schedule == "warmup_cosine_ds" else t.warmup_min_ratio
  return (t.lr * np.concatenate([[first], ratio])).astype(np.float32)
