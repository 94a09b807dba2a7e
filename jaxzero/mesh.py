"""The named device mesh ``(replica, fsdp)``, and virtual CPU devices for laptops."""

from __future__ import annotations

import os
import re
import sys

AXES = ("replica", "fsdp")
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def ensure_virtual_devices(n: int) -> None:
  """Asks XLA for `n` host (CPU) devices; must run before JAX starts.

  The flag only affects the CPU platform, so on a GPU machine it is harmless:
  the GPUs remain the default backend.
  """
  if n <= 1:
    return
  if "jax" in sys.modules:
    import jax  # pylint: disable=import-outside-toplevel
    if jax._src.xla_bridge.backends_are_initialized():  # pylint: disable=protected-access
      return
  flags = os.environ.get("XLA_FLAGS", "")
  match = re.search(_COUNT_FLAG + r"=(\d+)", flags)
  if match and int(match.group(1)) >= n:
    return
  flags = re.sub(_COUNT_FLAG + r"=\d+", "", flags).strip()
  os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()


def devices_needed(replica: int, fsdp: int) -> int:
  """Devices a mesh config asks for, or 0 when it takes 'all remaining'."""
  return replica * fsdp if replica > 0 and fsdp > 0 else 0


def make_mesh(replica: int, fsdp: int, devices=None):
  """A mesh over `devices` (default: all) with Auto axes: XLA propagates shardings."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import AxisType, Mesh  # pylint: disable=import-outside-toplevel

  devices = list(jax.devices() if devices is None else devices)
  if replica * fsdp != len(devices):
    raise ValueError(f"mesh {replica}x{fsdp} needs {replica * fsdp} devices, got {len(devices)}")
  grid = np.asarray(devices, dtype=object).reshape(replica, fsdp)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))
