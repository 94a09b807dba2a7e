"""ZeRO-Infinity's parameter tier (offload.params=nvme): every step's loss and the final
weights of the in-memory run, on 1 and 8 devices and 2 processes, with and without
gradient accumulation; checkpoints that move between the two, exactly, under their
checksums; a SIGKILL costs nothing; bad input is one line before anything is built."""

import json
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
from jaxzero import train as train_cli
from jaxzero.checkpoint import checkpointer
from jaxzero.errors import ConfigError, DamagedCheckpointError, PathError
from jaxzero.offload import checks as offload_checks
from jaxzero.offload import infinity, nvme_checkpoint
from jaxzero.planning import infinity_plan, planner
from jaxzero.training import loop

from processes import ROOT, TINY, cli_env, load_script, wait_for

# The tiny preset, smaller, in float32: 10 steps, saved at 5 and 10.
SETS = ["model.dim=64", "model.n_layers=3", "model.mlp_dim=128", "train.global_batch=16",
        "train.seq_len=32", "precision.compute=float32", "train.steps=10", "train.warmup_steps=1",
        "train.lr=3e-3", "train.log_every=1", "data.max_bytes=200000", "checkpoint.every=5"]


def infinity_sets(nvme_dir, params="nvme"):
  return ["offload.optimizer=nvme", f"offload.params={params}", f"offload.nvme_dir={nvme_dir}"]


def train(workdir, sets=(), devices=8, steps=None):
  cfg = config.load(TINY, [*SETS, f"mesh.fsdp={devices}", *sets])
  return loop.run_training(cfg, workdir, steps, devices=jax.devices()[:devices], progress=False)


def logged(workdir) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  lines = path.read_text().splitlines() if path.exists() else []
  return [json.loads(line) for line in lines if line.endswith("}")]


def losses(workdir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in logged(workdir)}


def weights(workdir, step) -> dict[str, np.ndarray]:
  """Checkpoint `step`'s master weights and compute copy, by leaf name."""
  with checkpointer.CheckpointReader(workdir, side=nvme_checkpoint.SIDE_ITEM) as reader:
    return {name: reader.read(step, tuple(name.split("/")), shape)
            for name, shape in reader.leaf_shapes(step).items()
            if name.startswith(("master/", "params/"))}


def at_step(workdir, step, copy):
  """A copy of `workdir` as it was when it had saved `step`."""
  shutil.copytree(workdir, copy)
  for later in (p for p in (copy / "checkpoints").iterdir() if int(p.name) > step):
    shutil.rmtree(later)
  (copy / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in logged(copy)
                                              if r["step"] <= step))
  return copy


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


@pytest.mark.parametrize("devices,accum,params", [
    (1, 1, "nvme"), pytest.param(1, 2, "nvme", marks=pytest.mark.slow),
    pytest.param(8, 1, "nvme", marks=pytest.mark.slow),
    pytest.param(8, 2, "pinned_host", marks=pytest.mark.slow)])
def test_one_and_eight_devices_with_and_without_accumulation(reference, nvme_dir, tmp_path,
                                                            devices, accum, params):
  if params == "pinned_host" and "pinned_host" not in {
      m.kind for m in jax.devices()[0].addressable_memories()}:
    pytest.skip("this backend has no pinned_host memory")
  train(tmp_path, [f"train.grad_accum={accum}", *infinity_sets(nvme_dir, params)], devices)
  assert_same_run(tmp_path, reference[devices, accum], range(1, 11))
  expected, got = weights(reference[devices, accum], 10), weights(tmp_path, 10)
  for name, value in got.items():
    np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_the_programs_hold_one_layer_and_gradients_leave_reduced(nvme_dir, tmp_path):
  # Stage 3 on 8 devices: a layer's weights come in as their fp32 shards (1/8 of a layer)
  # and its gradient leaves as shards (reduce-scattered), never whole.
  cfg = config.load(TINY, [*SETS, "train.grad_accum=2", *infinity_sets(nvme_dir)])
  run = loop.build(cfg, jax.devices()[:8], tmp_path, progress=False)
  tier = run.nvme
  try:
    state = tier.init()
    weights_in = tier._read_weights(tier._layer_leaves(tier.leaves), 0).result()
    for w in jax.tree.leaves(weights_in):
      assert w.shape[0] == 1 and w.addressable_shards[0].data.size * 8 == w.size
    p = tier.programs
    batch = jax.tree.map(lambda x: x[0], run.batch(0))
    outer = tier._read_weights(tier._outer_leaves(tier.leaves), None).result()
    # Each side of the cut reads only its own weights: the embedding before, the final
    # norm and the head after (untied).
    assert p.outer_names("pre", batch) == ["embed_VxD"]
    assert p.outer_names("post", batch) == ["final_norm", "lm_head_DxV"]
    carry, consts = p.pre({"embed_VxD": outer["embed_VxD"]}, batch)
    out = p.layer_forward(weights_in, carry, consts)
    grads, _, _ = p.layer_backward(weights_in, carry, consts, out)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(weights_in), strict=True):
      assert g.sharding.is_equivalent_to(w.sharding, g.ndim) and g.dtype == np.float32
    hlo = p.layer_backward.lower(weights_in, carry, consts, out).compile().as_text()
    assert "all-gather" in hlo and ("reduce-scatter" in hlo or "all-reduce" in hlo)
    del state
  finally:
    tier.close()


