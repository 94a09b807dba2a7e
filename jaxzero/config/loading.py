"""Loading a config file and the checks that need no devices.

Reading a config starts no JAX backend, so the CLI can decide how many virtual
CPU devices to create before JAX starts.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import traceback

from jaxzero.config import mesh_checks
from jaxzero.config.overrides import apply_overrides, check_literals, check_types
from jaxzero.config.sections import Config, OffloadConfig, PrecisionConfig
from jaxzero.errors import ConfigError
from jaxzero.models import lora as lora_lib


def load(path: str, assignments: list[str] = ()) -> Config:
  """Loads `get_config()` from a config file and applies `--set` overrides."""
  cfg = apply_overrides(read(path), list(assignments))
  validate(cfg)
  return cfg


def read(path: str) -> Config:
  """The config file's `get_config()`, as it is: unchecked, before any `--set`."""
  file = _check_config_file(path)
  spec = importlib.util.spec_from_file_location(f"jaxzero_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  # A model module kept beside the config file imports by its name (model_factory).
  directory = str(file.resolve().parent)
  if directory not in sys.path:
    sys.path.append(directory)
  _run_config_file(path, lambda: spec.loader.exec_module(module))
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path!r} defines no get_config()")
  cfg = _run_config_file(path, module.get_config)
  if not isinstance(cfg, Config):
    raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not jaxzero Config")
  return cfg


# Where a framework's file goes instead of --config (jaxzero.train's flags), by its suffix.
DEEPSPEED_FLAG = "a DeepSpeed config (JSON) goes to jaxzero.train --deepspeed"
ACCELERATE_FLAG = "an Accelerate config (YAML) goes to jaxzero.train --accelerate-config"
FRAMEWORK_FLAGS = {".json": (DEEPSPEED_FLAG,), ".yaml": (ACCELERATE_FLAG,),
                   ".yml": (ACCELERATE_FLAG,)}


def _check_config_file(path: str) -> pathlib.Path:
  """`path` as a Python config file; one line when it is missing, a directory or not Python."""
  file = pathlib.Path(path)
  if file.is_dir():
    inside = _python_files(file)
    raise ConfigError(f"config file {path!r} is a directory; name a .py file "
                      + (f"in it: {', '.join(inside)}" if inside else
                         f"(presets are in configs/: {', '.join(_python_files(_configs_dir()))})"))
  if not file.is_file():
    raise ConfigError(f"config file {path!r} does not exist; presets are in configs/: "
                      + ", ".join(_python_files(_configs_dir())))
  if file.suffix != ".py":
    flags = FRAMEWORK_FLAGS.get(file.suffix.lower(), (DEEPSPEED_FLAG, ACCELERATE_FLAG))
    raise ConfigError(f"config file {path!r} is not a Python file: a config is a .py file "
                      f"defining get_config() (presets are in configs/); {' and '.join(flags)}"
                      ", over such a file")
  return file


def _python_files(directory: pathlib.Path) -> list[str]:
  return sorted(p.name for p in directory.glob("*.py") if p.name != "__init__.py")


def _run_config_file(path: str, run):
  """`run()`, with an error the config file raises (a syntax error, a failed import, a
  bug in get_config) as one line naming the file and the line."""
  try:
    return run()
  except ConfigError:
    raise
  except SyntaxError as e:
    raise ConfigError(f"config file {path}: {e.filename or path}, line {e.lineno}: "
                      f"SyntaxError: {e.msg}") from None
  except Exception as e:  # pylint: disable=broad-exception-caught
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if pathlib.Path(f.filename).resolve() == pathlib.Path(path).resolve()]
    where = f", line {frames[-1].lineno}" if frames else ""
    raise ConfigError(f"config file {path}{where}: {type(e).__name__}: {e}") from None


def _configs_dir() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parents[2] / "configs"


