"""`python -m jaxzero.launch`: two processes train to the same losses as one, checkpoints
move between process counts, and a dead process ends the launch instead of hanging it."""

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero.checkpoint.reader import latest_step
from jaxzero.training import loop

import damage
from processes import ROOT, TINY, child_env, run_python

# tests/test_step.py's tiny model; the schedule spans 6 steps, runs stop earlier with --steps.
SETS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.seq_len=32",
        "train.global_batch=16", "train.grad_accum=2", "train.lr=3e-3", "train.warmup_steps=2",
        "train.steps=6", "train.log_every=1", "data.max_bytes=200000", "mesh.replica=1",
        "mesh.fsdp=8", "eval.every=3", "eval.batches=2", "data.eval_fraction=0.1"]
HYBRID = ["zero.strategy=HYBRID_SHARD", "mesh.replica=2", "mesh.fsdp=4"]


def set_args(sets):
  return [arg for s in sets for arg in ("--set", s)]


def launch_args(workdir, *train_args, sets=()):
  """The Python arguments of a two-process launch of jaxzero.train on `workdir`."""
  return ["-m", "jaxzero.launch", "--nproc", "2", "--devices-per-proc", "4",
          "--", "--config", TINY, "--workdir", str(workdir), "--no-progress",
          *set_args([*SETS, *sets]), *train_args]


@pytest.fixture(scope="module")
def launch_env(tmp_path_factory) -> dict:
  """The launcher's environment: the tests' fast-compile XLA flags (results change
  only in the last bits) and one compilation cache for the module's launches, so
  launches of the same program (the same SETS) compile it once."""
  return child_env(tmp_path_factory.mktemp("launch_compilation_cache"), alone=True)


def launch(env, workdir, *train_args, sets=()):
  result = run_python(*launch_args(workdir, *train_args, sets=sets), env=env, timeout=400)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def logged_losses(workdir) -> np.ndarray:
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  records = [json.loads(line) for line in lines]
  assert [r["step"] for r in records] == list(range(1, len(records) + 1))
  return np.array([r["loss"] for r in records])


def one_process(workdir, steps=None):
  """Trains (or resumes) in this process: one process with 8 virtual devices."""
  cfg = config.load(TINY, SETS)
  return loop.train(cfg, workdir, steps=steps, devices=jax.devices()[:8], progress=False)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  """The workdir of one uninterrupted run of steps 1-6 in one process."""
  workdir = tmp_path_factory.mktemp("one_process")
  one_process(workdir)
  return workdir


@pytest.fixture(scope="module")
def reference(reference_run):
  """Losses of steps 1-6 of one uninterrupted run in one process."""
  return logged_losses(reference_run)


def eval_losses(workdir) -> dict[int, float]:
  records = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text()
             .splitlines()]
  return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


