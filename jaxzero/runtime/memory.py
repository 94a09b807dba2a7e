"""Memory in use now: the most any of this process's devices holds (where they report
it, GPUs), else this process's resident memory (a CPU's devices are the host's)."""

from __future__ import annotations

import os


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
