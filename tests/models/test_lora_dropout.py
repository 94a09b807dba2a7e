"""LoRA dropout (lora.dropout, PEFT's lora_dropout): each adapter's input dropped with
the configured probability in training, the rest scaled by 1 / (1 - p), from keys the
engine draws per row of the global batch, so that a run equals itself on any mesh and
grad_accum; evaluation and the exported adapter see no dropout."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero.engine.step import keyed_batch
from jaxzero.hf import peft as hf_peft
from jaxzero.models import lora as lora_lib
from jaxzero.models.interface import KeyedBatch
from jaxzero.models.llama import next_keys

from test_lora import TOKENS, lora_config, program, train

RATE = 0.25


def dropout_config(rate=RATE, **changes) -> config.Config:
  c = lora_config(**changes)
  return dataclasses.replace(c, lora=dataclasses.replace(c.lora, dropout=rate))


@pytest.fixture(scope="module")
def one_device():
  return train(dropout_config(mesh=config.MeshConfig(fsdp=1)))


def test_an_adapter_input_loses_the_rate_and_the_rest_is_scaled():
  drop = lora_lib.adapter_dropout(RATE, None, 64)
  keys = jax.random.key_data(jax.random.split(jax.random.key(0), 4))
  h = jnp.ones((4, 64, 32))
  out = np.asarray(drop(keys, "q", h))
  dropped = out == 0
  assert abs(dropped.mean() - RATE) < 0.02, dropped.mean()
  np.testing.assert_allclose(out[~dropped], 1 / (1 - RATE), rtol=1e-6)
  # Each target and each layer draws its own mask; the same keys draw the same one.
  other_target = np.asarray(drop(keys, "k", h)) == 0
  next_layer = np.asarray(drop(next_keys(keys), "q", h)) == 0
  assert 0.5 < (dropped != other_target).mean() / (2 * RATE * (1 - RATE)) < 1.5
  assert 0.5 < (dropped != next_layer).mean() / (2 * RATE * (1 - RATE)) < 1.5
  np.testing.assert_array_equal(np.asarray(drop(keys, "q", h)) == 0, dropped)


def test_a_sequence_laid_out_in_another_order_keeps_each_positions_mask():
  """Under context parallelism the engine lays positions out in another order: each
  position keeps the mask it has in order."""
  order = np.random.default_rng(0).permutation(16)
  keys = jax.random.key_data(jax.random.split(jax.random.key(1), 2))
  h = jnp.ones((2, 16, 8))
  in_order = np.asarray(lora_lib.adapter_dropout(RATE, None, 16)(keys, "up", h))
  laid_out = np.asarray(lora_lib.adapter_dropout(RATE, order, 16)(keys, "up", h))
  np.testing.assert_array_equal(laid_out, in_order[:, order])


def test_row_keys_depend_on_the_row_of_the_global_batch_alone():
  p = program(dropout_config(mesh=config.MeshConfig(fsdp=1)))
  tokens = jnp.asarray(TOKENS[0])  # [A=2, B=8, T+1]
  keyed = keyed_batch(tokens, 0, 5, p.layout)
  assert isinstance(keyed, KeyedBatch) and keyed.row_keys.shape == (2, 8, 2)
  flat = keyed_batch(tokens.reshape(1, 16, -1), 0, 5, p.layout).row_keys
  np.testing.assert_array_equal(keyed.row_keys.reshape(1, 16, 2), flat)
  # Another step or seed: other keys; every row its own.
  assert not np.array_equal(keyed_batch(tokens, 0, 6, p.layout).row_keys, keyed.row_keys)
  assert not np.array_equal(keyed_batch(tokens, 1, 5, p.layout).row_keys, keyed.row_keys)
  assert len({tuple(k) for k in np.asarray(flat).reshape(-1, 2)}) == 16


@pytest.mark.slow
def test_dropout_changes_training_and_not_evaluation(one_device):
  losses, state, _ = one_device
  plain_losses, plain, _ = train(lora_config(mesh=config.MeshConfig(fsdp=1)))
  # Step 0's loss is the base model's (B = 0) with or without dropout; training differs.
  assert losses[0] == plain_losses[0]
  assert not np.allclose(state.master["layers"]["lora_q_b"], plain.master["layers"]["lora_q_b"])
  # Evaluation draws no mask: the same weights give the same loss, every time.
  p = program(dropout_config(mesh=config.MeshConfig(fsdp=1)))
  assert p.model.keyed_rows and not program(lora_config()).model.keyed_rows
  from jaxzero.models.interface import Hooks, merge  # pylint: disable=import-outside-toplevel
  params = merge(state.master, state.frozen)
  tokens = jnp.asarray(TOKENS[0, 0])
  loss = lambda model: float(model.loss(params, tokens, Hooks()))
  assert loss(p.model) == loss(program(lora_config()).model)


@pytest.mark.parametrize("name,changes", [
    ("stage 3 on 8", {}),
    ("grad_accum 1", {"mesh": config.MeshConfig(fsdp=1), "grad_accum": 1}),
    pytest.param("pipeline 2 x fsdp 4", {"mesh": config.MeshConfig(fsdp=4, pipeline=2)},
                 marks=pytest.mark.slow),
    pytest.param("context 2 x fsdp 2 x tensor 2",
                 {"mesh": config.MeshConfig(fsdp=2, context=2, tensor=2)},
                 marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_a_run_with_dropout_equals_itself_on_every_mesh_and_grad_accum(one_device, name, changes):
  want_losses, want, _ = one_device
  accum = changes.pop("grad_accum", None)
  cfg = dropout_config(**changes)
  if accum is None:
    losses, state, _ = train(cfg)
  else:  # the same global batches, as one micro-batch of 16 rows
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=accum))
    p = program(cfg)
    state, losses = p.init(), []
    for tokens in TOKENS:
      batch = jax.device_put(tokens.reshape(1, 16, -1), p.batch_sharding)
      state, metrics = p.train_step(state, batch)
      losses.append(float(metrics["loss"]))
    state = jax.device_get(state)
  np.testing.assert_allclose(losses, want_losses, atol=1e-5, err_msg=name)
  chex.assert_trees_all_close(state.master, want.master, atol=1e-5)


def test_the_peft_adapter_config_records_the_dropout():
  record = lora_lib.run_record(4, 8.0, "all-linear", dropout=0.05)
  assert hf_peft.adapter_config(record)["lora_dropout"] == 0.05
  assert hf_peft.adapter_config(lora_lib.run_record(4, 8.0, "q"))["lora_dropout"] == 0.0


@pytest.mark.parametrize("rate", [1.0, -0.1])
def test_a_dropout_outside_zero_to_one_is_one_line(rate):
  with pytest.raises(config.ConfigError, match=r"lora.dropout=.* must be in \[0, 1\)"):
    config.validate(dropout_config(rate))


def test_dropout_under_1f1b_is_one_line():
  cfg = dropout_config(mesh=config.MeshConfig(fsdp=4, pipeline=2),
                       pipeline=config.PipelineConfig(schedule="1f1b"))
  with pytest.raises(config.ConfigError, match="lora.dropout=0.25 with pipeline.schedule=1f1b"):
    config.validate(cfg)
