"""A random tiny Hugging Face Llama (or Mistral, Qwen2), the reference the model and loader
tests compare to, and whole-state-dict conversions built from jaxzero.hf.tensors'
per-tensor ones."""

import math

import numpy as np
import pytest
from flax import traverse_util

from jaxzero.hf import tensors

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)


def random_hf_llama(n_kv_heads: int, tied: bool, scaled: bool):
  """A float32 LlamaForCausalLM (vocab 97, dim 64, 2 layers) with weights of order one.

  Scaled rope uses original_max_position_embeddings=16, so the Llama-3
  scaling changes the frequencies at the tests' sequence lengths.
  """
  return random_hf_model("llama", n_kv_heads, tied, scaled)


def random_hf_model(family: str, n_kv_heads: int, tied: bool, scaled: bool, window: int = 0):
  """A float32 LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM (`family`) of the
  shapes of random_hf_llama, with weights (biases too) of order one; `window` > 0 is a
  sliding window (on every layer)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  common = dict(
      vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=n_kv_heads, intermediate_size=128, rms_norm_eps=1e-5,
      max_position_embeddings=128, tie_word_embeddings=tied, attn_implementation="eager",
      rope_theta=10_000.0, rope_scaling=LLAMA3_ROPE if scaled else None)
  hf_cfg = {
      "llama": lambda: transformers.LlamaConfig(**common),
      "mistral": lambda: transformers.MistralConfig(**common, sliding_window=window or None),
      "qwen2": lambda: transformers.Qwen2Config(
          **common, use_sliding_window=bool(window), sliding_window=window or None,
          max_window_layers=0),
  }[family]()
  model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
  with torch.no_grad():
    # A tied head is the embedding's Parameter, so it is drawn once.
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1] if p.ndim > 1 else 4))
  return model


def params_from_hf(state_dict: dict, cfg) -> dict:
  """A jaxzero pure params dict (numpy float32) from a whole Hugging Face state dict."""
  layers_of: dict = {}
  for name, array in state_dict.items():
    mapped = tensors.hf_tensor_to_jaxzero(name, array, cfg)
    if mapped is not None:
      path, layer, value = mapped
      layers_of.setdefault(path, {})[layer] = value
  flat = {path: np.asarray(layers[None] if None in layers else
                           np.stack([layers[i] for i in range(cfg.n_layers)]), np.float32)
          for path, layers in layers_of.items()}
  return traverse_util.unflatten_dict(flat)


def hf_state_dict(params: dict, cfg) -> dict:
  """The Hugging Face state dict (numpy, dtype kept) of jaxzero params; a tied
  model has no ``lm_head.weight``, as in Hugging Face's own saved checkpoints."""
  return {name: array for path, leaf in traverse_util.flatten_dict(params).items()
          for name, array in tensors.jaxzero_to_hf_tensors(path, leaf, cfg)}

