"""A LoRA run's adapters as a Hugging Face PEFT adapter directory, and back.

``export_peft`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` as
PEFT's ``save_pretrained`` does for a causal LM, so that
``peft.PeftModel.from_pretrained(base_model, DIR)`` loads them: per layer and target,
``base_model.model.model.layers.{i}.{module}.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] (jaxzero's A [in..., r] and B [r, out...], flattened and
transposed, the base weights' own Hugging Face layout); for the head
``base_model.model.lm_head.lora_A.weight`` [r, D] and ``lora_B.weight`` [V, r]; for the
embedding (PEFT's LoRA Embedding) ``base_model.model.model.embed_tokens.lora_embedding_A``
[r, V] and ``lora_embedding_B`` [D, r]. ``read_adapter`` reads such a directory into
jaxzero's adapters (``lora.init_from``), after ``check_adapter``.
"""

from __future__ import annotations

import json
import math
import re
import pathlib

import numpy as np
from safetensors import safe_open

from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.errors import CheckpointError, HFCheckpointError
from jaxzero.hf import export as hf_export
from jaxzero.hf import metadata
from jaxzero.models import lora as lora_lib
from jaxzero.models.llama import LlamaConfig
from jaxzero.offload import nvme_checkpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
MODULES = "model.layers"  # the layers' modules as PEFT names them when it matches targets
# The top-level targets' PEFT names of (A, B) and whether PEFT stores them [in, r] / [r, out]
# (the embedding's) rather than transposed (a Linear's lora_A.weight [r, in]).
TOP_NAMES = {"embed": ("base_model.model.model.embed_tokens.lora_embedding_A",
                       "base_model.model.model.embed_tokens.lora_embedding_B"),
             "head": ("base_model.model.lm_head.lora_A.weight",
                      "base_model.model.lm_head.lora_B.weight")}


