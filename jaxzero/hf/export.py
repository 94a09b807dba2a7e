"""Writing a jaxzero checkpoint as a Hugging Face Llama, Mistral or Qwen2 model directory.

``export_hf`` reads the checkpoint's fp32 master weights one leaf at a time (a
stacked leaf one layer at a time) and streams them into safetensors shards, so
the host never holds the whole model. Names and layouts come from
jaxzero.hf.tensors, config.json from jaxzero.hf.config_json, the tokenizer and what
config.json carries over from the base model from jaxzero.hf.metadata; the checkpoint from
jaxzero.checkpoint.reader. An export is written beside its directory and renamed into
place (new_directory), so a failed one leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import struct
import tempfile
from typing import Any, Iterator, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxzero.checkpoint.directory import check_fits
from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.errors import CheckpointError
from jaxzero.hf import config_json, metadata, tensors
from jaxzero.hf.load import CONFIG_FILE, WEIGHTS_INDEX_FILE
from jaxzero.models import lora as lora_lib
from jaxzero.models.llama import LlamaConfig, param_specs
from jaxzero.offload import nvme_checkpoint

Path = tuple[str, ...]


EXPORT_DTYPES = {"float32": ("F32", np.dtype(np.float32)),
                 "bfloat16": ("BF16", np.dtype(jnp.bfloat16)),
                 "float16": ("F16", np.dtype(np.float16))}
DEFAULT_SHARD_BYTES = 5 * 2**30


class Export(NamedTuple):
  out: pathlib.Path
  step: int
  dtype: str
  files: list[str]
  tokenizer: tuple[str, ...] = ()  # the tokenizer files copied beside them


class _Planned(NamedTuple):
  name: str
  shape: tuple[int, ...]
  nbytes: int


def export_hf(workdir: str | pathlib.Path, out: str | pathlib.Path, *, step: int | None = None,
              dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              merged: bool = False) -> Export:
  """Writes a checkpoint as a Hugging Face directory of its model's family (Llama,
  Mistral, Qwen2: ``model.family``): ``config.json``,
  ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``. A LoRA
  run's model is its frozen base with the adapters folded in (W + alpha/r · A B);
  jaxzero.hf.peft writes the adapters alone. With them, as WORKDIR/config.json records
  the run (jaxzero.hf.metadata): the tokenizer and its chat template, and the base
  model's special-token ids, max_position_embeddings and generation_config.json.

  Reads the fp32 master weights one leaf at a time and writes them one
  per-layer tensor at a time, so the host holds one leaf, never the model.
  `out` must not exist or be an empty directory; the files appear there only
  once all are written.

  Args:
    step: the checkpoint step; default the latest.
    dtype: "float32" or "bfloat16"; default the run's compute dtype.
    max_shard_bytes: the size of one safetensors file (a bigger tensor gets
      a file of its own).
    merged: a LoRA run's checkpoint is exported only when asked for its merged model.
  """
  run = metadata.read_run(workdir)  # a damaged config.json stops us before anything is read
  with CheckpointReader(workdir, side=nvme_checkpoint.SIDE_ITEM) as reader:
    return _export(reader, pathlib.Path(out), step, dtype, max_shard_bytes, merged, run)


def _export(reader: CheckpointReader, out: pathlib.Path, step: int | None, dtype: str | None,
            max_shard_bytes: int, merged: bool = False, run: dict | None = None) -> Export:
  step = reader.resolve_step(step)
  info = reader.info(step)
  if bool(info.get("lora")) != merged:
    raise CheckpointError(
        f"checkpoint {reader.step_dir(step)} is a LoRA run's: export --peft (the adapters) or "
        "--merged (the model with them folded in)" if info.get("lora") else
        f"--merged: checkpoint {reader.step_dir(step)} is not a LoRA run's (lora.rank=0); "
        "export it without --merged")
  model = recorded_model(info, reader.step_dir(step))
  dtype = dtype or info["compute_dtype"]
  if dtype not in EXPORT_DTYPES:
    raise CheckpointError(f"export dtype {dtype!r} is not one of: {', '.join(EXPORT_DTYPES)}")
  check_new(out)
  lora = info.get("lora")
  leaves = _master_leaves(reader, step, model, "frozen" if lora else "master",
                         lora_lib.stored_quantized(lora))
  shards = _plan_shards(model, EXPORT_DTYPES[dtype][1].itemsize, max_shard_bytes)
  generation = metadata.generation_settings(run, (lora or {}).get("base_model", ""))
  with new_directory(out) as partial:
    files = _write_export(partial, reader, step, leaves, model, dtype, shards, lora, generation)
    tokenizer = metadata.copy_tokenizer(run, partial)
  return Export(out, step, dtype, files, tuple(tokenizer))


def check_new(out: pathlib.Path) -> None:
  """Refuses an --out that export would overwrite."""
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise CheckpointError(f"--out {out} already exists and is not an empty directory; "
                          "export writes a new one")


@contextlib.contextmanager
def new_directory(out: pathlib.Path) -> Iterator[pathlib.Path]:
  """A temporary directory for the body to fill, removed if the body fails: `out` never
  holds half an export. Where `out` does not exist the temporary is made beside it and
  renamed to it; an existing empty `out` (perhaps a link, or a mount point that cannot be
  removed or replaced) gets it inside, and its files are moved up once it is full."""
  existing = out.is_dir()
  if not existing:
    out.parent.mkdir(parents=True, exist_ok=True)
  where = out if existing else out.parent
  partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=where))
  try:
    yield partial
    if existing:
      for item in partial.iterdir():
        item.replace(out / item.name)
      partial.rmdir()
    else:
      partial.chmod(_mkdir_mode())  # mkdtemp's 0700 would keep the model from everyone else
      partial.rename(out)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise


def recorded_model(info: dict, where: pathlib.Path) -> LlamaConfig:
  """The built-in model a checkpoint's record names; CheckpointError for a model of the
  user's own (a model_factory run's or a jaxzero.Engine's), which has no Hugging Face
  layout here."""
  fields = {f.name for f in dataclasses.fields(LlamaConfig)}
  record = info.get("model") or {}
  if not record or not set(record) <= fields:
    raise CheckpointError(f"checkpoint {where} holds a model of your own (model_factory or "
                          "jaxzero.Engine), not a built-in Llama, Mistral or Qwen2: export "
                          "writes those only; read its state with orbax from "
                          f"{where / 'state'}")
  return LlamaConfig(**record)


def _mkdir_mode() -> int:
  """The mode os.mkdir gives a new directory: 0o777 less the umask."""
  umask = os.umask(0)  # reading the umask means setting it; put it straight back
  os.umask(umask)
  return 0o777 & ~umask


def _master_leaves(reader: CheckpointReader, step: int, model: LlamaConfig,
                   field: str = "master", quantized: tuple[str, ...] = ()
                   ) -> dict[Path, tuple[int, ...]]:
  """{leaf path: shape} of the model's weights (in the state's `field`: the master
  weights, or a LoRA run's frozen base) in param_specs order (the order
  jaxzero.hf.tensors lists them), checked against the recorded model (but for the
  `quantized` weights' names, stored as parts)."""
  wanted = {p: spec.shape for p, spec in traverse_util.flatten_dict(param_specs(model)).items()}
  stored_as_parts = lambda name: name.split("/")[-2] in quantized  # .../wq_LxDxHxE/codes
  saved = {name[len(field) + 1:]: shape for name, shape in reader.leaf_shapes(step).items()
           if name.startswith(field + "/") and not stored_as_parts(name)}
  check_fits(saved, {"/".join(p): s for p, s in wanted.items() if p[-1] not in quantized},
             reader.step_dir(step), "the model recorded with it")
  return wanted


def _plan_shards(model: LlamaConfig, itemsize: int, max_shard_bytes: int
                ) -> list[list[_Planned]]:
  """Tensors in write order, cut into files of at most `max_shard_bytes`."""
  shards: list[list[_Planned]] = [[]]
  size = 0
  for name, shape in tensors.hf_tensor_shapes(model).items():
    nbytes = int(np.prod(shape)) * itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(_Planned(name, shape, nbytes))
    size += nbytes
  return shards


def _write_export(directory: pathlib.Path, reader: CheckpointReader, step: int,
                  leaves: dict[Path, tuple[int, ...]], model: LlamaConfig, dtype: str,
                  shards: list[list[_Planned]], lora: dict | None,
                  generation: metadata.Generation) -> list[str]:
  code, np_dtype = EXPORT_DTYPES[dtype]
  hf_config = {**config_json.hf_config_from_llama(model, carried=generation.config),
               "dtype": dtype}
  (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
  if generation.generation_config is not None:
    (directory / metadata.GENERATION_CONFIG).write_text(
        json.dumps(generation.generation_config, indent=2) + "\n")
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  with _SafetensorsWriter(directory, names, shards, code) as writer:
    for path, shape in leaves.items():
      if lora and path[0] == "layers":  # the frozen base, the adapters folded in by layer
        leaf = lora_lib.MergedLayers(path, shape, lambda name, shape: (
            reader.read_by_layer if name[0] == "frozen" else reader.read)(step, name, shape),
                                     lora)
      elif lora:
        read = lambda name, shape: reader.read(step, name, shape)
        leaf = lora_lib.fold_adapters(path, lora_lib.read_base_leaf(path, shape, read, lora),
                                      read, lora)
      else:
        read = reader.read_by_layer if path[0] == "layers" else reader.read
        leaf = read(step, ("master", *path), shape)
      for name, tensor in tensors.jaxzero_to_hf_tensors(path, leaf, model):
        with np.errstate(over="ignore"):  # (an overflow is said below, in one line)
          cast = tensor.astype(np_dtype, copy=False)
        if dtype == "float16" and not np.isfinite(cast).all():  # past 65504: inf
          raise CheckpointError(f"weight {name} has values beyond float16's range (largest "
                                f"{float(np.abs(tensor).max()):.4g}, float16's 65504): export "
                                "it with --dtype bfloat16 or float32")
        writer.write(name, cast)
      del leaf
  index = {"metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard)},
           "weight_map": dict(sorted((t.name, file) for file, shard in zip(names, shards)
                                     for t in shard))}
  (directory / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  return names


def write_safetensors(path: pathlib.Path, tensors_by_name: dict[str, np.ndarray],
                      dtype: str) -> None:
  """One safetensors file of `tensors_by_name`, cast to `dtype` (a key of EXPORT_DTYPES)."""
  code, np_dtype = EXPORT_DTYPES[dtype]
  arrays = {n: np.asarray(a).astype(np_dtype, copy=False) for n, a in tensors_by_name.items()}
  planned = [[_Planned(n, a.shape, a.nbytes) for n, a in arrays.items()]]
  with _SafetensorsWriter(path.parent, [path.name], planned, code) as writer:
    for name, array in arrays.items():
      writer.write(name, array)


class _SafetensorsWriter:
  """Writes planned safetensors files one tensor at a time.

  The safetensors libraries write a file from a dict of all its tensors, so a
  shard would sit in host memory whole. The format is an 8-byte header length,
  a JSON header (dtype, shape and byte range of every tensor) and the raw
  bytes; with the header planned from shapes, tensors can be streamed in.
  """

  def __init__(self, directory: pathlib.Path, names: list[str], shards: list[list[_Planned]],
               dtype_code: str):
    self._files = [(directory / name, shard) for name, shard in zip(names, shards)]
    self._code = dtype_code
    self._pending: list[_Planned] = []
    self._file = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self._file is not None:
      self._file.close()
    if exc[0] is None and (self._pending or self._files):
      raise RuntimeError("export wrote fewer tensors than planned")

  def write(self, name: str, array: np.ndarray) -> None:
    if not self._pending:
      self._open_next()
    planned = self._pending.pop(0)
    if (planned.name, planned.shape, planned.nbytes) != (name, array.shape, array.nbytes):
      raise RuntimeError(f"export planned {planned} but got {name} {array.shape}")
    self._file.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))

  def _open_next(self) -> None:
    if self._file is not None:
      self._file.close()
    path, shard = self._files.pop(0)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
      header[t.name] = {"dtype": self._code, "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
      offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the library does
    self._file = open(path, "wb")
    self._file.write(struct.pack("<Q", len(blob)) + blob)
    self._pending = list(shard)
