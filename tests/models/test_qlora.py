"""QLoRA: the frozen base stored as NF4 with double-quantized block scales (or int8),
dequantized inside the step; the same training on one device and eight; a checkpoint
that resumes and exports; and what cannot be quantized said in one line."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero import export
from jaxzero.errors import ConfigError
from jaxzero.hf import load as hf_load
from jaxzero.models import lora as lora_lib
from jaxzero.models import quantize
from jaxzero.models.llama import LLAMA31_8B, param_specs

from test_lora import TOKENS, lora_config, program


def reference_nf4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(level index of each value, block absmax), the plain way: nearest level by argmin."""
  blocks = w.reshape(-1, quantize.BLOCK).astype(np.float64)
  absmax = np.abs(blocks).max(axis=1)
  normed = blocks / absmax[:, None]
  index = np.abs(normed[..., None] - quantize.NF4_LEVELS[None, None, :]).argmin(axis=-1)
  return index.reshape(-1), absmax


def test_nf4_codes_are_the_nearest_levels_and_scales_nearly_exact():
  w = np.random.default_rng(0).standard_normal((2, 64, 96)).astype(np.float32)
  parts = jax.device_get(quantize.quantize(jnp.asarray(w), "nf4"))
  for layer in range(2):
    index, absmax = reference_nf4(w[layer])
    codes = parts["codes"][layer]
    unpacked = np.stack([codes >> 4, codes & 15], axis=-1).reshape(-1)
    np.testing.assert_array_equal(unpacked, index)
    # The double-quantized block scales: within half an int8 step of each group's range.
    layer_parts = {k: v[layer] for k, v in parts.items()}
    got = np.asarray(quantize.dequantize(layer_parts, (64, 96), jnp.float32))
    want = (quantize.NF4_LEVELS[index].reshape(-1, 64) * absmax[:, None]).reshape(64, 96)
    step = np.abs(absmax - absmax.mean()).max() / 127
    assert np.abs(got - want).max() <= step / 2 * 1.0001 + 1e-6
  assert parts["codes"].dtype == np.uint8 and parts["absmax"].dtype == np.int8


def test_int8_round_trip_error_is_half_a_step():
  w = np.random.default_rng(1).standard_normal((3, 128, 64)).astype(np.float32)
  parts = jax.device_get(quantize.quantize(jnp.asarray(w), "int8"))
  got = np.stack([np.asarray(quantize.dequantize({k: v[i] for k, v in parts.items()},
                                                 (128, 64), jnp.float32)) for i in range(3)])
  absmax = np.abs(w.reshape(3, -1, 64)).max(axis=-1)
  error = np.abs(got - w).reshape(3, -1, 64).max(axis=-1)
  assert np.all(error <= absmax / 127 / 2 * 1.0001)


def test_llama8b_projections_take_about_half_a_byte_a_parameter_in_nf4():
  layers = param_specs(LLAMA31_8B)["layers"]
  n = sum(np.prod(layers[name].shape) for name in lora_lib.QUANTIZED)
  nf4 = sum(quantize.stored_bytes(layers[name].shape, "nf4") for name in lora_lib.QUANTIZED)
  int8 = sum(quantize.stored_bytes(layers[name].shape, "int8") for name in lora_lib.QUANTIZED)
  assert 0.515 < nf4 / n < 0.517  # 0.5 + 1/64 + 4/(64 x 256)
  assert 1.06 < int8 / n < 1.07


def qlora(base_dtype="nf4", **changes):
  c = lora_config(**changes)
  return dataclasses.replace(c, lora=dataclasses.replace(c.lora, base_dtype=base_dtype))


def train(cfg, steps=3):
  p = program(cfg)
  state = p.init()
  first = jax.device_get(state.frozen)
  losses = []
  for tokens in TOKENS[:steps]:
    state, metrics = p.train_step(state, jax.device_put(tokens, p.batch_sharding))
    losses.append(float(metrics["loss"]))
  return p, np.array(losses), jax.device_get(state), first


