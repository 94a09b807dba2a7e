"""Hugging Face Accelerate's FSDP config (the YAML ``accelerate config`` writes),
read as jaxzero settings over a base config.

``python -m jaxzero.train --config BASE.py --accelerate-config fsdp.yaml [--set ...]``
follows the rules of ``jaxzero.frameworks.deepspeed``: what the file governs in Accelerate
it governs here, a key it leaves out taking Accelerate's default (``mixed_precision`` no,
FULL_SHARD, no activation checkpointing, no offload, no ``parallelism_config``: no tensor
or context parallelism), an unknown key is an error naming it, a known key jaxzero cannot
honour is an error saying so, and the knobs XLA makes unnecessary are reported once, in
one log line.
"""

from __future__ import annotations

import pathlib

from jaxzero import config as config_lib
from jaxzero.frameworks.translated_file import (GATHERED_PER_LAYER, SHARDED_SAVES, Translation,
                                                number, read_mapping)

# torch's ShardingStrategy numbers, as `accelerate config` offers them.
STRATEGY_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD",
                    5: "HYBRID_SHARD_ZERO2"}

_WRAP = "every weight is sharded by its logical axes and gathered one layer at a time"
_INIT = "weights are created (or read) straight into their shards"
_LAUNCH = "processes come from jaxzero.launch or distributed.* (one per host or GPU)"
UNNEEDED_FSDP = {
    **dict.fromkeys(("fsdp_backward_prefetch", "fsdp_backward_prefetch_policy",
                     "fsdp_forward_prefetch", "fsdp_limit_all_gathers"), GATHERED_PER_LAYER),
    **dict.fromkeys(("fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
                     "fsdp_min_num_params", "fsdp_use_orig_params"), _WRAP),
    **dict.fromkeys(("fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading"), _INIT),
    "fsdp_state_dict_type": SHARDED_SAVES, "fsdp_version": "one implementation",
}
# Every key of Accelerate 1.x's ClusterConfig (accelerate/commands/config/config_args.py) is
# here or in TOP_KEYS, with the older spellings it converts: dynamo_backend, fp16.
UNNEEDED_TOP = {
    **dict.fromkeys(("compute_environment", "machine_rank", "main_process_ip",
                     "main_process_port", "main_training_function", "num_processes",
                     "rdzv_backend", "same_network", "gpu_ids", "enable_cpu_affinity",
                     "num_machines", "use_cpu", "debug", "mpirun_config"), _LAUNCH),
    **dict.fromkeys(("downcast_bf16", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "tpu_name",
                     "tpu_zone", "tpu_vm", "commands", "command_file"), "TPU-only setting"),
    **dict.fromkeys(("dynamo_config", "dynamo_backend"), "every step is compiled by XLA"),
    # Accelerate's launcher reads these blocks only under their own distributed_type.
    "deepspeed_config": "Accelerate reads it only under distributed_type DEEPSPEED",
    "megatron_lm_config": "Accelerate reads it only under distributed_type MEGATRON_LM",
}
FSDP_KEYS = {"fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params",
             "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload",
             "fsdp_ignored_modules", *UNNEEDED_FSDP}
TOP_KEYS = {"distributed_type", "fsdp_config", "mixed_precision", "fp8_config",
            "parallelism_config", "fp16", *UNNEEDED_TOP}
# Accelerate's ParallelismConfig (it has no pipeline size): key -> mesh key. A size it leaves
# out is 1 (dp_shard: what is left).
PARALLELISM_SIZES = {"parallelism_config_dp_replicate_size": "mesh.replica",
                     "parallelism_config_dp_shard_size": "mesh.fsdp",
                     "parallelism_config_tp_size": "mesh.tensor",
                     "parallelism_config_cp_size": "mesh.context"}
_SP_SETTINGS = ("parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
                "parallelism_config_sp_seq_length_is_variable",
                "parallelism_config_sp_attn_implementation")
PARALLELISM_KEYS = {*PARALLELISM_SIZES, "parallelism_config_cp_comm_strategy",
                    "parallelism_config_cp_backend", "parallelism_config_sp_size", *_SP_SETTINGS}
# torch's GradScaler, which Accelerate's fp16 uses: 2**16 at first, doubled after 2000 steps
# without overflow, halved at each overflow, with no floor (here the smallest normal fp32).
GRAD_SCALER = {"precision.loss_scale": 0.0, "precision.initial_scale_power": 16,
               "precision.loss_scale_window": 2000, "precision.hysteresis": 1,
               "precision.consecutive_hysteresis": False, "precision.min_loss_scale": 2.0 ** -126}


