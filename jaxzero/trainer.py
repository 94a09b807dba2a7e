"""The training loop: build mesh, layout and state, resume, run steps, log, save.

Restarting with the same workdir continues from the latest complete checkpoint,
on any mesh and stage. metrics.jsonl is appended to; records past the step a
run resumes from (logged by a run that was killed before saving them) are
dropped first, so each step appears once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import signal
import threading
import time
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxzero import checkpoint as checkpoint_lib
from jaxzero import config as config_lib
from jaxzero import distributed
from jaxzero import data as data_lib
from jaxzero import hf
from jaxzero import step as step_lib
from jaxzero.config import Config
from jaxzero.mesh import make_mesh
from jaxzero.metrics import MetricsLogger
from jaxzero.zero import Layout

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
  """Everything a training run builds from its config, before any step."""
  cfg: Config
  layout: Layout
  tx: object
  batches: data_lib.Batches
  step_fn: Callable


def build(cfg: Config, devices=None, workdir: str | pathlib.Path | None = None,
          progress: bool = True) -> Run:
  """Mesh, layout, optimizer, data and the jitted step for `cfg` (no state yet).

  `workdir` holds the token cache of file data sources (unless data.cache_dir).
  """
  devices = list(jax.devices() if devices is None else devices)
  replica, fsdp = config_lib.mesh_shape(cfg, len(devices))
  stage, hybrid = cfg.zero.resolved
  if hybrid and replica == 1:
    log.warning("hybrid sharding with mesh.replica=1 is plain stage %d", stage)
  layout = Layout(make_mesh(replica, fsdp, devices), stage, hybrid,
                  params_memory=cfg.offload.params, optimizer_memory=cfg.offload.optimizer)
  micro = config_lib.micro_batch(cfg, layout.data_parallel_size)
  source = data_lib.open_tokens(cfg.data, workdir, model_vocab_size=cfg.model.vocab_size,
                                progress=progress and jax.process_index() == 0)
  batches = data_lib.Batches(source.tokens, cfg.train.seq_len, cfg.train.grad_accum,
                             micro * layout.data_parallel_size, cfg.seed, order=source.order)
  tx = step_lib.make_optimizer(cfg)
  return Run(cfg, layout, tx, batches, step_lib.make_train_step(cfg, layout, tx))


def global_batch(run: Run, step: int) -> jax.Array:
  """The batch of `step` as one global array; each process supplies only its rows."""
  sharding = run.layout.batch_sharding(leading_dims=1)
  shape = run.batches.shape
  index_map = sharding.addressable_devices_indices_map(shape)
  starts = [idx[1].start or 0 for idx in index_map.values()]
  stops = [idx[1].stop or shape[1] for idx in index_map.values()]
  local = run.batches(step, slice(min(starts), max(stops)))
  return jax.make_array_from_process_local_data(sharding, local, shape)


@dataclasses.dataclass
class Outcome:
  """How a call to run_training ended."""
  history: list[dict]  # the metrics this call logged
  start_step: int  # 0, or the checkpoint step it resumed from
  step: int  # the step the state reached
  checkpoint: pathlib.Path  # where the state of `step` is saved
  stopped_by: str | None = None  # the signal that stopped it early, e.g. "SIGTERM"


def train(cfg: Config, workdir: str | pathlib.Path, steps: int | None = None,
          devices=None, progress: bool = True) -> list[dict]:
  """Trains `cfg` up to step `steps` (default train.steps); returns the logged metrics."""
  return run_training(cfg, workdir, steps, devices, progress).history


def run_training(cfg: Config, workdir: str | pathlib.Path, steps: int | None = None,
                 devices=None, progress: bool = True, require_checkpoint: bool = False
                 ) -> Outcome:
  """Resumes from the latest checkpoint in `workdir` (or starts afresh) and
  trains up to step `steps` (default train.steps).

  Saves every `checkpoint.every` steps and at the end. SIGTERM or SIGINT during
  training stops it at the next step boundary, with that step saved; it then
  returns normally.
  """
  workdir = pathlib.Path(workdir)
  total = steps if steps is not None else cfg.train.steps
  checkpoints = checkpoint_lib.Checkpointer(workdir, cfg)
  stop = _StopSignals()
  try:
    if require_checkpoint and checkpoints.latest_step() is None:
      raise checkpoint_lib.CheckpointError(
          f"--resume: there is no checkpoint to resume in {checkpoints.directory}")
    if cfg.model.hf_checkpoint and checkpoints.latest_step() is None:
      # A mismatched preset fails before tokenizing or compiling. With a
      # checkpoint the run resumes from it and the HF weights are not read.
      hf.check_matches(cfg.model, cfg.model.hf_checkpoint)
    run = build(cfg, devices, workdir, progress)
    state = _restore_or_init(run, checkpoints)
    start = int(state.step)
    _drop_metrics_after(workdir / "metrics.jsonl", start)
    history = []
    if start < total:
      compiled = _compile(run, state, start)
      with stop:
        state, history = _train_steps(run, compiled, state, start, total, workdir, checkpoints,
                                      stop, progress)
    step = int(state.step)
    saved = checkpoints.save(step, state, wait=True)
  finally:
    checkpoints.close()  # waits for saves still in flight
  return Outcome(history, start, step, saved, stop.received)


def _restore_or_init(run: Run, checkpoints: checkpoint_lib.Checkpointer) -> step_lib.TrainState:
  """The latest checkpoint; else step 0 from model.hf_checkpoint; else random weights.

  A checkpoint wins over model.hf_checkpoint, so that a fine-tune resumes
  where it stopped instead of starting over from the pretrained weights.
  """
  step = checkpoints.latest_step()
  if step is not None:
    shardings = step_lib.state_shardings(run.cfg, run.layout, run.tx)
    state = checkpoints.restore(step, shardings.abstract, shardings.state)
    log.info("resumed from step %d (%s)", step, checkpoints.step_dir(step))
    return state
  if run.cfg.model.hf_checkpoint:
    log.info("starting from the Hugging Face weights in %s", run.cfg.model.hf_checkpoint)
    return hf.init_state(run.cfg, run.layout, run.tx)
  return step_lib.init_state(run.cfg, run.layout, run.tx)


def _compile(run: Run, state, start: int):
  t0 = time.perf_counter()
  compiled = run.step_fn.lower(state, global_batch(run, start)).compile()
  log.info("compiled the train step in %.1f s", time.perf_counter() - t0)
  # Hosts compile at different speeds; gloo (CPU) allows only 30 s between the
  # first and the last process reaching the first collective.
  distributed.wait_for_all("train step compiled")
  return compiled


def _train_steps(run: Run, compiled, state, start: int, total: int, workdir: pathlib.Path,
                 checkpoints: checkpoint_lib.Checkpointer, stop: "_StopSignals", progress: bool):
  """Steps `start`..`total` (or until a stop signal); returns (state, logged metrics)."""
  cfg = run.cfg
  logger = MetricsLogger(workdir, total_steps=total, start=start, enabled=progress)
  metrics = _PendingMetrics(logger, cfg.train.global_batch * cfg.train.seq_len)
  done = start
  for step in range(start, total):
    state, step_metrics = compiled(state, global_batch(run, step))
    metrics.add(step_metrics)
    done = step + 1
    logged = done % cfg.train.log_every == 0 or done == total
    if logged:
      metrics.log(done)
    if stop.agreed(at_sync_point=logged):
      break
    if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < total:
      checkpoints.save(done, state)  # asynchronous: training goes on while it is written
  metrics.log(done)
  logger.close()
  return state, logger.history


class _PendingMetrics:
  """Step metrics held on device until the next logged step: fetching them is
  the loop's only host sync."""

  def __init__(self, logger: MetricsLogger, tokens_per_step: int):
    self._logger = logger
    self._tokens_per_step = tokens_per_step
    self._pending = []
    self._last_time = time.perf_counter()

  def add(self, metrics) -> None:
    self._pending.append(metrics)

  def log(self, done: int) -> None:
    """Logs the pending steps, the last of which is step `done`."""
    if not self._pending:
      return
    fetched = jax.device_get(self._pending)
    now = time.perf_counter()
    step_time = (now - self._last_time) / len(fetched)
    self._last_time = now
    for offset, m in enumerate(fetched):
      self._logger.log({"step": done - len(fetched) + 1 + offset,
                        **{k: float(np.asarray(v)) for k, v in m.items()},
                        "tokens_per_sec": self._tokens_per_step / step_time,
                        "step_time_s": step_time})
    self._pending = []


