"""What is about to run, said before it runs: the start-up banner and WORKDIR/config.json."""

from __future__ import annotations

import dataclasses
import pathlib

import jax

from jaxzero import config as config_lib
from jaxzero.engine.state_bytes import kept_whole
from jaxzero.models import lora as lora_lib
from jaxzero.planning.memory_check import Budget
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.utils.files import write_json_atomic
from jaxzero.utils.formatting import format_bytes as _b
from jaxzero.utils.formatting import format_count

CONFIG_FILE = "config.json"


# The files a later reader of config.json (jaxzero.export: the tokenizer, the chat
# template, the base model's ids) opens, wherever it runs from.
_PATH_FIELDS = (("data", "tokenizer"), ("data", "chat_template"), ("init", "hf_checkpoint"))


def write_config(cfg: config_lib.Config, workdir: pathlib.Path) -> pathlib.Path:
  """The resolved config as nested JSON (sections and fields as in jaxzero.config), with
  the _PATH_FIELDS that name a file or directory here made absolute."""
  workdir.mkdir(parents=True, exist_ok=True)
  path = workdir / CONFIG_FILE
  recorded = dataclasses.asdict(cfg)
  for section, field in _PATH_FIELDS:
    recorded[section][field] = recorded_path(recorded[section][field])
  write_json_atomic(path, recorded)
  return path


def recorded_path(name: str) -> str:
  """`name` as an absolute path where it names a file or directory here, for records read
  from another directory; otherwise as given (a Hugging Face Hub id, an unset "")."""
  path = pathlib.Path(name).expanduser()
  return str(path.absolute()) if name and path.exists() else name


def _devices(devices) -> str:
  """What the mesh runs on, in words: virtual CPU devices where there is no accelerator."""
  if devices[0].platform == "cpu":
    return f"{len(devices)} virtual CPU device{'s' if len(devices) > 1 else ''} (no GPU here)"
  return f"{len(devices)} x {devices[0].device_kind}"


def _loss_scaling(p) -> str:
  if not p.scales_loss:
    return ""
  if p.loss_scale:
    return f" with static loss scale {p.loss_scale:g}"
  return (f" with dynamic loss scale from 2^{p.initial_scale_power} (window "
          f"{p.loss_scale_window}, hysteresis {p.hysteresis}, min {p.min_loss_scale:g})")


def figures(run, budget: Budget) -> dict:
  """The banner's figures as numbers (for a tracker's run config)."""
  cfg, layout = run.cfg, run.layout
  return {"run/parameters": run.program.n_params, "run/devices": len(run.devices),
          "run/processes": jax.process_count(), "run/mesh": dict(layout.mesh.shape),
          "run/micro_batch": mesh_lib.micro_batch(cfg.train, layout.data_parallel_size),
          "run/tokens_per_step": cfg.train.global_batch * cfg.train.seq_len,
          "run/state_bytes_per_device": budget.state,
          "run/activation_bytes_per_device": budget.activations,
          "run/memory_bytes_per_device": budget.needed}


def _whole_text(whole: dict) -> str:
  """What the state keeps whole on every device, said where there is any."""
  if not whole["leaves"]:
    return ""
  leaves = f"{whole['leaves']} parameter{'s' if whole['leaves'] > 1 else ''}"
  return f" but {leaves} kept whole ({whole['why']}: {_b(whole['bytes'])} on each)"


def _frozen_text(state: dict) -> str:
  return f" of which frozen {_b(state['frozen'])}" if state.get("frozen") else ""


