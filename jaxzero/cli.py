"""Shared command-line plumbing: one-line errors with exit code 2, config loading."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxzero import config as config_lib
from jaxzero.mesh import devices_needed, ensure_virtual_devices


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line, exit code 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


def add_config_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--config", required=True, help="config file defining get_config()")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field by its dotted name, e.g. train.steps=10")


def load_config(args) -> config_lib.Config:
  """Loads the config and, before JAX starts, creates the CPU devices its mesh needs."""
  cfg = config_lib.load(args.config, args.set)
  ensure_virtual_devices(devices_needed(cfg.mesh.replica, cfg.mesh.fsdp))
  return cfg


def user_errors() -> tuple[type[Exception], ...]:
  """Exceptions that mean bad input, not a bug: reported in one line."""
  # pylint: disable=import-outside-toplevel
  from jaxzero.checkpoint import CheckpointError
  from jaxzero.data import DataError
  return (config_lib.ConfigError, DataError, CheckpointError, FileNotFoundError)


def run_main(prog: str, body) -> int:
  """Runs `body()`; bad input becomes `prog: error: ...` on stderr and exit code 2."""
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                      datefmt="%H:%M:%S")
  # JAX logs its search for TPU/GPU plugins at INFO; only our own lines matter here.
  logging.getLogger("jax").setLevel(logging.WARNING)
  # orbax narrates every save and restore at INFO through absl.
  logging.getLogger("absl").setLevel(logging.WARNING)
  try:
    return body() or 0
  except user_errors() as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    if _joined_other_processes():
      # A normal exit would wait in JAX's shutdown barrier while the other
      # processes wait in a collective for this one: leave at once instead.
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(2)  # pylint: disable=protected-access
    return 2


def _joined_other_processes() -> bool:
  distributed = sys.modules.get("jax._src.distributed")
  return distributed is not None and distributed.global_state.client is not None
