"""Hugging Face Llama <-> jaxzero: config fields, tensor names and layouts.

This is the single mapping shared by checkpoint import and export, so both
directions are written next to each other and are exact inverses: a tensor
only ever goes through a transpose and a reshape, never arithmetic, so a round
trip is bit-exact in any dtype.

Layouts (per layer; jaxzero stacks layers on a leading ``L`` axis):

=====================================  =================  ==================
Hugging Face name                      HF shape           jaxzero leaf
=====================================  =================  ==================
model.embed_tokens.weight              [V, D]             embed_VxD [V, D]
model.layers.{i}.self_attn.q_proj      [H*E, D]           wq [D, H, E]
model.layers.{i}.self_attn.k_proj      [K*E, D]           wk [D, K, E]
model.layers.{i}.self_attn.v_proj      [K*E, D]           wv [D, K, E]
model.layers.{i}.self_attn.o_proj      [D, H*E]           wo [H, E, D]
model.layers.{i}.mlp.gate_proj         [F, D]             w_gate [D, F]
model.layers.{i}.mlp.up_proj           [F, D]             w_up [D, F]
model.layers.{i}.mlp.down_proj         [D, F]             w_down [F, D]
model.layers.{i}.input_layernorm       [D]                attn_norm [D]
model.layers.{i}.post_attention_...    [D]                mlp_norm [D]
model.norm.weight                      [D]                final_norm [D]
lm_head.weight                         [V, D]             lm_head_DxV [D, V]
=====================================  =================  ==================

A ``torch.nn.Linear`` weight is [out, in]; jaxzero keeps [in..., out...] so the
forward is a plain einsum. No head permutation is needed: models.llama applies
rotate-half RoPE, which is the layout Hugging Face checkpoints are stored in.

Arrays are numpy; this module never imports torch, so it also serves
safetensors files read with ``safetensors.numpy``. The per-tensor functions
return views where no transpose is needed (norms, embedding), so treat their
outputs as read-only; params_from_hf_state_dict always copies.

Loading a checkpoint directory (``load_llama``, ``load_params``, and
``init_state`` for ``model.hf_checkpoint``) reads the safetensors files one
tensor, or one slice of a tensor, at a time, straight into each device's
shard, so the host never holds the whole model.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxzero import step as step_lib
from jaxzero.config import Config
from jaxzero.data import DataError
from jaxzero import zero
from jaxzero.zero import Layout
from models.llama import Llama, LlamaConfig, ParamSpec, is_param_spec, param_specs

Path = tuple[str, ...]

_ARCHITECTURE = "LlamaForCausalLM"
_MODEL_TYPE = "llama"
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "rms_norm_eps")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


# ----------------------------------------------------------------------------- config


def llama_config_from_hf(hf_config: Mapping[str, Any]) -> LlamaConfig:
  """Builds a LlamaConfig from a Hugging Face ``config.json`` dict.

  Reads both the transformers 4 layout (top-level ``rope_theta`` plus
  ``rope_scaling``) and the transformers 5 one (``rope_parameters``).

  Raises:
    ValueError: naming the field, when the config is not a Llama causal LM, a
      required field is missing, or it uses a feature jaxzero does not model.
  """
  _check_architecture(hf_config)
  for field in _REQUIRED_FIELDS:
    if hf_config.get(field) is None:
      raise ValueError(f"Hugging Face config is missing required field {field!r}")
  _check_unsupported(hf_config)
  n_heads = int(hf_config["num_attention_heads"])
  # Hugging Face's own meaning of an absent/null num_key_value_heads is plain
  # multi-head attention (Llama-1/2 configs omit it).
  n_kv_heads = hf_config.get("num_key_value_heads")
  cfg = LlamaConfig(
      vocab_size=int(hf_config["vocab_size"]),
      dim=int(hf_config["hidden_size"]),
      n_layers=int(hf_config["num_hidden_layers"]),
      n_heads=n_heads,
      n_kv_heads=n_heads if n_kv_heads is None else int(n_kv_heads),
      mlp_dim=int(hf_config["intermediate_size"]),
      norm_eps=float(hf_config["rms_norm_eps"]),
      # transformers' LlamaConfig defaults to untied; it always writes the field.
      tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
      init_std=float(hf_config.get("initializer_range", LlamaConfig.init_std)),
      **_rope_fields_from_hf(hf_config),
  )
  try:
    cfg.validate()
  except ValueError as e:
    raise ValueError(f"Hugging Face config is not a valid jaxzero Llama: {e}") from e
  head_dim = hf_config.get("head_dim")
  if head_dim is not None and int(head_dim) != cfg.head_dim:
    raise ValueError(f"Hugging Face config field 'head_dim'={head_dim} differs from "
                     f"hidden_size // num_attention_heads = {cfg.head_dim}; "
                     "jaxzero derives head_dim")
  return cfg


def hf_config_from_llama(cfg: LlamaConfig, *, max_position_embeddings: int | None = None
                        ) -> dict[str, Any]:
  """The Hugging Face ``config.json`` dict for ``cfg`` (inverse of llama_config_from_hf).

  RoPE is written in the transformers 4 layout (``rope_theta`` +
  ``rope_scaling``), which transformers 5 also reads.

  Args:
    cfg: the jaxzero model config.
    max_position_embeddings: jaxzero has no such field (it only matters to
      Hugging Face for cache sizing); defaults to the context length the RoPE
      settings were made for: ``rope_original_max_len``, times the scaling
      factor when scaling is on.
  """
  cfg.validate()
  scaled = cfg.rope_scaling_factor >= 1.0
  if max_position_embeddings is None:
    factor = cfg.rope_scaling_factor if scaled else 1.0
    max_position_embeddings = int(cfg.rope_original_max_len * factor)
  hf_config: dict[str, Any] = {
      "architectures": [_ARCHITECTURE],
      "model_type": _MODEL_TYPE,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "max_position_embeddings": max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings,
      "initializer_range": cfg.init_std,
  }
  # models.llama treats factor <= 1 as "off"; exactly 1 is still exported as
  # llama3 (an identity in both libraries) so that the config round-trips.
  if scaled:
    hf_config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": cfg.rope_scaling_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_len,
    }
  return hf_config


def _check_architecture(hf_config: Mapping[str, Any]) -> None:
  model_type = hf_config.get("model_type")
  if model_type != _MODEL_TYPE:
    raise ValueError(f"Hugging Face config field 'model_type' is {model_type!r}; "
                     f"only {_MODEL_TYPE!r} is supported")
  # transformers writes architectures=None for configs built in memory.
  architectures = hf_config.get("architectures") or [_ARCHITECTURE]
  if list(architectures) != [_ARCHITECTURE]:
    raise ValueError(f"Hugging Face config field 'architectures' is {architectures!r}; "
                     f"only [{_ARCHITECTURE!r}] is supported")


def _check_unsupported(hf_config: Mapping[str, Any]) -> None:
  """Rejects Llama options that change the maths but that models.llama lacks."""
  if hf_config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"Hugging Face config field 'hidden_act' is {hf_config['hidden_act']!r}; "
                     "jaxzero's MLP is SwiGLU ('silu')")
  for field in ("attention_bias", "mlp_bias"):
    if hf_config.get(field):
      raise ValueError(f"Hugging Face config field {field!r} is true; jaxzero has no biases")


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
    # transformers would raise frequencies; models.llama would switch scaling off.
    raise ValueError(f"Hugging Face config llama3 rope field 'factor'={factor} is below 1")
  return {
      "rope_theta": float(theta),
      "rope_scaling_factor": factor,
      "rope_low_freq_factor": float(rope["low_freq_factor"]),
      "rope_high_freq_factor": float(rope["high_freq_factor"]),
      "rope_original_max_len": int(original),
  }


# ----------------------------------------------------------------------------- tensors


class _Tensor(NamedTuple):
  """How one Hugging Face tensor maps onto one jaxzero leaf."""
  path: Path
  # For Linear weights: how many leading axes of the jaxzero (per-layer) array
  # make up the HF "in" axis. None: same layout on both sides.
  n_in_axes: int | None


_TOP_TENSORS = {
    "model.embed_tokens.weight": _Tensor(("embed_VxD",), None),
    "model.norm.weight": _Tensor(("final_norm",), None),
    "lm_head.weight": _Tensor(("lm_head_DxV",), 1),
}
# Names below "model.layers.{i}.".
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": _Tensor(("layers", "wq_LxDxHxE"), 1),
    "self_attn.k_proj.weight": _Tensor(("layers", "wk_LxDxKxE"), 1),
    "self_attn.v_proj.weight": _Tensor(("layers", "wv_LxDxKxE"), 1),
    "self_attn.o_proj.weight": _Tensor(("layers", "wo_LxHxExD"), 2),
    "mlp.gate_proj.weight": _Tensor(("layers", "w_gate_LxDxF"), 1),
    "mlp.up_proj.weight": _Tensor(("layers", "w_up_LxDxF"), 1),
    "mlp.down_proj.weight": _Tensor(("layers", "w_down_LxFxD"), 1),
    "input_layernorm.weight": _Tensor(("layers", "attn_norm"), None),
    "post_attention_layernorm.weight": _Tensor(("layers", "mlp_norm"), None),
}
_PATH_TO_TOP = {t.path: name for name, t in _TOP_TENSORS.items()}
_PATH_TO_LAYER = {t.path: suffix for suffix, t in _LAYER_TENSORS.items()}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Derived RoPE buffers that old (transformers < 4.31) checkpoints saved per layer.
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


def hf_tensor_to_jaxzero(name: str, array: np.ndarray, cfg: LlamaConfig
                        ) -> tuple[Path, int | None, np.ndarray] | None:
  """Maps one Hugging Face tensor onto jaxzero.

  Args:
    name: Hugging Face state-dict name, e.g. ``model.layers.3.mlp.up_proj.weight``.
    array: the tensor, any dtype (kept).
    cfg: the model config, for shapes.

  Returns:
    ``(path, layer, array)``: the jaxzero leaf path (e.g. ``("layers",
    "w_up_LxDxF")``), the layer index into its leading axis (None for leaves
    that are not stacked), and the array in jaxzero layout (per layer). None
    for tensors that carry no jaxzero parameter: ``lm_head.weight`` of a
    tied model (a copy of the embedding) and legacy ``rotary_emb.inv_freq``
    buffers.

  Raises:
    KeyError: the name is not a Llama tensor, or its layer index is out of range.
    ValueError: the array's shape is wrong for ``cfg``.
  """
  if name.endswith(_IGNORED_SUFFIX):
    return None
  tensor, layer = _lookup(name, cfg)
  if tensor is None:
    return None
  spec = _spec(cfg, tensor.path)
  shape = spec.shape[1:] if layer is not None else spec.shape
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

  Returns:
    An iterator of ``(hf_name, array)`` in Hugging Face layout, one per layer
    for stacked leaves, in layer order. Dtype is kept. Lazy, so a big stacked
    leaf is converted one layer at a time.

  Raises:
    KeyError: ``path`` is not a jaxzero parameter for ``cfg``.
    ValueError: the array's shape is wrong for ``cfg``.
  """
  path = tuple(path)
  spec = _spec(cfg, path)
  # A stacked leaf may be any array-like that reads one layer when indexed
  # (export passes such a reader), so it is not converted to numpy whole.
  array = array if hasattr(array, "shape") and path not in _PATH_TO_TOP else np.asarray(array)
  if tuple(array.shape) != spec.shape:
    raise ValueError(f"jaxzero parameter {'/'.join(path)!r} has shape {tuple(array.shape)}, "
                     f"expected {spec.shape}")
  # Checked above, not in the generator, so errors surface at the call.
  return _leaf_to_hf(path, array, cfg)


