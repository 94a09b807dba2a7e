"""The training loop: resume or initialise, run steps, log, save.

:func:`build` takes the config through the mesh and the ZeRO layout to a
TrainProgram and the runner the config chooses (jaxzero.runners), once; the loop
drives the runner, whatever it is. Restarting with the same workdir continues from
the latest complete checkpoint, on any mesh and stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from orbax.checkpoint import multihost

from jaxzero import config as config_lib
from jaxzero import engine as engine_lib
from jaxzero.api import adapters
from jaxzero.checkpoint import checkpointer as checkpoint_lib
from jaxzero.config import Config
from jaxzero.data import batches as batches_lib
from jaxzero.data import pipeline
from jaxzero.errors import (CheckpointError, ConfigError, DamagedCheckpointError,
                            NonFiniteError)
from jaxzero.hf import load as hf_load
from jaxzero.hf import peft as hf_peft
from jaxzero.models import attention as attention_lib
from jaxzero.models import lora as lora_lib
from jaxzero.models.llama import param_specs
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.parallel.zero import Layout, on_device
from jaxzero.planning import memory_check, memory_measure
from jaxzero.planning.flops import model_flops_per_token
from jaxzero.runners import base as runners_base
from jaxzero.runners import resume
from jaxzero.runners.base import Runner
from jaxzero.runners.choose import make_runner
from jaxzero.runtime import peerwatch
from jaxzero.training import banner, evaluation, profiling, tracking
from jaxzero.training import workdir as workdir_lib
from jaxzero.training.metrics import (MetricsLogger, PendingMetrics, drop_metrics_after,
                                      nonfinite_streak)
from jaxzero.training.preemption import StopSignals

log = logging.getLogger(__name__)

# How long the first process to compile the step waits for the last one.
COMPILE_WAIT_S = 600


@dataclasses.dataclass
class Run:
  """Everything a training run builds from its config, before any step."""
  cfg: Config
  layout: Layout
  runner: Runner  # how the state is trained and kept (jaxzero.runners)
  batches: Any  # the training batches by step (jaxzero.data.pipeline)
  eval_batches: Any = None  # the held-out split's fixed batches, if any
  data_description: str = ""  # what the training batches hold, for the banner
  eval_left_out: str = ""  # the held-out examples left out, for the banner

  @property
  def program(self) -> engine_lib.TrainProgram:
    return self.runner.program

  @property
  def devices(self) -> list:
    return list(self.layout.mesh.devices.flat)

  def batch(self, step: int) -> jax.Array:
    """The batch of `step` as one global array; each process supplies only its rows."""
    return batches_lib.global_batch(self.batches, self.program.batch_sharding, step)


def prepare(cfg: Config, devices=None, workdir: str | pathlib.Path | None = None,
            check: bool = True) -> Runner:
  """Mesh, layout, program (optimizer, shardings, jitted step) and the runner `cfg`
  chooses, its targets checked (one line for one it cannot use) unless `check` is
  False. Reads and writes nothing; `workdir` names the NVMe store's directory."""
  devices = list(jax.devices() if devices is None else devices)
  if check and not cfg.model_factory:  # cuDNN where it cannot run fails at compile otherwise
    try:
      attention_lib.check_runs_on(cfg.model.attention, devices[0].platform, cfg.precision.compute)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  layout = Layout.from_config(cfg, mesh_lib.mesh_for(cfg.mesh, devices))
  program = engine_lib.TrainProgram(cfg, layout, adapters.model_for(cfg, layout.shard_size))
  return make_runner(program, workdir, check=check)


def build(cfg: Config, devices=None, workdir: str | pathlib.Path | None = None,
          progress: bool = True, runner: Runner | None = None) -> Run:
  """The run of `cfg`: its runner (`runner`, else :func:`prepare`'s) and its data.
  `workdir` holds the token cache of file data sources (unless data.cache_dir)."""
  runner = runner or prepare(cfg, devices, workdir)
  layout = runner.program.layout
  micro = mesh_lib.micro_batch(cfg.train, layout.data_parallel_size)
  progress = progress and jax.process_index() == 0
  data = pipeline.open_data(cfg, workdir, micro * layout.data_parallel_size, progress=progress)
  return Run(cfg, layout, runner, data.train, data.held_out, data.description,
             data.held_out_left_out)


