"""Weights & Biases for a run (``log.wandb=PROJECT``): process 0 logs what TensorBoard gets.

The run's id is kept in ``WORKDIR/wandb_run_id``, so a resumed run continues the
same W&B run. ``wandb`` is an optional extra; asking for it without the package is
one line naming the extra, before anything is built.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import pathlib
import secrets

from jaxzero import config as config_lib
from jaxzero.errors import ConfigError

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"


def check(log_cfg: config_lib.LogConfig) -> None:
  """Raises ConfigError (one line) when W&B is asked for and not installed."""
  if log_cfg.wandb and log_cfg.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
    raise ConfigError(f"log.wandb={log_cfg.wandb} needs the wandb package: "
                      "pip install 'jaxzero[wandb]' (or set log.wandb_mode=disabled)")


class WandbRun:
  """One W&B run: the same scalars as TensorBoard, at each logged step."""

  def __init__(self, cfg: config_lib.Config, workdir: pathlib.Path, figures: dict):
    import wandb  # pylint: disable=import-outside-toplevel
    c = cfg.log
    id_file = workdir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    workdir.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id + "\n")
    self._run = wandb.init(
        project=c.wandb, entity=c.wandb_entity or None, name=c.wandb_name or workdir.name,
        group=c.wandb_group or None, mode=c.wandb_mode, dir=str(workdir), id=run_id,
        resume="allow", config={**config_lib.as_dotted(cfg), **figures})
    log.info("W&B run %s (%s) in project %s", run_id, c.wandb_mode, c.wandb)

  def log(self, values: dict[str, float], step: int) -> None:
    finite = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
    if finite:
      self._run.log(finite, step=step)

  def close(self) -> None:
    self._run.finish()


def start(cfg: config_lib.Config, workdir: pathlib.Path, figures: dict) -> WandbRun | None:
  """Process 0's W&B run when log.wandb asks for one, else None."""
  import jax  # pylint: disable=import-outside-toplevel
  if not cfg.log.wandb or cfg.log.wandb_mode == "disabled" or jax.process_index() != 0:
    return None
  return WandbRun(cfg, workdir, figures)
