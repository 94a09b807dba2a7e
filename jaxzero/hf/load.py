"""Reading Hugging Face Llama, Mistral and Qwen2 checkpoint files into sharded weights.

``load_llama`` and ``load_params`` take a model directory (config.json with
model.safetensors, or shards listed in model.safetensors.index.json) one
tensor, or one slice of a tensor, at a time, straight into each device's
shard, so the host never holds the whole model. Names and layouts come from
jaxzero.hf.tensors, the config from jaxzero.hf.config_json; writing is jaxzero.hf.export.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxzero import config as config_lib
from jaxzero.data import tokens as tokens_lib
from jaxzero.errors import HFCheckpointError
from jaxzero.hf import config_json, tensors
from jaxzero.models.llama import Llama, LlamaConfig, param_specs
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.parallel import zero

Path = tuple[str, ...]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- reading


def read_config(path: str | os.PathLike) -> LlamaConfig:
  """The LlamaConfig of a Hugging Face model directory, from its config.json."""
  file = _checkpoint_dir(path) / CONFIG_FILE
  if not file.is_file():
    raise HFCheckpointError(f"{file.parent}: no {CONFIG_FILE}; expected a Hugging Face model "
                            f"directory ({CONFIG_FILE} with {WEIGHTS_FILE} or "
                            f"{WEIGHTS_INDEX_FILE})")
  try:
    hf_config = json.loads(file.read_text())
  except ValueError as e:
    raise HFCheckpointError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(hf_config, dict):
    raise HFCheckpointError(f"{file}: not a JSON object")
  try:
    return config_json.llama_config_from_hf(hf_config)
  except ValueError as e:
    raise HFCheckpointError(f"{file}: {e}") from None


def check_matches(model: LlamaConfig, path: str | os.PathLike) -> LlamaConfig:
  """Checks the model config against a checkpoint's config.json; returns the latter.

  Raises:
    HFCheckpointError: naming the first ``model.*`` field that differs, and the
      value that would match.
  """
  found = read_config(path)
  try:
    config_json.check_config_matches(model, found, str(_checkpoint_dir(path) / CONFIG_FILE))
  except ValueError as e:
    raise HFCheckpointError(str(e)) from None
  return found


def check_tokenizer(tokenizer: str, path: str | os.PathLike) -> None:
  """Refuses the byte tokenizer for a checkpoint that has a tokenizer of its own, larger
  than bytes (a tokenizer.json): its embedding would read byte values as its own token
  ids, and train on nonsense. A byte-level checkpoint (jaxzero's export of a byte-level
  run, with or without a tokenizer.json of bytes) takes bytes."""
  own = _checkpoint_dir(path) / "tokenizer.json"
  if tokenizer != "byte" or not own.is_file():
    return
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  try:
    size = Tokenizer.from_file(str(own)).get_vocab_size(with_added_tokens=True)
  except Exception:  # pylint: disable=broad-except
    return  # (the Rust side's own error type) not one jaxzero reads: said if it is asked for
  if size > tokens_lib.BYTE_VOCAB:
    raise HFCheckpointError(f"init.hf_checkpoint={str(path)!r} has its own tokenizer of "
                            f"{size:,} tokens ({own}); data.tokenizer='byte' would feed it "
                            f"byte values as token ids: set data.tokenizer={str(path)!r}")


def load_llama(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, *,
               dtype: Any = jnp.float32) -> Llama:
  """A jaxzero.models.llama.Llama holding a Hugging Face Llama, Mistral or Qwen2
  checkpoint's weights (LlamaConfig.family says which).

  Args:
    path: the model directory: config.json and model.safetensors, or shards
      listed in model.safetensors.index.json.
    mesh: None puts the model on the default device; with a jaxzero mesh
      (jaxzero.parallel.mesh.make_mesh) the weights are laid out as a default run
      keeps its parameters at rest (ZeRO-3: sharded over all devices).
    dtype: of the weights (float32 or bfloat16).

  Returns:
    The model; ``model(tokens_BxT)`` on int32 tokens gives float32 logits [B, T, V].
  """
  cfg = read_config(path)
  if mesh is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  else:
    layout = zero.Layout.from_config(config_lib.Config(model=cfg), mesh)
    shardings = layout.tree_shardings(param_specs(cfg), "params")
  params = load_params(path, cfg, shardings, dtype)
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.split(abstract, nnx.Param)[0], params)


def load_params(path: str | os.PathLike, cfg: LlamaConfig, shardings: Any,
                dtype: Any = jnp.float32,
                each: Callable[[tuple[str, ...], jax.Array], Any] | None = None
                ) -> dict[str, Any]:
  """Reads a Hugging Face checkpoint straight into sharded jaxzero params.

  Each distinct shard of each leaf is read once, one Hugging Face tensor (or
  the slice of it the shard needs) at a time, and copied to the devices that
  hold it before the next read, so the host holds at most two such blocks
  beyond what the devices keep.

  Args:
    path: the model directory (see load_llama).
    cfg: the model config; it must match config.json (see check_matches).
    shardings: one Sharding for every leaf, or a tree of them shaped like
      ``param_specs(cfg)``, e.g. a train state's ``master`` shardings for the
      fp32 master weights; memory kinds are kept.
    dtype: of the result.
    each: (leaf path, placed leaf) -> what the result holds instead, applied to each
      leaf as soon as it is placed (e.g. quantizing it), so that the leaves in
      `dtype` are not all held at once.

  Returns:
    A pure params dict of jax.Arrays, for ``nnx.merge(graphdef, params)``.

  Raises:
    HFCheckpointError: naming the file or tensor that is missing or wrong.
  """
  check_matches(cfg, path)
  shapes = {p: spec.shape for p, spec in traverse_util.flatten_dict(param_specs(cfg)).items()}
  leaf_shardings = _leaf_shardings(shardings, shapes)
  with SafetensorsReader(path) as reader:
    _check_tensors(reader, cfg)
    flat = {}
    for p, shape in shapes.items():
      leaf = _place(shape, leaf_shardings[p], functools.partial(
          tensors.read_leaf_block, cfg, p, read=reader.read, dtype=np.dtype(dtype)))
      flat[p] = leaf if each is None else each(p, leaf)
      del leaf
  return traverse_util.unflatten_dict(flat)


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
      handle = self._files.enter_context(_safe_open(file))
      self._open[file] = handle, frozenset(handle.keys())
    return self._open[file]


def _checkpoint_dir(path: str | os.PathLike) -> pathlib.Path:
  directory = pathlib.Path(path).expanduser()
  if not directory.is_dir():
    raise HFCheckpointError(f"Hugging Face checkpoint {str(path)!r} is not a directory")
  return directory


def _safe_open(file: pathlib.Path):
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    return safe_open(str(file), framework="numpy")
  except Exception as e:  # SafetensorError, OSError
    raise HFCheckpointError(f"{file}: not a readable safetensors file ({e})") from None


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
    with _safe_open(single) as handle:
      return {name: single for name in handle.keys()}
  raise HFCheckpointError(f"{directory}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} "
                          "(only safetensors checkpoints can be read)")


def _check_tensors(reader: SafetensorsReader, cfg: LlamaConfig) -> None:
  """Fails before any loading if a tensor is missing, misshapen or unexpected."""
  wanted = tensors.hf_tensor_shapes(cfg)
  for name, want in wanted.items():
    have = reader.shape(name)
    if have != want:
      raise HFCheckpointError(f"{reader.file_of[name]}: tensor {name!r} has shape {have}, "
                              f"expected {want} from {CONFIG_FILE}")
  unexpected = sorted(n for n in reader.file_of.keys() - wanted.keys()
                      if not tensors.carries_no_weight(n, cfg))
  if unexpected:
    more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
    raise HFCheckpointError(f"{reader.directory}: tensors that a {cfg.family} model with this "
                            f"{CONFIG_FILE} does not have: {', '.join(unexpected[:3])}{more}")


def _leaf_shardings(shardings: Any, shapes: dict[Path, tuple[int, ...]]) -> dict[Path, Any]:
  if isinstance(shardings, jax.sharding.Sharding):
    return {path: shardings for path in shapes}
  flat = traverse_util.flatten_dict(shardings)
  if flat.keys() != shapes.keys():
    raise ValueError(f"shardings do not match the parameters: {sorted(flat)} vs {sorted(shapes)}")
  return flat


def _stored_shape(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[int, ...]:
  """The shape a leaf of true `shape` is stored at under `sharding`: a split dimension
  that its shards do not divide is padded up to a multiple of them
  (jaxzero.parallel.padding pads only the dimension ZeRO splits)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return tuple(shape)
  sizes = [math.prod(sharding.mesh.shape[a] for a in axes)
           for axes in mesh_lib.axes_per_dimension(sharding, len(shape))]
  return tuple(-(-n // k) * k for n, k in zip(shape, sizes))


def _place(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
           read: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
  """A global array whose distinct shards are each read once, then copied to
  every device that holds them (replicas included) before the next read. A leaf
  stored padded gets zeros past its true `shape`."""
  stored = _stored_shape(shape, sharding)
  devices_of: dict[tuple, tuple[tuple[slice, ...], list]] = {}
  for device, index in sharding.addressable_devices_indices_map(stored).items():
    full = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, stored))
    key = tuple((s.start, s.stop) for s in full)
    devices_of.setdefault(key, (full, []))[1].append(device)
  arrays = []
  for index, devices in devices_of.values():
    inside = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(index, shape))
    block = read(inside)
    if stored != tuple(shape):  # the padding's zeros
      block = np.pad(block, [(0, (s.stop - s.start) - b) for s, b in zip(index, block.shape)])
    copies = [jax.device_put(block, jax.sharding.SingleDeviceSharding(
        d, memory_kind=sharding.memory_kind)) for d in devices]
    # device_put is asynchronous: without this wait a read that outpaces the
    # copies (a busy host, a slow link) keeps block after block alive, up to a
    # whole stacked leaf (all layers of one weight) on the host. (JAX may hold
    # a block it copied until its next call: two blocks at most, not one.)
    arrays += jax.block_until_ready(copies)
    del block, copies
  return jax.make_array_from_single_device_arrays(stored, sharding, arrays)
