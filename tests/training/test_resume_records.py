"""What a run leaves on disk survives a crash, a kill or a signal at its end: every step a
checkpoint holds is in metrics.jsonl and TensorBoard once, TensorBoard events are on disk
as soon as metrics.jsonl's, and a signal during the last save lets that save finish."""

import json
import time

import jax
import pytest

from jaxzero import config
from jaxzero.checkpoint.reader import latest_step
from jaxzero.training import loop
from jaxzero.training.metrics import MetricsLogger

from processes import ROOT, TINY, child_env, run_python

SETS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
        "train.seq_len=32", "train.steps=6", "train.warmup_steps=1", "data.max_bytes=200000",
        "precision.compute=float32", "mesh.fsdp=4"]


def tensorboard_steps(workdir, tag="train/loss"):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(workdir / "tb"))
  events.Reload()
  return [e.step for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


@pytest.mark.slow
def test_a_crash_between_a_save_and_a_logged_step_loses_no_record(tmp_path, monkeypatch):
  """Logged every 5 steps, saved every 2, crashed at step 4: the resume from checkpoint 2
  finds steps 1-2 in metrics.jsonl, and TensorBoard keeps step 2 (the resumed run logs
  from step 3)."""
  cfg = config.load(TINY, [*SETS, "train.log_every=5", "checkpoint.every=2"])
  real_batch = loop.Run.batch

  def crash_at_step_4(run, step):
    if step == 3:
      raise RuntimeError("a crash at step 4")
    return real_batch(run, step)
  monkeypatch.setattr(loop.Run, "batch", crash_at_step_4)
  with pytest.raises(RuntimeError, match="a crash at step 4"):
    loop.train(cfg, tmp_path, devices=jax.devices()[:4], progress=False)
  assert latest_step(tmp_path) == 2
  monkeypatch.setattr(loop.Run, "batch", real_batch)
  loop.train(cfg, tmp_path, devices=jax.devices()[:4], progress=False)
  steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
  assert steps == [1, 2, 3, 4, 5, 6]
  assert tensorboard_steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_tensorboard_events_are_on_disk_a_moment_after_they_are_logged(tmp_path):
  """A run killed (SIGKILL, an OOM, the peer watch's exit) keeps the TensorBoard events of
  its logged steps but the last second's (tensorboardX flushed every 30 s)."""
  logger = MetricsLogger(tmp_path, total_steps=10, progress=False)
  record = {"loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0,
            "step_time_s": 1.0, "tflops": 1.0}
  logger.log([{"step": 1, **record}])
  logger.log([{"step": 2, **record}])
  deadline = time.monotonic() + 5
  while len(tensorboard_steps(tmp_path)) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
  assert tensorboard_steps(tmp_path) == [1, 2]  # before close
  logger.close()


@pytest.mark.slow  # two event files, named by the second they were made in: 2 s asleep
def test_a_restart_from_step_0_hides_the_earlier_attempt_s_tensorboard_events(tmp_path):
  """An attempt that saved nothing (killed before its first checkpoint) logged steps 1-2;
  the run that starts over from step 0 shows each step once."""
  record = {"loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0,
            "step_time_s": 1.0, "tflops": 1.0}
  for steps in ([1, 2], [1]):
    time.sleep(1.05)  # an event file's name holds the second it was made in
    logger = MetricsLogger(tmp_path, total_steps=10, start=0, progress=False)
    logger.log([{"step": step, **record} for step in steps])
    logger.close()
  assert tensorboard_steps(tmp_path) == [1]
  # The restart's own marker, not only the reader's purge of a step gone back (which not
  # every reader does): a session START at step 0 hides every earlier event.
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  from tensorboard.compat.proto.event_pb2 import SessionLog
  starts = [event.step for path in sorted((tmp_path / "tb").iterdir())
            for event in EventFileLoader(str(path)).Load()
            if event.HasField("session_log") and event.session_log.status == SessionLog.START]
  assert len(list((tmp_path / "tb").iterdir())) == 2 and starts[-1:] == [0]


@pytest.mark.slow
def test_a_signal_during_the_last_save_lets_it_finish(tmp_path):
  """SIGTERM while the end-of-run checkpoint is written: the save completes (a first
  signal stops at a step boundary; only a second acts at once)."""
  script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from jaxzero import train
from jaxzero.checkpoint import checkpointer
real_save = checkpointer.Checkpointer.save
def save(self, step, state, *, wait=False, **kw):
  if wait:
    os.kill(os.getpid(), signal.SIGTERM)
  return real_save(self, step, state, wait=wait, **kw)
checkpointer.Checkpointer.save = save
sys.exit(train.main(["--config", {TINY!r}, "--workdir", {str(tmp_path)!r}, "--no-progress",
                     *[a for s in {SETS + ["train.steps=2"]!r} for a in ("--set", s)]]))
"""
  result = run_python("-c", script, env=child_env(alone=True), timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "SIGTERM came during the last save, which finished; checkpoint of step 2" in result.stdout
  assert latest_step(tmp_path) == 2
  assert not list((tmp_path / "checkpoints").glob("*tmp*"))
