"""A Qwen2-style model (q/k/v biases, a sliding window shorter than the sequence) trains
under ZeRO-3 on 8 devices to the losses of one device, its biases sharded like the weights."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero.models.llama import LlamaConfig, param_specs
from jaxzero.parallel.mesh import make_mesh
from jaxzero.parallel.zero import Layout
from jaxzero.training import loop

QWEN2 = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128,
                    rope_theta=10_000.0, family="qwen2", qkv_bias=True, sliding_window=8)


def qwen2_config(stage: int) -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c, model=QWEN2, zero=config.ZeroConfig(stage=stage),
      train=dataclasses.replace(c.train, steps=3, global_batch=16, grad_accum=2, seq_len=32,
                                lr=3e-3, warmup_steps=1),
      precision=config.PrecisionConfig(compute="float32"),
      data=config.DataConfig(max_bytes=200_000))


def test_zero3_biases_are_sharded():
  layout = Layout.from_config(qwen2_config(3), make_mesh(1, 8))
  specs = param_specs(QWEN2)["layers"]
  for name in ("bq_LxHxE", "bk_LxKxE", "bv_LxKxE"):
    spec = specs[name]
    # heads (4) and kv_heads (2) do not divide 8 devices: head_dim (16) is split.
    assert layout.spec(spec.shape, spec.logical_axes, "params") == jax.sharding.PartitionSpec(
        None, None, ("replica", "fsdp")), name


@pytest.mark.slow
def test_qwen2_zero3_matches_one_device(tmp_path):
  history = {}
  for n_devices, stage in ((1, 0), (8, 3)):
    cfg = config.apply_overrides(qwen2_config(stage), ["checkpoint.at_end=false"])
    history[n_devices] = loop.train(cfg, tmp_path / str(n_devices),
                                    devices=jax.devices()[:n_devices], progress=False)
  one, many = (np.array([h["loss"] for h in history[n]]) for n in (1, 8))
  assert len(many) == 3 and one[-1] < one[0]
  np.testing.assert_allclose(many, one, rtol=1e-5)