@dataclasses.dataclass
class Outcome:
  """How a call to run_training ended."""
  history: list[dict]  # the metrics this call logged
  start_step: int  # 0, or the checkpoint step it resumed from
  step: int  # the step the state reached
  checkpoint: pathlib.Path | None  # where the state of `step` is saved; None: not saved
  stopped_by: str | None = None  # the signal that stopped it early, e.g. "SIGTERM"
  finished: bool = False  # the workdir was already at (or past) the step asked for


def train(cfg: Config, workdir: str | pathlib.Path, steps: int | None = None,
          devices=None, progress: bool = True) -> list[dict]:
  """Trains `cfg` up to step `steps` (default train.steps); returns the logged metrics."""
  return run_training(cfg, workdir, steps, devices, progress).history


def run_training(cfg: Config, workdir: str | pathlib.Path, steps: int | None = None,
                 devices=None, progress: bool = True, require_checkpoint: bool = False,
                 resume_step: int | None = None, force: bool = False) -> Outcome:
  """Resumes from the latest checkpoint in `workdir` (or `resume_step`, or starts
  afresh) and trains up to step `steps` (default train.steps).

  Before the state is created, checks that the run fits the devices' memory
  (jaxzero.planning.memory_check; `force` goes on anyway), prints the start-up banner and
  writes WORKDIR/config.json. Saves every `checkpoint.every` steps and at the
  end. SIGTERM or SIGINT during training stops it at the next step boundary,
  with that step saved; it then returns normally. A workdir already at `steps`
  (its checkpoint verified as for a resume) trains nothing (Outcome.finished).
  """
  workdir = pathlib.Path(workdir)
  # Before anything is built: a bad path or a second run costs one line, not a compile.
  workdir_lib.check_paths(cfg, workdir)
  tracking.check(cfg.log)
  runner = prepare(cfg, devices, workdir)  # its targets checked before anything is written
  with workdir_lib.hold(workdir):
    return _run_locked(cfg, workdir, steps, runner, progress, require_checkpoint, resume_step,
                       force)


def _run_locked(cfg: Config, workdir: pathlib.Path, steps: int | None, runner: Runner,
                progress: bool, require_checkpoint: bool, resume_step: int | None = None,
                force: bool = False) -> Outcome:
  """run_training's body, with the workdir checked and locked."""
  total = steps if steps is not None else cfg.train.steps
  checkpoints = runners_base.checkpointer(
      workdir, cfg.checkpoint.keep,
      checkpoint_lib.run_info(cfg.model, cfg.precision.compute, cfg.seed, cfg.model_factory,
                              _lora_record(cfg) or runner.program.model.lora,
                              pipeline.position_settings(cfg)))
  stop = StopSignals()
  run = None
  try:
    latest = checkpoints.latest_step()
    if require_checkpoint and latest is None:
      raise CheckpointError(
          f"--resume: there is no checkpoint to resume in {checkpoints.directory}")
    steps = checkpoints.all_steps()
    if resume_step is not None and resume_step not in steps:
      raise CheckpointError(f"--resume-step {resume_step}: no such checkpoint in "
                            f"{checkpoints.directory}; available steps: "
                            f"{', '.join(map(str, steps)) or 'none'}")
    if latest is not None:  # another model's checkpoint: said before tokenizing
      checkpoints.check_model_shape(latest if resume_step is None else resume_step)
    if cfg.init.hf_checkpoint and latest is None:
      # A mismatched preset fails before tokenizing or compiling. With a
      # checkpoint the run resumes from it and the HF weights are not read.
      hf_load.check_matches(cfg.model, cfg.init.hf_checkpoint)
      hf_load.check_tokenizer(cfg.data.tokenizer, cfg.init.hf_checkpoint)
    if cfg.lora.init_from and latest is None:  # likewise a mismatched adapter
      hf_peft.check_adapter(cfg.lora.init_from, cfg.model, _lora_record(cfg))
    if jax.process_index() == 0:
      for notice in config_lib.notices(cfg):
        log.warning("%s", notice)
    run = build(cfg, workdir=workdir, progress=progress, runner=runner)
    budget = memory_check.check(run.runner, run.devices, force)  # before any state exists
    if jax.process_index() == 0:
      print(banner.text(run, budget, workdir, total), flush=True)
    memory = memory_measure.FirstStepMemory(budget, run.devices)  # before the state exists
    peerwatch.phase("restore or init")
    state = _restore_or_init(run, checkpoints, resume_step)
    memory.state_created()
    start = int(state.step)
    if jax.process_index() == 0:  # once the restore succeeded: a refused run changes nothing
      banner.write_config(cfg, workdir)
    if resume_step is not None:
      _set_aside_later(checkpoints, start)
    drop_metrics_after(workdir / "metrics.jsonl", start)
    in_a_row = _nonfinite_in_a_row(workdir, start)
    history, saved = [], None
    with contextlib.ExitStack() as signals:
      if start < total:
        evaluator = (evaluation.Evaluator(run.program, run.eval_batches, state)
                     if run.eval_batches is not None and cfg.eval.every else None)
        compiled = _compile(run, state, start)
        tracker = tracking.start(cfg, workdir, banner.figures(run, budget))
        # From here to the last save, a first SIGTERM/SIGINT stops at a step boundary and
        # lets the save finish; a second acts at once.
        signals.enter_context(stop)
        state, history = _train_steps(run, compiled, state, start, total, workdir, checkpoints,
                                      stop, progress, evaluator, tracker, memory, in_a_row)
      step = int(state.step)
      # Every process decides alike: a stop agreed between them ends all at one step short
      # of `total` (only the signalled process has `stop.received`), and they save together.
      if cfg.checkpoint.at_end or step < total or start >= total:
        peerwatch.phase(f"save {step}")
        saved = run.runner.save(checkpoints, step, state, wait=True)
    peerwatch.phase("done")
  finally:
    checkpoints.close()  # waits for saves still in flight
    if run is not None:
      run.runner.close()  # what it keeps outside memory: the last checkpoint holds the state
  return Outcome(history, start, step, saved, stop.received, finished=start >= total)


