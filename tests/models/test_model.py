"""Tests that jaxzero.models.llama computes Llama-3 (and Mistral, Qwen2), and that
jaxzero.hf.config_json and jaxzero.hf.tensors map it exactly.

Three independent witnesses of the forward pass:
* a from-scratch numpy float64 reference written below (no code shared with
  jaxzero.models.llama),
* transformers' LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM, loaded
  through jaxzero.hf.tensors,
* the model itself with and without rematerialisation (gradients).

Weights are random everywhere (norm scales too, not ones) and of unit-ish
scale, so a swapped, transposed or mis-grouped tensor changes the logits by
far more than the tolerances.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxzero.hf import config_json, tensors
from jaxzero.models import llama
from jaxzero.models.llama import LlamaConfig

from hf_reference import hf_state_dict, params_from_hf, random_hf_model

B, T = 2, 24
# original_max_len 16 < T: with theta 1e4 and head_dim 16 the highest of the 8
# frequencies is interpolated and the other 7 are divided by 8, so scaling
# visibly moves the logits (checked by test_reference_is_sensitive_to_rope_scaling).
SCALING = dict(rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_len=16)


def make_cfg(n_kv_heads: int = 2, tied: bool = False, scaled: bool = True,
             family: str = "llama", window: int = 0) -> LlamaConfig:
  return LlamaConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                     mlp_dim=128, norm_eps=1e-5, rope_theta=10_000.0, tie_embeddings=tied,
                     family=family, qkv_bias=family == "qwen2", sliding_window=window,
                     **(SCALING if scaled else {}))


def random_params(cfg: LlamaConfig, seed: int = 0) -> dict:
  """Pure params dict, numpy float32, with activations of order one."""
  rng = np.random.default_rng(seed)
  # Input width of each product. The embedding is a lookup, but it is also the
  # tied head, so it gets the same scale: logits stay at a few units, where
  # float32 rounding (~1e-6) is well inside the 1e-5 tolerance.
  # Biases are of order one, as the projections' outputs are.
  fan_in = {"w_down_LxFxD": cfg.mlp_dim, "bq_LxHxE": 1, "bk_LxKxE": 1, "bv_LxKxE": 1}

  def draw(name: str, spec: llama.ParamSpec) -> np.ndarray:
    if spec.init == "ones":
      return (1.0 + 0.2 * rng.standard_normal(spec.shape)).astype(np.float32)
    std = 1.0 / math.sqrt(fan_in.get(name, cfg.dim))
    return (std * rng.standard_normal(spec.shape)).astype(np.float32)

  specs = llama.param_specs(cfg)
  params = {n: draw(n, s) for n, s in specs.items() if n != "layers"}
  params["layers"] = {n: draw(n, s) for n, s in specs["layers"].items()}
  return params


def random_tokens(cfg: LlamaConfig, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T), dtype=np.int32)


def graphdef(cfg: LlamaConfig):
  abstract = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract, nnx.Param)[0]


def model_logits(cfg: LlamaConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
  gd = graphdef(cfg)
  fwd = jax.jit(lambda p, t: nnx.merge(gd, p)(t))
  return np.asarray(fwd(params, tokens))


# ----------------------------------------------------------------------------- reference


def ref_inv_freq(cfg: LlamaConfig) -> np.ndarray:
  """RoPE inverse frequencies; Llama-3.1 scaling as the piecewise rule of Meta's
  reference ``apply_scaling``."""
  E = cfg.head_dim
  inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, E, 2, dtype=np.float64) / E)
  factor = cfg.rope_scaling_factor
  if factor <= 1.0:
    return inv_freq
  lo, hi, orig = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
  out = []
  for f in inv_freq:
    wavelen = 2 * math.pi / f
    if wavelen < orig / hi:  # high frequency: kept
      out.append(f)
    elif wavelen > orig / lo:  # low frequency: slowed down
      out.append(f / factor)
    else:  # in between: blend
      s = (orig / wavelen - lo) / (hi - lo)
      out.append((1 - s) * f / factor + s * f)
  return np.array(out)


def ref_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  return w * x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps)


def ref_rope(x_BxTxNxE: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
  angles = np.arange(x_BxTxNxE.shape[1])[:, None] * inv_freq[None, :]
  angles = np.concatenate([angles, angles], axis=-1)[None, :, None, :]
  x1, x2 = np.split(x_BxTxNxE, 2, axis=-1)
  return x_BxTxNxE * np.cos(angles) + np.concatenate([-x2, x1], axis=-1) * np.sin(angles)


def ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0) -> np.ndarray:
  """Causal softmax attention; [B, T, H, E] in and out, k/v with K heads; a window W > 0
  hides the keys W or more positions back."""
  H, K, E = q.shape[2], k.shape[2], q.shape[3]
  # GQA: query head h reads kv head h // (H / K), like HF's repeat_kv.
  k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
  scores = np.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(E)
  future = np.triu(np.ones((q.shape[1], k.shape[1]), bool), 1)
  if window:
    future |= np.tril(np.ones((q.shape[1], k.shape[1]), bool), -window)
  scores = np.where(future, -np.inf, scores)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhe->bqhe", probs, v)


def ref_forward(cfg: LlamaConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
  """Llama-3 logits in float64, from the jaxzero pure params dict."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  lp = p["layers"]
  inv_freq = ref_inv_freq(cfg)
  silu = lambda z: z / (1 + np.exp(-z))
  bias = lambda name, l: lp[name][l] if cfg.qkv_bias else 0.0
  x = p["embed_VxD"][tokens]
  for l in range(cfg.n_layers):
    h = ref_rms_norm(x, lp["attn_norm"][l], cfg.norm_eps)
    q = ref_rope(np.einsum("btd,dhe->bthe", h, lp["wq_LxDxHxE"][l]) + bias("bq_LxHxE", l),
                 inv_freq)
    k = ref_rope(np.einsum("btd,dke->btke", h, lp["wk_LxDxKxE"][l]) + bias("bk_LxKxE", l),
                 inv_freq)
    v = np.einsum("btd,dke->btke", h, lp["wv_LxDxKxE"][l]) + bias("bv_LxKxE", l)
    ctx = ref_attention(q, k, v, cfg.sliding_window)
    x = x + np.einsum("bthe,hed->btd", ctx, lp["wo_LxHxExD"][l])
    h = ref_rms_norm(x, lp["mlp_norm"][l], cfg.norm_eps)
    x = x + (silu(h @ lp["w_gate_LxDxF"][l]) * (h @ lp["w_up_LxDxF"][l])) @ lp["w_down_LxFxD"][l]
  x = ref_rms_norm(x, p["final_norm"], cfg.norm_eps)
  head = p["embed_VxD"].T if cfg.tie_embeddings else p["lm_head_DxV"]
  return x @ head


