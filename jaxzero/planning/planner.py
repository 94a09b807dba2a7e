"""Memory planning: per-device bytes of every ZeRO stage, read from XLA itself.

Each row of the plan (a stage, a remat policy or an offload setting) lowers and compiles the
very train step that training runs, ahead of time on N virtual CPU devices, from
``ShapeDtypeStruct``s that carry only shapes and shardings: no weight is ever allocated. Model
state is counted from the shardings and is exact; XLA's figures are those of its CPU compiler,
so ``activation_bytes`` is an estimate of a GPU's. With the NVMe tier the planner compiles
``TrainProgram.grad_step``, whose figures leave the streamed update out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import jax

from jaxzero import config as config_lib
from jaxzero import engine as engine_lib
from jaxzero.config import Config
from jaxzero.errors import ConfigError
from jaxzero.config.builtin_model import builtin_model
from jaxzero.models.llama import count_params
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.parallel import pipeline
from jaxzero.parallel.zero import Layout
from jaxzero.planning import comm_report as comm_lib
from jaxzero.planning import host_memory
from jaxzero.planning import variants as variants_lib
from jaxzero.planning import zero_formula
from jaxzero.runtime import pinned_pool
# (Variant is the plan's row kind: callers name it planner.Variant.)
from jaxzero.planning.variants import Variant
from jaxzero.planning.flops import model_flops_per_token
from jaxzero.runners.base import Runner
from jaxzero.runners.choose import make_runner

log = logging.getLogger(__name__)

# The plan needs XLA's buffer assignment, which is fixed before code generation;
# LLVM's optimisations and the MLIR fusion emitters only make the CPU kernels
# faster. Without them Llama-3-8B and 70B steps compile about 6x faster, with
# the same argument and output bytes and temporaries within a few hundred bytes.
FAST_COMPILE_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
# For the memory figures, XLA:CPU's loop-invariant code motion is left out:
# XLA:CPU computes bf16 data movement in f32 (float normalization), so a layer
# loop's slice of a bf16 weight stack becomes a slice of an f32 copy of the
# whole stack, which code motion then hoists out of the loop (4 bytes x the
# stack per device, e.g. 4.4 GB for Llama-3-70B on 64 devices). A GPU compiler
# moves bf16 as bf16 and makes no such copy. Communication is counted on the
# program compiled with every pass (code motion also hoists collectives).
MEMORY_COMPILE_OPTIONS = {**FAST_COMPILE_OPTIONS,
                          "xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# The largest micro-batch per device the search tries.
MICRO_BATCH_LIMIT = 1024
# Remat policies that move saved activations to pinned_host.
OFFLOADING_POLICIES = frozenset({"offload_matmuls"})


# The rates a predicted step assumes unless given (jaxzero.plan --tflops, --pcie-gbps,
# --host-gbps): dense bf16 at ~40% of an H100's peak; PCIe 4 x16 one way; a host update
# streaming through DRAM at what a 16-core server sustains.
DEFAULT_RATES = {"tflops": 400.0, "pcie_gbps": 25.0, "host_gbps": 20.0}
# A process's devices where the plan is not told: a GPU host's (jaxzero.launch starts one
# process a host).
DEVICES_PER_HOST = 8


@dataclasses.dataclass
class Row:
  """The plan of one variant, per device. Field names are the documented contract."""
  strategy: str
  stage: int
  hybrid: bool
  devices: int
  mesh: tuple[int, int]  # (replica, fsdp)
  micro_batch: int  # sequences per device per micro-step
  grad_accum: int
  seq_len: int
  remat: str
  offload_optimizer: str
  offload_params: str
  params_bytes: int  # compute copy of the weights
  grads_bytes: int  # gradients in zero.grad_dtype, placed by the stage's grads role
  optimizer_bytes: int  # fp32 master weights + Adam moments
  # XLA's temporaries of the step less the gradient buffers among them (those
  # are grads_bytes, in the state): activations, gathered weights, workspace.
  activation_bytes: int
  host_bytes: int  # state leaves placed in pinned_host
  nvme_bytes: int  # state leaves in the NVMe tier's files (the runner's plan)
  transfer_bytes: int  # host <-> device bytes per step, both ways (the runner's plan)
  total_bytes: int  # XLA's figure for what the device holds during the step, with what the
  # runner holds beside the program (beside_program: Twin-Flow's optimizer layers, DPU's copy)
  theory_state_bytes: int  # the ZeRO formula for params + grads + optimizer
  theory_formula: str
  fits: bool  # the device's share of total_bytes (device_bytes) <= the HBM budget
  max_micro_batch: int | None  # largest micro_batch that fits; None when not searched
  xla_host_bytes: int  # what XLA reports in host memory (state and offloaded activations)
  # False when something was placed in pinned_host but XLA counted it in its
  # device figures (the CPU compiler does): then total_bytes includes host_bytes
  # and offloaded activations.
  xla_separates_host: bool
  # With comm=True: every collective of the compiled step, counted the ZeRO way
  # (a jaxzero.planning.comm_report.CommReport); None otherwise.
  comm_report: object = dataclasses.field(default=None, repr=False, compare=False)
  tensor: int = 1  # mesh.tensor: `devices` = replica x fsdp x tensor x pipeline
  pipeline: int = 1  # mesh.pipeline: stages, each device holding its stage's layers
  context: int = 1  # devices each sequence is split over (mesh.context)
  # Host memory of one process of `devices_per_process` devices: the offloaded state, its
  # update's workspace, XLA's pinned pool and a save's copy (jaxzero.planning.host_memory);
  # what the host's update reads and writes a step.
  host_process_bytes: int = 0
  devices_per_process: int = 1
  host_update_bytes: int = 0
  # The predicted step, in seconds, at the plan's rates: the device's compute, the
  # host's update, PCIe; `step_s` adds the update's part (the slower of host and PCIe,
  # which overlap chunk by chunk) to the compute, or under offload.delayed_update
  # overlaps it with the next step's; `bound` names the slowest part.
  seconds: dict = dataclasses.field(default_factory=dict)
  step_s: float = 0.0
  bound: str = "compute"

  @property
  def state_bytes(self) -> int:
    return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclasses.dataclass
class Plan:
  rows: list[Row]
  notes: list[str]
  n_params: int
  hbm_bytes: int
  compiles: int
  seconds: float
  rates: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_RATES))
  # The trained parameters, where some are frozen (LoRA: the adapters; else n_params).
  n_trained: int | None = None


# ----------------------------------------------------------------------------
# XLA's figures from the compiled step


def compile_step(runner: Runner, micro_batch: int, options=FAST_COMPILE_OPTIONS):
  """The runner's device program, compiled ahead of time from shapes: nothing is
  allocated. With the NVMe runner, the step without its update (which runs outside it)."""
  program = runner.program
  lowered = runner.lower(program.abstract_state(), program.abstract_batch(micro_batch))
  try:
    return lowered.compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:
    if "No such compile option" not in str(e):
      raise
    log.info("this XLA lacks a fast-compile option (%s); compiling with defaults", e)
    return lowered.compile()


def xla_total_bytes(stats) -> int:
  """What the device holds while the step runs, by XLA's buffer assignment.

  Arguments (the state and the batch) and outputs live across the call and
  temporaries only during it, so their sum bounds the peak. Donated state is
  an argument aliased to an output: counted once, hence "- alias". Buffers in
  host memory are reported apart (host_*) by compilers that separate them.
  (`peak_memory_in_bytes` is not used: the CPU compiler leaves temporaries
  out of it.)
  """
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes
          + stats.generated_code_size_in_bytes)


def xla_host_bytes(stats) -> int:
  return (stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes
          - stats.host_alias_size_in_bytes + stats.host_temp_size_in_bytes)


def beside_program(runner: Runner, state: dict) -> int:
  """Device bytes a runner holds through the step outside its compiled program (`state`:
  its plan()): a runner whose program is the gradient step updates outside it, and keeps
  on the device the optimizer state it does not offload (Twin-Flow's first layers) and,
  under DPU, the copy of the weights its update writes while the next step runs."""
  if runner.device_program != "gradients":
    return 0
  offloaded = state["nvme"] + state["host"] - state.get("pinned_pool", state["host"])
  return max(0, state["optimizer"] - offloaded) + state.get("delayed_device", 0)


def device_bytes(stats, cfg: Config, state: dict, micro: int, beside: int = 0) -> int:
  """XLA's total less what a GPU keeps in pinned_host, where the compiler counted it on
  the device (XLA:CPU does): the weights placed there (exact, from the runner's plan(),
  `state`) and remat.policy=offload_matmuls's activations (estimated: pinned_pool); plus
  what the runner holds `beside` the program (beside_program)."""
  total = xla_total_bytes(stats) + beside
  if xla_host_bytes(stats) > 0:  # the compiler reported them apart
    return total
  on_host = state.get("pinned_pool", state["host"])
  if cfg.remat.policy in OFFLOADING_POLICIES:
    on_host += pinned_pool.offloaded_matmul_bytes(cfg, micro)
  return max(0, total - on_host)


def largest_micro_batch(total_at: Callable[[int], int], budget: int, start: int,
                        start_total: int, limit: int = MICRO_BATCH_LIMIT) -> int:
  """Largest micro-batch whose step fits `budget` (0 if none), from a known point.

  Each probe is one compile, so it predicts instead of doubling: device
  bytes grow affinely with the micro-batch (activations and the batch scale,
  the state does not), and the next probe is the prediction from the last
  two points, clamped into the bracket (fits, fails) so that every probe
  narrows it. Usually three compiles.
  """
  if start_total > budget:  # downward: plain bisection over [0, start)
    fits, fails = 0, start
    while fails - fits > 1:
      mid = (fits + fails) // 2
      fits, fails = (mid, fails) if total_at(mid) <= budget else (fits, mid)
    return fits
  fits, fits_total, fails = start, start_total, None
  last = (start, start_total)
  probe = min(2 * start, limit)
  while fits < limit and (fails is None or fails - fits > 1):
    total = total_at(probe)
    if total <= budget:
      fits, fits_total = probe, total
    else:
      fails = probe
    slope = (total - last[1]) / (probe - last[0]) if probe != last[0] else 0
    last = (probe, total)
    guess = fits + int((budget - fits_total) // slope) if slope > 0 else limit
    upper = fails - 1 if fails is not None else limit
    probe = max(fits + 1, min(guess, upper))
  return fits


# ----------------------------------------------------------------------------
# The plan


def predicted_step(cfg: Config, n_params: int, devices: int, transfer: int, host_update: int,
                   rates: dict, n_frozen: int = 0) -> tuple[dict, float, str]:
  """({compute, host, pcie} seconds, the step's seconds, the slowest part's name)."""
  tokens = cfg.train.global_batch * cfg.train.seq_len
  per_token = model_flops_per_token(cfg, n_params, n_frozen)
  if cfg.remat.policy == "full":  # the forward pass again: 2 a weight (frozen or not) and
    # a third of attention's (the other policies' recompute is not counted)
    per_token += 2 * (n_params + n_frozen) + (per_token - 6 * n_params - 4 * n_frozen) / 3
  flops = per_token * tokens / devices
  seconds = {"compute": flops / (rates["tflops"] * 1e12),
             "host": host_update / (rates["host_gbps"] * 1e9),
             "pcie": transfer / (rates["pcie_gbps"] * 1e9)}
  update = max(seconds["host"], seconds["pcie"])
  step = (max(seconds["compute"], update) if cfg.offload.delayed_update
          else seconds["compute"] + update)
  return seconds, step, max(seconds, key=seconds.get)


def plan(cfg: Config, n_devices: int, hbm_bytes: int, sweep: str | list[Variant] = "stages",
         search: bool = True, comm: bool = False, rates: dict | None = None,
         devices_per_process: int | None = None) -> Plan:
  """Plans each variant of `sweep` (a name in variants.SWEEPS, or the variants themselves)
  for `cfg` on `n_devices` virtual CPU devices; `comm` also counts each
  variant's collectives (jaxzero.planning.collectives). Host memory is one process's, of
  `devices_per_process` of them (default: a host of 8 GPUs, or all `n_devices` if fewer)."""
  t0 = time.perf_counter()
  devices = variants_lib.cpu_devices(n_devices)
  cfg, notes = variants_lib.for_cpu(cfg)
  replica, fsdp, tensor = mesh_lib.resolve_shape(cfg.mesh, n_devices)
  cfg, fitted = variants_lib.fit_batch_arithmetic(cfg, replica * fsdp)
  notes += fitted
  mesh = mesh_lib.mesh_for(cfg.mesh, devices)
  rows, compiles, n_trained = [], 0, None
  for variant in (variants_lib.variants(cfg, sweep, replica) if isinstance(sweep, str)
                  else sweep):
    variant_cfg = variant.apply(cfg)
    try:  # a row jaxzero.train would refuse is not planned: the plan says why
      config_lib.validate(variant_cfg)
    except ConfigError as refused:
      notes.append(f"no row for {variants_lib.name(variant)}: {refused}")
      continue
    program = engine_lib.TrainProgram(variant_cfg, Layout.from_config(variant_cfg, mesh),
                                      builtin_model(variant_cfg))
    row, n = _plan_variant(make_runner(program, check=False), variant, hbm_bytes, search, comm,
                           {**DEFAULT_RATES, **(rates or {})},
                           min(n_devices, devices_per_process or DEVICES_PER_HOST))
    rows.append(row)
    compiles += n
    n_trained = program.n_params if program.n_frozen else None
  if not rows:
    asked = f"--sweep {sweep}" if isinstance(sweep, str) else "the rows asked for"
    raise ConfigError(f"{asked}: jaxzero.train refuses every one; {notes[-1]}")
  notes += _notes(cfg, sweep, rows)
  return Plan(rows, notes, count_params(cfg.model), hbm_bytes, compiles,
              time.perf_counter() - t0, {**DEFAULT_RATES, **(rates or {})}, n_trained)


def _plan_variant(runner: Runner, variant: Variant, hbm_bytes: int,
                  search: bool, comm: bool, rates: dict,
                  devices_per_process: int) -> tuple[Row, int]:
  """The row of one variant, and how many compiles it took."""
  program = runner.program
  micro = mesh_lib.micro_batch(program.cfg.train, program.layout.data_parallel_size)
  compiled = compile_step(runner, micro, MEMORY_COMPILE_OPTIONS)
  state = runner.plan()
  beside = beside_program(runner, state)
  on_device = device_bytes(compiled.memory_analysis(), program.cfg, state, micro, beside)
  row = _row(runner, state, variant, compiled.memory_analysis(), micro, on_device <= hbm_bytes,
             rates, devices_per_process, beside)
  compiles = 1
  if comm:
    compiles += 1
    row.comm_report = comm_lib.for_program(compile_step(runner, micro), program, micro)
  if search:
    def total_at(micro_batch: int) -> int:
      nonlocal compiles
      compiles += 1
      return device_bytes(
          compile_step(runner, micro_batch, MEMORY_COMPILE_OPTIONS).memory_analysis(),
          program.cfg, state, micro_batch, beside)
    row.max_micro_batch = largest_micro_batch(total_at, hbm_bytes, micro, on_device)
  return row, compiles


def _row(runner: Runner, state: dict, variant: Variant, stats, micro: int, fits: bool,
         rates: dict, devices_per_process: int, beside: int = 0) -> Row:
  cfg, layout = runner.program.cfg, runner.program.layout
  seconds, step_s, bound = predicted_step(cfg, runner.program.n_params, layout.mesh.size,
                                          state["transfer"], state.get("host_update", 0), rates,
                                          runner.program.n_frozen)
  program = runner.program
  theory, formula = (zero_formula.theory_state_bytes(cfg, layout, program.n_params,
                                                     program.n_frozen, program.frozen_bytes)
                     if program.n_frozen else zero_formula.theory_state_bytes(cfg, layout))
  total = xla_total_bytes(stats) + beside
  return Row(
      strategy=variant.strategy, stage=variant.stage, hybrid=variant.hybrid,
      devices=layout.mesh.size, mesh=(layout.mesh.shape["replica"], layout.mesh.shape["fsdp"]),
      tensor=layout.tensor_size, pipeline=layout.pipeline_size, context=layout.context_size,
      micro_batch=micro, grad_accum=cfg.train.grad_accum, seq_len=cfg.train.seq_len,
      remat=variant.remat, offload_optimizer=variant.offload_optimizer,
      offload_params=variant.offload_params,
      params_bytes=state["params"], grads_bytes=state["grads"],
      optimizer_bytes=state["optimizer"],
      # (A runner whose device program is the gradient step returns the gradients:
      # not temporaries.)
      activation_bytes=max(0, stats.temp_size_in_bytes
                           - (0 if runner.device_program == "gradients" else state["grads"])),
      host_bytes=state["host"], nvme_bytes=state["nvme"], transfer_bytes=state["transfer"],
      total_bytes=total,
      theory_state_bytes=theory, theory_formula=formula,
      fits=fits,
      max_micro_batch=None,
      xla_host_bytes=xla_host_bytes(stats),
      xla_separates_host=xla_host_bytes(stats) > 0 or not (
          state.get("pinned_pool", state["host"]) or variant.remat in OFFLOADING_POLICIES),
      # (The mesh's first devices, as a host's GPUs are in a multi-host mesh.)
      host_process_bytes=host_memory.per_process(
          runner, state, list(layout.mesh.devices.flat)[:devices_per_process],
          estimate_activations=not cfg.model_factory).process,
      devices_per_process=devices_per_process,
      host_update_bytes=state.get("host_update", 0), seconds=seconds, step_s=step_s, bound=bound)


def _kept_text(stages: int, micro: int, schedule: str, virtual: int) -> str:
  """What a stage keeps for its backward (pipeline.kept_for_backward), in words."""
  residuals, inputs = pipeline.kept_for_backward(stages, micro, schedule, virtual)
  if schedule == "1f1b":
    return f"two micro-batches' residuals and the inputs of {inputs} of its {micro}"
  if virtual > 1:
    return f"{inputs} ticks' chunk inputs and one chunk's residuals"
  return f"{int(residuals)} ticks' residuals ({micro} micro-batches and the bubble's)"


def _notes(cfg: Config, sweep, rows: list[Row]) -> list[str]:
  notes = []
  if cfg.precision.compute != "float32":
    short = {"bfloat16": "bf16", "float16": "fp16"}[cfg.precision.compute]
    notes.append(f"XLA's CPU compiler computes {short} matmuls in fp32 and keeps some "
                 "activations and gradient buffers in fp32: a GPU's activations are smaller")
  if sweep == "stages" and cfg.offload.params == "pinned_host":
    notes.append("offload.params=pinned_host applies to the stage-3 rows only")
  stages = cfg.mesh.pipeline
  if stages > 1:
    micro, schedule, virtual = (cfg.train.grad_accum, cfg.pipeline.schedule,
                                cfg.pipeline.virtual_stages)
    named = schedule
    if schedule == "interleaved":
      named += f" over {virtual} virtual stages (each stage's weights move to it every step)"
    notes.append(
        f"pipeline: {stages} stages of {cfg.model.n_layers // stages} layers, schedule "
        f"{named}, {micro} micro-batches a step: bubble {pipeline.BUBBLE_FORMULAS[schedule]} = "
        f"{pipeline.bubble_fraction(stages, micro, schedule, virtual):.1%}"
        f"{' of its slots (a slot lasts a backward)' if schedule == '1f1b' else ''}; each "
        f"stage keeps for its backward {_kept_text(stages, micro, schedule, virtual)} "
        "(in 'activations'); the state columns are one "
        "device's, with its stage's layers only, the ZeRO formula column the whole model's over N")
  if any(not r.xla_separates_host for r in rows):
    notes.append("XLA's CPU compiler does not separate pinned_host memory: its figures count "
                 "the host column and offloaded activations as device memory (a GPU compiler "
                 "reports them apart); fits and max micro leave them out")
  return notes