def _leaf_to_hf(path: Path, array: np.ndarray, cfg: LlamaConfig
               ) -> Iterator[tuple[str, np.ndarray]]:
  if path in _PATH_TO_TOP:
    name = _PATH_TO_TOP[path]
    yield name, _to_hf_layout(array, _TOP_TENSORS[name])
    return
  suffix = _PATH_TO_LAYER[path]
  for i in range(cfg.n_layers):
    yield f"model.layers.{i}.{suffix}", _to_hf_layout(array[i], _LAYER_TENSORS[suffix])


def params_from_hf_state_dict(state_dict: Mapping[str, Any], cfg: LlamaConfig
                             ) -> dict[str, Any]:
  """A jaxzero pure params dict (numpy float32) from a whole HF state dict.

  The result can be passed to ``nnx.merge(graphdef, params)``.

  Raises:
    KeyError: a tensor is missing or unexpected (all of them are named).
    ValueError: a shape is wrong, or a tied model's ``lm_head.weight``
      differs from its embedding.
  """
  flat = {path: np.empty(spec.shape, np.float32) for path, spec in _flat_specs(cfg).items()}
  # np.empty: every slot is either written below or reported missing.
  unfilled = set(_slots(cfg))
  unexpected = []
  for name, array in state_dict.items():
    try:
      mapped = hf_tensor_to_jaxzero(name, array, cfg)
    except KeyError as e:
      unexpected.append(e.args[0])  # names the tensor and says why
      continue
    if mapped is None:
      continue
    path, layer, value = mapped
    if layer is None:
      flat[path][...] = value
    else:
      flat[path][layer] = value
    unfilled.discard((path, layer))
  if unexpected:
    raise KeyError("unexpected tensors in Hugging Face state dict: "
                   + "; ".join(sorted(unexpected)))
  if unfilled:
    missing = sorted(_hf_name(path, layer) for path, layer in unfilled)
    raise KeyError(f"tensors missing from Hugging Face state dict: {missing}")
  if cfg.tie_embeddings and "lm_head.weight" in state_dict:
    # A tied model's head is the embedding; a different one means the config is wrong.
    head = np.asarray(state_dict["lm_head.weight"], np.float32)
    if not np.array_equal(head, flat[("embed_VxD",)]):
      raise ValueError("tie_word_embeddings is set but 'lm_head.weight' differs from "
                       "'model.embed_tokens.weight'")
  return _unflatten(flat)