@pytest.fixture(scope="module")
def nf4_one_device():
  return train(qlora(mesh=config.MeshConfig(fsdp=1)))


def test_the_quantized_base_is_stored_as_parts_and_never_changes(nf4_one_device):
  p, losses, state, first = nf4_one_device
  assert losses[-1] < losses[0]
  q = state.frozen["layers"]["wq_LxDxHxE"]
  assert set(q) == {"codes", "absmax", "scale", "offset"}
  assert q["codes"].dtype == np.uint8
  assert state.frozen["embed_VxD"].dtype == np.float32  # the compute dtype, not quantized
  chex.assert_trees_all_equal(state.frozen, first)
  assert p.n_frozen == sum(int(np.prod(s.shape)) for s in jax.tree.leaves(
      param_specs(p.cfg.model), is_leaf=lambda x: hasattr(x, "logical_axes")))


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_qlora_on_eight_devices_equals_one_device(nf4_one_device, base_dtype):
  if base_dtype == "nf4":
    _, want_losses, want, _ = nf4_one_device
  else:
    _, want_losses, want, _ = train(qlora("int8", mesh=config.MeshConfig(fsdp=1)))
  p, losses, state, _ = train(qlora(base_dtype))
  codes = p.shardings.frozen["layers"]["w_up_LxDxF"]["codes"].spec
  assert tuple(codes) == (None, ("replica", "fsdp"))  # the codes are sharded 8 ways
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  chex.assert_trees_all_close(state.master, want.master, atol=1e-5)


@pytest.mark.slow
def test_a_quantized_base_in_host_memory_trains_the_same(nf4_one_device):
  """offload.params=pinned_host: the NF4 parts rest in pinned_host and each layer's come
  to the device in the layer scan, to be dequantized there."""
  _, want_losses, want, _ = nf4_one_device
  p, losses, state, first = train(qlora(offload=config.OffloadConfig(params="pinned_host")))
  codes = p.shardings.frozen["layers"]["w_up_LxDxF"]["codes"]
  assert codes.memory_kind == "pinned_host"
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  chex.assert_trees_all_close(state.master, want.master, atol=1e-5)
  chex.assert_trees_all_equal(state.frozen, first)


@pytest.mark.slow
def test_a_quantized_base_with_embedding_and_head_adapters_pipelines_by_1f1b():
  """The 1F1B schedule takes the frozen NF4 layers stage by stage (never kept per
  micro-batch) and trains as one device does."""
  def cfg(**changes):
    c = qlora(**changes)
    return dataclasses.replace(c, lora=dataclasses.replace(c.lora, targets="q,v,embed,head"))
  _, want_losses, want, _ = train(cfg(mesh=config.MeshConfig(fsdp=1)))
  _, losses, state, _ = train(cfg(mesh=config.MeshConfig(fsdp=4, pipeline=2),
                                  pipeline=config.PipelineConfig(schedule="1f1b")))
  np.testing.assert_allclose(losses, want_losses, atol=1e-5)
  chex.assert_trees_all_close(state.master, want.master, atol=1e-5)


@pytest.mark.slow  # compiles two more programs
def test_the_quantized_model_is_close_to_the_base_it_was_made_from():
  """The loss through the NF4 base at step 0 (B = 0) is the full-precision base's,
  to within what 4 bits a weight can hold."""
  full = program(lora_config(mesh=config.MeshConfig(fsdp=1)))
  nf4 = program(qlora(mesh=config.MeshConfig(fsdp=1)))
  tokens = jax.device_put(TOKENS[0], full.batch_sharding)
  loss_full = float(full.train_step(full.init(), tokens)[1]["loss"])
  loss_nf4 = float(nf4.train_step(nf4.init(), tokens)[1]["loss"])
  assert loss_full != loss_nf4
  assert abs(loss_full - loss_nf4) < 0.01 * loss_full


