"""The `tensor` mesh axis: Megatron's splits and sequence parallelism on top of
every ZeRO stage (issue 16).

Steps are compiled with the planner's fast options (a few seconds each) and
start from the 1-device run's initial state, placed into each layout's shards.
"""

import dataclasses
import json
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import config
from jaxzero.checkpoint import checkpointer
from jaxzero.config import ConfigError
from jaxzero.hf import export as hf_export
from jaxzero.hf import load as hf_load
from jaxzero.models.llama import LlamaConfig, count_params, is_param_spec, param_specs
from jaxzero.models.loss import cross_entropy
from jaxzero.engine.hooks import LayoutHooks
from jaxzero.parallel import mesh
from jaxzero.planning import collectives, comm_report, planner, zero_formula
from jaxzero.runners.base import InMemoryRunner

import processes
from tiny import compiled_step, initial_state_and_batches, make_engine, run_steps

DATA = ("replica", "fsdp")
MODEL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128,
                    rope_theta=10_000.0, attention="xla")
STEPS = 3


def make_cfg(zero: dict, shape: tuple[int, int, int], model=MODEL, compute="float32",
             **train) -> config.Config:
  c = config.base()
  replica, fsdp, tensor = shape
  return dataclasses.replace(
      c, model=model, zero=config.ZeroConfig(grad_dtype=compute, **zero),
      mesh=config.MeshConfig(replica=replica, fsdp=fsdp, tensor=tensor),
      train=dataclasses.replace(c.train, **{"global_batch": 16, "grad_accum": 2, "seq_len": 32,
                                            "lr": 3e-3, "warmup_steps": 1, **train}),
      precision=config.PrecisionConfig(compute=compute))


@pytest.fixture(scope="module")
def reference():
  """The 1-device run: (initial state on the host, tokens, losses)."""
  cfg = make_cfg({"stage": 0}, (1, 1, 1))
  state0, tokens = initial_state_and_batches(cfg, STEPS)
  losses, _ = run_steps(cfg, state0, tokens)
  return state0, tokens, losses


# ----------------------------------------------------------------------------- acceptance 1


@pytest.mark.parametrize("zero, shape, attention", [
    ({"stage": 0}, (1, 4, 2), "xla"),
    ({"stage": 1}, (1, 2, 4), "xla"),  # 2 KV heads, tensor 4: KV heads replicated
    ({"stage": 2}, (1, 4, 2), "xla"),
    pytest.param({"stage": 3}, (1, 2, 4), "blockwise",  # KV heads replicated; flash attention
                 marks=pytest.mark.slow),
    ({"strategy": "HYBRID_SHARD"}, (2, 2, 2), "xla"),
    ({"strategy": "HYBRID_SHARD_ZERO2"}, (2, 2, 2), "xla"),
], ids=["stage0_f4t2", "stage1_f2t4", "stage2_f4t2", "stage3_f2t4", "hybrid_2x2x2",
        "hybrid_zero2_2x2x2"])
def test_tensor_parallel_losses_equal_one_device(zero, shape, attention, reference):
  state0, tokens, want = reference
  model = dataclasses.replace(MODEL, attention=attention)
  got, state = run_steps(make_cfg(zero, shape, model), state0, tokens)
  assert len(got) == STEPS and got[-1] != got[0]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  wq = state.params["layers"]["wq_LxDxHxE"]
  assert wq.sharding.spec[2] == "tensor"  # the step keeps the Megatron split


# ----------------------------------------------------------------------------- acceptance 2

# Each weight's dimensions: T split over `tensor` (Megatron), K split over
# `tensor` when it divides the KV heads (else replicated), Z split over the
# data axes where the stage shards the role (ZeRO; over `tensor` too for a
# weight that `tensor` leaves whole), - never split.
GOLDEN = {
    "embed_VxD": "TZ", "lm_head_DxV": "ZT", "final_norm": "Z",
    "attn_norm": "-Z", "mlp_norm": "-Z",
    "wq_LxDxHxE": "-ZT-", "wk_LxDxKxE": "-ZK-", "wv_LxDxKxE": "-ZK-", "wo_LxHxExD": "-T-Z",
    "w_gate_LxDxF": "-ZT", "w_up_LxDxF": "-ZT", "w_down_LxFxD": "-TZ",
}
SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"),
           3: ("optimizer", "grads", "params")}
