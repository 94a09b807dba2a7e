"""DeepSpeed's ``ds_config.json`` read as jaxzero settings over a base config.

The file applies over the base config, then ``--set`` over that. What the file governs in
DeepSpeed it governs here, absent keys included, with DeepSpeed's defaults: no enabled
``bf16``/``fp16`` block trains fp32, no ``gradient_clipping`` clips at 1.0, no
``zero_optimization.stage`` is stage 0, no offload block offloads nothing, a batch key left
out is DeepSpeed's rule's (gradient accumulation 1), and gradients accumulate and are
reduced in the training dtype unless ``data_types.grad_accum_dtype`` and
``communication_data_type`` say otherwise. Without an ``optimizer`` or ``scheduler`` block
DeepSpeed uses the training script's, here the base config's. ``"auto"`` (the HF
Trainer's) takes the run's value: the base's. A key jaxzero does not know, or cannot
honour, is an error naming it; knobs XLA makes unnecessary are accepted and reported once,
in one log line.
:class:`jaxzero.frameworks.translated_file.Translation` is what the file says in jaxzero's terms.
"""

from __future__ import annotations

import dataclasses
import pathlib

from jaxzero import config as config_lib
from jaxzero.frameworks import ds_optimizer, ds_parallel, ds_zero
from jaxzero.frameworks.ds_zero import BUFFERS, NVME_FIXED, RESHARD
from jaxzero.frameworks.translated_file import Translation, number, param, read_mapping
from jaxzero.parallel import mesh as mesh_lib

# ----------------------------------------------------------------------------
# ds_config.json

# Accepted and not needed: key -> what jaxzero does instead.
UNNEEDED_TOP = {
    "wall_clock_breakdown": "metrics.jsonl records step_time_s",
    "memory_breakdown": "python -m jaxzero.plan reports memory per device",
    "prescale_gradients": "gradients are averaged once, in zero.reduce_dtype",
    "gradient_predivide_factor": "gradients are averaged once, in zero.reduce_dtype",
    "zero_allow_untested_optimizer": "one optimizer serves every stage",
    "zero_force_ds_cpu_optimizer": "one optimizer serves every stage",
    "checkpoint": RESHARD,
    "compile": "every step is compiled by XLA",
    "aio": NVME_FIXED,
    "tensorboard": "jaxzero always writes TensorBoard events to WORKDIR/tb/",
    # It spaces DeepSpeed's own progress print, not its metrics or overflow checks: taken as
    # train.log_every, HF's 2000 would log (and check for non-finite steps) that rarely.
    "steps_per_print": "metrics are logged every train.log_every steps (the base's)",
    "dataloader_drop_last": "every batch is full: windows of the token stream, by step",
    "disable_allgather": "the stage's layout decides the collectives",
    "dump_state": "--print-config prints the resolved config and where each value came from",
    "log_level": "jaxzero logs through Python's logging, at INFO",
    "timers": "metrics.jsonl records step_time_s and tokens/s",
    "disable_python_gc": "a step is one compiled XLA program, which Python's collector never "
                         "interrupts",
    "seq_parallel_communication_data_type": "context parallelism gathers keys and values in "
                                            "the compute dtype",
}
# Keys whose value decides whether jaxzero can honour them: key -> (DeepSpeed's default,
# {value accepted as unneeded: why}, {DeepSpeed's other value, refused: why}).
BY_VALUE = {
    "gradient_allreduce_op": (
        "mean", {"mean": "gradients are averaged over the devices"},
        {"sum": "summed gradients (N devices' times the mean) are not available"}),
    "managed_gradient_accumulation": (
        True, {True: "each step runs train.grad_accum micro-batches itself"},
        {False: "the script owning the accumulation boundary is not available: a step runs "
                "train.grad_accum micro-batches"}),
}
UNNEEDED_ACTIVATIONS = {
    "partition_activations": "activations are sharded over the batch at layer boundaries",
    "contiguous_memory_optimization": BUFFERS,
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
# DeepSpeed features that change what trains: refused when enabled (anywhere in the block:
# DeepSpeed reads data_efficiency's inner switches on their own), accepted when disabled.
UNSUPPORTED_WHEN_ENABLED = {
    "hybrid_engine": "DeepSpeed's hybrid engine (generation inside RLHF training)",
    "torch_autocast": "torch autocast",
    "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency (curriculum learning, random-LTD)",
}
TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16",
            "bfloat16", "zero_optimization", "activation_checkpointing", "data_types",
            "communication_data_type", "sparse_gradients", "wandb", *UNNEEDED_TOP, *BY_VALUE,
            "pipeline", "tensor_parallel", "sequence_parallel_size", *REFUSED_WHEN_ENABLED,
            *UNSUPPORTED_WHEN_ENABLED}
BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow",
             "bf16_master_weights_and_grads", "bf16_optimizer_states"}
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "consecutive_hysteresis", "min_loss_scale",
             "fp16_master_weights_and_grads"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DATA_TYPES_KEYS = {"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"}
# grad_accum_dtype's other names, as DeepSpeed's DtypeEnum takes them (exactly).
DTYPE_ALIASES = {"float32": "float32", "float": "float32", "torch.float32": "float32",
                 "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16", "float16": "float16",
                 "half": "float16", "torch.float16": "float16"}
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
  for key, what in UNSUPPORTED_WHEN_ENABLED.items():
    if key in ds:
      switch = _switched_on(tr, ds[key], key)
      if switch:
        instead = " and enable bf16 instead" if key == "torch_autocast" else ""
        raise tr.error(f"{switch}=true: {what} is a DeepSpeed setting jaxzero does not support;"
                       f" leave it disabled{instead}")
      tr.unneeded[key] = "disabled, as DeepSpeed's default"
  if ds.get("sparse_gradients"):
    raise tr.error("sparse_gradients=true: sparse gradients are not available")
  tr.unneeded.update({k: UNNEEDED_TOP[k] for k in ds if k in UNNEEDED_TOP})
  for key, (default, accepted, refused) in BY_VALUE.items():
    value = ds.get(key, default)
    value = value.lower() if isinstance(value, str) else value  # (as DeepSpeed reads it)
    if not isinstance(value, (str, bool, int, float)) or value not in {**accepted, **refused}:
      raise tr.error(f"{key}={ds[key]!r} is not one of DeepSpeed's values: "
                     f"{', '.join(map(repr, {**accepted, **refused}))}")
    if value in refused:
      raise tr.error(f"{key}={ds[key]!r}: {refused[value]}; leave it out (DeepSpeed's default "
                     f"is {default!r})")
    if key in ds:
      tr.unneeded[key] = accepted[value]
  _precision(tr, ds, base)
  _wandb(tr, ds.get("wandb", {}), base)
  ds_zero.translate(tr, ds)
  _nonfinite(tr, ds)
  ds_parallel.translate(tr, ds, base)
  _activation_checkpointing(tr, ds.get("activation_checkpointing", {}), base)
  ds_optimizer.translate(tr, ds, base)
  if "gradient_clipping" not in ds:
    tr.set("train.clip_norm", 1.0, "no gradient_clipping: DeepSpeed's default clips at 1.0")
  elif ds["gradient_clipping"] != "auto":
    tr.set("train.clip_norm", number(tr, ds["gradient_clipping"], "gradient_clipping",
                                     minimum=0), "gradient_clipping")
  _batch_request(tr, ds)
  return tr


def _switched_on(tr: Translation, block, where: str) -> str | None:
  """The first ``enabled: true`` in `block` (a mapping, searched through), by its dotted
  key; None where every one is false or absent."""
  if not isinstance(block, dict):
    raise tr.error(f"{where} must be a mapping of keys to values, not {block!r}")
  if block.get("enabled", False) not in (True, False):
    raise tr.error(f"{where}.enabled={block['enabled']!r} must be true or false")
  if block.get("enabled"):
    return f"{where}.enabled"
  inner = (_switched_on(tr, v, f"{where}.{k}") for k, v in block.items() if isinstance(v, dict))
  return next((found for found in inner if found), None)


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
  """A block's ``enabled``: true, false or "auto"; absent is false, as in DeepSpeed."""
  enabled = block.get("enabled", False)
  if enabled != "auto" and not isinstance(enabled, bool):
    raise tr.error(f"{where}.enabled={enabled!r} must be true, false or \"auto\"")
  return enabled


