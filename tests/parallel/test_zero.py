"""Stage layouts: the sharding of every leaf, and per-device bytes against the ZeRO table."""

import dataclasses
import pathlib

import chex
import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxzero import config
from jaxzero import engine as engine_lib
from jaxzero.engine import state_bytes
from jaxzero.models import trainable
from jaxzero.models.llama import LlamaConfig, count_params, param_specs
from jaxzero.parallel.mesh import make_mesh
from jaxzero.parallel.zero import Layout

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
ALL = ("replica", "fsdp")
TINY = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128)


def _cfg(model=TINY, compute="bfloat16"):
  return dataclasses.replace(config.base(), model=model,
                             zero=config.ZeroConfig(grad_dtype=compute),
                             precision=config.PrecisionConfig(compute=compute))


def _layout(stage, hybrid=False, replica=1, fsdp=8, optimizer="device", params="device"):
  cfg = dataclasses.replace(config.base(), zero=config.ZeroConfig(stage=stage, hybrid=hybrid),
                            offload=config.OffloadConfig(optimizer=optimizer, params=params))
  return Layout.from_config(cfg, make_mesh(replica, fsdp, jax.devices()[:replica * fsdp]))


def _state_bytes(cfg, layout):
  """Per-device bytes of compute params, grads (in grad dtype), and master + Adam."""
  got = engine_lib.TrainProgram(cfg, layout, trainable.llama(cfg.model)).state_bytes()
  return {role: got[role] for role in ("params", "grads", "optimizer")}


def _expected_specs(stage, shard_axes):
  """What each role's PartitionSpec must be: `embed` split when the role is sharded."""
  def sharded(spec):
    return P(*[shard_axes if a == "embed" else None for a in spec.logical_axes])
  roles = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"),
           3: ("optimizer", "grads", "params")}[stage]
  return {role: (sharded if role in roles else (lambda _: P())) for role in
          ("params", "grads", "optimizer")}


@pytest.mark.parametrize("stage, hybrid", [(0, False), (1, False), (2, False), (3, False),
                                           (3, True), (2, True)])
def test_every_param_and_optimizer_leaf_is_placed_by_the_stage_table(stage, hybrid):
  cfg = _cfg()
  layout = _layout(stage, hybrid, replica=2 if hybrid else 1, fsdp=4 if hybrid else 8)
  shard_axes = ("fsdp",) if hybrid else ALL
  expected = _expected_specs(stage, shard_axes)
  sh = engine_lib.TrainProgram(cfg, layout, trainable.llama(cfg.model)).shardings
  specs = param_specs(cfg.model)
  is_spec = lambda x: hasattr(x, "logical_axes")
  flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
  assert [s.spec for s in jax.tree.leaves(sh.params)] == [expected["params"](s) for s in flat_specs]
  assert [s.spec for s in jax.tree.leaves(sh.master)] == [expected["optimizer"](s)
                                                        for s in flat_specs]
  grads = jax.tree.leaves(layout.tree_shardings(specs, "grads"))
  assert [s.spec for s in grads] == [expected["grads"](s) for s in flat_specs]
  # Adam's mu and nu are placed exactly like the master weights; its counters replicated.
  adam = sh.opt_state[1][0]
  for moments in (adam.mu, adam.nu):
    chex.assert_trees_all_equal(moments, sh.master)
  assert adam.count.spec == P()


def test_initialised_state_really_lives_in_its_shards():
  cfg = _cfg(compute="float32")
  state = engine_lib.TrainProgram(cfg, _layout(3), trainable.llama(cfg.model)).init()
  wq = state.params["layers"]["wq_LxDxHxE"]
  assert wq.sharding.spec == P(None, ALL, None, None)
  chex.assert_shape([s.data for s in wq.addressable_shards], (2, 8, 4, 16))
  assert len(wq.addressable_shards) == 8
  chex.assert_trees_all_equal_structs(state.params, state.master)


@pytest.mark.parametrize("model", [TINY, dataclasses.replace(TINY, tie_embeddings=True)])
def test_per_device_model_state_follows_the_zero_formula(model):
  cfg = _cfg(model)
  phi, n = count_params(model), 8
  formula = {0: 2 * phi + 2 * phi + 12 * phi, 1: 2 * phi + 2 * phi + 12 * phi / n,
             2: 2 * phi + 14 * phi / n, 3: 16 * phi / n}
  totals = {}
  for stage, expected in formula.items():
    got = _state_bytes(cfg, _layout(stage))
    totals[stage] = sum(got.values())
    # Adam's step counters (a few bytes) are the only extra.
    assert expected <= totals[stage] <= expected + 64, (stage, got)
  assert totals[0] > totals[1] > totals[2] > totals[3]
  assert totals[3] == pytest.approx(totals[0] / 8, abs=64)