# ----------------------------------------------------------------------------- checkpoints


def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(infinity_run, nvme_dir, tmp_path):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  assert train(workdir, ["train.grad_accum=2", *infinity_sets(nvme_dir)]).start_step == 5
  assert losses(workdir) == losses(infinity_run)


def test_its_checkpoint_resumes_in_memory_on_another_mesh_and_stage(infinity_run, tmp_path):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  assert train(workdir, ["train.grad_accum=2", "zero.stage=1"], devices=4).start_step == 5
  assert_same_run(workdir, infinity_run, range(6, 11))


def test_an_in_memory_checkpoint_resumes_with_everything_on_nvme(reference, nvme_dir, tmp_path):
  workdir = at_step(reference[8, 2], 5, tmp_path / "w")
  assert train(workdir, ["train.grad_accum=2", *infinity_sets(nvme_dir)], 1).start_step == 5
  # On 1 device against 8: sums in another order, ~1e-6 apart after 10 steps in memory too.
  assert_same_run(workdir, reference[8, 2], range(6, 11), rtol=3e-6)


@pytest.mark.parametrize("into", ["memory", "nvme"])
def test_checksums_cover_its_checkpoint(infinity_run, nvme_dir, tmp_path, into):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  item = workdir / "checkpoints/5/nvme/layers.w_up_LxDxF"
  chunk = max((p for p in item.rglob("*") if p.is_file() and p.name != ".zarray"),
              key=lambda p: p.stat().st_size)
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x40  # one bit of one master weight's (or moment's) value
  chunk.write_bytes(bytes(data))
  sets = ["train.grad_accum=2", "checkpoint.on_damaged=refuse"]
  with pytest.raises(DamagedCheckpointError, match="layers/w_up_LxDxF"):
    train(workdir, sets + (infinity_sets(nvme_dir) if into == "nvme" else []))