CASES = [(0, False, (1, 4, 2)), (1, False, (1, 2, 4)), (2, False, (1, 4, 2)),
         (3, False, (1, 4, 2)), (3, False, (1, 2, 4)), (3, True, (2, 2, 2)),
         (2, True, (1, 2, 4))]


def split_by_tensor(name: str, tensor: int) -> bool:
  return "T" in GOLDEN[name] or ("K" in GOLDEN[name] and MODEL.n_kv_heads % tensor == 0)


def expected_spec(name: str, role: str, stage: int, hybrid: bool, tensor: int) -> P:
  zero = (("fsdp",) if hybrid else DATA) + (() if split_by_tensor(name, tensor) else ("tensor",))
  dims = {"-": None, "T": "tensor", "K": "tensor" if MODEL.n_kv_heads % tensor == 0 else None,
          "Z": zero if role in SHARDED[stage] else None}
  axes = [dims[c] for c in GOLDEN[name]]
  return P(*axes) if any(axes) else P()


def _named(tree) -> dict[str, P]:
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {path[-1].key: leaf.spec for path, leaf in leaves}


@pytest.mark.parametrize("stage, hybrid, shape", CASES,
                         ids=[f"stage{s}{'_hybrid' if h else ''}_{'x'.join(map(str, m))}"
                              for s, h, m in CASES])
def test_every_leaf_is_split_by_the_stage_and_tensor(stage, hybrid, shape):
  cfg = make_cfg({"stage": stage, "hybrid": hybrid}, shape, compute="bfloat16")
  engine = make_engine(cfg)
  layout, sh, specs = engine.layout, engine.shardings, param_specs(MODEL)
  tensor = shape[2]
  adam = sh.opt_state[1][0]
  roles = {"params": sh.params, "optimizer": sh.master, "mu": adam.mu, "nu": adam.nu,
           "grads": layout.tree_shardings(specs, "grads"),
           "compute": layout.tree_shardings(specs, "compute")}
  for role, tree in roles.items():
    table_role = "optimizer" if role in ("mu", "nu") else role
    got = _named(tree)
    assert set(got) == set(GOLDEN)
    for name, spec in got.items():
      assert spec == expected_spec(name, table_role, stage, hybrid, tensor), (role, name, spec)
  assert adam.count.spec == P()

  # Per device: the ZeRO formula divided by the tensor size, except that the few
  # weights `tensor` leaves whole (norm gains; KV projections when it does not
  # divide the KV heads) are whole in the roles the stage does not shard.
  got = engine.state_bytes()
  whole = sum(int(np.prod(s.shape)) for n, s in _flat_specs(specs).items()
              if not split_by_tensor(n, tensor))
  phi = count_params(MODEL)
  n = layout.shard_size
  per_param = {"params": 2, "grads": 2, "optimizer": 12}
  expected = sum(b * phi / (n * tensor) if role in SHARDED[stage] else
                 b * ((phi - whole) / tensor + whole) for role, b in per_param.items())
  state = got["params"] + got["grads"] + got["optimizer"]
  assert expected <= state <= expected + 64, (got, expected)  # + Adam's step counters
  if stage == 3:
    assert state == pytest.approx(16 * phi / (n * tensor), abs=64)


def _flat_specs(specs) -> dict:
  return {path[-1].key: s for path, s in
          jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_param_spec)}


def test_llama70b_state_is_the_zero_figure_over_tensor():
  cfg = config.load(str(planner_config("llama70b_zero3_offload")),
                    ["mesh.fsdp=4", "mesh.tensor=2", "offload.optimizer=device"])
  engine = make_engine(cfg)
  got = engine.state_bytes()
  theory, formula = zero_formula.theory_state_bytes(cfg, engine.layout)
  phi = count_params(cfg.model)
  assert formula == "(16Φ/N)/T"
  assert theory == round(16 * phi / 8)
  assert got["params"] + got["grads"] + got["optimizer"] == pytest.approx(theory, rel=1e-4)


