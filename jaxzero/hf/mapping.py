"""Hugging Face Llama, Mistral and Qwen2 <-> jaxzero: config.json fields, tensor names, layouts.

The one place that knows Hugging Face's names (``_TENSORS``). Both directions are exact
inverses: a tensor only goes through a transpose and a reshape, never arithmetic, so a round
trip is bit-exact in any dtype. Arrays are numpy; nothing here reads or writes files
(jaxzero.hf.load does) or uses jax. The per-tensor functions return views where no
transpose is needed (norms, embedding), so treat their outputs as read-only.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import numpy as np

from jaxzero.models.llama import LlamaConfig, ParamSpec, is_param_spec, param_specs

Path = tuple[str, ...]


# LlamaConfig.family (= config.json's model_type) -> its causal-LM class.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM"}
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "rms_norm_eps")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")

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


# ----------------------------------------------------------------------------- config


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
  n_heads = int(hf_config["num_attention_heads"])
  # Hugging Face's own meaning of an absent/null num_key_value_heads is plain
  # multi-head attention (Llama-1/2 configs omit it).
  n_kv_heads = hf_config.get("num_key_value_heads")
  cfg = LlamaConfig(
      vocab_size=int(hf_config["vocab_size"]), dim=int(hf_config["hidden_size"]),
      n_layers=int(hf_config["num_hidden_layers"]), n_heads=n_heads,
      n_kv_heads=n_heads if n_kv_heads is None else int(n_kv_heads),
      mlp_dim=int(hf_config["intermediate_size"]), norm_eps=float(hf_config["rms_norm_eps"]),
      # transformers' configs default to untied; they always write the field.
      tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
      init_std=float(hf_config.get("initializer_range", LlamaConfig.init_std)),
      family=family, qkv_bias=family == "qwen2",
      sliding_window=_sliding_window_from_hf(hf_config, family),
      **_rope_fields_from_hf(hf_config))
  try:
    cfg.validate()
  except ValueError as e:
    raise ValueError(f"Hugging Face config is not a valid jaxzero model: {e}") from e
  head_dim = hf_config.get("head_dim")
  if head_dim is not None and int(head_dim) != cfg.head_dim:
    raise ValueError(f"Hugging Face config field 'head_dim'={head_dim} differs from hidden_size"
                     f" // num_attention_heads = {cfg.head_dim}; jaxzero derives head_dim")
  return cfg


def hf_config_from_llama(cfg: LlamaConfig, *, max_position_embeddings: int | None = None
                        ) -> dict[str, Any]:
  """The Hugging Face ``config.json`` dict for ``cfg`` (inverse of llama_config_from_hf).

  RoPE is written in the transformers 4 layout (``rope_theta`` +
  ``rope_scaling``), which transformers 5 also reads. ``cfg.family`` picks the
  architecture; a Qwen2 window is written as every layer's (``max_window_layers=0``).
  ``max_position_embeddings`` (no jaxzero field: Hugging Face sizes caches by it)
  defaults to the context length the RoPE settings were made for:
  ``rope_original_max_len``, times the scaling factor when scaling is on.
  """
  cfg.validate()
  scaled = cfg.rope_scaling_factor >= 1.0
  if max_position_embeddings is None:
    factor = cfg.rope_scaling_factor if scaled else 1.0
    max_position_embeddings = int(cfg.rope_original_max_len * factor)
  window = cfg.sliding_window or None
  hf_config: dict[str, Any] = {
      "architectures": [_ARCHITECTURES[cfg.family]],
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
  }
  # jaxzero.models.llama treats factor <= 1 as "off"; exactly 1 is still exported as
  # llama3 (an identity in both libraries) so that the config round-trips.
  if scaled:
    hf_config["rope_scaling"] = {"rope_type": "llama3", **{
        hf_name.split(".")[1]: getattr(cfg, name) for name, hf_name in _HF_FIELDS.items()
        if hf_name.startswith("rope_scaling.")}}
  return hf_config


def _check_architecture(hf_config: Mapping[str, Any]) -> str:
  """The family (model_type) of a supported causal LM."""
  model_type = hf_config.get("model_type")
  if model_type not in _ARCHITECTURES:
    raise ValueError(f"Hugging Face config field 'model_type' is {model_type!r}; supported: "
                     + ", ".join(map(repr, _ARCHITECTURES)))
  # transformers writes architectures=None for configs built in memory.
  architecture = _ARCHITECTURES[model_type]
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


def _sliding_window_from_hf(hf_config: Mapping[str, Any], family: str) -> int:
  """LlamaConfig.sliding_window, as transformers applies it: Mistral's
  ``sliding_window`` (null: none); Qwen2's when ``use_sliding_window``, on the
  layers ``layer_types`` names, by default those from ``max_window_layers`` (28) on."""
  window = hf_config.get("sliding_window")
  if family == "llama" or window is None or (
      family == "qwen2" and not hf_config.get("use_sliding_window", False)):
    return 0
  if family == "qwen2":
    key = "layer_types" if hf_config.get("layer_types") else "max_window_layers"
    types = list(hf_config.get("layer_types") or [
        "sliding_attention" if i >= int(hf_config.get("max_window_layers", 28)) else "full"
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
  takes priority over ``rope_parameters`` and a top-level ``rope_theta`` fills in."""
  rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
  if not isinstance(rope, Mapping):
    raise ValueError(f"Hugging Face config field 'rope_parameters' is not a dict: {rope!r}")
  theta = rope.get("rope_theta", hf_config.get("rope_theta"))
  if theta is None:
    raise ValueError("Hugging Face config is missing required field 'rope_theta' "
                     "(looked at top level and in 'rope_parameters'/'rope_scaling')")
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


