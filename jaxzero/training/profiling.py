"""A jax.profiler trace of the steps ``profile.steps=START:END`` asks for, in WORKDIR/profile.

Each step is annotated (``train_step``, with its number), so the trace shows the
steps on the host's timeline beside XLA's own events. The trace opens in
TensorBoard's profile plugin and in Perfetto (its ``perfetto_trace.json.gz``).
"""

from __future__ import annotations

import contextlib
import pathlib

import jax

PROFILE_DIR = "profile"


class StepProfiler:
  """Starts the trace before step START and stops it once step END has run.

  The window is cut to the steps this run trains, `first`..`last` (a resumed run, a
  --steps short of END); `note` says so, or that none of them is in it.
  """

  def __init__(self, window: tuple[int, int] | None, workdir: pathlib.Path,
               first: int = 1, last: int | None = None):
    self.window, self.directory, self.note = None, workdir / PROFILE_DIR, None
    self._on = False
    if window:
      asked = f"profile.steps={window[0]}:{window[1]}"
      start, end = max(window[0], first), min(window[1], window[1] if last is None else last)
      if start > end:
        self.note = (f"{asked}: this run trains steps {first}-{last}, none of them; "
                     "nothing is traced")
      else:
        self.window = (start, end)
        if (start, end) != tuple(window):
          self.note = f"{asked}: this run trains steps {first}-{last}; tracing {start}-{end}"

  def step(self, step: int, state) -> contextlib.AbstractContextManager:
    """The context one step (1-based `step`) runs in; `state` is waited for at the end."""
    if self.window and step == self.window[0] and not self._on:
      jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
      self._on = True
    return jax.profiler.StepTraceAnnotation("train_step", step_num=step)

  def after(self, step: int, state) -> str | None:
    """After step `step` was dispatched: stops the trace at END; returns a line saying where."""
    if not self._on or step < self.window[1]:
      return None
    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    self._on = False
    start, end = self.window
    return (f"profile of steps {start}-{end} in {self.directory}: tensorboard --logdir "
            f"{self.directory} (profile tab: pip install tensorboard-plugin-profile), or "
            "open its perfetto_trace.json.gz in https://ui.perfetto.dev")

  def close(self) -> None:
    if self._on:  # the run stopped inside the window
      jax.profiler.stop_trace()
      self._on = False
