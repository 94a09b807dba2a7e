"""jaxzero.lora on any model: a Flax NNX model's Linear kernels and a Linen model's Dense
kernels gain adapters; only they train, on 8 devices as on one (fp32), prime-sized
kernels included; step 0 is the base model; the plan shows trained and frozen."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxzero
from jaxzero.errors import CheckpointError, ConfigError


class MLP(nnx.Module):
  """Two Linear layers, the first of prime size (padded on 8 devices)."""

  def __init__(self, rngs: nnx.Rngs, vocab=64, dim=32, hidden=331):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.up = nnx.Linear(dim, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    return self.head(x + self.down(jax.nn.gelu(self.up(x))))


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


BATCHES = [((np.random.default_rng(i).integers(0, 64, (16, 1)) + np.arange(9)) % 64
            ).astype(np.int32) for i in range(3)]


def engine(devices: int, model=None, **options):
  model = model or jaxzero.lora(MLP, rank=4, alpha=8.0, targets=r"(up|down)/kernel")
  return jaxzero.Engine(model, optimizer=optax.adamw(3e-2), loss_fn=loss_fn,
                        zero=jaxzero.Zero(stage=3), min_shard_size=0,
                        mesh=jaxzero.mesh(fsdp=devices, devices=jax.devices()[:devices]),
                        **options)


def train(e):
  state = e.init(jax.random.key(0))
  first = jax.device_get(state.frozen)
  losses = []
  for batch in BATCHES:
    state, metrics = e.step(state, batch)
    losses.append(float(metrics["loss"]))
  return np.array(losses), jax.device_get(state), first


@pytest.fixture(scope="module")
def one_device():
  return train(engine(1))


def test_only_the_adapters_train_and_eight_devices_equal_one(one_device):
  want_losses, want, first = one_device
  assert want_losses[-1] < want_losses[0]
  assert set(want.master) == {"lora"}
  assert set(want.master["lora"]) == {"up", "down"}
  assert want.master["lora"]["up"]["kernel"]["a"].shape == (32, 4)
  assert want.master["lora"]["up"]["kernel"]["b"].shape == (4, 331)
  chex.assert_trees_all_equal(want.frozen, first)  # the model's own parameters
  e8 = engine(8)
  b = e8.shardings.master["lora"]["up"]["kernel"]["b"]
  assert "fsdp" in str(b.spec)  # B [4, 331]: padded to 336 and sharded 8 ways
  losses, state, _ = train(e8)
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  # Stored padded (331 -> 336) on 8 devices: the true part equals, the padding stays zero.
  true_part = jax.tree.map(lambda a, w: a[tuple(slice(0, n) for n in w.shape)], state.master,
                           want.master)
  chex.assert_trees_all_close(true_part, want.master, atol=1e-5)
  assert not np.any(state.master["lora"]["down"]["kernel"]["a"][331:])


def test_step_zero_is_the_base_model():
  """B = 0: the first step's loss is the frozen weights' own model's."""
  e = engine(1)
  state = e.init(jax.random.key(0))
  frozen = jax.device_get(state.frozen)
  got = float(e.step(state, BATCHES[0])[1]["loss"])
  graphdef, params = nnx.split(MLP(nnx.Rngs(1)))
  nnx.replace_by_pure_dict(params, frozen)
  np.testing.assert_allclose(got, float(loss_fn(nnx.merge(graphdef, params), BATCHES[0])),
                             rtol=1e-6)


def test_the_plan_shows_trained_and_frozen():
  plan = engine(8).plan()
  assert plan["n_params"] == 32 * 4 + 4 * 331 + 331 * 4 + 4 * 32
  assert plan["n_frozen"] == 64 * 32 + (32 * 331 + 331) + (331 * 32 + 32) + (32 * 64 + 64)
  assert plan["frozen_bytes"] > 0 and plan["theory_formula"].endswith("Φf/N")