@pytest.fixture(scope="module")
def two_process_stage3(tmp_path_factory, launch_env):
  """The workdir of 2 processes x 4 devices, ZeRO-3 over all 8, after steps 1-3."""
  workdir = tmp_path_factory.mktemp("two_process_stage3")
  (workdir.parent / "two_process_stage3.out").write_text(
      launch(launch_env, workdir, "--steps", "3").stdout)
  return workdir


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_like_one_under_stage3(two_process_stage3, reference):
  np.testing.assert_allclose(logged_losses(two_process_stage3), reference[:3], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_memory_line_counts_every_process_on_the_host(two_process_stage3):
  out = (two_process_stage3.parent / "two_process_stage3.out").read_text()
  (line,) = [l for l in out.splitlines() if "memory    per device" in l]
  assert "; 8 CPU devices in 2 processes share this host's" in line, line


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_evaluate_like_one(two_process_stage3, reference_run):
  # Each process supplies the held-out rows its devices hold, as for training.
  two, one = eval_losses(two_process_stage3), eval_losses(reference_run)
  assert sorted(two) == [3] and sorted(one) == [3, 6]
  np.testing.assert_allclose(two[3], one[3], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_like_one_under_hybrid_shard(tmp_path, reference, launch_env):
  # replica=2 x fsdp=4: each process holds one whole replica, sharded over its 4 devices.
  launch(launch_env, tmp_path, "--steps", "3", sets=HYBRID)
  np.testing.assert_allclose(logged_losses(tmp_path), reference[:3], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, sets", [
    ("gpipe", ["mesh.fsdp=2", "mesh.tensor=2"]), ("1f1b", ["mesh.fsdp=4"])])
def test_two_processes_train_like_one_with_a_stage_each(tmp_path, reference, launch_env,
                                                        schedule, sets):
  # pipeline=2 outside the other axes: each process holds one stage and only activations
  # cross between the processes (issue 28); with tensor=2, each tensor group inside one
  # process (issue 16).
  launch(launch_env, tmp_path, "--steps", "3",
         sets=[*sets, "mesh.pipeline=2", f"pipeline.schedule={schedule}"])
  np.testing.assert_allclose(logged_losses(tmp_path), reference[:3], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_like_one_with_the_ring_across_them(tmp_path, reference,
                                                               launch_env):
  # context=8 over both processes' devices: the keys and values pass between processes
  # on two of the ring's hops (issue 43), load balanced.
  launch(launch_env, tmp_path, "--steps", "3",
         sets=["mesh.fsdp=1", "mesh.context=8", "context.strategy=ring"])
  np.testing.assert_allclose(logged_losses(tmp_path), reference[:3], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoints_move_between_process_counts(two_process_stage3, reference, tmp_path,
                                                launch_env):
  workdir = tmp_path / "run"
  shutil.copytree(two_process_stage3, workdir)
  one_process(workdir, steps=5)  # restores step 3, written by 2 processes
  launch(launch_env, workdir, "--steps", "6")  # 2 processes restore step 5, written by 1
  np.testing.assert_allclose(logged_losses(workdir), reference, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_shards_one_process_cannot_read_stop_the_run_instead_of_a_fallback_alone(
    two_process_stage3, tmp_path, launch_env):
  """Checkpoint 4's files written by process 1, damaged: process 1's reads fail, process
  0's do not. Process 1 fell back to checkpoint 3 alone and met process 0 in another step's
  collectives (a 30 s Gloo timeout and a traceback). It stops in one line naming the
  damage, and the run with it, with both checkpoints where they were."""
  workdir = tmp_path / "run"
  shutil.copytree(two_process_stage3, workdir)
  launch(launch_env, workdir, "--steps", "4")  # checkpoint 4, written by both processes
  step_dir = workdir / "checkpoints" / "4"
  for data in (step_dir / "state" / "ocdbt.process_1" / "d").iterdir():
    data.write_bytes(bytes(64) + data.read_bytes()[64:-64] + bytes(64))
  assert damage._saved_values(step_dir) is None  # the damage shows
  before = {p: p.read_bytes() for p in (workdir / "checkpoints").rglob("*") if p.is_file()}
  result = run_python(*launch_args(workdir, "--steps", "6"), env=launch_env, timeout=400)
  assert result.returncode == 2, result.stderr[-3000:]
  assert (f"[1] jaxzero.train: error: checkpoint {step_dir} is damaged: ") in result.stderr
  assert ("process 1 of 2 read this, and a process does not resume an older checkpoint alone, "
          "so the run stops and moves nothing (--resume-step 3 resumes the one before it on "
          "every process)") in result.stderr
  assert "Traceback" not in result.stderr and "trying checkpoint 3" not in result.stderr
  assert {p: p.read_bytes() for p in (workdir / "checkpoints").rglob("*") if p.is_file()} \
      == before


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_process_ends_the_launch_within_60s(tmp_path, launch_env):
  out, err = tmp_path / "out.txt", tmp_path / "err.txt"
  with open(out, "w") as out_file, open(err, "w") as err_file:
    # A schedule of 1000 steps: still training when killed (--steps may not pass it).
    launcher = subprocess.Popen(
        [sys.executable, *launch_args(tmp_path / "w", sets=["train.steps=1000"])], cwd=ROOT,
        env=launch_env, stdout=out_file, stderr=err_file, start_new_session=True)
  try:
    pids = wait_for(lambda: re.search(r"process 0 \(pid (\d+)\), process 1 \(pid (\d+)\)",
                                      err.read_text()), launcher)
    victim, survivor = int(pids.group(2)), int(pids.group(1))
    wait_for(lambda: (tmp_path / "w" / "metrics.jsonl").exists(), launcher)  # mid-run
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    code = launcher.wait(timeout=90)
    assert time.monotonic() - killed < 60
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
  assert code != 0
  assert f"error: process 1 (pid {victim}) was killed by SIGKILL" in err.read_text()
  assert not pathlib.Path(f"/proc/{survivor}").exists(), "the other process was left running"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hangup_of_the_launcher_stops_its_processes(tmp_path, launch_env):
  """A closed terminal or a dropped ssh (SIGHUP) reaches every process as SIGTERM, a
  preemption: they save the step they are at, and none runs on without the launcher."""
  with launched(tmp_path, launch_env, ["train.steps=1000"]) as (launcher, err):
    pids = wait_for(lambda: re.search(r"process 0 \(pid (\d+)\), process 1 \(pid (\d+)\)",
                                      err.read_text()), launcher)
    wait_for(lambda: (tmp_path / "w" / "metrics.jsonl").exists(), launcher)  # mid-run
    os.kill(launcher.pid, signal.SIGHUP)
    code = launcher.wait(timeout=90)
  assert code == 128 + signal.SIGHUP, err.read_text()
  said = err.read_text()
  assert ("SIGHUP: the processes stop and save at their next logged step (train.log_every); "
          "send it again to stop them at once, unsaved") in said
  assert "interrupted by SIGHUP; every process stopped" in said
  assert not any(pathlib.Path(f"/proc/{pid}").exists() for pid in pids.groups())
  assert latest_step(tmp_path / "w") is not None, err.read_text()  # saved as it stopped


@pytest.mark.slow
def test_a_process_the_launcher_started_ends_when_the_launcher_is_killed(tmp_path):
  """SIGKILL (or the OOM killer) gives the launcher no chance to stop its processes; each
  gets SIGTERM from the kernel instead, and none runs on alone."""
  child = ("import sys, time; from jaxzero.runtime import distributed; "
           "distributed.stop_with_launcher(); print('ready', flush=True); time.sleep(120)")
  parent = (f"import os, subprocess, sys, time\n"
            f"env = dict(os.environ, JAXZERO_LAUNCHER_PID=str(os.getpid()))\n"
            f"c = subprocess.Popen([sys.executable, '-c', {child!r}], env=env)\n"
            f"print(c.pid, flush=True)\ntime.sleep(120)\n")
  ready = tmp_path / "out.txt"
  with open(ready, "w") as out:
    launcher = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=out,
                                env=child_env(pythonpath=True))
  try:
    wait_for(lambda: "ready" in ready.read_text(), launcher, timeout_s=60)
    pid = int(ready.read_text().split()[0])
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(pid):
      time.sleep(0.1)
    assert not _running(pid)
  finally:
    if launcher.poll() is None:
      launcher.kill()


def _running(pid: int) -> bool:
  """Whether `pid` exists and is not a zombie (an exited process not yet reaped)."""
  try:
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except (FileNotFoundError, ProcessLookupError):
    return False


@contextlib.contextmanager
def launched(tmp_path, launch_env, sets):
  """A two-process launch in a session of its own, its stderr in tmp_path/err.txt: yields
  (the launcher, that file); whatever still runs at the end is killed."""
  err = tmp_path / "err.txt"
  with open(err, "w") as err_file:
    launcher = subprocess.Popen(
        [sys.executable, *launch_args(tmp_path / "w", sets=sets)], cwd=ROOT, env=launch_env,
        stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True)
  try:
    yield launcher, err
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)


def wait_for(condition, launcher, timeout_s=300):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    found = condition()
    if found:
      return found
    assert launcher.poll() is None, "the launch ended early"
    time.sleep(0.2)
  raise AssertionError("timed out")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_failing_process_ends_the_launch_with_its_error(tmp_path, launch_env):
  # --resume finds no checkpoint only once the processes run.
  result = run_python(*launch_args(tmp_path, "--resume"), env=launch_env, timeout=120)
  assert result.returncode == 2
  assert re.search(r"error: process \d \(pid \d+\) exited with code 2", result.stderr)
  assert ("jaxzero.train: error: --resume: there is no checkpoint to resume"
          in result.stderr.split("exited")[-1])


@pytest.mark.slow
@pytest.mark.parametrize("bad, message", [
    (["--set", "zero.stage=5"], "zero.stage"),
    (["--steps", "100000"], "--steps"),
    (["--set", "distributed.num_processes=3"], "distributed.num_processes=3: jaxzero.launch "
     "says where each of its processes joins"),
    (["--set", "mesh.fsdp=3", "--set", "train.global_batch=12"], "the mesh names 3 devices, "
     "which --nproc 2 processes cannot share evenly; use --nproc among 1, 3"),
    # On the launch's devices, before they exist (each process found it, once joined).
    (["--set", "train.global_batch=24"], "train.global_batch=24 is not divisible by "
     "data-parallel devices (8) x train.grad_accum (2) = 16"),
])
def test_bad_training_arguments_are_one_line_before_any_process_starts(tmp_path, bad, message):
  result = run_python(*launch_args(tmp_path, *bad), timeout=60)
  assert result.returncode == 2
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert result.stderr.startswith("jaxzero.train: error: ") and message in result.stderr
  assert "started" not in result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_after_a_ctrl_c_the_launcher_waits_for_the_save_and_a_second_kills(tmp_path,
                                                                          launch_env):
  """The processes agree to stop at a logged step, however far off: waited for (it was
  cut at 60 s, unsaved and unsaid). A second Ctrl-C kills them, and says so."""
  sets = ["train.steps=100000", "train.log_every=100000", "checkpoint.every=0", "eval.every=0"]
  with launched(tmp_path, launch_env, sets) as (launcher, err):
    wait_for(lambda: err.read_text().count("compiled the train step") == 2, launcher)
    time.sleep(2)  # training, between logged steps
    os.kill(launcher.pid, signal.SIGINT)
    time.sleep(3)
    assert launcher.poll() is None  # waiting for the agreed step
    os.kill(launcher.pid, signal.SIGINT)
    code = launcher.wait(timeout=60)
  assert code == 128 + signal.SIGINT, err.read_text()
  assert ("interrupted by SIGINT; killed the processes (a second signal, or 600 s without "
          "stopping) before they saved") in err.read_text()


@pytest.mark.slow
def test_help_and_print_config_are_said_once_and_start_nothing(tmp_path):
  for asked in ("--help", "--print-config"):
    result = run_python(*launch_args(tmp_path, asked), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "started" not in result.stderr and "[0]" not in result.stdout
  assert result.stdout.count("train.steps=") == 1


@pytest.mark.slow
def test_launch_needs_the_train_arguments_after_dashes():
  result = run_python("-m", "jaxzero.launch", "--nproc", "2", timeout=60)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "jaxzero.launch: error: put the jaxzero.train arguments after --, e.g. -- --config "
      "configs/tiny_zero3.py"]


def test_a_reader_that_went_away_does_not_stop_the_copy():
  """`jaxzero.launch ... | head -1`: the launcher's stdout closes; a child's lines are
  still read (and kept for the error summary), or the child would block on a full pipe."""
  import collections
  import io
  from jaxzero import launch

  class Closed(io.StringIO):
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")

  tail = collections.deque(maxlen=3)
  stream = io.StringIO("".join(f"line {i}\n" for i in range(100_000)))
  launch._pump(stream, Closed(), "[0] ", tail)  # pylint: disable=protected-access
  assert stream.closed and list(tail) == ["line 99997", "line 99998", "line 99999"]


def test_the_process_named_is_the_first_to_fail_not_the_peer_it_stopped():
  """Process 1 fails; the peer watch ends process 0 a few milliseconds later, within one
  poll: the summary names process 1."""
  import types
  from jaxzero import launch
  run = launch.Launch(2, 1, [])
  run.procs = [types.SimpleNamespace(poll=lambda: 1), types.SimpleNamespace(poll=lambda: 1)]
  run.exited_at = [100.004, 100.0]
  assert run._wait_for_first_failure() == 1  # pylint: disable=protected-access
  run.procs[0] = types.SimpleNamespace(poll=lambda: -9)  # killed (out of memory, say)
  assert run._wait_for_first_failure() == 0  # pylint: disable=protected-access
