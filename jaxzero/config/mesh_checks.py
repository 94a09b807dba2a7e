"""The device mesh's axes checked against the model and the step, before anything runs:
pipeline stages of whole layers with a micro-batch each, context parts that attention
tiles whole, tensor groups that divide the heads, the MLP width and the vocabulary."""

from __future__ import annotations

import dataclasses
import math

from jaxzero.config.sections import Config
from jaxzero.errors import ConfigError


def validate_pipeline(cfg: Config, layers: int) -> None:
  """The pipeline checks, for a model of `layers` stacked layers (jaxzero.Engine's own)."""
  check_pipeline(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=layers)))


def check_pipeline(cfg: Config) -> None:
  """mesh.pipeline: stages of whole layers, at least one micro-batch per stage, on what
  the pipelined step runs (jaxzero.parallel.pipeline)."""
  stages, layers = cfg.mesh.pipeline, cfg.model.n_layers
  if stages < 1:
    raise ConfigError(f"mesh.pipeline={stages} must be a positive stage count (1 = off)")
  virtual = cfg.pipeline.virtual_stages
  if (cfg.pipeline.schedule == "interleaved") != (virtual > 1) or virtual < 1:
    raise ConfigError(f"pipeline.virtual_stages={virtual} with pipeline.schedule="
                      f"{cfg.pipeline.schedule}: the interleaved schedule takes virtual_stages "
                      ">= 2, the others 1")
  if stages == 1:
    return
  if cfg.model_factory:
    raise ConfigError(f"mesh.pipeline={stages}: the pipeline axis runs the Llama family's "
                      "stacked layers; a model_factory model trains with mesh.pipeline=1")
  if layers % stages:
    valid = ", ".join(str(d) for d in range(1, layers + 1) if layers % d == 0)
    raise ConfigError(f"mesh.pipeline={stages} does not divide model.n_layers={layers} into "
                      f"stages of whole layers; valid values: {valid}")
  if layers % (stages * virtual):
    valid = ", ".join(str(v) for v in range(2, layers // stages + 1)
                      if layers % (stages * v) == 0) or "none"
    raise ConfigError(f"pipeline.virtual_stages={virtual} does not divide the "
                      f"{layers // stages} layers of each of the mesh.pipeline={stages} stages "
                      f"into chunks of whole layers; valid values: {valid}")
  if cfg.train.grad_accum < stages:
    raise ConfigError(f"train.grad_accum={cfg.train.grad_accum} gives fewer micro-batches than "
                      f"mesh.pipeline={stages} stages: use train.grad_accum >= {stages} (the "
                      "step's micro-batches are the pipeline's)")
  if cfg.pipeline.schedule == "1f1b" and cfg.remat.policy == "offload_matmuls":
    # (A stage's slot is a lax.cond of forward, backward or idle: the forward's residuals
    # would be in host memory and the others' on the device, and a cond's branches must
    # agree.)
    raise ConfigError("remat.policy=offload_matmuls with pipeline.schedule=1f1b is not "
                      "supported; use pipeline.schedule=gpipe or interleaved, or another "
                      "remat.policy (full, save_matmuls, save_attention, none)")
  if cfg.pipeline.schedule == "1f1b" and cfg.mesh.context > 1 and cfg.context.strategy == "ring":
    # (The ring's hops are collective permutes inside each stage's slot, and in a 1F1B
    # tick the stages take different branches: the idle stage's devices never join the
    # hop, and the step waits until the collective times out.)
    raise ConfigError("context.strategy=ring with pipeline.schedule=1f1b is not supported; "
                      "use context.strategy=all_gather, or pipeline.schedule=gpipe or "
                      "interleaved")
  for key, value, allowed in (("offload.params", cfg.offload.params, ("device",)),
                              ("offload.optimizer", cfg.offload.optimizer,
                               ("device", "pinned_host"))):
    if value not in allowed:
      raise ConfigError(f"mesh.pipeline={stages} with {key}={value} is not supported; "
                        "pipeline runs keep the weights on the device and the optimizer on "
                        "the device or in pinned_host")


# Attention's largest tile (jaxzero.models.attention.DEFAULT_BLOCK), and the granule a
# device's part of a longer sequence must come in for tiles of a useful size.
ATTENTION_TILE, CONTEXT_TILE = 512, 128


def check_context(cfg: Config) -> None:
  """mesh.context splits each sequence of train.seq_len tokens into equal parts."""
  context, seq = cfg.mesh.context, cfg.train.seq_len
  if context < 1:
    raise ConfigError(f"mesh.context={context} must be a positive device count (1 = off)")
  if seq % context:
    raise ConfigError(f"mesh.context={context} does not divide train.seq_len={seq} into equal "
                      f"parts; valid values: {_valid_contexts(cfg)}")
  if context > 1 and cfg.model_factory:
    raise ConfigError(f"mesh.context={context}: the context axis splits the Llama family's "
                      "sequence; a model_factory model trains with mesh.context=1")
  balanced = context > 1 and cfg.context.load_balance
  if balanced and seq % (2 * context):
    raise ConfigError(f"context.load_balance needs train.seq_len={seq} cut into "
                      f"2 x mesh.context={2 * context} equal chunks; make seq_len a multiple "
                      f"of {2 * context}, or set context.load_balance=False (mesh.context "
                      f"values that fit: {_valid_contexts(cfg)})")
  # The piece of the sequence attention tiles whole: a device's part, or half of it.
  part = seq // context // (2 if balanced else 1)
  if context > 1 and part > ATTENTION_TILE and part % CONTEXT_TILE:
    raise ConfigError(f"mesh.context={context} leaves attention pieces of {part} positions "
                      f"of train.seq_len={seq} (a device's part"
                      f"{', halved by context.load_balance' if balanced else ''}); it tiles "
                      f"them whole, so make that at most {ATTENTION_TILE} or a multiple "
                      f"of {CONTEXT_TILE}")
  if context > 1 and cfg.model.attention == "cudnn":
    raise ConfigError(f"mesh.context={context} with model.attention=cudnn: cuDNN's attention "
                      "takes no query offset here; use model.attention=auto (blockwise)")


def context_fits(seq: int, context: int, balanced: bool) -> bool:
  """Whether `context` cuts `seq` into equal parts (halved again where `balanced`) that
  attention tiles whole."""
  chunks = context * (2 if balanced and context > 1 else 1)
  if seq % chunks:
    return False
  part = seq // chunks
  return context == 1 or part <= ATTENTION_TILE or part % CONTEXT_TILE == 0


def _valid_contexts(cfg: Config) -> str:
  """The mesh.context values up to 64 that train.seq_len and context.load_balance allow."""
  seq = cfg.train.seq_len
  return ", ".join(str(d) for d in range(1, min(seq, 64) + 1)
                   if context_fits(seq, d, cfg.context.load_balance))


def check_tensor(tensor: int, model) -> None:
  """mesh.tensor must divide the heads, the MLP width and the vocabulary (the
  KV heads are replicated across the tensor group when it does not divide them)."""
  if tensor < 1:
    raise ConfigError(f"mesh.tensor={tensor} must be a positive device count (1 = off)")
  common = math.gcd(model.n_heads, model.mlp_dim, model.vocab_size)
  if common % tensor:
    valid = [d for d in range(1, common + 1) if common % d == 0]
    raise ConfigError(
        f"mesh.tensor={tensor} must divide model.n_heads={model.n_heads}, "
        f"model.mlp_dim={model.mlp_dim} and model.vocab_size={model.vocab_size}; valid values: "
        f"{', '.join(map(str, valid))}")
