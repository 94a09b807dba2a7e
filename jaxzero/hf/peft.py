"""A LoRA run's adapters as a Hugging Face PEFT adapter directory, and back.

``export_peft`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` as
PEFT's ``save_pretrained`` does for a causal LM, so that
``peft.PeftModel.from_pretrained(base_model, DIR)`` loads them: per layer and target,
``base_model.model.model.layers.{i}.{module}.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] (jaxzero's A [in..., r] and B [r, out...], flattened and
transposed, the base weights' own Hugging Face layout). ``read_adapter`` reads such a
directory into jaxzero's adapters (``lora.init_from``).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.errors import CheckpointError
from jaxzero.hf import export as hf_export
from jaxzero.models import lora as lora_lib
from jaxzero.models.llama import LlamaConfig
from jaxzero.offload import nvme_checkpoint

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"


def adapter_config(record: dict, base_model: str = "") -> dict:
  """PEFT's adapter_config.json for a run's LoRA record (jaxzero.models.lora.run_record)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": record["rank"],
      "lora_alpha": record["alpha"], "lora_dropout": 0.0, "bias": "none",
      "target_modules": [lora_lib.PEFT_MODULES[t].split(".")[-1] for t in record["targets"]],
      "base_model_name_or_path": base_model, "fan_in_fan_out": False,
      "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
      "use_rslora": False, "use_dora": False,
  }


def peft_tensors(adapters: dict[str, np.ndarray], record: dict, n_layers: int
                 ) -> dict[str, np.ndarray]:
  """{PEFT name: array} of jaxzero's stacked adapters {lora_{t}_a: [L, in..., r], ...}."""
  out = {}
  rank = record["rank"]
  for target in record["targets"]:
    a, b = adapters[lora_lib.adapter_key(target, "a")], adapters[lora_lib.adapter_key(target, "b")]
    module = lora_lib.PEFT_MODULES[target]
    for i in range(n_layers):
      name = f"{PREFIX}.{i}.{module}"
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
  return out


def export_peft(workdir: str | pathlib.Path, out: str | pathlib.Path, *, step: int | None = None,
                dtype: str | None = None) -> hf_export.Export:
  """Writes checkpoint `step` (default: the latest) of a LoRA run as a PEFT adapter
  directory `out` (new, or empty); `dtype` default float32 (the adapters' masters)."""
  out = pathlib.Path(out)
  dtype = dtype or "float32"
  with CheckpointReader(workdir, side=nvme_checkpoint.SIDE_ITEM) as reader:
    step = reader.resolve_step(step)
    info = reader.info(step)
    record = info.get("lora")
    if not record:
      raise CheckpointError(f"checkpoint {reader.step_dir(step)} is not a LoRA run's "
                            "(lora.rank=0): export it without --peft")
    model = LlamaConfig(**info["model"])
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
      raise CheckpointError(f"--out {out} already exists and is not an empty directory; "
                            "export writes a new one")
    specs = lora_lib.adapter_specs(model, record["rank"], tuple(record["targets"]))["layers"]
    adapters = {n: reader.read(step, ("master", "layers", n), s.shape) for n, s in specs.items()}
  out.mkdir(parents=True, exist_ok=True)
  base = info.get("base_model", "")
  (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(record, base), indent=2) + "\n")
  hf_export.write_safetensors(out / ADAPTER_WEIGHTS,
                              peft_tensors(adapters, record, model.n_layers), dtype)
  return hf_export.Export(out, step, dtype, [ADAPTER_WEIGHTS])

