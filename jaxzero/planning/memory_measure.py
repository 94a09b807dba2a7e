"""The memory plan against the first step: what the start-up check predicted per
device (jaxzero.planning.memory_check) beside what the run then used.

On a GPU the measure is the device's own: bytes in use once the state exists,
and ``memory_stats()``'s peak after the run's first step. On a CPU it is the process's
resident memory: its growth from before the state was created, over this process's
devices, with the step's peak taken from the process's peak RSS (which also
holds XLA's compilation), and labelled so.
"""

from __future__ import annotations

import logging
import resource

import jax

from jaxzero.planning.memory_check import Budget
from jaxzero.runtime.memory import memory_in_use
from jaxzero.utils.formatting import format_bytes

log = logging.getLogger(__name__)

WARN_RATIO = 1.15  # measured over predicted past which the line becomes a warning
# On a CPU the process's fixed memory (XLA's compiler, thread pools, the runtime:
# tens of MB) outweighs a small run's state: below this excess, no warning.
CPU_WARN_EXCESS_BYTES = 512 << 20


class FirstStepMemory:
  """Readings before the state exists, once it does, and after the first step."""

  def __init__(self, budget: Budget, devices):
    self.budget = budget
    self._local = [d for d in devices if d.process_index == jax.process_index()]
    self._device = self._local[0].platform != "cpu" and _device_in_use(self._local) is not None
    self._before = 0 if self._device else _rss()
    self._state = None

  def state_created(self) -> None:
    self._state = _device_in_use(self._local) if self._device else _rss() - self._before

  def measure(self, state, step: int = 1) -> tuple[str, dict]:
    """After the run's first step, `step` (a resumed run's is past 1): (the line to print,
    the figures for that step's metrics record)."""
    jax.block_until_ready(state)
    b = self.budget
    predicted_state = b.state - b.disk - (0 if b.platform == "cpu" else b.host)
    if self._device:
      state_bytes = self._state or 0
      peak = max(d.memory_stats().get("peak_bytes_in_use", 0) for d in self._local)
      how = "device peak (memory_stats)"
    else:
      n = len(self._local)
      state_bytes = (self._state or 0) // n
      peak = (_peak_rss() - self._before) // n
      how = f"CPU: this process's RSS growth over its {n} devices, compile included"
    fields = {"predicted_state_bytes": predicted_state,
              "predicted_activation_bytes": b.activations, "predicted_total_bytes": b.needed,
              "measured_state_bytes": state_bytes, "measured_total_bytes": peak,
              "memory_ratio": peak / max(b.needed, 1), "memory_measured_as": how}
    if not b.activations_estimated:  # the ratio of what was predicted: the model state
      fields["memory_ratio"] = state_bytes / max(predicted_state, 1)
      line = (f"memory after step {step}, per device: predicted state "
              f"{format_bytes(predicted_state)} "
              f"(activations not estimated); measured ({how}) state {format_bytes(state_bytes)},"
              f" peak {format_bytes(peak)}: the state {fields['memory_ratio']:.2f}x predicted")
      return line, fields
    line = (f"memory after step {step}, per device: predicted state "
            f"{format_bytes(predicted_state)} + "
            f"{b.activations_text} = {format_bytes(b.needed)}; measured "
            f"({how}) state {format_bytes(state_bytes)}, peak {format_bytes(peak)}: "
            f"{fields['memory_ratio']:.2f}x predicted")
    excess = (peak - b.needed) * (1 if self._device else len(self._local))
    if fields["memory_ratio"] > WARN_RATIO and (self._device or excess > CPU_WARN_EXCESS_BYTES):
      state_off = state_bytes / max(predicted_state, 1)
      steps_off = (peak - state_bytes) / max(b.activations, 1)
      part = "the model state" if state_off >= steps_off else "the step's activations"
      log.warning("measured memory is %.2fx the prediction: %s differs most (predicted %s, "
                  "measured %s)", fields["memory_ratio"], part,
                  format_bytes(predicted_state if state_off >= steps_off else b.activations),
                  format_bytes(state_bytes if state_off >= steps_off else peak - state_bytes))
    return line, fields


def _device_in_use(local) -> int | None:
  memory = memory_in_use(local)
  return memory[1] if memory and memory[0] == "device_memory_bytes" else None


def _rss() -> int:
  memory = memory_in_use([])
  return memory[1] if memory else 0


def _peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