def read(path: str, base: config_lib.Config) -> Translation:
  """Reads and translates the Accelerate config at `path` against `base`."""
  return translate(read_mapping(path, "Accelerate"), base, source=pathlib.Path(path).name)


def translate(acc: dict, base: config_lib.Config, source: str = "fsdp.yaml") -> Translation:
  """The jaxzero settings an Accelerate FSDP config (parsed YAML) means over `base`."""
  tr = Translation(source)
  kind = acc.get("distributed_type", "FSDP")
  if kind == "DEEPSPEED":
    raise tr.error("distributed_type=DEEPSPEED: pass its deepspeed_config_file (the "
                   "ds_config.json) with --deepspeed")
  if kind not in ("FSDP", "MULTI_GPU"):
    raise tr.error(f"distributed_type={kind!r} is not available; choose FSDP or MULTI_GPU")
  tr.check_keys(acc, "", TOP_KEYS)
  tr.unneeded.update({k: UNNEEDED_TOP[k] for k in acc if k in UNNEEDED_TOP})
  _precision(tr, acc, fsdp=kind == "FSDP")
  if kind == "MULTI_GPU":  # DDP: Accelerate reads no fsdp_config
    tr.set("zero.strategy", "NO_SHARD", "distributed_type=MULTI_GPU")
    if acc.get("fsdp_config"):
      tr.unneeded["fsdp_config"] = "distributed_type=MULTI_GPU: Accelerate reads it only for FSDP"
    fsdp = {}
  else:
    fsdp = tr.check_keys(acc.get("fsdp_config") or {}, "fsdp_config.", FSDP_KEYS)
    tr.unneeded.update({f"fsdp_config.{k}": UNNEEDED_FSDP[k] for k in fsdp
                        if k in UNNEEDED_FSDP})
    if fsdp.get("fsdp_ignored_modules"):
      raise tr.error("fsdp_config.fsdp_ignored_modules: every weight is sharded here; "
                     "leave it out")
  strategy = _sharding(tr, acc, fsdp) if kind == "FSDP" else "NO_SHARD"
  _parallelism(tr, acc.get("parallelism_config") or {}, strategy)
  _checkpointing(tr, fsdp)
  _offload(tr, fsdp, strategy)
  return tr


def _precision(tr: Translation, acc: dict, fsdp: bool) -> None:
  """mixed_precision as Accelerate runs it: under FSDP weights and the gradient reduction
  in the dtype (MixedPrecision(param_dtype, reduce_dtype)), gradients kept and accumulated
  in fp32 (the sharded parameters' dtype); under DDP (MULTI_GPU, autocast) fp32 weights,
  gradients and reduction; fp16 with torch's GradScaler; fp8 as FP8 matmuls around bf16
  compute (Transformer Engine's and torchao's recipes)."""
  precision = acc.get("mixed_precision", None)
  if precision is False:  # YAML reads an unquoted `no` as false
    precision = "no"
  # `fp16: true` is the older spelling of mixed_precision fp16; Accelerate reads it only
  # where the file has no mixed_precision key.
  legacy = "fp16" in acc and "mixed_precision" not in acc
  if legacy and acc["fp16"]:
    precision = "fp16"
  elif "fp16" in acc and not legacy:
    tr.unneeded["fp16"] = "Accelerate reads mixed_precision when both are given"
  if isinstance(precision, str):
    precision = precision.lower()  # as Accelerate reads it
  if precision not in (None, "no", "bf16", "fp16", "fp8"):
    raise tr.error(f"mixed_precision={acc['mixed_precision']!r} is not valid; choose one of: "
                   "no, bf16, fp16, fp8")
  compute = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}.get(precision, "float32")
  where = ("mixed_precision" if acc.get("mixed_precision") is not None else "fp16" if legacy
           else "no mixed_precision: Accelerate's default, no (fp32)")
  tr.set("precision.compute", compute, where)
  tr.set("precision.matmul", "fp8" if precision == "fp8" else "default", where)
  tr.set("zero.grad_dtype", "float32", f"{where}: FSDP keeps gradients in the fp32 shards' dtype")
  if fsdp:
    tr.set("zero.reduce_dtype", compute, f"{where}: FSDP's MixedPrecision reduces in it")
  else:
    tr.set("zero.reduce_dtype", "float32", "distributed_type=MULTI_GPU: DDP reduces the fp32 "
           "gradients of its fp32 weights")
  if precision == "fp16":
    for key, value in GRAD_SCALER.items():
      tr.set(key, value, "mixed_precision=fp16: torch's GradScaler, as Accelerate uses it")
  if "fp8_config" in acc:
    tr.unneeded["fp8_config"] = ("FP8 matmuls scale each tensor by its current amax "
                                 "(precision.matmul=fp8)")


