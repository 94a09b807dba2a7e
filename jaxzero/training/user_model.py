"""The model a run trains: the Llama family, or the user's own (``model_factory``).

A factory "module:function" returns ``(model, loss_fn)`` or a dict of
jaxzero.Engine's model arguments; the model is adapted like jaxzero.Engine's
(jaxzero.api.adapters) and trained on the run's token batches [B, T+1].
"""

from __future__ import annotations

import importlib

from jaxzero.api import adapters
from jaxzero.config import Config
from jaxzero.errors import ConfigError
from jaxzero.models import trainable
from jaxzero.models.interface import Model


def model_for(cfg: Config, shard_size: int) -> Model:
  """The run's model: cfg.model_factory's, else the Llama family's of cfg.model."""
  if not cfg.model_factory:
    return trainable.llama(cfg.model)
  module_name, _, function = cfg.model_factory.partition(":")
  try:
    made = getattr(importlib.import_module(module_name), function)()
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"model_factory={cfg.model_factory!r}: {e}; put the module on PYTHONPATH "
                      "or beside the config file") from None
  spec = made if isinstance(made, dict) else dict(zip(("model", "loss_fn"), made))
  if {"model", "loss_fn"} - set(spec):
    raise ConfigError(f"model_factory={cfg.model_factory!r} must return (model, loss_fn) or a "
                      "dict with model and loss_fn")
  model, loss_fn = spec.pop("model"), spec.pop("loss_fn")
  options = {"min_size": cfg.zero.min_shard_size}  # the factory's own min_shard_size wins
  options.update({{"min_shard_size": "min_size"}.get(k, k): v for k, v in spec.items()})
  return adapters.build(model, loss_fn, shard_size=shard_size, **options)
