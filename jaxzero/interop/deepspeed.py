"""DeepSpeed's ``ds_config.json`` read as jaxzero settings over a base config.

The file applies over the base config, then ``--set`` over that. A key the file leaves out keeps
the base's value (inside ``optimizer`` or ``scheduler``, DeepSpeed's default), and ``"auto"``
takes the base's value. A key jaxzero does not know, or cannot honour, is an error naming it;
knobs XLA makes unnecessary are accepted and reported once, in one log line.
:class:`jaxzero.interop.translation.Translation` is what the file says in jaxzero's terms.
"""

from __future__ import annotations

import pathlib

from jaxzero import config as config_lib
from jaxzero.interop.translation import (GATHERED_PER_LAYER, SHARDED_SAVES, Translation, number,
                                         param, read_mapping)
from jaxzero.sharding import mesh as mesh_lib

# ----------------------------------------------------------------------------
# ds_config.json

# Accepted and not needed: key -> what jaxzero does instead.
_SCHEDULED = "XLA's scheduler overlaps collectives with compute"
_BUFFERS = "XLA sizes, lays out and combines collective buffers itself"
_LAYOUT = "the stage's layout decides the collectives (gradients reduce-scattered where produced)"
_RESHARD = "checkpoints restore on any mesh and stage"
_PINNED = "offloaded state lives in pinned_host memory"
_NVME_ONLY = "an NVMe-tier setting, unused without device nvme"
_NVME_FIXED = "the NVMe tier's buffers and I/O are fixed (jaxzero.offload.nvme_store)"
UNNEEDED_ZERO = {
    "overlap_comm": _SCHEDULED, "contiguous_gradients": _BUFFERS,
    "reduce_bucket_size": _BUFFERS, "allgather_bucket_size": _BUFFERS,
    "sub_group_size": _BUFFERS, "use_multi_rank_bucket_allreduce": _BUFFERS,
    "reduce_scatter": _LAYOUT, "allgather_partitions": _LAYOUT,
    "round_robin_gradients": _LAYOUT,
    **dict.fromkeys(("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_model_persistence_threshold", "stage3_max_live_parameters",
                     "stage3_max_reuse_distance", "stage3_use_all_reduce_for_fetch_params",
                     "mics_hierarchical_params_gather"), GATHERED_PER_LAYER),
    "stage3_gather_16bit_weights_on_model_save": SHARDED_SAVES,
    "stage3_gather_fp16_weights_on_model_save": SHARDED_SAVES,
    "elastic_checkpoint": _RESHARD, "load_from_fp32_weights": _RESHARD,
    "ignore_unused_parameters": "JAX's gradients cover every parameter",
    "memory_efficient_linear": "remat.policy decides what the backward pass keeps",
    "cpu_offload_use_pin_memory": _PINNED,
}
UNNEEDED_TOP = {
    "wall_clock_breakdown": "metrics.jsonl records step_time_s",
    "memory_breakdown": "python -m jaxzero.plan reports memory per device",
    "prescale_gradients": "gradients are averaged once, in zero.reduce_dtype",
    "gradient_predivide_factor": "gradients are averaged once, in zero.reduce_dtype",
    "zero_allow_untested_optimizer": "one optimizer serves every stage",
    "zero_force_ds_cpu_optimizer": "one optimizer serves every stage",
    "checkpoint": _RESHARD,
    "compile": "every step is compiled by XLA",
    "aio": _NVME_FIXED,
    "tensorboard": "jaxzero always writes TensorBoard events to WORKDIR/tb/",
}
UNNEEDED_ACTIVATIONS = {
    "partition_activations": "activations are sharded over the batch at layer boundaries",
    "contiguous_memory_optimization": _BUFFERS,
    "number_checkpoints": "remat.policy decides what each layer keeps",
    "synchronize_checkpoint_boundary": "remat.policy decides what each layer keeps",
    "profile": "remat.policy decides what each layer keeps",
}
# Blocks jaxzero knows but cannot honour when enabled: key -> why.
MONITORS = ("wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger")
REFUSED_WHEN_ENABLED = {
    **{k: "is not available; jaxzero writes WORKDIR/metrics.jsonl and TensorBoard events in "
          "WORKDIR/tb/" for k in MONITORS},
    "amp": "(NVIDIA Apex AMP) is not available; use bf16",
    "elasticity": "(elastic batch sizes) is not available",
}
REFUSED = {
    "pipeline": "pipeline parallelism is not available",
    "tensor_parallel": "tensor parallelism is not available yet",
}
ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params",
             "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
             "zero_quantized_nontrainable_weights", "mics_shard_size", *UNNEEDED_ZERO}
