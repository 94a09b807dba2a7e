"""Pipeline parallelism over the layer stack: a ``Hooks.scan`` that runs the stacked
layers as `stages` groups of consecutive layers, with the micro-batches flowing through
them (GPipe's schedule).

The stages are a leading axis that a ``vmap`` with ``spmd_axis_name`` places one per
device of the ``pipeline`` mesh axis: each device holds its own layers (the stack's
``layers`` dimension is split over ``pipeline``) and runs them on the micro-batch in
front of it. After each tick the stage outputs shift one stage on (a shift of the stage
axis, which XLA partitions into a collective-permute between neighbours): only
activations cross stages, and their gradients on the way back. For M micro-batches and S
stages a pass is M + S - 1 ticks, S - 1 of them partly idle (the bubble,
(S - 1) / (M + S - 1) of the time). The backward pass is the forward's gradient, so it
keeps every micro-batch's stage inputs (GPipe's memory; remat applies inside each
layer as elsewhere).

Invariants: the result equals ``jax.lax.scan(layer, carry, stacked)[0]`` on the whole
batch (each row goes through every layer in order); the stack's length divides by
`stages` and the batch by `micro`; row r of the batch belongs to micro-batch r % micro.
Ticks in the bubble compute on stale rows whose results are never read, so no gradient
flows from them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxzero.sharding.mesh import PIPELINE


def gpipe_scan(stages: int, micro: int,
               constrain: Callable[[Any], Any] = lambda tree: tree) -> Callable:
  """A ``Hooks.scan`` that pipelines the layers over `stages` stages and the batch as
  `micro` micro-batches; `constrain` places the [stages, rows, ...] buffer of stage
  inputs (its leading axis over ``pipeline``)."""

  def scan(layer, carry, stacked):
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    rows = jax.tree.leaves(carry)[0].shape[0]
    if n_layers % stages or rows % micro:
      raise ValueError(f"{n_layers} layers and {rows} rows do not split into {stages} stages "
                       f"and {micro} micro-batches")
    per_stage = jax.tree.map(lambda w: w.reshape(stages, n_layers // stages, *w.shape[1:]),
                             stacked)
    # Row r is micro-batch r % micro: a device's rows of every micro-batch are its
    # own block of the batch, so splitting them needs no communication.
    inputs = jax.tree.map(
        lambda x: x.reshape(rows // micro, micro, *x.shape[1:]).swapaxes(0, 1), carry)

    def one_stage(x, weights):  # a stage's layers, in order
      return jax.lax.scan(layer, x, weights)[0]

    run_stages = jax.vmap(one_stage, spmd_axis_name=PIPELINE)

    def tick(buffers, t):
      state, outputs = buffers
      # Stage 0 takes micro-batch t (past the last, the last again: its result is unused).
      first = jax.tree.map(lambda x: x[jnp.minimum(t, micro - 1)], inputs)
      state = constrain(jax.tree.map(lambda s, f: s.at[0].set(f), state, first))
      out = constrain(run_stages(state, per_stage))
      # The last stage finishes micro-batch t - (S - 1); before that, what it writes to
      # row 0 is overwritten at t = S - 1.
      done = jnp.maximum(t - (stages - 1), 0)
      outputs = jax.tree.map(
          lambda o, y: jax.lax.dynamic_update_index_in_dim(o, y[-1], done, 0), outputs, out)
      return (jax.tree.map(_shift, out), outputs), None

    state = constrain(jax.tree.map(
        lambda x: jnp.zeros((stages, *x.shape[1:]), x.dtype), inputs))
    outputs = jax.tree.map(jnp.zeros_like, inputs)
    (_, outputs), _ = jax.lax.scan(tick, (state, outputs), jnp.arange(micro + stages - 1))
    return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(rows, *y.shape[2:]), outputs)

  return scan


def _shift(y):
  """Stage s's output as stage s + 1's input: one collective-permute between neighbours
  (stage 0's row, which it replaces with the next micro-batch, is zeros)."""
  return jnp.concatenate([jnp.zeros_like(y[:1]), y[:-1]])


def bubble_fraction(stages: int, micro: int, virtual: int = 1) -> float:
  """The idle share of a pipelined pass: (S - 1) / (V M + S - 1) with V virtual stages
  per device (V = 1: GPipe and 1F1B)."""
  return (stages - 1) / (virtual * micro + stages - 1)