def hf_state_dict_from_params(params: Mapping[str, Any], cfg: LlamaConfig
                             ) -> dict[str, np.ndarray]:
  """A Hugging Face state dict (numpy, dtype kept) from a jaxzero pure params dict.

  A tied model gets no ``lm_head.weight``, as in Hugging Face's own saved
  checkpoints; pass ``strict=False`` to torch's ``load_state_dict``.

  Raises:
    KeyError: a parameter is missing or unexpected (all of them are named).
    ValueError: a shape is wrong.
  """
  flat = _flatten(params)
  specs = _flat_specs(cfg)
  unexpected = sorted("/".join(p) for p in flat.keys() - specs.keys())
  missing = sorted("/".join(p) for p in specs.keys() - flat.keys())
  if unexpected or missing:
    raise KeyError(f"jaxzero params do not match the config: missing {missing}, "
                   f"unexpected {unexpected}")
  state_dict = {}
  for path in specs:
    state_dict.update(jaxzero_to_hf_tensors(path, flat[path], cfg))
  return state_dict


def hf_tensor_names(cfg: LlamaConfig) -> list[str]:
  """Every Hugging Face tensor name that hf_state_dict_from_params produces."""
  return [_hf_name(path, layer) for path, layer in _slots(cfg)]


def _slots(cfg: LlamaConfig) -> Iterator[tuple[Path, int | None]]:
  """(jaxzero path, layer index or None) for every Hugging Face tensor."""
  for path in _flat_specs(cfg):
    layers = range(cfg.n_layers) if path[0] == "layers" else [None]
    for layer in layers:
      yield path, layer


