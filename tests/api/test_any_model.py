"""ZeRO for models that are not Llama: a GPT-2-style Flax NNX model, a small ViT in
Linen and a plain-pytree MLP train for 6 steps at stages 0-3 and HYBRID on 8
devices to one device's losses (fp32), with every leaf placed as the rules say,
the stage-3 state at 16Φ/N, and checkpoints that resume on another stage and mesh."""


import dataclasses
import functools
import gc
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxzero
from jaxzero.errors import CheckpointError, ConfigError, UserError

STEPS = 6
LAYOUTS = {"one": (jaxzero.Zero(stage=0), 1, 1), "stage0": (jaxzero.Zero(stage=0), 1, 8),
           "stage1": (jaxzero.Zero(stage=1), 1, 8), "stage2": (jaxzero.Zero(stage=2), 1, 8),
           "stage3": (jaxzero.Zero(stage=3), 1, 8),
           "hybrid": (jaxzero.Zero(stage=3, hybrid=True), 2, 4)}


# ----------------------------------------------------------------------------- GPT-2 (NNX)


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.ln1, self.ln2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.fc = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.proj = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x):
    causal = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(self.ln1(x), mask=causal)
    return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT2(nnx.Module):
  """Learned positions, LayerNorm, GELU, a head tied to the token embedding."""

  def __init__(self, rngs: nnx.Rngs, vocab=64, dim=32, layers=2, heads=4, seq=16):
    init = nnx.initializers.normal(0.02)
    self.wte = nnx.Param(nnx.with_partitioning(init, ("vocab", "embed"))(rngs.params(),
                                                                          (vocab, dim)))
    self.wpe = nnx.Param(init(rngs.params(), (seq, dim)))
    self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(dim, rngs=rngs)

  def __call__(self, tokens):
    x = self.wte[...][tokens] + self.wpe[...][:tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.ln_f(x) @ self.wte[...].T


def gpt2_loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def gpt2_batches():
  # Counting sequences from random starts: a pattern the model learns in a few steps.
  rng = np.random.default_rng(0)
  return [((rng.integers(0, 64, (16, 1)) + np.arange(17)) % 64).astype(np.int32)
          for _ in range(STEPS)]


# ----------------------------------------------------------------------------- ViT (Linen)


class ViT(nn.Module):
  """Patches of 4x4 pixels, a class token, two pre-norm blocks, a linear head."""
  dim: int = 32
  classes: int = 10

  @nn.compact
  def __call__(self, images):
    b = images.shape[0]
    patches = images.reshape(b, 2, 4, 2, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 4, 48)
    x = nn.Dense(self.dim, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("patch", "embed")))(patches)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, self.dim))
    x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)), x], axis=1)
    x = x + self.param("pos", nn.initializers.normal(0.02), (5, self.dim))
    for _ in range(2):
      x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x))
      x = x + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(nn.LayerNorm()(x))))
    return nn.Dense(self.classes)(nn.LayerNorm()(x[:, 0]))


def vit_loss(apply, batch):
  logits = apply(batch["images"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def vit_batches():
  rng = np.random.default_rng(1)
  return [{"images": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
           "labels": rng.integers(0, 10, (16,), dtype=np.int32)} for _ in range(STEPS)]


# ----------------------------------------------------------------------------- MLP (pytree)


def mlp_init(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (16, 64)) * 0.2, "b1": jnp.zeros((64,)),
          "w2": jax.random.normal(k2, (64, 8)) * 0.2, "b2": jnp.zeros((8,))}


def mlp_apply(params, x):
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def mlp_loss(apply, batch):
  return jnp.mean((apply(batch["x"]) - batch["y"]) ** 2)


def mlp_batches():
  rng = np.random.default_rng(2)
  return [{"x": rng.normal(size=(16, 16)).astype(np.float32),
           "y": rng.normal(size=(16, 8)).astype(np.float32)} for _ in range(STEPS)]


MODELS = {
    "gpt2_nnx": (lambda rngs: GPT2(rngs), gpt2_loss, gpt2_batches, {}),
    "vit_linen": (ViT(), vit_loss, vit_batches,
                  {"init_args": (jnp.zeros((1, 8, 8, 3)),)}),
    "mlp_pytree": ((mlp_init, mlp_apply), mlp_loss, mlp_batches, {}),
}


def engine(name, layout, **kw):
  model, loss_fn, _, extra = MODELS[name]
  zero, replica, fsdp = LAYOUTS[layout]
  mesh = jaxzero.mesh(replica=replica, fsdp=fsdp, devices=jax.devices()[:replica * fsdp])
  return jaxzero.Engine(model, optimizer=optax.adamw(1e-2, weight_decay=0.01), loss_fn=loss_fn,
                        zero=zero, mesh=mesh, grad_accum=2, clip_norm=1.0, min_shard_size=0,
                        **extra, **kw)


def train(name, layout, steps=STEPS, state=None, start=0):
  e = engine(name, layout)
  state = e.init(jax.random.key(0)) if state is None else state
  losses = []
  for batch in MODELS[name][2]()[start:steps]:
    state, metrics = e.step(state, batch)
    losses.append(float(metrics["loss"]))
  return e, state, losses


# The two flax models train for tens of seconds in all; the MLP stays in the fast lane.
NAMES = [pytest.param("gpt2_nnx", marks=pytest.mark.slow),
         pytest.param("vit_linen", marks=pytest.mark.slow), "mlp_pytree"]


@functools.cache
def one_device(name):
  return train(name, "one")[2]


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "one"])
@pytest.mark.parametrize("name", NAMES)
def test_every_stage_and_hybrid_train_as_one_device(name, layout):
  _, state, losses = train(name, layout)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  np.testing.assert_allclose(losses, one_device(name), rtol=1e-5)


