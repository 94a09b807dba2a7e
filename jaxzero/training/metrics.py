"""Metrics: ``metrics.jsonl``, TensorBoard events and the screen, from process 0 only.

Every step gets a record with its own loss, gradient norm, learning rate and
timing. The loop never waits on the step it just dispatched: it waits on the
one before (the device always has the next step queued), and a step's time is
from the moment the previous step's result was ready to the moment its own
was. Records reach the file, TensorBoard and the screen at logged steps
(``train.log_every``, evaluations, the end), where the loop syncs with the host
anyway. On a terminal the screen shows a progress bar; otherwise (a cluster
log, a pipe, ``--no-progress``) one plain line per logged step.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxzero.runtime.memory import memory_in_use
from jaxzero.training import throughput

log = logging.getLogger(__name__)

TB_DIR = "tb"
# Records a resumed run dropped from metrics.jsonl (drop_metrics_after).
DROPPED_FILE = "metrics.dropped.jsonl"
# metrics.jsonl field -> TensorBoard tag.
TB_TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "tokens_per_sec": "perf/tokens_per_sec", "step_time_s": "perf/step_time_s",
           "tflops": "perf/model_tflops", "mfu": "perf/mfu",
           "device_memory_bytes": "memory/device_bytes_in_use",
           "host_rss_bytes": "memory/host_rss_bytes",
           "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity",
           "loss_scale": "train/loss_scale", "skipped_steps": "train/skipped_steps"}


def use_progress_bar(progress: bool) -> bool:
  """A bar only when asked for and both streams are terminals; else plain lines."""
  return progress and sys.stdout.isatty() and sys.stderr.isatty()


def _summary_writer() -> type:
  """tensorboardX's SummaryWriter, imported without torch where neither is loaded
  yet: tensorboardX imports torch when it can, only to accept torch tensors
  (jaxzero logs floats), and that import costs over a second at every start on
  a machine with torch installed. Called once, at start-up: a thread importing
  torch at that very moment would find it missing."""
  # pylint: disable=import-outside-toplevel
  if "torch" in sys.modules or "tensorboardX" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
  try:
    from tensorboardX import SummaryWriter
  finally:
    if "torch" in sys.modules and sys.modules["torch"] is None:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsLogger:
  """Writes records to metrics.jsonl and TensorBoard, and shows logged steps."""

  def __init__(self, workdir: pathlib.Path, total_steps: int, start: int = 0,
               progress: bool = True, tensorboard: bool = True, tracker=None):
    """`tracker`: a jaxzero.training.tracking.WandbRun that gets the same scalars."""
    self.history: list[dict] = []
    self._tracker = tracker
    self.is_main = jax.process_index() == 0
    self.total_steps = total_steps
    self._file = self._bar = self._tb = None
    if not self.is_main:
      return
    workdir.mkdir(parents=True, exist_ok=True)
    self._file = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
    if use_progress_bar(progress):
      self._bar = tqdm(total=total_steps, initial=start, unit="step", dynamic_ncols=True)
    if tensorboard:
      SummaryWriter = _summary_writer()  # pylint: disable=invalid-name
      # purge_step: TensorBoard hides the events of steps after the one this run resumes
      # from (the run logs them again from start + 1; step `start` itself stays). A run
      # from step 0 logs step 0's eval again: an earlier attempt's events all go.
      # flush_secs: tensorboardX writes events from its own thread, and flushes them at
      # most this long after; a killed run loses no more than that of them.
      self._tb = SummaryWriter(str(workdir / TB_DIR), purge_step=start + 1 if start else 0,
                               flush_secs=1)

  def log(self, records: list[dict]) -> None:
    """Writes `records` (consecutive steps) and shows the last, a logged step."""
    self.history.extend(records)
    if not self.is_main or not records:
      return
    for record in records:
      self._file.write(json_line(record) + "\n")
      # (Not an overflowing fp16 step's infinite norm: metrics.jsonl has it.)
      scalars = {tag: record[key] for key, tag in TB_TAGS.items()
                 if record.get(key) is not None and math.isfinite(record[key])}
      if self._tb is not None:
        for tag, value in scalars.items():
          self._tb.add_scalar(tag, value, record["step"])
      if self._tracker is not None:
        self._tracker.log(scalars, record["step"])
    self._file.flush()
    last = records[-1]
    if self._bar is None:
      print(format_line(last, self.total_steps), flush=True)
      return
    postfix = {"loss": f"{last['loss']:.4f}", "tok_s": f"{last['tokens_per_sec']:,.0f}"}
    if last.get("mfu") is not None:
      postfix["mfu"] = f"{last['mfu']:.1%}"
    if last.get("eval_loss") is not None:
      postfix["eval"] = f"{last['eval_loss']:.4f}"
    self._bar.set_postfix(postfix, refresh=False)
    self._bar.update(last["step"] - self._bar.n)

  def log_initial_eval(self, result: dict) -> None:
    """The held-out loss before the first step: TensorBoard's step 0 and one line
    (metrics.jsonl holds trained steps only)."""
    if not self.is_main:
      return
    if self._tb is not None:
      for key in ("eval_loss", "eval_perplexity"):
        self._tb.add_scalar(TB_TAGS[key], result[key], 0)
    if self._tracker is not None:
      self._tracker.log({TB_TAGS[k]: result[k] for k in ("eval_loss", "eval_perplexity")}, 0)
    line = (f"step 0/{self.total_steps} | eval loss {result['eval_loss']:.4f} "
            f"(ppl {result['eval_perplexity']:.2f})")
    if self._bar is None:
      print(line, flush=True)
    else:
      self._bar.write(line)

  def close(self) -> None:
    if self.is_main:
      if self._bar is not None:
        self._bar.close()
      if self._tb is not None:
        self._tb.close()
      if self._tracker is not None:
        self._tracker.close()
      self._file.close()


def format_line(r: dict, total_steps: int) -> str:
  """One plain log line for a record, e.g. for a cluster's log file."""
  width = len(str(total_steps))
  parts = [f"step {r['step']:>{width}}/{total_steps}", f"loss {r['loss']:.4f}",
           f"grad norm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}",
           f"{r['tokens_per_sec']:,.0f} tok/s", f"{r['step_time_s']:.3f} s/step",
           f"{r['tflops']:.3g} TFLOP/s"]
  if r.get("mfu") is not None:
    parts.append(f"MFU {r['mfu']:.1%}")
  if r.get("device_memory_bytes") is not None:
    parts.append(f"device mem {r['device_memory_bytes'] / 1e9:.2f} GB")
  elif r.get("host_rss_bytes") is not None:
    parts.append(f"host mem {r['host_rss_bytes'] / 1e9:.2f} GB")
  if r.get("eval_loss") is not None:
    parts.append(f"eval loss {r['eval_loss']:.4f} (ppl {r['eval_perplexity']:.2f})")
  if r.get("loss_scale") is not None:
    parts.append(f"loss scale {r['loss_scale']:g} ({r['skipped_steps']:.0f} skipped)")
  if r.get("nonfinite"):
    parts.append("NON-FINITE: update skipped")
  return " | ".join(parts)