def _lookup(name: str, cfg: LlamaConfig) -> tuple[_Tensor | None, int | None]:
  """The mapping entry and layer index for an HF name; (None, None) for a tied head."""
  if name in _TOP_TENSORS:
    if name == "lm_head.weight" and cfg.tie_embeddings:
      return None, None
    return _TOP_TENSORS[name], None
  match = _LAYER_NAME.fullmatch(name)
  if match is None or match.group(2) not in _LAYER_TENSORS:
    raise KeyError(f"{name!r} is not a Hugging Face Llama tensor name")
  layer = int(match.group(1))
  if layer >= cfg.n_layers:
    raise KeyError(f"{name!r}: layer {layer} is out of range for n_layers={cfg.n_layers}")
  return _LAYER_TENSORS[match.group(2)], layer


def _to_hf_layout(array: np.ndarray, tensor: _Tensor) -> np.ndarray:
  if tensor.n_in_axes is None:
    return np.ascontiguousarray(array)
  n_in = math.prod(array.shape[:tensor.n_in_axes])
  return np.ascontiguousarray(array.reshape(n_in, -1).T)


def _hf_shape(shape: tuple[int, ...], n_in_axes: int | None) -> tuple[int, ...]:
  if n_in_axes is None:
    return shape
  return (math.prod(shape[n_in_axes:]), math.prod(shape[:n_in_axes]))


