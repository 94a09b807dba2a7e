"""A ds_config's ``zero_optimization`` block as ``zero.*`` and ``offload.*`` settings.

The stage, MiCS (``mics_shard_size``: HYBRID_SHARD over groups of that size) and the
optimizer and parameter offload blocks (``cpu``: pinned_host; ``nvme``: the NVMe tier, one
directory for both; the optimizer's ``ratio``, partial offload at stage 3: Twin-Flow's
``offload.optimizer_fraction``). ZeRO++ quantization and hierarchical partitioning are
refused; ``stage3_param_persistence_threshold`` + 1 is ``zero.min_shard_size``, and the
bucket and prefetch knobs are accepted as unneeded.
"""

from __future__ import annotations

import os

from jaxzero.frameworks.translated_file import (GATHERED_PER_LAYER, SHARDED_SAVES, Translation,
                                                number)

# Accepted and not needed: key -> what jaxzero does instead (BUFFERS, RESHARD and NVME_FIXED
# are also why for keys outside this block: jaxzero.frameworks.deepspeed).
_SCHEDULED = "XLA's scheduler overlaps collectives with compute"
BUFFERS = "XLA sizes, lays out and combines collective buffers itself"
_LAYOUT = "the stage's layout decides the collectives (gradients reduce-scattered where produced)"
RESHARD = "checkpoints restore on any mesh and stage"
_PINNED = "offloaded state lives in pinned_host memory"
_NVME_ONLY = "an NVMe-tier setting, unused without device nvme"
NVME_FIXED = "the NVMe tier's buffers and I/O are fixed (jaxzero.offload.nvme_store)"
_PARAM_BUFFERS = {"buffer_count": "one layer is read ahead (jaxzero.runners.infinity)",  # nvme
                  "buffer_size": "whole layers are read, in the NVMe tier's chunks",
                  "max_in_cpu": "each layer is read from NVMe when it runs, none kept in RAM"}
UNNEEDED_ZERO = {
    "overlap_comm": _SCHEDULED, "contiguous_gradients": BUFFERS,
    "reduce_bucket_size": BUFFERS, "allgather_bucket_size": BUFFERS,
    "sub_group_size": BUFFERS, "use_multi_rank_bucket_allreduce": BUFFERS,
    "reduce_scatter": _LAYOUT, "allgather_partitions": _LAYOUT,
    "round_robin_gradients": _LAYOUT,
    **dict.fromkeys(("stage3_prefetch_bucket_size", "stage3_model_persistence_threshold",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance",
                     "stage3_use_all_reduce_for_fetch_params",
                     "mics_hierarchical_params_gather"), GATHERED_PER_LAYER),
    "stage3_gather_16bit_weights_on_model_save": SHARDED_SAVES,
    "stage3_gather_fp16_weights_on_model_save": SHARDED_SAVES,
    "elastic_checkpoint": RESHARD, "load_from_fp32_weights": RESHARD,
    "ignore_unused_parameters": "JAX's gradients cover every parameter",
    "memory_efficient_linear": "remat.policy decides what the backward pass keeps",
    "cpu_offload_use_pin_memory": _PINNED,
    # DeepSpeed 0.19's newer knobs: how its hooks fetch, pad and check; none changes the math.
    "stage3_module_granularity_threshold": GATHERED_PER_LAYER, "leaf_module": GATHERED_PER_LAYER,
    "stage3_allgather_sequential": BUFFERS, "parameter_alignment": BUFFERS,
    "pipeline_loading_checkpoint": RESHARD,
    "override_module_apply": "weights are created (or read) straight into their shards",
    **dict.fromkeys(("log_trace_cache_warnings", "enable_sanity_checks"),
                    "the step is one compiled XLA program: no module trace to cache or check"),
    "compute_grad_norm": "the gradient norm is computed every step (the log, train.clip_norm and "
                         "the non-finite guard)",
    "legacy_stage1": "one implementation of each stage",
    "save_muon_momentum_buffer_in_memory": "jaxzero trains with AdamW or Adam: no Muon state",
}
ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param",
             "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
             "zero_quantized_nontrainable_weights", "mics_shard_size",
             "stage3_param_persistence_threshold", "zenflow", *UNNEEDED_ZERO}
OFFLOAD_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                "fast_init", "ratio", "pipeline", "pipeline_read", "pipeline_write",
                "super_offload", "cpuadam_cores_perc"}
_HOST_UPDATE = {"super_offload": "the host's update is XLA:CPU's, over all its cores",
                "cpuadam_cores_perc": "the host's update is XLA:CPU's, over all its cores"}


