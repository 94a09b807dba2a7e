"""ZeRO-Infinity's NVMe tier (offload.optimizer=nvme): the losses of the in-memory
optimizer across processes; checkpoints that move between the two; a SIGKILL at
any moment costs nothing; a non-finite step touches nothing; bad input is one
line. (Stages 1-3 against no offload: tests/test_host_offload.py.)"""

import hashlib
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
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts

from jaxzero import config
from jaxzero import train as train_cli
from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.errors import ConfigError, PathError
from jaxzero.models.llama import count_params
from jaxzero.offload import nvme_checkpoint, nvme_store
from jaxzero.offload import targets as offload_targets
from jaxzero.training import loop

from processes import ROOT, TINY, at_step, child_env, logged, losses, wait_for

# tiny_zero3, smaller, in float32 with two micro-steps; saved at steps 2 and 4.
SETS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
        "train.seq_len=32", "train.grad_accum=2", "precision.compute=float32", "train.steps=4",
        "train.warmup_steps=1", "train.lr=3e-3", "train.log_every=1", "data.max_bytes=200000",
        "checkpoint.every=2"]


def nvme_sets(nvme_dir, stage=3):
  return [f"zero.stage={stage}", "offload.optimizer=nvme", f"offload.nvme_dir={nvme_dir}"]


def train(workdir, sets=(), steps=None, devices=8):
  cfg = config.load(TINY, [*SETS, *sets])
  return loop.run_training(cfg, workdir, steps, devices=jax.devices()[:devices],
                              progress=False)