def validate(cfg: Config) -> None:
  """Checks everything that does not need to know the devices."""
  check_types(cfg)
  check_literals(cfg)
  if not cfg.model_factory:  # (a model_factory model's shapes are its own, checked built)
    _validate_model(cfg.model)
  elif cfg.model.vocab_size < 1:  # (the data's token ids are checked against it)
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} must be at least 1")
  if cfg.seed >= 2**63:
    raise ConfigError(f"seed={cfg.seed} must be below 2**63 (a 64-bit seed)")
  for key, value in (("seed", cfg.seed), ("train.warmup_steps", cfg.train.warmup_steps),
                     ("train.lr", cfg.train.lr), ("train.weight_decay", cfg.train.weight_decay),
                     ("train.clip_norm", cfg.train.clip_norm), ("train.eps", cfg.train.eps),
                     ("train.warmup_min_ratio", cfg.train.warmup_min_ratio),
                     ("train.min_lr_ratio", cfg.train.min_lr_ratio),
                     ("zero.min_shard_size", cfg.zero.min_shard_size),
                     ("data.max_bytes", cfg.data.max_bytes)):
    if value < 0:
      raise ConfigError(f"{key}={value} must not be negative")
  for key, value in (("train.b1", cfg.train.b1), ("train.b2", cfg.train.b2)):
    if not 0 <= value < 1:  # (Adam's betas, as torch.optim.Adam bounds them)
      raise ConfigError(f"{key}={value} must be in [0, 1)")
  for key, value in (("train.min_lr_ratio", cfg.train.min_lr_ratio),
                     ("train.warmup_min_ratio", cfg.train.warmup_min_ratio)):
    if value > 1:
      raise ConfigError(f"{key}={value} must be at most 1 (a fraction of train.lr)")
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
  if not cfg.model_factory:
    mesh_checks.check_tensor(cfg.mesh.tensor, cfg.model)
  mesh_checks.check_pipeline(cfg)
  mesh_checks.check_context(cfg)
  if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
    raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
  _validate_eval(cfg)
  _validate_data_format(cfg)
  _validate_matmul(cfg)
  _validate_loss_scale(cfg.precision)
  _validate_operations(cfg)
  if cfg.model_factory and (":" not in cfg.model_factory or cfg.init.hf_checkpoint):
    raise ConfigError(f"model_factory={cfg.model_factory!r} must be \"module:function\""
                      + (" and cannot start from init.hf_checkpoint (a Llama-family checkpoint)"
                         if cfg.init.hf_checkpoint else ""))
  validate_offload(cfg)
  _validate_lora(cfg)


def _validate_lora(cfg: Config) -> None:
  lora = cfg.lora
  if lora.rank == 0:
    if lora.init_from:
      raise ConfigError(f"lora.init_from={lora.init_from} needs lora.rank (the adapter's r)")
    # A quantized base shows the intent to train adapters (a preset's other lora fields
    # stay as they are when lora.rank=0 turns LoRA off for a full fine-tune baseline).
    ignored = _changed(lora, "lora", ["base_dtype"])
    if ignored:  # a QLoRA preset missing its rank would train every weight in full
      raise ConfigError(f"{', '.join(ignored)} without lora.rank: no LoRA, every weight "
                        "trains; set lora.rank (e.g. 16) to train adapters, or leave "
                        f"{'it' if len(ignored) == 1 else 'them'} unset")
    return
  if lora.rank < 0:
    raise ConfigError(f"lora.rank={lora.rank} must be positive (0 = no LoRA: every weight "
                      "trains)")
  if lora.alpha <= 0:
    raise ConfigError(f"lora.alpha={lora.alpha:g} must be positive")
  if not 0 <= lora.dropout < 1:
    raise ConfigError(f"lora.dropout={lora.dropout:g} must be in [0, 1) (the probability "
                      "of dropping each adapter input; PEFT's lora_dropout)")
  try:
    targets = lora_lib.resolve_targets(lora.targets)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  top = [t for t in targets if t in lora_lib.TOP_TARGETS]
  if top and cfg.model.tie_embeddings:
    raise ConfigError(f"lora.targets={lora.targets!r} adapts the {' and '.join(top)}, and "
                      "this model ties its head to its embedding (model.tie_embeddings): "
                      "a merged export could not hold the two apart; adapt the "
                      "projections only (e.g. all-linear)")
  if lora.base_dtype in ("bfloat16", "float32") and lora.base_dtype != cfg.precision.compute:
    raise ConfigError(f"lora.base_dtype={lora.base_dtype} with precision.compute="
                      f"{cfg.precision.compute}: a base that is not quantized is kept in the "
                      "compute dtype; leave lora.base_dtype empty, or choose nf4 or int8")
  if cfg.model_factory:
    raise ConfigError("lora.rank with model_factory: the lora section adapts the built-in "
                      "Llama family; wrap your own model with jaxzero.lora instead")
  try:
    lora_lib.check_base_dtype(cfg.model, lora.base_dtype)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  validate_frozen_offload(cfg, f"lora.rank={lora.rank}")
  if cfg.mesh.pipeline > 1 and cfg.pipeline.schedule == "1f1b" and lora.dropout:
    raise ConfigError(f"lora.dropout={lora.dropout:g} with pipeline.schedule=1f1b is not "
                      "supported (the rows' keys do not cross its stages); use gpipe or "
                      "interleaved, or lora.dropout=0")


