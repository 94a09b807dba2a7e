"""Loading Hugging Face Llama, Mistral and Qwen2 checkpoint directories into sharded
jaxzero weights.

Parity cases are saved by transformers itself (single file and sharded);
the memory and error cases write safetensors files directly, so they also run
without torch.
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxzero import config
from jaxzero import engine as engine_lib
from jaxzero.checkpoint.checkpointer import run_info
from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.engine import hooks as hooks_lib
from jaxzero.errors import HFCheckpointError
from jaxzero.hf import config_json
from jaxzero.hf import load as hf_load
from jaxzero.hf.export import export_hf
from jaxzero.models import trainable
from jaxzero.models.llama import LlamaConfig, param_specs
from jaxzero.parallel.mesh import make_mesh
from jaxzero.parallel.zero import Layout
from jaxzero.runners.base import InMemoryRunner, checkpointer

from hf_reference import hf_state_dict, params_from_hf, random_hf_llama, random_hf_model

B, T = 2, 24
hf_model = random_hf_llama


def tokens_BxT(vocab: int, shape=(B, T)) -> np.ndarray:
  return np.random.default_rng(1).integers(0, vocab, shape, dtype=np.int32)


def flat(tree) -> dict:
  return dict(jax.tree_util.tree_flatten_with_path(tree)[0])


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("n_kv_heads, tied, scaled, shard_size", [
    pytest.param(4, False, False, None, id="mha-untied-rope"),
    pytest.param(2, True, True, None, id="gqa-tied-llama3"),
    pytest.param(2, False, True, "100KB", id="gqa-untied-llama3-sharded"),
])
def test_logits_match_transformers(n_kv_heads, tied, scaled, shard_size, tmp_path):
  torch = pytest.importorskip("torch")
  model = hf_model(n_kv_heads, tied, scaled)
  model.save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
  if shard_size:
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 3
  tokens = tokens_BxT(97)
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()

  ours = hf_load.load_llama(tmp_path)
  assert ours.cfg.n_kv_heads == n_kv_heads and ours.cfg.tie_embeddings == tied
  got = np.asarray(ours(tokens))
  assert got.dtype == np.float32 and got.shape == (B, T, 97)
  assert np.abs(want).max() > 1.0  # not a comparison between near-zeros
  assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("family, tied, window", [
    pytest.param("mistral", False, 8, id="mistral-window8"),
    pytest.param("qwen2", True, 0, id="qwen2-bias-tied"),
    pytest.param("qwen2", False, 0, id="qwen2-bias-untied"),
])
def test_family_logits_match_transformers(family, tied, window, tmp_path):
  torch = pytest.importorskip("torch")
  model = random_hf_model(family, 2, tied, False, window)
  model.save_pretrained(tmp_path)
  tokens = tokens_BxT(97)
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()
  ours = hf_load.load_llama(tmp_path)
  assert (ours.cfg.family, ours.cfg.qkv_bias, ours.cfg.sliding_window, ours.cfg.tie_embeddings
          ) == (family, family == "qwen2", window, tied)
  got = np.asarray(ours(tokens))
  assert np.abs(want).max() > 1.0
  assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_config_without_rope_theta_loads_as_transformers_reads_it(family, tmp_path):
  """Llama 2's config.json (transformers 4.31: no rope_theta, rope_scaling null) has
  transformers' default theta, 10,000."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  random_hf_model(family, 2, False, False).save_pretrained(tmp_path)
  hf_config = json.loads((tmp_path / "config.json").read_text())
  for key in ("rope_parameters", "rope_theta"):
    hf_config.pop(key, None)
  hf_config.update(rope_scaling=None, transformers_version="4.31.0.dev0")
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, attn_implementation="eager")
  tokens = tokens_BxT(97)
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()
  ours = hf_load.load_llama(tmp_path)
  assert ours.cfg.rope_theta == model.config.rope_parameters["rope_theta"] == 10_000.0
  assert np.abs(np.asarray(ours(tokens)) - want).max() <= 1e-4


@pytest.mark.parametrize("family, extra", [("mistral", {}), ("qwen2", {"use_sliding_window": True,
                                                                 "max_window_layers": 0})])