OPTIMIZERS = {
    "multi_transform": lambda: optax.multi_transform(
        {"train": optax.adam(1e-2), "freeze": optax.set_to_zero()},
        {"w1": "freeze", "b1": "freeze", "w2": "train", "b2": "train"}),
    "masked": lambda: optax.masked(optax.adam(1e-2), lambda p: {k: v.ndim > 1
                                                                for k, v in p.items()}),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optax_groups_masks_and_factored_statistics_train_as_optax_does(optimizer):
  """optax.multi_transform and masked (MaskedNode where a group leaves a weight out) and
  Adafactor (row and column statistics) at stage 3 on 8 devices: the weights optax itself
  gives on one device. A state leaf of a weight's shape is placed as that weight."""
  mesh = jaxzero.mesh(fsdp=8, devices=jax.devices()[:8])
  e = jaxzero.Engine((mlp_init, mlp_apply), optimizer=OPTIMIZERS[optimizer](),
                     loss_fn=mlp_loss, zero=jaxzero.Zero(stage=3), mesh=mesh, min_shard_size=0)
  state = e.init(jax.random.key(0))
  tx, params = OPTIMIZERS[optimizer](), mlp_init(jax.random.key(0))
  opt_state = tx.init(params)
  for batch in mlp_batches()[:3]:
    state, _ = e.step(state, batch)
    grads = jax.grad(lambda p: mlp_loss(functools.partial(mlp_apply, p), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_close(jax.device_get(state.master), params, atol=1e-6, rtol=1e-5)
  if optimizer == "adafactor":
    factored = e.shardings.opt_state[0]
    assert factored.v_row["w1"].spec == P() and factored.v["b1"].spec != P()


def test_a_pipeline_mesh_needs_a_model_with_stacked_layers():
  model, loss_fn, _, _ = MODELS["mlp_pytree"]
  with pytest.raises(ConfigError, match=r"a mesh with pipeline=2 runs a model's "
                     r"stacked layers in stages: it needs a jaxzero Model that declares "
                     r"layers_key and runs them through hooks.scan; use pipeline=1"):
    jaxzero.Engine(model, optimizer=optax.sgd(0.1), loss_fn=loss_fn, grad_accum=2,
                   mesh=jaxzero.mesh(fsdp=2, pipeline=2, devices=jax.devices()[:4]))


@pytest.mark.parametrize("name", MODELS)
def test_stage3_state_is_16_phi_over_n_and_placed_leaf_by_leaf(name):
  e = engine(name, "stage3")
  plan = e.plan()
  # fp32 compute here: 4 + 4 + 12 = 20 bytes a parameter, all of it over N = 8.
  phi = plan["n_params"]
  assert abs(plan["state_bytes"] - 20 * phi / 8) <= 0.03 * 20 * phi / 8, plan
  for leaf, sharding in zip(jax.tree.leaves(e.program.abstract.master),
                            jax.tree.leaves(e.shardings.master)):
    spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    split = [i for i, axes in enumerate(spec) if axes is not None]
    # A dimension the model named "embed" (GPT-2's wte, the ViT's patch kernel) is the
    # one ZeRO splits; an unnamed leaf is split along its largest dimension.
    annotated = {("gpt2_nnx", (64, 32)), ("vit_linen", (48, 32))}
    divisible = [i for i in range(leaf.ndim) if leaf.shape[i] % 8 == 0]
    want = [1] if (name, leaf.shape) in annotated else (
        [max(divisible, key=lambda i: (leaf.shape[i], -i))] if divisible else [])
    assert split == want, (leaf.shape, spec)  # [] : no dimension divides 8, left whole


def test_the_mlp_leaves_are_where_the_rules_put_them():
  sh = engine("mlp_pytree", "stage3").shardings
  assert sh.master["w1"].spec == P(None, ("replica", "fsdp"))  # its largest dimension
  assert sh.master["w2"].spec == P(("replica", "fsdp"), None)
  assert sh.params["b1"].spec == P(("replica", "fsdp"))
  small = jaxzero.Engine((mlp_init, mlp_apply), optimizer=optax.sgd(0.1), loss_fn=mlp_loss,
                         mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]))
  assert small.shardings.master["w1"].spec == P()  # under DeepSpeed's 1e5-element threshold
  # The plan says so, from the shardings: all four parameters, the whole state but the
  # optimizer's step count.
  plan = small.plan()
  assert (plan["whole_leaves"], plan["whole_why"]) == (
      4, "under zero.min_shard_size=100,000 elements")
  assert 0 <= plan["state_bytes"] - plan["whole_bytes"] <= 8


@pytest.mark.slow
def test_an_nnx_checkpoint_resumes_on_another_stage_and_mesh(tmp_path):
  e3, state, first = train("gpt2_nnx", "stage3", steps=3)
  e3.save(state, tmp_path)
  hybrid = engine("gpt2_nnx", "hybrid")
  restored = hybrid.restore(tmp_path)
  assert int(restored.step) == 3
  _, _, rest = train("gpt2_nnx", "hybrid", state=restored, start=3)
  np.testing.assert_allclose(first + rest, one_device("gpt2_nnx"), rtol=1e-5)


def test_a_checkpoint_of_another_precision_restores_with_the_compute_copy_from_the_masters(
    tmp_path):
  """Saved in bfloat16, restored by a float32 (or float16) engine: verified against its
  checksums as saved, then the compute copy cast from the float32 masters, as a step makes
  it (not the bfloat16 copy cast up); a float16 engine's loss scaler starts afresh."""
  saved = engine("mlp_pytree", "stage3", precision="bfloat16")
  state = saved.init(jax.random.key(0))
  for batch in mlp_batches()[:2]:
    state, _ = saved.step(state, batch)
  saved.save(state, tmp_path)
  for precision, dtype in [("float32", jnp.float32), ("float16", jnp.float16)]:
    restored = engine("mlp_pytree", "stage1", precision=precision).restore(tmp_path)
    assert int(restored.step) == 2
    chex.assert_trees_all_equal(restored.master, state.master)
    chex.assert_trees_all_equal(restored.params,
                                jax.tree.map(lambda w: w.astype(dtype), state.master))
    assert bool(jax.tree.leaves(restored.loss_scale)) == (precision == "float16")


@pytest.mark.parametrize("name", ["gpt2_nnx", "mlp_pytree"])
def test_a_remat_policy_without_a_block_is_refused_for_a_model_without_declared_layers(name):
  """The policy applies where the engine scans a model's declared layers; a model of one's
  own has none, so remat="full" alone checkpointed nothing (the same program as "none")."""
  with pytest.raises(ConfigError, match=re.escape(
      "remat='full' checkpoints the layers of a model that declares them (a jaxzero Model's "
      "layers_key); for this model name its block: remat=jaxzero.Remat('full', "
      "block=MyBlock)")):
    engine(name, "stage3", remat="full")
  engine(name, "stage3", remat="none")


@pytest.mark.slow
def test_remat_of_the_models_own_block_class_changes_no_loss():
  plain = train("gpt2_nnx", "stage3", steps=3)[2]
  e = engine("gpt2_nnx", "stage3", remat=jaxzero.Remat("full", block=Block))
  state, remat = e.init(jax.random.key(0)), []
  for batch in gpt2_batches()[:3]:
    state, metrics = e.step(state, batch)
    remat.append(float(metrics["loss"]))
  np.testing.assert_allclose(remat, plain, rtol=1e-6)
  batch = e._micro_batches(gpt2_batches()[0])  # pylint: disable=protected-access
  jaxpr = str(e.program.train_step.trace(e.program.abstract_state(), batch).jaxpr)
  assert jaxpr.count("remat2[") == 2  # one per Block call: the blocks are recomputed


class MLPBlock(nnx.Module):
  def __init__(self, rngs):
    self.up, self.down = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jnp.tanh(self.up(x)))