class PendingMetrics:
  """Step metrics held on device until the next logged step, each step timed.

  `add` waits for the step before the one just dispatched, so the device
  always has work queued and the wait costs nothing; the time it returns is
  that step's end. With `returns_when_done` (a runner whose update runs outside the
  device program, on the host or from files, and is finished when the step returns)
  each step ends when it returns.
  """

  def __init__(self, logger: MetricsLogger, tokens_per_step: int, flops_per_token: float,
               devices, returns_when_done: bool = False):
    self._logger = logger
    self._tokens_per_step = tokens_per_step
    self._flops_per_step = flops_per_token * tokens_per_step
    peak = throughput.device_peak_tflops(devices[0])
    self._peak_flops = peak * 1e12 * len(devices) if peak else None
    self._local_devices = [d for d in devices if d.process_index == jax.process_index()]
    self._returns_when_done = returns_when_done
    self._pending: list = []
    self._ends: list[float] = []
    self._extra: dict[int, dict] = {}
    self.restart_clock()

  def annotate(self, step: int, fields: dict) -> None:
    """Fields that join step `step`'s record when it is logged."""
    self._extra.setdefault(step, {}).update(fields)

  def restart_clock(self) -> None:
    """The next step's time counts from now (after compiling, evaluating, saving)."""
    self._last_end = time.perf_counter()

  def add(self, metrics) -> None:
    self._pending.append(metrics)
    if self._returns_when_done:
      self._ends.append(time.perf_counter())
    elif len(self._pending) >= 2:
      jax.block_until_ready(self._pending[-2])
      self._ends.append(time.perf_counter())

  def log(self, done: int, evaluate=None) -> list[dict]:
    """Logs the pending steps, the last of which is step `done`; returns their records.

    `evaluate()`, when given, runs after step `done` and its fields join that
    step's record (its time is not any step's).
    """
    if not self._pending:
      return []
    fetched = jax.device_get(self._pending)
    if len(self._ends) < len(self._pending):
      self._ends.append(time.perf_counter())
    extra = evaluate() if evaluate is not None else {}
    records = []
    previous = self._last_end
    for offset, (m, end) in enumerate(zip(fetched, self._ends)):
      step_time = max(end - previous, 1e-9)
      previous = end
      record = {"step": done - len(fetched) + 1 + offset,
                **{k: float(np.asarray(v)) for k, v in m.items()},
                "step_time_s": step_time,
                "tokens_per_sec": self._tokens_per_step / step_time,
                "tflops": self._flops_per_step / step_time / 1e12}
      if self._peak_flops:
        record["mfu"] = self._flops_per_step / step_time / self._peak_flops
      record.update(self._extra.pop(record["step"], {}))
      records.append(record)
    memory = memory_in_use(self._local_devices)
    if memory is not None:
      records[-1][memory[0]] = memory[1]
    records[-1].update(extra)
    self._pending, self._ends = [], []
    self._last_end = previous
    if extra:
      self.restart_clock()
    self._logger.log(records)
    return records