def validate_frozen_offload(cfg: Config, what: str) -> None:
  """The ``offload`` section for a model with frozen weights (`what`: LoRA's, or
  jaxzero.lora's): the trained adapters' optimizer state (a few MB) stays on the device,
  and the frozen weights rest on the device or, at stage 3, in pinned_host."""
  o = cfg.offload
  if o.optimizer != "device" or o.params == "nvme":
    raise ConfigError(f"{what} with offload.optimizer={o.optimizer}, offload.params="
                      f"{o.params}: a model with frozen weights keeps its optimizer state (the "
                      "adapters', a few MB) on the device, and its frozen weights on the device "
                      "or, with offload.params=pinned_host, in host memory; set "
                      "offload.optimizer=device and offload.params=device or pinned_host")


def validate_offload(cfg: Config) -> None:
  """The ``offload`` section against the stage and mesh (jaxzero.Engine checks it too)."""
  o = cfg.offload
  if not 0 <= o.optimizer_fraction <= 1:
    raise ConfigError(f"offload.optimizer_fraction={o.optimizer_fraction:g} must be between 0 "
                      "and 1 (the share of the layers' optimizer state on the host)")
  for key, value, default in (("optimizer_fraction", o.optimizer_fraction, 1.0),
                              ("delayed_update", o.delayed_update, False)):
    if value != default and o.optimizer != "pinned_host":
      raise ConfigError(f"offload.{key}={value} applies to the optimizer in host memory: set "
                        f"offload.optimizer=pinned_host (got offload.optimizer={o.optimizer})")
  if o.delayed_update_after < 0:
    raise ConfigError(f"offload.delayed_update_after={o.delayed_update_after} must be a step "
                      "count >= 0 (0: DPU from the first step)")
  if o.delayed_update and cfg.precision.scales_loss:
    raise ConfigError("offload.delayed_update=true with precision.compute=float16: a step that "
                      "overflows would skip an update already under way; use bfloat16 or "
                      "float32, or offload.delayed_update=false")
  if cfg.offload.params != "device" and cfg.zero.resolved[0] != 3:
    raise ConfigError(f"offload.params={cfg.offload.params} needs ZeRO stage 3 (zero.stage=3 or "
                      "zero.strategy=FULL_SHARD/HYBRID_SHARD)")
  if cfg.offload.params == "nvme":
    _validate_param_tier(cfg)


def _validate_param_tier(cfg) -> None:
  """offload.params=nvme: what the layer-by-layer driver (jaxzero.runners.infinity) runs."""
  where = "offload.params=nvme"
  if cfg.offload.optimizer != "nvme":
    raise ConfigError(f"{where} needs offload.optimizer=nvme (the master weights it reads live "
                      f"there); got offload.optimizer={cfg.offload.optimizer}")
  if cfg.zero.resolved[1] or cfg.mesh.replica not in (1,) or cfg.mesh.tensor != 1:
    raise ConfigError(f"{where} runs on an fsdp-only mesh at zero.stage=3 (mesh.replica=1, "
                      "mesh.tensor=1, no HYBRID_SHARD)")
  if cfg.eval.every:
    raise ConfigError(f"{where} does not evaluate held-out data yet: set eval.every=0")