class BlockNet(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([MLPBlock(rngs) for _ in range(2)])
    self.head = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def test_each_remat_policy_of_a_block_of_ones_own_keeps_what_it_says():
  """A block of one's own names no activations: "none" leaves it as it is, "save_matmuls"
  keeps its projections' outputs (the backward recomputes the tanh only) and "full"
  recomputes it all (both projections' dots again); "save_attention" needs names."""
  loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  mesh = jaxzero.mesh(fsdp=8, devices=jax.devices()[:8])
  found = {}
  for policy in ("none", "save_matmuls", "full"):
    e = jaxzero.Engine(BlockNet, optimizer=optax.sgd(0.1), loss_fn=loss, mesh=mesh,
                       remat=jaxzero.Remat(policy, block=MLPBlock))
    batch = e._micro_batches(mlp_batches()[0])  # pylint: disable=protected-access
    jaxpr = str(e.program.train_step.trace(e.program.abstract_state(), batch).jaxpr)
    found[policy] = (jaxpr.count("remat2["), jaxpr.count("tanh"), jaxpr.count("dot_general"))
  assert found["none"] == (0, 2, 14)
  assert found["save_matmuls"] == (2, 4, 14)  # the tanh again, no dot again
  assert found["full"] == (2, 4, 16)  # and the up projection's dot (down's input is saved)
  with pytest.raises(ConfigError, match=re.escape(
      "remat.policy='save_attention' keeps activations by the names the built-in models give "
      "them, which a block of one's own lacks; for a block choose one of: none, full, "
      "save_matmuls, offload_matmuls")):
    jaxzero.Engine(BlockNet, optimizer=optax.sgd(0.1), loss_fn=loss, mesh=mesh,
                   remat=jaxzero.Remat("save_attention", block=MLPBlock))


def test_the_nvme_tiers_files_go_when_the_engine_is_closed_left_or_collected(tmp_path):
  """As jaxzero.train deletes them at its end: an engine's store (the optimizer state's
  size) is deleted by close(), at the end of a with block, or when the engine is gone."""
  def files(d):
    return [p for p in d.rglob("*") if p.is_file()]

  def trained(d):
    d.mkdir()
    e = engine("mlp_pytree", "stage3", offload=jaxzero.Offload("nvme", nvme_dir=str(d)))
    e.step(e.init(jax.random.key(0)), mlp_batches()[0])
    assert files(d)
    return e

  e = trained(tmp_path / "closed")
  e.close()
  assert not files(tmp_path / "closed")
  with pytest.raises(UserError, match=re.escape(
      "this jaxzero.Engine was closed (close(), or the end of its with block); make another "
      "to train on")):
    e.init(jax.random.key(0))
  with trained(tmp_path / "with"):
    pass
  assert not files(tmp_path / "with")
  e = trained(tmp_path / "collected")
  del e
  gc.collect()
  assert not files(tmp_path / "collected")


@pytest.mark.parametrize("offload", [
    pytest.param(jaxzero.Offload("pinned_host"), marks=pytest.mark.slow),
    jaxzero.Offload("pinned_host", delayed_update=True, delayed_update_after=0),
    jaxzero.Offload("nvme")], ids=["host", "dpu", "nvme"])
def test_an_offloaded_engine_refuses_a_state_a_later_init_replaced(offload, tmp_path):
  """Its optimizer state lives in the engine's one store: a second init replaces it, and
  stepping or saving the first state then read another state's copies (a raw KeyError on
  the host, a closed thread pool on NVMe). One line instead; the latest state steps from
  its own weights, not from the replaced state's update still in flight (DPU)."""
  if offload.optimizer == "nvme":
    offload = dataclasses.replace(offload, nvme_dir=str(tmp_path))
  e = engine("mlp_pytree", "stage3", offload=offload)
  first, _ = e.step(e.init(jax.random.key(0)), mlp_batches()[0])  # (DPU: its update in flight)
  latest = e.init(jax.random.key(1))
  own = jax.device_get(latest.params)
  for use in (lambda: e.step(first, mlp_batches()[1]), lambda: e.save(first, tmp_path / "ck")):
    with pytest.raises(UserError, match="this state's optimizer state was in files a later "
                                        "init or restore of the same engine replaced"):
      use()
  assert not (tmp_path / "ck" / "checkpoints" / "1").exists()
  stepped, _ = e.step(latest, mlp_batches()[0])
  if offload.delayed_update:  # the weights after the last update: none yet, its own
    chex.assert_trees_all_equal(jax.device_get(stepped.params), own)
  e.close()


@pytest.mark.parametrize("option, message", [
    (dict(grad_accum=0), "grad_accum=0 must be at least 1"),
    (dict(grad_accum=-1), "grad_accum=-1 must be at least 1"),
    (dict(grad_accum=2.0), "train.grad_accum=2.0 must be an int"),
    (dict(clip_norm=-1.0), "clip_norm=-1.0 must be at least 0"),
    (dict(clip_norm=float("nan")), "train.clip_norm=nan must be a finite number"),
    (dict(min_shard_size=-5), "min_shard_size=-5 must be at least 0"),
    (dict(precision=jaxzero.Precision("float16", hysteresis=0)),
     "precision.loss_scale_window=1000 and precision.hysteresis=0 must be at least 1"),
    (dict(precision=jaxzero.Precision(initial_scale_power=8)),
     "Precision(compute='bfloat16') with loss-scaler settings: they apply to "
     "compute='float16' only"),
    (dict(precision=jaxzero.Precision("bfloat16", matmul="fp8")),
     "Precision(matmul='fp8') sets the built-in models' projections"),
    (dict(mesh=jaxzero.mesh(fsdp=4, context=2, devices=jax.devices()[:8])),
     "a mesh with context=2 splits the sequence of a model that shards its activations "
     "through the engine's hooks"),
    (dict(optimizer=optax.adamw), "is not an optax optimizer: give one made, e.g. "
     "optax.adamw(3e-4), not the function optax.adamw"),
    (dict(optimizer=None), "optimizer=None is not an optax optimizer"),
    (dict(zero=3), "zero=3: give jaxzero.Zero(stage=...)"),
    (dict(mesh=8), "mesh=8: give jaxzero.mesh(fsdp=..., ...) or a jax.sharding.Mesh"),
    (dict(model=(lambda k: {"w": jnp.ones(3), "n": jnp.arange(3)}, lambda p, x: x)),
     "parameter ['n'] is int32: jaxzero trains floating-point parameters")])
def test_bad_engine_arguments_are_one_line_before_anything_is_built(option, message):
  """As jaxzero.train refuses them in its config (grad_accum=0 was a ZeroDivisionError at
  the first step; a negative clip_norm or min_shard_size passed silently; an integer
  parameter was trained as a float; optimizer=None trained with the config's AdamW)."""
  option = {"mesh": jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]),
            "optimizer": optax.sgd(0.1), "model": (mlp_init, mlp_apply), **option}
  with pytest.raises(ConfigError, match=re.escape(message)):
    jaxzero.Engine(option.pop("model"), loss_fn=mlp_loss, **option)


