"""DeepSpeed's ``ds_config.json`` read as jaxzero settings over a base config.

The file applies over the base config, then ``--set`` over that. A key the file leaves out keeps
the base's value (inside ``optimizer`` or ``scheduler``, DeepSpeed's default), and ``"auto"``
takes the base's value. A key jaxzero does not know, or cannot honour, is an error naming it;
knobs XLA makes unnecessary are accepted and reported once, in one log line.
:class:`jaxzero.frameworks.translated_file.Translation` is what the file says in jaxzero's terms.
"""

from __future__ import annotations

import dataclasses
import pathlib

from jaxzero import config as config_lib
from jaxzero.frameworks import ds_parallel
from jaxzero.frameworks.translated_file import (GATHERED_PER_LAYER, SHARDED_SAVES, Translation,
                                                number, param, read_mapping)
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
_PARAM_BUFFERS = {"buffer_count": "one layer is read ahead (jaxzero.offload.infinity)",  # nvme
                  "buffer_size": "whole layers are read, in the NVMe tier's chunks",
                  "max_in_cpu": "each layer is read from NVMe when it runs, none kept in RAM"}
UNNEEDED_ZERO = {
    "overlap_comm": _SCHEDULED, "contiguous_gradients": _BUFFERS,
    "reduce_bucket_size": _BUFFERS, "allgather_bucket_size": _BUFFERS,
    "sub_group_size": _BUFFERS, "use_multi_rank_bucket_allreduce": _BUFFERS,
    "reduce_scatter": _LAYOUT, "allgather_partitions": _LAYOUT,
    "round_robin_gradients": _LAYOUT,
    **dict.fromkeys(("stage3_prefetch_bucket_size", "stage3_model_persistence_threshold",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_use_all_reduce_for_fetch_params",
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
MONITORS = ("csv_monitor", "comet", "flops_profiler", "comms_logger")
WANDB_KEYS = {"enabled", "project", "group", "team"}
REFUSED_WHEN_ENABLED = {
    **{k: "is not available; jaxzero writes WORKDIR/metrics.jsonl and TensorBoard events in "
          "WORKDIR/tb/" for k in MONITORS},
    "amp": "(NVIDIA Apex AMP) is not available; use bf16",
    "elasticity": "(elastic batch sizes) is not available",
}
ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params",
             "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
             "zero_quantized_nontrainable_weights", "mics_shard_size",
             "stage3_param_persistence_threshold", *UNNEEDED_ZERO}
OFFLOAD_KEYS = {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                "fast_init", "ratio", "pipeline", "pipeline_read", "pipeline_write"}
TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "steps_per_print", "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16",
            "bfloat16", "zero_optimization", "activation_checkpointing", "data_types",
            "communication_data_type", "sparse_gradients", "wandb", *UNNEEDED_TOP,
            "pipeline", "tensor_parallel", *REFUSED_WHEN_ENABLED}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "consecutive_hysteresis", "min_loss_scale",
             "fp16_master_weights_and_grads"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# fp16 block key -> (precision key, type, least value, DeepSpeed's default).
FP16_SCALER = {"loss_scale": ("precision.loss_scale", float, 0, 0.0),
               "initial_scale_power": ("precision.initial_scale_power", int, 0, 16),
               "loss_scale_window": ("precision.loss_scale_window", int, 1, 1000),
               "hysteresis": ("precision.hysteresis", int, 1, 2),
               "min_loss_scale": ("precision.min_loss_scale", float, None, 1.0)}


def read(path: str, base: config_lib.Config) -> Translation:
  """Reads and translates the ds_config at `path` against `base`."""
  return translate(read_mapping(path, "DeepSpeed"), base, source=pathlib.Path(path).name)


def translate(ds: dict, base: config_lib.Config, source: str = "ds_config") -> Translation:
  """The jaxzero settings a ds_config (a parsed JSON object) means over `base`."""
  tr = Translation(source)
  tr.check_keys(ds, "", TOP_KEYS)
  for key, why in REFUSED_WHEN_ENABLED.items():
    if isinstance(ds.get(key), dict) and ds[key].get("enabled") is True:
      raise tr.error(f"{key}.enabled=true: {key} {why}")
  if ds.get("sparse_gradients"):
    raise tr.error("sparse_gradients=true: sparse gradients are not available")
  tr.unneeded.update({k: UNNEEDED_TOP[k] for k in ds if k in UNNEEDED_TOP})
  _precision(tr, ds, base)
  _wandb(tr, ds.get("wandb", {}), base)
  _zero(tr, ds.get("zero_optimization", {}))
  ds_parallel.translate(tr, ds, base)
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
  _batch_request(tr, ds)
  return tr


def _wandb(tr: Translation, block: dict, base: config_lib.Config) -> None:
  """DeepSpeed's wandb monitor: its project (DeepSpeed's default "deepspeed"), group, team."""
  block = tr.check_keys(block, "wandb.", WANDB_KEYS)
  if _enabled(tr, block, "wandb") is not True:
    return
  tr.set("log.wandb", block.get("project") or base.log.wandb or "deepspeed", "wandb.project")
  for key, target in (("group", "log.wandb_group"), ("team", "log.wandb_entity")):
    if block.get(key):
      tr.set(target, block[key], f"wandb.{key}")


def _enabled(tr: Translation, block: dict, where: str):
  enabled = block.get("enabled", "auto")
  if enabled != "auto" and not isinstance(enabled, bool):
    raise tr.error(f"{where}.enabled={enabled!r} must be true, false or \"auto\"")
  return enabled


def _precision(tr: Translation, ds: dict, base: config_lib.Config) -> None:
  fp16 = tr.check_keys(ds.get("fp16", {}), "fp16.", FP16_KEYS)
  fp16_on = _enabled(tr, fp16, "fp16") is True
  for key in ("bf16", "bfloat16"):  # "bfloat16" is DeepSpeed's older spelling
    block = tr.check_keys(ds.get(key, {}), f"{key}.", {"enabled", "immediate_grad_update"})
    if "immediate_grad_update" in block:
      tr.unneeded[f"{key}.immediate_grad_update"] = "the update runs once per step"
    enabled = _enabled(tr, block, key)
    if enabled is True and fp16_on:
      raise tr.error(f"fp16.enabled and {key}.enabled are both true; enable one")
    if enabled != "auto" and not fp16_on:
      tr.set("precision.compute", "bfloat16" if enabled else "float32", f"{key}.enabled")
  if fp16_on:
    _fp16(tr, fp16, base.precision)
  data_types = tr.check_keys(ds.get("data_types", {}), "data_types.", {"grad_accum_dtype"})
  for where, key, value in (("data_types.grad_accum_dtype", "zero.grad_dtype",
                             data_types.get("grad_accum_dtype")),
                            ("communication_data_type", "zero.reduce_dtype",
                             ds.get("communication_data_type"))):
    if value is not None:
      if value not in DTYPES:
        raise tr.error(f"{where}={value!r} is not available; choose one of: fp32, bf16, fp16")
      tr.set(key, DTYPES[value], where)


def _fp16(tr: Translation, fp16: dict, base: config_lib.PrecisionConfig) -> None:
  """DeepSpeed's fp16 block: float16 compute with its loss scaler's settings."""
  tr.set("precision.compute", "float16", "fp16.enabled")
  if fp16.get("fp16_master_weights_and_grads") is True:
    raise tr.error("fp16.fp16_master_weights_and_grads=true: jaxzero keeps fp32 master "
                   "weights; leave it false")
  if fp16.get("auto_cast") not in (None, "auto", False):
    tr.unneeded["fp16.auto_cast"] = ("the compute copy of the weights is float16 and the "
                                     "model's inputs are token ids: nothing to cast")
  values = {}
  for key, (target, kind, least, default) in FP16_SCALER.items():
    base_value = getattr(base, target.split(".")[1])  # for "auto"
    values[key] = param(tr, fp16, "fp16.", key, base_value, default, kind, least)
    tr.set(target, values[key], f"fp16.{key}")
  consecutive = fp16.get("consecutive_hysteresis", False)
  if consecutive == "auto":
    consecutive = base.consecutive_hysteresis
  if not isinstance(consecutive, bool):
    raise tr.error(f"fp16.consecutive_hysteresis={consecutive!r} must be true or false")
  tr.set("precision.consecutive_hysteresis", consecutive, "fp16.consecutive_hysteresis")
  if values["min_loss_scale"] <= 0 or (
      values["loss_scale"] == 0 and values["min_loss_scale"] > 2 ** values["initial_scale_power"]):
    raise tr.error(f"fp16.min_loss_scale={values['min_loss_scale']:g} must be positive and at "
                   f"most the initial scale 2**fp16.initial_scale_power = "
                   f"{2 ** values['initial_scale_power']:g}")


def _zero(tr: Translation, zero: dict) -> None:
  tr.check_keys(zero, "zero_optimization.", ZERO_KEYS)
  tr.unneeded.update({f"zero_optimization.{k}": UNNEEDED_ZERO[k]
                      for k in zero if k in UNNEEDED_ZERO})
  threshold = zero.get("stage3_param_persistence_threshold", "auto")
  if threshold != "auto":
    where = "zero_optimization.stage3_param_persistence_threshold"
    tr.set("zero.min_shard_size", number(tr, threshold, where, int, 0), where)
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
  if block.get("ratio", 1) != 1:
    raise tr.error(f"{where}ratio: partial offload is not available; offload all (ratio 1) "
                   f"or nothing")
  if key in zero:
    tr.set(target, {"cpu": "pinned_host", "nvme": "nvme"}.get(device, "device"), f"{where}device")
  if device == "nvme":
    named = tr.settings.get("offload.nvme_dir")
    if named and named[0] != block["nvme_path"]:
      raise tr.error(f"{where}nvme_path={block['nvme_path']!r} differs from {named[1]}="
                     f"{named[0]!r}: the parameters, gradients and optimizer state share one "
                     "directory here (offload.nvme_dir); give both the same path")
    tr.set("offload.nvme_dir", block["nvme_path"], f"{where}nvme_path")
  for name in block:
    if name == "pin_memory" and device != "nvme":
      tr.unneeded[where + name] = _PINNED
    elif name not in ("device", "ratio") and not (device == "nvme" and name == "nvme_path"):
      tr.unneeded[where + name] = (_NVME_ONLY if device != "nvme" else
                                   _PARAM_BUFFERS.get(name, _NVME_FIXED)
                                   if key == "offload_param" else _NVME_FIXED)


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
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch_request(tr: Translation, ds: dict) -> None:
  """The file's three batch sizes, each a number or None ("auto" or absent):
  resolved by :func:`resolve_batch` once --set is applied and the devices are known."""
  request = {key: param(tr, ds, "", key, None, None, int, 1) for key in BATCH_KEYS}
  tr.batch = request if any(v is not None for v in request.values()) else None


def resolve_batch(cfg: config_lib.Config, tr: Translation, n_devices: int, from_set=()
                  ) -> tuple[config_lib.Config, dict[str, str]]:
  """`cfg` with the file's batch sizes resolved by DeepSpeed's rule on `n_devices`,
  and how each derived value was found ({dotted key: "auto: ..."}).

  "auto" (or absent) fills the size the other two and the device count give;
  what cannot be derived is the base's. `--set train.global_batch` or
  `--set train.grad_accum` (`from_set`) replaces the file's number. Three fixed
  sizes that disagree with the device count are one error stating the arithmetic.
  """
  if tr.batch is None:
    return cfg, {}
  t = cfg.train
  tbs, micro, gas = (tr.batch[k] for k in BATCH_KEYS)
  names = dict(zip(BATCH_KEYS, BATCH_KEYS))
  if "train.global_batch" in from_set:
    tbs, names["train_batch_size"] = t.global_batch, "train.global_batch"
  if "train.grad_accum" in from_set:
    gas, names["gradient_accumulation_steps"] = t.grad_accum, "train.grad_accum"
  replica, fsdp, _ = mesh_lib.resolve_shape(cfg.mesh, n_devices)
  world = replica * fsdp
  how = {}
  if micro is None:  # the micro-batch follows at run time from the other two
    tbs, gas = (t.global_batch if tbs is None else tbs), (t.grad_accum if gas is None else gas)
    if tbs % (gas * world):
      raise tr.error(f"{names['train_batch_size']}={tbs} is not divisible by "
                     f"{names['gradient_accumulation_steps']} {gas} x {world} data-parallel "
                     f"devices; {BATCH_RULE}")
  elif tbs is None:
    gas = t.grad_accum if gas is None else gas
    tbs = micro * gas * world
    how["train.global_batch"] = (f"auto: train_micro_batch_size_per_gpu {micro} x "
                                 f"{names['gradient_accumulation_steps']} {gas} x {world} "
                                 "data-parallel devices")
  elif gas is None:
    if tbs % (micro * world):
      raise tr.error(f"{names['train_batch_size']}={tbs} is not divisible by "
                     f"train_micro_batch_size_per_gpu {micro} x {world} data-parallel devices; "
                     f"{BATCH_RULE}")
    gas = tbs // (micro * world)
    how["train.grad_accum"] = (f"auto: {names['train_batch_size']} {tbs} / "
                               f"(train_micro_batch_size_per_gpu {micro} x {world} devices)")
  elif tbs != micro * gas * world:
    fits = tbs // (micro * gas) if tbs % (micro * gas) == 0 else None
    mesh_hint = (f"a mesh of {fits} data-parallel devices (mesh.replica x mesh.fsdp)" if fits
                 else "another mesh size")
    raise tr.error(f"{names['train_batch_size']}={tbs} != train_micro_batch_size_per_gpu "
                   f"{micro} x {names['gradient_accumulation_steps']} {gas} x {world} "
                   f"data-parallel devices = {micro * gas * world}; use {mesh_hint}, or --set "
                   f"train.global_batch={micro * gas * world} (or train.grad_accum) over the file")
  for key, name in (("train.global_batch", "train_batch_size"),
                    ("train.grad_accum", "gradient_accumulation_steps")):
    if key not in how and key not in from_set and tr.batch[name] is not None:
      how[key] = f"{tr.source}: {name}"
  train = dataclasses.replace(t, global_batch=tbs, grad_accum=gas)
  return dataclasses.replace(cfg, train=train), how