def test_an_absent_sliding_window_is_transformers_default(family, extra):
  """A config.json without `sliding_window` has transformers' default window (4096), as
  MistralConfig and Qwen2Config read it; an explicit null is full attention."""
  transformers = pytest.importorskip("transformers")
  hf_config = {**config_json.hf_config_from_llama(dataclasses.replace(CFG, family=family,
                                                                      qkv_bias=family == "qwen2")),
               **extra}
  hf_config.pop("sliding_window")
  want = transformers.AutoConfig.for_model(**hf_config).sliding_window
  assert want == 4096
  assert config_json.llama_config_from_hf(hf_config).sliding_window == want
  assert config_json.llama_config_from_hf({**hf_config, "sliding_window": None}
                                          ).sliding_window == 0


# ----------------------------------------------------------------------------- sharded reads


def write_checkpoint(directory, cfg: LlamaConfig, state_dict: dict, n_files: int = 1,
                     hf_config: dict | None = None):
  """A Hugging Face directory: config.json and safetensors, sharded when n_files > 1."""
  directory.mkdir(parents=True, exist_ok=True)
  hf_config = hf_config or config_json.hf_config_from_llama(cfg)
  (directory / "config.json").write_text(json.dumps(hf_config))
  if n_files == 1:
    save_file(state_dict, str(directory / "model.safetensors"))
    return directory
  names = sorted(state_dict)
  weight_map = {}
  for i in range(n_files):
    file = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
    save_file({n: state_dict[n] for n in names[i::n_files]}, str(directory / file))
    weight_map.update({n: file for n in names[i::n_files]})
  (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return directory


def random_state_dict(cfg: LlamaConfig, dtype=np.float32) -> dict:
  rng = np.random.default_rng(0)
  specs = param_specs(cfg)
  draw = lambda s: rng.standard_normal(s.shape).astype(dtype)
  params = {n: draw(s) for n, s in specs.items() if n != "layers"}
  params["layers"] = {n: draw(s) for n, s in specs["layers"].items()}
  return hf_state_dict(params, cfg)


def test_zero3_load_reads_each_shard_once_and_never_the_whole_model(tmp_path, monkeypatch):
  # Big enough (18 MB) that host bookkeeping is small next to the model.
  cfg = LlamaConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp_dim=1024)
  state_dict = random_state_dict(cfg)
  path = write_checkpoint(tmp_path / "ckpt", cfg, state_dict, n_files=5)
  tensor_bytes = {n: a.nbytes for n, a in state_dict.items()}
  model_bytes, biggest = sum(tensor_bytes.values()), max(tensor_bytes.values())
  layout = Layout.from_config(config.base(), make_mesh(1, 8))  # ZeRO-3
  shardings = layout.tree_shardings(param_specs(cfg), "optimizer")

  reads = []
  read = hf_load.SafetensorsReader.read

  def spy(self, name, index):
    out = read(self, name, index)
    reads.append((name, out.nbytes))
    return out

  monkeypatch.setattr(hf_load.SafetensorsReader, "read", spy)
  tracemalloc.start()
  try:
    params = jax.block_until_ready(hf_load.load_params(path, cfg, shardings))
    after, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()

  # Each call reads one tensor's share for one device: an eighth of it.
  assert all(nbytes <= tensor_bytes[name] // 8 for name, nbytes in reads)
  # Every byte of the checkpoint is read exactly once.
  assert sum(nbytes for _, nbytes in reads) == model_bytes
  # Host memory beyond what stays alive never reaches two tensors, let alone the model.
  # (What stays alive is not bounded here: on CPU the devices' shards are host memory, and
  # how much of it tracemalloc sees depends on the process's past: 6.0 MB of this 17.8 MB
  # model once in a full-suite worker, under 4.5 MB when the file runs alone.)
  assert peak - after <= 2 * biggest < model_bytes / 4
  want = params_from_hf(state_dict, cfg)
  for (key, leaf), sharding, value in zip(flat(params).items(), jax.tree.leaves(shardings),
                                          jax.tree.leaves(want)):
    assert leaf.sharding == sharding, key
    assert {s.data.shape for s in leaf.addressable_shards} == {sharding.shard_shape(leaf.shape)}
    np.testing.assert_array_equal(np.asarray(leaf), value)


def test_zero3_load_shards_qwen2_biases(tmp_path):
  cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64,
                    family="qwen2", qkv_bias=True)
  state_dict = random_state_dict(cfg)
  assert state_dict["model.layers.1.self_attn.k_proj.bias"].shape == (16,)
  layout = Layout.from_config(config.Config(model=cfg), make_mesh(1, 8))  # ZeRO-3
  shardings = layout.tree_shardings(param_specs(cfg), "params")
  params = hf_load.load_params(write_checkpoint(tmp_path, cfg, state_dict, n_files=3), cfg,
                               shardings)
  bias = params["layers"]["bq_LxHxE"]
  assert bias.shape == (2, 4, 8) and bias.addressable_shards[0].data.shape == (2, 4, 1)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params,
               params_from_hf(state_dict, cfg))


