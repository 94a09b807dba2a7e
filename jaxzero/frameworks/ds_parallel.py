"""A ds_config's parallelism blocks, ``tensor_parallel`` and ``pipeline``, and its
``sequence_parallel_size``, as mesh settings.

DeepSpeed's AutoTP training takes its group size from ``tensor_parallel.autotp_size``:
here ``mesh.tensor``. Its pipeline engine takes the stage count from the model's code
(``PipelineModule(num_stages=...)``), so the ``pipeline`` block's ``stages`` is ``"auto"``
unless written as a number: a number is ``mesh.pipeline``; ``"auto"`` keeps the base
config's ``mesh.pipeline`` (``--set mesh.pipeline=S`` gives it). Stages hold equal layer
counts here (``partition: "uniform"``, which for alike layers is also "parameters" and
"best"); a ``type:`` partition is refused. DeepSpeed's pipeline engine trains with 1F1B
(its ``TrainSchedule``), so a ``pipeline`` block sets ``pipeline.schedule=1f1b``.
``sequence_parallel_size`` (DeepSpeed-Ulysses: an all-to-all from sequence to heads
around attention) is ``mesh.context`` with ``context.strategy=all_gather``, the nearest
strategy here: each device sees every position's keys and values, as Ulysses' heads do.
"""

from __future__ import annotations

from jaxzero import config as config_lib
from jaxzero.frameworks.translated_file import Translation, number

# DeepSpeed's AutoTP keys; those needing no setting here -> what jaxzero does instead.
TENSOR_PARALLEL_KEYS = {"autotp_size", "tp_overlap_comm", "dtype", "vocab_parallel_lm_head",
                        "vocab_parallel_ce_backend", "tp", "tensor_parallel"}
UNNEEDED_TENSOR_PARALLEL = {
    "tp_overlap_comm": "XLA's scheduler overlaps collectives with compute",
    "dtype": "precision.compute gives the compute dtype",
    "vocab_parallel_lm_head": "the head is split over the vocabulary whenever mesh.tensor > 1",
    "vocab_parallel_ce_backend": "the loss is vocabulary-parallel, without gathering logits",
}
PIPELINE_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                 "pipe_partitioned", "grad_partitioned"}
UNNEEDED_PIPELINE = {
    "seed_layers": "every layer's initialisation is drawn from the run's seed",
    "activation_checkpoint_interval": "remat.policy decides what each layer keeps",
    "pipe_partitioned": "activations between stages are split over the data axes",
    "grad_partitioned": "their gradients are split the same way",
}


def translate(tr: Translation, ds: dict, base: config_lib.Config) -> None:
  """Adds the mesh settings of `ds`'s ``tensor_parallel`` and ``pipeline`` blocks to `tr`."""
  if "tensor_parallel" in ds:
    _tensor_parallel(tr, ds["tensor_parallel"])
  if "pipeline" in ds:
    _pipeline(tr, ds["pipeline"], base)
  if "sequence_parallel_size" in ds:
    size = number(tr, ds["sequence_parallel_size"], "sequence_parallel_size", int, 1)
    tr.set("mesh.context", size, "sequence_parallel_size")
    if size > 1:
      tr.set("context.strategy", "all_gather",
             "sequence_parallel_size: Ulysses' all-to-all over heads, whose nearest here is "
             "gathering keys and values")
  axes = [k for k in ("mesh.tensor", "mesh.pipeline", "mesh.context") if k in tr.settings]
  if axes and base.mesh.replica == 1:  # DeepSpeed's data-parallel group: what is left
    tr.set("mesh.fsdp", -1, " and ".join(tr.settings[k][1] for k in axes))


def _tensor_parallel(tr: Translation, block: dict) -> None:
  block = tr.check_keys(block, "tensor_parallel.", TENSOR_PARALLEL_KEYS)
  for key in ("tp", "tensor_parallel"):
    if key in block:
      raise tr.error(f"tensor_parallel.{key}: DeepSpeed's inference tensor parallelism is not "
                     "available; for training set tensor_parallel.autotp_size")
  tr.unneeded.update({f"tensor_parallel.{k}": why for k, why in UNNEEDED_TENSOR_PARALLEL.items()
                      if k in block})
  size = block.get("autotp_size", 0)
  if size != "auto":
    size = number(tr, size, "tensor_parallel.autotp_size", int, 0)
    if size:  # 0: DeepSpeed's "off"
      tr.set("mesh.tensor", size, "tensor_parallel.autotp_size")


def _pipeline(tr: Translation, block: dict, base: config_lib.Config) -> None:
  block = tr.check_keys(block, "pipeline.", PIPELINE_KEYS)
  partition = block.get("partition", "best")
  if partition not in ("uniform", "best", "parameters"):
    raise tr.error(f"pipeline.partition={partition!r} is not available: stages hold equal "
                   "layer counts here (\"uniform\")")
  if partition != "uniform":  # the Llama's layers are alike
    tr.unneeded["pipeline.partition"] = "equal layer counts are also equal parameter counts"
  tr.unneeded.update({f"pipeline.{k}": why for k, why in UNNEEDED_PIPELINE.items()
                      if k in block})
  tr.set("pipeline.schedule", "1f1b", "pipeline")
  tr.set("pipeline.virtual_stages", 1, "pipeline")
  stages = block.get("stages", "auto")
  if stages == "auto":
    if base.mesh.pipeline == 1:
      tr.unneeded["pipeline.stages"] = ("\"auto\": DeepSpeed takes the stage count from "
                                        "PipelineModule(num_stages=...); set mesh.pipeline")
    return
  tr.set("mesh.pipeline", number(tr, stages, "pipeline.stages", int, 1), "pipeline.stages")
