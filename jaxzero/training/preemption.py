"""Preemption: SIGTERM and SIGINT become a stop at the next step boundary, agreed
by every process so that they all save the same step."""

from __future__ import annotations

import logging
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


class StopSignals:
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