# Each of GQA, tying and llama3 scaling is on in two cases and off in two
# (pairwise cover of the 8 combinations; each case costs a compile); then Qwen2's
# q/k/v biases with a sliding window shorter than T.
@pytest.mark.parametrize("n_kv_heads, tied, scaled, family, window", [
    pytest.param(4, False, False, "llama", 0, id="mha-untied-rope"),
    pytest.param(4, True, True, "llama", 0, id="mha-tied-llama3"),
    pytest.param(2, False, True, "llama", 0, id="gqa-untied-llama3"),
    pytest.param(2, True, False, "llama", 0, id="gqa-tied-rope"),
    pytest.param(2, False, False, "qwen2", 7, id="qwen2-bias-window7"),
])
def test_matches_numpy_reference(n_kv_heads, tied, scaled, family, window):
  cfg = make_cfg(n_kv_heads, tied, scaled, family, window)
  params, tokens = random_params(cfg), random_tokens(cfg)
  got = model_logits(cfg, params, tokens)
  want = ref_forward(cfg, params, tokens)
  assert got.dtype == np.float32 and got.shape == (B, T, cfg.vocab_size)
  assert np.abs(want).max() > 1.0  # the comparison is not between near-zeros
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_reference_is_sensitive_to_rope_scaling():
  """Guards the test set-up: at this T, llama3 scaling must change the logits."""
  params, tokens = random_params(make_cfg()), random_tokens(make_cfg())
  diff = ref_forward(make_cfg(scaled=True), params, tokens) - ref_forward(
      make_cfg(scaled=False), params, tokens)
  assert np.abs(diff).max() > 0.1