def _restore_or_init(run: Run, checkpoints: checkpoint_lib.Checkpointer,
                     resume_step: int | None = None) -> engine_lib.TrainState:
  """The latest checkpoint that verifies (or checkpoint `resume_step`); else step
  0 from init.hf_checkpoint; else random weights.

  A checkpoint wins over init.hf_checkpoint, so that a fine-tune resumes
  where it stopped instead of starting over from the pretrained weights. A run
  that has checkpoints never starts from scratch: when none verifies, it stops.
  """
  steps = checkpoints.all_steps()
  if resume_step is not None:  # (one of `steps`: checked before the build)
    return _restore(run, checkpoints, resume_step)
  damaged_newer = []  # set aside only once an older checkpoint verifies
  for step in reversed(steps):
    try:
      state = _restore(run, checkpoints, step)
    except DamagedCheckpointError as damaged:
      older = [s for s in steps if s < step]
      if run.cfg.checkpoint.on_damaged == "refuse":
        raise DamagedCheckpointError(
            f"{damaged} (checkpoint.on_damaged=refuse; "
            + (f"--resume-step {older[-1]} resumes from the one before it)" if older else
               "there is no earlier checkpoint)")) from damaged
      if not older:
        raise DamagedCheckpointError(
            f"{damaged}; no checkpoint verifies (none was moved), and a run with checkpoints "
            "is not restarted from scratch: move the checkpoints directory away to start over"
        ) from damaged
      log.warning("%s; trying checkpoint %d", damaged, older[-1])
      damaged_newer.append(step)
      continue
    for newer in damaged_newer:
      log.warning("moved damaged checkpoint %d to %s", newer, checkpoints.set_aside(newer))
    if damaged_newer:
      log.warning("resuming from checkpoint %d, the newest that verifies", step)
    return state
  cfg, sh = run.cfg, run.program.shardings
  path = cfg.init.hf_checkpoint
  if cfg.lora.rank:  # LoRA: the Hugging Face weights are the frozen base
    frozen = adapters = None
    if path:
      log.info("starting from the Hugging Face weights in %s", path)
      frozen = _load_base(run, path)
    if cfg.lora.init_from:
      log.info("starting the adapters from the PEFT adapter in %s", cfg.lora.init_from)
      adapters = hf_peft.read_adapter(cfg.lora.init_from, cfg.model, _lora_record(cfg))
      # Stored as the run stores them: padded where no dimension divides the devices.
      adapters = jax.device_put(run.program.padding.pad(adapters), sh.master)
    return run.runner.init(master=adapters, frozen=frozen)
  if path:
    log.info("starting from the Hugging Face weights in %s", path)
    return run.runner.init(master=hf_load.load_params(path, cfg.model, sh.master))
  return run.runner.init()