def text(run, budget: Budget, workdir: pathlib.Path, total_steps: int) -> str:
  """The banner: model, mesh and devices, ZeRO, batch arithmetic, data, memory, eval."""
  cfg, layout = run.cfg, run.layout
  m, t = cfg.model, cfg.train
  dp = layout.data_parallel_size
  micro = mesh_lib.micro_batch(t, dp)
  stage, hybrid = cfg.zero.resolved
  devices = run.devices
  mesh = " x ".join(f"{axis} {size}" for axis, size in layout.mesh.shape.items())
  tokens_per_step = t.global_batch * t.seq_len
  epochs = total_steps * t.global_batch / run.batches.rows_per_epoch
  offload = ", ".join(f"{role} in {kind}" for role, kind in
                      (("optimizer", cfg.offload.optimizer), ("params", cfg.offload.params))
                      if kind != "device") or "none"
  available = (f" of {_b(budget.available)}" if budget.available is not None else "")
  model = (f"{cfg.model_factory}, {format_count(run.program.n_params)} parameters"
           if cfg.model_factory else
           f"{m.family.capitalize()}, {format_count(run.program.n_params)} parameters (dim "
           f"{m.dim}, {m.n_layers} layers, {m.n_heads} heads / {m.n_kv_heads} kv, mlp "
           f"{m.mlp_dim}, vocab {m.vocab_size})")
  if cfg.lora.rank:
    model = (f"{m.family.capitalize()}, {format_count(run.program.n_frozen)} parameters frozen "
             f"+ LoRA rank {cfg.lora.rank} (alpha {cfg.lora.alpha:g}"
             + (f", dropout {cfg.lora.dropout:g}" if cfg.lora.dropout else "") + ") on "
             f"{','.join(lora_lib.resolve_targets(cfg.lora.targets))}: "
             f"{format_count(run.program.n_params)} trained (dim {m.dim}, {m.n_layers} layers)")
  lines = [
      f"jaxzero.train: {model}",
      f"  mesh      {mesh} = {_devices(devices)}, "
      f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''}",
      f"  ZeRO      stage {stage} ({config_lib.strategy_name(stage, hybrid)}), "
      f"{_sharded_text(layout)}{_whole_text(kept_whole(run.program))}; "
      f"remat {cfg.remat.policy}; offload {offload}; "
      f"compute {cfg.precision.compute}{_loss_scaling(cfg.precision)}"
      f"{' with fp8 matmuls' if cfg.precision.matmul == 'fp8' else ''}, grads "
      f"{cfg.zero.grad_dtype}",
      f"  batch     micro-batch {micro} x grad_accum {t.grad_accum} x {dp} data-parallel = "
      f"global batch {t.global_batch} sequences of {t.seq_len} = {tokens_per_step:,} tokens "
      f"per step",
      f"  data      {run.data_description}; {total_steps} steps see "
      f"{total_steps * tokens_per_step:,} tokens = {epochs:.3g} epochs",
      f"  memory    per device: model state {_b(budget.state)} (params {_b(budget.params)}"
      f"{_frozen_text(run.runner.plan())}, "
      f"grads {_b(budget.grads)}, optimizer {_b(budget.optimizer)}){budget.off_device_text} "
      f"+ {budget.activations_text} = {_b(budget.needed)}{available}; {budget.where}",
  ]
  if host_line(budget):
    lines.append(host_line(budget))
  if run.eval_batches is not None:
    n, rows, window = run.eval_batches.shape
    held_out = (f"the last {cfg.data.eval_fraction:g} of the data" if cfg.data.eval_fraction
                else cfg.data.eval_source)
    when = (f"every {cfg.eval.every} steps and at the end" if cfg.eval.every
            else "never (eval.every=0)")
    lines.append(f"  eval      {held_out} ({run.eval_batches.n_tokens:,} tokens): {n} batches "
                 f"of {rows} x {window - 1} tokens, {when}"
                 + (f"; left out: {run.eval_left_out}" if run.eval_left_out else ""))
  lines.append(f"  workdir   {workdir} ({CONFIG_FILE}, metrics.jsonl, tb/, checkpoints/)")
  return "\n".join(lines)


def _sharded_text(layout) -> str:
  """Which of the state ZeRO shards: the optimizer's from stage 1, the gradients from 2,
  the parameters at 3 (NO_SHARD: none)."""
  sharded = [name for role, name in (("optimizer", "optimizer state"), ("grads", "gradients"),
                                     ("params", "parameters")) if layout.is_sharded(role)]
  if not sharded:
    return "state replicated on every data-parallel device"
  what = "state" if len(sharded) == 3 else " and ".join(sharded)
  return f"{what} sharded over {layout.shard_size} devices"


def host_line(budget: Budget) -> str:
  """Host memory of an offloaded run on an accelerator ("" elsewhere: on a CPU, host
  memory is the devices' and the memory line counts it)."""
  if budget.platform == "cpu" or not budget.host_process:
    return ""
  ram = f" of {_b(budget.host_ram)} RAM" if budget.host_ram else " (RAM unknown)"
  return (f"  host      per process: {_b(budget.host_process)} (offloaded state, the update's "
          f"workspace, XLA's pinned pool, a save's copy of the device state) x "
          f"{budget.host_processes} on this host = "
          f"{_b(budget.host_process * budget.host_processes)}{ram}")