def _drop_metrics_after(path: pathlib.Path, step: int) -> None:
  """Keeps metrics.jsonl a record of the steps the state was trained through.

  A run that ends without saving its last steps (killed, or crashed) has logged
  metrics that the resumed run logs again; those records are dropped, as is a
  line a kill cut short, so each step appears once. The file is rewritten only
  when something is dropped, and only after the restore succeeded.
  """
  if jax.process_index() != 0 or not path.exists():
    return
  lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
  kept = [line if line.endswith("\n") else line + "\n"
          for line in lines if _logged_step(line) <= step]
  if kept == lines:
    return
  partial = path.with_name(path.name + ".partial")
  partial.write_text("".join(kept), encoding="utf-8")
  partial.replace(path)
  log.info("dropped %d metrics records past step %d from %s", len(lines) - len(kept), step, path)


def _logged_step(line: str) -> float:
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return math.inf


class _StopSignals:
  """Turns SIGTERM and SIGINT into a request to stop at the next step boundary.

  A preempted job gets SIGTERM and a grace period before SIGKILL: stopping at a
  step boundary lets it save the current step in that time. The first signal
  also puts the previous handlers back, so a second one acts at once (Ctrl-C
  twice interrupts even a save).
  """
  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._previous: dict = {}

  def __enter__(self):
    # Python only lets the main thread install handlers; elsewhere, signals act as before.
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    self._restore()

  def agreed(self, at_sync_point: bool) -> bool:
    """Whether every process stops after the current step.

    Alone, a process stops at once. Processes must stop at the same step (the
    save is collective), and a preemption signal reaches them at different
    moments: so they compare flags at logged steps, where the loop syncs with
    the host anyway, and stop together if any of them was signalled.
    """
    if jax.process_count() == 1:
      return self.received is not None
    if not at_sync_point:
      return False
    flags = multihost_utils.process_allgather(np.int32(self.received is not None))
    return bool(np.any(flags))

  def _handle(self, signum, _frame):
    self.received = signal.Signals(signum).name
    log.warning("%s: stopping at the next step boundary (send it again to stop at once)",
                self.received)
    self._restore()

  def _restore(self):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}