def adapter_config(record: dict, base_model: str = "") -> dict:
  """PEFT's adapter_config.json for a run's LoRA record (jaxzero.models.lora.run_record)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": record["rank"],
      "lora_alpha": record["alpha"], "lora_dropout": record.get("dropout", 0.0), "bias": "none",
      "target_modules": [lora_lib.peft_name(t) for t in record["targets"]],
      "base_model_name_or_path": base_model, "fan_in_fan_out": False,
      "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
      "use_rslora": False, "use_dora": False,
  }


def peft_tensors(adapters: dict, record: dict, n_layers: int) -> dict[str, np.ndarray]:
  """{PEFT name: array} of jaxzero's adapters: {"layers": {lora_{t}_a: [L, in..., r],
  ...}, lora_embed_a: [V, r], ...}. Both of PEFT's [r, in] and [out, r] layouts are the
  transposes of jaxzero's [in, r] and [r, out]; its embedding's A is [r, V], B [D, r]."""
  out = {}
  rank = record["rank"]
  for target in record["targets"]:
    if target in lora_lib.TOP_TARGETS:
      for which, name in zip("ab", TOP_NAMES[target]):
        out[name] = np.ascontiguousarray(adapters[lora_lib.adapter_key(target, which)].T)
      continue
    layers = adapters["layers"]
    a, b = layers[lora_lib.adapter_key(target, "a")], layers[lora_lib.adapter_key(target, "b")]
    for i in range(n_layers):
      name = _module_name(i, target)
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
  return out


def export_peft(workdir: str | pathlib.Path, out: str | pathlib.Path, *, step: int | None = None,
                dtype: str | None = None) -> hf_export.Export:
  """Writes checkpoint `step` (default: the latest) of a LoRA run as a PEFT adapter
  directory `out` (new, or empty), with the run's tokenizer (jaxzero.hf.metadata);
  `dtype` default float32 (the adapters' masters). The files are written beside `out` and
  renamed into place, so a failed export leaves nothing there."""
  out = pathlib.Path(out)
  dtype = dtype or "float32"
  run = metadata.read_run(workdir)  # a damaged config.json stops us before anything is read
  with CheckpointReader(workdir, side=nvme_checkpoint.SIDE_ITEM) as reader:
    step = reader.resolve_step(step)
    info = reader.info(step)
    record = info.get("lora")
    if not record:
      raise CheckpointError(f"checkpoint {reader.step_dir(step)} is not a LoRA run's "
                            "(lora.rank=0): export it without --peft")
    model = hf_export.recorded_model(info, reader.step_dir(step))
    hf_export.check_new(out)
    specs = lora_lib.adapter_specs(model, record["rank"], tuple(record["targets"]))
    adapters = {n: reader.read(step, ("master", n), s.shape) for n, s in specs.items()
                if n != "layers"}
    adapters["layers"] = {n: reader.read(step, ("master", "layers", n), s.shape)
                          for n, s in specs["layers"].items()}
  base = record.get("base_model", "")
  with hf_export.new_directory(out) as partial:
    (partial / ADAPTER_CONFIG).write_text(
        json.dumps(adapter_config(record, base), indent=2) + "\n")
    hf_export.write_safetensors(partial / ADAPTER_WEIGHTS,
                                peft_tensors(adapters, record, model.n_layers), dtype)
    tokenizer = metadata.copy_tokenizer(run, partial)
  return hf_export.Export(out, step, dtype, [ADAPTER_WEIGHTS], tuple(tokenizer))



def check_adapter(path: str | pathlib.Path, model: LlamaConfig, record: dict) -> dict:
  """Checks a PEFT adapter directory against the run before anything is read: its
  files, type, rank, alpha, targets and tensor shapes (an adapter for another base
  has other shapes). Returns its adapter_config.json. Raises HFCheckpointError (one
  line, naming what differs and the setting that would match)."""
  directory = pathlib.Path(path).expanduser()
  config_file, weights = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
  for f in (config_file, weights):
    if not f.is_file():
      raise HFCheckpointError(f"lora.init_from={path}: {f.name} is missing (a PEFT adapter "
                              f"directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
  try:
    found = json.loads(config_file.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise HFCheckpointError(f"lora.init_from={path}: {ADAPTER_CONFIG} is not readable "
                            f"JSON ({e})") from None
  if not isinstance(found, dict):
    raise HFCheckpointError(f"lora.init_from={path}: {ADAPTER_CONFIG} is not a JSON object")
  if found.get("peft_type") != "LORA":
    raise HFCheckpointError(f"lora.init_from={path}: peft_type={found.get('peft_type')!r}; "
                            "only LORA adapters are read")
  for key in ("use_rslora", "use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern",
              "alpha_pattern"):
    if found.get(key):
      raise HFCheckpointError(f"lora.init_from={path}: {key}={found[key]!r} is not supported "
                              "(plain LoRA adapters only)")
  if found.get("bias", "none") != "none":
    raise HFCheckpointError(f"lora.init_from={path}: bias={found['bias']!r} is not supported "
                            "(bias='none' only)")
  _check_every_layer(path, found, model.n_layers)
  targets = _peft_targets(found)
  if not targets:
    said = " and ".join(f"{k}={found[k]!r}" for k in ("target_modules", "exclude_modules")
                        if found.get(k))
    raise HFCheckpointError(
        f"lora.init_from={path}: {said or 'no target_modules'} adapts none of the modules "
        f"jaxzero adapts ({', '.join(map(lora_lib.peft_name, lora_lib.ALL_TARGETS))})")
  for key, want, have in (("rank", record["rank"], found.get("r")),
                          ("alpha", record["alpha"], found.get("lora_alpha")),
                          ("targets", ",".join(record["targets"]), ",".join(targets))):
    if want != have and not (key == "alpha" and have is not None and float(have) == want):
      raise HFCheckpointError(f"lora.init_from={path} has {key} {have}, this run lora.{key}="
                              f"{want}: set lora.{key}={have}")
  try:
    with safe_open(weights, "np") as f:
      shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
  except Exception as e:  # pylint: disable=broad-except  # safetensors' own error type
    raise HFCheckpointError(f"lora.init_from={path}: {ADAPTER_WEIGHTS} cannot be read: "
                            f"{e}") from None
  want_shapes = _peft_shapes(model, record)
  # PEFT's save_pretrained also writes the embedding's and the head's own weights when
  # they are adapted (".base_layer.weight"): the base's, which the run has already.
  saved_base = {TOP_NAMES[t][0].rsplit(".lora_", 1)[0] + ".base_layer.weight"
                for t in record["targets"] if t in TOP_NAMES}
  extra = sorted(set(shapes) - set(want_shapes) - saved_base)
  if extra:
    raise HFCheckpointError(f"lora.init_from={path}: {len(extra)} tensors this run would not "
                            f"read, e.g. {extra[0]}: an adapter for other modules or models")
  for name, shape in want_shapes.items():
    if shapes.get(name) != shape:
      raise HFCheckpointError(
          f"lora.init_from={path}: tensor {name} is "
          + ("missing" if name not in shapes else f"{list(shapes[name])}")
          + f", this model needs {list(shape)}: an adapter for another base model")
  return found


def _check_every_layer(path, found: dict, n_layers: int) -> None:
  """Refuses an adapter on some of the layers only (PEFT's layers_to_transform, or
  target_modules or exclude_modules naming layers): jaxzero adapts its targets in every
  layer."""
  layers = found.get("layers_to_transform")
  if layers is not None:
    chosen = sorted({layers} if isinstance(layers, int) else set(layers))
    if chosen != list(range(n_layers)):
      raise HFCheckpointError(
          f"lora.init_from={path}: layers_to_transform={layers!r} adapts layers {chosen} of "
          f"this model's {n_layers} only; jaxzero adapts lora.targets in every layer, so the "
          "adapters cannot start from it")
  for key in ("target_modules", "exclude_modules"):
    if isinstance(found.get(key), str) and found[key] != lora_lib.ALL_LINEAR:
      try:
        re.compile(found[key])
      except re.error as e:
        raise HFCheckpointError(f"lora.init_from={path}: {key}={found[key]!r} is not a "
                                f"regular expression ({e})") from None
  for target, module in lora_lib.PEFT_MODULES.items():
    chosen = [i for i in range(n_layers) if _adapts(found, f"{MODULES}.{i}.{module}")]
    if 0 < len(chosen) < n_layers:
      said = " and ".join(f"{k}={found[k]}" for k in ("target_modules", "exclude_modules")
                          if found.get(k))
      raise HFCheckpointError(
          f"lora.init_from={path}: {said} adapts "
          f"{lora_lib.peft_name(target)} in layers {chosen} of this model's {n_layers} only; "
          "jaxzero adapts lora.targets in every layer, so the adapters cannot start from it")


def _adapts(found: dict, module: str) -> bool:
  """Whether PEFT adapts `module` (a full name, model.layers.0.self_attn.q_proj) under
  `found`'s target_modules and exclude_modules, as PEFT matches them: a string is a regular
  expression the whole name matches ("all-linear": every projection, not the head); a
  list's names match the whole name or its end after a dot."""
  def matches(spec) -> bool:
    if isinstance(spec, str):
      return (module.startswith(f"{MODULES}.") if spec == lora_lib.ALL_LINEAR else
              re.fullmatch(spec, module) is not None)
    return any(module == name or module.endswith(f".{name}") for name in spec or ())
  return matches(found.get("target_modules")) and not (
      found.get("exclude_modules") and matches(found["exclude_modules"]))


def read_adapter(path: str | pathlib.Path, model: LlamaConfig, record: dict) -> dict:
  """A checked PEFT adapter (check_adapter) as jaxzero's adapters, float32 on the host:
  {"layers": {lora_{t}_a: [L, in..., r], lora_{t}_b: [L, r, out...]}, and lora_embed_a
  ... where the embedding or the head are adapted}."""
  check_adapter(path, model, record)
  specs = lora_lib.adapter_specs(model, record["rank"], tuple(record["targets"]))["layers"]
  rank = record["rank"]
  out, top = {}, {}
  with safe_open(pathlib.Path(path).expanduser() / ADAPTER_WEIGHTS, "np") as f:
    for target in record["targets"]:
      if target in lora_lib.TOP_TARGETS:
        for which, name in zip("ab", TOP_NAMES[target]):
          top[lora_lib.adapter_key(target, which)] = f.get_tensor(name).astype(np.float32).T
        continue
      for which, name in (("a", "lora_A"), ("b", "lora_B")):
        key = lora_lib.adapter_key(target, which)
        shape = specs[key].shape
        layers = [f.get_tensor(f"{_module_name(i, target)}.{name}.weight").astype(np.float32)
                  for i in range(model.n_layers)]
        if which == "a":  # [r, in] -> [in..., r]
          out[key] = np.stack([a.T.reshape(*shape[1:-1], rank) for a in layers])
        else:  # [out, r] -> [r, out...]
          out[key] = np.stack([b.T.reshape(rank, *shape[2:]) for b in layers])
  return {"layers": out, **top}


def _module_name(layer: int, target: str) -> str:
  """PEFT's name of layer `layer`'s adapted module for `target`."""
  return f"{PREFIX}.{layer}.{lora_lib.PEFT_MODULES[target]}"


def _peft_targets(found: dict) -> tuple[str, ...]:
  """jaxzero's targets of a PEFT adapter_config (`found`): those PEFT adapts in layer 0, or
  outside the layers (_adapts)."""
  full = {**{t: f"{MODULES}.0.{m}" for t, m in lora_lib.PEFT_MODULES.items()},
          **{t: m for t, (_, m) in lora_lib.TOP_TARGETS.items()}}
  return tuple(t for t in lora_lib.ALL_TARGETS if _adapts(found, full[t]))


def _peft_shapes(model: LlamaConfig, record: dict) -> dict[str, tuple[int, int]]:
  """{PEFT name: shape} of the adapters `record` describes for `model`."""
  all_specs = lora_lib.adapter_specs(model, record["rank"], tuple(record["targets"]))
  specs = all_specs["layers"]
  rank, out = record["rank"], {}
  for target in record["targets"]:
    if target in lora_lib.TOP_TARGETS:
      for which, name in zip("ab", TOP_NAMES[target]):
        out[name] = all_specs[lora_lib.adapter_key(target, which)].shape[::-1]
      continue
    a = specs[lora_lib.adapter_key(target, "a")].shape
    b = specs[lora_lib.adapter_key(target, "b")].shape
    for i in range(model.n_layers):
      name = _module_name(i, target)
      out[f"{name}.lora_A.weight"] = (rank, math.prod(a[1:-1]))
      out[f"{name}.lora_B.weight"] = (math.prod(b[2:]), rank)
  return out