def _hf_name(path: Path, layer: int | None) -> str:
  if layer is None:
    return _PATH_TO_TOP[path]
  return f"model.layers.{layer}.{_PATH_TO_LAYER[path]}"


def _spec(cfg: LlamaConfig, path: Path) -> ParamSpec:
  specs = _flat_specs(cfg)
  if path not in specs:
    raise KeyError(f"{'/'.join(path)!r} is not a jaxzero parameter for this config "
                   f"(tie_embeddings={cfg.tie_embeddings})")
  return specs[path]


def _flat_specs(cfg: LlamaConfig) -> dict[Path, ParamSpec]:
  return _flatten(param_specs(cfg), is_leaf=is_param_spec)


def _flatten(tree: Mapping[str, Any], prefix: Path = (), is_leaf=None) -> dict[Path, Any]:
  """Nested dict -> {path tuple: leaf}; nested Mappings are interior nodes by default."""
  is_leaf = is_leaf or (lambda x: not isinstance(x, Mapping))
  flat = {}
  for key, value in tree.items():
    path = prefix + (str(key),)
    if is_leaf(value):
      flat[path] = value
    else:
      flat.update(_flatten(value, path, is_leaf))
  return flat


def _unflatten(flat: Mapping[Path, Any]) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


# ----------------------------------------------------------------------------- checkpoints

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# jaxzero field -> where config.json keeps it, for error messages.
_HF_FIELD_NAMES = {
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
_SCALING_FIELDS = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_len")


class HFCheckpointError(DataError):
  """A Hugging Face checkpoint that cannot be loaded; the message names the file or tensor.

  A DataError, so the command line reports it in one line.
  """


def read_config(path: str | os.PathLike) -> LlamaConfig:
  """The LlamaConfig of a Hugging Face model directory, from its config.json."""
  file = _checkpoint_dir(path) / CONFIG_FILE
  if not file.is_file():
    raise HFCheckpointError(f"{file.parent}: no {CONFIG_FILE}; expected a Hugging Face model "
                          f"directory ({CONFIG_FILE} with {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE})")
  try:
    hf_config = json.loads(file.read_text())
  except ValueError as e:
    raise HFCheckpointError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(hf_config, dict):
    raise HFCheckpointError(f"{file}: not a JSON object")
  try:
    return llama_config_from_hf(hf_config)
  except ValueError as e:
    raise HFCheckpointError(f"{file}: {e}") from None


def check_matches(model: LlamaConfig, path: str | os.PathLike) -> LlamaConfig:
  """Checks the model config against a checkpoint's config.json; returns the latter.

  Raises:
    HFCheckpointError: naming the first ``model.*`` field that differs, and the
      value that would match.
  """
  found = read_config(path)
  scaled = found.rope_scaling_factor > 1
  for name, hf_name in _HF_FIELD_NAMES.items():
    have, want = getattr(model, name), getattr(found, name)
    if name in _SCALING_FIELDS and not scaled:
      if model.rope_scaling_factor > 1:
        raise HFCheckpointError(
            f"model.rope_scaling_factor={model.rope_scaling_factor!r} but "
            f"{_checkpoint_dir(path) / CONFIG_FILE} has no llama3 rope_scaling; the model "
            "config must match the checkpoint (--set model.rope_scaling_factor=0, or a "
            "preset made for it)")
      continue
    if have != want:
      raise HFCheckpointError(
          f"model.{name}={have!r} but {_checkpoint_dir(path) / CONFIG_FILE} has "
          f"{hf_name}={want!r}; the model config must match the checkpoint "
          f"(--set model.{name}={want!r}, or a preset made for it)")
  return found


def load_llama(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, *,
               dtype: Any = jnp.float32) -> Llama:
  """A models.llama.Llama holding a Hugging Face Llama checkpoint's weights.

  Args:
    path: the model directory: config.json and model.safetensors, or shards
      listed in model.safetensors.index.json.
    mesh: None puts the model on the default device; with a jaxzero mesh
      (jaxzero.mesh.make_mesh) every weight is sharded over all its devices,
      as ZeRO-3 keeps parameters at rest.
    dtype: of the weights (float32 or bfloat16).

  Returns:
    The model; ``model(tokens_BxT)`` on int32 tokens gives float32 logits [B, T, V].
  """
  cfg = read_config(path)
  if mesh is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  else:
    shardings = Layout(mesh, stage=3).tree_shardings(param_specs(cfg), "params")
  params = load_params(path, cfg, shardings, dtype)
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.split(abstract, nnx.Param)[0], params)


