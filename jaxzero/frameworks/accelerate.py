"""Hugging Face Accelerate's FSDP config (the YAML ``accelerate config`` writes),
read as jaxzero settings over a base config.

``python -m jaxzero.train --config BASE.py --accelerate-config fsdp.yaml [--set ...]``
follows the rules of ``jaxzero.frameworks.deepspeed``: what the file governs in Accelerate it
governs here, a key it leaves out taking Accelerate's default (``mixed_precision`` no,
FULL_SHARD, no activation checkpointing, no offload), an unknown key is an error naming it, a known key jaxzero cannot
honour is an error saying so, and the knobs XLA makes unnecessary are reported
once, in one log line.
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
UNNEEDED_TOP = {
    **dict.fromkeys(("compute_environment", "machine_rank", "main_process_ip",
                     "main_process_port", "main_training_function", "num_processes",
                     "rdzv_backend", "same_network", "gpu_ids", "enable_cpu_affinity",
                     "num_machines", "use_cpu", "debug"), _LAUNCH),
    **dict.fromkeys(("downcast_bf16", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "tpu_name",
                     "tpu_zone"), "TPU-only setting"),
    "dynamo_config": "every step is compiled by XLA",
}
FSDP_KEYS = {"fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params",
             "fsdp_activation_checkpointing", *UNNEEDED_FSDP}
TOP_KEYS = {"distributed_type", "fsdp_config", "mixed_precision", "log_with",
            "parallelism_config", *UNNEEDED_TOP}
# Accelerate's ParallelismConfig (it has no pipeline size): key -> mesh key.
PARALLELISM_SIZES = {"parallelism_config_dp_replicate_size": "mesh.replica",
                     "parallelism_config_dp_shard_size": "mesh.fsdp",
                     "parallelism_config_tp_size": "mesh.tensor",
                     "parallelism_config_cp_size": "mesh.context"}
PARALLELISM_KEYS = {*PARALLELISM_SIZES, "parallelism_config_cp_size",
                    "parallelism_config_cp_comm_strategy", "parallelism_config_cp_backend"}


def read(path: str, base: config_lib.Config) -> Translation:
  """Reads and translates the Accelerate config at `path` against `base`."""
  return translate(read_mapping(path, "Accelerate"), base, source=pathlib.Path(path).name)


def translate(acc: dict, base: config_lib.Config, source: str = "fsdp.yaml") -> Translation:
  """The jaxzero settings an Accelerate FSDP config (parsed YAML) means over `base`."""
  tr = Translation(source)
  tr.check_keys(acc, "", TOP_KEYS)
  kind = acc.get("distributed_type", "FSDP")
  if kind == "MULTI_GPU":  # DDP
    tr.set("zero.strategy", "NO_SHARD", "distributed_type")
  elif kind == "DEEPSPEED":
    raise tr.error("distributed_type=DEEPSPEED: pass its ds_config.json with --deepspeed")
  elif kind != "FSDP":
    raise tr.error(f"distributed_type={kind!r} is not available; choose FSDP or MULTI_GPU")
  tr.unneeded.update({k: UNNEEDED_TOP[k] for k in acc if k in UNNEEDED_TOP})
  precision = acc.get("mixed_precision", None)
  if precision is False:  # YAML reads an unquoted `no` as false
    precision = "no"
  if precision not in (None, "no", "bf16", "fp16", "fp8"):
    raise tr.error(f"mixed_precision={precision!r} is not valid; choose one of: no, bf16, fp16, "
                   "fp8")
  # fp16: with dynamic loss scaling at DeepSpeed's defaults, as Accelerate's GradScaler does.
  # fp8: FP8 matmuls around bf16 compute, as Accelerate's (Transformer Engine, torchao) are.
  tr.set("precision.compute", {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}.get(
      precision, "float32"), "mixed_precision" if precision is not None
         else "no mixed_precision: Accelerate's default, no (fp32)")
  if precision == "fp8":
    tr.set("precision.matmul", "fp8", "mixed_precision")
  trackers = acc.get("log_with")
  trackers = [trackers] if isinstance(trackers, str) else list(trackers or [])
  for tracker in trackers:
    if tracker not in ("wandb", "tensorboard"):
      raise tr.error(f"log_with={tracker!r} is not available; choose wandb or tensorboard "
                     "(TensorBoard events are always written)")
  if "wandb" in trackers:
    tr.set("log.wandb", base.log.wandb or "jaxzero", "log_with")
  fsdp = tr.check_keys(acc.get("fsdp_config") or {}, "fsdp_config.", FSDP_KEYS)
  tr.unneeded.update({f"fsdp_config.{k}": UNNEEDED_FSDP[k] for k in fsdp if k in UNNEEDED_FSDP})
  strategy = _strategy(tr, fsdp)
  machines = number(tr, acc.get("num_machines", 1), "num_machines", int, 1)
  if strategy is None and kind == "FSDP":
    tr.set("zero.strategy", "FULL_SHARD",
           "no fsdp_config.fsdp_sharding_strategy: Accelerate's default, FULL_SHARD")
  if strategy:
    tr.set("zero.strategy", strategy, "fsdp_config.fsdp_sharding_strategy")
    if strategy.startswith("HYBRID"):
      # HSDP shards inside a node and replicates across nodes.
      tr.set("mesh.replica", machines, "num_machines")
      tr.set("mesh.fsdp", -1, "num_machines")
  _parallelism(tr, acc.get("parallelism_config") or {})
  checkpointing = _flag(tr, fsdp, "fsdp_activation_checkpointing")
  tr.set("remat.policy", "full" if checkpointing else "none",
         "fsdp_config.fsdp_activation_checkpointing" if "fsdp_activation_checkpointing" in fsdp
         else "no fsdp_config.fsdp_activation_checkpointing: Accelerate's default, off")
  if _flag(tr, fsdp, "fsdp_offload_params"):
    # FSDP's CPUOffload moves parameters and gradients to the host and runs the
    # optimizer there: jaxzero keeps the parameter shards and the optimizer
    # state in pinned host memory, which needs ZeRO-3.
    if strategy not in ("FULL_SHARD", "HYBRID_SHARD", None):
      raise tr.error(f"fsdp_config.fsdp_offload_params with {strategy}: jaxzero offloads "
                     f"parameters only under FULL_SHARD or HYBRID_SHARD")
    tr.set("offload.params", "pinned_host", "fsdp_config.fsdp_offload_params")
    tr.set("offload.optimizer", "pinned_host", "fsdp_config.fsdp_offload_params")
  else:
    where = ("fsdp_config.fsdp_offload_params" if "fsdp_offload_params" in fsdp
             else "no fsdp_config.fsdp_offload_params: Accelerate's default, off")
    tr.set("offload.params", "device", where)
    tr.set("offload.optimizer", "device", where)
  return tr


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


def _parallelism(tr: Translation, block: dict) -> None:
  """ParallelismConfig's sizes as the mesh (over the hybrid strategy's): cp_size is
  mesh.context; cp_comm_strategy allgather is context.strategy=all_gather, and alltoall
  (torch's ring rotation of key/value shards) context.strategy=ring."""
  block = tr.check_keys(block, "parallelism_config.", PARALLELISM_KEYS)
  for key, target in PARALLELISM_SIZES.items():
    if key in block:
      tr.set(target, number(tr, block[key], f"parallelism_config.{key}", int, 1),
             f"parallelism_config.{key}")
  strategy = block.get("parallelism_config_cp_comm_strategy", "allgather")
  if strategy not in ("allgather", "alltoall"):
    raise tr.error(f"parallelism_config.parallelism_config_cp_comm_strategy={strategy!r}; "
                   "Accelerate's choices are allgather and alltoall")
  if "parallelism_config_cp_comm_strategy" in block:
    tr.set("context.strategy", {"allgather": "all_gather", "alltoall": "ring"}[strategy],
           "parallelism_config.parallelism_config_cp_comm_strategy")
  if "parallelism_config_cp_backend" in block:
    tr.unneeded["parallelism_config.parallelism_config_cp_backend"] = (
        "XLA's collectives, placed by the mesh")


def _strategy(tr: Translation, fsdp: dict) -> str | None:
  """zero.strategy from fsdp_sharding_strategy (a name or 1-5) or FSDP2's
  fsdp_reshard_after_forward (true = FULL_SHARD, false = SHARD_GRAD_OP, or a name).
  Under fsdp_version 2 Accelerate reads the latter as a boolean only (1/0 too); under
  version 1 a digit there is a strategy's number."""
  names = []
  for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
    if key not in fsdp:
      continue
    value = fsdp[key]
    as_bool = key == "fsdp_reshard_after_forward" and str(fsdp.get("fsdp_version")) == "2"
    if (as_bool or (isinstance(value, str) and not value.isdigit())) and (
        _truth(value) is not None):
      value = _truth(value)  # as _flag reads it
    if isinstance(value, bool):
      value = "FULL_SHARD" if value else "SHARD_GRAD_OP"
    elif isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
      value = STRATEGY_NUMBERS.get(int(value), value)
    elif isinstance(value, str):
      value = value.lstrip("_")  # torch spells it _HYBRID_SHARD_ZERO2
    if value not in STRATEGY_NUMBERS.values():
      raise tr.error(f"fsdp_config.{key}={fsdp[key]!r} is not valid; choose one of: "
                     + ", ".join(f"{n} ({name})" for n, name in STRATEGY_NUMBERS.items()))
    names.append(value)
  if len(set(names)) > 1:
    raise tr.error(f"fsdp_config.fsdp_sharding_strategy ({names[0]}) and "
                   f"fsdp_reshard_after_forward ({names[1]}) disagree")
  return names[0] if names else None
