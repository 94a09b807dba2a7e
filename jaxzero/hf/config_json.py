"""Hugging Face ``config.json`` <-> LlamaConfig, for Llama, Mistral and Qwen2 causal LMs.

Reads the transformers 4 and 5 layouts (RoPE at top level or in ``rope_parameters``) and
writes the transformers 4 one, which both read. A feature jaxzero does not model is a
ValueError naming the field. Reads no files (jaxzero.hf.load does); tensor names and
layouts are jaxzero.hf.tensors'.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxzero.models.llama import LlamaConfig


# LlamaConfig.family (= config.json's model_type) -> its causal-LM class.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "rms_norm_eps")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")
# transformers' rope_theta for Llama, Mistral and Qwen2 configs that omit it (Llama-2-era ones).
DEFAULT_ROPE_THETA = 10_000.0
# config.json fields jaxzero does not model, that Hugging Face generates by: carried over
# from the model a run started from (jaxzero.hf.metadata).
CARRIED_FIELDS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")

# LlamaConfig field -> where config.json keeps it ("a.b": field b of dict a).
_HF_FIELDS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "mlp_dim": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "rope_scaling_factor": "rope_scaling.factor",
    "rope_low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_original_max_len": "rope_scaling.original_max_position_embeddings",
}
# Fields that do nothing while llama3 scaling is off (factor <= 1).
_SCALING_FIELDS = tuple(name for name, hf_name in _HF_FIELDS.items()
                        if hf_name.startswith("rope_scaling."))


def llama_config_from_hf(hf_config: Mapping[str, Any]) -> LlamaConfig:
  """Builds a LlamaConfig from a Hugging Face ``config.json`` dict.

  Reads both the transformers 4 layout (top-level ``rope_theta`` plus
  ``rope_scaling``) and the transformers 5 one (``rope_parameters``), of a
  Llama, Mistral or Qwen2 causal LM.

  Raises:
    ValueError: naming the field, when the config is not one of those causal
      LMs, a required field is missing, or it uses a feature jaxzero does not model.
  """
  family = _check_architecture(hf_config)
  for field in _REQUIRED_FIELDS:
    if hf_config.get(field) is None:
      raise ValueError(f"Hugging Face config is missing required field {field!r}")
  _check_unsupported(hf_config, family)
  size = lambda field: _integer(hf_config, field)
  n_heads = size("num_attention_heads")
  # Hugging Face's own meaning of an absent/null num_key_value_heads is plain
  # multi-head attention (Llama-1/2 configs omit it).
  n_kv_heads = hf_config.get("num_key_value_heads")
  cfg = LlamaConfig(
      vocab_size=size("vocab_size"), dim=size("hidden_size"),
      n_layers=size("num_hidden_layers"), n_heads=n_heads,
      n_kv_heads=n_heads if n_kv_heads is None else size("num_key_value_heads"),
      mlp_dim=size("intermediate_size"), norm_eps=_positive_float(hf_config, "rms_norm_eps"),
      # transformers' configs default to untied; they always write the field.
      tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
      init_std=_positive_float({"initializer_range": LlamaConfig.init_std, **hf_config},
                               "initializer_range"),
      family=family, qkv_bias=family == "qwen2",
      sliding_window=_sliding_window_from_hf(hf_config, family),
      **_rope_fields_from_hf(hf_config))
  try:
    cfg.validate()
  except ValueError as e:
    raise ValueError(f"Hugging Face config is not a valid jaxzero model: {e}") from e
  head_dim = hf_config.get("head_dim")
  if head_dim is not None and _integer(hf_config, "head_dim") != cfg.head_dim:
    raise ValueError(f"Hugging Face config field 'head_dim'={head_dim} differs from hidden_size"
                     f" // num_attention_heads = {cfg.head_dim}; jaxzero derives head_dim")
  return cfg


def hf_config_from_llama(cfg: LlamaConfig, *, carried: Mapping[str, Any] | None = None
                        ) -> dict[str, Any]:
  """The Hugging Face ``config.json`` dict for ``cfg`` (inverse of llama_config_from_hf).

  RoPE is written in the transformers 4 layout (``rope_theta`` +
  ``rope_scaling``), which transformers 5 also reads. ``cfg.family`` picks the
  architecture; a Qwen2 window is written as every layer's (``max_window_layers=0``).
  ``carried`` gives CARRIED_FIELDS (the base model's: carried_fields). Without it,
  ``max_position_embeddings`` (no jaxzero field: Hugging Face sizes caches by it) is the
  context length the RoPE settings were made for: ``rope_original_max_len``, times the
  scaling factor when scaling is on; the special tokens' ids are left out.
  """
  cfg.validate()
  scaled = cfg.rope_scaling_factor >= 1.0
  carried = carried_fields(carried or {})
  max_position_embeddings = carried.pop("max_position_embeddings", None)
  if max_position_embeddings is None:
    factor = cfg.rope_scaling_factor if scaled else 1.0
    max_position_embeddings = int(cfg.rope_original_max_len * factor)
  window = cfg.sliding_window or None
  hf_config: dict[str, Any] = {
      "architectures": [ARCHITECTURES[cfg.family]],
      "model_type": cfg.family,
      **{hf_name: getattr(cfg, name) for name, hf_name in _HF_FIELDS.items()
         if "." not in hf_name},
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": max_position_embeddings,
      "initializer_range": cfg.init_std,
      **{"llama": {"attention_bias": False, "mlp_bias": False},
         "mistral": {"sliding_window": window},
         "qwen2": {"use_sliding_window": window is not None, "sliding_window": window,
                   "max_window_layers": 0 if window else cfg.n_layers}}[cfg.family],
      **carried,
  }
  # jaxzero.models.llama treats factor <= 1 as "off"; exactly 1 is still exported as
  # llama3 (an identity in both libraries) so that the config round-trips.
  if scaled:
    hf_config["rope_scaling"] = {"rope_type": "llama3", **{
        hf_name.split(".")[1]: getattr(cfg, name) for name, hf_name in _HF_FIELDS.items()
        if hf_name.startswith("rope_scaling.")}}
  return hf_config


def carried_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """The CARRIED_FIELDS a Hugging Face ``config.json`` dict sets: a token id set to null
  too (no such token, where transformers would otherwise assume its default id)."""
  return {k: hf_config[k] for k in CARRIED_FIELDS
          if hf_config.get(k) is not None or (k.endswith("_token_id") and k in hf_config)}


def _integer(hf_config: Mapping[str, Any], field: str, least: int = 1) -> int:
  value = hf_config[field]
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) \
      or value < least:
    kind = "a positive integer" if least == 1 else f"an integer of at least {least}"
    raise ValueError(f"Hugging Face config field {field!r} is {value!r}; it must be {kind}")
  return int(value)


def _positive_float(hf_config: Mapping[str, Any], field: str) -> float:
  value = hf_config[field]
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    raise ValueError(f"Hugging Face config field {field!r} is {value!r}; it must be a "
                     "positive number")
  return float(value)


def _check_architecture(hf_config: Mapping[str, Any]) -> str:
  """The family (model_type) of a supported causal LM."""
  model_type = hf_config.get("model_type")
  if model_type not in ARCHITECTURES:
    raise ValueError(f"Hugging Face config field 'model_type' is {model_type!r}; supported: "
                     + ", ".join(map(repr, ARCHITECTURES)))
  # transformers writes architectures=None for configs built in memory.
  architecture = ARCHITECTURES[model_type]
  architectures = hf_config.get("architectures") or [architecture]
  if list(architectures) != [architecture]:
    raise ValueError(f"Hugging Face config field 'architectures' is {architectures!r}; "
                     f"only [{architecture!r}] is supported for model_type {model_type!r}")
  return model_type


def _check_unsupported(hf_config: Mapping[str, Any], family: str) -> None:
  """Rejects options that change the maths but that jaxzero.models.llama lacks."""
  if hf_config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"Hugging Face config field 'hidden_act' is {hf_config['hidden_act']!r}; "
                     "jaxzero's MLP is SwiGLU ('silu')")
  # Only Llama reads these (Qwen2's q/k/v biases are always there, Mistral has none).
  for field in ("attention_bias", "mlp_bias") if family == "llama" else ():
    if hf_config.get(field):
      raise ValueError(f"Hugging Face config field {field!r} is true; jaxzero has no such biases")


# MistralConfig's and Qwen2Config's default for an absent ``sliding_window``.
HF_DEFAULT_SLIDING_WINDOW = 4096


def _sliding_window_from_hf(hf_config: Mapping[str, Any], family: str) -> int:
  """LlamaConfig.sliding_window, as transformers applies it: Mistral's
  ``sliding_window`` (null: none; absent: transformers' default, 4096); Qwen2's when
  ``use_sliding_window``, on the layers ``layer_types`` names, by default those from
  ``max_window_layers`` (28) on."""
  window = hf_config.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW)
  if family == "llama" or window is None or (
      family == "qwen2" and not hf_config.get("use_sliding_window", False)):
    return 0
  if family == "qwen2":
    key = "layer_types" if hf_config.get("layer_types") else "max_window_layers"
    types = list(hf_config.get("layer_types") or [
        "sliding_attention" if i >= _integer({"max_window_layers": 28, **hf_config},
                                             "max_window_layers", least=0) else "full"
        for i in range(int(hf_config["num_hidden_layers"]))])
    n_sliding = types.count("sliding_attention")
    if n_sliding == 0:
      return 0
    if n_sliding < len(types):
      raise ValueError(f"Hugging Face config field {key!r} gives {n_sliding} of {len(types)} "
                       "layers a sliding window; jaxzero gives every layer the same attention")
  if int(window) < 1:
    raise ValueError(f"Hugging Face config field 'sliding_window' is {window}; it must be "
                     "positive, or null for full attention")
  return int(window)


def _rope_fields_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """LlamaConfig rope_* fields. Mirrors transformers 5, where ``rope_scaling``
  takes priority over ``rope_parameters``, a top-level ``rope_theta`` fills in, and
  a config with neither (Llama 2's) has DEFAULT_ROPE_THETA."""
  rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
  if not isinstance(rope, Mapping):
    raise ValueError(f"Hugging Face config field 'rope_parameters' is not a dict: {rope!r}")
  theta = rope.get("rope_theta", hf_config.get("rope_theta"))
  if theta is None:
    theta = DEFAULT_ROPE_THETA
  partial = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
  if partial is not None and float(partial) != 1.0:
    raise ValueError(f"Hugging Face config field 'partial_rotary_factor' is {partial}; "
                     "jaxzero rotates the whole head")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return {"rope_theta": float(theta)}
  if rope_type != "llama3":
    raise ValueError(f"Hugging Face config field 'rope_type' is {rope_type!r}; "
                     "jaxzero supports 'default' and 'llama3'")
  for field in _LLAMA3_FIELDS:
    if rope.get(field) is None:
      raise ValueError(f"Hugging Face config is missing llama3 rope field {field!r}")
  # Same fallback as transformers when the pretraining length is not recorded.
  original = rope.get("original_max_position_embeddings",
                      hf_config.get("max_position_embeddings"))
  if original is None:
    raise ValueError("Hugging Face config is missing llama3 rope field "
                     "'original_max_position_embeddings' (and 'max_position_embeddings')")
  factor = float(rope["factor"])
  if factor < 1.0:
    # transformers would raise frequencies; jaxzero.models.llama would switch scaling off.
    raise ValueError(f"Hugging Face config llama3 rope field 'factor'={factor} is below 1")
  return {"rope_theta": float(theta), "rope_scaling_factor": factor,
          "rope_low_freq_factor": float(rope["low_freq_factor"]),
          "rope_high_freq_factor": float(rope["high_freq_factor"]),
          "rope_original_max_len": int(original)}


def check_config_matches(model: LlamaConfig, found: LlamaConfig, where: str) -> None:
  """Checks the run's model config against ``found``, read from the config.json
  at ``where``; a ValueError names the first ``model.*`` field that differs
  and the value that would match."""
  scaled = found.rope_scaling_factor > 1
  for name, hf_name in [("family", "model_type"), ("sliding_window", "sliding_window"),
                        *_HF_FIELDS.items()]:
    have, want = getattr(model, name), getattr(found, name)
    if name in _SCALING_FIELDS and not scaled:
      if model.rope_scaling_factor > 1:
        raise ValueError(
            f"model.rope_scaling_factor={model.rope_scaling_factor!r} but {where} has no llama3 "
            "rope_scaling; the model config must match the checkpoint "
            "(--set model.rope_scaling_factor=0, or a preset made for it)")
      continue
    if have != want:
      raise ValueError(
          f"model.{name}={have!r} but {where} has {hf_name}={want!r}; the model config must "
          f"match the checkpoint (--set model.{name}={want}, or a preset made for it)")
