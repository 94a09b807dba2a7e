"""Metrics: ``metrics.jsonl`` in the workdir and a progress bar, from process 0 only."""

from __future__ import annotations

import json
import pathlib

import jax
from tqdm import tqdm


class MetricsLogger:
  """Appends one JSON object per logged step and drives a tqdm progress bar."""

  def __init__(self, workdir: pathlib.Path, total_steps: int, start: int = 0,
               enabled: bool = True):
    self.history: list[dict] = []
    self.is_main = jax.process_index() == 0
    self._file = None
    self._bar = None
    if self.is_main:
      workdir.mkdir(parents=True, exist_ok=True)
      self._file = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
      self._bar = tqdm(total=total_steps, initial=start, unit="step", disable=not enabled,
                       dynamic_ncols=True)

  def log(self, record: dict) -> None:
    self.history.append(record)
    if not self.is_main:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    self._bar.set_postfix(loss=f"{record['loss']:.4f}",
                          tok_s=f"{record['tokens_per_sec']:,.0f}", refresh=False)
    self._bar.update(record["step"] - self._bar.n)

  def close(self) -> None:
    if self.is_main:
      self._bar.close()
      self._file.close()