def validate_precision(p: PrecisionConfig) -> None:
  """The loss scaler's rules (jaxzero.Engine's precision, as the config's)."""
  _validate_loss_scale(p)


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


def _validate_operations(cfg: Config) -> None:
  steps = cfg.profile.steps
  start, colon, end = steps.partition(":")
  if steps and not (start.isdigit() and int(start) >= 1 and (not colon or (
      end.isdigit() and int(end) >= int(start)))):
    raise ConfigError(f"profile.steps={steps!r} must be START:END, the first and last step to "
                      "trace (from 1), e.g. 20:23")
  if steps and int(start) > cfg.train.steps:
    raise ConfigError(f"profile.steps={steps!r} starts after train.steps={cfg.train.steps}: "
                      f"nothing would be traced; trace steps from 1 to {cfg.train.steps}")
  d = cfg.distributed
  if d.stall_s < 0 or d.stall_exit_s < 0:
    raise ConfigError(f"distributed.stall_s={d.stall_s:g} and distributed.stall_exit_s="
                      f"{d.stall_exit_s:g} must not be negative (0 = the default)")


def _validate_matmul(cfg: Config) -> None:
  p = cfg.precision
  if p.matmul != "fp8":
    return
  if p.compute == "float16":
    raise ConfigError("precision.matmul=fp8 with precision.compute=float16: FP8 matmuls run "
                      "around bfloat16 (or float32) compute; set precision.compute=bfloat16")
  if cfg.model_factory:
    raise ConfigError("precision.matmul=fp8 sets the built-in models' projections; a "
                      "model_factory model chooses its own matmuls")


def notices(cfg: Config) -> list[str]:
  """Settings that pass the checks but do not do what they seem to: said once, at start."""
  t, d, o = cfg.train, cfg.data, cfg.offload
  said = []
  if t.warmup_steps > t.steps:
    said.append(f"train.warmup_steps={t.warmup_steps} is past train.steps={t.steps}, where the "
                f"schedule ends: the learning rate never reaches train.lr={t.lr:g} (to stop "
                "early, keep train.steps and give --steps N)")
  if o.nvme_dir and "nvme" not in (o.optimizer, o.params):
    said.append(f"offload.nvme_dir={o.nvme_dir!r} is unused: nothing is offloaded to NVMe "
                "(offload.optimizer=nvme or offload.params=nvme)")
  default_after = OffloadConfig.delayed_update_after
  if o.delayed_update_after != default_after and not o.delayed_update:
    said.append(f"offload.delayed_update_after={o.delayed_update_after} is unused: "
                "offload.delayed_update is off (every step is exact)")
  elif o.delayed_update and o.delayed_update_after >= t.steps:
    said.append(f"offload.delayed_update_after={o.delayed_update_after} is not before "
                f"train.steps={t.steps}: every step is exact, DPU never runs")
  if d.eval_fraction and not cfg.eval.every:
    said.append(f"data.eval_fraction={d.eval_fraction} holds data out of training that "
                "eval.every=0 never evaluates: set eval.every, or leave data.eval_fraction 0")
  return said