def load_params(path: str | os.PathLike, cfg: LlamaConfig, shardings: Any,
                dtype: Any = jnp.float32) -> dict[str, Any]:
  """Reads a Hugging Face Llama checkpoint straight into sharded jaxzero params.

  Each distinct shard of each leaf is read once, one Hugging Face tensor (or
  the slice of it the shard needs) at a time, and copied to the devices that
  hold it, so the host holds at most one tensor beyond the shards in flight.

  Args:
    path: the model directory (see load_llama).
    cfg: the model config; it must match config.json (see check_matches).
    shardings: one Sharding for every leaf, or a tree of them shaped like
      ``param_specs(cfg)``, e.g. ``layout.tree_shardings(param_specs(cfg),
      "optimizer")`` for the fp32 master weights; memory kinds are kept.
    dtype: of the result.

  Returns:
    A pure params dict of jax.Arrays, for ``nnx.merge(graphdef, params)``.

  Raises:
    HFCheckpointError: naming the file or tensor that is missing or wrong.
  """
  check_matches(cfg, path)
  specs = _flat_specs(cfg)
  leaf_shardings = _leaf_shardings(shardings, specs)
  with SafetensorsReader(path) as reader:
    _check_tensors(reader, cfg)
    flat = {p: _place(spec.shape, leaf_shardings[p],
                      functools.partial(_read_shard, reader, cfg, p, np.dtype(dtype)))
            for p, spec in specs.items()}
  return _unflatten(flat)


def init_state(cfg: Config, layout: Layout, tx: optax.GradientTransformation
              ) -> step_lib.TrainState:
  """Step 0 of a run that starts from ``cfg.model.hf_checkpoint``.

  Like step.init_state, with the same shardings, but the fp32 master weights
  are read from the checkpoint into the optimizer layout; the compute copy is
  cast from them and the Adam moments start at zero.
  """
  shardings = step_lib.state_shardings(cfg, layout, tx).state
  master = load_params(cfg.model.hf_checkpoint, cfg.model, shardings.master, jnp.float32)
  compute = step_lib.dtype_of(cfg.precision.compute)
  # Offloaded (pinned_host) master weights are brought over for the cast, as
  # the train step does.
  master_on_device = zero.on_device(shardings.master)

  @functools.partial(jax.jit, out_shardings=(shardings.params, shardings.opt_state))
  def derive(master):
    master = jax.device_put(master, master_on_device)
    return jax.tree.map(lambda w: w.astype(compute), master), tx.init(master)

  params, opt_state = derive(master)
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return step_lib.TrainState(step, params, master, opt_state)


