"""A DeepSpeed or Accelerate file in jaxzero's terms: the settings it makes,
the knobs it names that XLA makes unnecessary, and one-line errors naming its keys.

Shared by ``jaxzero.frameworks.deepspeed``, ``jaxzero.frameworks.accelerate`` and
``jaxzero.migrate``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import pathlib
import re
from typing import Any

import yaml

from jaxzero import config as config_lib
from jaxzero.errors import ConfigError

log = logging.getLogger(__name__)

# What jaxzero does instead of knobs that DeepSpeed and FSDP both have.
GATHERED_PER_LAYER = "ZeRO-3 gathers one layer at a time inside the layer scan, prefetched by XLA"
SHARDED_SAVES = ("checkpoints are sharded (orbax) and restore on any mesh and stage; "
                 "python -m jaxzero.export writes the full model")


@dataclasses.dataclass
class Translation:
  """What a DeepSpeed or Accelerate file says, in jaxzero's terms.

  Attributes:
    source: the file's name, which starts every message about it.
    settings: dotted jaxzero key -> (value, the file's key it comes from); a
      later setting of a key replaces an earlier one.
    batch: see below.
    unneeded: the file's key -> what jaxzero does instead (knobs XLA makes
      unnecessary; accepted, reported once).
  """
  source: str
  settings: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
  unneeded: dict[str, str] = dataclasses.field(default_factory=dict)
  # DeepSpeed's three batch sizes as the file gives them (None: "auto" or
  # absent), resolved once the devices are known (deepspeed.resolve_batch).
  batch: dict[str, int | None] | None = None
  autos: set[str] = dataclasses.field(default_factory=set)  # the file's keys that said "auto"

  def set(self, key: str, value: Any, origin: str) -> None:
    self.settings[key] = (value, origin)

  def error(self, message: str) -> ConfigError:
    return ConfigError(f"{self.source}: {message}")

  def check_keys(self, block: Any, where: str, known) -> dict:
    """Returns `block` (a mapping at `where`) after refusing any key not in `known`."""
    if not isinstance(block, dict):
      raise self.error(f"{where.rstrip('.') or 'the file'} must be a mapping of keys to values, "
                       f"not {block!r}")
    for key in block:
      if key not in known:
        close = difflib.get_close_matches(str(key), list(known), n=1)
        hint = f"; did you mean {where + close[0]!r}?" if close else ""
        raise self.error(f"unknown key {where + str(key)!r}: jaxzero does not know it{hint}")
    return block

  def apply(self, cfg: config_lib.Config) -> config_lib.Config:
    """`cfg` with every setting applied (parsed and checked as `--set` would be)."""
    for key, (value, _) in self.settings.items():
      text = str(value).lower() if isinstance(value, bool) else str(value)
      cfg = config_lib.override(cfg, key, text)
    return cfg

  def summary(self) -> str:
    """One line: the accepted knobs XLA makes unnecessary and what jaxzero does instead."""
    by_reason: dict[str, list[str]] = {}
    for key, reason in self.unneeded.items():
      by_reason.setdefault(reason, []).append(key)
    return "; ".join(f"{', '.join(keys)}: {reason}" for reason, keys in by_reason.items())


def apply_file(tr: Translation, cfg: config_lib.Config) -> config_lib.Config:
  """`cfg` with a translated file applied; logs the unneeded knobs, once."""
  if tr.unneeded:
    log.info("%s: accepted, not needed under XLA: %s", tr.source, tr.summary())
  return tr.apply(cfg)


def number(tr: Translation, value: Any, where: str, kind=float, minimum=None) -> Any:
  """`value` as an int or float, refusing booleans, text and values below `minimum`."""
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  finite = not isinstance(value, float) or math.isfinite(value)  # JSON's NaN, Infinity
  if kind is int:  # (an int of any size is whole; float() of a huge one overflows)
    ok = ok and (isinstance(value, int) or (finite and float(value).is_integer()))
  if not ok or not finite or (minimum is not None and value < minimum):
    least = "" if minimum is None else f" of at least {minimum}"
    what = "an integer" if kind is int else "a number" if finite else "a finite number"
    raise tr.error(f"{where}={value!r} must be {what}{least}")
  return kind(value)


def param(tr: Translation, params: dict, where: str, key: str, base: Any, default: Any,
          kind=float, minimum=None) -> Any:
  """A scheduler/optimizer parameter: `default` when absent, `base` when "auto"."""
  value = params.get(key, default)
  if value == "auto":
    tr.autos.add(f"{where}{key}")
    return base
  if value is None:
    return default
  return number(tr, value, f"{where}{key}", kind, minimum)


def read_mapping(path: str, kind: str) -> dict:
  """The mapping in a JSON (`kind` "DeepSpeed") or YAML ("Accelerate") file; a file that
  cannot be read or parsed is one line naming it (and the line and column)."""
  file = pathlib.Path(path)
  if not file.exists():
    raise ConfigError(f"{kind} config {path!r} does not exist")
  if file.is_dir():
    raise ConfigError(f"{kind} config {path!r} is a directory; give the file in it")
  try:
    text = file.read_bytes().decode("utf-8-sig")  # an editor's byte-order mark is fine
  except OSError as e:
    raise ConfigError(f"{kind} config {path!r} cannot be read: {e.strerror}") from None
  except UnicodeDecodeError as e:
    line = e.object.count(b"\n", 0, e.start) + 1
    raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line});"
                      " save it as UTF-8") from None
  data = _json(path, text) if kind == "DeepSpeed" else _yaml(path, text)
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: a {kind} config must be a mapping of keys to values")
  return data


class _DuplicateKey(ValueError):
  pass


def _unique(pairs: list) -> dict:
  """An object's pairs as a dict, refusing a key given twice, as DeepSpeed does
  (its dict_raise_error_on_duplicate_keys): which one would count is not obvious."""
  seen = set()
  for key, _ in pairs:
    if key in seen:
      raise _DuplicateKey(key)
    seen.add(key)
  return dict(pairs)


def _json(path: str, text: str):
  """A ds_config read as DeepSpeed reads it: with hjson (a superset of JSON: comments,
  trailing commas) where it is installed, else as JSON."""
  try:
    import hjson  # pylint: disable=import-outside-toplevel
  except ImportError:
    hjson = None
  try:
    data = (hjson or json).loads(text, object_pairs_hook=_unique)
  except _DuplicateKey as e:
    raise ConfigError(f"{path}: key {e.args[0]!r} is given twice in one object; DeepSpeed "
                      "refuses duplicate keys, give it once") from None
  except ValueError as e:  # json's and hjson's decode errors, with the line and column
    hint = ("" if hjson is not None else
            "; comments and trailing commas (DeepSpeed's hjson) need pip install hjson")
    raise ConfigError(f"{path}: not valid JSON at line {getattr(e, 'lineno', '?')} column "
                      f"{getattr(e, 'colno', '?')}: {getattr(e, 'msg', e)}{hint}") from None
  swallowed = _swallowed_key(data, "", text)
  if swallowed:  # (JSON refuses '"overlap_comm": true "offload_optimizer": {...}' outright)
    raise ConfigError(f"{path}: {swallowed[0]} reads as the text {swallowed[1][:60]!r}: a "
                      "comma is missing before the key in it (hjson, as DeepSpeed reads the "
                      "file, takes an unquoted value to the end of its line)")
  return data


def _swallowed_key(value: Any, where: str, source: str) -> tuple[str, str] | None:
  """The first string in `value` that holds a quoted key and its colon as it stands in the
  file's `source` (a quoted string escapes its quotes there): hjson's unquoted text
  swallowing the keys after a missing comma."""
  if isinstance(value, (dict, list)):
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return next(filter(None, (_swallowed_key(v, f"{where}{k}.", source) for k, v in items)),
                None)
  if isinstance(value, str) and re.search(r'"[^"]*"\s*:', value) and value in source:
    return where.rstrip("."), value
  return None


def _yaml(path: str, text: str):
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
