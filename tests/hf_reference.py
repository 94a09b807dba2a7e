"""A random tiny Hugging Face Llama, the reference the model and loader tests compare to."""

import math

import pytest

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)


def random_hf_llama(n_kv_heads: int, tied: bool, scaled: bool):
  """A float32 LlamaForCausalLM (vocab 97, dim 64, 2 layers) with weights of order one.

  Scaled rope uses original_max_position_embeddings=16, so the Llama-3
  scaling changes the frequencies at the tests' sequence lengths.
  """
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf_cfg = transformers.LlamaConfig(
      vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=n_kv_heads, intermediate_size=128, rms_norm_eps=1e-5,
      max_position_embeddings=128, tie_word_embeddings=tied, attn_implementation="eager",
      rope_theta=10_000.0, rope_scaling=LLAMA3_ROPE if scaled else None)
  model = transformers.LlamaForCausalLM(hf_cfg).float().eval()
  with torch.no_grad():
    # A tied head is the embedding's Parameter, so it is drawn once.
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
              else torch.randn_like(p) / math.sqrt(p.shape[1]))
  return model