def test_hybrid_shards_over_fsdp_only():
  cfg = _cfg()
  phi = count_params(cfg.model)
  got = _state_bytes(cfg, _layout(3, hybrid=True, replica=2, fsdp=4))
  assert sum(got.values()) == pytest.approx(16 * phi / 4, abs=64)


def test_a_leaf_that_does_not_divide_picks_another_dimension_or_is_padded():
  # dim 36 and vocab 257 divide no 8-way axis; mlp 64 does.
  odd = LlamaConfig(vocab_size=257, dim=36, n_layers=1, n_heads=4, n_kv_heads=2, mlp_dim=64)
  program = engine_lib.TrainProgram(_cfg(odd), _layout(3), trainable.llama(_cfg(odd).model))
  sh, abstract = program.shardings, program.abstract
  assert sh.params["layers"]["w_up_LxDxF"].spec == P(None, None, ALL)
  # Outside the layers, padded where it wastes least: vocab 257 -> 264 (7 x 36 elements,
  # where dim 36 -> 40 would add 4 x 257), the final norm 36 -> 40.
  assert abstract.params["embed_VxD"].shape == (264, 36)
  assert sh.params["embed_VxD"].spec == P(ALL, None)
  assert abstract.master["final_norm"].shape == (40,) and sh.master["final_norm"].spec == P(ALL)
  # The stacked layers' leaves too (the layer scan hands each layer its true shape):
  # nothing stays whole.
  assert abstract.params["layers"]["attn_norm"].shape == (1, 40)
  assert sh.params["layers"]["attn_norm"].spec == P(None, ALL)
  assert program.n_params == count_params(odd)
  assert state_bytes.kept_whole(program)["leaves"] == 0


def test_rules_reject_unknown_logical_axes():
  with pytest.raises(ValueError, match="logical axes .* each dimension needs one of"):
    _layout(3).spec((4, 4), ("embed", "bogus"), "params", "w")


@pytest.mark.parametrize("name", ["llama8b_zero3", "llama70b_zero3_offload"])
def test_big_presets_build_their_sharded_abstract_state(name):
  cfg = config.load(str(CONFIGS / f"{name}.py"))
  layout = _layout(3)
  got = _state_bytes(cfg, layout)
  phi = count_params(cfg.model)
  assert phi == (8_030_261_248 if "8b" in name else 70_553_706_496)
  assert sum(got.values()) == pytest.approx(16 * phi / 8, rel=1e-6)


def test_an_unnamed_layer_stack_is_sliced_by_layer_not_split():
  """A scanned stack without dimension names (lax.scan over [L, D, F]): its leading axis
  divides 8 devices and a model dimension does not; the model dimension is split, padded
  (split, the stack would be gathered whole on every device for each layer's use)."""
  from jaxzero.parallel import rules  # pylint: disable=import-outside-toplevel
  assert rules.leaf_axes("['up']", (8, 36, 60), None, {}, 8, 0) == ("none", "none", "embed")
  assert rules.leaf_axes("['w']", (64, 12), None, {}, 8, 0) == ("embed", "none")  # 2-D: any
  # Nothing else as large as the devices: the leading axis (padding a 1 to 8 would not do).
  assert rules.leaf_axes("['c']", (8, 1, 1), None, {}, 8, 0) == ("embed", "none", "none")


def test_a_leaf_kept_whole_says_why_once(caplog):
  from jaxzero.parallel import rules  # pylint: disable=import-outside-toplevel
  caplog.set_level("INFO")
  for _ in range(4):  # as for each role: params, grads, optimizer, compute
    small = rules.leaf_axes("['emb']['tiny']", (61, 96), ("vocab", "embed"), {}, 8, 100_000)
    prime = rules.leaf_axes("['w']['prime']", (331, 997), None, {}, 8, 0)
  # The prime leaf is not replicated: its largest dimension is named, and padded.
  assert small == ("none", "none") and prime == ("none", "embed")
  lines = [r.getMessage() for r in caplog.records]
  assert lines.count("keeping ['emb']['tiny'] (61, 96) whole on every device: 5,856 elements, "
                     "under zero.min_shard_size=100,000") == 1
  assert not any("replicating" in line for line in lines)
