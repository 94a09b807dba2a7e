"""The non-finite guard across two processes (``jax.distributed``, 4 devices each):
both agree, as one process does.

Each run poisons the loss of one step's batch (NaN when the loss sees that
batch's labels), under ZeRO stage 3 with a checkpoint every step.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxzero.checkpoint.reader import latest_step

from processes import ROOT, TINY, child_env, free_port
from tiny import master_at

# Each test starts processes of a multi-process run.
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

POISONED_STEP = 3
SETTINGS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
            "train.seq_len=32", "train.steps=5", "train.log_every=1", "checkpoint.every=1",
            "checkpoint.keep=10", "data.max_bytes=200000", "precision.compute=float32"]

POISON = f"""
import sys
import jax.numpy as jnp, numpy as np
from jaxzero import train
from jaxzero.models import trainable
from jaxzero.training import loop
real_build = loop.build
def build(cfg, *args, **kwargs):
  run = real_build(cfg, *args, **kwargs)
  marker = int(run.batches({POISONED_STEP - 1})[0][:, 1:].astype(np.int64).sum())
  real = trainable.cross_entropy
  def poisoned(x, head, labels, **kw):
    loss = real(x, head, labels, **kw)
    return jnp.where(labels.astype(jnp.int32).sum() == marker, jnp.nan, loss)
  trainable.cross_entropy = poisoned
  return run
loop.build = build
sys.exit(train.main(sys.argv[1:]))
"""


def start(workdir, mode, cache, rank=None, coordinator=None):
  settings = [arg for s in [*SETTINGS, f"train.nonfinite={mode}"] for arg in ("--set", s)]
  joined = {} if rank is None else dict(JAXZERO_COORDINATOR=coordinator,
                                        JAXZERO_NUM_PROCESSES="2", JAXZERO_PROCESS_ID=str(rank))
  return subprocess.Popen(  # pylint: disable=consider-using-with
      [sys.executable, "-c", POISON, "--config", TINY, *settings, "--workdir", str(workdir),
       "--no-progress"],
      cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      env=child_env(cache, alone=True, **joined))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{name: (workdir, [(returncode, stdout, stderr) per process])} for a two-process
  run with each mode and a one-process run with `skip`, one after another (the
  second two-process run finds the step compiled in the shared cache)."""
  cache = tmp_path_factory.getbasetemp() / "jax_compilation_cache"
  results = {}
  for name, mode, ranks in (("stop", "stop", (0, 1)), ("skip", "skip", (0, 1)),
                            ("skip alone", "skip", (None,))):
    workdir, coordinator = tmp_path_factory.mktemp(mode) / "w", f"127.0.0.1:{free_port()}"
    procs = [start(workdir, mode, cache, rank, coordinator) for rank in ranks]
    results[name] = workdir, [finish(p) for p in procs]
  return results


def finish(process):
  stdout, stderr = process.communicate(timeout=600)
  return process.returncode, stdout, stderr


def losses(workdir):
  """The losses metrics.jsonl records, NaN where it wrote null (a non-finite value)."""
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return np.array([json.loads(line)["loss"] for line in lines], dtype=float)


def test_stop_ends_both_processes_with_one_line_and_saves_nothing_poisoned(runs):
  workdir, results = runs["stop"]
  for returncode, _, stderr in results:
    assert returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(f"jaxzero.train: error: step {POISONED_STEP}: loss nan"), stderr
    assert f"the last checkpoint is step {POISONED_STEP - 1}" in errors[0]
  assert latest_step(workdir) == POISONED_STEP - 1
  for saved in range(1, POISONED_STEP):
    assert np.isfinite(master_at(workdir, saved)).all()


def test_skip_across_processes_drops_that_update_like_one_process(runs):
  workdir, results = runs["skip"]
  assert all(code == 0 for code, _, _ in results), results
  np.testing.assert_array_equal(master_at(workdir, POISONED_STEP),
                                master_at(workdir, POISONED_STEP - 1))
  two, one = losses(workdir), losses(runs["skip alone"][0])
  assert np.isnan(two[POISONED_STEP - 1]) and np.isnan(one[POISONED_STEP - 1])
  np.testing.assert_allclose(np.delete(two, POISONED_STEP - 1),
                             np.delete(one, POISONED_STEP - 1), rtol=1e-5)
