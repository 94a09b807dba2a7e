"""Pipeline parallelism over the layer stack: `stages` groups of consecutive layers, one
per device of the ``pipeline`` axis, the step's micro-batches flowing through them.

The stages are a leading axis that a ``vmap`` with ``spmd_axis_name`` places one per
device; after each tick the stage outputs shift one stage on, which XLA partitions into
a collective-permute between neighbours, so only activations (and their gradients)
cross stages. :func:`gpipe_scan` is a ``Hooks.scan`` whose backward is autodiff's:
GPipe, and interleaved (circular) over V virtual stages. 1F1B, where each stage runs its
own schedule, is jaxzero.parallel.one_f_one_b; this module keeps every schedule's bubble
formula (docs/stages-and-meshes.md, "Pipeline stages", compares them).

Invariants: each row goes through every layer in order, so losses and gradients are
the unpipelined model's; the stack's length divides by `stages` (times V); row r of a
merged batch is micro-batch r % M. Ticks in the bubble compute on stale rows that are
never read, masked out of every sum and never stashed, so no gradient flows from them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.parallel.mesh import AXES, PIPELINE


def stage_constraint(mesh, unsplit: int = 0) -> Callable[[Any], Any]:
  """Places a tree of [stages, (`unsplit` dims,) rows, ...] buffers: a stage per device
  of ``pipeline``, the rows over the data axes."""
  def constrain(tree):
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(
        mesh, P(PIPELINE, *[None] * unsplit, AXES,
                *[P.UNCONSTRAINED] * (x.ndim - 2 - unsplit)))), tree)
  return constrain


def gpipe_scan(stages: int, micro: int,
               constrain: Callable[[Any], Any] = lambda tree: tree, virtual: int = 1) -> Callable:
  """A ``Hooks.scan`` that pipelines the layers over `stages` stages and the batch as
  `micro` micro-batches; `constrain` places the [stages, rows, ...] buffer of stage
  inputs (its leading axis over ``pipeline``). With `virtual` V > 1 the pipeline is
  circular (interleaved): the stack is S x V chunks, chunk r S + s on stage s, and each
  micro-batch goes round the stages V times."""

  def scan(layer, carry, stacked):
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    rows = jax.tree.leaves(carry)[0].shape[0]
    if n_layers % (stages * virtual) or rows % micro or (virtual > 1 and micro < stages):
      raise ValueError(f"{n_layers} layers and {rows} rows do not split into {stages} x "
                       f"{virtual} stages and {micro} micro-batches")
    chunk = n_layers // (stages * virtual)
    # [S, V, chunk, ...]: stage s's round r runs chunk r S + s. With V > 1 this is not the
    # stored order (each device stores consecutive layers), so XLA moves the weights to
    # their stages here, and their gradients back.
    per_stage = jax.tree.map(
        lambda w: w.reshape(virtual, stages, chunk, *w.shape[1:]).swapaxes(0, 1), stacked)
    # Row r is micro-batch r % micro: a device's rows of every micro-batch are its
    # own block of the batch, so splitting them needs no communication.
    inputs = jax.tree.map(
        lambda x: x.reshape(rows // micro, micro, *x.shape[1:]).swapaxes(0, 1), carry)

    def one_stage(x, weights, round_):  # a stage's chunk for this round, in order
      if virtual == 1:  # the weights are the same every tick: autodiff keeps no copy
        return jax.lax.scan(layer, x, jax.tree.map(lambda w: w[0], weights))[0]
      return jax.lax.scan(layer, x, jax.tree.map(lambda w: w[round_], weights))[0]

    if virtual > 1:
      # Each tick picks each stage's chunk anew; autodiff would keep every tick's picked
      # weights. Recomputing the stage from its input in the backward keeps only that
      # input (remat at chunk boundaries; one more chunk forward a tick).
      one_stage = jax.checkpoint(one_stage)
    run_stages = jax.vmap(one_stage, spmd_axis_name=PIPELINE)

    def tick(buffers, t):
      state, outputs = buffers
      # Stage 0 takes micro-batch t % M: in the first round from the inputs (past the
      # last, the last again: its result is unused), in later rounds from where the last
      # stage left it, M - S + 1 ticks before.
      first = jax.tree.map(lambda x: x[jnp.minimum(t, micro - 1)], inputs)
      if virtual > 1:
        first = jax.tree.map(lambda f, o: jnp.where(t < micro, f, o[t % micro]), first,
                             outputs)
      state = constrain(jax.tree.map(lambda s, f: s.at[0].set(f), state, first))
      rounds = jnp.clip((t - jnp.arange(stages)) // micro, 0, virtual - 1)
      out = constrain(run_stages(state, per_stage, rounds))
      # The last stage finishes pass t - (S - 1) (micro-batch (t - S + 1) % M); before
      # that, what it writes to row 0 is overwritten at t = S - 1.
      done = jnp.maximum(t - (stages - 1), 0) % micro
      outputs = jax.tree.map(
          lambda o, y: jax.lax.dynamic_update_index_in_dim(o, y[-1], done, 0), outputs, out)
      return (jax.tree.map(_shift, out), outputs), None

    state = constrain(jax.tree.map(
        lambda x: jnp.zeros((stages, *x.shape[1:]), x.dtype), inputs))
    outputs = jax.tree.map(jnp.zeros_like, inputs)
    (_, outputs), _ = jax.lax.scan(tick, (state, outputs),
                                   jnp.arange(virtual * micro + stages - 1))
    return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(rows, *y.shape[2:]), outputs)

  return scan


def _shift(y):
  """Stage s's output as stage s + 1's input: one collective-permute between neighbours
  (stage 0's row, which it replaces with the next micro-batch, is zeros)."""
  return jnp.concatenate([jnp.zeros_like(y[:1]), y[:-1]])


# Each schedule's bubble, as the plan prints it (bubble_fraction computes it).
BUBBLE_FORMULAS = {"gpipe": "(S-1)/(M+S-1)", "1f1b": "(S-1)/(M+S-1)",
                   "interleaved": "(S-1)/(VM+S-1)"}


def bubble_fraction(stages: int, micro: int, schedule: str = "gpipe", virtual: int = 1) -> float:
  """The idle share of a pipelined step: (S - 1) / (M + S - 1) for GPipe and 1F1B (in
  slots: jaxzero.parallel.one_f_one_b), (S - 1) / (V M + S - 1) interleaved over V virtual
  stages."""
  work = micro * (virtual if schedule == "interleaved" else 1)
  return (stages - 1) / (work + stages - 1)


def inputs_held(stages: int, micro: int, schedule: str = "gpipe") -> int:
  """Micro-batches whose stage inputs a device holds at once: all M for GPipe (and
  interleaved, whose backward recomputes each tick's chunk from its input); for 1F1B at
  most S (stage 0's; stage s holds S - s)."""
  return min(micro, stages) if schedule == "1f1b" else micro


def kept_for_backward(stages: int, micro: int, schedule: str = "gpipe",
                      virtual: int = 1) -> tuple[float, int]:
  """What a stage keeps for its backward at the peak: (sets of its layers' residuals, each
  one micro-batch's; stage inputs, each one micro-batch's, beyond those residuals).
  GPipe: every tick's residuals, M + S - 1 (autodiff keeps the bubble's ticks too);
  interleaved: every tick's chunk input, V M + S - 1, and one chunk's residuals (1/V of
  the stage's) recomputed from it in the backward; 1F1B: two micro-batches' residuals
  (the loop carries one from the slot that makes it to the backward's, and a slot that
  makes the next holds both: 0.97-0.99x of XLA's temporaries on CPU at 2 stages, where one
  set was 0.70-0.80x) and the inputs of at most S."""
  if schedule == "1f1b":
    return 2.0, inputs_held(stages, micro, schedule)
  if virtual > 1:
    return 1.0 / virtual, virtual * micro + stages - 1
  return float(micro + stages - 1), 0