# ----------------------------------------------------------------------------- tensors


class _Tensor(NamedTuple):
  """How one Hugging Face tensor maps onto one jaxzero leaf."""
  path: Path
  # For Linear weights: how many leading axes of the jaxzero (per-layer) array
  # make up the HF "in" axis. None: same layout on both sides. 0: a bias, whose
  # jaxzero axes are flattened into HF's one.
  n_in_axes: int | None


# Hugging Face name -> jaxzero leaf; "{}" stands for the layer index of the
# leaves stacked under "layers".
_TENSORS = {
    "model.embed_tokens.weight": _Tensor(("embed_VxD",), None),
    "model.layers.{}.self_attn.q_proj.weight": _Tensor(("layers", "wq_LxDxHxE"), 1),
    "model.layers.{}.self_attn.k_proj.weight": _Tensor(("layers", "wk_LxDxKxE"), 1),
    "model.layers.{}.self_attn.v_proj.weight": _Tensor(("layers", "wv_LxDxKxE"), 1),
    "model.layers.{}.self_attn.o_proj.weight": _Tensor(("layers", "wo_LxHxExD"), 2),
    "model.layers.{}.self_attn.q_proj.bias": _Tensor(("layers", "bq_LxHxE"), 0),
    "model.layers.{}.self_attn.k_proj.bias": _Tensor(("layers", "bk_LxKxE"), 0),
    "model.layers.{}.self_attn.v_proj.bias": _Tensor(("layers", "bv_LxKxE"), 0),
    "model.layers.{}.mlp.gate_proj.weight": _Tensor(("layers", "w_gate_LxDxF"), 1),
    "model.layers.{}.mlp.up_proj.weight": _Tensor(("layers", "w_up_LxDxF"), 1),
    "model.layers.{}.mlp.down_proj.weight": _Tensor(("layers", "w_down_LxFxD"), 1),
    "model.layers.{}.input_layernorm.weight": _Tensor(("layers", "attn_norm"), None),
    "model.layers.{}.post_attention_layernorm.weight": _Tensor(("layers", "mlp_norm"), None),
    "model.norm.weight": _Tensor(("final_norm",), None),
    "lm_head.weight": _Tensor(("lm_head_DxV",), 1),
}
_TEMPLATE_OF = {t.path: name for name, t in _TENSORS.items()}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Derived RoPE buffers that old (transformers < 4.31) checkpoints saved per layer.
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


def carries_no_weight(name: str, cfg: LlamaConfig) -> bool:
  """True for checkpoint tensors jaxzero has no parameter for: a tied model's
  ``lm_head.weight`` (a copy of the embedding) and legacy ``rotary_emb.inv_freq``
  buffers."""
  return name.endswith(_IGNORED_SUFFIX) or (name == "lm_head.weight" and cfg.tie_embeddings)


