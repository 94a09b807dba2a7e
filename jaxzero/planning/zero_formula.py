"""The ZeRO paper's per-device model state: bytes per parameter of each role, and the
formula of each stage (16Φ, 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N with bf16 compute and
grads), to compare with what the shardings give (jaxzero.runners: ``Runner.plan``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxzero import engine as engine_lib
from jaxzero.config import Config
from jaxzero.models.llama import count_params
from jaxzero.parallel.zero import SHARDED_ROLES, Layout

# AdamW's fp32 master weights and its two moments, per parameter.
OPTIMIZER_BYTES_PER_PARAM = 12


def bytes_per_param(cfg: Config) -> dict[str, int]:
  return {"params": jnp.dtype(engine_lib.dtype_of(cfg.precision.compute)).itemsize,
          "grads": jnp.dtype(engine_lib.dtype_of(cfg.zero.grad_dtype)).itemsize,
          "optimizer": OPTIMIZER_BYTES_PER_PARAM}


def theory_state_bytes(cfg: Config, layout: Layout, phi: int | None = None,
                       phi_frozen: int = 0, frozen_bytes: int | None = None) -> tuple[int, str]:
  """The ZeRO paper's per-device model state, and the formula as text.

  Each role costs its bytes per parameter times Φ (`phi`, default the config's
  Llama's), divided by N where the stage shards it. With bf16 compute and bf16
  grads this is the paper's 16Φ, 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N for stages 0-3.
  Frozen weights (`phi_frozen`, Φf: a LoRA base) add their compute copy, sharded at
  every stage: 2Φf/N in bf16, or `frozen_bytes` (all of them, unsharded) where
  the base is stored otherwise (quantized: about 0.5Φf/N in nf4).
  """
  phi = count_params(cfg.model) if phi is None else phi
  n, t = layout.shard_size, layout.tensor_size
  per_param = bytes_per_param(cfg)
  sharded = sum(b for role, b in per_param.items() if role in SHARDED_ROLES[layout.stage])
  replicated = sum(per_param.values()) - sharded
  terms = ([f"{replicated}Φ"] if replicated else []) + ([f"{sharded}Φ/N"] if sharded else [])
  frozen = per_param["params"] * phi_frozen if frozen_bytes is None else frozen_bytes
  if phi_frozen:
    terms.append(f"{frozen / phi_frozen:.2g}Φf/N")
  formula = " + ".join(terms) if t == 1 else f"({' + '.join(terms)})/T"  # T = mesh.tensor
  return round((replicated * phi + (sharded * phi + frozen) / n) / t), formula
