"""Gradient accumulation adds each layer's gradient into the sum inside the backward pass."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero.engine.program import TrainProgram
from jaxzero.models import trainable
from jaxzero.models.llama import LlamaConfig
from jaxzero.planning import planner
from jaxzero.planning.planner import Variant
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.parallel.zero import Layout

# 32 layers and a small vocabulary: the stacked layers are 99.6% of the gradient, and
# one layer's gradient, the backward pass's working set, 3%.
MODEL = LlamaConfig(vocab_size=64, dim=64, n_layers=32, n_heads=4, n_kv_heads=2, mlp_dim=256,
                    rope_theta=10_000.0)


def cfg_for(stage: int, accum: int, replica: int = 1, dtype: str = "float32",
            params: str = "device") -> config.Config:
  """`replica` > 1: HYBRID_SHARD on replica x (8 / replica)."""
  c = config.base()
  return dataclasses.replace(
      c, model=MODEL,
      zero=dataclasses.replace(c.zero, stage=stage, strategy="", hybrid=replica > 1,
                               grad_dtype=dtype),
      offload=dataclasses.replace(c.offload, params=params),
      mesh=config.MeshConfig(replica=replica, fsdp=-1),
      train=dataclasses.replace(c.train, global_batch=8 * accum, grad_accum=accum, seq_len=32),
      precision=config.PrecisionConfig(compute=dtype))


@pytest.mark.parametrize("stage,hybrid,offload_params,dtype", [
    pytest.param(1, False, "device", "float32", marks=pytest.mark.slow),
    (3, False, "device", "float32"),
    pytest.param(3, True, "device", "float32", marks=pytest.mark.slow),
    pytest.param(3, False, "pinned_host", "float32", marks=pytest.mark.slow),
    pytest.param(3, False, "device", "bfloat16", marks=pytest.mark.slow)],
    ids=["stage1", "stage3", "hybrid_shard", "stage3_params_pinned_host", "stage3_bf16"])
def test_grad_accum_4_holds_no_second_gradient_buffer(stage, hybrid, offload_params, dtype):
  """From the compiled step's buffer assignment: the temporaries at grad_accum 4 exceed
  those at grad_accum 1 (same micro-batch) by under 5% of one gradient-sized buffer.
  Adding each micro-step's whole gradient after its backward pass cost 100-160%."""
  rows = {}
  for accum in (1, 4):
    cfg = cfg_for(stage, accum, replica=2 if hybrid else 1, dtype=dtype)
    variant = Variant(stage, hybrid, "full", offload_params=offload_params)
    rows[accum] = planner.plan(cfg, 8, int(80e9), [variant], search=False).rows[0]
  assert rows[1].micro_batch == rows[4].micro_batch
  grads = rows[1].grads_bytes
  extra = rows[4].activation_bytes - rows[1].activation_bytes
  assert extra <= 0.05 * grads, (extra, grads)


def grad_sums(cfg: config.Config, model, n_devices: int = 8):
  devices = jax.devices()[:n_devices]
  replica, fsdp, tensor = mesh_lib.resolve_shape(cfg.mesh, n_devices)
  layout = Layout.from_config(cfg, mesh_lib.make_mesh(replica, fsdp, devices, tensor))
  engine = TrainProgram(cfg, layout, model)
  state = engine.init()
  t = cfg.train
  tokens = jax.random.randint(jax.random.key(1), (t.grad_accum, t.global_batch // t.grad_accum,
                                                  t.seq_len + 1), 0, cfg.model.vocab_size)
  grad_sum, loss, norm = engine.grad_step(
      state.params, jax.device_put(tokens, engine.batch_sharding), None)
  return jax.device_get(grad_sum), float(loss), float(norm)


@pytest.mark.slow
@pytest.mark.parametrize("stage,replica,params", [
    (1, 1, "device"), (3, 1, "device"), (3, 2, "device"), (3, 1, "pinned_host"),
    (3, 2, "pinned_host")],
    ids=["stage1", "stage3", "hybrid_shard", "params_pinned_host", "hybrid_params_pinned_host"])
def test_the_sum_equals_adding_whole_micro_step_gradients(stage, replica, params):
  """The same model without `layers_key` takes the plain path (jax.grad of the whole
  micro-step, then an add): the sums, loss and norm agree to float32 rounding."""
  cfg = cfg_for(stage, accum=3, replica=replica, params=params)
  assert cfg.zero.hybrid == (replica > 1)
  model = trainable.llama(cfg.model)
  assert model.layers_key == "layers"
  got = grad_sums(cfg, model)
  want = grad_sums(cfg, dataclasses.replace(model, layers_key=None))
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got[1:], want[1:], rtol=1e-6)


def test_a_model_declaring_layers_key_must_scan_its_layers_through_the_hook():
  cfg = cfg_for(3, accum=2)
  model = trainable.llama(cfg.model)
  plain_scan = lambda layer, carry, stacked: jax.lax.scan(layer, carry, stacked)[0]
  ignores_hook = dataclasses.replace(model, loss=lambda params, batch, hooks: model.loss(
      params, batch, dataclasses.replace(hooks, scan=plain_scan)))
  with pytest.raises(ValueError, match="layers_key='layers'.*ran Hooks.scan 0 times"):
    grad_sums(cfg, ignores_hook)