def hf_tensor_to_jaxzero(name: str, array: np.ndarray, cfg: LlamaConfig
                        ) -> tuple[Path, int | None, np.ndarray] | None:
  """Maps one Hugging Face tensor (state-dict ``name``, e.g.
  ``model.layers.3.mlp.up_proj.weight``; ``array`` of any dtype, kept) onto jaxzero.

  Returns ``(path, layer, array)``: the jaxzero leaf path (e.g. ``("layers",
  "w_up_LxDxF")``), the layer index into its leading axis (None for leaves that
  are not stacked), and the array in jaxzero layout (per layer); None for
  tensors that carry no jaxzero parameter (see carries_no_weight). Raises
  KeyError when the name is not a tensor of ``cfg``'s model or its layer is out
  of range, ValueError when the array's shape is wrong for ``cfg``.
  """
  if carries_no_weight(name, cfg):
    return None
  tensor, layer = _lookup(name, cfg)
  shape = _layer_shape(cfg, tensor.path)
  want = _hf_shape(shape, tensor.n_in_axes)
  array = np.asarray(array)
  if array.shape != want:
    raise ValueError(f"Hugging Face tensor {name!r} has shape {array.shape}, expected {want}")
  if tensor.n_in_axes is not None:
    array = array.T.reshape(shape)
  return tensor.path, layer, np.ascontiguousarray(array)


def jaxzero_to_hf_tensors(path: Path, array: np.ndarray, cfg: LlamaConfig
                         ) -> Iterator[tuple[str, np.ndarray]]:
  """Maps one jaxzero leaf (stacked over layers if under ``layers``) to HF tensors.

  Returns a lazy iterator of ``(hf_name, array)`` in Hugging Face layout (dtype
  kept), one per layer for stacked leaves, in layer order, so a big stacked leaf
  is converted one layer at a time. Raises KeyError when ``path`` is not a
  jaxzero parameter for ``cfg``, ValueError when the array's shape is wrong.
  """
  path = tuple(path)
  spec = _spec(cfg, path)
  stacked = path[0] == "layers"
  # A stacked leaf may be any array-like that reads one layer when indexed
  # (export passes such a reader), so it is not converted to numpy whole.
  array = array if hasattr(array, "shape") and stacked else np.asarray(array)
  if tuple(array.shape) != spec.shape:
    raise ValueError(f"jaxzero parameter {'/'.join(path)!r} has shape {tuple(array.shape)}, "
                     f"expected {spec.shape}")
  tensor = _TENSORS[_TEMPLATE_OF[path]]
  if not stacked:
    return iter([(_hf_name(path, None), _to_hf_layout(array, tensor))])
  # A generator made after the checks above, so that errors surface at the call.
  return ((_hf_name(path, i), _to_hf_layout(array[i], tensor)) for i in range(cfg.n_layers))


def hf_tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """{Hugging Face name: shape} of every tensor a checkpoint of ``cfg`` holds (a tied
  model: no ``lm_head.weight``), leaf by leaf in param_specs order, layers in order (the
  order export writes them)."""
  shapes = {}
  for path in _flat_specs(cfg):
    shape = _hf_shape(_layer_shape(cfg, path), _TENSORS[_TEMPLATE_OF[path]].n_in_axes)
    for layer in range(cfg.n_layers) if path[0] == "layers" else [None]:
      shapes[_hf_name(path, layer)] = shape
  return shapes


def read_leaf_block(cfg: LlamaConfig, path: Path, index: tuple[slice, ...],
                    read: Callable[[str, tuple[slice, ...]], np.ndarray],
                    dtype: Any) -> np.ndarray:
  """Block ``index`` (a slice with start and stop per dimension) of jaxzero leaf
  ``path``, in ``dtype``, from ``read(hf_name, hf_index)``, which returns
  ``tensor[hf_index]`` of one Hugging Face tensor (e.g. SafetensorsReader.read).
  It is asked for one layer's tensor at a time, and for only the part of it
  that ``index`` needs where the layout allows."""
  tensor = _TENSORS[_TEMPLATE_OF[path]]
  shape = _layer_shape(cfg, path)
  if path[0] != "layers":
    return _read_block(read, _hf_name(path, None), tensor, shape, index).astype(dtype)
  out = np.empty([s.stop - s.start for s in index], dtype)
  for i, layer in enumerate(range(index[0].start, index[0].stop)):
    out[i] = _read_block(read, _hf_name(path, layer), tensor, shape, index[1:])
  return out