OFFLOAD_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                "fast_init", "ratio", "pipeline", "pipeline_read", "pipeline_write"}
TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "steps_per_print", "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16",
            "bfloat16", "zero_optimization", "activation_checkpointing", "data_types",
            "communication_data_type", "sparse_gradients", *UNNEEDED_TOP,
            *REFUSED_WHEN_ENABLED, *REFUSED}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "consecutive_hysteresis", "min_loss_scale",
             "fp16_master_weights_and_grads"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def read(path: str, base: config_lib.Config) -> Translation:
  """Reads and translates the ds_config at `path` against `base`."""
  return translate(read_mapping(path, "DeepSpeed"), base, source=pathlib.Path(path).name)


def translate(ds: dict, base: config_lib.Config, source: str = "ds_config") -> Translation:
  """The jaxzero settings a ds_config (a parsed JSON object) means over `base`."""
  tr = Translation(source)
  tr.check_keys(ds, "", TOP_KEYS)
  for key, why in REFUSED.items():
    if key in ds:
      raise tr.error(f"{key}: {why}")
  for key, why in REFUSED_WHEN_ENABLED.items():
    if isinstance(ds.get(key), dict) and ds[key].get("enabled") is True:
      raise tr.error(f"{key}.enabled=true: {key} {why}")
  if ds.get("sparse_gradients"):
    raise tr.error("sparse_gradients=true: sparse gradients are not available")
  tr.unneeded.update({k: UNNEEDED_TOP[k] for k in ds if k in UNNEEDED_TOP})
  _precision(tr, ds)
  _zero(tr, ds.get("zero_optimization", {}))
  _activation_checkpointing(tr, ds.get("activation_checkpointing", {}))
  lr = _optimizer(tr, ds["optimizer"], base) if "optimizer" in ds else base.train.lr
  if "scheduler" in ds:
    _scheduler(tr, ds["scheduler"], base, lr)
  if "gradient_clipping" in ds and ds["gradient_clipping"] != "auto":
    tr.set("train.clip_norm", number(tr, ds["gradient_clipping"], "gradient_clipping",
                                     minimum=0), "gradient_clipping")
  if "steps_per_print" in ds and ds["steps_per_print"] != "auto":
    tr.set("train.log_every", number(tr, ds["steps_per_print"], "steps_per_print", int, 1),
           "steps_per_print")
  _batch(tr, ds, base)
  return tr


def _precision(tr: Translation, ds: dict) -> None:
  fp16 = tr.check_keys(ds.get("fp16", {}), "fp16.", FP16_KEYS)
  if fp16.get("enabled") is True:
    raise tr.error('fp16.enabled=true: jaxzero has no fp16 loss scaling; train in bf16 '
                   'instead ("bf16": {"enabled": true}), which needs none')
  for key in ("bf16", "bfloat16"):  # "bfloat16" is DeepSpeed's older spelling
    block = tr.check_keys(ds.get(key, {}), f"{key}.", {"enabled", "immediate_grad_update"})
    if "immediate_grad_update" in block:
      tr.unneeded[f"{key}.immediate_grad_update"] = "the update runs once per step"
    enabled = block.get("enabled", "auto")
    if enabled != "auto":
      if not isinstance(enabled, bool):
        raise tr.error(f"{key}.enabled={enabled!r} must be true, false or \"auto\"")
      tr.set("precision.compute", "bfloat16" if enabled else "float32",
             f"{key}.enabled")
  data_types = tr.check_keys(ds.get("data_types", {}), "data_types.", {"grad_accum_dtype"})
  for where, key, value in (("data_types.grad_accum_dtype", "zero.grad_dtype",
                             data_types.get("grad_accum_dtype")),
                            ("communication_data_type", "zero.reduce_dtype",
                             ds.get("communication_data_type"))):
    if value is not None:
      if value not in DTYPES:
        raise tr.error(f"{where}={value!r} is not available; choose one of: fp32, bf16")
      tr.set(key, DTYPES[value], where)


