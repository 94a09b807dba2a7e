"""Typed, frozen configuration: the dataclasses, loading, dotted overrides, checks.

A config file defines ``get_config()`` returning a :class:`Config`; presets are a few lines
derived from :func:`base` with ``dataclasses.replace``. Each module a run goes through takes
only the sections it needs. Reading a config starts no JAX backend, so the CLI can decide how
many virtual CPU devices to create before JAX starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import pathlib
import typing
from typing import Any, Literal, get_args, get_origin

from jaxzero.errors import ConfigError
from jaxzero.models.llama import LlamaConfig

log = logging.getLogger(__name__)

# Stage and hybrid flag for each FSDP/DeepSpeed spelling.
STRATEGIES: dict[str, tuple[int, bool]] = {
    "NO_SHARD": (0, False),
    "ZERO1": (1, False),
    "SHARD_GRAD_OP": (2, False),
    "FULL_SHARD": (3, False),
    "HYBRID_SHARD_ZERO2": (2, True),
    "HYBRID_SHARD": (3, True),
}

Dtype = Literal["float32", "bfloat16", "float16"]
MemoryKind = Literal["device", "pinned_host"]


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  # 0 = DDP, 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters.
  stage: Literal[0, 1, 2, 3] = 3
  # FSDP spelling; when set it decides stage and hybrid (empty = use `stage`).
  strategy: Literal["", "NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD",
                    "HYBRID_SHARD_ZERO2", "HYBRID_SHARD"] = ""
  # Hybrid: shard over `fsdp` only and replicate over `replica`.
  hybrid: bool = False
  # Dtype of gradients and of the gradient-accumulation buffers.
  grad_dtype: Dtype = "float32"
  # Dtype gradients are reduced in across devices (FSDP's reduce_dtype);
  # empty = grad_dtype.
  reduce_dtype: Literal["", "float32", "bfloat16", "float16"] = ""

  @property
  def resolved(self) -> tuple[int, bool]:
    """(stage, hybrid) after applying `strategy`."""
    return STRATEGIES[self.strategy] if self.strategy else (self.stage, self.hybrid)


def strategy_name(stage: int, hybrid: bool) -> str:
  """The FSDP/DeepSpeed name of (stage, hybrid), e.g. (3, False) -> FULL_SHARD."""
  names = {value: name for name, value in STRATEGIES.items()}
  return names.get((stage, hybrid), f"HYBRID_ZERO{stage}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  replica: int = 1
  fsdp: int = -1  # -1 = all remaining devices
  # Tensor (Megatron) and sequence parallelism, innermost: inside a host.
  # Divides the devices, the heads, the MLP width and the vocabulary.
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 100
  global_batch: int = 16  # sequences per optimizer step
  grad_accum: int = 1
  seq_len: int = 128
  lr: float = 3e-4
  warmup_steps: int = 10
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float = 1.0  # 0 disables clipping
  # A step whose loss or gradient norm is not finite never updates the state.
  # "stop": the run then stops with an error naming the step; "skip": it goes
  # on, and stops only after `max_nonfinite` such steps in a row.
  nonfinite: Literal["stop", "skip"] = "stop"
  max_nonfinite: int = 5
  log_every: int = 1
  # "adamw": decoupled weight decay. "adam": weight_decay is an L2 term added to
  # the gradient before Adam's moments (torch.optim.Adam; DeepSpeed adam_w_mode=false).
  optimizer: Literal["adamw", "adam"] = "adamw"
  # "warmup_cosine": linear warmup from 0 to lr, cosine to lr x min_lr_ratio at
  # `steps`. DeepSpeed's schedules, with its formulas: "warmup_constant"
  # (WarmupLR), "warmup_linear_decay" (WarmupDecayLR: linearly back to the
  # warmup's start at `steps`), "warmup_cosine_ds" (WarmupCosineLR: cosine to
  # lr x min_lr_ratio at `steps`).
  schedule: Literal["warmup_cosine", "warmup_constant", "warmup_linear_decay",
                    "warmup_cosine_ds"] = "warmup_cosine"
  # DeepSpeed's schedules only: the warmup's shape, and where it starts as a
  # fraction of lr (DeepSpeed's warmup_min_lr / warmup_max_lr, or warmup_min_ratio).
  warmup_type: Literal["log", "linear"] = "log"
  warmup_min_ratio: float = 0.0


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  compute: Dtype = "bfloat16"  # dtype of the compute copy of the weights
  # float16 only, with DeepSpeed's fp16 keys and meanings: the loss is scaled
  # before the backward pass. 0 = dynamic: from 2**initial_scale_power, halved
  # after `hysteresis` overflowing steps (each skipped), doubled after
  # `loss_scale_window` steps without one, never below min_loss_scale; > 0 = static.
  loss_scale: float = 0.0
  initial_scale_power: int = 16
  loss_scale_window: int = 1000
  hysteresis: int = 2
  consecutive_hysteresis: bool = False  # refill the hysteresis after every good step
  min_loss_scale: float = 1.0

  @property
  def scales_loss(self) -> bool:
    return self.compute == "float16"


@dataclasses.dataclass(frozen=True)
class RematConfig:
  policy: Literal["none", "full", "save_matmuls", "save_attention", "offload_matmuls"] = "none"


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
  # Where the fp32 master weights and Adam moments live: device memory, pinned
  # host memory (ZeRO-Offload), or files in `nvme_dir` (ZeRO-Infinity's NVMe tier).
  optimizer: Literal["device", "pinned_host", "nvme"] = "device"
  params: MemoryKind = "device"  # the compute copy at rest (stage 3)
  # offload.optimizer=nvme: a directory on local disk (each process keeps its
  # shards in a subdirectory it makes, and deletes when the run ends).
  nvme_dir: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 0  # 0 = only at the end and on preemption
  keep: int = 3
  # A latest checkpoint that fails verification: "fallback" resumes from the
  # newest one that verifies (moving the damaged one to checkpoints.damaged/),
  # "refuse" stops with the error and changes nothing.
  on_damaged: Literal["fallback", "refuse"] = "fallback"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # "stdlib": the Python standard library's own source, byte-level tokens; or a
  # file, directory or glob of .txt/.jsonl/.parquet files (see jaxzero.data.tokens).
  source: str = "stdlib"
  max_bytes: int = 16_000_000  # "stdlib" only
  tokenizer: str = "byte"  # "byte" or the path of a Hugging Face tokenizer.json
  text_field: str = "text"  # the JSON-lines field / Parquet column holding the text
  # Where tokenized files are cached; empty = WORKDIR/data_cache. Share one
  # directory between runs to tokenize a corpus once.
  cache_dir: str = ""
  eos_token: str = ""  # document separator; empty = the tokenizer's usual end-of-text
  # Held-out text for evaluation (eval.*): the last `eval_fraction` of the token
  # stream (training uses the rest), or a separate source tokenized the same way.
  eval_fraction: float = 0.0
  eval_source: str = ""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  every: int = 0  # steps between evaluations of the held-out split; 0 = never
  batches: int = 4  # global micro-batches (train.global_batch / grad_accum rows) per evaluation


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  # Unset (empty, 0, -1) = from JAXZERO_COORDINATOR / JAXZERO_NUM_PROCESSES /
  # JAXZERO_PROCESS_ID, else from SLURM, Open MPI or Kubernetes, else one process.
  coordinator_address: str = ""  # host:port where process 0 serves the coordinator
  num_processes: int = 0
  process_id: int = -1
  timeout_s: int = 300  # how long every process waits for all the others to join


@dataclasses.dataclass(frozen=True)
class InitConfig:
  # A Hugging Face Llama directory (config.json + safetensors) whose weights
  # start training; the model.* fields must match its config.json. A run with
  # a checkpoint of its own resumes from that instead.
  hf_checkpoint: str = ""


@dataclasses.dataclass(frozen=True)
class Config:
  model: LlamaConfig = LlamaConfig()
  init: InitConfig = InitConfig()
  zero: ZeroConfig = ZeroConfig()
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  precision: PrecisionConfig = PrecisionConfig()
  remat: RematConfig = RematConfig()
  offload: OffloadConfig = OffloadConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  data: DataConfig = DataConfig()
  eval: EvalConfig = EvalConfig()
  distributed: DistributedConfig = DistributedConfig()
  seed: int = 0


def base() -> Config:
  return Config()


# ----------------------------------------------------------------------------
# Dotted overrides: --set train.steps=10


def _field_types(cls) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse_value(key: str, text: str, typ: Any) -> Any:
  if get_origin(typ) is Literal:
    choices = get_args(typ)
    for choice in choices:
      if str(choice) == text:
        return choice
    raise ConfigError(f"{key}={text!r} is not valid; choose one of: "
                      + ", ".join(repr(c) if c == "" else str(c) for c in choices))
  if typ is bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
    raise ConfigError(f"{key}={text!r} is not a boolean; use true or false")
  if typ in (int, float):
    try:
      return typ(text)
    except ValueError:
      raise ConfigError(f"{key}={text!r} is not a valid {typ.__name__}") from None
  return text


def override(cfg: Any, key: str, text: str, _prefix: str = "") -> Any:
  """Returns `cfg` with the field at dotted `key` set from the string `text`."""
  head, _, rest = key.partition(".")
  types = _field_types(type(cfg))
  full = _prefix + head
  if head not in types:
    raise ConfigError(f"unknown config key {full!r}; valid keys here: "
                      + ", ".join(_prefix + k for k in types))
  current = getattr(cfg, head)
  if dataclasses.is_dataclass(current):
    if not rest:
      raise ConfigError(f"{full!r} is a section; set one of its keys: "
                        + ", ".join(f"{full}.{k}" for k in _field_types(type(current))))
    value = override(current, rest, text, full + ".")
  else:
    if rest:
      raise ConfigError(f"unknown config key {key!r}: {full!r} has no sub-keys")
    value = _parse_value(full, text, types[head])
  return dataclasses.replace(cfg, **{head: value})


# Keys that moved, old dotted name -> new one. The old name keeps working.
MOVED_KEYS = {"model.hf_checkpoint": "init.hf_checkpoint"}


def as_dotted(cfg: Any, _prefix: str = "") -> dict[str, Any]:
  """Every field by its dotted name, e.g. {"train.steps": 80, ...}: the inverse of
  `--set` (each pair, given back as `--set KEY=VALUE`, reproduces the config)."""
  fields = {}
  for name in _field_types(type(cfg)):
    value = getattr(cfg, name)
    if dataclasses.is_dataclass(value):
      fields.update(as_dotted(value, f"{_prefix}{name}."))
    else:
      fields[_prefix + name] = value
  return fields


def apply_overrides(cfg: Config, assignments: list[str]) -> Config:
  for assignment in assignments:
    key, eq, text = assignment.partition("=")
    if not eq:
      raise ConfigError(f"--set {assignment!r} must look like KEY=VALUE, e.g. train.steps=10")
    key = key.strip()
    if key in MOVED_KEYS:
      log.warning("config key %s is deprecated; it is now %s", key, MOVED_KEYS[key])
      key = MOVED_KEYS[key]
    cfg = override(cfg, key, text.strip())
  return cfg


def check_literals(cfg: Any, _prefix: str = "") -> None:
  """Rejects a Literal-typed field holding a value outside its choices."""
  for name, typ in _field_types(type(cfg)).items():
    value = getattr(cfg, name)
    if dataclasses.is_dataclass(value):
      check_literals(value, _prefix + name + ".")
    elif get_origin(typ) is Literal and value not in get_args(typ):
      raise ConfigError(f"{_prefix}{name}={value!r} is not valid; choose one of: "
                        + ", ".join(map(str, get_args(typ))))


# ----------------------------------------------------------------------------
# Loading


def load(path: str, assignments: list[str] = ()) -> Config:
  """Loads `get_config()` from a config file and applies `--set` overrides."""
  file = pathlib.Path(path)
  if not file.is_file():
    raise ConfigError(f"config file {path!r} does not exist; presets are in configs/: "
                      + ", ".join(sorted(p.name for p in _configs_dir().glob("*.py")
                                         if p.name != "__init__.py")))
  spec = importlib.util.spec_from_file_location(f"jaxzero_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path!r} defines no get_config()")
  cfg = module.get_config()
  if not isinstance(cfg, Config):
    raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not jaxzero Config")
  cfg = apply_overrides(cfg, list(assignments))
  validate(cfg)
  return cfg


def _configs_dir() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parent.parent / "configs"


def validate(cfg: Config) -> None:
  """Checks everything that does not need to know the devices."""
  check_literals(cfg)
  m = cfg.model
  for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_dim"):
    if getattr(m, key) < 1:
      raise ConfigError(f"model.{key}={getattr(m, key)} must be at least 1")
  for key, value in (("seed", cfg.seed), ("train.warmup_steps", cfg.train.warmup_steps),
                     ("train.lr", cfg.train.lr), ("train.weight_decay", cfg.train.weight_decay),
                     ("train.clip_norm", cfg.train.clip_norm),
                     ("train.warmup_min_ratio", cfg.train.warmup_min_ratio),
                     ("train.min_lr_ratio", cfg.train.min_lr_ratio)):
    if value < 0:
      raise ConfigError(f"{key}={value} must not be negative")
  try:
    cfg.model.validate()
  except ValueError as e:
    raise ConfigError(str(e)) from None
  t = cfg.train
  for key, value in (("train.steps", t.steps), ("train.global_batch", t.global_batch),
                     ("train.grad_accum", t.grad_accum), ("train.seq_len", t.seq_len),
                     ("train.log_every", t.log_every),
                     ("train.max_nonfinite", t.max_nonfinite)):
    if value < 1:
      raise ConfigError(f"{key}={value} must be at least 1")
  for key, value in (("mesh.replica", cfg.mesh.replica), ("mesh.fsdp", cfg.mesh.fsdp)):
    if value == 0 or value < -1:
      raise ConfigError(f"{key}={value} must be a positive device count or -1 (all remaining)")
  if cfg.mesh.replica == -1 and cfg.mesh.fsdp == -1:
    raise ConfigError("mesh.replica and mesh.fsdp cannot both be -1")
  _check_tensor(cfg.mesh.tensor, cfg.model)
  if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
    raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
  _validate_eval(cfg)
  _validate_loss_scale(cfg.precision)
  if cfg.offload.params == "pinned_host" and cfg.zero.resolved[0] != 3:
    raise ConfigError("offload.params=pinned_host needs ZeRO stage 3 (zero.stage=3 or "
                      "zero.strategy=FULL_SHARD/HYBRID_SHARD)")


def _check_tensor(tensor: int, model) -> None:
  """mesh.tensor must divide the heads, the MLP width and the vocabulary (the
  KV heads are replicated across the tensor group when it does not divide them)."""
  if tensor < 1:
    raise ConfigError(f"mesh.tensor={tensor} must be a positive device count (1 = off)")
  common = math.gcd(model.n_heads, model.mlp_dim, model.vocab_size)
  if common % tensor:
    valid = [d for d in range(1, common + 1) if common % d == 0]
    raise ConfigError(
        f"mesh.tensor={tensor} must divide model.n_heads={model.n_heads}, "
        f"model.mlp_dim={model.mlp_dim} and model.vocab_size={model.vocab_size}; valid values: "
        f"{', '.join(map(str, valid))}")


def _validate_loss_scale(p: PrecisionConfig) -> None:
  """DeepSpeed's fp16 rules, checked whatever the compute dtype (a preset may
  switch to float16 later)."""
  if p.loss_scale < 0:
    raise ConfigError(f"precision.loss_scale={p.loss_scale} must be 0 (dynamic loss scaling) "
                      "or a positive static scale")
  if p.loss_scale_window < 1 or p.hysteresis < 1:
    raise ConfigError(f"precision.loss_scale_window={p.loss_scale_window} and "
                      f"precision.hysteresis={p.hysteresis} must be at least 1")
  if not 0 <= p.initial_scale_power <= 64:
    raise ConfigError(f"precision.initial_scale_power={p.initial_scale_power} must be in "
                      "[0, 64]: the dynamic scale starts at 2**initial_scale_power")
  if p.min_loss_scale <= 0 or (p.loss_scale == 0 and p.min_loss_scale > 2**p.initial_scale_power):
    raise ConfigError(f"precision.min_loss_scale={p.min_loss_scale:g} must be positive and at "
                      f"most the initial scale 2**precision.initial_scale_power = "
                      f"{2**p.initial_scale_power:g}")


def _validate_eval(cfg: Config) -> None:
  d, e = cfg.data, cfg.eval
  if not 0 <= d.eval_fraction < 1:
    raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
  if d.eval_fraction and d.eval_source:
    raise ConfigError("data.eval_fraction and data.eval_source both name a held-out split; "
                      "set one")
  if e.every < 0 or e.batches < 1:
    raise ConfigError(f"eval.every={e.every} must be >= 0 and eval.batches={e.batches} >= 1")
  if e.every and not (d.eval_fraction or d.eval_source):
    raise ConfigError(f"eval.every={e.every} needs a held-out split: set data.eval_fraction "
                      "(e.g. 0.01) or data.eval_source")
