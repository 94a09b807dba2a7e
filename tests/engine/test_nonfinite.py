"""A non-finite loss or gradient never reaches the state or a checkpoint.

A step is poisoned by making the loss NaN on exactly one batch (the loss
function is wrapped to return NaN when it sees that batch's labels), under
ZeRO stage 0 (gradients per device, reduced once) and stage 3.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.checkpoint.reader import latest_step
from jaxzero.errors import NonFiniteError
from jaxzero.models import trainable
from jaxzero.training import loop

from tiny import master_at, tiny_config

POISONED_STEP = 3  # 1-based, as in metrics.jsonl


@pytest.fixture
def poison(monkeypatch):
  """Makes the loss NaN on the batch of POISONED_STEP: the whole batch at stage 3,
  the first device's rows at stage 0 (where the loss is taken per device)."""
  def arm(cfg, steps=(POISONED_STEP,)):
    run = loop.build(cfg, jax.devices()[:8])
    markers = []
    for step in steps:
      tokens = run.batches(step - 1)[0]
      rows = tokens if cfg.zero.stage == 3 else tokens[:len(tokens) // 8]
      markers.append(int(rows[:, 1:].astype(np.int64).sum()))
    real = trainable.cross_entropy

    def poisoned(x, head, labels, **kw):
      loss = real(x, head, labels, **kw)
      hit = jnp.isin(labels.astype(jnp.int32).sum(), jnp.asarray(markers))
      return jnp.where(hit, jnp.nan, loss)
    monkeypatch.setattr(trainable, "cross_entropy", poisoned)
  return arm


# Each mode under one stage: the guard is the same code for every stage, and the
# stages differ in where the loss is taken (per device at stage 0, whole at 3).
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_stop_names_the_step_and_saves_nothing_poisoned(stage, poison, tmp_path):
  # Logged every 5 steps, saved every step: a saved step is checked before it is saved.
  cfg = tiny_config(stage, "stop")
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, log_every=5))
  poison(cfg)
  with pytest.raises(NonFiniteError) as info:
    loop.run_training(cfg, tmp_path, devices=jax.devices()[:8], progress=False)
  message = str(info.value)
  assert f"step {POISONED_STEP}: loss nan" in message and "\n" not in message
  # It stops at that step: nothing after it is saved, everything before is finite.
  assert f"the last checkpoint is step {POISONED_STEP - 1}" in message
  assert latest_step(tmp_path) == POISONED_STEP - 1
  for saved in range(1, POISONED_STEP):
    assert np.isfinite(master_at(tmp_path, saved)).all()


@pytest.mark.parametrize("stage", [3])
def test_skip_drops_that_update_and_trains_on(stage, poison, tmp_path):
  cfg = tiny_config(stage, "skip")
  poison(cfg)
  history = loop.train(cfg, tmp_path, devices=jax.devices()[:8], progress=False)
  assert [r["nonfinite"] for r in history] == [0, 0, 1, 0, 0]
  losses = np.array([r["loss"] for r in history])
  assert np.isnan(losses[POISONED_STEP - 1]) and np.isfinite(np.delete(losses, 2)).all()
  # metrics.jsonl stays JSON (which has no NaN): the step's loss is null, its flag set.
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  bad = json.loads(lines[POISONED_STEP - 1], parse_constant=lambda name: pytest.fail(name))
  assert (bad["loss"], bad["nonfinite"]) == (None, 1)
  np.testing.assert_array_equal(master_at(tmp_path, POISONED_STEP),
                                master_at(tmp_path, POISONED_STEP - 1))
  assert not np.array_equal(master_at(tmp_path, 5), master_at(tmp_path, POISONED_STEP))



@pytest.mark.slow
def test_a_resumed_run_carries_on_the_streak_of_non_finite_steps(poison, tmp_path):
  """train.max_nonfinite=2 counts steps in a row across a stop and a resume: step 3 is
  skipped, the run stops and resumes at 3, and step 4 is the second in a row."""
  cfg = tiny_config(3, "skip")
  poison(cfg, steps=(POISONED_STEP, POISONED_STEP + 1))
  loop.train(cfg, tmp_path, steps=POISONED_STEP, devices=jax.devices()[:8], progress=False)
  with pytest.raises(NonFiniteError, match="2 in a row reached train.max_nonfinite=2"):
    loop.train(cfg, tmp_path, devices=jax.devices()[:8], progress=False)
  assert latest_step(tmp_path) == POISONED_STEP