def planner_config(name: str) -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parents[2] / "configs" / f"{name}.py"


# ----------------------------------------------------------------------------- acceptance 3

HLO_MODEL = LlamaConfig(vocab_size=768, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                        mlp_dim=512)


def _arrays(shape: str) -> list[tuple[int, ...]]:
  return [tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"\[([\d,]*)\]", shape)]


def test_tensor_collectives_move_activations_never_weights_or_logits():
  """ZeRO-3, fsdp 4 x tensor 2, one sequence of 32 per data-parallel group: over
  `tensor` only activations move (the sequence all-gathered before each block's
  matmuls and reduce-scattered after them), never a weight (the smallest
  layer weight's tensor shard is 2x one sequence's activation) nor the logits
  (no array with the vocabulary's 768 columns)."""
  B, T, D = 1, 32, HLO_MODEL.dim
  cfg = make_cfg({"stage": 3}, (1, 4, 2), HLO_MODEL, compute="bfloat16", global_batch=4,
                 grad_accum=1, seq_len=T)
  cfg = dataclasses.replace(cfg, remat=config.RematConfig(policy="full"))
  engine = make_engine(cfg)
  compiled = planner.compile_step(InMemoryRunner(engine), micro_batch=B)
  over_tensor = [c for c in collectives.collectives(compiled.as_text())
                 if "tensor" in comm_report.mesh_axes(c.replica_groups, engine.layout.mesh)]
  weights = [s.shape[1:] if s.logical_axes[0] == "layers" else s.shape
             for s in jax.tree.leaves(param_specs(HLO_MODEL), is_leaf=is_param_spec)]
  smallest_weight_shard = min(int(np.prod(w)) // 2 for w in weights if len(w) > 1)
  assert smallest_weight_shard >= 2 * B * T * D
  for c in over_tensor:
    for dims in _arrays(c.shape):
      assert int(np.prod(dims)) <= B * T * D, (c.op, c.shape)
      assert HLO_MODEL.vocab_size not in dims, (c.op, c.shape)
  # Per layer (inside the layer scan: runs = n_layers), activations cross `tensor`:
  # a [B, T, D] all-gathered along the sequence and one reduce-scattered onto it.
  in_layers = [c for c in over_tensor if c.runs >= HLO_MODEL.n_layers]
  gathers = [c for c in in_layers if c.op == "all-gather" and (B, T, D) in _arrays(c.shape)]
  scatters = [c for c in in_layers if c.op in ("reduce-scatter", "all-reduce")
              and (B, T, D) in _arrays(c.shape) and c.sliced_bytes > 0]
  assert gathers and scatters, comm_report.format_table(
      comm_report.report(compiled, engine.layout.mesh, 1))


def test_vocabulary_parallel_loss_never_gathers_logits():
  """Over 8 vocabulary chunks with the head split over `tensor`: each device
  computes its half of every chunk's logits; only per-position statistics
  cross `tensor` inside the loop, and the loss is the unsplit one."""
  B, T, D, V, chunk = 4, 32, 16, 1024, 128
  layout = make_engine(make_cfg({"stage": 3}, (1, 4, 2))).layout
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
  labels = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  sharded = lambda a, *axes: jax.device_put(a, NamedSharding(layout.mesh, P(*axes)))
  args = (sharded(x, DATA, "tensor"), sharded(head, None, "tensor"), sharded(labels, DATA))
  loss = lambda x, h, l, shard: cross_entropy(x, h, l, chunk=chunk, shard=shard)
  def compile_grad(shard, *a):
    return jax.jit(jax.value_and_grad(lambda *b: loss(*b, shard), argnums=(0, 1))).lower(
        *a).compile(planner.FAST_COMPILE_OPTIONS)
  compiled = compile_grad(LayoutHooks(layout).shard, *args)
  (got, got_grads) = compiled(*args)
  (want, want_grads) = compile_grad(None, x, head, labels)(x, head, labels)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-6)
  logits_per_chunk = (B // 4) * T * chunk  # rows of one data-parallel device
  for c in collectives.collectives(compiled.as_text()):
    if "tensor" in comm_report.mesh_axes(c.replica_groups, layout.mesh):
      for dims in _arrays(c.shape):
        assert int(np.prod(dims)) < logits_per_chunk // 2, (c.op, c.shape, c.runs)


# ----------------------------------------------------------------------------- acceptance 4

PLAN_70B_BY_TENSOR = """
import json, sys
from jaxzero.parallel import mesh
mesh.use_virtual_cpu_devices(64)
from jaxzero import config
from jaxzero.planning import planner
rows = {}
for tensor, batch in ((1, 64), (8, 8)):  # one sequence per data-parallel group
  cfg = config.load(sys.argv[1], ["offload.optimizer=device", "train.grad_accum=1",
                                  f"mesh.tensor={tensor}", f"train.global_batch={batch}"])
  row, = planner.plan(cfg, 64, 80e9, sweep=[planner.Variant(3, False, "full")],
                      search=False).rows
  rows[tensor] = [row.activation_bytes, row.state_bytes, row.theory_state_bytes,
                  row.grads_bytes]
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_tensor_8_cuts_llama70b_activations_4x_at_the_zero_state(tmp_path):
  """Llama-3-70B on 64 devices, ZeRO-3, seq 4096, full remat: with mesh.tensor=8
  (global batch 8) the planner's activations per device are at least 4x lower
  than with mesh.tensor=1 (global batch 64), and the state is 16Φ/64 in both."""
  done = processes.run_python("-c", PLAN_70B_BY_TENSOR,
                              str(planner_config("llama70b_zero3_offload")),
                              env=processes.child_env(tmp_path / "cache"), timeout=None)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(done.stdout.strip().splitlines()[-1])
  (act_1, state_1, theory_1, grads_1), (act_8, state_8, theory_8, _) = rows["1"], rows["8"]
  assert act_1 >= 4 * act_8, rows
  # Issue 10's bound on the same step at mesh.tensor=1: XLA's temporaries
  # (activations and gradient buffers) within 1.5x of the analytic floor, 22 GB.
  assert act_1 + grads_1 <= 22e9, rows
  phi = count_params(config.load(str(planner_config("llama70b_zero3_offload"))).model)
  for state, theory in ((state_1, theory_1), (state_8, theory_8)):
    assert theory == round(16 * phi / 64)
    assert state == pytest.approx(theory, rel=1e-6)


# ----------------------------------------------------------------------------- acceptance 5


@pytest.mark.slow
def test_checkpoint_written_with_tensor_2_resumes_with_tensor_1_and_4(reference, tmp_path):
  """Saved by ZeRO-2 on fsdp 4 x tensor 2; restored on one device and by ZeRO-1
  on fsdp 2 x tensor 4 (the meshes and stages of the loss tests: no new compile);
  exported to Hugging Face and imported into replica 2 x fsdp 2 x tensor 2."""
  state0, tokens, want = reference
  _, state = run_steps(make_cfg({"stage": 2}, (1, 4, 2)), state0, tokens[:1])
  info = checkpointer.run_info(MODEL, "float32", 0)
  with checkpointer.Checkpointer(tmp_path, 1, info) as saver:
    saver.save(1, state, wait=True)
  for zero, shape in (({"stage": 0}, (1, 1, 1)), ({"stage": 1}, (1, 2, 4))):
    cfg = make_cfg(zero, shape)
    engine, _ = compiled_step(cfg)
    with checkpointer.Checkpointer(tmp_path, 1, info) as reader:
      restored = reader.restore(1, engine.abstract_state())
    assert int(restored.step) == 1
    assert restored.master["layers"]["wq_LxDxHxE"].sharding == engine.shardings.master[
        "layers"]["wq_LxDxHxE"]
    got, _ = run_steps(cfg, restored, tokens[1:])
    np.testing.assert_allclose(got, want[1:], rtol=1e-5)
  # Exported to Hugging Face and read back into a tensor-parallel layout: the same weights.
  hf_export.export_hf(tmp_path, tmp_path / "hf", dtype="float32")
  layout = make_engine(make_cfg({"stage": 3}, (2, 2, 2))).layout
  loaded = hf_load.load_params(tmp_path / "hf", MODEL, layout.tree_shardings(param_specs(MODEL),
                                                                           "optimizer"))
  assert loaded["lm_head_DxV"].sharding.spec == P(DATA, "tensor")
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded), jax.device_get(state.master))


# ----------------------------------------------------------------------------- acceptance 6


def test_a_tensor_size_that_does_not_divide_the_devices_is_refused():
  with pytest.raises(ConfigError, match="^mesh.tensor=3 does not divide the 8 devices; valid "
                                        "values: 1, 2, 4, 8$"):
    mesh.resolve_shape(config.MeshConfig(replica=1, fsdp=-1, tensor=3), 8)
  with pytest.raises(ConfigError, match="mesh.replica=1 x mesh.fsdp=2 x mesh.tensor=2 does not "
                                        "fit 8 devices"):
    mesh.resolve_shape(config.MeshConfig(replica=1, fsdp=2, tensor=2), 8)
  assert mesh.resolve_shape(config.MeshConfig(replica=2, fsdp=-1, tensor=2), 8) == (2, 2, 2)


@pytest.mark.parametrize("assignments, message", [
    (["mesh.tensor=8"], "mesh.tensor=8 must divide model.n_heads=4, model.mlp_dim=128 and "
                        "model.vocab_size=256; valid values: 1, 2, 4"),
    (["mesh.tensor=4", "model.mlp_dim=90"],
     "must divide .* model.mlp_dim=90 .* valid values: 1, 2$"),
    (["mesh.tensor=2", "model.vocab_size=255"], "model.vocab_size=255; valid values: 1$"),
    (["mesh.tensor=0"], "mesh.tensor=0 must be a positive device count"),
])
def test_a_bad_tensor_size_is_one_line_naming_the_key_and_valid_values(assignments, message):
  cfg = config.apply_overrides(make_cfg({"stage": 3}, (1, -1, 1)), assignments)
  with pytest.raises(ConfigError, match=message) as info:
    config.validate(cfg)
  assert "\n" not in str(info.value)


def test_a_weight_whose_megatron_dimension_does_not_divide_is_refused():
  layout = make_engine(make_cfg({"stage": 3}, (1, 4, 2))).layout
  with pytest.raises(ConfigError, match=r"^mesh.tensor=2 does not divide w's heads dimension "
                                        r"\(3\); valid values: 1, 3$"):
    layout.spec((64, 3, 16), ("embed", "heads", "head_dim"), "compute", "w")


def test_kv_heads_that_tensor_does_not_divide_are_replicated_and_logged(caplog):
  with caplog.at_level("INFO", logger="jaxzero.parallel.zero"):
    layout = make_engine(make_cfg({"stage": 3}, (1, 2, 4))).layout
  assert "replicating the 2 KV heads across each tensor group of 4" in caplog.text
  assert layout.spec((2, 64, 2, 16), ("layers", "embed", "kv_heads", "head_dim"), "compute") == P()


def test_a_tensor_group_across_processes_is_refused():
  two_processes = [[types.SimpleNamespace(process_index=p) for p in (0, 0, 1, 1)]]
  with pytest.raises(ConfigError, match="mesh.tensor=4 would span processes .* one process of "
                                        "2 devices.*; valid values: 1, 2$"):
    mesh.check_tensor_groups(two_processes)
  mesh.check_tensor_groups([[types.SimpleNamespace(process_index=p) for p in (0, 0)],
                            [types.SimpleNamespace(process_index=p) for p in (1, 1)]])


def test_batch_arithmetic_counts_data_parallel_devices_only():
  cfg = make_cfg({"stage": 3}, (1, -1, 2), global_batch=8, grad_accum=1)
  engine = make_engine(dataclasses.replace(cfg, mesh=config.MeshConfig(1, 4, 2)))
  assert engine.layout.data_parallel_size == 4
  assert mesh.micro_batch(cfg.train, engine.layout.data_parallel_size) == 2
  assert mesh.devices_needed(config.MeshConfig(2, 2, 2)) == 8
  assert mesh.data_parallel_needed(config.MeshConfig(2, 2, 2)) == 4
  assert engine.batch_sharding.spec == P(None, DATA)  # tokens [A, B, T+1]: rows split