def _load_base(run: Run, path: str):
  """A LoRA run's frozen base from Hugging Face weights, placed by the ``frozen`` role;
  a quantized base (lora.base_dtype nf4, int8) is quantized leaf by leaf as it is read,
  so the compute-dtype copy of one leaf at most exists at a time."""
  cfg, layout, sh = run.cfg, run.layout, run.program.shardings
  kind = cfg.lora.base_dtype if cfg.lora.base_dtype in ("nf4", "int8") else None
  specs = param_specs(cfg.model)
  placed = layout.tree_shardings(specs, "frozen")  # each leaf as read, before quantizing
  if kind:  # quantized on the device, then stored where the frozen role rests
    placed = on_device(placed)

  def store(leaf_path, leaf):
    target = sh.frozen
    for key in leaf_path:
      target = target[key]
    # The leaf read is dropped once quantized (donated where the result shares its memory).
    same_memory = jax.tree.leaves(target)[0].memory_kind == leaf.sharding.memory_kind
    return jax.jit(lambda w: lora_lib.store_leaf(leaf_path, w, kind), out_shardings=target,
                   donate_argnums=0 if same_memory else ())(leaf)
  return hf_load.load_params(path, cfg.model, placed,
                             dtype=engine_lib.dtype_of(cfg.precision.compute),
                             each=store if kind else None)


def _lora_record(cfg: Config) -> dict | None:
  """What checkpoints record of the run's LoRA (jaxzero.models.lora.run_record)."""
  return lora_lib.run_record(cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets,
                             banner.recorded_path(cfg.init.hf_checkpoint),  # read elsewhere
                             cfg.lora.base_dtype, cfg.lora.dropout)


def _restore(run: Run, checkpoints: checkpoint_lib.Checkpointer,
             step: int) -> engine_lib.TrainState:
  state = resume.restore(run.runner, checkpoints, step)  # in any precision; verified
  log.info("resumed from step %d (%s)", step, checkpoints.step_dir(step))
  return state


def _nonfinite_in_a_row(workdir: pathlib.Path, start: int) -> int:
  """The non-finite steps in a row that end steps 1..`start`, as metrics.jsonl (process
  0's) records them, agreed by every process."""
  in_a_row = nonfinite_streak(workdir / "metrics.jsonl", start) if jax.process_index() == 0 else 0
  if jax.process_count() > 1:
    in_a_row = int(multihost_utils.broadcast_one_to_all(np.int32(in_a_row)))
  return in_a_row


def _set_aside_later(checkpoints: checkpoint_lib.Checkpointer, start: int) -> None:
  """After --resume-step: checkpoints past it belong to the abandoned history;
  moved aside (nothing is deleted) so that the run saves those steps anew."""
  for later in [s for s in checkpoints.all_steps() if s > start]:
    log.warning("--resume-step %d: moved checkpoint %d to %s", start, later,
                checkpoints.set_aside(later))


def _compile(run: Run, state, start: int):
  peerwatch.phase("compile")
  t0 = time.perf_counter()
  compiled = run.runner.compile(state, run.batch(start))
  log.info("compiled the train step in %.1f s", time.perf_counter() - t0)
  # Hosts compile at different speeds; gloo (CPU) allows only 30 s between the
  # first and the last process reaching the first collective. The barrier goes
  # through the coordination service (processes named), not a device collective.
  multihost.sync_global_processes("jaxzero:train step compiled", timeout=COMPILE_WAIT_S,
                                  processes=set(range(jax.process_count())))
  return compiled


