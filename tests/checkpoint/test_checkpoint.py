"""Checkpoints: resume on any stage and mesh, survive SIGKILL, save on SIGTERM/SIGINT,
and refuse damaged or mismatched checkpoints without touching anything.

Training runs go through ``python -m jaxzero.train`` and share one XLA
compilation cache: every 8-device run below is the same program (train.steps
is fixed, ``--steps`` stops early), so only the first one compiles.
"""

import hashlib
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxzero import config, train
from jaxzero.checkpoint.directory import checkpoint_dir
from jaxzero.checkpoint.reader import latest_step
from jaxzero.errors import CheckpointError
from jaxzero.training import loop

from damage import damage_data, truncate_to
from processes import ROOT, TINY, child_env, logged, losses, run_python, wait_for

# tiny_zero3 (stage 3 on 8 devices), smaller; the schedule spans 10k steps.
SETTINGS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
            "train.seq_len=32", "train.steps=10000", "train.log_every=1", "checkpoint.every=3",
            "data.max_bytes=200000"]

# Runs jaxzero.train with the rename that completes checkpoint HOLD_STEP held
# back, so that the test can kill the process while that save is in flight.
HOLD_SAVE = """
import asyncio, os, pathlib, sys
from orbax.checkpoint.path import atomicity
finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def held_finalize(self):
  if self.get_final().name == os.environ["HOLD_STEP"]:
    pathlib.Path(os.environ["HOLD_MARKER"]).touch()
    await asyncio.sleep(3600)
  await finalize(self)
atomicity.AtomicRenameTemporaryPath.finalize = held_finalize
from jaxzero import train
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
  """One compilation cache for the session: every 8-device run compiles once."""
  return child_env(tmp_path_factory.getbasetemp() / "jax_compilation_cache")


def start_train(env, workdir, *args, code=None, **extra_env):
  command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "jaxzero.train"]
  settings = [arg for s in SETTINGS for arg in ("--set", s)]
  return subprocess.Popen(
      [*command, "--config", TINY, *settings, "--workdir", str(workdir), "--no-progress", *args],
      cwd=ROOT, env={**env, **extra_env}, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE)


def train_cli(env, workdir, *args):
  process = start_train(env, workdir, *args)
  stdout, stderr = process.communicate(timeout=600)
  assert process.returncode == 0, stderr
  return stdout, stderr


def snapshot(directory):
  """{relative path: content hash} of every file, to show nothing was touched."""
  root = pathlib.Path(directory)
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(root.rglob("*")) if p.is_file()}


def saved_steps(workdir):
  return sorted(int(p.name) for p in checkpoint_dir(workdir).iterdir())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cli_env):
  """Run A: 6 steps of stage 3 on 8 devices, saving at 3 and 6."""
  workdir = tmp_path_factory.mktemp("a")
  train_cli(cli_env, workdir, "--steps", "6")
  assert saved_steps(workdir) == [3, 6]
  return losses(workdir)


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory, cli_env, uninterrupted):
  """Run B, first part: the same config stopped after step 3."""
  workdir = tmp_path_factory.mktemp("b")
  stdout, _ = train_cli(cli_env, workdir, "--steps", "3")
  assert f"checkpoint of step 3 in {checkpoint_dir(workdir) / '3'}" in stdout
  assert saved_steps(workdir) == [3]
  assert losses(workdir) == {s: uninterrupted[s] for s in (1, 2, 3)}
  return workdir


@pytest.fixture
def workdir_at_3(stopped_at_3, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(stopped_at_3, workdir)
  return workdir


@pytest.mark.slow
def test_resume_under_stage1_on_4_devices_matches_the_uninterrupted_run(workdir_at_3,
                                                                        uninterrupted):
  cfg = config.load(TINY, [*SETTINGS, "zero.stage=1", "mesh.fsdp=4"])
  outcome = loop.run_training(cfg, workdir_at_3, steps=6, devices=jax.devices()[:4],
                                 progress=False)
  assert (outcome.start_step, outcome.step) == (3, 6)
  resumed = {h["step"]: h["loss"] for h in outcome.history}
  assert list(resumed) == [4, 5, 6]
  np.testing.assert_allclose([resumed[s] for s in (4, 5, 6)],
                             [uninterrupted[s] for s in (4, 5, 6)], rtol=1e-5)
  assert [r["step"] for r in logged(workdir_at_3)] == [1, 2, 3, 4, 5, 6]
  assert saved_steps(workdir_at_3) == [3, 6]


@pytest.mark.slow  # runs jaxzero.train processes
def test_resume_on_the_same_mesh_is_bitwise_equal_and_drops_unsaved_metrics(
    workdir_at_3, uninterrupted, cli_env):
  # As if the run had logged steps 4 and 5, the last line cut short, and been
  # killed before saving them: the resumed run logs them again, once.
  with open(workdir_at_3 / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write(json.dumps({"step": 4, "loss": 9.0}) + "\n" + '{"step": 5, "lo')
  _, stderr = train_cli(cli_env, workdir_at_3, "--steps", "6", "--resume")
  assert "resumed from step 3" in stderr
  assert [r["step"] for r in logged(workdir_at_3)] == [1, 2, 3, 4, 5, 6]
  assert losses(workdir_at_3) == uninterrupted


@pytest.mark.slow  # runs jaxzero.train processes
def test_another_model_shape_is_refused_before_the_build_naming_the_fields(workdir_at_3,
                                                                           monkeypatch):
  """From the checkpoint's run record, before tokenizing or compiling (a reused workdir);
  the restore itself names the leaf and both shapes where no record says (an Engine's)."""
  cfg = config.load(TINY, [*SETTINGS, "model.dim=128"])
  before = snapshot(workdir_at_3)
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built"))
  with pytest.raises(CheckpointError) as error:
    loop.run_training(cfg, workdir_at_3, progress=False)
  message = str(error.value)
  assert message.endswith("/3 does not fit this config (model.dim=64 in the checkpoint, 128 "
                          "here); another model needs another --workdir")
  assert snapshot(workdir_at_3) == before


def test_a_leaf_of_another_shape_is_named_with_both_shapes(tmp_path):
  from jaxzero.checkpoint import directory
  with pytest.raises(CheckpointError) as error:
    directory.check_fits({"params/embed_VxD": (256, 64)}, {"params/embed_VxD": (256, 128)},
                         tmp_path / "3", "this config", " (model.dim=64 in the checkpoint, 128 "
                         "here)")
  assert str(error.value) == (
      f"checkpoint {tmp_path / '3'} does not fit this config: leaf params/embed_VxD has shape "
      "(256, 64) in the checkpoint but (256, 128) in this config (model.dim=64 in the "
      "checkpoint, 128 here)")


@pytest.mark.parametrize("damage, expected", [
    ("truncate_data_file", "is damaged: leaf "),
    ("delete_state_metadata", "is damaged: its state metadata (state/_METADATA) "),
    ("delete_info", "is damaged: its run record (info/) cannot be read"),
])
@pytest.mark.slow  # runs jaxzero.train processes
def test_a_damaged_checkpoint_is_refused_and_nothing_is_overwritten(workdir_at_3, damage,
                                                                      expected):
  step_dir = checkpoint_dir(workdir_at_3) / "3"
  if damage == "truncate_data_file":
    damage_data(step_dir, lambda data_file: data_file.write_bytes(data_file.read_bytes()[:10]))
  elif damage == "delete_state_metadata":
    (step_dir / "state" / "_METADATA").unlink()
  else:
    shutil.rmtree(step_dir / "info")
  before = snapshot(workdir_at_3)
  with pytest.raises(CheckpointError) as error:
    loop.run_training(config.load(TINY, SETTINGS), workdir_at_3, progress=False)
  assert expected in str(error.value) and str(step_dir) in str(error.value)
  assert "\n" not in str(error.value)
  assert snapshot(workdir_at_3) == before


# Ten restores of damaged checkpoints by jaxzero.train's own main(), in one process.
RESTORE_TEN_TIMES = """
import sys
from jaxzero import train
config, workdirs = sys.argv[1:-10], sys.argv[-10:]
codes = [train.main([*config, "--workdir", workdir]) for workdir in workdirs]
sys.exit(0 if codes == [2] * 10 else 1)
"""


@pytest.mark.slow
def test_after_a_damaged_restore_stderr_holds_only_its_error(stopped_at_3, tmp_path, cli_env):
  """Tensorstore reads abandoned by a failed restore report nothing: ten
  restores of checkpoints truncated at ten lengths."""
  workdirs = []
  for attempt in range(10):
    workdir = tmp_path / f"w{attempt}"
    shutil.copytree(stopped_at_3, workdir)
    damage_data(checkpoint_dir(workdir) / "3", truncate_to(attempt / 10))
    workdirs.append(str(workdir))
  settings = [arg for s in SETTINGS for arg in ("--set", s)]
  result = run_python("-c", RESTORE_TEN_TIMES, "--config", TINY, *settings, "--no-progress",
                      *workdirs, env=cli_env, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  log_line = re.compile(r"^\d\d:\d\d:\d\d [\w.]+: ")  # jaxzero's own log lines
  others = [line for line in result.stderr.splitlines() if not log_line.match(line)]
  assert len(others) == 10, result.stderr[-3000:]
  for line, workdir in zip(others, workdirs):
    assert line.startswith(f"jaxzero.train: error: checkpoint {checkpoint_dir(workdir) / '3'} is "
                           "damaged: "), line


# A tensorstore read that a failed restore abandoned, answering on its own thread
# into the closed event loop, before that restore's error has been raised.
CLOSED_LOOP_BEFORE_THE_ERROR = """
import asyncio, sys, threading
from jaxzero.checkpoint import reader
reader.CheckpointReader(sys.argv[1])
loop = asyncio.new_event_loop()
loop.close()
class AbandonedRead:
  def __del__(self):
    loop.call_soon_threadsafe(print)
thread = threading.Thread(target=AbandonedRead)
thread.start()
thread.join()
"""


@pytest.mark.slow  # runs jaxzero.train processes
def test_abandoned_reads_are_quiet_from_the_first_read(tmp_path, cli_env):
  result = run_python("-c", CLOSED_LOOP_BEFORE_THE_ERROR, str(tmp_path), env=cli_env, timeout=120)
  assert result.returncode == 0 and result.stderr == "", result.stderr[-3000:]
  # The same error raised by the program itself is never hidden.
  own = CLOSED_LOOP_BEFORE_THE_ERROR + "raise RuntimeError('Event loop is closed')\n"
  result = run_python("-c", own, str(tmp_path), env=cli_env, timeout=120)
  assert result.returncode == 1
  assert result.stderr.splitlines()[-1] == "RuntimeError: Event loop is closed", result.stderr


def test_resume_flag_without_a_checkpoint_is_a_one_line_error(tmp_path, capsys):
  code = train.main(["--config", TINY, "--workdir", str(tmp_path / "w"), "--resume"])
  errors = capsys.readouterr().err.strip().splitlines()
  assert code == 2
  assert errors[-1].startswith("jaxzero.train: error: --resume: there is no checkpoint")
  assert not (tmp_path / "w" / "checkpoints").exists()



@pytest.mark.slow
def test_sigkill_during_an_async_save_resumes_from_the_last_complete_checkpoint(
    tmp_path, cli_env, uninterrupted):
  workdir, marker = tmp_path / "w", tmp_path / "save_in_flight"
  killed = start_train(cli_env, workdir, "--steps", "9", code=HOLD_SAVE, HOLD_STEP="6",
                       HOLD_MARKER=str(marker))
  wait_for(marker.exists, killed)
  killed.send_signal(signal.SIGKILL)
  killed.wait(timeout=60)
  checkpoints = checkpoint_dir(workdir)
  assert [p.name for p in checkpoints.iterdir() if p.name.startswith("6.")], \
      "step 6 should have been killed mid-save"
  assert latest_step(workdir) == 3

  stdout, stderr = train_cli(cli_env, workdir, "--steps", "9")
  assert "resumed from step 3" in stderr
  assert f"checkpoint of step 9 in {checkpoints / '9'}" in stdout
  assert [r["step"] for r in logged(workdir)] == list(range(1, 10))
  resumed = losses(workdir)
  assert {s: resumed[s] for s in range(1, 7)} == uninterrupted  # to the bit
  assert sorted(p.name for p in checkpoints.iterdir()) == ["3", "6", "9"]  # leftovers gone


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_saves_the_current_step_and_exits_128_plus_it(tmp_path, cli_env, sig):
  """Saved, but not finished: the status a shell gives a process the signal ended (143,
  130), so that a scheduler retries the run and `train && export` stops."""
  workdir = tmp_path / "w"
  process = start_train(cli_env, workdir, "--set", "checkpoint.every=0")
  wait_for(lambda: len(logged(workdir)) >= 2, process)
  process.send_signal(sig)
  stdout, stderr = process.communicate(timeout=120)
  assert process.returncode == 128 + sig, stderr
  step = latest_step(workdir)
  assert step is not None and 2 <= step < 10000
  assert (f"stopped by {sig.name} at step {step}; checkpoint of step {step} in "
          f"{checkpoint_dir(workdir) / str(step)}") in stdout
  assert [r["step"] for r in logged(workdir)] == list(range(1, step + 1))


def test_lora_settings_that_differ_are_named_as_each_side_records_them():
  from jaxzero.checkpoint import checkpointer  # pylint: disable=import-outside-toplevel
  differ = checkpointer._lora_difference  # pylint: disable=protected-access
  run = {"rank": 4, "alpha": 8.0, "targets": ["q", "v"], "base_dtype": ""}
  assert differ(run, {**run, "targets": ["q"], "alpha": 16.0}) == [
      "lora.targets=q,v in the checkpoint, q here"]  # (alpha: its own check, at restore)
  assert differ(None, run) == ["lora.rank=0 in the checkpoint, 4 here"]
  assert differ(None, None) == [] and differ(run, dict(run)) == []
  # jaxzero.Engine records jaxzero.lora's targets as given: a regex.
  engine = {"rank": 4, "alpha": 8.0, "targets": "up/kernel"}
  assert differ(engine, {**engine, "targets": "down/kernel"}) == [
      "lora.targets=up/kernel in the checkpoint, down/kernel here"]