def test_a_shard_wholly_in_a_leafs_padding_is_zeros_not_a_read_past_the_tensor(tmp_path):
  """dim 12 and 6 heads on 8 devices: leaves pad to 16 and 8, so the last shards hold
  padding only (each read an empty slice of the file, which safetensors refused)."""
  model = LlamaConfig(vocab_size=64, dim=12, n_layers=2, n_heads=6, n_kv_heads=3, mlp_dim=20,
                      family="qwen2", qkv_bias=True)
  state_dict = random_state_dict(model)
  cfg = dataclasses.replace(config.base(), model=model, zero=config.ZeroConfig(min_shard_size=0),
                            precision=config.PrecisionConfig(compute="float32"))
  program = engine_lib.TrainProgram(cfg, Layout.from_config(cfg, make_mesh(1, 8)),
                                    trainable.llama(model))
  params = hf_load.load_params(write_checkpoint(tmp_path, model, state_dict), model,
                               program.shardings.master)
  assert params["final_norm"].shape == (16,) and params["layers"]["bq_LxHxE"].shape == (2, 8, 2)
  want = params_from_hf(state_dict, model)
  jax.tree.map(np.testing.assert_array_equal, program.padding.unpad(jax.device_get(params)), want)
  nonzero = lambda tree: [np.count_nonzero(leaf) for leaf in jax.tree.leaves(tree)]
  assert nonzero(jax.device_get(params)) == nonzero(want)  # zeros past the true shapes


def test_bfloat16_checkpoint_loads_exactly(tmp_path):
  ml_dtypes = pytest.importorskip("ml_dtypes")
  cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64)
  state_dict = random_state_dict(cfg, ml_dtypes.bfloat16)
  params = hf_load.load_params(write_checkpoint(tmp_path, cfg, state_dict), cfg,
                          jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  want = params_from_hf(state_dict, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, want)
  assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))


# ----------------------------------------------------------------------------- training


def test_training_starts_from_the_checkpoint(tmp_path):
  """init.hf_checkpoint via --set; the first step's loss is transformers' loss."""
  torch = pytest.importorskip("torch")
  model = hf_model(2, False, True)
  model.save_pretrained(tmp_path)
  base = config.Config(model=hf_load.read_config(tmp_path), zero=config.ZeroConfig(stage=3),
                       train=config.TrainConfig(global_batch=8, seq_len=16),
                       precision=config.PrecisionConfig(compute="float32"))
  cfg = config.apply_overrides(base, [f"init.hf_checkpoint={tmp_path}"])
  assert cfg.init.hf_checkpoint == str(tmp_path)
  layout = Layout.from_config(cfg, make_mesh(1, 8))
  engine = engine_lib.TrainProgram(cfg, layout, trainable.llama(cfg.model))
  # As the trainer does: the fp32 master weights straight into their shards.
  master = hf_load.load_params(cfg.init.hf_checkpoint, cfg.model, engine.shardings.master)
  state = engine.init(master=master)

  for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(engine.shardings)):
    assert leaf.sharding == sharding
  assert int(state.step) == 0
  assert not any(np.asarray(x).any() for x in jax.tree.leaves(state.opt_state))  # fresh Adam
  # The train step's loss on the sharded state is transformers' loss.
  batch = tokens_BxT(97, (8, 17))
  loss_fn = lambda p, t: hooks_lib.loss_with_hooks(engine.model, p, t, layout, None)
  loss = jax.jit(loss_fn)(state.params, batch)
  with torch.no_grad():
    logits = model(torch.from_numpy(batch[:, :-1]).long()).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 97),
                                             torch.from_numpy(batch[:, 1:]).long().reshape(-1))
  assert abs(float(loss) - float(want)) < 1e-5


# ----------------------------------------------------------------------------- bad input


CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64)


