"""One runner protocol, chosen in one place (jaxzero.runners.choose.make_runner): the
in-memory program, ZeRO-Offload, the NVMe optimizer runner and ZeRO-Infinity train a
user's own model through jaxzero.Engine to the same losses (fp32), and the training loop
asks the same function for its runner."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxzero
from jaxzero import config
from jaxzero.models.interface import Leaf, Model
from jaxzero.runners import base, choose, host, infinity, nvme
from jaxzero.training import loop

from processes import TINY

VOCAB, DIM, LAYERS, STEPS = 64, 16, 2, 3


def scanned_model(layers: int = LAYERS, key: str = "layers") -> Model:
  """A user's model under the engine's own contract: embedding, a stack of residual
  tanh layers (under `key`) scanned through the engine's hook (so it can stream layer by
  layer, or run in pipeline stages), and a head."""
  specs = {"embed": Leaf((VOCAB, DIM), ("vocab", "embed")),
           key: {"w": Leaf((layers, DIM, DIM), ("layers", "embed", "mlp"))},
           "head": Leaf((DIM, VOCAB), ("embed", "vocab"))}

  def init(rng):
    k1, k2, k3 = jax.random.split(rng, 3)
    return {"embed": jax.random.normal(k1, (VOCAB, DIM)) * 0.5,
            key: {"w": jax.random.normal(k2, (layers, DIM, DIM)) * 0.3},
            "head": jax.random.normal(k3, (DIM, VOCAB)) * 0.3}

  def loss(params, tokens, hooks):
    x = hooks.gather(params["embed"], ("vocab", "embed"))[tokens[:, :-1]]

    def layer(h, weights):
      return h + jnp.tanh(h @ hooks.gather(weights["w"], ("embed", "mlp"))), None

    h = hooks.scan(layer, hooks.shard(x, ("batch", "seq", "embed")), params[key])
    logits = h @ hooks.gather(params["head"], ("embed", "vocab"))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return Model(specs=specs, init=init, loss=loss, layers_key=key)


OFFLOADS = {"device": dict(optimizer="device"), "zero_offload": dict(optimizer="pinned_host"),
            "nvme": dict(optimizer="nvme"), "infinity": dict(optimizer="nvme", params="nvme")}
RUNNERS = {"device": base.InMemoryRunner, "zero_offload": host.HostRunner,
           "nvme": nvme.NvmeRunner, "infinity": infinity.InfinityRunner}


def train(offload: str, nvme_dir, model: Model | None = None,
          optimizer: optax.GradientTransformation | None = None, **options
          ) -> tuple[list[float], type]:
  engine = jaxzero.Engine(
      model or scanned_model(), optimizer=optimizer or optax.adamw(1e-2),
      zero=jaxzero.Zero(stage=3), mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]),
      grad_accum=2, workdir=nvme_dir,
      offload=jaxzero.Offload(**OFFLOADS[offload], **options, nvme_dir=str(nvme_dir)))
  tokens = jax.random.randint(jax.random.key(1), (STEPS, 16, 9), 0, VOCAB, jnp.int32)
  state, losses = engine.init(jax.random.key(0)), []
  for batch in tokens:
    state, metrics = engine.step(state, batch)
    losses.append(float(metrics["loss"]))
  engine.runner.close()
  return losses, type(engine.runner)


@pytest.mark.slow
def test_every_runner_trains_a_user_model_through_the_engine_to_the_same_losses(tmp_path):
  reference, kind = train("device", tmp_path)
  assert kind is base.InMemoryRunner
  assert reference[-1] < reference[0]
  for offload in ("zero_offload", "nvme", "infinity"):
    (tmp_path / offload).mkdir()
    losses, kind = train(offload, tmp_path / offload)
    assert kind is RUNNERS[offload], offload
    np.testing.assert_allclose(losses, reference, rtol=1e-6, err_msg=offload)


def _head_apart(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "head" if "head" in jax.tree_util.keystr(path) else "rest", params)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["multi_transform", "bf16_moment", "blocks", "one_layer"])
def test_the_runners_that_stream_the_state_take_what_memory_takes(case, tmp_path):
  """Per-group optimizers (multi_transform, its labels a function), a moment kept in
  bfloat16, a layer stack under another key, a stack of one layer: ZeRO-Offload with
  Twin-Flow and ZeRO-Infinity train them as the in-memory step does (they crashed, or
  kept the moment in float32)."""
  model, optimizer = scanned_model(), None
  if case == "multi_transform":
    optimizer = optax.multi_transform({"rest": optax.adam(1e-2), "head": optax.sgd(0.1)},
                                      _head_apart)
  elif case == "bf16_moment":
    optimizer = optax.adamw(1e-2, mu_dtype=jnp.bfloat16)
  elif case == "blocks":
    model = scanned_model(key="blocks")
  else:
    model = scanned_model(layers=1)
  reference, _ = train("device", tmp_path, model, optimizer)
  for offload, options in (("zero_offload", {"optimizer_fraction": 0.5}), ("infinity", {})):
    (tmp_path / offload).mkdir()
    losses, _ = train(offload, tmp_path / offload, model, optimizer, **options)
    np.testing.assert_allclose(losses, reference, rtol=2e-7, err_msg=offload)


def test_a_mask_given_as_a_tree_is_refused_naming_the_function_form(tmp_path):
  """The box-by-box update runs the optimizer on one weight at a time: a mask tree of
  every weight cannot match it; the same mask as a function can."""
  mask = {"embed": False, "layers": {"w": True}, "head": True}
  with pytest.raises(config.ConfigError, match="a mask= or multi_transform's labels given "
                     "as a tree of the parameters cannot take one weight alone: give them as "
                     "a function of the parameters"):
    jaxzero.Engine(scanned_model(), optimizer=optax.adamw(1e-2, mask=mask),
                   mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]),
                   offload=jaxzero.Offload("pinned_host"))


def test_a_model_without_a_layer_stack_cannot_stream_its_layers(tmp_path):
  model = scanned_model()
  flat = Model(specs=model.specs, init=model.init, loss=model.loss)  # no layers_key
  with pytest.raises(config.ConfigError, match="must declare Model.layers_key"):
    jaxzero.Engine(flat, optimizer=optax.adamw(1e-2), mesh=jaxzero.mesh(fsdp=8),
                   offload=jaxzero.Offload("nvme", params="nvme", nvme_dir=str(tmp_path)))


def test_the_loop_and_the_engine_ask_the_same_chooser(tmp_path, monkeypatch):
  asked = []
  real = choose.make_runner
  monkeypatch.setattr(loop, "make_runner", lambda *a, **k: asked.append("loop") or real(*a, **k))
  cfg = config.load(TINY, ["data.max_bytes=100000", "offload.optimizer=nvme",
                           f"offload.nvme_dir={tmp_path}"])
  run = loop.build(cfg, jax.devices()[:8], tmp_path / "run", progress=False)
  assert asked == ["loop"] and isinstance(run.runner, nvme.NvmeRunner)
  assert run.runner.directory.is_relative_to(tmp_path)
  # Every runner answers the whole protocol.
  for kind in (base.InMemoryRunner, host.HostRunner, nvme.NvmeRunner, infinity.InfinityRunner):
    missing = [m for m in ("check", "init", "compile", "step", "lower", "save", "restore",
                           "plan", "close") if not callable(getattr(kind, m, None))]
    assert not missing, (kind, missing)


def losses_on(mesh, layers=LAYERS, **options) -> list[float]:
  engine = jaxzero.Engine(scanned_model(layers), optimizer=optax.adamw(1e-2),
                          zero=jaxzero.Zero(stage=3), mesh=mesh, grad_accum=4, **options)
  tokens = jax.random.randint(jax.random.key(1), (STEPS, 16, 9), 0, VOCAB, jnp.int32)
  state, losses = engine.init(jax.random.key(0)), []
  for batch in tokens:
    state, metrics = engine.step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.parametrize("layers, mesh, options", [
    (2, dict(fsdp=2, pipeline=2), dict(pipeline=jaxzero.Pipeline("1f1b"))),
    (2, dict(fsdp=2, context=2), dict(context=jaxzero.Context("ring"))),
    pytest.param(4, dict(fsdp=2, pipeline=2), dict(pipeline=jaxzero.Pipeline("interleaved", 2)),
                 marks=pytest.mark.slow),
    pytest.param(2, dict(fsdp=4), dict(precision=jaxzero.Precision(
        "float16", initial_scale_power=8)), marks=pytest.mark.slow)],
    ids=["1f1b", "context_ring", "interleaved", "float16_scaler"])
def test_the_engine_reaches_the_schedules_context_and_precision_options_of_the_command(
    layers, mesh, options):
  """Pipeline schedules, the context axis and its strategy, and the loss scaler's options:
  modes jaxzero.train runs, through jaxzero.Engine, to the losses of fsdp alone (float16
  to its rounding)."""
  want = losses_on(jaxzero.mesh(fsdp=4, devices=jax.devices()[:4]), layers)
  got = losses_on(jaxzero.mesh(**mesh, devices=jax.devices()[:4]), layers, **options)
  np.testing.assert_allclose(got, want, rtol=2e-3 if "precision" in options else 1e-6)


def test_the_engine_checks_its_pipeline_as_the_config_does():
  with pytest.raises(config.ConfigError, match="pipeline.virtual_stages=2 does not divide the 1 "
                                               "layers of each of the mesh.pipeline=2 stages"):
    losses_on(jaxzero.mesh(fsdp=2, pipeline=2, devices=jax.devices()[:4]),
              pipeline=jaxzero.Pipeline("interleaved", 2))

