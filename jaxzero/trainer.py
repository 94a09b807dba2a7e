"""The training loop: build mesh, layout and state, run steps, log metrics."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from typing import Callable

import jax
import numpy as np

from jaxzero import config as config_lib
from jaxzero import data as data_lib
from jaxzero import step as step_lib
from jaxzero.config import Config
from jaxzero.mesh import make_mesh
from jaxzero.metrics import MetricsLogger
from jaxzero.zero import Layout

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
  """Everything a training run builds from its config, before any step."""
  cfg: Config
  layout: Layout
  tx: object
  batches: data_lib.Batches
  step_fn: Callable


def build(cfg: Config, devices=None) -> Run:
  """Mesh, layout, optimizer, data and the jitted step for `cfg` (no state yet)."""
  devices = list(jax.devices() if devices is None else devices)
  replica, fsdp = config_lib.mesh_shape(cfg, len(devices))
  stage, hybrid = cfg.zero.resolved
  if hybrid and replica == 1:
    log.warning("hybrid sharding with mesh.replica=1 is plain stage %d", stage)
  layout = Layout(make_mesh(replica, fsdp, devices), stage, hybrid,
                  params_memory=cfg.offload.params, optimizer_memory=cfg.offload.optimizer)
  micro = config_lib.micro_batch(cfg, layout.data_parallel_size)
  tokens = data_lib.load_tokens(cfg.data.source, cfg.data.max_bytes)
  if cfg.model.vocab_size < data_lib.BYTE_VOCAB:
    raise config_lib.ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                                 f"byte vocabulary ({data_lib.BYTE_VOCAB})")
  batches = data_lib.Batches(tokens, cfg.train.seq_len, cfg.train.grad_accum,
                             micro * layout.data_parallel_size, cfg.seed)
  tx = step_lib.make_optimizer(cfg)
  return Run(cfg, layout, tx, batches, step_lib.make_train_step(cfg, layout, tx))


def global_batch(run: Run, step: int) -> jax.Array:
  """The batch of `step` as one global array; each process supplies only its rows."""
  sharding = run.layout.batch_sharding(leading_dims=1)
  shape = run.batches.shape
  index_map = sharding.addressable_devices_indices_map(shape)
  starts = [idx[1].start or 0 for idx in index_map.values()]
  stops = [idx[1].stop or shape[1] for idx in index_map.values()]
  local = run.batches(step, slice(min(starts), max(stops)))
  return jax.make_array_from_process_local_data(sharding, local, shape)


def train(cfg: Config, workdir: str | pathlib.Path, steps: int | None = None,
          devices=None, progress: bool = True) -> list[dict]:
  """Trains `cfg` for `steps` (default train.steps); returns the logged metrics."""
  run = build(cfg, devices)
  total = steps if steps is not None else cfg.train.steps
  state = step_lib.init_state(cfg, run.layout, run.tx)
  start = int(state.step)

  t0 = time.perf_counter()
  compiled = run.step_fn.lower(state, global_batch(run, start)).compile()
  log.info("compiled the train step in %.1f s", time.perf_counter() - t0)

  tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
  logger = MetricsLogger(pathlib.Path(workdir), total_steps=total, start=start,
                         enabled=progress)
  pending, last_time = [], time.perf_counter()
  for step in range(start, total):
    state, metrics = compiled(state, global_batch(run, step))
    pending.append(metrics)
    if (step + 1) % cfg.train.log_every == 0 or step + 1 == total:
      fetched = jax.device_get(pending)  # the only host sync: once per logged step
      now = time.perf_counter()
      step_time = (now - last_time) / len(pending)
      last_time = now
      for offset, m in enumerate(fetched):
        logger.log({"step": step + 2 - len(fetched) + offset,
                    **{k: float(np.asarray(v)) for k, v in m.items()},
                    "tokens_per_sec": tokens_per_step / step_time,
                    "step_time_s": step_time})
      pending = []
  logger.close()
  return logger.history