def _train_steps(run: Run, compiled, state, start: int, total: int, workdir: pathlib.Path,
                 checkpoints: checkpoint_lib.Checkpointer, stop: StopSignals, progress: bool,
                 evaluator: evaluation.Evaluator | None = None, tracker=None,
                 memory: memory_measure.FirstStepMemory | None = None, in_a_row: int = 0):
  """Steps `start`..`total` (or until a stop signal); returns (state, logged metrics).

  Evaluates the held-out split before the first step, every eval.every steps
  and at `total`; traces the steps profile.steps names; after the first step,
  compares the memory the run uses with what the check predicted. `in_a_row` non-finite
  steps ended the trained part (a resumed run's streak goes on).
  """
  cfg = run.cfg
  logger = MetricsLogger(workdir, total_steps=total, start=start, progress=progress,
                         tracker=tracker)
  profiler = profiling.StepProfiler(cfg.profile.window, workdir, first=start + 1, last=total)
  _say(profiler.note)
  metrics = PendingMetrics(logger, cfg.train.global_batch * cfg.train.seq_len,
                           model_flops_per_token(cfg, run.program.n_params, run.program.n_frozen),
                           run.devices,
                           returns_when_done=run.runner.device_program == "gradients")
  guard = NonFiniteGuard(cfg.train.nonfinite, cfg.train.max_nonfinite, checkpoints, in_a_row)
  done = start
  try:
    if evaluator is not None and start == 0:
      logger.log_initial_eval(evaluator(run.runner.current(state)))
      metrics.restart_clock()
    for step in range(start, total):
      peerwatch.phase(f"step {step + 1}")
      with profiler.step(step + 1, state):
        state, step_metrics = compiled(state, run.batch(step))
        metrics.add(step_metrics)
      done = step + 1
      _say(profiler.after(done, state))
      if memory is not None and step == start:
        line, fields = memory.measure(state, done)
        metrics.annotate(done, fields)
        _say(line)
      evaluate = evaluator is not None and (done % cfg.eval.every == 0 or done == total)
      saving = bool(cfg.checkpoint.every) and done % cfg.checkpoint.every == 0 and done < total
      # A saved step is logged first: its records are on disk with it, and the non-finite
      # guard has seen it (train.nonfinite=stop saves nothing past a bad step).
      logged = done % cfg.train.log_every == 0 or done == total or evaluate or saving
      if logged:
        if evaluate:
          peerwatch.phase(f"eval {done}")
        guard.check(metrics.log(  # (evaluated as saved: DPU's update in flight applied)
            done, (lambda: evaluator(run.runner.current(state))) if evaluate else None))
        checkpoints.check_saves()  # a save that failed in the background, said now
      if stop.agreed(at_sync_point=logged):
        break
      if saving:
        peerwatch.phase(f"save {done}")
        run.runner.save(checkpoints, done, state)  # asynchronous: training goes on meanwhile
        # Its blocking part (the copy off the devices) is not the next step's time.
        metrics.restart_clock()
    guard.check(metrics.log(done))
  finally:
    profiler.close()
    logger.close()
  return state, logger.history


def _say(line: str | None) -> None:
  """A line for the person watching the run, from process 0 only."""
  if line and jax.process_index() == 0:
    print(line, flush=True)


class NonFiniteGuard:
  """Acts on steps whose loss or gradient norm was not finite.

  The step itself never applies such an update (jaxzero.engine.step), so the state and
  every checkpoint stay finite; this decides whether training goes on.
  """

  def __init__(self, mode: str, max_in_a_row: int, checkpoints: checkpoint_lib.Checkpointer,
               in_a_row: int = 0):
    self.mode, self.max_in_a_row, self.checkpoints = mode, max_in_a_row, checkpoints
    self.in_a_row = in_a_row

  def check(self, records: list[dict]) -> None:
    """Raises NonFiniteError when train.nonfinite says to stop."""
    for r in records:
      if not r.get("nonfinite"):
        self.in_a_row = 0
        continue
      self.in_a_row += 1
      what = f"step {r['step']}: loss {r['loss']}, gradient norm {r['grad_norm']}"
      if self.mode == "skip" and self.in_a_row < self.max_in_a_row:
        log.warning("%s: update skipped (%d in a row; the run stops at "
                    "train.max_nonfinite=%d)", what, self.in_a_row, self.max_in_a_row)
        continue
      self.checkpoints.wait()  # a save in flight is finite too: name it once written
      latest = self.checkpoints.latest_step()
      last_good = (f"the last checkpoint is step {latest} in {self.checkpoints.directory}"
                   if latest is not None else "there is no checkpoint yet")
      why = ("train.nonfinite=stop; set train.nonfinite=skip to skip such steps"
             if self.mode == "stop" else
             f"{self.in_a_row} in a row reached train.max_nonfinite={self.max_in_a_row}")
      raise NonFiniteError(f"{what}: the update was not applied and training stopped "
                           f"({why}); {last_good} (a lower train.lr may help)")
