"""The run directory: a path that cannot be used is one line (exit 2) before
compiling, a second run on a live run's workdir is refused, a dead run's lock is
taken over, and export directories get the umask's mode."""

import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import chex
import pytest

from jaxzero import config
from jaxzero.checkpoint import read_errors
from jaxzero.checkpoint.directory import checkpoint_dir
from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.errors import CheckpointError
from jaxzero import train as train_cli
from jaxzero.hf import export as hf_export
from jaxzero.training import loop
from jaxzero.training.workdir import LOCK_FILE

from processes import ROOT, TINY
from processes import child_env
from processes import wait_for

# tiny_zero3, smaller; saves every step, and the schedule spans 10k steps so
# that a run started without --steps is still training when the test looks.
SETTINGS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
            "train.seq_len=32", "train.steps=10000", "train.log_every=1", "checkpoint.every=1",
            "data.max_bytes=200000"]


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
  return child_env(tmp_path_factory.mktemp("jax_compilation_cache"))


def _obey_permissions():
  """Runs in the child before exec: root without the capabilities that let it
  write where the mode bits say no, so read-only directories are read-only."""
  libc = ctypes.CDLL(None, use_errno=True)
  for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
      raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def start(env, module, *args, settings=SETTINGS):
  sets = [arg for s in settings for arg in ("--set", s)]
  config_args = ["--config", TINY, *sets, "--no-progress"] if module == "jaxzero.train" else []
  return subprocess.Popen(
      [sys.executable, "-m", module, *config_args, *args], cwd=ROOT, env=env, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      preexec_fn=_obey_permissions if os.geteuid() == 0 else None)


def finish(process, timeout=300):
  stdout, stderr = process.communicate(timeout=timeout)
  return process.returncode, stdout, stderr


def assert_one_line_error(prog, returncode, stderr, *expected):
  assert returncode == 2, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr
  for text in expected:
    assert text in lines[0], stderr


def read_only_dir(path):
  path.mkdir(parents=True)
  path.chmod(0o555)
  return path


def _workdir_is_a_file(tmp):
  (tmp / "w").write_text("not a directory")
  return [], ["--workdir", "is a file, not a directory"]


def _workdir_not_writable(tmp):
  read_only_dir(tmp / "w")
  return [], ["--workdir", "is not writable: permission denied"]


def _workdir_cannot_be_created(tmp):
  read_only_dir(tmp / "parent")
  return ["--workdir", str(tmp / "parent" / "w")], ["cannot be created in", "permission denied"]


def _checkpoints_is_a_file(tmp):
  (tmp / "w").mkdir()
  (tmp / "w" / "checkpoints").write_text("")
  return [], ["checkpoint directory", "checkpoints is a file, not a directory"]


def _cache_dir_not_writable(tmp):
  (tmp / "corpus.txt").write_text("some text to tokenize " * 200)
  cache = read_only_dir(tmp / "cache")
  return (["--set", f"data.source={tmp / 'corpus.txt'}", "--set", f"data.cache_dir={cache}",
           "--set", "data.max_bytes=16000000"],  # (the default: it caps the stdlib only)
          ["data.cache_dir=", "is not writable: permission denied"])


@pytest.mark.parametrize("problem", [_workdir_is_a_file, _workdir_not_writable,
                                     _workdir_cannot_be_created, _checkpoints_is_a_file,
                                     _cache_dir_not_writable], ids=lambda f: f.__name__[1:])
@pytest.mark.slow
def test_a_path_problem_is_one_line_before_compiling(problem, tmp_path, cli_env):
  args, expected = problem(tmp_path)
  if "--workdir" not in args:
    args = [*args, "--workdir", str(tmp_path / "w")]
  returncode, _, stderr = finish(start(cli_env, "jaxzero.train", *args))
  assert_one_line_error("jaxzero.train", returncode, stderr, *expected)
  assert "compiled the train step" not in stderr


@pytest.mark.slow
@pytest.mark.parametrize("out_problem", ["a file", "in a read-only directory"])
def test_an_export_path_problem_is_one_line(out_problem, tmp_path, cli_env):
  if out_problem == "a file":
    out = tmp_path / "hf"
    out.write_text("")
    expected = ["--out", "is a file"]
  else:
    out = read_only_dir(tmp_path / "ro") / "hf"
    expected = ["--out's parent", "is not writable: permission denied"]
  (tmp_path / "w").mkdir()
  returncode, _, stderr = finish(start(cli_env, "jaxzero.export", "--workdir",
                                       str(tmp_path / "w"), "--out", str(out)))
  assert_one_line_error("jaxzero.export", returncode, stderr, *expected)


