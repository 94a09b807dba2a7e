"""LoRA: the base frozen (no gradient, no optimizer state, unchanged by steps), the
adapters trained the same on every mesh and stage, step 0 the base model, a trained
adapter that PEFT loads to the same logits, and bad settings as one line."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero import engine as engine_lib
from jaxzero import export
from jaxzero.api.adapters import model_for
from jaxzero.checkpoint import checkpointer as checkpoint_lib
from jaxzero.errors import ConfigError, HFCheckpointError
from jaxzero.hf import export as hf_export
from jaxzero.hf import load as hf_load
from jaxzero.hf import peft as hf_peft
from jaxzero.models import lora as lora_lib
from jaxzero.models import trainable
from jaxzero.models.llama import decoder_forward
from jaxzero.parallel import mesh
from jaxzero.parallel.zero import Layout

from hf_reference import random_hf_model
from tiny import tiny_config

TARGETS = tuple(lora_lib.TARGETS)


def lora_config(**changes) -> config.Config:
  """The tiny float32 model with rank-4 LoRA on every projection, adapters sharded
  (min_shard_size 0), two micro-steps a step (the per-layer accumulation)."""
  c = tiny_config(3, "stop")
  c = dataclasses.replace(c, lora=config.LoraConfig(rank=4, alpha=8.0),
                          zero=dataclasses.replace(c.zero, min_shard_size=0),
                          train=dataclasses.replace(c.train, grad_accum=2, lr=1e-2))
  return dataclasses.replace(c, **changes)


def program(cfg: config.Config, model=None) -> engine_lib.TrainProgram:
  config.validate(cfg)
  devices = jax.devices()[:mesh.devices_needed(cfg.mesh)]
  layout = Layout.from_config(cfg, mesh.mesh_for(cfg.mesh, devices))
  return engine_lib.TrainProgram(cfg, layout, model or model_for(cfg, layout.shard_size))


TOKENS = np.random.default_rng(0).integers(0, 256, (3, 2, 8, 17), dtype=np.int32)


def train(cfg: config.Config, steps: int = 3):
  """(losses, the final state on the host, the initial state on the host)."""
  p = program(cfg)
  state = p.init()
  first = jax.device_get(state)
  losses = []
  for tokens in TOKENS[:steps]:
    state, metrics = p.train_step(state, jax.device_put(tokens, p.batch_sharding))
    losses.append(float(metrics["loss"]))
  return np.array(losses), jax.device_get(state), first


@pytest.fixture(scope="module")
def one_device():
  return train(lora_config(mesh=config.MeshConfig(fsdp=1)))


def test_the_base_is_frozen_and_only_the_adapters_have_state(one_device):
  losses, state, first = one_device
  assert losses[-1] < losses[0]  # the adapters learn
  # Trained: the adapters alone, with AdamW moments of their shapes.
  assert set(state.master) == {"layers"}
  assert set(state.master["layers"]) == {lora_lib.adapter_key(t, w) for t in TARGETS
                                         for w in "ab"}
  adam = state.opt_state[1][0]
  chex.assert_trees_all_equal_shapes(adam.mu, state.master)
  chex.assert_trees_all_equal_shapes(adam.nu, state.master)
  # Frozen: the whole base, unchanged bit for bit after three steps.
  assert set(state.frozen) == set(first.frozen) == {"embed_VxD", "layers", "final_norm",
                                                    "lm_head_DxV"}
  chex.assert_trees_all_equal(state.frozen, first.frozen)
  # B starts at zero, and has moved.
  assert not np.any(first.master["layers"]["lora_q_b"])
  assert np.any(state.master["layers"]["lora_q_b"])


@pytest.mark.parametrize("name,changes", [
    ("stage 3 on 8", {}),
    pytest.param("stage 1 on 8", {"zero": config.ZeroConfig(stage=1, min_shard_size=0)},
                 marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_lora_on_eight_devices_equals_one_device(one_device, name, changes):
  want_losses, want, _ = one_device
  losses, state, _ = train(lora_config(**changes))
  np.testing.assert_allclose(losses, want_losses, atol=1e-5, err_msg=name)
  chex.assert_trees_all_close(state.master, want.master, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name,changes", [
    ("HYBRID_SHARD 2 x 4", {"mesh": config.MeshConfig(replica=2, fsdp=4),
                            "zero": config.ZeroConfig(strategy="HYBRID_SHARD", min_shard_size=0)}),
    ("fsdp 4 x tensor 2", {"mesh": config.MeshConfig(fsdp=4, tensor=2)}),
    ("stage 2, pipeline 2 x fsdp 4", {"mesh": config.MeshConfig(fsdp=4, pipeline=2),
                                      "zero": config.ZeroConfig(stage=2, min_shard_size=0)}),
    ("stage 3, 1F1B pipeline 2 x fsdp 4", {"mesh": config.MeshConfig(fsdp=4, pipeline=2),
                                           "pipeline": config.PipelineConfig(schedule="1f1b")}),
])
def test_lora_on_every_mesh_equals_one_device(one_device, name, changes):
  want_losses, want, _ = one_device
  losses, state, _ = train(lora_config(**changes))
  np.testing.assert_allclose(losses, want_losses, atol=1e-5, err_msg=name)
  chex.assert_trees_all_close(state.master, want.master, atol=1e-5)


@pytest.mark.slow
def test_with_offload_params_the_frozen_base_rests_in_host_memory_and_trains_the_same(
    one_device):
  """offload.params=pinned_host: the base (and the adapters' compute copy) rest in
  pinned_host, each layer's shard coming to the device inside the layer scan; the
  training is the same."""
  cfg = lora_config(offload=config.OffloadConfig(params="pinned_host"))
  p = program(cfg)
  kinds = {sh.memory_kind for sh in jax.tree.leaves(p.shardings.frozen)}
  assert kinds == {"pinned_host"}
  got = p.state_bytes()
  assert got["host"] == got["params"]  # the base and the compute copy, per device
  frozen_layers = sum(a.size * 4 for a in jax.tree.leaves(p.abstract.frozen["layers"])) // 8
  assert got["transfer"] > cfg.train.grad_accum * 2 * frozen_layers
  want_losses, want, _ = one_device
  losses, state, _ = train(cfg)
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  chex.assert_trees_all_close(state.master, want.master, atol=1e-5)


def test_the_frozen_base_is_sharded_at_every_stage_and_counted_in_the_plan():
  p = program(lora_config(zero=config.ZeroConfig(stage=1, min_shard_size=0)))
  abstract, sh = p.abstract, p.shardings
  for spec in jax.tree.leaves(jax.tree.map(lambda s: s.spec, sh.frozen["layers"])):
    assert ("replica", "fsdp") in tuple(spec), spec  # stage 1, yet split 8 ways
  assert jax.tree.leaves(abstract.frozen)[0].dtype == jnp.float32  # the compute dtype
  got = p.state_bytes()
  frozen = sum(a.size * 4 for a in jax.tree.leaves(abstract.frozen)) // 8
  assert got["frozen"] == frozen
  replicated_adapters = sum(a.size * 4 for a in jax.tree.leaves(abstract.params))
  assert got["params"] == frozen + replicated_adapters  # stage 1: the compute copy whole
  assert p.n_frozen == sum(a.size for a in jax.tree.leaves(abstract.frozen))
  assert p.n_params == lora_lib.n_adapter_params(p.model.specs)


def test_step_zero_is_the_base_model():
  """B = 0: the LoRA model's loss is the base model's, on the same weights."""
  cfg = lora_config(mesh=config.MeshConfig(fsdp=1))
  lora_model = model_for(cfg, 1)
  base_model = trainable.llama(cfg.model)
  key = jax.random.key(3)
  base = base_model.init(key)
  adapters = lora_model.init(key)
  tokens = jnp.asarray(TOKENS[0, 0])
  from jaxzero.models.interface import Hooks, merge  # pylint: disable=import-outside-toplevel
  got = lora_model.loss(merge(adapters, base), tokens, Hooks())
  want = base_model.loss(base, tokens, Hooks())
  assert float(got) == float(want)


@pytest.mark.parametrize("setting,message", [
    ("lora.rank=-2", "lora.rank=-2 must be positive"),
    ("lora.targets=q,embed", "this model ties its head to its embedding"),
    ("lora.targets=xyz.*", "matches no projection"),
    ("lora.targets=q,(", "neither names nor a valid regex"),
    ("lora.dropout=1", "lora.dropout=1 must be in"),
    ("lora.alpha=0", "lora.alpha=0 must be positive"),
])
def test_bad_lora_settings_are_one_line(setting, message):
  cfg = config.apply_overrides(lora_config(), ["lora.rank=4", "model.tie_embeddings=true",
                                               setting])
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".*", r"\.\*")) as e:
    config.validate(cfg)
  assert "\n" not in str(e.value)


def test_peft_target_modules_as_names_all_linear_or_a_regex():
  # pylint: disable-next=protected-access
  targets = lambda modules, **found: hf_peft._peft_targets({"target_modules": modules, **found})
  assert targets(["q_proj", "v_proj"]) == ("q", "v")
  assert targets("all-linear") == TARGETS
  assert targets(r".*\.(up|down)_proj") == ("up", "down")
  assert targets(["q_proj", "embed_tokens", "lm_head"]) == ("q", "embed", "head")
  assert targets(r"lm_head|.*\.v_proj") == ("v", "head")
  # As PEFT matches a list: a name, or the end of one after a dot; exclude_modules likewise.
  assert targets(["self_attn.q_proj", "mlp.down_proj", "model.embed_tokens"]) == (
      "q", "down", "embed")
  assert targets(["proj"]) == () and targets(["attn.q_proj"]) == ()
  assert targets("all-linear", exclude_modules=["self_attn.q_proj", "k_proj"]) == (
      "v", "o", "gate", "up", "down")
  assert targets("all-linear", exclude_modules=r".*mlp.*") == ("q", "k", "v", "o")


def test_targets_by_name_peft_name_or_pattern():
  assert lora_lib.resolve_targets("all-linear") == TARGETS
  assert lora_lib.resolve_targets("q, v") == ("q", "v")
  assert lora_lib.resolve_targets("q_proj,o_proj,down_proj") == ("q", "o", "down")
  assert lora_lib.resolve_targets("gate|up") == ("gate", "up")
  assert lora_lib.resolve_targets(".*_proj") == TARGETS
  assert lora_lib.resolve_targets("embed_tokens,q,lm_head") == ("q", "embed", "head")
  assert lora_lib.resolve_targets("head, embed") == ("embed", "head")


@pytest.mark.slow
def test_embedding_and_head_adapters_start_at_the_base_model_and_train_alike_on_8_devices():
  """PEFT's LoRA Embedding (A zeros, B standard normal) and a LoRA head (B zeros): step 0's
  loss is the base model's, and a stage-3 run on 8 devices equals one device."""
  def cfg(**changes):
    c = lora_config(**changes)
    return dataclasses.replace(c, lora=dataclasses.replace(c.lora, targets="v,embed,head"))
  one_losses, one, first = train(cfg(mesh=config.MeshConfig(fsdp=1)))
  assert not np.any(first.master["lora_embed_a"]) and not np.any(first.master["lora_head_b"])
  assert abs(np.std(first.master["lora_embed_b"]) - 1) < 0.2
  plain_losses = train(lora_config(mesh=config.MeshConfig(fsdp=1)), steps=1)[0]
  assert one_losses[0] == pytest.approx(plain_losses[0], abs=1e-6)
  assert np.abs(one.master["lora_embed_a"]).max() > 1e-3  # trained
  losses, eight, _ = train(cfg())
  np.testing.assert_allclose(losses, one_losses, atol=1e-5)
  chex.assert_trees_all_close(eight.master, one.master, atol=1e-5)


# ---------------------------------------------------------------- PEFT interoperability


def jaxzero_lora_logits(model_cfg, frozen, adapters, record, tokens):
  """The logits of a full-precision base (a pure params dict) with adapters (the
  master's: stacked under layers, the embedding's and head's top-level)."""
  from jaxzero.models.interface import merge  # pylint: disable=import-outside-toplevel
  params = jax.tree.map(jnp.asarray, merge(adapters, frozen))
  specs = lora_lib.adapter_specs(model_cfg, record["rank"], tuple(record["targets"]))
  top_axes = {n: s.logical_axes for n, s in specs.items() if n != "layers"}
  scale = record["alpha"] / record["rank"]
  x, head = decoder_forward(model_cfg, params, jnp.asarray(tokens),
                            layer_axes={n: s.logical_axes[1:]
                                        for n, s in specs["layers"].items()},
                            lora_scale=scale, top_axes=top_axes)
  logits = jnp.einsum("btd,dv->btv", x, head)
  low_rank = lora_lib.head_low_rank(params, x, lambda w, _: w, scale, top_axes)
  if low_rank is not None:
    logits = logits + jnp.einsum("btr,rv->btv", *low_rank)
  return np.asarray(logits)


def read_whole(monkeypatch) -> list[tuple[str, ...]]:
  """The leaves CheckpointReader.read (whole leaves) reads from now on."""
  from jaxzero.checkpoint.reader import CheckpointReader  # pylint: disable=import-outside-toplevel
  paths, read = [], CheckpointReader.read
  monkeypatch.setattr(CheckpointReader, "read", lambda self, step, path, shape: (
      paths.append(tuple(path)), read(self, step, path, shape))[1])
  return paths


@pytest.mark.slow  # trains, exports twice and runs transformers and PEFT
@pytest.mark.parametrize("family,window,targets", [
    ("llama", 0, "q,k,v,o,gate,up,down"), ("mistral", 8, "q,k,v,o,gate,up,down"),
    ("qwen2", 0, "q,k,v,o,gate,up,down"), ("llama", 0, "q,v,embed_tokens,lm_head")])
def test_a_trained_adapter_loads_into_peft_and_merges_into_transformers(family, window,
                                                                        targets, tmp_path,
                                                                        monkeypatch):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft", reason="pip install peft")
  original = random_hf_model(family, 2, False, False, window)
  original.save_pretrained(tmp_path / "base")
  model_cfg = hf_load.read_config(tmp_path / "base")
  cfg = lora_config(model=model_cfg, mesh=config.MeshConfig(fsdp=2),
                    lora=config.LoraConfig(rank=4, alpha=8.0, targets=targets),
                    train=dataclasses.replace(lora_config().train, lr=5e-2))
  p = program(cfg)
  state = p.init(frozen=hf_load.load_params(tmp_path / "base", model_cfg, p.shardings.frozen))
  tokens = np.random.default_rng(1).integers(0, 97, (2, 2, 4, 17), dtype=np.int32)
  for batch in tokens:  # trained: B is no longer zero
    state, _ = p.train_step(state, jax.device_put(batch, p.batch_sharding))
  record = lora_lib.run_record(4, 8.0, cfg.lora.targets)
  info = checkpoint_lib.run_info(model_cfg, "float32", cfg.seed, lora=record)
  with checkpoint_lib.Checkpointer(tmp_path / "run", 1, info) as checkpoints:
    checkpoints.save(2, state, wait=True)
  assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "peft"),
                      "--peft"]) == 0
  whole = read_whole(monkeypatch)
  assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "merged"),
                      "--merged"]) == 0
  assert whole and not [p for p in whole if p[:2] == ("frozen", "layers")]  # a layer at a time
  adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)

  # (On 2 devices the head adapter's vocabulary of 97 is stored padded.)
  frozen, master = jax.device_get(state.frozen), p.padding.unpad(jax.device_get(state.master))
  trained_b = [master["layers"].get("lora_v_b"), master.get("lora_head_b")]
  assert all(np.abs(b).max() > 1e-3 for b in trained_b if b is not None)
  ids = np.random.default_rng(2).integers(0, 97, (2, 24))
  want = jaxzero_lora_logits(model_cfg, frozen, master, record, ids)
  base = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "base", dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    base_logits = base(torch.from_numpy(ids)).logits.numpy()
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    peft_logits = adapted(torch.from_numpy(ids)).logits.numpy()
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, attn_implementation="eager")
    merged_logits = merged(torch.from_numpy(ids)).logits.numpy()
  assert np.abs(want - base_logits).max() > 1e-2  # the adapter changes the model
  np.testing.assert_allclose(peft_logits, want, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(merged_logits, want, atol=1e-4, rtol=1e-4)
  # The other way: the PEFT adapter read back is the run's adapters.
  record = {**record, "base_model": ""}
  chex.assert_trees_all_close(hf_peft.read_adapter(tmp_path / "peft", model_cfg, record),
                              master, atol=0)
  # As PEFT itself saves it (with the embedding's and head's base weights, where adapted).
  adapted.save_pretrained(tmp_path / "peft_saved")
  chex.assert_trees_all_close(hf_peft.read_adapter(tmp_path / "peft_saved", model_cfg, record),
                              master, atol=0)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
  """A PEFT adapter (rank 4, alpha 8, every projection) for the tiny model, as export
  writes it, from random adapters."""
  cfg = lora_config().model
  record = lora_lib.run_record(4, 8.0, "all-linear")
  specs = lora_lib.adapter_specs(cfg, 4, TARGETS)
  adapters = jax.tree.map(np.asarray, lora_lib.init_adapters(specs, jax.random.key(1)))
  adapters["layers"] = {n: a + 0.5 for n, a in adapters["layers"].items()}
  out = tmp_path_factory.mktemp("adapter")
  (out / hf_peft.ADAPTER_CONFIG).write_text(json.dumps(hf_peft.adapter_config(record)))
  hf_export.write_safetensors(out / hf_peft.ADAPTER_WEIGHTS, hf_peft.peft_tensors(
      adapters, record, cfg.n_layers), "float32")
  return out, cfg, record, adapters


def test_a_peft_adapter_reads_back_exactly(adapter_dir):
  out, cfg, record, adapters = adapter_dir
  chex.assert_trees_all_equal(hf_peft.read_adapter(out, cfg, record), adapters)


@pytest.mark.parametrize("change,message", [
    ("rank", "has rank 4, this run lora.rank=8: set lora.rank=4"),
    ("targets", "has targets q,k,v,o,gate,up,down, this run lora.targets=q,v"),
    ("base", "an adapter for another base model"),
    ("missing", "adapter_model.safetensors is missing"),
    ("rslora", "use_rslora=True is not supported"),
    ("layers_to_transform", r"layers_to_transform=\[1\] adapts layers \[1\] of this model's 2 "
     "only; jaxzero adapts lora.targets in every layer, so the adapters cannot start from it"),
    ("layer_regex", r"target_modules=model\\.layers\\.1\\.\.\* adapts q_proj in layers \[1\] "
     "of this model's 2 only; jaxzero adapts lora.targets in every layer"),
    ("bad_regex", r"target_modules='model\.\[layers' is not a regular expression \(unterminated "
     "character set"),
    ("no_targets", r"target_modules=\['fc1', 'fc2'\] adapts none of the modules jaxzero adapts "
     r"\(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, embed_tokens, lm_head\)"),
    ("layer_names", r"target_modules=\['layers.1.self_attn.q_proj'\] adapts q_proj in layers "
     r"\[1\] of this model's 2 only"),
    ("exclude_layer", r"target_modules=\['q_proj'\] and exclude_modules=\['layers.0.self_attn."
     r"q_proj'\] adapts q_proj in layers \[1\] of this model's 2 only"),
    ("not_an_object", "adapter_config.json is not a JSON object"),
    ("damaged_weights", "adapter_model.safetensors cannot be read: "),
])
def test_an_adapter_that_does_not_fit_is_one_line(adapter_dir, tmp_path, change, message):
  out, cfg, record, _ = adapter_dir
  if change == "rank":
    record = {**record, "rank": 8}
  elif change == "targets":
    record = {**record, "targets": ["q", "v"]}
  elif change == "base":
    cfg = dataclasses.replace(cfg, dim=64, n_heads=8)
  elif change in ("rslora", "layers_to_transform", "layer_regex", "bad_regex", "layer_names",
                  "exclude_layer", "no_targets"):
    found = json.loads((out / hf_peft.ADAPTER_CONFIG).read_text())
    found.update({"rslora": {"use_rslora": True},
                  "layers_to_transform": {"layers_to_transform": [1]},
                  "layer_regex": {"target_modules": r"model\.layers\.1\..*"},
                  "bad_regex": {"target_modules": "model.[layers"},
                  "layer_names": {"target_modules": ["layers.1.self_attn.q_proj"]},
                  "no_targets": {"target_modules": ["fc1", "fc2"]},
                  "exclude_layer": {"target_modules": ["q_proj"],
                                    "exclude_modules": ["layers.0.self_attn.q_proj"]}}[change])
    (tmp_path / hf_peft.ADAPTER_CONFIG).write_text(json.dumps(found))
    (tmp_path / hf_peft.ADAPTER_WEIGHTS).write_bytes((out / hf_peft.ADAPTER_WEIGHTS).read_bytes())
    out = tmp_path
  elif change == "not_an_object":
    (tmp_path / hf_peft.ADAPTER_CONFIG).write_text("[]")
    (tmp_path / hf_peft.ADAPTER_WEIGHTS).write_bytes((out / hf_peft.ADAPTER_WEIGHTS).read_bytes())
    out = tmp_path
  elif change == "damaged_weights":
    (tmp_path / hf_peft.ADAPTER_CONFIG).write_text((out / hf_peft.ADAPTER_CONFIG).read_text())
    (tmp_path / hf_peft.ADAPTER_WEIGHTS).write_bytes(b"\x07\x00")
    out = tmp_path
  else:
    (tmp_path / hf_peft.ADAPTER_CONFIG).write_text((out / hf_peft.ADAPTER_CONFIG).read_text())
    out = tmp_path
  with pytest.raises(HFCheckpointError, match=message) as e:
    hf_peft.check_adapter(out, cfg, record)
  assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """A LoRA run's workdir holding a checkpoint of its initial state (no training)."""
  cfg = lora_config(mesh=config.MeshConfig(fsdp=1))
  workdir = tmp_path_factory.mktemp("lora_run")
  info = checkpoint_lib.run_info(cfg.model, "float32", cfg.seed,
                                 lora=lora_lib.run_record(4, 8.0, cfg.lora.targets))
  with checkpoint_lib.Checkpointer(workdir, 1, info) as checkpoints:
    checkpoints.save(0, program(cfg).init(), wait=True)
  return workdir


@pytest.mark.parametrize("kind", ["--peft", "--merged"])
def test_an_export_that_cannot_be_written_is_one_line_and_leaves_nothing(
    lora_run, tmp_path, monkeypatch, capsys, kind):
  """A disk that fills up while the weights are written: no half-written --out (which a
  retry would refuse), no traceback, exit code 1 (a failed write, not bad input)."""
  import errno  # pylint: disable=import-outside-toplevel
  write = hf_export._SafetensorsWriter.write  # pylint: disable=protected-access

  def full_disk(self, name, array):
    write(self, name, array)  # a first tensor is on disk
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(hf_export._SafetensorsWriter, "write", full_disk)
  out = tmp_path / "out"
  argv = ["--workdir", str(lora_run), "--out", str(out), kind]
  assert export.main(argv) == 1
  stderr = capsys.readouterr().err
  assert stderr.splitlines() == [f"jaxzero.export: error: the export failed: no space left on "
                                 f"device; --out {out} is left as it was"], stderr
  assert list(tmp_path.iterdir()) == []
  monkeypatch.undo()
  assert export.main(argv) == 0
  assert (out / ("adapter_model.safetensors" if kind == "--peft" else "config.json")).is_file()


def test_evaluation_sees_the_frozen_base():
  """The held-out loss of a LoRA state is its train loss on the same tokens (before the
  step's update), through the evaluation's own program."""
  from jaxzero.training import evaluation  # pylint: disable=import-outside-toplevel
  p = program(lora_config(mesh=config.MeshConfig(fsdp=1)))
  state = p.init()
  tokens = jax.device_put(TOKENS[0], p.batch_sharding)
  got = evaluation.make_eval_step(p)(state.params, state.frozen, tokens)
  want = p.train_step(state, tokens)[1]["loss"]
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


@pytest.mark.slow
def test_a_lora_run_resumes_only_under_its_own_lora_settings(tmp_path, monkeypatch):
  """A checkpoint's adapters under another lora.alpha fit every shape but are another
  model; another rank, targets or base storage, or none, another state: each refused in
  one line naming what to set, before the run is built, nothing changed; under its own
  settings it resumes."""
  from jaxzero.errors import CheckpointError
  from jaxzero.training import loop
  cfg = lora_config(train=dataclasses.replace(lora_config().train, steps=2),
                    checkpoint=config.CheckpointConfig(every=1))
  loop.train(cfg, tmp_path, 1, devices=jax.devices()[:8], progress=False)
  before = sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "checkpoints").rglob("*"))
  fits = "does not fit this config"
  settings = "set lora.rank=4, lora.targets=q,k,v,o,gate,up,down, lora.base_dtype= to resume it"
  with monkeypatch.context() as m:
    m.setattr(loop, "build", lambda *a, **k: pytest.fail("built"))
    for change, message in (
        ({"alpha": 16.0}, r"was trained with lora.alpha=8, this config has lora.alpha=16: .*; "
                          r"set lora.alpha=8$"),
        ({"rank": 8}, rf"{fits} \(lora.rank=4 in the checkpoint, 8 here\); {settings}"),
        ({"targets": "q,v"}, rf"{fits} \(lora.targets=q,k,v,o,gate,up,down in the checkpoint, "
                             r"q,v here\)"),
        ({"base_dtype": "int8"}, r"\(lora.base_dtype= in the checkpoint, int8 here\)"),
        ({"rank": 0}, rf"\(lora.rank=4 in the checkpoint, 0 here\); {settings}")):
      other = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, **change))
      with pytest.raises(CheckpointError, match=message):
        loop.train(other, tmp_path, 2, devices=jax.devices()[:8], progress=False)
  assert sorted((p, p.stat().st_mtime_ns)
                for p in (tmp_path / "checkpoints").rglob("*")) == before
  assert [r["step"] for r in loop.train(cfg, tmp_path, 2, devices=jax.devices()[:8],
                                        progress=False)] == [2]
