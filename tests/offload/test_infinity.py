"""ZeRO-Infinity (offload.params=nvme): every step's loss and the final weights of the
in-memory run, on 1 and 8 devices and 2 processes, with and without gradient
accumulation; checkpoints that move between the two, exactly, under their checksums;
a SIGKILL costs nothing; no room on disk changes nothing. Its programs, plan,
benchmark and bad input: tests/offload/test_infinity_tools.py."""

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.errors import DamagedCheckpointError, PathError
from jaxzero.offload import nvme_checkpoint, nvme_store
from jaxzero.offload import targets as offload_targets
from jaxzero.runners import infinity
from jaxzero.training import loop

from processes import ROOT, TINY, at_step, child_env, logged, losses, run_python, wait_for
from tiny import INFINITY_SETS as SETS
from tiny import infinity_sets


def train(workdir, sets=(), devices=8, steps=None):
  cfg = config.load(TINY, [*SETS, f"mesh.fsdp={devices}", *sets])
  return loop.run_training(cfg, workdir, steps, devices=jax.devices()[:devices], progress=False)


def weights(workdir, step) -> dict[str, np.ndarray]:
  """Checkpoint `step`'s master weights and compute copy, by leaf name."""
  with CheckpointReader(workdir, side=nvme_checkpoint.SIDE_ITEM) as reader:
    return {name: reader.read(step, tuple(name.split("/")), shape)
            for name, shape in reader.leaf_shapes(step).items()
            if name.startswith(("master/", "params/"))}


def assert_same_run(got_dir, expected_dir, steps, rtol=1e-6):
  got, expected = losses(got_dir), losses(expected_dir)
  np.testing.assert_allclose([got[s] for s in steps], [expected[s] for s in steps], rtol=rtol)


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("nvme")


class _References(dict):
  """{(devices, grad_accum): workdir} of the in-memory runs at stage 3, each trained
  when first asked for."""

  def __init__(self, tmp_path_factory):
    super().__init__()
    self._tmp = tmp_path_factory

  def __missing__(self, key):
    devices, accum = key
    self[key] = workdir = self._tmp.mktemp(f"memory_d{devices}_a{accum}")
    train(workdir, [f"train.grad_accum={accum}"], devices)
    return workdir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return _References(tmp_path_factory)


@pytest.fixture(scope="module")
def infinity_run(tmp_path_factory, nvme_dir):
  """The workdir of a run with everything on NVMe: 8 devices, grad_accum 2."""
  workdir = tmp_path_factory.mktemp("infinity")
  train(workdir, ["train.grad_accum=2", *infinity_sets(nvme_dir)])
  return workdir


@pytest.mark.slow  # its in-memory reference trains for the fast lane's budget alone
def test_every_loss_and_the_final_weights_are_the_in_memory_run(reference, infinity_run,
                                                                 nvme_dir):
  assert_same_run(infinity_run, reference[8, 2], range(1, 11))
  assert losses(infinity_run)[10] < losses(infinity_run)[1]
  expected, got = weights(reference[8, 2], 10), weights(infinity_run, 10)
  assert sorted(got) == sorted(expected) and len(got) > 10
  for name, value in got.items():  # params/: derived from the masters, cast as XLA casts
    np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
  assert not list(nvme_dir.iterdir())  # the stores are deleted when the run ends
  index = json.loads((infinity_run / "checkpoints/10/nvme/index.json").read_text())
  assert index["derived"] == "float32"


@pytest.mark.slow  # slowed writes: the fast lane keeps the 8-device exactness run
def test_one_device_without_accumulation(reference, nvme_dir, tmp_path, monkeypatch):
  # (With the weights in pinned_host and the optimizer on NVMe, the whole-program step's
  # equality is tests/offload/test_host_offload.py's.)
  # Slow writes, as on a busy machine: a step's reads of the masters must wait for the
  # last update's writes still in flight (a stale read once moved a loss by 2.6 %).
  transfer = nvme_store._transfer  # pylint: disable=protected-access

  def slow_transfer(call, *args):
    if call is os.pwritev:
      time.sleep(0.01)
    transfer(call, *args)

  monkeypatch.setattr(nvme_store, "_transfer", slow_transfer)
  train(tmp_path, ["train.grad_accum=1", *infinity_sets(nvme_dir)], 1)
  assert_same_run(tmp_path, reference[1, 1], range(1, 11))
  expected, got = weights(reference[1, 1], 10), weights(tmp_path, 10)
  for name, value in got.items():
    np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(infinity_run, nvme_dir, tmp_path):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  assert train(workdir, ["train.grad_accum=2", *infinity_sets(nvme_dir)]).start_step == 5
  assert losses(workdir) == losses(infinity_run)


@pytest.mark.slow  # the infinity_run fixture trains
def test_its_checkpoint_resumes_in_memory_on_another_mesh_and_stage(infinity_run, tmp_path):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  assert train(workdir, ["train.grad_accum=2", "zero.stage=1"], devices=4).start_step == 5
  assert_same_run(workdir, infinity_run, range(6, 11))


@pytest.mark.slow  # it trains the in-memory reference
def test_an_in_memory_checkpoint_resumes_with_everything_on_nvme(reference, nvme_dir, tmp_path):
  # On 1 device, one micro-step of 16 rows where the run had two of 8: the same mean
  # gradient, summed in another order (~1e-6 apart after 10 steps in memory too).
  workdir = at_step(reference[8, 2], 5, tmp_path / "w")
  assert train(workdir, ["train.grad_accum=1", *infinity_sets(nvme_dir)], 1).start_step == 5
  assert_same_run(workdir, reference[8, 2], range(6, 11), rtol=3e-6)


