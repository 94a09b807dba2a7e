"""Padding (jaxzero.parallel.padding): the dimension chosen, and the built-in Llama with
no dimension dividing the devices (dim 36 = 3 heads of 12, mlp 60, vocab 257 on 8) training at stage 3
and HYBRID, with gradient accumulation, to one device's losses and weights."""

import dataclasses
import functools

import chex
import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero import engine as engine_lib
from jaxzero.models import trainable
from jaxzero.models.llama import LlamaConfig
from jaxzero.parallel.mesh import make_mesh
from jaxzero.parallel.padding import padded_shape
from jaxzero.parallel.zero import Layout

ODD = LlamaConfig(vocab_size=257, dim=36, n_layers=2, n_heads=3, n_kv_heads=1, mlp_dim=60,
                  rope_theta=10_000.0)


def test_the_dimension_padded_is_the_one_that_wastes_least():
  assert padded_shape((331, 997), ("embed", "mlp"), 8) == (331, 1000)  # +3 x 331
  assert padded_shape((503, 331), ("vocab", "embed"), 8) == (504, 331)  # +1 x 331
  assert padded_shape((7, 9), ("embed", "mlp"), 4) == (8, 9)  # +9 (a tie: +1 x 9, +3 x 7)
  assert padded_shape((36, 64), ("embed", "mlp"), 8) == (36, 64)  # one divides: as it is
  assert padded_shape((36, 9), ("embed", "head_dim"), 8, skip=0) == (36, 16)  # not `tensor`'s
  assert padded_shape((5, 7), ("layers", "none"), 8) == (5, 7)  # nothing ZeRO may split


def test_the_true_shapes_of_a_padded_state_are_not_said_to_be_replicated(caplog):
  """Checkpoints and the NVMe tier read a padded state's true shapes; finding them placed
  nothing, so nothing is said of their placement (it said each was replicated)."""
  caplog.set_level("INFO")
  layout = Layout.from_config(_cfg(3), make_mesh(1, 8, jax.devices()[:8]))
  program = engine_lib.TrainProgram(_cfg(3), layout, trainable.llama(ODD))
  assert program.true_abstract.master["embed_VxD"].shape == (257, 36)
  assert program.abstract.master["embed_VxD"].shape != (257, 36)
  assert not [r for r in caplog.records if "replicating" in r.getMessage()]


def _cfg(stage, hybrid=False, grad_accum=2):
  c = config.base()
  return dataclasses.replace(
      c, model=ODD, zero=config.ZeroConfig(stage=stage, hybrid=hybrid),
      train=dataclasses.replace(c.train, global_batch=16, grad_accum=grad_accum, seq_len=16,
                                lr=3e-3, warmup_steps=1, weight_decay=0.1),
      precision=config.PrecisionConfig(compute="float32"))


def _train(cfg, replica, fsdp, steps=3):
  devices = jax.devices()[:replica * fsdp]
  layout = Layout.from_config(cfg, make_mesh(replica, fsdp, devices))
  program = engine_lib.TrainProgram(cfg, layout, trainable.llama(cfg.model))
  state = program.init(key=jax.random.key(0))
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(steps):
    tokens = rng.integers(0, ODD.vocab_size, (cfg.train.grad_accum, 16 // cfg.train.grad_accum,
                                              17), dtype=np.int32)
    state, metrics = program.train_step(state, jax.device_put(tokens, program.batch_sharding))
    losses.append(float(metrics["loss"]))
  return program, losses, program.padding.unpad(jax.device_get(state.master))


@functools.cache
def _one_device():
  return _train(_cfg(0), 1, 1)[1:]


# Stages 1 and 2 pad as stage 3 does (one stored shape for every role); a user model's
# prime shapes train at each of them (tests/api/test_any_model.py).
@pytest.mark.parametrize("stage, hybrid, replica, fsdp", [
    pytest.param(3, False, 1, 8, marks=pytest.mark.slow), (3, True, 2, 4)])
def test_a_llama_no_dimension_of_which_divides_shards_and_trains_as_one_device(
    stage, hybrid, replica, fsdp):
  program, losses, master = _train(_cfg(stage, hybrid), replica, fsdp)
  padded = program.padding.padded_leaves()
  if fsdp == 8:  # (HYBRID shards over fsdp 4 only, which 36 and 60 divide)
    assert padded["['embed_VxD']"] == ((257, 36), (264, 36))
    assert padded["['layers']['w_up_LxDxF']"] == ((2, 36, 60), (2, 36, 64))
  for sharding in jax.tree.leaves(program.shardings.master):  # every leaf split
    assert any(axes is not None for axes in sharding.spec), sharding
  want_losses, want = _one_device()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  chex.assert_trees_all_close(master, want, atol=1e-5)