def test_reference_is_sensitive_to_window_and_biases():
  """Guards the test set-up: at this T, a window of 7 and the biases change the logits."""
  cfg = make_cfg(family="qwen2", window=7)
  params, tokens = random_params(cfg), random_tokens(cfg)
  full = ref_forward(dataclasses.replace(cfg, sliding_window=0), params, tokens)
  assert np.abs(ref_forward(cfg, params, tokens) - full).max() > 0.1
  no_bias = jax.tree.map(np.zeros_like, params["layers"])
  no_bias = {**params, "layers": {**params["layers"], **{
      n: no_bias[n] for n in ("bq_LxHxE", "bk_LxKxE", "bv_LxKxE")}}}
  assert np.abs(ref_forward(cfg, no_bias, tokens) - ref_forward(cfg, params, tokens)).max() > 0.1


# ----------------------------------------------------------------------------- gradients


def test_remat_does_not_change_gradients():
  cfg = make_cfg()
  params = jax.tree.map(jnp.asarray, random_params(cfg))
  tokens = random_tokens(cfg)
  gd = graphdef(cfg)

  def loss(params, remat):
    logits = nnx.merge(gd, params)(tokens[:, :-1], remat=remat)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

  remat = lambda f: jax.checkpoint(f)
  # The hook must actually be wired into the traced computation.
  assert "remat" in str(jax.make_jaxpr(lambda p: loss(p, remat))(params))
  plain = jax.jit(jax.grad(lambda p: loss(p, None)))(params)
  checkpointed = jax.jit(jax.grad(lambda p: loss(p, remat)))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(plain):
    assert np.abs(np.asarray(g)).max() > 0, path
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               plain, checkpointed)


# ----------------------------------------------------------------------------- hf config.json


def test_config_round_trip():
  for cfg in (make_cfg(4, False, False), make_cfg(2, True, True),
              make_cfg(family="mistral", window=8), make_cfg(family="mistral"),
              make_cfg(family="qwen2", tied=True), make_cfg(family="qwen2", window=5)):
    assert config_json.llama_config_from_hf(config_json.hf_config_from_llama(cfg)) == cfg


def test_config_reads_both_rope_layouts():
  common = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=97,
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-5,
                tie_word_embeddings=False, max_position_embeddings=128)
  llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16)
  v4 = dict(common, rope_theta=10_000.0, rope_scaling=dict(llama3, rope_type="llama3"))
  v5 = dict(common, rope_parameters=dict(llama3, rope_type="llama3", rope_theta=10_000.0))
  assert config_json.llama_config_from_hf(v4) == make_cfg()
  assert config_json.llama_config_from_hf(v5) == make_cfg()
  plain = dict(common, rope_parameters=dict(rope_type="default", rope_theta=10_000.0))
  assert config_json.llama_config_from_hf(plain) == make_cfg(scaled=False)