class SafetensorsReader:
  """The tensors of one checkpoint directory, read one tensor or slice per call.

  safetensors memory-maps the files, so only what `read` returns is copied
  into host memory.
  """

  def __init__(self, path: str | os.PathLike):
    self.directory = _checkpoint_dir(path)
    self.file_of = _weight_map(self.directory)  # tensor name -> file
    sharded = (self.directory / WEIGHTS_INDEX_FILE).is_file()
    self.listing = WEIGHTS_INDEX_FILE if sharded else WEIGHTS_FILE  # where names are listed
    self._files = contextlib.ExitStack()
    self._open: dict[pathlib.Path, tuple[Any, frozenset[str]]] = {}

  def __enter__(self) -> SafetensorsReader:
    return self

  def __exit__(self, *exc) -> None:
    self._files.close()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """``tensor[index]`` of one tensor, in the checkpoint's dtype."""
    return self._slice(name)[index]

  def _slice(self, name: str):
    file = self.file_of.get(name)
    if file is None:
      raise HFCheckpointError(f"{self.directory}: tensor {name!r} is missing (not in "
                            f"{self.listing})")
    handle, names = self._handle(file)
    if name not in names:
      raise HFCheckpointError(f"{file}: tensor {name!r} is missing "
                            f"({WEIGHTS_INDEX_FILE} lists it in this file)")
    return handle.get_slice(name)

  def _handle(self, file: pathlib.Path):
    if file not in self._open:
      from safetensors import safe_open  # pylint: disable=import-outside-toplevel
      try:
        handle = self._files.enter_context(safe_open(str(file), framework="numpy"))
      except Exception as e:  # SafetensorError, OSError
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({e})") from None
      self._open[file] = handle, frozenset(handle.keys())
    return self._open[file]


def _checkpoint_dir(path: str | os.PathLike) -> pathlib.Path:
  directory = pathlib.Path(path).expanduser()
  if not directory.is_dir():
    raise HFCheckpointError(f"Hugging Face checkpoint {str(path)!r} is not a directory")
  return directory


