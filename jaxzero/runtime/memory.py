"""Memory in use now: the most any of this process's devices holds (where they report
it, GPUs), else this process's resident memory (a CPU's devices are the host's); and the
host memory this process's cgroup may hold."""

from __future__ import annotations

import os
import pathlib

# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT = 1 << 62


def host_ram_bytes(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
                   ) -> int:
  """The host's RAM, or less where this process's cgroups limit its memory (Slurm's
  --mem, a container's limit): the most this process and its host's others may hold."""
  physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return min([physical, *_cgroup_limits(pathlib.Path(cgroup_root), proc_cgroup)])


def _cgroup_limits(root: pathlib.Path, proc_cgroup: str) -> list[int]:
  """The memory limits of this process's cgroup and its ancestors, v2 (memory.max) and v1
  (memory/memory.limit_in_bytes); a container sees its own cgroup as the root."""
  try:
    lines = pathlib.Path(proc_cgroup).read_text(encoding="ascii").splitlines()
  except OSError:
    return []
  limits = []
  for line in lines:
    _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
    if controllers == "":
      base, name = root, "memory.max"
    elif "memory" in controllers.split(","):
      base, name = root / "memory", "memory.limit_in_bytes"
    else:
      continue
    parts = pathlib.PurePosixPath(path or "/").parts[1:]
    for depth in range(len(parts), -1, -1):
      try:
        text = (base.joinpath(*parts[:depth]) / name).read_text(encoding="ascii").strip()
      except OSError:
        continue
      if text.isdigit() and int(text) < _NO_LIMIT:
        limits.append(int(text))
  return limits


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