def bad_checkpoint(case: str, root):
  """A directory that is wrong in one way; returns (path, model config)."""
  good = random_state_dict(CFG)
  without = lambda name: {k: v for k, v in good.items() if k != name}
  root.mkdir()
  if case == "not_a_directory":
    (root / "file").write_text("")
    return root / "file", CFG
  if case == "no_config":
    return root, CFG
  if case == "not_llama":
    return write_checkpoint(root, CFG, good, hf_config=dict(
        config_json.hf_config_from_llama(CFG), model_type="gemma")), CFG
  if case in ("family_mismatch", "missing_bias"):
    qwen2 = LlamaConfig(**{**CFG.__dict__, "family": "qwen2", "qkv_bias": True})
    weights = random_state_dict(qwen2)
    if case == "missing_bias":
      del weights["model.layers.1.self_attn.v_proj.bias"]
    return write_checkpoint(root, qwen2, weights), CFG if case == "family_mismatch" else qwen2
  if case == "no_weights":
    (root / "config.json").write_text(json.dumps(config_json.hf_config_from_llama(CFG)))
    return root, CFG
  if case == "missing_tensor":
    return write_checkpoint(root, CFG, without("model.layers.1.mlp.up_proj.weight")), CFG
  if case == "missing_shard_file":
    path = write_checkpoint(root, CFG, good, n_files=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    return path, CFG
  if case == "wrong_shape":
    return write_checkpoint(root, CFG, dict(good, **{
        "model.layers.0.self_attn.k_proj.weight": np.zeros((32, 32), np.float32)})), CFG
  if case == "unexpected_tensor":
    return write_checkpoint(root, CFG, dict(good, **{
        "model.layers.0.mlp.up_proj.bias": np.zeros(64, np.float32)})), CFG
  assert case == "config_mismatch"
  return write_checkpoint(root, CFG, good), LlamaConfig(**{**CFG.__dict__, "n_kv_heads": 4})


@pytest.mark.parametrize("case, message", [
    ("not_a_directory", "file' is not a directory"),
    ("no_config", "no config.json; expected a Hugging Face model directory"),
    ("not_llama", "config.json: Hugging Face config field 'model_type' is 'gemma'; "
                  "supported: 'llama', 'mistral', 'qwen2'"),
    ("family_mismatch", "model.family='llama' but"),
    ("missing_bias", "tensor 'model.layers.1.self_attn.v_proj.bias' is missing"),
    ("no_weights", "no model.safetensors or model.safetensors.index.json"),
    ("missing_tensor", "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    ("missing_shard_file", "model-00002-of-00003.safetensors: no such file"),
    ("wrong_shape", "model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has "
                    "shape (32, 32), expected (16, 32)"),
    ("unexpected_tensor", "does not have: model.layers.0.mlp.up_proj.bias"),
    ("config_mismatch", "model.n_kv_heads=4 but"),
])
def test_bad_checkpoint_is_one_line_naming_the_culprit(case, message, tmp_path):
  path, cfg = bad_checkpoint(case, tmp_path / "ckpt")
  with pytest.raises(HFCheckpointError) as info:
    hf_load.load_params(path, cfg, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  text = str(info.value)
  assert message in text and "\n" not in text
  if case == "config_mismatch":
    assert "num_key_value_heads=2; the model config must match" in text
    assert "--set model.n_kv_heads=2" in text
  if case == "family_mismatch":
    assert "has model_type='qwen2'; the model config must match" in text
    assert "--set model.family=qwen2" in text


def _word_tokenizer(path, words: int):
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {f"w{i}": i for i in range(words)}
  tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")).save(str(path))


def test_a_checkpoint_with_its_own_tokenizer_is_not_fed_bytes(tmp_path, monkeypatch):
  """The byte tokenizer's ids mean nothing to a pretrained embedding: refused where the
  checkpoint has a tokenizer larger than bytes, before anything is built; a byte-level
  checkpoint (jaxzero's export of a byte-level run) takes bytes."""
  from jaxzero.training import loop
  hf_load.check_tokenizer("byte", tmp_path)  # no tokenizer.json
  _word_tokenizer(tmp_path / "tokenizer.json", 200)
  hf_load.check_tokenizer("byte", tmp_path)  # no larger than bytes
  _word_tokenizer(tmp_path / "tokenizer.json", 1000)
  hf_load.check_tokenizer(str(tmp_path), tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(config_json.hf_config_from_llama(CFG)))
  cfg = config.apply_overrides(config.base(), [f"init.hf_checkpoint={tmp_path}"])
  cfg = dataclasses.replace(cfg, model=CFG)
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built"))
  with pytest.raises(HFCheckpointError, match=r"has its own tokenizer of 1,000 tokens .*"
                     r"data.tokenizer='byte' would feed it byte values as token ids: set "
                     r"data.tokenizer="):
    loop.run_training(cfg, tmp_path / "w", devices=jax.devices()[:8], progress=False)


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 0, "'num_attention_heads' is 0; it must be a positive integer"),
    ("num_key_value_heads", 0, "'num_key_value_heads' is 0; it must be a positive integer"),
    ("hidden_size", [32], "'hidden_size' is [32]; it must be a positive integer"),
    ("intermediate_size", 64.5, "'intermediate_size' is 64.5; it must be a positive integer"),
    ("rms_norm_eps", "1e-5", "'rms_norm_eps' is '1e-5'; it must be a positive number"),
    ("initializer_range", None, "'initializer_range' is None; it must be a positive number"),
    ("head_dim", [16], "'head_dim' is [16]; it must be a positive integer"),
    ("max_window_layers", None, "'max_window_layers' is None; it must be an integer of at "
     "least 0"),
])
def test_a_config_json_value_of_the_wrong_kind_is_one_line(field, value, message, tmp_path):
  model = (dataclasses.replace(CFG, family="qwen2", qkv_bias=True, sliding_window=8)
           if field == "max_window_layers" else CFG)
  (tmp_path / "config.json").write_text(json.dumps(
      {**config_json.hf_config_from_llama(model), field: value}))
  with pytest.raises(HFCheckpointError) as info:
    hf_load.read_config(tmp_path)
  assert str(info.value).endswith(f"config.json: Hugging Face config field {message}")