@pytest.mark.parametrize("loss_fn, message", [
    (lambda apply, b: (mlp_loss(apply, b), 0.0), "loss_fn returned a tuple; it returns the "
     "scalar mean loss alone"),
    (lambda apply, b: (apply(b["x"]) - b["y"]) ** 2, "loss_fn returned an array of shape "
     "(16, 8); it returns the scalar mean loss")])
def test_a_loss_that_is_not_one_scalar_is_one_line(loss_fn, message):
  e = jaxzero.Engine((mlp_init, mlp_apply), optimizer=optax.sgd(0.1), loss_fn=loss_fn,
                     mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]))
  with pytest.raises(ConfigError, match=re.escape(message)):
    e.step(e.init(jax.random.key(0)), mlp_batches()[0])


def test_misused_calls_are_one_line(tmp_path):
  with pytest.raises(ConfigError, match=re.escape("needs loss_fn=(model, batch) -> mean loss, "
                                                  "a function (not 3)")):
    jaxzero.Engine((mlp_init, mlp_apply), optimizer=optax.sgd(0.1), loss_fn=3,
                   mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]))
  e = jaxzero.Engine((mlp_init, mlp_apply), optimizer=optax.sgd(0.1), loss_fn=mlp_loss,
                     mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]))
  with pytest.raises(UserError, match=re.escape("init(rng=0): give a jax.random.key(seed)")):
    e.init(0)
  batch = mlp_batches()[0]
  with pytest.raises(UserError, match=re.escape("step(state=None, ...): pass the state")):
    e.step(None, batch)
  state = e.init(jax.random.PRNGKey(0))  # a raw key too
  with pytest.raises(ConfigError, match="a batch leaf is a scalar"):
    e.step(state, {**batch, "w": 1.0})
  with pytest.raises(ConfigError, match=re.escape("the batch's leaves have [8, 16] rows")):
    e.step(state, {**batch, "y": batch["y"][:8]})
  (tmp_path / "file").write_text("")
  with pytest.raises(UserError, match="file is a file: checkpoints are saved under a directory"):
    e.save(state, tmp_path / "file")
  e.step(state, batch)  # consumes `state` (on 8 devices, running it again crashed JAX)
  with pytest.raises(UserError, match=re.escape("this state was consumed by an earlier step")):
    e.step(state, batch)


