"""Hugging Face Llama, Mistral and Qwen2 tensors <-> jaxzero leaves: names and layouts.

The one place that knows Hugging Face's tensor names (``_TENSORS``). Both directions are exact
inverses: a tensor only goes through a transpose and a reshape, never arithmetic, so a round
trip is bit-exact in any dtype. Arrays are numpy; nothing here reads or writes files
(jaxzero.hf.load does) or uses jax. The per-tensor functions return views where no
transpose is needed (norms, embedding), so treat their outputs as read-only.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from jaxzero.hf.config_json import ARCHITECTURES
from jaxzero.models.llama import LlamaConfig, ParamSpec, is_param_spec, param_specs

Path = tuple[str, ...]


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
  if any(s.stop <= s.start for s in index):  # a device's shard wholly in a leaf's padding
    return np.zeros([s.stop - s.start for s in index], dtype)
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
    raise KeyError(f"{name!r} is not a tensor of this {ARCHITECTURES[cfg.family]}")
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
