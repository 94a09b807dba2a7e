"""Every ZeRO stage and mesh trains to the same losses as one device."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero.models.llama import LlamaConfig
from jaxzero.training import loop


def tiny_config(**zero) -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128,
                        rope_theta=10_000.0),
      zero=config.ZeroConfig(**zero),
      mesh=config.MeshConfig(replica=2 if zero.get("strategy", "").startswith("HYBRID")
                             or zero.get("hybrid") else 1, fsdp=-1),
      train=dataclasses.replace(c.train, steps=10, global_batch=16, grad_accum=2, seq_len=32,
                                lr=3e-3, warmup_steps=2),
      precision=config.PrecisionConfig(compute="float32"),
      data=config.DataConfig(max_bytes=1_000_000),
  )


def losses(cfg, tmp_path, n_devices=8):
  # Only the losses are compared: the last step is not saved.
  cfg = config.apply_overrides(cfg, ["checkpoint.at_end=false"])
  history = loop.train(cfg, tmp_path, devices=jax.devices()[:n_devices], progress=False)
  return np.array([h["loss"] for h in history])


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
  got = losses(tiny_config(stage=0), tmp_path_factory.mktemp("single"), n_devices=1)
  assert got[-1] < got[0] - 0.5, "the reference run should learn"
  return got


@pytest.mark.parametrize("zero", [
    pytest.param({"stage": 0}, marks=pytest.mark.slow), {"stage": 1},
    pytest.param({"stage": 2}, marks=pytest.mark.slow),
    {"stage": 3},
    pytest.param({"strategy": "HYBRID_SHARD"}, marks=pytest.mark.slow),
    pytest.param({"strategy": "HYBRID_SHARD_ZERO2"}, marks=pytest.mark.slow),
    pytest.param({"stage": 1, "hybrid": True}, marks=pytest.mark.slow),  # (it crashed)
], ids=["stage0", "stage1", "stage2", "stage3", "hybrid_shard_2x4", "hybrid_shard_zero2_2x4",
        "hybrid_zero1_2x4"])
def test_stage_matches_single_device(zero, single_device_losses, tmp_path):
  got = losses(tiny_config(**zero), tmp_path)
  assert len(got) == 10
  np.testing.assert_allclose(got, single_device_losses, rtol=1e-5)


def test_metrics_have_the_documented_fields(tmp_path):
  # Steps 1-2 of the stage-3 run above (its program, from the compilation cache).
  loop.train(tiny_config(stage=3), tmp_path, steps=2, devices=jax.devices()[:8],
                progress=False)
  import json
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s"} <= set(r)
    assert r["tokens_per_sec"] > 0 and r["grad_norm"] > 0


def test_a_loss_mask_that_leaves_devices_unequal_targets_trains_as_one_device():
  """Stages 0-1 and HYBRID take the loss as one part per device group; with a loss mask
  (SFT) the parts have unequal targets, and each is weighed by its share of them: the loss
  and the update are the whole batch's, as on one device and at stage 3 (they weighed
  alike, which doubled the gradient norm here)."""
  from tiny import initial_state_and_batches, make_engine  # pylint: disable=import-outside-toplevel

  def cfg(stage, replica=1, fsdp=1, accum=1):
    c = config.base()
    return dataclasses.replace(
        c, model=LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             mlp_dim=64, rope_theta=10_000.0, attention="xla"),
        zero=config.ZeroConfig(stage=stage, grad_dtype="float32", hybrid=replica > 1),
        mesh=config.MeshConfig(replica=replica, fsdp=fsdp),
        train=dataclasses.replace(c.train, global_batch=8, grad_accum=accum, seq_len=8,
                                  lr=3e-3, warmup_steps=1),
        precision=config.PrecisionConfig(compute="float32"))

  state0, tokens = initial_state_and_batches(cfg(0), 1)
  mask = np.zeros_like(tokens[0])
  mask[0, :4, :] = 1  # the first half of the rows: 8 targets each
  mask[0, 4:, 1] = 1  # the second: one each
  batch = {"tokens": tokens[0], "loss_mask": mask}
  results = {}
  # (Stage 0 takes the loss as stage 1 does; stage 3 whole, as one device.)
  for name, c in {"one": cfg(0), "stage1": cfg(1, fsdp=4),
                  "hybrid": cfg(3, replica=2, fsdp=2)}.items():
    program = make_engine(c)
    state, metrics = program.train_step(jax.device_put(state0, program.shardings),
                                        jax.device_put(batch, program.batch_sharding))
    results[name] = (float(metrics["loss"]), float(metrics["grad_norm"]),
                     jax.device_get(state.master))
  loss, norm, master = results.pop("one")
  for name, (got_loss, got_norm, got_master) in results.items():
    np.testing.assert_allclose([got_loss, got_norm], [loss, norm], rtol=2e-6, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 got_master, master)
