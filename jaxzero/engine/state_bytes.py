"""Per-device bytes of a program's train state, counted from its shardings (exact).

What each role (params, grads, optimizer) costs a device (frozen weights, a LoRA base,
count as params, and alone as "frozen"), what of it sits in
pinned_host, and what moves between host and device memory per step. Nothing is
compiled or allocated. The runners add what they keep elsewhere (jaxzero.runners);
the planner and the start-up memory check read these beside XLA's own figures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxzero.engine.groups import reduces_once
from jaxzero.engine.state import dtype_of
from jaxzero.models.interface import is_spec
from jaxzero.parallel.mesh import AXES, axes_per_dimension
from jaxzero.parallel.zero import FSDP_DIM_PREFERENCE, bytes_per_device


def state_bytes(program) -> dict[str, int]:
  """Per-device bytes of each role, of the leaves placed in pinned_host, and moved
  between host and device memory per step (jaxzero.engine.TrainProgram's state)."""
  cfg, layout, abstract, sh = program.cfg, program.layout, program.abstract, program.shardings
  grad_dtype = dtype_of(cfg.zero.grad_dtype)
  abstract_grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, grad_dtype),
                                abstract.master)
  host = sum(_bytes_in_memory(getattr(abstract, name), getattr(sh, name), "pinned_host")
             for name in ("params", "master", "opt_state", "frozen")
             if getattr(abstract, name) is not None)
  frozen = bytes_per_device(abstract.frozen, sh.frozen) if abstract.frozen is not None else 0
  host_frozen = (_bytes_in_memory(abstract.frozen, sh.frozen, "pinned_host")
                 if abstract.frozen is not None else 0)
  return {
      "transfer": transfer_bytes(program),
      # Weights at rest: the trained compute copy and the frozen ones (of which "frozen").
      "params": bytes_per_device(abstract.params, sh.params) + frozen,
      "frozen": frozen,
      "grads": bytes_per_device(abstract_grads,
                                layout.tree_shardings(program.model.specs, "grads")),
      "optimizer": (bytes_per_device(abstract.master, sh.master)
                    + bytes_per_device(abstract.opt_state, sh.opt_state)),
      "host": host,
      "host_frozen": host_frozen,  # of which frozen weights (they have no gradient)
  }


def transfer_bytes(program) -> int:
  """Bytes one device moves between host and device memory in a step, both ways, for
  weights in pinned_host: streamed to the device layer by layer (jaxzero.engine.hooks),
  the updated copy sent back. (A runner that keeps the optimizer state off the device
  adds its own: jaxzero.runners.)
  """
  cfg, layout, abstract, sh = program.cfg, program.layout, program.abstract, program.shardings
  key = program.model.layers_key
  layers_of = lambda tree, shardings: (bytes_per_device(tree[key], shardings[key])
                                       if key in tree else 0)
  moved = 0
  if layout.params_memory == "pinned_host":
    params = bytes_per_device(abstract.params, sh.params)
    layers = layers_of(abstract.params, sh.params)
    # The rest (the embedding, head and final norm; a model without stacked layers,
    # whole) comes up once. Each micro-step, every layer's shard comes up for the forward
    # pass and again for the backward (no remat policy keeps it), and its gradient shard
    # goes down as the backward produces it and comes back up after.
    moved += (params - layers) + cfg.train.grad_accum * 4 * layers
    moved += params  # the updated compute copy goes back down
    if abstract.frozen is not None:  # frozen weights: up for the forward and the backward
      frozen = bytes_per_device(abstract.frozen, sh.frozen)
      frozen_layers = layers_of(abstract.frozen, sh.frozen)
      moved += (frozen - frozen_layers) + cfg.train.grad_accum * 2 * frozen_layers
  return moved


def grad_bytes_per_param(program) -> int:
  """The bytes of a reduced gradient, per parameter: float32 where stages 0-1 reduce
  once (jaxzero.engine.groups), else the grad dtype."""
  dtype = jnp.float32 if reduces_once(program.layout) else dtype_of(program.cfg.zero.grad_dtype)
  return jnp.dtype(dtype).itemsize


def _bytes_in_memory(abstract, shardings, kind: str) -> int:
  pairs = [(a, s) for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
           if s.memory_kind == kind]
  return bytes_per_device([a for a, _ in pairs], [s for _, s in pairs])


def kept_whole(program) -> dict:
  """What of the state ZeRO keeps whole on every device although its stage shards the
  optimizer: {"bytes": per device, of those parameters' compute copy, gradient, master
  weights and optimizer state, from their shardings; "leaves": how many parameters;
  "why": the reason, one line}. Nothing at stage 0 or on one device (whole by choice)."""
  layout, abstract, sh = program.layout, program.abstract, program.shardings
  if layout.shard_size == 1 or not layout.is_sharded("optimizer"):
    return {"bytes": 0, "leaves": 0, "why": ""}

  def whole(a, sharding) -> bool:
    return a.ndim > 0 and not any(set(axes) & set(AXES) for axes in
                                  axes_per_dimension(sharding, a.ndim))

  specs = jax.tree.leaves(program.model.specs, is_leaf=is_spec)
  kept = [spec for spec, a, s in zip(specs, jax.tree.leaves(abstract.master),
                                     jax.tree.leaves(sh.master)) if whole(a, s)]
  # Frozen weights (a LoRA base) are not padded: one no dimension of which divides the
  # sharding devices stays whole.
  frozen = [(a, s) for a, s in zip(jax.tree.leaves(abstract.frozen),
                                   jax.tree.leaves(sh.frozen)) if whole(a, s)]
  if not kept and not frozen:
    return {"bytes": 0, "leaves": 0, "why": ""}
  if not kept:
    return {"bytes": bytes_per_device([a for a, _ in frozen], [s for _, s in frozen]),
            "leaves": len(frozen), "why": f"frozen weights no dimension of which divides the "
                                          f"{layout.shard_size} sharding devices"}
  grads = layout.tree_shardings(program.model.specs, "grads")
  grad_dtype = dtype_of(program.cfg.zero.grad_dtype)
  pairs = [*zip(jax.tree.leaves(abstract.params), jax.tree.leaves(sh.params)),
           *zip([jax.ShapeDtypeStruct(a.shape, grad_dtype) for a in jax.tree.leaves(
               abstract.master)], jax.tree.leaves(grads)),
           *zip(jax.tree.leaves(abstract.master), jax.tree.leaves(sh.master)),
           *zip(jax.tree.leaves(abstract.opt_state), jax.tree.leaves(sh.opt_state))]
  held = [(a, s) for a, s in pairs if whole(a, s)]
  by_choice = sum(not set(spec.logical_axes) & set(FSDP_DIM_PREFERENCE) for spec in kept)
  why = (f"under zero.min_shard_size={program.cfg.zero.min_shard_size:,} elements"
         if by_choice == len(kept) else
         f"no dimension of theirs divides the {layout.shard_size} sharding devices"
         + (" or they are under zero.min_shard_size" if by_choice else ""))
  held += frozen
  if frozen:
    why += f", and {len(frozen)} frozen weights no dimension of which divides them"
  return {"bytes": bytes_per_device([a for a, _ in held], [s for _, s in held]),
          "leaves": len(kept) + len(frozen), "why": why}
