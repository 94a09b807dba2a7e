"""Per-device bytes of the train state, counted from its shardings (exact).

What each role (params, grads, optimizer) costs a device, what sits in
pinned_host and in the NVMe tier's files, what moves between host and device
per step, and the ZeRO paper's formula to compare with. Nothing is compiled
or allocated: the planner (jaxzero.planning.planner) and the pre-flight memory check
(jaxzero.planning.memory_check) read these beside XLA's own figures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxzero import engine as engine_lib
from jaxzero.config import Config
from jaxzero.models.llama import count_params
from jaxzero.sharding.zero import SHARDED_ROLES, Layout, bytes_per_device

# AdamW's fp32 master weights and its two moments, per parameter.
OPTIMIZER_BYTES_PER_PARAM = 12


def state_bytes(engine: engine_lib.Engine) -> dict[str, int]:
  """Per-device bytes of each role, and of the leaves placed in pinned_host."""
  cfg, layout, abstract, sh = engine.cfg, engine.layout, engine.abstract, engine.shardings
  grad_dtype = engine_lib.dtype_of(cfg.zero.grad_dtype)
  abstract_grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, grad_dtype),
                                abstract.master)
  host = sum(_bytes_in_memory(getattr(abstract, name), getattr(sh, name), "pinned_host")
             for name in ("params", "master", "opt_state"))
  return {
      "transfer": transfer_bytes(engine),
      "nvme": nvme_bytes(engine),
      "params": bytes_per_device(abstract.params, sh.params),
      "grads": bytes_per_device(abstract_grads,
                                layout.tree_shardings(engine.model.specs, "grads")),
      "optimizer": (bytes_per_device(abstract.master, sh.master)
                    + bytes_per_device(abstract.opt_state, sh.opt_state)),
      "host": host,
  }


def nvme_bytes(engine: engine_lib.Engine) -> int:
  """Per-device bytes in the NVMe tier's files (0 without it): the fp32 master weights
  and the optimizer's per-weight leaves (a process stores a replicated shard once)."""
  if engine.cfg.offload.optimizer != "nvme":
    return 0
  abstract, sh = engine.abstract, engine.shardings
  per_weight = lambda tree: optax.tree_map_params(engine.tx, lambda x: x, tree,
                                                  transform_non_params=lambda _: None)
  return (bytes_per_device(abstract.master, sh.master)
          + bytes_per_device(per_weight(abstract.opt_state), per_weight(sh.opt_state)))


def transfer_bytes(engine: engine_lib.Engine) -> int:
  """Bytes one device moves between host and device memory in a step, both ways.

  Optimizer in pinned_host (ZeRO-Offload): the gradient shards go down in the
  dtype they were reduced in, and the new compute-dtype shards come up (a
  host-resident compute copy at stage 3 stays on the host). Weights in
  pinned_host: streamed to the device layer by layer (Layout.gather_for_compute);
  when the update runs on the device, the new copy goes back. The NVMe tier: the
  optimizer state's chunks come up from disk through the host and go back
  (nvme_bytes).
  """
  cfg, layout, abstract, sh = engine.cfg, engine.layout, engine.abstract, engine.shardings
  cast_shards = bytes_per_device(abstract.params, sh.master)  # compute dtype, optimizer layout
  moved = 2 * nvme_bytes(engine)
  if layout.optimizer_memory == "pinned_host":
    reduced = jnp.float32 if layout.reduces_once else engine_lib.dtype_of(cfg.zero.grad_dtype)
    grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, reduced), abstract.master)
    moved += bytes_per_device(grads, sh.master)
    moved += 0 if layout.params_memory == "pinned_host" else cast_shards
  if layout.params_memory == "pinned_host":
    params = bytes_per_device(abstract.params, sh.params)
    layers = bytes_per_device(abstract.params["layers"], sh.params["layers"])
    # The embedding, head and final norm come up once. Each micro-step, every
    # layer's shard comes up for the forward pass and again for the backward (no
    # remat policy keeps it), and its gradient shard goes down as the backward
    # produces it and comes back up after.
    moved += (params - layers) + cfg.train.grad_accum * 4 * layers
    if layout.optimizer_memory != "pinned_host":
      moved += params  # the updated compute copy goes back down
  return moved


def _bytes_in_memory(abstract, shardings, kind: str) -> int:
  pairs = [(a, s) for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
           if s.memory_kind == kind]
  return bytes_per_device([a for a, _ in pairs], [s for _, s in pairs])


def bytes_per_param(cfg: Config) -> dict[str, int]:
  return {"params": jnp.dtype(engine_lib.dtype_of(cfg.precision.compute)).itemsize,
          "grads": jnp.dtype(engine_lib.dtype_of(cfg.zero.grad_dtype)).itemsize,
          "optimizer": OPTIMIZER_BYTES_PER_PARAM}


def theory_state_bytes(cfg: Config, layout: Layout, phi: int | None = None) -> tuple[int, str]:
  """The ZeRO paper's per-device model state, and the formula as text.

  Each role costs its bytes per parameter times Φ (`phi`, default the config's
  Llama's), divided by N where the stage shards it. With bf16 compute and bf16
  grads this is the paper's 16Φ, 4Φ + 12Φ/N, 2Φ + 14Φ/N, 16Φ/N for stages 0-3.
  """
  phi = count_params(cfg.model) if phi is None else phi
  n, t = layout.shard_size, layout.tensor_size
  per_param = bytes_per_param(cfg)
  sharded = sum(b for role, b in per_param.items() if role in SHARDED_ROLES[layout.stage])
  replicated = sum(per_param.values()) - sharded
  terms = ([f"{replicated}Φ"] if replicated else []) + ([f"{sharded}Φ/N"] if sharded else [])
  formula = " + ".join(terms) if t == 1 else f"({' + '.join(terms)})/T"  # T = mesh.tensor
  return round((replicated * phi + sharded * phi / n) / t), formula
