"""The built-in model a config names: the Llama family (jaxzero.models.trainable), with
LoRA adapters on it where ``lora.rank`` is set (jaxzero.models.lora). The trainer, the
planner and the start-up check all build it here, so they plan what runs."""

from __future__ import annotations

from jaxzero.config import Config
from jaxzero.models import lora, trainable
from jaxzero.models.interface import Model


def builtin_model(cfg: Config) -> Model:
  """cfg.model as the engine trains it, with cfg.lora's adapters where rank > 0."""
  if cfg.lora.rank:
    return lora.lora_llama(cfg.model, cfg.lora.rank, cfg.lora.alpha,
                           lora.resolve_targets(cfg.lora.targets), cfg.zero.min_shard_size,
                           cfg.lora.base_dtype, cfg.precision.matmul, cfg.lora.dropout)
  return trainable.llama(cfg.model, cfg.precision.matmul)
