"""The tokenized data's cache directory: its place and name, the index that says
whether it still matches its source files and tokenizer, one writer at a time across
processes, and no partial file left by a failed write.

Invariant: an index is written last, by atomic rename, so a cache whose index
matches (`reusable`) holds whole files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import re
from typing import Callable

import numpy as np

from jaxzero.errors import DataError

# Bump when the token file layout or the tokenization rules change: caches are rebuilt.
CACHE_FORMAT = 2  # 2: long documents tokenized in pieces cut at word boundaries
TOKENS_FILE, INDEX_FILE = "tokens.bin", "index.json"


def cache_root(data, workdir) -> pathlib.Path:
  """Where tokenized data is kept: data.cache_dir, else the run's workdir/data_cache."""
  if data.cache_dir:
    return pathlib.Path(data.cache_dir).expanduser()
  if workdir is None:
    raise DataError("set data.cache_dir (or pass a workdir) to tokenize "
                    f"data.source={data.source!r}")
  return pathlib.Path(workdir) / "data_cache"


def cache_name(data, tokenizer, *more: str) -> str:
  """A directory per (source, tokenizer, field, `more`): switching back and forth reuses
  each."""
  key = json.dumps([os.path.abspath(os.path.expanduser(data.source)), tokenizer.digest,
                    tokenizer.separator, data.text_field, *more])
  readable = re.sub(r"[^A-Za-z0-9._-]+", "_", data.source.strip("/"))[-48:].strip("_")
  return f"{readable or 'data'}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def index_header(files: list[pathlib.Path], tokenizer, text_field: str) -> dict:
  """The index fields that must equal the current inputs for the cache to be reused."""
  stats = [(f, f.stat()) for f in files]
  return {
      "format": CACHE_FORMAT,
      "tokenizer_sha256": tokenizer.digest,
      "separator": list(tokenizer.separator),
      "text_field": text_field,
      # The change time and the inode too: a file replaced by one of the same size and
      # modification time (cp -p, rsync -t, tar) is another file; no one sets those.
      "files": [{"path": str(f), "bytes": s.st_size, "mtime_ns": s.st_mtime_ns,
                 "ctime_ns": s.st_ctime_ns, "inode": s.st_ino} for f, s in stats],
  }


FILE_KEYS = ("path", "bytes", "mtime_ns", "ctime_ns", "inode")


def reusable(index: dict | None, want: dict) -> bool:
  """Whether a cache's index was made from the files and settings `want` describes."""
  if index is None:
    return False
  files = [{k: f.get(k) for k in FILE_KEYS} for f in index.get("files") or []]
  return files == want["files"] and all(index.get(k) == v for k, v in want.items()
                                         if k != "files")


def read_index(cache: pathlib.Path) -> dict | None:
  """The index, or None if absent, unreadable or not matching its token file."""
  try:
    index = json.loads((cache / INDEX_FILE).read_text())
    size = (cache / TOKENS_FILE).stat().st_size
    return index if size == index["tokens"] * np.dtype(index["dtype"]).itemsize else None
  except (OSError, ValueError, KeyError, TypeError):
    return None


def cached(cache: pathlib.Path, want: dict, read: Callable[[pathlib.Path], dict | None],
           build: Callable[[], dict]) -> dict:
  """The index of `cache` if `read` finds one matching `want` (reusable), else `build()`'s.
  One process builds; others started at the same time wait, then reuse. A build first
  deletes the partial files (*.tmp) a killed build left: only the lock's holder writes
  them, so any there now is an orphan (a SIGKILL, or Ctrl-C's immediate exit at start-up,
  runs no clean-up)."""
  cache.mkdir(parents=True, exist_ok=True)
  with locked(cache / "lock"):
    index = read(cache)
    if reusable(index, want):
      return index
    for orphan in cache.glob("*.tmp"):
      orphan.unlink(missing_ok=True)
    return build()


@contextlib.contextmanager
def locked(path: pathlib.Path):
  """An exclusive lock on `path` (flock) while the block runs: one process tokenizes."""
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def remove_on_failure(partials: list[pathlib.Path]):
  """Deletes the partial files a tokenization was writing when it fails or is stopped
  (a retry would leave one more each time)."""
  try:
    yield
  except BaseException:
    for partial in partials:
      partial.unlink(missing_ok=True)
    raise
