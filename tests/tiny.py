"""A tiny model's config, its initial state and batches drawn on the host, its step
compiled ahead of time and run, and a checkpoint's weights read back, for tests that
train it."""

import dataclasses

import jax
import numpy as np

from jaxzero import config
from jaxzero import engine as engine_lib
from jaxzero.checkpoint.reader import CheckpointReader
from jaxzero.models import trainable
from jaxzero.models.llama import LlamaConfig, is_param_spec, param_specs
from jaxzero.parallel import mesh
from jaxzero.parallel.zero import Layout
from jaxzero.planning import planner
from jaxzero.runners.base import InMemoryRunner


def tiny_config(stage: int, nonfinite: str) -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c, model=LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           mlp_dim=64, rope_theta=10_000.0),
      zero=config.ZeroConfig(stage=stage), mesh=config.MeshConfig(replica=1, fsdp=8),
      train=dataclasses.replace(c.train, steps=5, global_batch=16, grad_accum=1, seq_len=16,
                                lr=3e-3, warmup_steps=1, nonfinite=nonfinite, max_nonfinite=2),
      precision=config.PrecisionConfig(compute="float32"),
      checkpoint=config.CheckpointConfig(every=1, keep=10),
      data=config.DataConfig(max_bytes=200_000))


def master_at(workdir, step_no):
  with CheckpointReader(workdir) as reader:
    shapes = reader.leaf_shapes(step_no)
    name = "master/layers/w_up_LxDxF"
    return reader.read(step_no, tuple(name.split("/")), shapes[name])


# The tiny preset, smaller, in float32: 10 steps, saved at 5 and 10 (ZeRO-Infinity's tests).
INFINITY_SETS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
                 "train.seq_len=16", "precision.compute=float32", "train.steps=10",
                 "train.warmup_steps=1", "train.lr=3e-3", "train.log_every=1",
                 "data.max_bytes=200000", "checkpoint.every=5"]


def infinity_sets(nvme_dir, params="nvme"):
  """offload.params=nvme (or `params`) with the optimizer state on NVMe in `nvme_dir`."""
  return ["offload.optimizer=nvme", f"offload.params={params}", f"offload.nvme_dir={nvme_dir}"]


def initial_state_and_batches(cfg: config.Config, steps: int, seed: int = 0):
  """(a TrainState on the host, token batches [steps, A, B, T+1]) for `cfg`: the weights
  drawn on the host as the model's initialisers do (jitting Llama's init costs a compile)."""
  model, t = cfg.model, cfg.train
  rng = np.random.default_rng(seed)
  master = jax.tree.map(
      lambda s: (np.ones(s.shape, np.float32) if s.init == "ones" else
                 (model.init_std * rng.standard_normal(s.shape)).astype(np.float32)),
      param_specs(model), is_leaf=is_param_spec)
  state = jax.device_get(engine_lib.TrainState(np.zeros((), np.int32), master, master,
                                               engine_lib.make_optimizer(cfg).init(master)))
  tokens = rng.integers(0, model.vocab_size,
                        (steps, t.grad_accum, t.global_batch // t.grad_accum, t.seq_len + 1),
                        dtype=np.int32)
  return state, tokens


def make_engine(cfg: config.Config) -> engine_lib.TrainProgram:
  """The engine of `cfg` (validated) on the first devices its mesh needs."""
  config.validate(cfg)
  devices = jax.devices()[:mesh.devices_needed(cfg.mesh)]
  replica, fsdp, tensor = mesh.resolve_shape(cfg.mesh, len(devices))
  layout = Layout.from_config(cfg, mesh.make_mesh(replica, fsdp, devices, tensor,
                                                  cfg.mesh.pipeline))
  return engine_lib.TrainProgram(cfg, layout, trainable.llama(cfg.model))


_COMPILED: dict = {}  # config -> (engine, its compiled step): a process compiles each once


def compiled_step(cfg: config.Config):
  """(engine, its train step compiled with the planner's fast options), once per config."""
  if cfg not in _COMPILED:
    engine = make_engine(cfg)
    micro = mesh.micro_batch(cfg.train, engine.layout.data_parallel_size)
    _COMPILED[cfg] = engine, planner.compile_step(InMemoryRunner(engine), micro)
  return _COMPILED[cfg]


def run_steps(cfg: config.Config, state, tokens_SxAxBxT1: np.ndarray):
  """(losses, final state) of len(tokens) steps from `state` (host arrays or a state)."""
  engine, compiled = compiled_step(cfg)
  state = jax.device_put(state, engine.shardings)
  losses = []
  for tokens in tokens_SxAxBxT1:
    state, metrics = compiled(state, jax.device_put(tokens, engine.batch_sharding))
    losses.append(float(metrics["loss"]))
  return np.array(losses), state
