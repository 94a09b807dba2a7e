"""Offload targets checked before the state is created, each problem one line.

:func:`check_offload` refuses an offload the devices cannot hold (a memory
kind the backend lacks; an ``offload.nvme_dir`` that is not set, missing or
not writable) and :func:`check_nvme_room` a directory without room for this
process's share of the state the NVMe tier keeps.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

from jaxzero.errors import ConfigError, PathError
from jaxzero.utils.formatting import format_bytes


def check_offload(cfg, devices) -> None:
  """Raises ConfigError or PathError (one line) for an offload these devices or
  this `offload.nvme_dir` cannot hold; creates nothing that stays."""
  kinds = {m.kind for m in devices[0].addressable_memories()}
  for role, kind in (("optimizer", cfg.offload.optimizer), ("params", cfg.offload.params)):
    if kind == "pinned_host" and kind not in kinds:
      raise ConfigError(
          f"offload.{role}=pinned_host: the {devices[0].platform} backend has no pinned_host "
          f"memory (its memory kinds: {', '.join(sorted(kinds))}); use offload.{role}=device"
          + (" or offload.optimizer=nvme" if role == "optimizer" else ""))
  if cfg.offload.optimizer != "nvme":
    return
  # Checked here, not with the config: planning an NVMe run needs no directory.
  if not cfg.offload.nvme_dir:
    raise ConfigError("offload.optimizer=nvme needs offload.nvme_dir=PATH, a directory on "
                      "local disk for the optimizer state")
  where = f"offload.nvme_dir={cfg.offload.nvme_dir}"
  directory = pathlib.Path(cfg.offload.nvme_dir).expanduser()
  if not directory.exists():
    raise PathError(f"{where} does not exist; create it (a directory on local disk) or choose "
                    "another")
  if not directory.is_dir():
    raise PathError(f"{where} is not a directory")
  try:
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".jaxzero-probe-"):
      pass
  except OSError as e:
    raise PathError(f"{where} cannot be written: {e.strerror or e}") from e


def check_nvme_room(cfg, needed: int, holds: str = "the optimizer state",
                    replaced: int = 0) -> None:
  """Raises PathError when offload.nvme_dir lacks room for `needed` bytes (this
  process's store, which `holds` what it names), counting as free the `replaced`
  bytes of its previous store."""
  free = shutil.disk_usage(pathlib.Path(cfg.offload.nvme_dir).expanduser()).free + replaced
  if needed > free:
    raise PathError(f"offload.nvme_dir={cfg.offload.nvme_dir} has {format_bytes(free)} free "
                    f"({free:,} bytes) but the NVMe tier needs {format_bytes(needed)} "
                    f"({needed:,} bytes) for this process's share of {holds}; free "
                    "space or choose another directory")