def drop_metrics_after(path: pathlib.Path, step: int) -> None:
  """Keeps metrics.jsonl a record of the steps the state was trained through.

  A run that ends without saving its last steps (killed, or crashed) has logged
  metrics that the resumed run logs again; those records are dropped, as is a
  line a kill cut short, so each step appears once. The file is rewritten only
  when something is dropped, and only after the restore succeeded. What is dropped
  is appended to metrics.dropped.jsonl (a --resume-step's abandoned history included):
  nothing a run logged is lost.
  """
  if jax.process_index() != 0 or not path.exists():
    return
  lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
  kept = [line if line.endswith("\n") else line + "\n"
          for line in lines if _logged_step(line) <= step]
  if kept == lines:
    return
  dropped = [line for line in lines if step < _logged_step(line) < math.inf]  # (not a cut line)
  with open(path.with_name(DROPPED_FILE), "a", encoding="utf-8") as kept_aside:
    kept_aside.writelines(dropped)
  partial = path.with_name(path.name + ".partial")
  partial.write_text("".join(kept), encoding="utf-8")
  partial.replace(path)
  log.info("dropped %d metrics records past step %d from %s (kept in %s)",
           len(lines) - len(kept), step, path, DROPPED_FILE)


def nonfinite_streak(path: pathlib.Path, step: int) -> int:
  """How many steps up to `step` in a row metrics.jsonl records as not finite: the
  non-finite guard's count, which a resumed run carries on (train.max_nonfinite)."""
  if not path.exists():
    return 0
  streak = 0
  for line in path.read_text(encoding="utf-8").splitlines():
    if _logged_step(line) <= step:
      streak = streak + 1 if json.loads(line).get("nonfinite") else 0
  return streak


def _logged_step(line: str) -> float:
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return math.inf


def json_line(record: dict) -> str:
  """`record` as one line of JSON: a non-finite float (an overflowing fp16 step's norm, a
  diverged loss) is null, as JSON has no NaN or Infinity (the record's `nonfinite` says
  which step it was)."""
  return json.dumps({key: None if isinstance(value, float) and not math.isfinite(value)
                     else value for key, value in record.items()}, allow_nan=False)