def _weight_map(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """Tensor name -> safetensors file, from the shard index or the single file."""
  index_file, single = directory / WEIGHTS_INDEX_FILE, directory / WEIGHTS_FILE
  if index_file.is_file():
    try:
      weight_map = json.loads(index_file.read_text())["weight_map"]
      files = {name: directory / file for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise HFCheckpointError(f"{index_file}: no valid 'weight_map' ({e!r})") from None
    for file in sorted(set(files.values())):
      if not file.is_file():
        raise HFCheckpointError(f"{file}: no such file ({index_file.name} lists it)")
    return files
  if single.is_file():
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    try:
      with safe_open(str(single), framework="numpy") as handle:
        return {name: single for name in handle.keys()}
    except Exception as e:  # SafetensorError, OSError
      raise HFCheckpointError(f"{single}: not a readable safetensors file ({e})") from None
  raise HFCheckpointError(f"{directory}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} "
                        "(only safetensors checkpoints can be read)")


def _check_tensors(reader: SafetensorsReader, cfg: LlamaConfig) -> None:
  """Fails before any loading if a tensor is missing, misshapen or unexpected."""
  wanted = set()
  for path, layer in _slots(cfg):
    name = _hf_name(path, layer)
    wanted.add(name)
    want = _hf_shape(_layer_shape(cfg, path), _tensor_of(path).n_in_axes)
    have = reader.shape(name)
    if have != want:
      raise HFCheckpointError(f"{reader.file_of[name]}: tensor {name!r} has shape {have}, "
                            f"expected {want} from {CONFIG_FILE}")
  ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
  unexpected = sorted(n for n in reader.file_of.keys() - wanted - ignored
                      if not n.endswith(_IGNORED_SUFFIX))
  if unexpected:
    more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
    raise HFCheckpointError(f"{reader.directory}: tensors that a Llama with this "
                          f"{CONFIG_FILE} does not have: {', '.join(unexpected[:3])}{more}")


def _tensor_of(path: Path) -> _Tensor:
  return _TOP_TENSORS[_PATH_TO_TOP[path]] if path in _PATH_TO_TOP else \
      _LAYER_TENSORS[_PATH_TO_LAYER[path]]


def _layer_shape(cfg: LlamaConfig, path: Path) -> tuple[int, ...]:
  """Shape of one layer's slice of a stacked leaf, or of the whole unstacked leaf."""
  shape = _spec(cfg, path).shape
  return shape[1:] if path[0] == "layers" else shape


def _leaf_shardings(shardings: Any, specs: Mapping[Path, ParamSpec]) -> dict[Path, Any]:
  if isinstance(shardings, jax.sharding.Sharding):
    return {path: shardings for path in specs}
  flat = _flatten(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  if flat.keys() != specs.keys():
    raise ValueError(f"shardings do not match the parameters: {sorted(flat)} vs {sorted(specs)}")
  return flat


def _place(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
           read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """A global array whose distinct shards are each read once, then copied to
  every device that holds them (replicas included) before the next read."""
  devices_of: dict[tuple, tuple[tuple[slice, ...], list]] = {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    full = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    key = tuple((s.start, s.stop) for s in full)
    devices_of.setdefault(key, (full, []))[1].append(device)
  arrays = []
  for index, devices in devices_of.values():
    block = read(index)
    arrays += [jax.device_put(block, jax.sharding.SingleDeviceSharding(
        d, memory_kind=sharding.memory_kind)) for d in devices]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _read_shard(reader: SafetensorsReader, cfg: LlamaConfig, path: Path, dtype: np.dtype,
                index: tuple[slice, ...]) -> np.ndarray:
  """Block `index` of jaxzero leaf `path`, from the Hugging Face tensor(s) it maps."""
  tensor = _tensor_of(path)
  if path[0] != "layers":
    return _read_block(reader, _PATH_TO_TOP[path], tensor, _layer_shape(cfg, path),
                       index).astype(dtype)
  layers = range(index[0].start, index[0].stop)
  out = np.empty([len(range(s.start, s.stop)) for s in index], dtype)
  for i, layer in enumerate(layers):  # one layer's tensor on the host at a time
    out[i] = _read_block(reader, _hf_name(path, layer), tensor, _layer_shape(cfg, path),
                         index[1:])
  return out


def _read_block(reader: SafetensorsReader, name: str, tensor: _Tensor,
                shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
  """``jaxzero_layout(tensor)[index]``, reading only what `index` needs.

  A Linear weight is stored as [prod(out dims), prod(in dims)]. Slicing the
  leading dim of a group is a contiguous range of the flattened group (the
  usual case: ZeRO splits `embed`, which leads its group), so it is read
  directly; slices of the other dims are taken after the read.
  """
  if tensor.n_in_axes is None:
    return reader.read(name, index)
  k = tensor.n_in_axes
  rows = _flat_range(shape[k:], index[k:])
  cols = _flat_range(shape[:k], index[:k])
  block = reader.read(name, (rows, cols)).T
  lead_in, lead_out = index[0].stop - index[0].start, index[k].stop - index[k].start
  block = block.reshape(lead_in, *shape[1:k], lead_out, *shape[k + 1:])
  return block[(slice(None), *index[1:k], slice(None), *index[k + 1:])]


def _flat_range(shape: tuple[int, ...], index: tuple[slice, ...]) -> slice:
  """The range of the flattened `shape` under the slice of its leading dim."""
  inner = math.prod(shape[1:])
  return slice(index[0].start * inner, index[0].stop * inner)
