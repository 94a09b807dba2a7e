"""Which files a data source names: a file, a directory or a glob, each file once.

Invariants: links to directories are never followed (a loop would not end, an alias
would repeat files); a path that names a file is that file, whatever glob characters it
holds; what a run writes (checkpoints, metrics, its token cache) is never its data.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re

from jaxzero.errors import DataError

log = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl", ".parquet")


def match_files(source: str, setting: str = "data.source",
                exclude: tuple[str | os.PathLike, ...] = ()) -> list[pathlib.Path]:
  """The files `source` (the value of `setting`) names, sorted, each once however links
  reach it: a file (whatever glob characters its name holds), a directory (searched
  recursively for supported files, any case of suffix; links to directories are not
  followed: they could repeat files or loop) or a glob (``**`` recurses). Files under
  `exclude` (what a run writes: checkpoints, metrics.jsonl, its token cache) are left out
  where a directory or a glob reaches them."""
  pattern = os.path.abspath(os.path.expanduser(source))
  if os.path.isdir(pattern):
    found = [os.path.join(root, name) for root, _, names in os.walk(pattern) for name in names]
    files = [p for p in found if os.path.isfile(p) and p.lower().endswith(SUFFIXES)]
    others = sorted(p for p in found if os.path.isfile(p) and not p.lower().endswith(SUFFIXES))
    if others:
      log.warning("%s=%s holds %d file(s) that are not %s, left out (first %s)", setting,
                  source, len(others), ", ".join(SUFFIXES), others[0])
  else:
    files = [pattern] if os.path.isfile(pattern) else [
        p for p in _glob(pattern) if os.path.isfile(p)]
    for path in files:
      if not path.lower().endswith(SUFFIXES):
        raise DataError(f"{setting}={source!r} matches {path}, which is not one of "
                        f"{', '.join(SUFFIXES)}")
  outside = [os.path.realpath(os.path.expanduser(d)) for d in exclude]
  inside = [p for p in files if p != pattern and any(
      os.path.realpath(p) == d or os.path.realpath(p).startswith(d + os.sep) for d in outside)]
  if inside:
    log.warning("%s=%s reaches %d file(s) a run writes (first %s): left out",
                setting, source, len(inside), inside[0])
  unique: dict[str, str] = {}
  for path in sorted(set(files) - set(inside)):
    unique.setdefault(os.path.realpath(path), path)
  if not unique:
    stdlib = "'stdlib' nor " if setting == "data.source" else ""
    raise DataError(f"{setting}={source!r} is neither {stdlib}a file, directory or glob "
                    f"matching any {', '.join(SUFFIXES)} file")
  return [pathlib.Path(p) for p in sorted(unique.values())]


def _glob(pattern: str) -> list[str]:
  """The paths an absolute glob matches, ``**`` recursing without following links to
  directories (glob.glob follows them: a loop never ends)."""
  parts = pathlib.Path(pattern).parts
  first = next((i for i, part in enumerate(parts) if re.search(r"[*?[]", part)), len(parts))
  if first == len(parts):
    return [pattern] if os.path.exists(pattern) else []
  return [str(p) for p in pathlib.Path(*parts[:first]).glob(str(pathlib.Path(*parts[first:])))]


# What a run writes in its workdir (jaxzero.training): never its data.
RUN_OUTPUTS = ("checkpoints", "checkpoints.damaged", "metrics.jsonl", "metrics.dropped.jsonl",
               "tb", "data_cache")


def run_outputs(data, workdir) -> tuple[pathlib.Path, ...]:
  """The files and directories a run writes, whose files are never its data: its
  checkpoints, metrics, events and token cache."""
  outputs = [pathlib.Path(workdir) / name for name in RUN_OUTPUTS] if workdir else []
  return (*outputs, *([pathlib.Path(data.cache_dir).expanduser()] if data.cache_dir else []))