@pytest.mark.slow  # the infinity_run fixture trains
def test_checksums_cover_its_checkpoint(infinity_run, nvme_dir, tmp_path):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  item = workdir / "checkpoints/5/nvme/layers.w_up_LxDxF"
  chunk = max((p for p in item.rglob("*") if p.is_file() and p.name != ".zarray"),
              key=lambda p: p.stat().st_size)
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x40  # one bit of one master weight's (or moment's) value
  chunk.write_bytes(bytes(data))
  sets = ["train.grad_accum=2", "checkpoint.on_damaged=refuse"]
  with pytest.raises(DamagedCheckpointError, match="layers/w_up_LxDxF"):
    train(workdir, [*sets, *infinity_sets(nvme_dir)])


@pytest.mark.slow
def test_sigkill_during_a_step_or_a_save_resumes_to_the_uninterrupted_losses(
    infinity_run, tmp_path):
  workdir, store = at_step(infinity_run, 5, tmp_path / "w"), tmp_path / "nvme"
  store.mkdir()
  sets = ["train.grad_accum=2", *infinity_sets(store), "checkpoint.every=1"]
  env = child_env(pathlib.Path(jax.config.jax_compilation_cache_dir))
  killed = subprocess.Popen(
      [sys.executable, "-m", "jaxzero.train", "--config", TINY, "--workdir", str(workdir),
       "--no-progress", *[a for s in [*SETS, *sets] for a in ("--set", s)]],
      cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  delay = random.uniform(0, 0.3)
  wait_for(lambda: len(logged(workdir)) >= 7, killed)
  time.sleep(delay)
  assert killed.poll() is None, f"the run ended before it was killed {delay:.2f} s after step 7"
  killed.send_signal(signal.SIGKILL)
  killed.communicate(timeout=60)
  train(workdir, sets)  # from the last complete checkpoint
  assert losses(workdir) == losses(infinity_run), f"killed {delay:.2f} s after step 7"
  assert not list(store.iterdir())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_as_in_memory(reference, tmp_path):
  store = tmp_path / "nvme"
  store.mkdir()
  sets = [*SETS, "train.grad_accum=2", "mesh.fsdp=8", *infinity_sets(store)]
  run = run_python("-m", "jaxzero.launch", "--nproc", "2", "--devices-per-proc", "4", "--",
                   "--config", TINY, "--workdir", str(tmp_path / "w"), "--no-progress",
                   *[a for s in sets for a in ("--set", s)],
                   env=child_env(pathlib.Path(jax.config.jax_compilation_cache_dir)), timeout=500)
  assert run.returncode == 0, run.stderr[-3000:]
  assert_same_run(tmp_path / "w", reference[8, 2], range(1, 11))
  expected, got = weights(reference[8, 2], 10), weights(tmp_path / "w", 10)
  for name, value in got.items():
    np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.slow  # the infinity_run fixture trains
def test_no_room_counts_the_gradients_and_changes_nothing(infinity_run, nvme_dir, monkeypatch,
                                                          tmp_path):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  before = sorted(p.name for p in workdir.rglob("*"))
  usage = shutil.disk_usage(nvme_dir)
  monkeypatch.setattr(offload_targets.shutil, "disk_usage", lambda _: usage._replace(free=1000))
  chosen = []  # the runner, as make_runner chose it (its check then refuses it)
  make = loop.make_runner
  monkeypatch.setattr(loop, "make_runner",
                      lambda program, *a, **kw: chosen.append(make(program, *a, check=False))
                      or make(program, *a, **kw))
  with pytest.raises(PathError) as error:
    train(workdir, ["train.grad_accum=2", *infinity_sets(nvme_dir)])
  tier = chosen[0]
  assert isinstance(tier, infinity.InfinityRunner)
  phi = sum(leaf.size for leaf in jax.tree.leaves(tier.program.abstract.master))
  needed = tier.bytes_needed()
  assert 16 * phi <= needed < 1.5 * 16 * phi  # master, 2 moments, gradient: 16 bytes each
  assert (f"the NVMe tier needs {needed / 1e6:.1f} MB ({needed:,} bytes) for this process's "
          "share of the optimizer state, the master weights and the gradients") in str(error.value)
  assert sorted(p.name for p in workdir.rglob("*")) == before
  assert not list(nvme_dir.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("params", ["nvme", "device"], ids=["infinity", "in_memory"])
def test_its_float32_checkpoint_resumes_in_float16(infinity_run, nvme_dir, tmp_path, params):
  """A checkpoint with an NVMe item read into float16 (whose scaler it lacks: made afresh),
  by ZeRO-Infinity (whose layer programs then scale the loss) and in memory; both were
  refused, one as damaged, one at its first step."""
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  sets = ["train.grad_accum=2", "precision.compute=float16",
          *(infinity_sets(nvme_dir) if params == "nvme" else ())]
  assert train(workdir, sets).start_step == 5
  got, expected = losses(workdir), losses(infinity_run)
  np.testing.assert_allclose([got[s] for s in range(6, 11)], [expected[s] for s in range(6, 11)],
                             rtol=2e-3)  # float16's rounding of the compute copy


def test_an_infinity_runner_made_anew_keeps_one_store(nvme_dir):
  """init twice (a fallback to an older checkpoint does the same): the second store
  replaces the first, gradients' included, and close() removes them."""
  cfg = config.load(TINY, [*SETS, "mesh.fsdp=8", *infinity_sets(nvme_dir)])
  runner = loop.prepare(cfg, jax.devices()[:8], workdir=nvme_dir / "run")
  runner.init()
  runner.init()
  runner.close()
  assert not runner.directory.exists()