def _zero(tr: Translation, zero: dict) -> None:
  tr.check_keys(zero, "zero_optimization.", ZERO_KEYS)
  tr.unneeded.update({f"zero_optimization.{k}": UNNEEDED_ZERO[k]
                      for k in zero if k in UNNEEDED_ZERO})
  if "stage" in zero:
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
  if zero.get("zero_hpz_partition_size", 1) != 1:
    raise tr.error("zero_optimization.zero_hpz_partition_size: ZeRO++ hierarchical "
                   "partitioning is not available; HYBRID_SHARD (zero.strategy) is the nearest")
  if zero.get("mics_shard_size", -1) not in (-1, 0):
    # MiCS: shard inside groups of mics_shard_size devices, replicate across them.
    size = number(tr, zero["mics_shard_size"], "zero_optimization.mics_shard_size", int, 1)
    if zero.get("stage", 3) != 3:
      raise tr.error("zero_optimization.mics_shard_size needs stage 3")
    for key, value in (("zero.strategy", "HYBRID_SHARD"), ("mesh.fsdp", size),
                       ("mesh.replica", -1)):
      tr.set(key, value, "zero_optimization.mics_shard_size")
  _offload(tr, zero, "offload_optimizer", "offload.optimizer", legacy="cpu_offload")
  _offload(tr, zero, "offload_param", "offload.params", legacy="cpu_offload_params")
  stage_named = zero.get("stage", 3)  # absent: the base's stage, checked by config.validate
  if tr.settings.get("offload.params", ("device",))[0] == "pinned_host" and stage_named != 3:
    raise tr.error("zero_optimization.offload_param needs stage 3 (parameters are "
                   "sharded and offloaded only under ZeRO-3)")


def _offload(tr: Translation, zero: dict, key: str, target: str, legacy: str) -> None:
  where = f"zero_optimization.{key}."
  if zero.get(legacy):  # DeepSpeed's older boolean spelling of device "cpu"
    tr.set(target, "pinned_host", f"zero_optimization.{legacy}")
  block = tr.check_keys(zero.get(key, {}), where, OFFLOAD_KEYS)
  device = block.get("device", "none")
  if device == "nvme" and target != "offload.optimizer":
    raise tr.error(f"{where}device=nvme: the NVMe tier holds the optimizer state only; use "
                   "device cpu (pinned host memory)")
  if device == "nvme" and not (isinstance(block.get("nvme_path"), str) and block["nvme_path"]):
    raise tr.error(f"{where}device=nvme needs {where}nvme_path, a directory on local disk")
  if device not in ("none", "cpu", "nvme"):
    raise tr.error(f"{where}device={device!r} is not valid; choose one of: none, cpu, nvme")
  if block.get("ratio", 1) != 1:
    raise tr.error(f"{where}ratio: partial offload is not available; offload all (ratio 1) "
                   f"or nothing")
  if key in zero:
    tr.set(target, {"cpu": "pinned_host", "nvme": "nvme"}.get(device, "device"), f"{where}device")
  if device == "nvme":
    tr.set("offload.nvme_dir", block["nvme_path"], f"{where}nvme_path")
  for name in block:
    if name == "pin_memory" and device != "nvme":
      tr.unneeded[where + name] = _PINNED
    elif name not in ("device", "ratio") and not (device == "nvme" and name == "nvme_path"):
      tr.unneeded[where + name] = _NVME_FIXED if device == "nvme" else _NVME_ONLY


def _activation_checkpointing(tr: Translation, block: dict) -> None:
  known = {"cpu_checkpointing", *UNNEEDED_ACTIVATIONS}
  tr.check_keys(block, "activation_checkpointing.", known)
  tr.unneeded.update({f"activation_checkpointing.{k}": UNNEEDED_ACTIVATIONS[k]
                      for k in block if k in UNNEEDED_ACTIVATIONS})
  # Whether to checkpoint at all is the model code's choice in DeepSpeed and
  # the base config's remat.policy here; the file only moves it to the host.
  if block.get("cpu_checkpointing") is True:
    tr.set("remat.policy", "offload_matmuls", "activation_checkpointing.cpu_checkpointing")