def test_a_bfloat16_init_trains_fp32_masters():
  """A model of one's own that draws its parameters in bf16 gets fp32 masters, and
  trains as its fp32 cast does (the step failed: the state was declared fp32)."""
  half = lambda key: jax.tree.map(lambda w: w.astype(jnp.bfloat16), mlp_init(key))
  mesh = jaxzero.mesh(fsdp=8, devices=jax.devices()[:8])
  states = []
  for init in (half, lambda key: jax.tree.map(lambda w: w.astype(jnp.float32), half(key))):
    e = jaxzero.Engine((init, mlp_apply), optimizer=optax.adam(1e-3), loss_fn=mlp_loss,
                       mesh=mesh)
    state = e.init(jax.random.key(0))
    assert {w.dtype for w in jax.tree.leaves(state.master)} == {jnp.dtype(jnp.float32)}
    state, _ = e.step(state, mlp_batches()[0])
    states.append(jax.device_get(state.master))
  chex.assert_trees_all_equal(*states)


def test_an_nnx_model_that_changes_its_own_state_is_one_line():
  class Dropped(nnx.Module):
    def __init__(self, rngs):
      self.linear, self.drop = nnx.Linear(16, 8, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.linear(x))

  class Normed(nnx.Module):
    def __init__(self, rngs, frozen=False):
      self.linear = nnx.Linear(16, 8, rngs=rngs)
      self.norm = nnx.BatchNorm(8, use_running_average=frozen, rngs=rngs)

    def __call__(self, x):
      return self.norm(self.linear(x))

  loss = lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2)
  mesh = jaxzero.mesh(fsdp=8, devices=jax.devices()[:8])
  for model, name in ((Dropped, "Dropped"), (Normed, "Normed")):
    e = jaxzero.Engine(model, optimizer=optax.sgd(0.1), loss_fn=loss, mesh=mesh)
    with pytest.raises(ConfigError, match=re.escape(
        f"model {name} changes its own state in training (a Dropout or other nnx.Rngs draw, "
        "or BatchNorm's running statistics)")):
      e.step(e.init(jax.random.key(0)), mlp_batches()[0])
  # Frozen statistics (fine-tuning a pretrained model) train.
  e = jaxzero.Engine(lambda rngs: Normed(rngs, frozen=True), optimizer=optax.sgd(0.1),
                     loss_fn=loss, mesh=mesh)
  state = e.init(jax.random.key(0))
  losses = []
  for batch in mlp_batches()[:3]:
    state, metrics = e.step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]


def test_restore_only_reads_and_names_the_steps_there_are(tmp_path):
  e = engine("mlp_pytree", "stage3")
  with pytest.raises(ConfigError, match=re.escape(f"no checkpoint under {tmp_path / 'typo'}")):
    e.restore(tmp_path / "typo")
  assert not (tmp_path / "typo").exists()
  e.save(e.init(jax.random.key(0)), tmp_path / "ck")
  with pytest.raises(CheckpointError, match=re.escape(
      f"no checkpoint at step 99 under {tmp_path / 'ck'}; available steps: 0")):
    e.restore(tmp_path / "ck", step=99)
  assert int(e.restore(tmp_path / "ck", step=0).step) == 0


