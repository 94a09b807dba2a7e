"""XLA flags jaxzero sets on GPU so that ZeRO's collectives overlap with compute.

ZeRO-3 turns every layer's weights into all-gathers and its gradients into
reduce-scatters. By default XLA runs them where they appear; these flags let
the latency-hiding scheduler start them early, combine the per-weight
collectives of a layer into a few large transfers, and pipeline them across
the iterations of the scan over layers. XLA aborts at start-up on a flag it
does not know, so this list holds only flags that jaxlib 0.10's XLA accepts.

Values given in ``XLA_FLAGS`` always win; ``JAXZERO_XLA_GPU_FLAGS=0`` turns
the defaults off entirely. Must run before JAX starts its backends.
"""

from __future__ import annotations

import importlib.util
import os

_MiB = 1024 * 1024

GPU_DEFAULTS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # One layer's gathers or reductions become a few large transfers.
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * _MiB),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * _MiB),
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * _MiB),
    # Gather layer i+1's weights and reduce layer i-1's gradients during layer i.
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
}

_GPU_PLATFORMS = ("cuda", "gpu", "rocm")
_GPU_PLUGIN_MODULES = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def flag_names(flags: str) -> set[str]:
  """Names of the flags in an XLA_FLAGS string: '--a=1 --b' -> {'a', 'b'}."""
  return {token.lstrip("-").split("=", 1)[0] for token in flags.split() if token.startswith("--")}


def merge(user_flags: str, defaults: dict[str, str]) -> str:
  """`user_flags` plus each default the user did not set; the user's values win."""
  given = flag_names(user_flags)
  added = [f"--{name}={value}" for name, value in defaults.items() if name not in given]
  return " ".join([user_flags.strip(), *added]).strip()


def gpu_will_be_used(environ=os.environ) -> bool:
  """True when JAX is going to pick a GPU: asked for by JAX_PLATFORMS, or a plugin is installed."""
  platforms = environ.get("JAX_PLATFORMS", "").lower()
  if platforms:
    return any(p.strip() in _GPU_PLATFORMS for p in platforms.split(","))
  return any(importlib.util.find_spec(name) is not None for name in _GPU_PLUGIN_MODULES)


def apply_gpu_defaults(environ=os.environ) -> bool:
  """Adds GPU_DEFAULTS to XLA_FLAGS when a GPU will be used; returns whether it did."""
  if environ.get("JAXZERO_XLA_GPU_FLAGS", "1").lower() in ("0", "false", "no", "off"):
    return False
  if not gpu_will_be_used(environ):
    return False
  environ["XLA_FLAGS"] = merge(environ.get("XLA_FLAGS", ""), GPU_DEFAULTS)
  return True
