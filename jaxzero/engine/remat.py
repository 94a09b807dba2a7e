"""Activation checkpointing: a policy name -> a wrapper for the per-layer function.

The model tags intermediate values with ``checkpoint_name`` (q_proj, k_proj,
v_proj, attention, o_proj, mlp_gate, mlp_up, mlp_down); a policy says which of
those the backward pass may keep instead of recomputing. Every policy keeps only
named activations, never a layer's weights: under ZeRO-3 those are re-gathered
in the backward pass, one layer at a time.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

MATMUL_OUTPUTS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp_gate", "mlp_up", "mlp_down")
ATTENTION_OUTPUTS = ("q_proj", "k_proj", "v_proj", "attention")
ALL_ACTIVATIONS = MATMUL_OUTPUTS + ("attention",)

_POLICIES: dict[str, Callable[[], object]] = {
    # Keep every named activation (all matmul outputs and the attention
    # context); recompute only elementwise work. Not jax's "save everything":
    # that would keep each layer's gathered weights (and copies derived from
    # them) until the backward pass, i.e. the full model under ZeRO-3, where
    # FSDP's reshard_after_forward re-gathers instead. So do we.
    "none": lambda: jax.checkpoint_policies.save_only_these_names(*ALL_ACTIVATIONS),
    # Recompute the whole layer in the backward pass; keep only layer inputs.
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    # Keep the matmul outputs; recompute only the cheap elementwise work.
    "save_matmuls": lambda: jax.checkpoint_policies.save_only_these_names(*MATMUL_OUTPUTS),
    # Keep q, k, v and the attention context; recompute the MLP.
    "save_attention": lambda: jax.checkpoint_policies.save_only_these_names(*ATTENTION_OUTPUTS),
    # Keep the matmul outputs in host memory (pinned_host) instead of on device.
    "offload_matmuls": lambda: jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(MATMUL_OUTPUTS),
        offload_src="device", offload_dst="pinned_host"),
}
POLICY_NAMES = tuple(_POLICIES)


def checkpoint_policy(policy: str):
  """The jax.checkpoint policy `policy` names."""
  if policy not in _POLICIES:
    raise ValueError(f"remat.policy={policy!r} is unknown; choose one of: "
                     + ", ".join(POLICY_NAMES))
  return _POLICIES[policy]()


def remat_wrapper(policy: str) -> Callable[[Callable], Callable]:
  """The model's `remat` hook for `policy`."""
  if policy not in _POLICIES:
    raise ValueError(f"remat.policy={policy!r} is unknown; choose one of: "
                     + ", ".join(POLICY_NAMES))
  return functools.partial(jax.checkpoint, policy=_POLICIES[policy](), prevent_cse=False)


# A block of one's own (jaxzero.Engine's Remat(block=...)) names none of its activations,
# so the names above would keep nothing: its policies keep what JAX can tell apart without
# names, the outputs of its dots that have no batch dimension (its projections, not
# attention's batched products). "none" leaves the block as it is.
_BLOCK_POLICIES: dict[str, Callable[[], object]] = {
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    "save_matmuls": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_matmuls": lambda: jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"),
}


def block_policy(policy: str):
  """The jax.checkpoint policy for an unnamed block of one's own; None for "none" (no
  checkpoint). ValueError for a policy that needs the built-in models' names."""
  if policy == "none":
    return None
  if policy not in _BLOCK_POLICIES:
    raise ValueError(f"remat.policy={policy!r} keeps activations by the names the built-in "
                     "models give them, which a block of one's own lacks; for a block choose "
                     "one of: none, " + ", ".join(_BLOCK_POLICIES))
  return _BLOCK_POLICIES[policy]()