@pytest.mark.parametrize("offload", ["pinned_host", "nvme"])
def test_an_optimizer_that_reduces_over_a_weight_is_refused_where_the_update_goes_by_box(
    offload, tmp_path):
  """Offloaded, the update runs a box of a weight at a time: global-norm clipping would
  compute its norm per box and train otherwise than in memory (seen: losses apart from the
  second step). Refused in one line before anything is allocated; AdamW with a mask is not
  (tests/offload/test_nvme.py probes more)."""
  where = jaxzero.Offload(offload, nvme_dir=str(tmp_path) if offload == "nvme" else "")
  mesh = jaxzero.mesh(fsdp=8, devices=jax.devices()[:8])
  make = lambda optimizer: jaxzero.Engine((mlp_init, mlp_apply), optimizer=optimizer,
                                          loss_fn=mlp_loss, mesh=mesh, offload=where)
  with pytest.raises(ConfigError, match=re.escape(
      f"offload.optimizer={offload} updates each weight a box at a time, and this optimizer "
      "cannot be: its updates of a box of a weight are not that box of its updates of the "
      "whole model")):
    make(optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0)))
  decay_matrices = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  make(optax.adamw(1e-2, weight_decay=0.1, mask=decay_matrices)).close()


@pytest.mark.parametrize("offload", [pytest.param("pinned_host", marks=pytest.mark.slow), "nvme"])
def test_the_optimizer_state_of_any_pytree_offloads(offload, tmp_path):
  _, in_memory, kept = train("mlp_pytree", "stage3", steps=3)
  def where(name):
    (tmp_path / name).mkdir()
    return jaxzero.Offload(offload, nvme_dir=str(tmp_path / name) if offload == "nvme" else "")
  e = engine("mlp_pytree", "stage3", offload=where("nvme"))
  state, got = e.init(jax.random.key(0)), []
  for batch in mlp_batches()[:3]:
    state, metrics = e.step(state, batch)
    got.append(float(metrics["loss"]))
  np.testing.assert_allclose(got, kept, rtol=1e-6)
  # The learning rate is the optimizer's own: not reported (it was the config's schedule).
  assert "lr" not in metrics
  if offload == "pinned_host":  # the host runner's store holds the state
    assert e.runner.store.host_bytes == 12 * e.program.n_params
  else:
    assert e.runner.store is not None and list(tmp_path.rglob("*"))  # the state is in files
  # Its checkpoint holds the master weights and moments, and resumes in memory or offloaded.
  e.save(state, tmp_path / "ck")
  for other in (engine("mlp_pytree", "stage3"),
                engine("mlp_pytree", "hybrid", offload=where("nvme_hybrid"))):
    restored = other.restore(tmp_path / "ck")
    if other.cfg.offload.optimizer == "device":
      chex.assert_trees_all_close(jax.device_get(restored.master),
                                  jax.device_get(in_memory.master), atol=1e-6)
    restored, metrics = other.step(restored, mlp_batches()[3])
    assert np.isfinite(float(metrics["loss"]))


def test_engine_save_keeps_every_save_and_overwrites_none(tmp_path):
  """As DeepSpeed's save_checkpoint: a fourth save prunes nothing; a step already saved
  under the path is refused, its checkpoint left as it was."""
  e = engine("mlp_pytree", "stage3")
  state = e.init(jax.random.key(0))
  for step in range(1, 5):
    e.save(state._replace(step=jnp.asarray(step, jnp.int32)), tmp_path)
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [1, 2, 3, 4]
  before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
  from jaxzero.errors import CheckpointError
  with pytest.raises(CheckpointError, match="already holds a checkpoint at step 4"):
    e.save(state._replace(step=jnp.asarray(4, jnp.int32)), tmp_path)
  assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns)
                for p in tmp_path.rglob("*")) == before
  assert int(e.restore(tmp_path).step) == 4


# ----------------------------------------------------------------------------- every dimension prime


class Prime(nnx.Module):
  """331 x 997 linears and a prime vocabulary: no dimension divides any device count."""

  def __init__(self, rngs: nnx.Rngs, vocab=503):
    self.emb = nnx.Embed(vocab, 331, rngs=rngs)
    self.up = nnx.Linear(331, 997, rngs=rngs)
    self.down = nnx.Linear(997, 331, rngs=rngs)
    self.out = nnx.Linear(331, vocab, rngs=rngs)

  def __call__(self, tokens):
    h = self.emb(tokens)
    return self.out(h + self.down(jax.nn.gelu(self.up(h))))


def prime_batches():
  rng = np.random.default_rng(3)
  return [rng.integers(0, 503, (16, 17)).astype(np.int32) for _ in range(3)]


PRIME_LAYOUTS = {**LAYOUTS, "five": (jaxzero.Zero(stage=1), 1, 5)}


def prime_engine(layout, vocab=503):
  zero, replica, fsdp = PRIME_LAYOUTS[layout]
  return jaxzero.Engine(lambda rngs: Prime(rngs, vocab), loss_fn=gpt2_loss,
                        optimizer=optax.adamw(1e-3, weight_decay=0.1), zero=zero,
                        mesh=jaxzero.mesh(replica=replica, fsdp=fsdp,
                                          devices=jax.devices()[:replica * fsdp]),
                        clip_norm=1.0, min_shard_size=0)


def prime_train(layout, state=None, start=0):
  e = prime_engine(layout)
  state = e.init(jax.random.key(0)) if state is None else state
  losses = []
  for batch in prime_batches()[start:]:
    state, metrics = e.step(state, batch)
    losses.append(float(metrics["loss"]))
  return e, state, losses


@functools.cache
def prime_one_device():
  e, state, losses = prime_train("one")
  return losses, e.program.padding.unpad(jax.device_get(state.master))


@pytest.mark.parametrize("layout", [pytest.param("stage1", marks=pytest.mark.slow),
                                    pytest.param("stage2", marks=pytest.mark.slow),
                                    "stage3", "hybrid"])
