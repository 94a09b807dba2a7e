"""ZeRO-Infinity's tools and edges: its per-layer programs, the plan against the compiled
programs and the files on disk, the benchmark, and bad input (one line, before anything
is built). Exactness and checkpoints: tests/offload/test_infinity.py."""

import json

import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero import train as train_cli
from jaxzero.errors import ConfigError
from jaxzero.runners import infinity
from jaxzero.planning import infinity_plan, planner
from jaxzero.training import loop

from processes import ROOT, TINY, load_script
from tiny import INFINITY_SETS as SETS
from tiny import infinity_sets


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("nvme")


def test_the_programs_hold_one_layer_and_gradients_leave_reduced(nvme_dir, tmp_path):
  # Stage 3 on 8 devices: a layer's weights come in as their fp32 shards (1/8 of a layer)
  # and its gradient leaves as shards (reduce-scattered), never whole.
  cfg = config.load(TINY, [*SETS, "train.grad_accum=2", *infinity_sets(nvme_dir)])
  run = loop.build(cfg, jax.devices()[:8], tmp_path, progress=False)
  tier = run.runner
  try:
    state = tier.init()
    weights_in = tier.read_weights(tier.layer_leaves(tier.leaves), 0).result()
    for w in jax.tree.leaves(weights_in):
      assert w.shape[0] == 1 and w.addressable_shards[0].data.size * 8 == w.size
    p = tier.programs
    batch = jax.tree.map(lambda x: x[0], run.batch(0))
    outer = tier.read_weights(tier.outer_leaves(tier.leaves), None).result()
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


def test_a_model_without_a_layer_scan_is_refused(nvme_dir):
  cfg = config.load(TINY, [*SETS, *infinity_sets(nvme_dir)])
  run = loop.build(cfg, jax.devices()[:8], None, progress=False)
  model = run.program.model
  object.__setattr__(model, "layers_key", None)
  with pytest.raises(ValueError, match="must declare Model.layers_key"):
    infinity.InfinityRunner(run.program, nvme_dir / "x")
  with pytest.raises(ConfigError):  # (a config error elsewhere stays one)
    config.load(TINY, ["offload.params=disk"])


# ----------------------------------------------------------------------------- the plan


def test_the_plan_is_the_compiled_programs_and_the_files_on_disk(nvme_dir, tmp_path):
  cfg = config.load(TINY, [*SETS, "train.grad_accum=2", *infinity_sets(nvme_dir)])
  run = loop.build(cfg, jax.devices()[:8], tmp_path, progress=False)
  tier = run.runner
  try:
    tier.init()
    found = infinity_plan.plan(cfg, 8, tier=tier)
    planned = {prog.name: prog for prog in found.programs}
    # The programs as the step runs them, from real arrays.
    p, batch = tier.programs, jax.tree.map(lambda x: x[0], run.batch(0))
    weights = tier.read_weights(tier.layer_leaves(tier.leaves), 0).result()
    outer = tier.read_weights(tier.outer_leaves(tier.leaves), None).result()
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
    checkpoints = 2 * shard(carry) + sum(shard(c) for c in consts)
    assert planned["layer backward"].resident_bytes == checkpoints + 2 * layer
    assert found.device_bytes == max(prog.device_bytes for prog in planned.values())
    files = sum(f.stat().st_size for f in tier.directory.rglob("*.f32"))
    assert found.nvme_bytes == files == tier.bytes_needed()
    assert found.bound in ("compute", "pcie", "disk")
  finally:
    tier.close()


def test_the_plan_of_packed_rows_keeps_their_segment_ids_and_positions_per_layer(nvme_dir):
  """Packed fine-tuning rows carry their segment ids and positions through the layers
  beside the residual stream: the plan compiles that carry, so each layer's checkpoint
  holds two int32 [rows, T] arrays more than for token windows, and the layers close
  over no RoPE tables (each row's positions give its own)."""
  import dataclasses
  cfg = config.load(TINY, [*SETS, "train.grad_accum=2", *infinity_sets(nvme_dir)])
  packed = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, format="chat",
                                                              packing=True))
  plain, rows = (infinity_plan.plan(c, 8) for c in (cfg, packed))
  per_device_rows = cfg.train.global_batch // cfg.train.grad_accum // 8
  T, m = cfg.train.seq_len, cfg.model
  ids_and_positions = m.n_layers * 2 * per_device_rows * T * 4
  rope_tables = 2 * T * (m.dim // m.n_heads) * 4  # cos, sin [T, head_dim]
  extra = ids_and_positions - rope_tables
  forward = lambda found: next(p for p in found.programs if p.name == "layer forward")
  assert forward(rows).resident_bytes - forward(plain).resident_bytes == extra


def test_plan_prints_the_70b_preset_within_20_gb_on_one_device(capsys):
  from jaxzero import plan as plan_cli
  assert plan_cli.main(["--config", str(ROOT / "configs/llama70b_infinity.py"), "--json"]) == 0
  found = json.loads(capsys.readouterr().out)
  assert found["devices"] == 1 and found["n_params"] > 70e9
  assert found["device_bytes"] <= 20e9
  assert found["nvme_bytes"] >= 16 * found["n_params"] and found["host_bytes"] > 0
  assert found["bound"] == "disk" and found["predicted_step_s"] > 0


# ----------------------------------------------------------------------------- the benchmark


@pytest.mark.slow
def test_the_benchmark_reports_its_figures_and_leaves_nothing(tmp_path, capsys):
  bench = load_script("infinity_bench")
  shape = ["--dim", "64", "--layers", "2", "--mlp", "128", "--heads", "4", "--kv-heads", "2",
           "--vocab", "256", "--seq", "16", "--steps", "3", "--seq-gb", "0.017"]
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
  huge = ["--dim", "8192", "--layers", "400", *shape[4:]]
  assert bench.main(["--nvme-dir", str(tmp_path), *huge]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"infinity_bench.py: error: --nvme-dir {tmp_path} has")
  assert "free; the benchmark needs about" in err[0]
  assert not list(tmp_path.iterdir())
