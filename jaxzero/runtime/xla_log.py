"""XLA's own log lines, kept out of a command's output.

XLA's C++ logger writes warnings (``W1127 18:30:19.856712  9399 spmd_partitioner.cc:656]
[SPMD] Involuntary full rematerialization ...``) straight to file descriptor 2, where no
Python logging setting reaches them. :func:`xla_lines_to` sends those lines to a log file
and lets every other line of standard error through as it comes, so that a command's own
output (a plan's table) comes first and one line of its own says what XLA had to say.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import re
import sys
import threading
from typing import Iterator

# glog's prefix: severity, MMDD, time, thread id, file:line]
XLA_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w.\-]+:\d+\] ")
REMAT = b"Involuntary full rematerialization"


@contextlib.contextmanager
def xla_lines_to(path: str | pathlib.Path) -> Iterator[collections.Counter]:
  """While inside, XLA's log lines on standard error are appended to `path` (created with
  its directory when the first comes); the Counter yielded counts them, "remat" for the
  partitioner's involuntary full rematerializations and "other" for the rest."""
  path = pathlib.Path(path)
  counts: collections.Counter = collections.Counter()
  sys.stderr.flush()
  original = os.dup(2)
  read_end, write_end = os.pipe()
  os.dup2(write_end, 2)
  os.close(write_end)

  def pump() -> None:
    log = None
    with os.fdopen(read_end, "rb") as lines:
      for line in lines:
        if not XLA_LINE.match(line):
          os.write(original, line)
          continue
        counts["remat" if REMAT in line else "other"] += 1
        if log is None:
          try:
            path.parent.mkdir(parents=True, exist_ok=True)
            log = open(path, "ab")  # pylint: disable=consider-using-with
          except OSError as e:  # the lines still reach standard error: nothing blocks
            counts["unwritable"] = 1
            log = os.fdopen(os.dup(original), "wb")
            log.write(f"(XLA's log lines cannot go to {path}: {e.strerror})\n".encode())
        log.write(line)
        log.flush()
    if log is not None:
      log.close()

  reader = threading.Thread(target=pump, name="xla-log", daemon=True)
  reader.start()
  try:
    yield counts
  finally:
    sys.stderr.flush()
    os.dup2(original, 2)  # closes the pipe's last write end: the reader sees its end
    reader.join(timeout=10)
    os.close(original)


def summary(counts: collections.Counter, path: str | pathlib.Path) -> str:
  """One line for what XLA logged, or "" when it logged nothing."""
  if not counts or counts["unwritable"]:
    return ""
  parts = []
  if counts["remat"]:
    parts.append(f"rematerialised {counts['remat']} buffer{'s' if counts['remat'] > 1 else ''} "
                 "it could not reshard efficiently")
  if counts["other"]:
    parts.append(f"logged {counts['other']} other line{'s' if counts['other'] > 1 else ''}")
  return f"XLA {' and '.join(parts)} (see {path})"
