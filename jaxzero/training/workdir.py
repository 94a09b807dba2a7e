"""The run directory: its paths checked before anything is built, and one writer at a time.

:func:`check_paths` (and :func:`check_export_paths` for ``jaxzero.export``) turns every
file-system problem a run would meet later into one line before the model is built and the
step compiled. :func:`hold` keeps a second run off a workdir that a live run is writing: an
``flock`` on ``WORKDIR/.jaxzero.lock``, held by an open file for the run's life, so the kernel
releases it when the process dies, however it dies.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import pathlib
import socket
import tempfile
import time
from typing import Iterator

import jax

from jaxzero.config import Config
from jaxzero.errors import PathError, WorkdirInUse

log = logging.getLogger(__name__)

LOCK_FILE = ".jaxzero.lock"
# How long a refused run waits for the holder to write its record (it does so
# right after taking the lock) before reporting the holder as unnamed.
_RECORD_WAIT_S = 1.0


# ----------------------------------------------------------------------------- path checks


def check_paths(cfg: Config, workdir: str | os.PathLike) -> None:
  """Raises PathError for the first path a run of `cfg` in `workdir` could not use.

  Creates nothing that stays: writability is tried with a probe file, since
  permission bits alone miss read-only mounts, ACLs and root.
  """
  workdir = pathlib.Path(workdir)
  _check_directory(workdir, "--workdir")
  _check_directory(workdir / "checkpoints", "the checkpoint directory")
  metrics = workdir / "metrics.jsonl"
  if metrics.exists() or metrics.is_symlink():
    try:
      # Appending nothing changes nothing, and fails where the run's first log would.
      with open(metrics, "a", encoding="utf-8"):
        pass
    except OSError as e:
      raise PathError(f"{metrics} cannot be written: {_why(e)}") from e
  if cfg.data.source != "stdlib":
    if cfg.data.cache_dir:
      _check_directory(pathlib.Path(cfg.data.cache_dir).expanduser(),
                       f"data.cache_dir={cfg.data.cache_dir!r}")
    else:
      _check_directory(workdir / "data_cache", "the token cache (set data.cache_dir to move it)")


def check_export_paths(workdir: str | os.PathLike, out: str | os.PathLike) -> None:
  """Raises PathError when `workdir` cannot be read as a run directory or the
  export directory `out` cannot be created, or lies among the workdir's checkpoints."""
  workdir, out = pathlib.Path(workdir), pathlib.Path(out)
  for path, what in ((workdir, "--workdir"), (workdir / "checkpoints", "its checkpoints")):
    if path.exists() and not path.is_dir():
      raise PathError(f"{what} {path} is a file, not a directory")
  if out.exists() and not out.is_dir():
    raise PathError(f"--out {out} is a file; export writes a new directory there")
  checkpoints = (workdir / "checkpoints").resolve()
  if checkpoints in (out.resolve(), *out.resolve().parents):
    raise PathError(f"--out {out} is inside {workdir / 'checkpoints'}, where the next run "
                    "would take the export for a damaged checkpoint and move it aside; write "
                    f"it elsewhere, e.g. --out {workdir / 'hf'}")
  # The export is written beside `out` and renamed into place.
  _check_directory(out.parent, "--out's parent")


def _check_directory(path: pathlib.Path, what: str) -> None:
  """Raises PathError unless `path` is, or could be made, a writable directory."""
  if path.exists() and not path.is_dir():
    raise PathError(f"{what} {path} is a file, not a directory")
  existing = path
  while not existing.exists():
    if existing.parent == existing:
      break
    existing = existing.parent
  if existing != path:
    if not existing.is_dir():
      raise PathError(f"{what} {path} cannot be created: {existing} is a file")
    where = f"{what} {path} cannot be created in {existing}"
  else:
    where = f"{what} {path} is not writable"
  try:
    fd, probe = tempfile.mkstemp(prefix=".jaxzero-probe-", dir=existing)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise PathError(f"{where}: {_why(e)}") from e


def _why(error: OSError) -> str:
  """The OS's words for `error` ("permission denied", "read-only file system")."""
  if error.errno is not None:
    return os.strerror(error.errno).lower()
  return str(error)


# ----------------------------------------------------------------------------- the lock


@contextlib.contextmanager
def hold(workdir: str | os.PathLike) -> Iterator[None]:
  """Holds `workdir`'s lock for the body; creates the workdir if needed.

  In a multi-process run only process 0 takes it: the others write the same
  run. A lock file left by a process that died is taken over, with a log line.

  Raises:
    WorkdirInUse: naming the host, pid and start time of the live holder.
  """
  if jax.process_index() != 0:
    yield
    return
  workdir = pathlib.Path(workdir)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise PathError(f"--workdir {workdir} cannot be created: {_why(e)}") from e
  path = workdir / LOCK_FILE
  fd = _lock(path, workdir)
  try:
    previous = _read_record(fd)
    if previous:
      log.info("taking over the lock %s from %s, %s", path, _describe(previous),
               _why_stale(previous))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_own_record()).encode() + b"\n", 0)
    yield
  finally:
    # Removed while still held, so no file is left behind for the next run to
    # mistake for a dead holder's; _lock copes with a file removed under it.
    with contextlib.suppress(OSError):
      os.unlink(path)
    os.close(fd)


def _lock(path: pathlib.Path, workdir: pathlib.Path) -> int:
  """An open descriptor of `path` holding its exclusive flock."""
  while True:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
      raise PathError(f"--workdir {workdir} is not writable: {_why(e)}") from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      record = _wait_for_record(fd)
      os.close(fd)
      holder = _describe(record) if record else "another run that has not named itself yet"
      raise WorkdirInUse(f"--workdir {workdir} is in use by {holder}; wait for it to end, or "
                         "use another --workdir") from None
    except OSError as e:
      os.close(fd)
      raise PathError(f"--workdir {workdir} cannot be locked: {_why(e)}") from e
    # The holder before us removes the file as it lets go: if that happened
    # between our open and our flock, we locked a file no other run will open.
    try:
      if os.stat(path).st_ino == os.fstat(fd).st_ino:
        return fd
    except FileNotFoundError:
      pass
    os.close(fd)


def _own_record() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def _read_record(fd: int) -> dict | None:
  try:
    record = json.loads(os.pread(fd, 4096, 0))
  except ValueError:  # empty or cut short: its writer died before finishing it
    return None
  return record if isinstance(record, dict) else None


def _wait_for_record(fd: int) -> dict | None:
  deadline = time.monotonic() + _RECORD_WAIT_S
  while (record := _read_record(fd)) is None and time.monotonic() < deadline:
    time.sleep(0.05)
  return record


def _describe(record: dict) -> str:
  return (f"process {record.get('pid')} on host {record.get('host')} "
          f"(running since {record.get('since')})")


def _why_stale(record: dict) -> str:
  """Why a recorded holder no longer holds the lock, as far as this host can tell."""
  if record.get("host") != socket.gethostname():
    return "which no longer holds it"
  try:
    os.kill(int(record.get("pid")), 0)
  except ProcessLookupError:
    return "which is no longer running"
  except (OSError, TypeError, ValueError):
    pass
  return "which no longer holds it (its pid now belongs to another process)"
