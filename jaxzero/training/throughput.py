"""Model FLOPs, MFU and memory in use: the figures a training log shows beside the loss.

Model FLOPs per token are jaxzero.planning.flops's. MFU is model TFLOP/s over the
devices' bf16 dense peak, where the device is known (a CPU has none).
"""

from __future__ import annotations

import os

# bf16 dense peak per device, TFLOP/s (vendor datasheets, without sparsity).
# The H100 figure is the SXM part's; PCIe H100s peak lower (756 TFLOP/s).
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0}


def device_peak_tflops(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  return next((peak for name, peak in PEAK_TFLOPS.items() if name in kind), None)


def memory_in_use(local_devices) -> tuple[str, int] | None:
  """("device_memory_bytes", the most any of this process's devices holds) where
  the devices report it (GPUs); on a CPU ("host_rss_bytes", this process's
  resident memory)."""
  stats = [d.memory_stats() for d in local_devices]
  in_use = [s["bytes_in_use"] for s in stats if s and "bytes_in_use" in s]
  if in_use:
    return "device_memory_bytes", max(in_use)
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      return "host_rss_bytes", int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None