def test_weights_load_into_padded_leaves_and_a_padded_checkpoint_reads_at_true_shapes(
    tmp_path):
  """A mesh none of whose sizes divides the model (dim 36, mlp 60, vocab 257 on 8 devices)
  stores its leaves padded (jaxzero.parallel.padding): Hugging Face weights load into
  them with zeros past the true shape, export's reader reads them back without, and
  the export is the weights loaded."""
  odd = LlamaConfig(vocab_size=257, dim=36, n_layers=2, n_heads=3, n_kv_heads=1, mlp_dim=60)
  path = write_checkpoint(tmp_path / "hf", odd, random_state_dict(odd))
  cfg = dataclasses.replace(config.base(), model=odd,
                            precision=config.PrecisionConfig(compute="float32"))
  program = engine_lib.TrainProgram(cfg, Layout.from_config(cfg, make_mesh(1, 8)),
                                    trainable.llama(odd))
  assert program.padding.padded_leaves()["['embed_VxD']"] == ((257, 36), (264, 36))
  want = jax.device_get(hf_load.load_params(
      path, odd, jax.sharding.SingleDeviceSharding(jax.devices()[0])))
  state = program.init(hf_load.load_params(path, odd, program.shardings.master))
  stored = jax.device_get(state.master)
  assert stored["embed_VxD"].shape == (264, 36) and not stored["embed_VxD"][257:].any()
  for got, expected in zip(jax.tree.leaves(program.padding.unpad(stored)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(got, expected)
  with checkpointer(tmp_path / "w", 1, run_info(odd, "float32", 0)) as saver:
    InMemoryRunner(program).save(saver, 0, state, wait=True)
  with CheckpointReader(tmp_path / "w") as reader:
    np.testing.assert_array_equal(reader.read(0, ("master", "embed_VxD"), (257, 36)),
                                  want["embed_VxD"])
    layers = reader.read_by_layer(0, ("master", "layers", "w_up_LxDxF"), (2, 36, 60))
    np.testing.assert_array_equal(layers[1], want["layers"]["w_up_LxDxF"][1])
    assert reader.leaf_shapes(0)["master/embed_VxD"] == (257, 36)
  # A padded checkpoint exports to the weights it was loaded from.
  exported = {}
  for name in export_hf(tmp_path / "w", tmp_path / "out").files:
    exported.update(load_file(tmp_path / "out" / name))
  original = load_file(path / "model.safetensors")
  assert sorted(exported) == sorted(original)
  for name, tensor in original.items():
    np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