FIRST_STEPS = 4


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, cli_env):
  """Run A trains FIRST_STEPS steps on a workdir while run B starts on it too; a
  lone run L trains the same elsewhere. Then run K continues A's workdir and is
  SIGKILLed after a save, and run C reruns K's command and resumes."""
  workdir, alone = tmp_path_factory.mktemp("w"), tmp_path_factory.mktemp("alone")
  first = start(cli_env, "jaxzero.train", "--workdir", str(workdir), "--steps", str(FIRST_STEPS))
  lone = None
  lock = workdir / LOCK_FILE
  try:
    wait_for(lambda: lock.exists() and lock.read_text().strip(), first)
    t0 = time.monotonic()
    second = finish(start(cli_env, "jaxzero.train", "--workdir", str(workdir)), timeout=60)
    second_s = time.monotonic() - t0
    lone = start(cli_env, "jaxzero.train", "--workdir", str(alone), "--steps", str(FIRST_STEPS))
    first_result, lone_result = finish(first), finish(lone)
  finally:
    for process in (first, lone):
      if process is not None:
        process.kill()
        process.wait()
  killed = start(cli_env, "jaxzero.train", "--workdir", str(workdir))
  try:
    wait_for(lambda: max(saved_steps(workdir)) > FIRST_STEPS, killed)
  finally:
    killed.kill()
    killed.wait()  # reaped: a zombie's pid would still look alive
  latest = max(saved_steps(workdir))
  rerun = finish(start(cli_env, "jaxzero.train", "--workdir", str(workdir),
                       "--steps", str(latest + 1)))
  return {"workdir": workdir, "alone": alone, "first_pid": first.pid, "first": first_result,
          "lone": lone_result, "killed_pid": killed.pid, "second": second, "second_s": second_s,
          "latest": latest, "rerun": rerun}


def saved_steps(workdir):
  directory = checkpoint_dir(workdir)
  if not directory.is_dir():
    return [0]
  return [0] + [int(p.name) for p in directory.iterdir() if p.name.isdigit()]  # complete saves


def losses(workdir):
  return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def saved_state(workdir, step):
  with CheckpointReader(workdir) as reader:
    return {name: reader.read(step, tuple(name.split("/")), shape)
            for name, shape in reader.leaf_shapes(step).items()
            if name.startswith(("master/", "params/"))}  # read by name: the dict-keyed leaves


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_workdir_exits_at_once_naming_the_holder(two_runs):
  returncode, _, stderr = two_runs["second"]
  assert_one_line_error("jaxzero.train", returncode, stderr, "is in use by process "
                        f"{two_runs['first_pid']} on host {socket.gethostname()} (running since ")
  assert "compiled the train step" not in stderr
  assert two_runs["second_s"] < 10


@pytest.mark.slow  # the two_runs fixture starts jaxzero.train processes
def test_the_first_run_finishes_as_if_alone(two_runs):
  for result in (two_runs["first"], two_runs["lone"]):
    assert result[0] == 0, result[2]
  first, alone = two_runs["workdir"], two_runs["alone"]
  assert losses(first)[:FIRST_STEPS] == losses(alone)  # to the bit, each step once
  assert len(losses(alone)) == FIRST_STEPS
  chex.assert_trees_all_equal(saved_state(first, FIRST_STEPS), saved_state(alone, FIRST_STEPS))


@pytest.mark.slow  # the two_runs fixture starts jaxzero.train processes
def test_a_rerun_after_sigkill_takes_the_lock_over_and_resumes(two_runs):
  returncode, stdout, stderr = two_runs["rerun"]
  assert returncode == 0, stderr
  assert (f"taking over the lock {two_runs['workdir'] / LOCK_FILE} from process "
          f"{two_runs['killed_pid']} on host {socket.gethostname()}") in stderr
  assert "which is no longer running" in stderr
  assert f"resumed from step {two_runs['latest']}" in stderr
  assert f"trained to step {two_runs['latest'] + 1}" in stdout
  assert not (two_runs["workdir"] / LOCK_FILE).exists()  # released and removed at the end


@pytest.mark.slow  # the two_runs fixture starts jaxzero.train processes
def test_a_damaged_state_metadata_is_named_in_words(two_runs, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(two_runs["workdir"], workdir)
  step_dir = checkpoint_dir(workdir) / str(two_runs["latest"] + 1)
  (step_dir / "state" / "_METADATA").write_bytes(b"\x00 not json")
  with pytest.raises(CheckpointError) as error:
    loop.run_training(config.load(TINY, [*SETTINGS, "checkpoint.on_damaged=refuse"]), workdir,
                         progress=False)
  message = str(error.value)
  assert (f"checkpoint {step_dir} is damaged: its state metadata (state/_METADATA) cannot be "
          "read: not valid JSON: expecting value (line 1, column 1)") in message, message
  assert "\n" not in message and not re.search(r": \d+$", message)


def test_a_bare_key_or_index_error_is_said_in_words():
  reason = read_errors.reason
  assert reason(KeyError(0)) == "missing entry 0"
  assert reason(IndexError()) == "index out of range"


@pytest.mark.slow  # the two_runs fixture starts jaxzero.train processes
def test_an_export_directory_gets_the_mode_mkdir_would_give(two_runs, tmp_path):
  previous = os.umask(0o027)
  try:
    done = hf_export.export_hf(two_runs["workdir"], tmp_path / "hf", dtype="float32")
  finally:
    os.umask(previous)
  assert (done.out.stat().st_mode & 0o777) == 0o750


@pytest.mark.slow
def test_checkpoint_at_end_false_saves_nothing_at_the_last_step(tmp_path):
  """checkpoint.at_end=false (a benchmark's run): the last step is not saved, and the
  summary says so; checkpoint.every still saves its steps before the last."""
  settings = [*SETTINGS, "checkpoint.at_end=false", "checkpoint.every=2"]
  outcome = loop.run_training(config.load(TINY, settings), tmp_path / "w", steps=3,
                              progress=False)
  assert outcome.step == 3 and outcome.checkpoint is None
  saved = sorted(int(p.name) for p in checkpoint_dir(tmp_path / "w").iterdir() if p.name.isdigit())
  assert saved == [2]
  assert "step 3 not saved (checkpoint.at_end=false)" in train_cli.summary(
      outcome, tmp_path / "w", 3, 10000)