@pytest.mark.parametrize("change, field", [
    (dict(model_type="gemma"), "model_type"),
    (dict(model_type="mistral"), "architectures"),
    (dict(architectures=["LlamaModel"]), "architectures"),
    (dict(intermediate_size=None), "intermediate_size"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope_type"),
    (dict(head_dim=32), "head_dim"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_config_rejects(change, field):
  hf_config = config_json.hf_config_from_llama(make_cfg(scaled=False))
  hf_config.update(change)
  hf_config = {k: v for k, v in hf_config.items() if v is not None}
  with pytest.raises(ValueError, match=field):
    config_json.llama_config_from_hf(hf_config)


@pytest.mark.parametrize("family, change, message", [
    # Qwen2's window on layer 1 only (layers from max_window_layers on): refused.
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     "field 'max_window_layers' gives 1 of 2 layers a sliding window"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"]),
     "field 'layer_types' gives 1 of 2 layers a sliding window"),
    ("mistral", dict(sliding_window=0), "field 'sliding_window' is 0; it must be positive"),
    ("mistral", dict(hidden_act="gelu"), "field 'hidden_act' is 'gelu'"),
])
def test_family_config_rejects(family, change, message):
  hf_config = {**config_json.hf_config_from_llama(make_cfg(family=family)), **change}
  with pytest.raises(ValueError, match=message):
    config_json.llama_config_from_hf(hf_config)


@pytest.mark.parametrize("change, window", [
    (dict(use_sliding_window=False, sliding_window=32768, max_window_layers=0), 0),
    (dict(use_sliding_window=True, sliding_window=32768, max_window_layers=2), 0),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),
    (dict(use_sliding_window=True, sliding_window=8,
          layer_types=["sliding_attention"] * 2, max_window_layers=28), 8),
])
def test_qwen2_window_is_the_one_transformers_applies(change, window):
  hf_config = {**config_json.hf_config_from_llama(make_cfg(family="qwen2")), **change}
  cfg = config_json.llama_config_from_hf(hf_config)
  assert (cfg.family, cfg.qkv_bias, cfg.sliding_window) == ("qwen2", True, window)


def test_family_fields_are_validated():
  for fields, message in [(dict(family="qwen2"), "model.qkv_bias=False with model.family"),
                          (dict(qkv_bias=True), "q/k/v biases are Qwen2's"),
                          (dict(sliding_window=4), "Llama has no sliding window"),
                          (dict(family="mistral", sliding_window=-1), "must not be negative"),
                          (dict(family="gemma"), "model.family='gemma' is unknown")]:
    with pytest.raises(ValueError, match=message):
      LlamaConfig(**fields).validate()


# ----------------------------------------------------------------------------- hf tensors


def test_tensor_names_shapes_and_errors():
  cfg = make_cfg(tied=True)
  state_dict = hf_state_dict(random_params(cfg), cfg)
  # A tied model has no head of its own: none is written, and one read is skipped.
  assert "lm_head.weight" not in state_dict
  assert {k: v.shape for k, v in state_dict.items()} == tensors.hf_tensor_shapes(cfg)
  head = state_dict["model.embed_tokens.weight"]
  assert tensors.hf_tensor_to_jaxzero("lm_head.weight", head, cfg) is None
  for extra in ("model.layers.2.mlp.up_proj.weight", "model.layers.0.mlp.bias"):
    with pytest.raises(KeyError, match=extra.replace(".", r"\.")):
      tensors.hf_tensor_to_jaxzero(extra, np.zeros(3), cfg)
  with pytest.raises(ValueError, match=r"k_proj.*\(64, 64\), expected \(32, 64\)"):
    tensors.hf_tensor_to_jaxzero("model.layers.0.self_attn.k_proj.weight",
                                    np.zeros((64, 64)), cfg)
  with pytest.raises(KeyError, match="lm_head_DxV"):
    tensors.jaxzero_to_hf_tensors(("lm_head_DxV",), np.zeros((64, 97)), cfg)


def test_per_tensor_layouts():
  """Spot-checks the documented layouts against HF's Linear convention y = x @ W.T."""
  cfg = make_cfg()
  rng = np.random.default_rng(0)
  x = rng.standard_normal(cfg.dim)
  w_q = rng.standard_normal((cfg.n_heads * cfg.head_dim, cfg.dim))
  path, layer, wq = tensors.hf_tensor_to_jaxzero("model.layers.1.self_attn.q_proj.weight",
                                                    w_q, cfg)
  assert (path, layer, wq.shape) == (("layers", "wq_LxDxHxE"), 1, (64, 4, 16))
  # Head h of HF's q is rows [h*E, (h+1)*E) of its projection output.
  np.testing.assert_allclose(np.einsum("d,dhe->he", x, wq).reshape(-1), w_q @ x, rtol=0,
                             atol=1e-12)
  w_o = rng.standard_normal((cfg.dim, cfg.n_heads * cfg.head_dim))
  _, _, wo = tensors.hf_tensor_to_jaxzero("model.layers.0.self_attn.o_proj.weight", w_o,
                                             cfg)
  ctx = rng.standard_normal((cfg.n_heads, cfg.head_dim))
  np.testing.assert_allclose(np.einsum("he,hed->d", ctx, wo), w_o @ ctx.reshape(-1), rtol=0,
                             atol=1e-12)
  path, layer, norm = tensors.hf_tensor_to_jaxzero("model.norm.weight", x, cfg)
  assert (path, layer) == (("final_norm",), None) and np.array_equal(norm, x)


# ----------------------------------------------------------------------------- transformers parity

HF_CASES = [
    pytest.param("llama", 4, False, True, 0, id="llama-mha-untied-llama3"),
    pytest.param("llama", 2, True, True, 0, id="llama-gqa-tied-llama3"),
    pytest.param("llama", 2, False, False, 0, id="llama-gqa-untied-rope"),
    # T = 24: a window of 8 hides most keys from the later queries.
    pytest.param("mistral", 2, False, False, 8, id="mistral-window8"),
    pytest.param("mistral", 4, True, True, 0, id="mistral-tied-llama3-no-window"),
    pytest.param("qwen2", 2, False, False, 0, id="qwen2-bias-untied"),
    pytest.param("qwen2", 2, True, False, 0, id="qwen2-bias-tied"),
    pytest.param("qwen2", 4, False, True, 5, id="qwen2-bias-window5-llama3"),
]


@pytest.mark.parametrize("family, n_kv_heads, tied, scaled, window", HF_CASES)
def test_matches_transformers(family, n_kv_heads, tied, scaled, window):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model = random_hf_model(family, n_kv_heads, tied, scaled, window)
  assert type(model).__name__ == config_json.hf_config_from_llama(
      make_cfg(family=family))["architectures"][0]

  cfg = config_json.llama_config_from_hf(model.config.to_dict())  # transformers 5 layout
  assert cfg == make_cfg(n_kv_heads, tied, scaled, family, window)
  assert llama.count_params(cfg) == sum(p.numel() for p in model.parameters())

  state_dict = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  params = params_from_hf(state_dict, cfg)
  tokens = random_tokens(cfg)
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()
  got = model_logits(cfg, params, tokens)
  assert np.abs(got - want).max() <= 1e-4

  # Round trips are pure transposes/reshapes: bit-exact.
  exported = hf_state_dict(params, cfg)
  assert exported.keys() == state_dict.keys() - ({"lm_head.weight"} if tied else set())
  for name, array in exported.items():
    assert array.dtype == np.float32 and np.array_equal(array, state_dict[name]), name
  again = params_from_hf(exported, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), again, params)

  # Export: the exported config and tensors rebuild the same transformers model.
  hf_config = config_json.hf_config_from_llama(cfg)
  rebuilt = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(**hf_config), attn_implementation="eager").eval()
  assert type(rebuilt) is type(model)
  rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=not tied)
  with torch.no_grad():
    np.testing.assert_array_equal(rebuilt(torch.from_numpy(tokens).long()).logits.numpy(), want)