def launch(workdir, sets, env, nproc=1):
  """`jaxzero.train` on `workdir` with `sets` (over `nproc` processes of 4 devices
  each: jaxzero.launch), as a process."""
  command = ["jaxzero.train"]
  if nproc > 1:
    command = ["jaxzero.launch", "--nproc", str(nproc), "--devices-per-proc", "4", "--"]
  return subprocess.Popen(
      [sys.executable, "-m", *command, "--config", TINY, "--workdir", str(workdir),
       "--no-progress", *[arg for s in [*SETS, *sets] for arg in ("--set", s)]],
      cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def snapshot(directory) -> dict:
  root = pathlib.Path(directory)
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def env():
  """The CLI's environment, sharing this session's compilation cache (conftest.py):
  a process that runs a program this one compiled does not compile it again."""
  return child_env(pathlib.Path(jax.config.jax_compilation_cache_dir), alone=True)


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def nvme_run(tmp_path_factory, nvme_dir):
  """(workdir, losses) of steps 1-4 with the NVMe tier: stage 3 on 8 devices."""
  workdir = tmp_path_factory.mktemp("nvme_stage3")
  train(workdir, nvme_sets(nvme_dir))
  return workdir, losses(workdir)


@pytest.fixture(scope="module")
def in_memory(nvme_run, tmp_path_factory):
  """(workdir, losses): steps 3-4 in memory, resumed from its checkpoint of step 2,
  at stage 2 on 4 devices (checkpoints of every kind resume on any mesh and stage);
  saved at steps 3 and 4."""
  workdir = at_step(nvme_run[0], 2, tmp_path_factory.mktemp("in_memory") / "w")
  sets = ["zero.stage=2", "mesh.fsdp=4", "checkpoint.every=1"]
  assert train(workdir, sets, devices=4).start_step == 2
  return workdir, losses(workdir)


def saved_weights(workdir, step) -> dict[str, np.ndarray]:
  """The fp32 master weights of checkpoint `step`, by name."""
  with CheckpointReader(workdir, side=nvme_checkpoint.SIDE_ITEM) as reader:
    return {name: reader.read(step, tuple(name.split("/")), shape)
            for name, shape in reader.leaf_shapes(step).items() if name.startswith("master/")}


@pytest.mark.slow
def test_stage3_leaves_no_files_and_saves_the_state_for_export(nvme_run, nvme_dir):
  assert sorted(nvme_run[1]) == [1, 2, 3, 4] and np.isfinite(list(nvme_run[1].values())).all()
  assert not list(nvme_dir.iterdir())  # the store is deleted when the run ends
  item = nvme_run[0] / "checkpoints" / "4" / "nvme"
  index = json.loads((item / "index.json").read_text())
  assert index["leaves"]["layers/w_up_LxDxF"]["kinds"] == [
      "master/layers/w_up_LxDxF", "opt_state/1/0/mu/layers/w_up_LxDxF",
      "opt_state/1/0/nu/layers/w_up_LxDxF"]
  # Export's reader reads the master weights there, whole or a layer at a time.
  with CheckpointReader(nvme_run[0], side=nvme_checkpoint.SIDE_ITEM) as reader:
    path = ("master", "layers", "w_up_LxDxF")
    whole = reader.read(4, path, (2, 64, 128))
    assert whole.shape == (2, 64, 128) and np.isfinite(whole).all()
    layers = reader.read_by_layer(4, path, (2, 64, 128))  # checked once both are read
    np.testing.assert_array_equal(np.stack([layers[0], layers[1]]), whole)


@pytest.mark.slow
def test_memory_resumes_an_nvme_checkpoint_on_another_mesh_and_stage(in_memory, nvme_run):
  got = in_memory[1]
  np.testing.assert_allclose([got[3], got[4]], [nvme_run[1][3], nvme_run[1][4]], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_at_stage2_resume_an_in_memory_checkpoint_and_train_as_in_memory(
    env, in_memory, nvme_dir, tmp_path):
  # 2 processes x 4 devices (jaxzero.launch), the optimizer state sharded across
  # both and the weights whole (each update all-gathers them across processes),
  # from the in-memory checkpoint of step 3 (1 process of 4 devices): step 4's
  # loss, and the weights its update saves, are those of the run in memory.
  workdir = at_step(in_memory[0], 3, tmp_path / "w")
  run = launch(workdir, nvme_sets(nvme_dir, 2), env, nproc=2)
  _, stderr = run.communicate(timeout=400)
  assert run.returncode == 0, stderr[-3000:]
  np.testing.assert_allclose(losses(workdir)[4], in_memory[1][4], rtol=1e-6)
  expected = saved_weights(in_memory[0], 4)
  got = saved_weights(workdir, 4)
  assert sorted(got) == sorted(expected) and len(got) > 10
  for name, weight in got.items():
    np.testing.assert_allclose(weight, expected[name], rtol=1e-6, atol=1e-8, err_msg=name)
  assert not list(nvme_dir.iterdir())


# ----------------------------------------------------------------------------- SIGKILL


@pytest.mark.slow
def test_sigkill_at_a_random_moment_resumes_to_the_uninterrupted_losses(env, nvme_run, tmp_path):
  # A run resumed at step 2 is killed at a random moment once its step 3 is
  # logged: saving step 3 (the store's chunks copied into the checkpoint), in
  # step 4 (the update writing the store), or saving step 4.
  workdir, store = at_step(nvme_run[0], 2, tmp_path / "w"), tmp_path / "nvme"
  store.mkdir()
  sets = [*nvme_sets(store), "checkpoint.every=1"]
  killed = launch(workdir, sets, env)
  delay = random.uniform(0, 0.5)
  moment = f"killed {delay:.2f} s after step 3 was logged"
  wait_for(lambda: len(logged(workdir)) >= 3, killed)
  time.sleep(delay)
  assert killed.poll() is None, f"the run ended before it was {moment}"
  killed.send_signal(signal.SIGKILL)
  killed.communicate(timeout=60)
  assert list(store.iterdir()), "the killed run's store should be left behind"
  saved = {p.name: snapshot(p) for p in (workdir / "checkpoints").iterdir()
           if p.name.isdigit()}

  train(workdir, sets)  # resumes from the last complete checkpoint
  got = losses(workdir)
  assert got == nvme_run[1], moment  # bit for bit
  for name, files in saved.items():  # every checkpoint complete at the kill is intact
    if (workdir / "checkpoints" / name).exists():
      assert snapshot(workdir / "checkpoints" / name) == files
  assert not list(store.iterdir())


# ----------------------------------------------------------------------------- non-finite


def test_a_nonfinite_step_changes_nothing_in_memory_or_on_disk(tmp_path):
  # The update is skipped, here as in memory (train.nonfinite decides what follows).
  cfg = config.load(TINY, [*SETS, *nvme_sets(tmp_path)])
  run = loop.build(cfg, jax.devices()[:8], tmp_path / "w")
  state = run.runner.init()
  on_disk = snapshot(run.runner.directory)
  in_memory = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
  grads = jax.tree.map(jnp.ones_like, state.params)

  def nonfinite(params, batch, scale):  # the gradient step of a batch with a NaN loss
    del params, batch, scale
    return grads, jnp.float32(jnp.nan), jnp.float32(1.0)

  new, metrics = run.runner.step(state, run.batch(0), nonfinite)
  run.runner.store.writes.wait()
  assert int(metrics["nonfinite"]) == 1 and int(new.step) == 1
  assert snapshot(run.runner.directory) == on_disk
  for old, kept in zip(in_memory, jax.tree.leaves((new.params, new.opt_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(kept), old)
  run.runner.close()
  assert not run.runner.directory.exists()


# ----------------------------------------------------------------------------- bad input


def test_training_nvme_without_a_directory_is_one_line_exit_2_and_nothing_is_written(
    tmp_path, capsys):
  code = train_cli.main(["--config", TINY, "--workdir", str(tmp_path / "w"),
                         "--set", "offload.optimizer=nvme"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and err == ["jaxzero.train: error: offload.optimizer=nvme needs "
                               "offload.nvme_dir=PATH, a directory on local disk for the "
                               "optimizer state"]
  assert not (tmp_path / "w").exists()
  # Building a run without training it checks the same, before reading any data.
  with pytest.raises(ConfigError, match="needs offload.nvme_dir=PATH"):
    loop.build(config.load(TINY, [*SETS, "offload.optimizer=nvme"]), jax.devices()[:8],
                  tmp_path / "w", progress=False)
  assert not (tmp_path / "w").exists()


def test_a_missing_nvme_dir_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys):
  missing = tmp_path / "missing"
  code = train_cli.main(["--config", TINY, "--workdir", str(tmp_path / "w"), "--no-progress",
                         "--set", "offload.optimizer=nvme", "--set", f"offload.nvme_dir={missing}"])
  assert code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"jaxzero.train: error: offload.nvme_dir={missing} does not exist; create it "
      "(a directory on local disk) or choose another"]
  assert not missing.exists() and not (tmp_path / "w" / "checkpoints").exists()


def test_an_nvme_dir_that_is_a_file_or_read_only_is_refused(tmp_path):
  devices = jax.devices()[:1]
  file = tmp_path / "file"
  file.write_text("")
  cfg = config.load(TINY, ["offload.optimizer=nvme", f"offload.nvme_dir={file}"])
  with pytest.raises(PathError, match="is not a directory"):
    offload_targets.check_offload(cfg, devices)
  read_only = tmp_path / "ro"
  read_only.mkdir(mode=0o555)
  cfg = config.load(TINY, ["offload.optimizer=nvme", f"offload.nvme_dir={read_only}"])
  if os.geteuid() != 0:  # root writes anywhere
    with pytest.raises(PathError, match="cannot be written"):
      offload_targets.check_offload(cfg, devices)


def test_a_store_directory_is_removed_only_when_the_tier_made_it(tmp_path):
  """A killed run's store (its marker) goes; so does one a kill left empty, before its
  marker was written, which every restart would otherwise refuse; anything else stays."""
  from jaxzero.offload import nvme_store
  marked, empty, foreign = (tmp_path / "run" / name for name in ("a", "b", "c"))
  for directory in (marked, empty, foreign):
    directory.mkdir(parents=True)
  (marked / nvme_store.MARKER).write_text("{}")
  (marked / "x.f32").write_bytes(b"0")
  (foreign / "data.bin").write_bytes(b"0")
  nvme_store.remove(marked)
  nvme_store.remove(empty)
  with pytest.raises(PathError, match="was not made by jaxzero's NVMe tier"):
    nvme_store.remove(foreign)
  assert [p.name for p in (tmp_path / "run").iterdir()] == ["c"]


def test_no_room_for_the_state_names_the_bytes_and_changes_nothing(nvme_run, nvme_dir,
                                                                   monkeypatch, tmp_path):
  workdir = at_step(nvme_run[0], 2, tmp_path / "w")
  before = snapshot(workdir)
  usage = shutil.disk_usage(nvme_dir)
  monkeypatch.setattr(offload_targets.shutil, "disk_usage",
                      lambda _: usage._replace(free=1000))
  chosen = []  # the runner, as make_runner chose it (its check then refuses it)
  make = loop.make_runner
  monkeypatch.setattr(loop, "make_runner",
                      lambda program, *a, **kw: chosen.append(make(program, *a, check=False))
                      or make(program, *a, **kw))
  with pytest.raises(PathError) as error:
    train(workdir, nvme_sets(nvme_dir))
  # fp32 master, m and v of all 8 shards (12 bytes a parameter), each chunk in 4 KiB blocks.
  needed = nvme_store.bytes_needed(chosen[0].leaves)
  phi = count_params(chosen[0].program.cfg.model)
  assert 12 * phi <= needed < 1.25 * 12 * phi
  assert str(error.value).startswith(
      f"offload.nvme_dir={nvme_dir} has 0.0 MB free (1,000 bytes) but the NVMe tier needs "
      f"{needed / 1e6:.1f} MB ({needed:,} bytes) for this process's share of the optimizer state")
  assert snapshot(workdir) == before
  assert not list(nvme_dir.iterdir())


class _Memory:
  def __init__(self, kind):
    self.kind = kind


class _DeviceWithoutPinnedHost:
  platform = "cpu"

  def addressable_memories(self):
    return [_Memory("device")]


@pytest.mark.parametrize("role", ["optimizer", "params"])
def test_an_offload_kind_the_backend_lacks_is_refused(role):
  cfg = config.load(TINY, [f"offload.{role}=pinned_host"])
  with pytest.raises(ConfigError, match=f"offload.{role}=pinned_host: the cpu backend has no "
                                        r"pinned_host memory \(its memory kinds: device\)"):
    offload_targets.check_offload(cfg, [_DeviceWithoutPinnedHost()])


# ----------------------------------------------------------------------------- the store


def test_chunks_cut_layers_then_unsplit_dimensions_within_the_budget():
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp", None))
  kinds = ("master/w", "opt_state/mu/w", "opt_state/nu/w")
  leaf = nvme_store.plan_leaf("layers/w", (4, 64, 96), kinds, sharding, stacked=True,
                              chunk_bytes=3 * 4 * 8 * 32)
  assert leaf.chunk == (1, 64, 32) and leaf.cut == (0, 2)
  assert len(leaf.starts()) == 4 * 3 and len(leaf.regions) == 8
  assert leaf.chunk_box(leaf.regions[1], (2, 32)) == ((2, 3), (8, 16), (32, 64))
  whole = nvme_store.plan_leaf("norm", (64,), kinds, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("fsdp")), stacked=False, chunk_bytes=1)
  assert whole.chunk == (64,) and whole.cut == () and whole.starts() == [()]


def test_a_chunk_is_cut_from_and_written_into_its_bf16_stack_without_widening_the_stack(
    tmp_path):
  # XLA:CPU moves bf16 as f32: writing a chunk into the weight stack as bf16
  # converted the whole stack for every chunk (most of the update's time on a
  # CPU); slicing one out of the gradient stack compiled such a convert too.
  cfg = config.load(TINY, [*SETS, *nvme_sets(tmp_path), "precision.compute=bfloat16",
                           "zero.grad_dtype=bfloat16"])
  run = loop.build(cfg, jax.devices()[:8], tmp_path / "w")
  state = run.runner.init()
  i, leaf = next((i, leaf) for i, leaf in enumerate(run.runner.leaves)
                 if leaf.name == "layers/w_up_LxDxF")
  weight = jax.tree.leaves(state.params)[i]
  assert leaf.cut == (0,) and weight.dtype == jnp.bfloat16
  chunk = jax.ShapeDtypeStruct((len(leaf.kinds), *leaf.chunk), jnp.float32,
                               sharding=leaf.chunk_sharding)
  try:
    hlo = run.runner._unit(leaf).lower(  # pylint: disable=protected-access
        weight, weight, chunk, (0,), jax.tree.leaves(state.opt_state),
        jnp.float32(1), jnp.float32(1)).compile().as_text()
  finally:
    run.runner.close()
  stack = ",".join(map(str, weight.sharding.shard_shape(weight.shape)))
  assert f"bf16[{stack}]" in hlo and f"f32[{stack}]" not in hlo


def test_a_buffer_is_reused_only_once_nothing_can_see_it():
  buffers = nvme_store._Buffers(1 << 16)
  lent = buffers.lend()
  first = lent.ctypes.data
  chunk = lent[:4096].view(np.float32).reshape(8, 128)  # as Store.read returns it
  chunk[...] = 1.0
  del lent
  view = chunk[2:].T
  del chunk
  other = buffers.lend()  # while a numpy view sees the first buffer: another one
  assert other.ctypes.data != first
  other[...] = 0
  np.testing.assert_array_equal(view, 1.0)
  del view, other
  assert buffers._free.qsize() == 2  # both came back, and are lent again
  lent = [buffers.lend(), buffers.lend()]
  assert buffers._free.qsize() == 0 and first in {b.ctypes.data for b in lent}

  # A CPU device may alias a chunk instead of copying it (then JAX keeps it).
  chunk = lent.pop(0)[:4096].view(np.float32)
  chunk[...] = 2.0
  held = jax.device_put(chunk, jax.devices("cpu")[0])
  aliased = held.unsafe_buffer_pointer() == chunk.ctypes.data
  del chunk, lent
  jnp.zeros(()).block_until_ready()  # JAX releases what it no longer needs
  if aliased:
    assert buffers._free.qsize() == 1
    np.testing.assert_array_equal(np.asarray(held), 2.0)
  del held
  jnp.zeros(()).block_until_ready()
  assert buffers._free.qsize() == 2
  buffers.clear()
  assert buffers._free.qsize() == 0


def test_a_path_through_dot_dot_opens_in_tensorstore(tmp_path):
  """The NVMe item's arrays under a workdir such as runs/a/../b: TensorStore
  refuses ".." in a file path, so a save there failed after training."""
  (tmp_path / "a").mkdir()
  spec = {"driver": "zarr", "kvstore": nvme_checkpoint.file_kvstore(tmp_path / "a" / ".." / "x"),
          "metadata": {"shape": [2], "chunks": [2], "dtype": "<f4"}}
  ts.open(spec, create=True, open=True).result().write(np.ones(2, np.float32)).result()
  assert (tmp_path / "x").is_dir()


@pytest.mark.slow  # compiles each optimizer's probe
def test_the_box_by_box_probe_refuses_what_reduces_and_passes_what_is_elementwise():
  """Over a Llama's weights' stand-ins (names, ranks): LAMB and Adafactor under a warm-up
  from 0, and LAMB behind MultiSteps, make no first update, and show by the probe's last;
  a rule by rank (global-norm clipping of the 1-D weights only) shows on those."""
  from jaxzero.errors import ConfigError
  from jaxzero.offload.nvme_chunks import check_updates_by_box
  weights = {"embed_VxD": (256, 128), "final_norm_D": (128,), "layers/attn_norm_LxD": (2, 128),
             "layers/w_up_LxDxF": (2, 128, 384), "lm_head_DxV": (128, 256)}
  warm_up = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 100)
  vectors = lambda p: jax.tree.map(lambda x: x.ndim == 1, p)
  for refused in (optax.lamb(warm_up), optax.adafactor(warm_up),
                  optax.MultiSteps(optax.lamb(1e-2), 4),
                  optax.chain(optax.masked(optax.clip_by_global_norm(0.01), vectors),
                              optax.adam(1e-2))):
    with pytest.raises(ConfigError, match="its updates of a box of a weight are not that box"):
      check_updates_by_box(refused, weights, "offload.optimizer=nvme")
  for elementwise in (optax.adamw(warm_up, weight_decay=0.1, mask=lambda p: jax.tree.map(
                          lambda x: x.ndim > 1, p)),
                      optax.MultiSteps(optax.adamw(1e-2), 4),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)):
    check_updates_by_box(elementwise, weights, "offload.optimizer=nvme")



def test_engines_without_a_workdir_never_share_a_store(tmp_path):
  """Two jaxzero.Engines made in one working directory (a notebook's cell run twice): each
  has its own store, so neither deletes the other's files; a run's is by its workdir."""
  from jaxzero.runners import nvme as nvme_runner
  assert (nvme_runner.store_directory(str(tmp_path), None)
          != nvme_runner.store_directory(str(tmp_path), None))
  assert (nvme_runner.store_directory(str(tmp_path), "runs/a")
          == nvme_runner.store_directory(str(tmp_path), "runs/a"))


def test_a_dead_processs_engine_store_is_deleted_by_the_next_engine(tmp_path):
  """An Engine's store has no workdir to be found by: when its process is gone (a killed
  notebook), the next Engine on this host deletes it; a live process's is left alone."""
  import socket
  from jaxzero.runners import nvme as nvme_runner
  host = socket.gethostname()
  stores = {}
  for name, pid in (("dead", 999_999_999), ("live", os.getpid())):  # (past Linux's pid_max)
    store = tmp_path / f"jaxzero-engine-{host}-{pid}-{name}" / "process_0"
    store.mkdir(parents=True)
    (store / nvme_store.MARKER).write_text("")
    stores[name] = store
  nvme_runner.store_directory(str(tmp_path), None)
  assert not stores["dead"].parent.exists() and stores["live"].exists()