# Accelerate hands fsdp_config's values to the training process as text, str(value).lower(),
# and reads a boolean back with its str_to_bool, which takes these.
_TRUE_TEXT = ("y", "yes", "t", "true", "on", "1")
_FALSE_TEXT = ("n", "no", "f", "false", "off", "0")


def _truth(value) -> bool | None:
  """`value` as Accelerate's str_to_bool reads it; None where that raises."""
  text = str(value).lower()
  return True if text in _TRUE_TEXT else False if text in _FALSE_TEXT else None


def _flag(tr: Translation, fsdp: dict, key: str) -> bool:
  """fsdp_config's boolean `key`, read as Accelerate reads it (true/false, yes/no, on/off,
  1/0, in any case); absent is false."""
  value = _truth(fsdp.get(key, False))
  if value is None:
    raise tr.error(f"fsdp_config.{key}={fsdp[key]!r} is not valid; choose true or false "
                   "(or yes/no, on/off, 1/0, as Accelerate reads them)")
  return value


def _parallelism(tr: Translation, block: dict, strategy: str) -> None:
  """ParallelismConfig's sizes as the mesh, each 1 where it leaves one out (dp_shard: what
  is left), over the strategy's: dp_replicate > 1 with dp_shard > 1 (or left out) is HSDP;
  cp_size is mesh.context (allgather: context.strategy=all_gather; alltoall, torch's ring
  rotation of key/value shards: ring); sp_size (Ulysses' all-to-all over heads) is
  mesh.context with all_gather, the nearest here: each device sees every position's keys
  and values."""
  block = tr.check_keys(block, "parallelism_config.", PARALLELISM_KEYS)
  hybrid = strategy.startswith("HYBRID")
  for key, target in PARALLELISM_SIZES.items():
    if key in block:
      tr.set(target, number(tr, block[key], f"parallelism_config.{key}", int, 1),
             f"parallelism_config.{key}")
    elif not (hybrid and target in ("mesh.replica", "mesh.fsdp")):
      default = -1 if target == "mesh.fsdp" else 1
      tr.set(target, default, f"no parallelism_config.{key}: Accelerate's default, "
             + ("what is left" if default == -1 else "1"))
  sp = number(tr, block.get("parallelism_config_sp_size", 1),
              "parallelism_config.parallelism_config_sp_size", int, 1)
  if sp > 1:
    if tr.settings["mesh.context"][0] > 1:
      raise tr.error("parallelism_config: cp_size and sp_size both split the sequence; "
                     "give one")
    tr.set("mesh.context", sp, "parallelism_config.parallelism_config_sp_size")
    tr.set("context.strategy", "all_gather", "parallelism_config.parallelism_config_sp_size: "
           "Ulysses' all-to-all over heads, whose nearest here is gathering keys and values")
  tr.unneeded.update({f"parallelism_config.{k}": "the mesh and XLA's collectives place it"
                      for k in (*_SP_SETTINGS, "parallelism_config_cp_backend") if k in block})
  strategy_key = "parallelism_config_cp_comm_strategy"
  comm = block.get(strategy_key, "allgather")
  if comm not in ("allgather", "alltoall"):
    raise tr.error(f"parallelism_config.{strategy_key}={comm!r}; "
                   "Accelerate's choices are allgather and alltoall")
  if strategy_key in block:
    tr.set("context.strategy", {"allgather": "all_gather", "alltoall": "ring"}[comm],
           f"parallelism_config.{strategy_key}")
  replicas, shards = (tr.settings.get(k, (1,))[0] for k in ("mesh.replica", "mesh.fsdp"))
  promoted = {"FULL_SHARD": "HYBRID_SHARD", "SHARD_GRAD_OP": "HYBRID_SHARD_ZERO2"}
  # HSDP, torch's 2-D mesh: shards inside each replica, whether dp_shard_size gives their
  # size or leaves it to the devices (-1); FULL_SHARD would shard over the replicas too.
  if strategy in promoted and replicas > 1 and (shards > 1 or shards == -1):
    tr.set("zero.strategy", promoted[strategy],
           "parallelism_config: dp_replicate_size above 1, dp_shard_size above 1 or what is "
           "left (HSDP)")


