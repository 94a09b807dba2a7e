"""Files written so that a reader sees the old content or the new, never a part."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any


def write_json_atomic(path: pathlib.Path, value: Any, indent: int = 2) -> None:
  """Writes `value` as JSON to `path` through a hidden temporary file in the same
  directory and a rename (atomic on POSIX), so concurrent writers and readers
  never meet a half-written file."""
  path = pathlib.Path(path)
  partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  partial.write_text(json.dumps(value, indent=indent) + "\n", encoding="utf-8")
  os.replace(partial, path)