def _precision(tr: Translation, ds: dict, base: config_lib.Config) -> None:
  """The compute dtype as DeepSpeed reads it: an enabled fp16 or bf16 block, else fp32 (a
  block it does not have is disabled); "enabled": "auto" (the HF Trainer's) is what the
  base trains in, and the block then applies as if it said so. Gradients accumulate and
  are reduced in the training dtype unless data_types.grad_accum_dtype and
  communication_data_type say otherwise, as DeepSpeed's engine does."""
  fp16 = tr.check_keys(ds.get("fp16", {}), "fp16.", FP16_KEYS)
  # DeepSpeed reads "bf16", and "bfloat16" (its older spelling) only without it.
  bf16_key = "bf16" if "bf16" in ds or "bfloat16" not in ds else "bfloat16"
  if bf16_key == "bf16" and "bfloat16" in ds:
    tr.unneeded["bfloat16"] = "DeepSpeed reads the bf16 block when both are given"
  bf16 = tr.check_keys(ds.get(bf16_key, {}), f"{bf16_key}.", BF16_KEYS)
  if "immediate_grad_update" in bf16:
    tr.unneeded[f"{bf16_key}.immediate_grad_update"] = "the update runs once per step"
  for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
    if bf16.get(key) is True:
      raise tr.error(f"{bf16_key}.{key}=true: jaxzero keeps fp32 master weights and optimizer "
                     "state; leave it false")
  fp16_on = _resolved(_enabled(tr, fp16, "fp16"), base, "float16")
  bf16_on = _resolved(_enabled(tr, bf16, bf16_key), base, "bfloat16")
  if fp16_on and bf16_on:
    raise tr.error(f"fp16.enabled and {bf16_key}.enabled are both true; enable one")
  given = [k for k in ("fp16", bf16_key) if k in ds]
  if fp16_on:
    _fp16(tr, fp16, base.precision, _origin(fp16, "fp16", base))
  elif bf16_on:
    tr.set("precision.compute", "bfloat16", _origin(bf16, bf16_key, base))
  else:
    tr.set("precision.compute", "float32",
           " and ".join(f"{k}.enabled={ds[k].get('enabled', False)}" for k in given)
           + ": DeepSpeed trains in fp32" if given else
           "no bf16 or fp16 block: DeepSpeed trains in fp32")
  compute = tr.settings["precision.compute"][0]
  data_types = tr.check_keys(ds.get("data_types", {}), "data_types.", DATA_TYPES_KEYS)
  _module_dtypes(tr, data_types, compute)
  for where, key, value, names in (
      ("data_types.grad_accum_dtype", "zero.grad_dtype", data_types.get("grad_accum_dtype"),
       {**DTYPES, **DTYPE_ALIASES}),
      ("communication_data_type", "zero.reduce_dtype", ds.get("communication_data_type"),
       DTYPES)):
    # DeepSpeed lower-cases communication_data_type, and reads grad_accum_dtype as written.
    name = value.lower() if isinstance(value, str) and names is DTYPES else value
    if value is not None and (not isinstance(value, str) or name not in names):
      others = f" (or {', '.join(DTYPE_ALIASES)})" if names is not DTYPES else ""
      raise tr.error(f"{where}={value!r} is not available; choose one of: fp32, bf16, fp16"
                     + others)
    dtype = names[name] if value is not None else compute
    tr.set(key, dtype, where if value is not None else
           f"no {where}: DeepSpeed's engine uses the training dtype, {compute}")


def _module_dtypes(tr: Translation, data_types: dict, compute: str) -> None:
  """data_types' module casts, checked as DeepSpeed's engine checks them: param_dtype must
  be the training dtype; buffer_dtype and keep_in_fp32_modules have nothing to act on (a
  jaxzero model keeps no buffers: rotary frequencies are computed in float32)."""
  names = {**DTYPES, **DTYPE_ALIASES}
  for key in ("param_dtype", "buffer_dtype"):
    value = data_types.get(key)
    if value is not None and (not isinstance(value, str) or value not in names):
      raise tr.error(f"data_types.{key}={value!r} is not available; choose one of: "
                     f"{', '.join(names)}")
  param = data_types.get("param_dtype")
  if param is not None and names[param] != compute:
    raise tr.error(f"data_types.param_dtype={param!r} conflicts with the training dtype, "
                   f"{compute} (the fp16/bf16 blocks); match it or leave param_dtype out")
  if param is not None:
    tr.unneeded["data_types.param_dtype"] = f"the weights are cast to {compute} already"
  keep = data_types.get("keep_in_fp32_modules", "auto")
  if keep != "auto" and not (isinstance(keep, list) and all(isinstance(n, str) for n in keep)):
    raise tr.error(f"data_types.keep_in_fp32_modules={keep!r} must be \"auto\" or a list of "
                   "name patterns")
  for key in ("buffer_dtype", "keep_in_fp32_modules"):
    if key in data_types:
      tr.unneeded[f"data_types.{key}"] = ("a jaxzero model keeps no buffers (rotary "
                                          "frequencies are computed in float32)")