def _optimizer(tr: Translation, block: dict, base: config_lib.Config) -> float:
  """Translates the optimizer block; returns its learning rate."""
  tr.check_keys(block, "optimizer.", {"type", "params"})
  kind = str(block.get("type", "")).lower()  # DeepSpeed matches optimizer names this way
  if kind not in ("adam", "adamw"):
    raise tr.error(f"optimizer.type={block.get('type')!r} is not available; jaxzero trains "
                   f"with AdamW or Adam")
  where = "optimizer.params."
  params = tr.check_keys(block.get("params", {}), where,
                         {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode",
                          "bias_correction", "amsgrad"})
  if params.get("bias_correction", True) is not True or params.get("amsgrad", False):
    raise tr.error(f"{where}bias_correction=false and amsgrad=true are not available")
  if "torch_adam" in params:
    tr.unneeded[where + "torch_adam"] = "the update is one fused XLA computation either way"
  # As DeepSpeed: the name AdamW, or adam_w_mode (default true), means decoupled decay.
  decoupled = kind == "adamw" or params.get("adam_w_mode", True) is not False
  tr.set("train.optimizer", "adamw" if decoupled else "adam", "optimizer.type / adam_w_mode")
  # DeepSpeed's defaults: FusedAdam and CPU Adam decay 0; torch.optim.AdamW 0.01.
  decay = 0.01 if params.get("torch_adam") and decoupled else 0.0
  t = base.train
  betas = params.get("betas", [0.9, 0.999])
  if betas == "auto":
    betas = [t.b1, t.b2]
  if not isinstance(betas, list) or len(betas) != 2:
    raise tr.error(f"{where}betas={betas!r} must be a list of two numbers")
  lr = param(tr, params, where, "lr", t.lr, 1e-3, minimum=0)
  for key, value in (("lr", lr), ("b1", number(tr, betas[0], where + "betas", minimum=0)),
                     ("b2", number(tr, betas[1], where + "betas", minimum=0)),
                     ("eps", param(tr, params, where, "eps", t.eps, 1e-8, minimum=0)),
                     ("weight_decay", param(tr, params, where, "weight_decay",
                                             t.weight_decay, decay, minimum=0))):
    origin = where + ("betas" if key in ("b1", "b2") else key)
    tr.set(f"train.{key}", value, origin)
  return lr


SCHEDULES = {"WarmupLR": "warmup_constant", "WarmupDecayLR": "warmup_linear_decay",
             "WarmupCosineLR": "warmup_cosine_ds"}


def _scheduler(tr: Translation, block: dict, base: config_lib.Config, lr: float) -> None:
  tr.check_keys(block, "scheduler.", {"type", "params"})
  kind = block.get("type")
  if kind not in SCHEDULES:
    raise tr.error(f"scheduler.type={kind!r} is not available; choose one of: "
                   + ", ".join(SCHEDULES))
  where, t = "scheduler.params.", base.train
  known = {"warmup_num_steps", "warmup_type", "last_batch_iteration", "total_num_steps"}
  known |= ({"warmup_min_ratio", "cos_min_ratio"} if kind == "WarmupCosineLR"
            else {"warmup_min_lr", "warmup_max_lr"})
  if kind == "WarmupLR":
    known.remove("total_num_steps")
  params = tr.check_keys(block.get("params", {}), where, known)
  if params.get("last_batch_iteration", -1) != -1:
    raise tr.error(f"{where}last_batch_iteration: a run resumes its schedule from its "
                   f"checkpoint's step; leave it at -1")
  tr.set("train.schedule", SCHEDULES[kind], "scheduler.type")
  warmup_type = params.get("warmup_type", "log")
  if warmup_type == "auto":
    warmup_type = t.warmup_type
  if warmup_type not in ("log", "linear"):
    raise tr.error(f"{where}warmup_type={warmup_type!r} is not valid; choose one of: log, linear")
  tr.set("train.warmup_type", warmup_type, where + "warmup_type")
  warmup = param(tr, params, where, "warmup_num_steps", t.warmup_steps, 1000, int, 1)
  tr.set("train.warmup_steps", warmup, where + "warmup_num_steps")
  if kind != "WarmupLR":
    if "total_num_steps" not in params:
      raise tr.error(f"{where}total_num_steps is required by {kind}")
    tr.set("train.steps", param(tr, params, where, "total_num_steps", t.steps, None, int, 1),
           where + "total_num_steps")
  if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
    tr.set("train.warmup_min_ratio", param(tr, params, where, "warmup_min_ratio",
                                            t.warmup_min_ratio, 0.0, minimum=0),
           where + "warmup_min_ratio")
    tr.set("train.min_lr_ratio", param(tr, params, where, "cos_min_ratio", t.min_lr_ratio,
                                        1e-4, minimum=0), where + "cos_min_ratio")
    return
  # WarmupLR's peak defaults to the optimizer's lr, WarmupDecayLR's to 0.001.
  max_lr = param(tr, params, where, "warmup_max_lr", t.lr,
                  lr if kind == "WarmupLR" else 1e-3, minimum=0)
  min_lr = param(tr, params, where, "warmup_min_lr", t.warmup_min_ratio * max_lr, 0.0,
                  minimum=0)
  tr.set("train.lr", max_lr, where + "warmup_max_lr")
  tr.set("train.warmup_min_ratio", min_lr / max_lr if max_lr else 0.0,
         where + "warmup_min_lr / warmup_max_lr")