def _validate_model(m) -> None:
  """The built-in model's sizes and numbers: each would fail later, or train on nonsense
  (a rope theta of 0 gives NaN at the first step, a norm eps of 0 at the first zero row)."""
  for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_dim"):
    if getattr(m, key) < 1:
      raise ConfigError(f"model.{key}={getattr(m, key)} must be at least 1")
  for key in ("rope_theta", "norm_eps", "init_std"):
    if not getattr(m, key) > 0:
      raise ConfigError(f"model.{key}={getattr(m, key)} must be positive")
  if m.rope_scaling_factor > 1 and not (
      m.rope_original_max_len >= 1 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor):
    raise ConfigError(
        f"model.rope_scaling_factor={m.rope_scaling_factor} (Llama 3's rope scaling) needs "
        f"model.rope_original_max_len >= 1 and 0 < model.rope_low_freq_factor < "
        f"model.rope_high_freq_factor; got {m.rope_original_max_len}, "
        f"{m.rope_low_freq_factor} and {m.rope_high_freq_factor}")
  try:
    m.validate()
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _validate_data_format(cfg: Config) -> None:
  d = cfg.data
  if not d.source.strip():  # (an unset shell variable): not every file under the cwd
    raise ConfigError("data.source is empty; set it to 'stdlib', or a file, directory or glob "
                      "of .txt, .jsonl or .parquet files")
  formats = ("text", "chat", "prompt_completion")
  if d.format not in formats:
    raise ConfigError(f"data.format={d.format!r}; choose one of {', '.join(formats)}")
  if d.overlong not in ("truncate", "drop"):
    raise ConfigError(f"data.overlong={d.overlong!r}; choose 'truncate' or 'drop'")
  if d.tokenizer == "byte" and d.eos_token:
    raise ConfigError(f"data.eos_token={d.eos_token!r} names a token of a Hugging Face "
                      "tokenizer; data.tokenizer='byte' ends each document with byte 0: "
                      "leave data.eos_token unset, or set data.tokenizer")
  if d.source != "stdlib" and _changed(d, "data", ["max_bytes"]):
    raise ConfigError(f"data.max_bytes={d.max_bytes} caps the built-in stdlib corpus; "
                      f"data.source={d.source!r} is read whole (list fewer files to read less)")
  if d.format == "text":
    if d.packing:
      raise ConfigError("data.packing packs fine-tuning examples (data.format=chat|"
                        "prompt_completion); data.format='text' is one stream already")
    ignored = _changed(d, "data", ["chat_template", "overlong"])
    if ignored:  # the text stream is neither rendered nor cut into examples
      one = len(ignored) == 1
      raise ConfigError(f"{', '.join(ignored)} with data.format='text': "
                        f"{'it applies' if one else 'they apply'} to fine-tuning records only "
                        "(data.format=chat|prompt_completion); set data.format, or leave "
                        f"{'it' if one else 'them'} unset")
    return
  if d.source == "stdlib":
    raise ConfigError(f"data.format={d.format!r} reads records from .jsonl or .parquet files; "
                      "set data.source to them")
  if _changed(d, "data", ["text_field"]):  # the records' fields are the format's own
    keys = "'messages'" if d.format == "chat" else "'prompt' and 'completion'"
    raise ConfigError(f"data.text_field={d.text_field!r} with data.format={d.format!r}: it "
                      f"names the text of data.format='text' records; {d.format} records "
                      f"hold {keys}; leave it unset")
  if cfg.model_factory:
    raise ConfigError(f"data.format={d.format!r} gives the built-in models' batches "
                      "(tokens, loss_mask, segment_ids); model_factory's loss takes token windows")
  if d.packing and cfg.model.attention == "cudnn":
    raise ConfigError("data.packing with model.attention=cudnn: cuDNN's attention takes no "
                      "segment ids here; use model.attention=auto (blockwise for packed rows)")
  if d.packing and cfg.mesh.pipeline > 1 and cfg.pipeline.schedule == "1f1b":
    raise ConfigError("data.packing with pipeline.schedule=1f1b is not supported yet: a "
                      "packed row's segment ids do not cross its stages; use gpipe or "
                      "interleaved, or data.packing=false")


def _changed(section, name: str, keys: list[str]) -> list[str]:
  """"name.key=value" of each of `keys` that `section` sets away from its default."""
  default, changed = type(section)(), []
  for key in keys:
    value = getattr(section, key)
    if value != getattr(default, key):
      changed.append(f"{name}.{key}={value:g}" if isinstance(value, float) else
                     f"{name}.{key}={value}")
  return changed


def _validate_eval(cfg: Config) -> None:
  d, e = cfg.data, cfg.eval
  if not 0 <= d.eval_fraction < 1:
    raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
  if d.eval_fraction and d.eval_source:
    raise ConfigError("data.eval_fraction and data.eval_source both name a held-out split; "
                      "set one")
  if e.every < 0:
    raise ConfigError(f"eval.every={e.every} must be >= 0 (0: no evaluation)")
  if e.batches < 1:
    raise ConfigError(f"eval.batches={e.batches} must be at least 1")
  if e.every and not (d.eval_fraction or d.eval_source):
    raise ConfigError(f"eval.every={e.every} needs a held-out split: set data.eval_fraction "
                      "(e.g. 0.01) or data.eval_source")