def test_a_prime_shaped_model_shards_every_leaf_and_trains_as_one_device(layout):
  e, state, losses = prime_train(layout)
  padding = e.program.padding.padded_leaves()
  # Every leaf is split over the data axes, stored padded where it wastes least.
  assert padding["['emb']['embedding']"] == ((503, 331), (504, 331))
  assert padding["['up']['kernel']"] == ((331, 997), (331, 1000))
  for sharding in jax.tree.leaves(e.shardings.master):
    assert any(axes is not None for axes in sharding.spec), sharding
  assert e.plan()["whole_leaves"] == 0
  # The padding never reaches the loss or the weights: the same as one device, and
  # still zero after three steps.
  want_losses, want = prime_one_device()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  got = jax.device_get(state.master)
  chex.assert_trees_all_close(e.program.padding.unpad(got), want, atol=1e-5)
  assert np.all(got["emb"]["embedding"][503:] == 0) and np.all(got["up"]["kernel"][:, 997:] == 0)


def test_a_prime_shaped_models_stage3_state_is_16_phi_over_n_with_gpt2s_vocabulary():
  plan = prime_engine("stage3", vocab=50_257).plan()
  phi = plan["n_params"]
  assert phi == 2 * 50_257 * 331 + 50_257 + 2 * 331 * 997 + 997 + 331
  # fp32 compute: 4 + 4 + 12 bytes a parameter, over 8 devices, padding included.
  assert plan["theory_formula"] == "20Φ/N"
  assert abs(plan["state_bytes"] - 20 * phi / 8) <= 0.03 * 20 * phi / 8, plan
  # bf16 compute and gradients: the paper's 2 + 2 + 12.
  bf16 = jaxzero.Engine(lambda rngs: Prime(rngs, 50_257), loss_fn=gpt2_loss,
                        optimizer=optax.adamw(1e-3), precision="bfloat16",
                        zero=jaxzero.Zero(stage=3, grad_dtype="bfloat16"),
                        mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]),
                        min_shard_size=0).plan()
  assert bf16["theory_formula"] == "16Φ/N" and bf16["whole_leaves"] == 0
  assert abs(bf16["state_bytes"] - 16 * phi / 8) <= 0.03 * 16 * phi / 8, bf16


@pytest.mark.slow  # three engines compile
def test_a_prime_checkpoint_restores_on_a_mesh_that_pads_otherwise_and_on_one_device(tmp_path):
  e, state, first = prime_train("stage3")  # 8 devices: 503 -> 504, 331 -> 336
  e.save(state, tmp_path)
  saved = e.program.padding.unpad(jax.device_get(state.master))
  for layout in ("five", "one"):  # stage 1 on 5 devices (503 -> 505, 331 -> 335); one device
    other = prime_engine(layout)
    restored = other.restore(tmp_path)  # checksums over the true shapes verify
    assert int(restored.step) == 3
    chex.assert_trees_all_equal(other.program.padding.unpad(jax.device_get(restored.master)),
                                saved)
  assert other.program.padding.padded_leaves() == {}


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["nvme"])  # the host runner saves the same item
def test_an_offloaded_prime_checkpoint_restores_wherever_the_padding_differs(offload, tmp_path):
  """The NVMe and host runners keep padded leaves in boxes: their checkpoints verify and
  restore in memory on 5 devices (other padding) and offloaded on one (none)."""
  def offloaded(layout, name):
    zero, replica, fsdp = PRIME_LAYOUTS[layout]
    (tmp_path / name).mkdir()
    return jaxzero.Engine(
        lambda rngs: Prime(rngs), loss_fn=gpt2_loss, optimizer=optax.adamw(1e-3, weight_decay=0.1),
        zero=zero, mesh=jaxzero.mesh(replica=replica, fsdp=fsdp,
                                     devices=jax.devices()[:replica * fsdp]),
        clip_norm=1.0, min_shard_size=0,
        offload=jaxzero.Offload(offload, nvme_dir=str(tmp_path / name) if offload == "nvme"
                                else ""))
  e = offloaded("stage3", "saved")
  state = e.init(jax.random.key(0))
  for batch in prime_batches():
    state, _ = e.step(state, batch)
  e.save(state, tmp_path / "ck")
  in_memory = prime_engine("five").restore(tmp_path / "ck")  # checksums over true shapes
  chex.assert_trees_all_close(prime_engine("five").program.padding.unpad(
      jax.device_get(in_memory.master)), prime_one_device()[1], atol=1e-5)
  one = offloaded("one", "one")
  restored, metrics = one.step(one.restore(tmp_path / "ck"), prime_batches()[0])
  plain = prime_engine("one")
  _, want = plain.step(plain.restore(tmp_path / "ck"), prime_batches()[0])
  np.testing.assert_allclose(float(metrics["loss"]), float(want["loss"]), rtol=1e-6)


