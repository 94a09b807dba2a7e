"""Shared command-line plumbing: one-line errors with exit code 2, config loading."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import signal
import sys
from typing import Any

from jaxzero import config as config_lib
from jaxzero.errors import UserError
from jaxzero.runtime import distributed, peerwatch
from jaxzero.parallel import mesh as mesh_lib


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line, exit code 2."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


def add_config_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--config", required=True, help="config file defining get_config()")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field by its dotted name, e.g. train.steps=10")


@dataclasses.dataclass
class Loaded:
  """A command's config, with where each value came from, before the batch sizes a
  DeepSpeed file leaves to the device count ("auto") are resolved."""
  cfg: config_lib.Config
  origins: dict[str, str]  # dotted key -> "base", "CONFIG_FILE", "FILE: KEY", "--set" or
  # "auto: ..."
  file: Any = None  # the translated DeepSpeed or Accelerate file (frameworks.translated_file)
  sets: tuple[str, ...] = ()  # the dotted keys --set gave

  def resolve(self, n_devices: int) -> config_lib.Config:
    """The config on `n_devices` devices (all processes'), checked."""
    if self.file is None or self.file.batch is None:
      return self.cfg
    from jaxzero.frameworks import deepspeed  # pylint: disable=import-outside-toplevel
    cfg, how = deepspeed.resolve_batch(self.cfg, self.file, n_devices, self.sets)
    self.origins.update(how)
    config_lib.validate(cfg)
    return cfg

  def describe(self, n_devices: int) -> str:
    """Every KEY=VALUE (each usable as --set, quoted for the shell where it needs to be),
    then where it came from."""
    cfg = self.resolve(n_devices)
    return "\n".join(f"{shlex.quote(f'{key}={value}')}  # {self.origins.get(key, 'base')}"
                     for key, value in config_lib.as_dotted(cfg).items())


def load_config(args) -> Loaded:
  """Loads the config and, before JAX starts, creates the CPU devices its mesh needs.

  A DeepSpeed (`--deepspeed`) or Accelerate (`--accelerate-config`) file, where
  the command takes one, applies over the config file, and `--set` over that;
  the checks run on the result.
  """
  ds_config = getattr(args, "deepspeed", None)
  accelerate_config = getattr(args, "accelerate_config", None)
  if ds_config and accelerate_config:
    raise UserError("--deepspeed and --accelerate-config both say how to shard; give one")
  sets = tuple(config_lib.MOVED_KEYS.get(k, k) for k in
               (a.partition("=")[0].strip() for a in args.set))
  # What the config file changes from the base config is the file's (as --print-config
  # says); a DeepSpeed or Accelerate file's keys and --set then apply over it.
  preset = config_lib.read(args.config)
  base = config_lib.as_dotted(config_lib.base())
  origins = {key: args.config for key, value in config_lib.as_dotted(preset).items()
             if base.get(key) != value}
  file = None
  if ds_config or accelerate_config:
    # pylint: disable-next=import-outside-toplevel
    from jaxzero.frameworks import accelerate, deepspeed, translated_file
    reader = deepspeed if ds_config else accelerate
    cfg = preset
    config_lib.validate(cfg)
    # The file reads its "auto" values (the HF Trainer's) and what it derives from the
    # config (a warmup floor as a ratio of the lr) from the config with the training
    # settings of --set applied, as the Trainer fills them from its command line
    # (--learning_rate, --bf16, --gradient_checkpointing); the layout (mesh, zero, offload)
    # is the file's. --set then applies over the file.
    training = [a for a, key in zip(args.set, sets)
                if key.split(".")[0] in ("train", "precision", "remat")]
    file = reader.read(ds_config or accelerate_config, config_lib.apply_overrides(cfg, training))
    cfg = translated_file.apply_file(file, cfg)
    origins |= {key: f"{file.source}: {origin}" + (' ("auto": the base\'s)' if origin in file.autos
                                                  else "")
               for key, (_, origin) in file.settings.items()}
    named = cfg.zero.strategy
    cfg = config_lib.apply_overrides(cfg, args.set)
    config_lib.validate(cfg)
  else:
    cfg = config_lib.apply_overrides(preset, args.set)
    config_lib.validate(cfg)
  # --set zero.stage or zero.hybrid spells out the strategy named before it (the config
  # file's, the DeepSpeed or Accelerate file's, or an earlier --set's: apply_overrides);
  # what the strategy decided is then its origin's.
  replaced = [k for k in ("zero.stage", "zero.hybrid") if k in sets]
  named_by_set = [a.partition("=")[2].strip() for a, key in zip(args.set, sets)
                  if key == "zero.strategy"]
  if named_by_set:
    named, was = named_by_set[-1], "--set"
  elif file is None:
    named, was = preset.zero.strategy, args.config
  else:
    was = origins.get("zero.strategy", "base")
  origins.update({key: "--set" for key in sets})
  if named and not cfg.zero.strategy and replaced:
    origins.update({key: was for key in ("zero.stage", "zero.hybrid") if key not in sets})
    origins["zero.strategy"] = f"--set {replaced[0]} replaces {named} ({was})"
  mesh_lib.use_cpu_devices_for(cfg.mesh)  # -1 means what it means to jaxzero.plan
  return Loaded(cfg, origins, file, sets)


# Exceptions that mean bad input, not a bug: reported in one line.
USER_ERRORS = (UserError, FileNotFoundError)


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
  except BrokenPipeError:
    # The reader of stdout left (`--print-config | head`): what it read is the output.
    # Stdout goes to devnull so that the exit's flush does not fail again; the status
    # is a shell's for a process that SIGPIPE ended.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + int(signal.SIGPIPE)
  except USER_ERRORS as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    if distributed.joined():
      # A normal exit would wait in JAX's shutdown barrier while the other
      # processes wait in a collective for this one: leave at once instead,
      # telling them why (they stop on the same error, or name this process).
      peerwatch.leaving(failed=True)
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(2)  # pylint: disable=protected-access
    return 2
  except Exception:
    if distributed.joined():
      # A collective that fails because a peer died races the watch's report of
      # that peer (from its own thread): give the watch the moment it needs to
      # name the lost process and exit, before this error's traceback prints.
      peerwatch.settle()
    raise