@pytest.mark.slow
def test_a_qlora_run_resumes_on_another_mesh_and_exports_merged(tmp_path, monkeypatch):
  """jaxzero.train from Hugging Face weights, quantized as read, in float32; resumed on 2
  devices at stage 1 in bfloat16 (the frozen embedding, head and norms cast with the
  compute copy, the NF4 parts as they are); the merged export (the dequantized base plus
  the adapters) loads into transformers with the logits jaxzero computes."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from processes import TINY, child_env, run_python  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  original = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10_000.0,
      max_position_embeddings=128, tie_word_embeddings=False))  # byte tokens: vocab 256
  original.save_pretrained(tmp_path / "base")
  common = ["--set", f"init.hf_checkpoint={tmp_path / 'base'}", "--set", "model.vocab_size=256",
            "--set", "model.dim=64", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
            "--set", "model.n_kv_heads=2", "--set", "model.mlp_dim=128", "--set",
            "model.rope_theta=10000", "--set", "model.rope_scaling_factor=0", "--set",
            "lora.rank=4", "--set", "lora.base_dtype=nf4", "--set", "train.seq_len=32",
            "--set", "train.global_batch=16", "--set",
            "data.max_bytes=200000", "--set", "checkpoint.every=2", "--set", "train.lr=1e-2",
            "--workdir", str(tmp_path / "run"), "--no-progress"]
  env = child_env()
  first = run_python("-m", "jaxzero.train", "--config", TINY, *common, "--steps", "2",
                     "--set", "precision.compute=float32", env=env)
  assert first.returncode == 0, first.stderr
  second = run_python("-m", "jaxzero.train", "--config", TINY, *common, "--steps", "4", "--set",
                      "mesh.fsdp=2", "--set", "zero.stage=1", "--set",
                      "precision.compute=bfloat16", env=env)
  assert second.returncode == 0, second.stderr
  assert "resumed from step 2" in second.stderr
  assert "the compute copy is cast from the float32 masters to bfloat16" in second.stderr
  from test_lora import read_whole  # pylint: disable=import-outside-toplevel
  whole = read_whole(monkeypatch)
  assert export.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "merged"),
                      "--merged", "--dtype", "float32"]) == 0
  assert whole and not [p for p in whole if p[:2] == ("frozen", "layers")]  # a layer at a time
  # jaxzero's logits: the checkpoint's dequantized base and adapters.
  from jaxzero.checkpoint.reader import CheckpointReader  # pylint: disable=import-outside-toplevel
  from test_lora import jaxzero_lora_logits  # pylint: disable=import-outside-toplevel
  model_cfg = hf_load.read_config(tmp_path / "base")
  with CheckpointReader(tmp_path / "run") as reader:
    step = reader.resolve_step(None)
    assert step == 4
    record = reader.info(step)["lora"]
    read = lambda name, shape: reader.read(step, name, shape)
    flat = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(
        param_specs(model_cfg), is_leaf=lambda x: hasattr(x, "logical_axes"))[0]:
      names = tuple(k.key for k in path)
      flat[names] = lora_lib.read_base_leaf(names, spec.shape, read, record)
    adapters = {n: read(("master", "layers", n), s.shape) for n, s in lora_lib.adapter_specs(
        model_cfg, 4, tuple(record["targets"]))["layers"].items()}
  from flax import traverse_util  # pylint: disable=import-outside-toplevel
  frozen = traverse_util.unflatten_dict(flat)
  ids = np.random.default_rng(2).integers(0, 256, (2, 24))
  want = jaxzero_lora_logits(model_cfg, frozen, {"layers": adapters}, record, ids)
  merged = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "merged", dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    got = merged(torch.from_numpy(ids)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_base_that_does_not_split_into_blocks_is_one_line():
  cfg = qlora()
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dim=36, n_heads=2,
                                                           n_kv_heads=2, mlp_dim=72))
  with pytest.raises(ConfigError, match="weight wq_LxDxHxE has 1,296 elements a layer "
                     r"\(36 x 2 x 18\), not a multiple of the 64-value block") as e:
    config.validate(cfg)
  assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="lora.base_dtype=bfloat16 with precision.compute="
                     "float32"):
    config.validate(qlora("bfloat16"))
