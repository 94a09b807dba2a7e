"""A failed checkpoint read, in one line and nothing after it.

orbax and tensorstore report a damaged file as a bare Exception whose text
carries TensorStore's whole spec, and the reads a failed restore abandons
report themselves again on stderr. :func:`read_error` says what failed in
words; `read_failure` tells damage from this machine's state (memory, file
handles, permissions, disk space), which is no reason to skip or move a
checkpoint; and :func:`quiet_abandoned_reads` (called before the first read)
keeps the abandoned reads from saying more.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import re
import sys
import threading
import warnings
from typing import Iterator

from jaxzero.errors import CheckpointError, DamagedCheckpointError

# tensorstore names the array it failed on, e.g. 'Error reading "master.embed_VxD/0.0"'.
_LEAF_IN_ERROR = re.compile(r'(?:Error reading|Metadata at) "([^"/]+)/')
_STATE_DIR_IN_ERROR = re.compile(r' in OCDBT database at local file "[^"]*"')


def read_error(where: pathlib.Path, error: BaseException, what: str = "") -> str:
  """One line for a failed read: the leaf when tensorstore names it, and why."""
  return f"checkpoint {where} is damaged: {_what_failed(error, what)} cannot be read: " \
         f"{reason(error)}"


def _what_failed(error: BaseException, what: str) -> str:
  quiet_abandoned_reads()
  leaf = next((m.group(1) for m in map(_LEAF_IN_ERROR.search, map(str, _causes(error))) if m),
              None)
  return f"leaf {leaf.replace('.', '/')}" if leaf else what or "a file"


# What says a read failed for want of a resource or a right, or for a moment, not for what
# the files hold: a status code at the start of a message (XLA's, tensorstore's), or the
# operating system's error number.
_NOT_DAMAGE = re.compile(r"(RESOURCE_EXHAUSTED|PERMISSION_DENIED|UNAVAILABLE|DEADLINE_EXCEEDED"
                         r"|ABORTED|CANCELLED)\b")
_NOT_DAMAGE_ERRNOS = {errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EPERM,
                      errno.ENOSPC, errno.EDQUOT, errno.ESTALE, errno.EAGAIN, errno.EINTR}


def read_failure(where: pathlib.Path, error: BaseException, what: str = "") -> CheckpointError:
  """The error to raise for a failed read of checkpoint `where`: damage
  (DamagedCheckpointError, which a run may answer by resuming an older checkpoint),
  or, where the read failed for want of memory, file handles, disk space or a right, or
  for a moment (a stale handle, a timeout), a CheckpointError saying so, which stops the
  run with every checkpoint where it was: resuming the same checkpoint works once that
  is fixed."""
  if any(_not_damage(e) for e in _causes(error)):
    return CheckpointError(
        f"checkpoint {where}: {_what_failed(error, what)} could not be read: {reason(error)}; "
        "that is this machine's state, not damage: no checkpoint was skipped or moved, and "
        "the run resumes from this one once it is fixed")
  return DamagedCheckpointError(read_error(where, error, what))


def _not_damage(error: BaseException) -> bool:
  if isinstance(error, MemoryError):
    return True
  if isinstance(error, OSError) and error.errno is not None:
    return error.errno in _NOT_DAMAGE_ERRNOS
  return bool(_NOT_DAMAGE.match(str(error).strip()))


def _causes(error: BaseException) -> Iterator[BaseException]:
  """`error` and its causes, as a traceback shows them: an exception raised
  `from None` (json's over its internal StopIteration) hides its context."""
  while error is not None:
    yield error
    error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


# Errors whose message alone is only a key, an index or nothing, in words.
_IN_WORDS = {KeyError: "missing entry", IndexError: "index out of range",
             StopIteration: "unexpected end of data", EOFError: "unexpected end of file"}


def reason(error: BaseException) -> str:
  """The innermost cause's first line, without tensorstore's spec dump, in words:
  a bare KeyError's "0" becomes "missing entry 0"."""
  *_, innermost = _causes(error)
  if isinstance(innermost, json.JSONDecodeError):
    return (f"not valid JSON: {innermost.msg.lower()} (line {innermost.lineno}, "
            f"column {innermost.colno})")
  lines = str(innermost).strip().splitlines()
  reason = _STATE_DIR_IN_ERROR.sub("", lines[0].split(" [tensorstore_spec")[0]) if lines else ""
  if not re.search(r"\s", reason.strip("'\"")):  # nothing, or one word: no sentence
    words = next((w for kind, w in _IN_WORDS.items() if isinstance(innermost, kind)), None)
    reason = (f"{words} {reason}" if words else
              f"{type(innermost).__name__}: {reason}" if reason else type(innermost).__name__)
    reason = reason.strip()
  return reason if len(reason) <= 500 else reason[:500] + "..."


# orbax's coroutine that reads one shard of one array.
_SHARD_READ = "_read_array_index_and_device_put"


class _AbandonedReadTasks(logging.Filter):
  """Drops asyncio's "Task/Future/_GatheringFuture exception was never
  retrieved" for the reads of a failed restore (orbax's, tensorstore's)."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (re.match(r"\w+ exception was never retrieved", message)
                and any(mark in message for mark in ("async_deserialize", _SHARD_READ,
                                                     "OCDBT database", "TensorStore")))


def quiet_abandoned_reads() -> None:
  """Keeps a failed restore's error the last word; idempotent.

  When one read fails, orbax stops awaiting the others: each of those then
  reports its own failure, or "Event loop is closed", as an unraisable
  exception or an unretrieved task exception (a traceback with TensorStore's
  whole spec on stderr), or is reported as never awaited. None of it says
  more than the error raised. Installed before reading, not on the first
  error: an abandoned read of the first failed restore may report itself
  (on a tensorstore thread) before that error reaches `read_error`.
  """
  warnings.filterwarnings("ignore", message=f"coroutine '{_SHARD_READ}' was never awaited",
                          category=RuntimeWarning)
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _AbandonedReadTasks) for f in asyncio_log.filters):
    asyncio_log.addFilter(_AbandonedReadTasks())
  previous = sys.unraisablehook
  if getattr(previous, "ignores_abandoned_reads", False):
    return

  def hook(unraisable):
    error, where = unraisable.exc_value, unraisable.object
    abandoned_read = getattr(getattr(where, "cr_code", None), "co_name", None) == _SHARD_READ
    if not (abandoned_read or _loop_closed(error)):
      previous(unraisable)

  hook.ignores_abandoned_reads = True
  sys.unraisablehook = hook
  # Tensorstore's callbacks report a closed loop through sys.excepthook, from
  # its own threads; the main thread's errors always reach the previous hook
  # (in a multi-process run, distributed's, which exits at once).
  report = sys.excepthook

  def excepthook(kind, error, traceback):
    if not (_loop_closed(error) and threading.current_thread() is not threading.main_thread()):
      report(kind, error, traceback)

  sys.excepthook = excepthook


class _BackgroundSaveTracebacks(logging.Filter):
  """Keeps the line orbax logs for a save that failed in its background threads, without
  its traceback (one per thread): the run's own error says what failed, once
  (jaxzero.checkpoint.checkpointer.Checkpointer.check_saves)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and "/orbax/" in record.pathname.replace("\\", "/"):
      record.exc_info, record.exc_text = None, None
    return True


def quiet_background_saves() -> None:
  """Installs _BackgroundSaveTracebacks on absl's logger (orbax's); idempotent."""
  absl_log = logging.getLogger("absl")
  if not any(isinstance(f, _BackgroundSaveTracebacks) for f in absl_log.filters):
    absl_log.addFilter(_BackgroundSaveTracebacks())


def write_reason(error: BaseException) -> str:
  """Why a write failed, in words: the operating system's error where tensorstore gives
  its number (a full disk: "no space left on device"), else as `reason`."""
  code = next((m.group(1) for m in map(re.compile(r"os_error_code='(\d+)'").search,
                                         map(str, _causes(error))) if m), None)
  return os.strerror(int(code)).lower() if code else reason(error)


def _loop_closed(error: BaseException | None) -> bool:
  return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class ReadError(Exception):
  """A saved array could not be read (its cause is chained): raised by a side
  item's reads, reported by the checkpointer as a damaged checkpoint."""