def _sharding(tr: Translation, acc: dict, fsdp: dict) -> str:
  """zero.strategy, and HYBRID's mesh (sharded inside a node, replicated across the
  num_machines nodes)."""
  strategy, key = _strategy(tr, fsdp)
  if strategy is None:
    strategy, where = "FULL_SHARD", "no fsdp_config sharding key: Accelerate's default, FULL_SHARD"
  else:
    where = f"fsdp_config.{key}"
  tr.set("zero.strategy", strategy, where)
  if strategy.startswith("HYBRID"):
    machines = number(tr, acc.get("num_machines", 1), "num_machines", int, 1)
    tr.set("mesh.replica", machines, "num_machines")
    tr.set("mesh.fsdp", -1, "num_machines")
  return strategy


def _checkpointing(tr: Translation, fsdp: dict) -> None:
  """fsdp_activation_checkpointing is remat.policy=full; with its _offload, the saved
  activations go to host memory (offload_matmuls)."""
  on = _flag(tr, fsdp, "fsdp_activation_checkpointing")
  offloaded = _flag(tr, fsdp, "fsdp_activation_checkpointing_offload")
  if offloaded and not on:
    raise tr.error("fsdp_config.fsdp_activation_checkpointing_offload needs "
                   "fsdp_activation_checkpointing, as Accelerate says")
  tr.set("remat.policy", "offload_matmuls" if offloaded else "full" if on else "none",
         "fsdp_config.fsdp_activation_checkpointing" if "fsdp_activation_checkpointing" in fsdp
         else "no fsdp_config.fsdp_activation_checkpointing: Accelerate's default, off")


def _offload(tr: Translation, fsdp: dict, strategy: str) -> None:
  """fsdp_offload_params: FSDP's CPUOffload moves parameters and gradients to the host and
  runs the optimizer there; jaxzero keeps the parameter shards and the optimizer state in
  pinned host memory, which needs ZeRO-3."""
  if _flag(tr, fsdp, "fsdp_offload_params"):
    if strategy not in ("FULL_SHARD", "HYBRID_SHARD"):
      raise tr.error(f"fsdp_config.fsdp_offload_params with {strategy}: jaxzero offloads "
                     f"parameters only under FULL_SHARD or HYBRID_SHARD")
    tr.set("offload.params", "pinned_host", "fsdp_config.fsdp_offload_params")
    tr.set("offload.optimizer", "pinned_host", "fsdp_config.fsdp_offload_params")
    return
  where = ("fsdp_config.fsdp_offload_params" if "fsdp_offload_params" in fsdp
           else "no fsdp_config.fsdp_offload_params: Accelerate's default, off")
  tr.set("offload.params", "device", where)
  tr.set("offload.optimizer", "device", where)


def _strategy(tr: Translation, fsdp: dict) -> tuple[str | None, str]:
  """(zero.strategy, the key it comes from) from fsdp_sharding_strategy (a name or 1-5) or
  fsdp_reshard_after_forward (true = FULL_SHARD, false = SHARD_GRAD_OP, or a name). Under
  fsdp_version 2 Accelerate reads only the latter, as a boolean (1/0 too); under version 1
  a digit there is a strategy's number."""
  version2 = str(fsdp.get("fsdp_version")) == "2"
  if version2 and "fsdp_sharding_strategy" in fsdp:
    tr.unneeded["fsdp_config.fsdp_sharding_strategy"] = (
        "fsdp_version 2 reads fsdp_reshard_after_forward, as Accelerate does")
  names = []
  for key in ("fsdp_reshard_after_forward",) if version2 else (
      "fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
    if key not in fsdp:
      continue
    value = fsdp[key]
    as_bool = key == "fsdp_reshard_after_forward" and version2
    if (as_bool or (isinstance(value, str) and not value.isdigit())) and (
        _truth(value) is not None):
      value = _truth(value)  # as _flag reads it
    elif as_bool:
      raise tr.error(f"fsdp_config.{key}={value!r} under fsdp_version 2 is not valid; choose "
                     "true (FULL_SHARD) or false (SHARD_GRAD_OP)")
    if isinstance(value, bool):
      value = "FULL_SHARD" if value else "SHARD_GRAD_OP"
    elif isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
      value = STRATEGY_NUMBERS.get(int(value), value)
    elif isinstance(value, str):  # Accelerate upper-cases it; torch spells _HYBRID_SHARD_ZERO2
      value = value.lstrip("_").upper()
    if value not in STRATEGY_NUMBERS.values():
      raise tr.error(f"fsdp_config.{key}={fsdp[key]!r} is not valid; choose one of: "
                     + ", ".join(f"{n} ({name})" for n, name in STRATEGY_NUMBERS.items()))
    names.append((value, key))
  if len({name for name, _ in names}) > 1:
    raise tr.error(f"fsdp_config.fsdp_sharding_strategy ({names[0][0]}) and "
                   f"fsdp_reshard_after_forward ({names[1][0]}) disagree")
  return names[0] if names else (None, "")