class Linen(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(64, 32)(tokens)
    x = nn.Dense(48)(x)
    return nn.Dense(64)(jax.nn.relu(x))


def test_a_linen_model_trains_its_adapters():
  e = engine(2, model=jaxzero.lora(Linen(), rank=2, targets=r"Dense_\d/kernel"),
             init_args=(jnp.zeros((2, 8), jnp.int32),))
  losses, state, first = train(e)
  assert losses[-1] < losses[0]
  assert set(state.master["lora"]) == {"Dense_0", "Dense_1"}
  chex.assert_trees_all_equal(state.frozen, first)


@pytest.mark.parametrize("targets,message", [
    ("nothing", "matches no 2-D parameter; the parameters are named like: "),
    ("up/bias", r"matches no 2-D parameter \(it matches up/bias, not 2-D\)"),
    ("(", "is not a valid regex"),
])
def test_bad_targets_are_one_line(targets, message):
  with pytest.raises(ConfigError, match=message) as e:
    engine(1, model=jaxzero.lora(MLP, rank=4, targets=targets))
  assert "\n" not in str(e.value) and str(e.value).startswith("jaxzero.lora: ")


@pytest.mark.parametrize("arguments,message", [
    ({"rank": 0}, r"jaxzero.lora\(rank=0\) must be a positive integer"),
    ({"rank": 2.5}, r"jaxzero.lora\(rank=2.5\) must be a positive integer"),
    ({"rank": 4, "alpha": 0}, r"jaxzero.lora\(alpha=0\) must be a positive number \(PEFT's "
     r"lora_alpha: the adapters are scaled by alpha / rank\)"),
    ({"rank": 4, "alpha": -16.0}, r"jaxzero.lora\(alpha=-16.0\) must be a positive number"),
    ({"rank": 4, "alpha": float("inf")}, r"jaxzero.lora\(alpha=inf\) must be a positive number"),
    ({"rank": 4, "targets": ["up"]}, r"jaxzero.lora\(targets=\['up'\]\) must be a regular "
     "expression"),
])
def test_bad_lora_arguments_are_one_line_at_the_call(arguments, message):
  with pytest.raises(ConfigError, match=f"^{message}"):
    jaxzero.lora(MLP, **arguments)


def test_numpy_scalars_are_lora_arguments_too():
  made = jaxzero.lora(MLP, rank=np.int64(4), alpha=np.float32(16))
  assert (made.rank, made.alpha) == (4, 16.0) and type(made.rank) is int


def test_frozen_weights_in_host_memory_train_the_same(one_device):
  """offload.params=pinned_host: the frozen weights and the adapters' compute copy rest
  in pinned_host, and come to the device whole each step (this model has no stacked
  layers to stream). (On CPU the transfers compile to nothing: this checks the program
  and its values, not the copies.)"""
  e = engine(8, offload=jaxzero.Offload(params="pinned_host"))
  assert {s.memory_kind for s in jax.tree.leaves(e.shardings.frozen)} == {"pinned_host"}
  want_losses, want, _ = one_device
  losses, state, _ = train(e)
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  true_part = jax.tree.map(lambda a, w: a[tuple(slice(0, n) for n in w.shape)], state.master,
                           want.master)  # (stored padded on 8 devices)
  chex.assert_trees_all_close(true_part, want.master, atol=1e-5)


def test_lora_with_offload_is_one_line():
  with pytest.raises(ConfigError, match="frozen parameters \\(jaxzero.lora\\) with "
                     "offload.optimizer=pinned_host, offload.params=device: a model with "
                     "frozen weights keeps its optimizer state") as e:
    engine(1, offload="pinned_host")
  assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_lora_state_saves_and_restores_on_another_mesh(one_device, tmp_path):
  _, want, _ = one_device
  e1 = engine(1)
  state = e1.init(jax.random.key(0))
  for batch in BATCHES:
    state, _ = e1.step(state, batch)
  e1.save(state, tmp_path)
  restored = jax.device_get(engine(2).restore(tmp_path))
  chex.assert_trees_all_equal(restored.frozen, want.frozen)
  chex.assert_trees_all_close(restored.master, want.master, atol=1e-6)
  # Under another alpha the adapters would be scaled otherwise: refused, as jaxzero.train
  # refuses it (the step-4 loss moved from 4.09 to 3.61 at alpha 64).
  other = jaxzero.lora(MLP, rank=4, alpha=64.0, targets=r"(up|down)/kernel")
  with pytest.raises(CheckpointError, match=re.escape(
      "was trained with jaxzero.lora(alpha=8), this model has alpha=64: the adapters would "
      "be scaled otherwise; make it with jaxzero.lora(..., alpha=8)")):
    engine(2, other).restore(tmp_path)