@pytest.mark.slow
def test_sigkill_during_a_step_or_a_save_resumes_to_the_uninterrupted_losses(
    infinity_run, tmp_path):
  workdir, store = at_step(infinity_run, 5, tmp_path / "w"), tmp_path / "nvme"
  store.mkdir()
  sets = ["train.grad_accum=2", *infinity_sets(store), "checkpoint.every=1"]
  env = cli_env(pathlib.Path(jax.config.jax_compilation_cache_dir))
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
  env = cli_env(pathlib.Path(jax.config.jax_compilation_cache_dir))
  sets = [*SETS, "train.grad_accum=2", "mesh.fsdp=8", *infinity_sets(store)]
  run = subprocess.run(
      [sys.executable, "-m", "jaxzero.launch", "--nproc", "2", "--devices-per-proc", "4", "--",
       "--config", TINY, "--workdir", str(tmp_path / "w"), "--no-progress",
       *[a for s in sets for a in ("--set", s)]],
      cwd=ROOT, env=env, text=True, capture_output=True, timeout=500, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert_same_run(tmp_path / "w", reference[8, 2], range(1, 11))
  expected, got = weights(reference[8, 2], 10), weights(tmp_path / "w", 10)
  for name, value in got.items():
    np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("sets,message", [
    (["zero.stage=2", "offload.optimizer=nvme"],
     "offload.params=nvme needs ZeRO stage 3 (zero.stage=3 or zero.strategy=FULL_SHARD/"
     "HYBRID_SHARD)"),
    ([], "offload.params=nvme needs offload.optimizer=nvme (the master weights it reads live "
         "there); got offload.optimizer=device"),
    (["offload.optimizer=nvme", "mesh.replica=2", "mesh.fsdp=4"],
     "offload.params=nvme runs on an fsdp-only mesh at zero.stage=3 (mesh.replica=1, "
     "mesh.tensor=1, no HYBRID_SHARD)"),
])
def test_where_it_cannot_apply_is_one_line_exit_2(tmp_path, capsys, sets, message):
  code = train_cli.main(["--config", TINY, "--workdir", str(tmp_path / "w"), "--no-progress",
                         *[a for s in [*sets, "offload.params=nvme",
                                       f"offload.nvme_dir={tmp_path}"] for a in ("--set", s)]])
  assert code == 2
  assert capsys.readouterr().err.strip().splitlines() == [f"jaxzero.train: error: {message}"]
  assert not (tmp_path / "w").exists()


def test_a_missing_nvme_dir_is_one_line_exit_2(tmp_path, capsys):
  missing = tmp_path / "missing"
  code = train_cli.main(["--config", TINY, "--workdir", str(tmp_path / "w"), "--no-progress",
                         *[a for s in infinity_sets(missing) for a in ("--set", s)]])
  assert code == 2
  assert capsys.readouterr().err.strip().splitlines() == [
      f"jaxzero.train: error: offload.nvme_dir={missing} does not exist; create it "
      "(a directory on local disk) or choose another"]
  assert not missing.exists() and not (tmp_path / "w" / "checkpoints").exists()


def test_no_room_counts_the_gradients_and_changes_nothing(infinity_run, nvme_dir, monkeypatch,
                                                          tmp_path):
  workdir = at_step(infinity_run, 5, tmp_path / "w")
  before = sorted(p.name for p in workdir.rglob("*"))
  usage = shutil.disk_usage(nvme_dir)
  monkeypatch.setattr(offload_checks.shutil, "disk_usage", lambda _: usage._replace(free=1000))
  built = []
  build = loop.build
  monkeypatch.setattr(loop, "build", lambda *a, **kw: built.append(build(*a, **kw)) or built[-1])
  with pytest.raises(PathError) as error:
    train(workdir, ["train.grad_accum=2", *infinity_sets(nvme_dir)])
  tier = built[0].nvme
  assert isinstance(tier, infinity.Infinity)
  phi = sum(leaf.size for leaf in jax.tree.leaves(built[0].engine.abstract.master))
  needed = tier.bytes_needed()
  assert 16 * phi <= needed < 1.5 * 16 * phi  # master, 2 moments, gradient: 16 bytes each
  assert (f"the NVMe tier needs {needed / 1e6:.1f} MB ({needed:,} bytes) for this process's "
          "share of the optimizer state, the master weights and the gradients") in str(error.value)
  assert sorted(p.name for p in workdir.rglob("*")) == before
  assert not list(nvme_dir.iterdir())


def test_a_model_without_a_layer_scan_is_refused(nvme_dir):
  cfg = config.load(TINY, [*SETS, *infinity_sets(nvme_dir)])
  run = loop.build(cfg, jax.devices()[:8], None, progress=False)
  model = run.engine.model
  object.__setattr__(model, "layers_key", None)
  with pytest.raises(ValueError, match="must declare Model.layers_key"):
    infinity.Infinity(run.engine, nvme_dir / "x")
  with pytest.raises(ConfigError):  # (a config error elsewhere stays one)
    config.load(TINY, ["offload.params=disk"])


# ----------------------------------------------------------------------------- the plan


def test_the_plan_is_the_compiled_programs_and_the_files_on_disk(nvme_dir, tmp_path):
  cfg = config.load(TINY, [*SETS, "train.grad_accum=2", *infinity_sets(nvme_dir)])
  run = loop.build(cfg, jax.devices()[:8], tmp_path, progress=False)
  tier = run.nvme
  try:
    tier.init()
    found = infinity_plan.plan(cfg, 8, tier=tier)
    planned = {prog.name: prog for prog in found.programs}
    # The programs as the step runs them, from real arrays.
    p, batch = tier.programs, jax.tree.map(lambda x: x[0], run.batch(0))
    weights = tier._read_weights(tier._layer_leaves(tier.leaves), 0).result()
    outer = tier._read_weights(tier._outer_leaves(tier.leaves), None).result()
    pre_in = {n: outer[n] for n in p.outer_names("pre", batch)}
    post_in = {n: outer[n] for n in p.outer_names("post", batch)}
    carry, consts = p.pre(pre_in, batch)
    analysed = lambda fn, *args: planner.xla_total_bytes(
        fn.lower(*args).compile(compiler_options=planner.MEMORY_COMPILE_OPTIONS)
        .memory_analysis())
    assert planned["pre (embedding)"].program_bytes == analysed(p.pre, pre_in, batch)
    assert planned["layer forward"].program_bytes == analysed(p.layer_forward, weights, carry,
                                                              consts)
    assert planned["post (head, loss, gradient)"].program_bytes == analysed(
        p.post_grad, post_in, batch, carry)
    assert planned["layer backward"].program_bytes == analysed(
        p.layer_backward, weights, carry, consts, carry)
    # Beside a layer's backward: every layer's checkpoint, the next layer's weights (in
    # the compute dtype) and the last layer's gradient (in grad_dtype, float32 here).
    shard = lambda x: x.addressable_shards[0].data.nbytes
    layer = sum(shard(w) for w in jax.tree.leaves(weights))
    checkpoints = 3 * shard(carry) + sum(shard(c) for c in consts)
    assert planned["layer backward"].resident_bytes == checkpoints + 2 * layer
    assert found.device_bytes == max(prog.device_bytes for prog in planned.values())
    files = sum(f.stat().st_size for f in tier.directory.rglob("*.f32"))
    assert found.nvme_bytes == files == tier.bytes_needed()
    assert found.bound in ("compute", "pcie", "disk")
  finally:
    tier.close()


def test_plan_prints_the_70b_preset_within_20_gb_on_one_device(capsys):
  from jaxzero import plan as plan_cli
  assert plan_cli.main(["--config", str(ROOT / "configs/llama70b_infinity.py"), "--json"]) == 0
  found = json.loads(capsys.readouterr().out)
  assert found["devices"] == 1 and found["n_params"] > 70e9
  assert found["device_bytes"] <= 20e9
  assert found["nvme_bytes"] >= 16 * found["n_params"] and found["host_bytes"] > 0
  assert found["bound"] == "disk" and found["predicted_step_s"] > 0


# ----------------------------------------------------------------------------- the benchmark


def test_the_benchmark_reports_its_figures_and_leaves_nothing(tmp_path, capsys):
  bench = load_script("infinity_bench")
  shape = ["--dim", "64", "--layers", "2", "--mlp", "128", "--heads", "4", "--kv-heads", "2",
           "--vocab", "256", "--seq", "16", "--steps", "3", "--seq-gb", "0.02"]
  assert bench.main(["--nvme-dir", str(tmp_path), *shape]) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["state_bytes"] == 16 * result["params"]
  assert len(result["losses"]) == 3 and result["losses"][2] < result["losses"][0]
  assert result["nvme_read_bytes_per_step"] > result["nvme_write_bytes_per_step"] > 0
  for key in ("peak_rss_bytes", "sequential_read_gbps", "sequential_write_gbps", "io_alone_s",
              "compute_alone_s", "overlap_efficiency"):
    assert result[key] > 0, key
  assert not list(tmp_path.iterdir())
  # Without room: one line, exit 2, nothing left behind.
  huge = [*shape[:2], "8192", "--layers", "400", *shape[4:]]
  assert bench.main(["--nvme-dir", str(tmp_path), *huge]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"infinity_bench.py: error: --nvme-dir {tmp_path} has")
  assert "free; the benchmark needs about" in err[0]
  assert not list(tmp_path.iterdir())