def translate(tr: Translation, ds: dict) -> None:
  """Adds the settings of `ds`'s ``zero_optimization`` block to `tr`."""
  zero = ds.get("zero_optimization", {})
  tr.check_keys(zero, "zero_optimization.", ZERO_KEYS)
  tr.unneeded.update({f"zero_optimization.{k}": UNNEEDED_ZERO[k]
                      for k in zero if k in UNNEEDED_ZERO})
  threshold = zero.get("stage3_param_persistence_threshold", "auto")
  if threshold != "auto":
    where = "zero_optimization.stage3_param_persistence_threshold"
    # DeepSpeed keeps a parameter of at most `threshold` elements whole; jaxzero one under
    # min_shard_size.
    tr.set("zero.min_shard_size", number(tr, threshold, where, int, 0) + 1, f"{where} + 1")
  if "stage" not in zero:
    for key, value in (("zero.stage", 0), ("zero.strategy", ""), ("zero.hybrid", False)):
      tr.set(key, value, "no zero_optimization.stage: DeepSpeed's default, 0")
  else:
    stage = zero["stage"]
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
      raise tr.error(f"zero_optimization.stage={stage!r} is not valid; choose one of: 0, 1, 2, 3")
    for key, value in (("zero.stage", stage), ("zero.strategy", ""), ("zero.hybrid", False)):
      tr.set(key, value, "zero_optimization.stage")
  for key, why in (("zero_quantized_weights", "ZeRO++ quantized weights"),
                   ("zero_quantized_gradients", "ZeRO++ quantized gradients"),
                   ("zero_quantized_nontrainable_weights", "ZeRO++ quantized weights")):
    if zero.get(key):
      raise tr.error(f"zero_optimization.{key}=true: {why} are not available")
  if zero.get("zenflow") is not None:  # a block (even {}) turns ZenFlow on
    raise tr.error("zero_optimization.zenflow: ZenFlow (the less important gradients applied "
                   "late, from the CPU) is a DeepSpeed setting jaxzero does not support; leave "
                   "it out")
  if zero.get("zero_hpz_partition_size", 1) != 1:
    raise tr.error("zero_optimization.zero_hpz_partition_size: ZeRO++ hierarchical "
                   "partitioning is not available; HYBRID_SHARD (zero.strategy) is the nearest")
  if zero.get("mics_shard_size", -1) not in (-1, 0):
    # MiCS: shard inside groups of mics_shard_size devices, replicate across them.
    size = number(tr, zero["mics_shard_size"], "zero_optimization.mics_shard_size", int, 1)
    if zero.get("stage", 0) != 3:
      raise tr.error("zero_optimization.mics_shard_size needs stage 3")
    for key, value in (("zero.strategy", "HYBRID_SHARD"), ("mesh.fsdp", size),
                       ("mesh.replica", -1)):
      tr.set(key, value, "zero_optimization.mics_shard_size")
  _offload(tr, zero, "offload_optimizer", "offload.optimizer", legacy="cpu_offload")
  _offload(tr, zero, "offload_param", "offload.params", legacy="cpu_offload_param")
  stage_named = zero.get("stage", 0)
  if (tr.settings.get("offload.params", ("device",))[0] == "nvme"
      and tr.settings.get("offload.optimizer", ("device",))[0] != "nvme"):
    raise tr.error("zero_optimization.offload_param.device=nvme needs offload_optimizer.device="
                   "nvme too: the parameter tier reads the master weights from its files")
  if tr.settings.get("offload.params", ("device",))[0] != "device" and stage_named != 3:
    raise tr.error("zero_optimization.offload_param needs stage 3 (parameters are "
                   "sharded and offloaded only under ZeRO-3)")


def _offload(tr: Translation, zero: dict, key: str, target: str, legacy: str) -> None:
  where = f"zero_optimization.{key}."
  if zero.get(legacy):  # DeepSpeed's older boolean spelling of device "cpu"
    tr.set(target, "pinned_host", f"zero_optimization.{legacy}")
  block = tr.check_keys(zero.get(key, {}), where, OFFLOAD_KEYS)
  device = block.get("device", "none")
  if device == "nvme" and not (isinstance(block.get("nvme_path"), str) and block["nvme_path"]):
    raise tr.error(f"{where}device=nvme needs {where}nvme_path, a directory on local disk")
  if device not in ("none", "cpu", "nvme"):
    raise tr.error(f"{where}device={device!r} is not valid; choose one of: none, cpu, nvme")
  ratio = block.get("ratio", 1)
  if ratio != 1:
    if (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
        or not 0 <= ratio <= 1):
      raise tr.error(f"{where}ratio={ratio!r} must be a number from 0 to 1")
    if key != "offload_optimizer" or device != "cpu" or zero.get("stage", 0) != 3:
      # DeepSpeed's partial offload: ZeRO-Offload++'s Twin-Flow, of the optimizer state
      # in CPU memory at stage 3 (its config asserts the stage).
      raise tr.error(f"{where}ratio={ratio} (partial offload) applies to offload_optimizer "
                     "with device cpu at stage 3, as in DeepSpeed")
    tr.set("offload.optimizer_fraction", float(ratio), f"{where}ratio")
  if key in zero:
    tr.set(target, {"cpu": "pinned_host", "nvme": "nvme"}.get(device, "device"), f"{where}device")
  elif not zero.get(legacy):
    tr.set(target, "device", f"no zero_optimization.{key}: DeepSpeed's default, none")
  if device == "nvme":
    named = tr.settings.get("offload.nvme_dir")
    if named and os.path.normpath(named[0]) != os.path.normpath(block["nvme_path"]):
      raise tr.error(f"{where}nvme_path={block['nvme_path']!r} differs from {named[1]}="
                     f"{named[0]!r}: the parameters, gradients and optimizer state share one "
                     "directory here (offload.nvme_dir); give both the same path")
    tr.set("offload.nvme_dir", block["nvme_path"], f"{where}nvme_path")
  for name in block:
    if name == "pin_memory" and device != "nvme":
      tr.unneeded[where + name] = _PINNED
    elif name in _HOST_UPDATE:
      tr.unneeded[where + name] = _HOST_UPDATE[name]
    elif name not in ("device", "ratio") and not (device == "nvme" and name == "nvme_path"):
      tr.unneeded[where + name] = (_NVME_ONLY if device != "nvme" else
                                   _PARAM_BUFFERS.get(name, NVME_FIXED)
                                   if key == "offload_param" else NVME_FIXED)
