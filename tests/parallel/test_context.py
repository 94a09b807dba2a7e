"""Context parallelism (mesh.context): a device's queries against keys and values gathered
over the context axis give the attention of the whole sequence; training at context 2, 4
and 8, alone and with fsdp x tensor at ZeRO-3, GPipe stages or stage 1 in bf16, equals one
device; the compiled step gathers keys and values, never queries; checkpoints move
between context sizes."""

import collections
import contextlib
import io
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero.models.attention import attention

TINY = "configs/tiny_zero3.py"


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize("window, packed", [(0, False), (20, False), (0, True)])
def test_attention_of_each_part_of_the_sequence_is_that_of_the_whole(implementation, window,
                                                                     packed):
  rng = np.random.default_rng(0)
  B, T, H, K, E, parts = 2, 64, 4, 2, 8, 4
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, E)), jnp.float32) for n in (H, K, K))
  seg = jnp.asarray(np.repeat(np.arange(4), [10, 20, 30, 4])[None].repeat(B, 0)) if packed \
      else None
  kwargs = dict(implementation=implementation, block=8, window=window)

  def whole(q, k, v):
    return attention(q, k, v, segment_ids_BxT=seg, **kwargs)

  def in_parts(q, k, v):  # as each device of a context axis of 4 computes it
    n = T // parts
    return jnp.concatenate([
        attention(q[:, c * n:(c + 1) * n], k, v, **kwargs, kv_segment_ids_BxS=seg,
                  segment_ids_BxT=None if seg is None else seg[:, c * n:(c + 1) * n],
                  q_offset=jnp.int32(c * n)) for c in range(parts)], axis=1)

  chex.assert_trees_all_close(in_parts(q, k, v), whole(q, k, v), atol=1e-6)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  chex.assert_trees_all_close(jax.grad(loss(in_parts), argnums=(0, 1, 2))(q, k, v),
                              jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v), atol=1e-5)


def tiny(*overrides):
  return config.load(TINY, ["model.n_layers=2", "train.seq_len=64", "train.log_every=1",
                            "data.max_bytes=200000", "train.steps=10", *overrides])


def losses(cfg, workdir, n_devices, steps=None):
  from jaxzero.training import loop
  with contextlib.redirect_stdout(io.StringIO()):
    history = loop.train(cfg, workdir, steps, devices=jax.devices()[:n_devices],
                         progress=False)
  return [r["loss"] for r in history]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  return losses(tiny("mesh.fsdp=1"), tmp_path_factory.mktemp("one"), 1)


@pytest.fixture(scope="module")
def one_device_bf16(tmp_path_factory):
  return losses(tiny("mesh.fsdp=1", "precision.compute=bfloat16"),
                tmp_path_factory.mktemp("one_bf16"), 1)


@pytest.mark.parametrize("mesh", [
    ["mesh.fsdp=1", "mesh.context=8"],
    ["mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2", "zero.stage=3"],
    ["mesh.fsdp=2", "mesh.context=2", "mesh.pipeline=2", "train.grad_accum=2"],
    ["mesh.replica=2", "mesh.fsdp=2", "mesh.context=2", "zero.stage=1",
     "precision.compute=bfloat16"],
])
def test_ten_steps_at_context_c_equal_one_device(mesh, one_device, one_device_bf16, tmp_path):
  want = one_device_bf16 if "precision.compute=bfloat16" in mesh else one_device
  np.testing.assert_allclose(losses(tiny(*mesh), tmp_path, 8), want,
                             rtol=1e-5 if want is one_device else 2e-3)


def test_the_step_gathers_keys_and_values_over_context_never_queries():
  from jaxzero.training import loop
  cfg = config.load(TINY, ["model.n_layers=1", "train.seq_len=2048", "train.global_batch=8",
                           "train.grad_accum=1", "mesh.fsdp=4", "mesh.context=2",
                           "model.attention=blockwise", "data.max_bytes=200000"])
  runner = loop.prepare(cfg, devices=jax.devices()[:8])
  program = runner.program
  text = runner.lower(program.abstract_state(), program.abstract_batch(2)).compile().as_text()
  ops = collections.Counter(re.findall(r"= (\S+?)\{[^}]*\} (all-gather|reduce-scatter)\(",
                                       text))
  # 2 rows a device, 2 KV heads of 32: k and v gathered from 1024 positions to 2048,
  # dk and dv reduce-scattered back; the 4 query heads never gathered.
  assert ops[("f32[2,2048,2,32]", "all-gather")] == 2
  assert ops[("f32[2,1024,2,32]", "reduce-scatter")] == 2
  assert not [shape for shape, _ in ops if re.match(r"f32\[\d+,2048,4,32\]", shape)]


def test_a_checkpoint_moves_between_context_sizes(one_device, tmp_path):
  # (Context 2 and 4, the second with the XLA attention kernel: 10 steps in all.)
  first = losses(tiny("mesh.fsdp=4", "mesh.context=2"), tmp_path, 8, steps=4)
  rest = losses(tiny("mesh.fsdp=2", "mesh.context=4", "model.attention=xla"), tmp_path, 8)
  np.testing.assert_allclose(first + rest, one_device, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.context=3"], "mesh.context=3 does not divide train.seq_len=64 into equal parts"),
    (["mesh.context=2", "model_factory=m:f"], "a model_factory model trains with mesh.context=1"),
    (["mesh.context=2", "model.attention=cudnn"], "mesh.context=2 with model.attention=cudnn"),
    (["mesh.context=2", "train.seq_len=4098"],
     "mesh.context=2 leaves 2049 positions of train.seq_len=4098 a device"),
])
def test_bad_context_settings_are_one_line(overrides, message):
  with pytest.raises(config.ConfigError, match=re.escape(message)):
    config.validate(config.apply_overrides(config.load(TINY, ["train.seq_len=64"]), overrides))