def _read_block(read, name: str, tensor: _Tensor, shape: tuple[int, ...],
                index: tuple[slice, ...]) -> np.ndarray:
  """``jaxzero_layout(tensor)[index]``, reading only what `index` needs.

  A Linear weight is stored as [prod(out dims), prod(in dims)], a bias as
  [prod(out dims)]. Slicing the leading dim of a group is a contiguous range of
  the flattened group (the usual case: ZeRO splits `embed`, which leads its
  group), so it is read directly; slices of the other dims are taken after.
  """
  if tensor.n_in_axes is None:
    return read(name, index)
  if tensor.n_in_axes == 0:  # a bias
    block = read(name, (_flat_range(shape, index),)).reshape(-1, *shape[1:])
    return block[(slice(None), *index[1:])]
  k = tensor.n_in_axes
  rows = _flat_range(shape[k:], index[k:])
  cols = _flat_range(shape[:k], index[:k])
  block = read(name, (rows, cols)).T
  lead_in, lead_out = index[0].stop - index[0].start, index[k].stop - index[k].start
  block = block.reshape(lead_in, *shape[1:k], lead_out, *shape[k + 1:])
  return block[(slice(None), *index[1:k], slice(None), *index[k + 1:])]


def _flat_range(shape: tuple[int, ...], index: tuple[slice, ...]) -> slice:
  """The range of the flattened `shape` under the slice of its leading dim."""
  inner = math.prod(shape[1:])
  return slice(index[0].start * inner, index[0].stop * inner)


def _lookup(name: str, cfg: LlamaConfig) -> tuple[_Tensor, int | None]:
  """The mapping entry and layer index for an HF name."""
  template, layer = name, None
  match = _LAYER_NAME.fullmatch(name)
  if match:
    template, layer = f"model.layers.{{}}.{match.group(2)}", int(match.group(1))
  if template not in _TENSORS or _TENSORS[template].path not in _flat_specs(cfg):
    raise KeyError(f"{name!r} is not a tensor of this {_ARCHITECTURES[cfg.family]}")
  if layer is not None and layer >= cfg.n_layers:
    raise KeyError(f"{name!r}: layer {layer} is out of range for n_layers={cfg.n_layers}")
  return _TENSORS[template], layer


def _to_hf_layout(array: np.ndarray, tensor: _Tensor) -> np.ndarray:
  if tensor.n_in_axes is None:
    return np.ascontiguousarray(array)
  n_in = math.prod(array.shape[:tensor.n_in_axes])
  hf_shape = _hf_shape(array.shape, tensor.n_in_axes)
  return np.ascontiguousarray(array.reshape(n_in, -1).T).reshape(hf_shape)


def _hf_shape(shape: tuple[int, ...], n_in_axes: int | None) -> tuple[int, ...]:
  """[out, in] of a Linear weight, [out] of a bias (n_in_axes 0)."""
  if n_in_axes is None:
    return shape
  n_in = (math.prod(shape[:n_in_axes]),) if n_in_axes else ()
  return (math.prod(shape[n_in_axes:]), *n_in)


def _hf_name(path: Path, layer: int | None) -> str:
  return _TEMPLATE_OF[path].format(layer)


def _layer_shape(cfg: LlamaConfig, path: Path) -> tuple[int, ...]:
  """Shape of one layer's slice of a stacked leaf, or of the whole unstacked leaf."""
  shape = _spec(cfg, path).shape
  return shape[1:] if path[0] == "layers" else shape


def _spec(cfg: LlamaConfig, path: Path) -> ParamSpec:
  specs = _flat_specs(cfg)
  if path not in specs:
    raise KeyError(f"{'/'.join(path)!r} is not a jaxzero parameter for this config "
                   f"(tie_embeddings={cfg.tie_embeddings})")
  return specs[path]


def _flat_specs(cfg: LlamaConfig) -> dict[Path, ParamSpec]:
  """{leaf path: spec} in param_specs order."""
  flat = {}
  for key, value in param_specs(cfg).items():
    if is_param_spec(value):
      flat[(key,)] = value
    else:
      flat.update({(key, name): spec for name, spec in value.items()})
  return flat
