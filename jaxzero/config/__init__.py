"""Typed, frozen configuration: the dataclasses, loading, dotted overrides, checks.

A config file defines ``get_config()`` returning a :class:`Config`; presets are a few lines
derived from :func:`base` with ``dataclasses.replace``. Each module a run goes through takes
only the sections it needs. Reading a config starts no JAX backend, so the CLI can decide how
many virtual CPU devices to create before JAX starts.
"""

from jaxzero.config.loading import (load, notices, read, validate, validate_frozen_offload,
                                    validate_offload, validate_precision)
from jaxzero.config.mesh_checks import validate_pipeline
from jaxzero.config.overrides import (MOVED_KEYS, apply_overrides, as_dotted, check_literals,
                                      check_types, override)
from jaxzero.config.sections import (STRATEGIES, CheckpointConfig, Config, ContextConfig,
                                     DataConfig,
                                     DistributedConfig, Dtype, EvalConfig, InitConfig, LogConfig,
                                     LoraConfig,
                                     MemoryKind, MeshConfig, OffloadConfig, PipelineConfig,
                                     PrecisionConfig, ProfileConfig, RematConfig, TrainConfig,
                                     ZeroConfig, base, strategy_name)
from jaxzero.errors import ConfigError

__all__ = ["notices", "MOVED_KEYS", "STRATEGIES", "CheckpointConfig", "Config", "ConfigError",
           "ContextConfig", "DataConfig",
           "DistributedConfig", "Dtype", "EvalConfig", "InitConfig", "LogConfig", "LoraConfig", "MemoryKind",
           "MeshConfig", "OffloadConfig", "PipelineConfig", "PrecisionConfig", "ProfileConfig",
           "RematConfig", "TrainConfig", "ZeroConfig", "apply_overrides", "as_dotted", "base",
           "check_literals", "check_types", "load", "override", "read", "strategy_name", "validate",
           "validate_frozen_offload", "validate_offload", "validate_pipeline",
           "validate_precision"]
