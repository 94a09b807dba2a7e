"""The float16 loss scaler moves exactly as DeepSpeed's DynamicLossScaler.

Both are driven through the same scripted sequences of overflowing and clean
steps (bursts, long clean stretches that let the scale grow, single overflows
that only use up hysteresis), 300 steps per setting; the scales, the steps
skipped and the step at which DeepSpeed gives up at its minimum scale must be
identical.
"""

import random

import jax
import jax.numpy as jnp
import pytest

from jaxzero import config
from jaxzero.engine import loss_scale

SETTINGS = [  # (loss_scale_window, hysteresis, consecutive_hysteresis, initial_scale_power)
    (1000, 2, False, 16),  # DeepSpeed's defaults
    (5, 2, False, 12),
    (3, 3, True, 20),
    (7, 1, False, 24),
    (4, 2, True, 16),
    (2, 1, False, 3),  # reaches the minimum scale: where DeepSpeed gives up, so does jaxzero
]


def scripted(seed: int, window: int, steps: int = 300) -> list[bool]:
  """Overflow flags: clean stretches (up to three windows, so that the scale
  grows), bursts and lone overflows, in random order."""
  rng, flags = random.Random(seed), []
  while len(flags) < steps:
    kind = rng.choice(["clean", "clean", "clean", "burst", "lone"])
    flags += ([False] * rng.randint(1, min(3 * window, 30)) if kind == "clean" else
              [True] * rng.randint(2, 4) if kind == "burst" else [True])
  return flags[:steps]


@pytest.fixture
def deepspeed_scaler(monkeypatch):
  loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler",
                                    reason="DeepSpeed is not installed (pip install deepspeed)")
  # It asks its process group for the rank only to decide who logs.
  monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)
  return loss_scaler.DynamicLossScaler


@pytest.mark.parametrize("window, hysteresis, consecutive, power", SETTINGS)
def test_scale_sequence_equals_deepspeeds(deepspeed_scaler, window, hysteresis, consecutive,
                                          power):
  precision = config.PrecisionConfig(compute="float16", initial_scale_power=power,
                                     loss_scale_window=window, hysteresis=hysteresis,
                                     consecutive_hysteresis=consecutive, min_loss_scale=1.0)
  theirs = deepspeed_scaler(init_scale=2.0 ** power, scale_window=window, min_scale=1.0,
                            delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
  step = jax.jit(lambda state, overflow: (loss_scale.update(state, overflow, precision),
                                          loss_scale.exhausted(state, overflow, precision)))
  ours = loss_scale.init(precision)
  ours_seq, theirs_seq, grew, halved, stopped = [], [], 0, 0, False
  for i, overflow in enumerate(scripted(window * 31 + power, window)):
    ours, stops = step(ours, jnp.bool_(overflow))
    try:
      theirs.update_scale(overflow)
    except Exception:  # pylint: disable=broad-except
      # DeepSpeed gives up where the scale cannot fall further: so must we, here.
      assert bool(stops), f"step {i}: DeepSpeed stopped at its minimum scale, jaxzero did not"
      stopped = True
      break
    assert not bool(stops), f"step {i}: jaxzero stopped, DeepSpeed did not"
    grew += float(ours.scale) > (ours_seq or [2.0 ** power])[-1]
    halved += float(ours.scale) < (ours_seq or [2.0 ** power])[-1]
    ours_seq.append(float(ours.scale))
    theirs_seq.append(float(theirs.cur_scale))
    assert int(ours.hysteresis) == theirs.cur_hysteresis, f"step {i}"
  assert ours_seq == theirs_seq
  assert halved and len(ours_seq) >= 10 and (stopped or power > 3)  # the rules were used
  if window < 1000 and power > 3:
    assert grew


def test_a_static_scale_never_moves_and_any_overflow_is_too_much():
  precision = config.PrecisionConfig(compute="float16", loss_scale=128.0)
  state = loss_scale.init(precision)
  for overflow in (True, False, True):
    assert bool(loss_scale.exhausted(state, jnp.bool_(overflow), precision)) == overflow
    state = loss_scale.update(state, jnp.bool_(overflow), precision)
  assert float(state.scale) == 128.0 and int(state.iteration) == 3


def test_only_float16_has_a_scaler():
  assert loss_scale.init(config.PrecisionConfig(compute="bfloat16")) is None
  assert float(loss_scale.init(config.PrecisionConfig(compute="float16")).scale) == 2.0 ** 16