def _nonfinite(tr: Translation, ds: dict) -> None:
  """DeepSpeed's ZeRO optimizers (stages 1-3) skip a step whose gradient norm is not
  finite, and so does this (train.nonfinite=skip, still stopping after
  train.max_nonfinite in a row); bf16 at stages 1-2 only with check_grad_overflow (its
  default). Stage 0 applies the step: the base's setting stands, jaxzero never applying it."""
  stage = tr.settings["zero.stage"][0]
  bf16 = tr.settings["precision.compute"][0] == "bfloat16"
  key = "bf16" if "bf16" in ds or "bfloat16" not in ds else "bfloat16"
  checked = ds.get(key, {}).get("check_grad_overflow", True) is not False
  if stage >= 1 and (checked or not bf16 or stage == 3):
    tr.set("train.nonfinite", "skip", "zero_optimization.stage: DeepSpeed's ZeRO optimizer "
           "skips a step whose gradient norm is not finite")


def _resolved(enabled, base: config_lib.Config, dtype: str) -> bool:
  """A block's `enabled` (true, false or "auto": whether the base trains in `dtype`)."""
  return base.precision.compute == dtype if enabled == "auto" else enabled is True


def _origin(block: dict, key: str, base: config_lib.Config) -> str:
  """Where precision.compute came from: the block's enabled, or the base's where "auto"."""
  if block.get("enabled") == "auto":
    return f"{key}.enabled=auto: the base's precision.compute={base.precision.compute}"
  return f"{key}.enabled"


def _fp16(tr: Translation, fp16: dict, base: config_lib.PrecisionConfig, origin: str) -> None:
  """DeepSpeed's fp16 block: float16 compute with its loss scaler's settings."""
  tr.set("precision.compute", "float16", origin)
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


def _activation_checkpointing(tr: Translation, block: dict, base: config_lib.Config) -> None:
  known = {"cpu_checkpointing", *UNNEEDED_ACTIVATIONS}
  tr.check_keys(block, "activation_checkpointing.", known)
  tr.unneeded.update({f"activation_checkpointing.{k}": UNNEEDED_ACTIVATIONS[k]
                      for k in block if k in UNNEEDED_ACTIVATIONS})
  # Whether to checkpoint at all is the model code's choice in DeepSpeed and
  # the base config's remat.policy here; the file only moves it to the host.
  if block.get("cpu_checkpointing") is True and base.remat.policy != "none":
    tr.set("remat.policy", "offload_matmuls", "activation_checkpointing.cpu_checkpointing")
  elif block.get("cpu_checkpointing") is True:
    tr.unneeded["activation_checkpointing.cpu_checkpointing"] = (
        "remat.policy=none: the model checkpoints nothing to move to the host")


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
  what cannot be derived is the base's, except that a file giving one size alone
  accumulates nothing (gradient_accumulation_steps 1), as DeepSpeed's rule says.
  `--set train.global_batch` or `--set train.grad_accum` (`from_set`) replaces the
  file's number. Three fixed
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
  absent = {k for k in BATCH_KEYS if tr.batch[k] is None and k not in tr.autos}
  absent -= {"train_batch_size"} if "train.global_batch" in from_set else set()
  if ("gradient_accumulation_steps" in absent and "train.grad_accum" not in from_set
      and len(absent) == 2):  # one size given: DeepSpeed accumulates nothing
    gas = 1
    how["train.grad_accum"] = ("no gradient_accumulation_steps: DeepSpeed's rule with one "
                               "batch size given, 1")
  if micro is None:  # the micro-batch follows at run time from the other two
    whose = ""
    if tbs is None:
      tbs, names["train_batch_size"] = t.global_batch, "train.global_batch"
      whose = " (the config's: the file gives no train_batch_size)"
    gas = t.grad_accum if gas is None else gas
    if tbs % (gas * world):
      raise tr.error(f"{names['train_batch_size']}={tbs}{whose} is not divisible by "
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