def test_a_state_that_cannot_fit_is_one_line_before_anything_is_allocated(monkeypatch):
  """A 2e10-parameter linear layer's state (400 GB at 20 bytes a parameter with Adam's) on
  a 32 GB host: refused as jaxzero.train refuses it; force=True constructs it (nothing is
  allocated until init)."""
  from jaxzero.planning import memory_check
  from jaxzero.planning.memory_check import DoesNotFitError
  monkeypatch.setattr(memory_check, "host_memory_bytes", lambda: 32 * 10**9)
  init = lambda key: {"w": jnp.zeros((200_000, 100_000))}
  model = (init, lambda p, x: x @ p["w"])
  loss = lambda m, batch: jnp.mean(m(batch) ** 2)
  mesh = jaxzero.mesh(fsdp=1, devices=jax.devices()[:1])
  with pytest.raises(DoesNotFitError, match=r"^this run needs about 400.0 GB per device \(model "
                     r"state 400.0 GB \+ activations not estimated\).*; force=True constructs"):
    jaxzero.Engine(model, optimizer=optax.adam(1e-3), loss_fn=loss, mesh=mesh)
  engine = jaxzero.Engine(model, optimizer=optax.adam(1e-3), loss_fn=loss, mesh=mesh, force=True)
  assert engine.plan()["state_bytes"] == pytest.approx(400e9, rel=1e-6)


def test_a_checkpoint_restores_with_clipping_turned_on_or_off(tmp_path):
  """Global-norm clipping keeps no state (as in DeepSpeed and torch, gradient_clipping may
  change on resume): a state saved with clip_norm=1 restores under 0 and back, every
  optimizer leaf as saved."""
  mesh = jaxzero.mesh(fsdp=8, devices=jax.devices()[:8])
  make = lambda clip: jaxzero.Engine((mlp_init, mlp_apply), optimizer=optax.adam(1e-2),
                                     loss_fn=mlp_loss, mesh=mesh, clip_norm=clip)
  clipped, plain = make(1.0), make(0.0)
  state, _ = clipped.step(clipped.init(jax.random.key(0)), mlp_batches()[0])
  saved = jax.device_get(state)
  clipped.save(state, tmp_path / "a")
  restored = plain.restore(tmp_path / "a")
  chex.assert_trees_all_equal(jax.device_get(restored.opt_state), saved.opt_state[1])
  chex.assert_trees_all_equal(jax.device_get(restored.master), saved.master)
  state, _ = plain.step(restored, mlp_batches()[1])
  plain.save(state, tmp_path / "b")
  back = clipped.restore(tmp_path / "b")
  chex.assert_trees_all_equal(jax.device_get(back.opt_state[1]),
                              jax.device_get(state.opt_state))


def test_an_optimizer_that_reads_a_weight_s_shape_is_warned_of_padding(caplog):
  """Adafactor scales by a weight's RMS, and a padded weight's zeros lower it: its updates
  differ a little from one device's (~1e-3 in 4 steps); an elementwise optimizer's do not."""
  from jaxzero.engine import padding_changes_updates
  assert padding_changes_updates(optax.adafactor(1e-2))
  assert not padding_changes_updates(optax.adamw(1e-2, weight_decay=0.1))

  def prime_init(key):
    return {"w": jax.random.normal(key, (13, 29)) * 0.2}
  mesh = jaxzero.mesh(fsdp=8, devices=jax.devices()[:8])
  for optimizer, warned in ((optax.adafactor(1e-2), True), (optax.adamw(1e-2), False)):
    caplog.clear()
    jaxzero.Engine((prime_init, lambda p, x: x @ p["w"]), optimizer=optimizer,
                   loss_fn=lambda apply, batch: jnp.mean(apply(batch) ** 2), mesh=mesh,
                   min_shard_size=0)
    said = [r.getMessage() for r in caplog.records if "stored padded" in r.getMessage()]
    assert bool(said) == warned, said


def test_a_model_with_dropout_and_optimizer_offload_is_one_line_before_its_state():
  """A Model that draws randomness per row trains through the device step only: refused
  as the engine is made, naming offload (it was a ValueError at the first step)."""
  from jaxzero.api import adapters  # pylint: disable=import-outside-toplevel
  model = dataclasses.replace(adapters.build((mlp_init, mlp_apply), mlp_loss, shard_size=8),
                              keyed_rows=True)
  with pytest.raises(ConfigError, match=re.escape(
      "(Model.keyed_rows: dropout) with offload.optimizer=pinned_host, offload.params=device: "
      "it trains with its optimizer state on the device")):
    jaxzero.Engine(model, optimizer=optax.sgd(0.1), offload="pinned_host",
                   mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]))


def test_a_batch_wider_than_the_compute_dtype_is_warned_of_once(caplog):
  """Against float32 inputs JAX promotes bfloat16 weights: the matmuls would run in
  float32, unseen. Said once, naming the leaves; not for a batch cast where it matters
  (its inputs in bfloat16, its targets in float32)."""
  e = jaxzero.Engine((mlp_init, mlp_apply), optimizer=optax.sgd(0.1), loss_fn=mlp_loss,
                     mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]), precision="bfloat16")
  batch = mlp_batches()[0]
  state = e.init(jax.random.key(0))
  half = {"x": batch["x"].astype(jnp.bfloat16), "y": batch["y"]}
  state, _ = e.step(state, half)
  assert "wider than precision" not in caplog.text
  for _ in range(2):
    state, _ = e.step(state, batch)
  said = [r.getMessage() for r in caplog.records if "wider than precision" in r.getMessage()]
  assert said == ["the batch's leaves ['x'] (float32), ['y'] (float32) are wider than "
                  "precision=bfloat16: a weight that meets one is promoted, and that matmul "
                  "runs in the wider dtype (unless the model casts its inputs); give the "
                  "model's inputs in bfloat16 (as FSDP2's cast_forward_inputs does) to compute "
                  "in it"]
