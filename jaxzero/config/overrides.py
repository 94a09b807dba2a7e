"""Dotted overrides (``--set train.steps=10``): each value parsed to its field's type.

An unknown key or a bad value is one error naming the key and the valid choices; a config
file's values are held to the same types (check_types, check_literals).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from jaxzero.errors import ConfigError

log = logging.getLogger(__name__)


def _field_types(cls) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse_value(key: str, text: str, typ: Any) -> Any:
  if get_origin(typ) is Literal:
    choices = get_args(typ)
    for choice in choices:
      if str(choice) == text:
        return choice
    raise ConfigError(f"{key}={text!r} is not valid; choose one of: "
                      + ", ".join(repr(c) if c == "" else str(c) for c in choices))
  if typ is bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
    raise ConfigError(f"{key}={text!r} is not a boolean; use true or false")
  if typ in (int, float):
    try:
      return typ(text)
    except ValueError:
      raise ConfigError(f"{key}={text!r} is not a valid {typ.__name__}") from None
  if typ is not str:  # (as_dotted leaves such fields out too)
    raise ConfigError(f"{key} holds a Python object (jaxzero.Engine sets it): it is not a "
                      "file or command-line setting")
  return text


def override(cfg: Any, key: str, text: str, _prefix: str = "") -> Any:
  """Returns `cfg` with the field at dotted `key` set from the string `text`."""
  head, _, rest = key.partition(".")
  types = _field_types(type(cfg))
  full = _prefix + head
  if head not in types:
    raise ConfigError(f"unknown config key {full!r}; valid keys here: "
                      + ", ".join(_prefix + k for k in types))
  current = getattr(cfg, head)
  if dataclasses.is_dataclass(current):
    if not rest:
      raise ConfigError(f"{full!r} is a section; set one of its keys: "
                        + ", ".join(f"{full}.{k}" for k in _field_types(type(current))))
    value = override(current, rest, text, full + ".")
  else:
    if rest:
      raise ConfigError(f"unknown config key {key!r}: {full!r} has no sub-keys")
    value = _parse_value(full, text, types[head])
  return dataclasses.replace(cfg, **{head: value})


# Keys that moved, old dotted name -> new one. The old name keeps working.
MOVED_KEYS = {"model.hf_checkpoint": "init.hf_checkpoint"}


def as_dotted(cfg: Any, _prefix: str = "") -> dict[str, Any]:
  """Every field `--set` can set, by its dotted name, e.g. {"train.steps": 80, ...}: the
  inverse of `--set` (each pair, given back as `--set KEY=VALUE`, reproduces the config;
  a field that holds a Python object, set by jaxzero.Engine, is left out)."""
  fields = {}
  for name, typ in _field_types(type(cfg)).items():
    value = getattr(cfg, name)
    if dataclasses.is_dataclass(value):
      fields.update(as_dotted(value, f"{_prefix}{name}."))
    elif get_origin(typ) is Literal or typ in (bool, int, float, str):
      fields[_prefix + name] = value
  return fields


def apply_overrides(cfg: Any, assignments: list[str]) -> Any:
  for assignment in assignments:
    key, eq, text = assignment.partition("=")
    if not eq:
      raise ConfigError(f"--set {assignment!r} must look like KEY=VALUE, e.g. train.steps=10")
    key = key.strip()
    if key in MOVED_KEYS:
      log.warning("config key %s is deprecated; it is now %s", key, MOVED_KEYS[key])
      key = MOVED_KEYS[key]
    cfg = override(_strategy_spelled_out(cfg, key), key, text.strip())
  return cfg


def _strategy_spelled_out(cfg: Any, key: str) -> Any:
  """`cfg` ready for an override of `key`: zero.strategy, when set, decides the stage and
  the hybrid flag (ZeroConfig.resolved), so an override of either replaces the strategy by
  the (stage, hybrid) it names; otherwise the value given would not be the one that runs."""
  zero = getattr(cfg, "zero", None)
  if key not in ("zero.stage", "zero.hybrid") or not getattr(zero, "strategy", ""):
    return cfg
  stage, hybrid = zero.resolved
  return dataclasses.replace(cfg, zero=dataclasses.replace(zero, stage=stage, hybrid=hybrid,
                                                           strategy=""))


def check_literals(cfg: Any, _prefix: str = "") -> None:
  """Rejects a Literal-typed field holding a value outside its choices."""
  for name, typ in _field_types(type(cfg)).items():
    value = getattr(cfg, name)
    if dataclasses.is_dataclass(value):
      check_literals(value, _prefix + name + ".")
    elif get_origin(typ) is Literal and not any(value == c and type(value) is type(c)
                                                for c in get_args(typ)):
      raise ConfigError(f"{_prefix}{name}={value!r} is not valid; choose one of: "
                        + ", ".join(map(str, get_args(typ))))


# What a plain annotation accepts (a bool is no int setting), and how a message names it.
_ACCEPTS = {int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
            float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a float"),
            str: (lambda v: isinstance(v, str), "a string"),
            bool: (lambda v: isinstance(v, bool), "True or False"),
            type: (lambda v: isinstance(v, type), "a class")}


def check_types(cfg: Any, _prefix: str = "") -> None:
  """Rejects a field whose value is not of its annotated type (a config file's
  ``global_batch=256 / 2`` or ``lr="3e-4"``), and a float that is not finite. A Literal
  field is check_literals'; a section recurses."""
  for name, typ in _field_types(type(cfg)).items():
    value, key = getattr(cfg, name), _prefix + name
    if dataclasses.is_dataclass(typ) and not isinstance(value, typ):
      raise ConfigError(f"{key}={value!r} must be a {typ.__name__} section")
    if dataclasses.is_dataclass(typ):
      check_types(value, key + ".")
    elif get_origin(typ) is not Literal:
      _check_value(key, value, typ)


def _check_value(key: str, value: Any, typ: Any) -> None:
  """`value` against a plain annotation or an Optional of one (others are not checked)."""
  options = get_args(typ) if get_origin(typ) in (Union, types.UnionType) else (typ,)
  kinds = [t for t in options if t is not type(None)]
  if (value is None and len(kinds) < len(options)) or not all(t in _ACCEPTS for t in kinds):
    return  # None where allowed; or a Python object jaxzero.Engine sets
  if not any(_ACCEPTS[t][0](value) for t in kinds):
    names = [_ACCEPTS[t][1] for t in kinds] + (["None"] if len(kinds) < len(options) else [])
    raise ConfigError(f"{key}={value!r} must be {' or '.join(names)}")
  if isinstance(value, float) and not math.isfinite(value):
    raise ConfigError(f"{key}={value} must be a finite number")