BATCH_RULE = ("DeepSpeed's rule: train_batch_size = train_micro_batch_size_per_gpu x "
              "gradient_accumulation_steps x data-parallel devices")


def _batch(tr: Translation, ds: dict, base: config_lib.Config) -> None:
  """DeepSpeed's batch arithmetic: any two of the three sizes give the third.

  jaxzero's data-parallel devices are the mesh's (every device holds a slice
  of the batch). The device count is known only when the run starts, so it
  is taken from the mesh the base config (with this file's mesh settings)
  names. Where that mesh takes "all remaining devices" (-1) and the file
  gives all three sizes, the sizes fix the device count and the mesh is
  pinned to it, so a run on a different count stops with the mesh's error
  instead of training another batch; where the count is needed and cannot be
  inferred, it is an error asking for it.
  """
  t = base.train
  mesh_cfg = tr.apply(base).mesh
  world = mesh_lib.data_parallel_needed(mesh_cfg) or None
  base_micro = (t.global_batch // (world * t.grad_accum)
                if world and t.global_batch % (world * t.grad_accum) == 0 else None)
  names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
  tbs, micro, gas = (
      param(tr, ds, "", name, auto, None, int, 1)
      for name, auto in zip(names, (t.global_batch, base_micro, t.grad_accum)))
  if tbs is micro is gas is None:
    return
  origin = " / ".join(n for n in names if n in ds)

  def need_world():
    if world is None:
      raise tr.error(f"{origin}: the data-parallel device count is needed ({BATCH_RULE}), and "
                     f"the base config's mesh ({mesh_cfg.replica} x {mesh_cfg.fsdp}) takes all "
                     f"devices; give train_batch_size, or name the mesh in the base config")
    return world

  if tbs is None and micro is None:
    raise tr.error("gradient_accumulation_steps alone does not give a batch size: set "
                   "train_batch_size or train_micro_batch_size_per_gpu")
  if micro is None:  # the micro-batch follows from the devices at run time
    gas = gas or 1
    if world is not None and tbs % (gas * world):
      raise tr.error(f"train_batch_size={tbs} is not divisible by gradient_accumulation_steps "
                     f"({gas}) x data-parallel devices ({world}); {BATCH_RULE}")
  elif tbs is None:
    gas = gas or 1
    tbs = micro * gas * need_world()
  elif gas is None:
    if tbs % (micro * need_world()):
      raise tr.error(f"train_batch_size={tbs} is not divisible by train_micro_batch_size_per_gpu "
                     f"({micro}) x data-parallel devices ({world}); {BATCH_RULE}")
    gas = tbs // (micro * world)
  elif world is None:
    if tbs % (micro * gas):
      raise tr.error(f"train_batch_size={tbs} is not divisible by train_micro_batch_size_per_gpu "
                     f"({micro}) x gradient_accumulation_steps ({gas}); {BATCH_RULE}")
    _pin_mesh(tr, mesh_cfg, tbs // (micro * gas))
  elif tbs != micro * gas * world:
    raise tr.error(f"train_batch_size={tbs} != train_micro_batch_size_per_gpu ({micro}) x "
                   f"gradient_accumulation_steps ({gas}) x data-parallel devices ({world}) = "
                   f"{micro * gas * world}; {BATCH_RULE}")
  tr.set("train.global_batch", tbs, origin)
  tr.set("train.grad_accum", gas, origin)


def _pin_mesh(tr: Translation, mesh_cfg: config_lib.MeshConfig, devices: int) -> None:
  axis, fixed = (("mesh.fsdp", mesh_cfg.replica) if mesh_cfg.fsdp == -1
                 else ("mesh.replica", mesh_cfg.fsdp))
  if devices % fixed:
    raise tr.error(f"the batch sizes imply {devices} data-parallel devices, which the base "
                   f"config's mesh ({mesh_cfg.replica} x {mesh_cfg.fsdp}) cannot hold; "
                   f"{BATCH_RULE}")
  tr.set(axis, devices // fixed, "train_batch_size / (train_micro_batch_size_per_gpu x "
         "gradient_accumulation_steps)")
