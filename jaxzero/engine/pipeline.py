"""Pipeline parallelism over the layer stack: `stages` groups of consecutive layers, one
per device of the ``pipeline`` axis, the step's micro-batches flowing through them.

The stages are a leading axis that a ``vmap`` with ``spmd_axis_name`` places one per
device; after each tick the stage outputs shift one stage on, which XLA partitions into
a collective-permute between neighbours, so only activations (and their gradients)
cross stages. :func:`gpipe_scan` is a ``Hooks.scan`` whose backward is autodiff's:
GPipe, and interleaved (circular) over V virtual stages. :func:`one_f_one_b` cuts the
model at its layer scan (jaxzero.engine.cut) and runs forward and backward in one
lockstep loop: a stage keeps at most 2S - 1 stage inputs whatever M is, at a bubble of
(2S - 2) / (M + 2S - 2) (docs/stages-and-meshes.md, "Pipeline stages", compares them).

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

from jaxzero.engine import cut
from jaxzero.sharding.mesh import AXES, PIPELINE


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


def one_f_one_b(loss: Callable, layers_key: str, stages: int, mesh, grad_dtype, params,
                batch_Ax, *scale):
  """1F1B over `stages` stages of ``params[layers_key]``, the micro-batches being
  `batch_Ax`'s leading axis: (the sum of the micro-batches' gradients in `grad_dtype`,
  their mean loss). `loss(params, batch, scan)` is the model's loss (jaxzero.engine.cut);
  `scale`, where given, multiplies each micro-batch's loss before its gradient."""
  n_micro = jax.tree.leaves(batch_Ax)[0].shape[0]
  layers = params[layers_key]
  outer = {k: v for k, v in params.items() if k != layers_key}
  n_layers = jax.tree.leaves(layers)[0].shape[0]
  if n_layers % stages or n_micro < stages:
    raise ValueError(f"{n_layers} layers and {n_micro} micro-batches do not fill {stages} "
                     "stages")
  micro = lambda a: jax.tree.map(lambda x: x[a], batch_Ax)
  with_layers = lambda outer: {**outer, layers_key: layers}
  # The layer function, with the values it closes over hoisted (cut.before_layers: the
  # floating ones, which may differ by micro-batch; integer ones stay micro-batch 0's).
  first = cut.before_layers(loss, params, micro(0))
  stacked = lambda values: jax.tree.map(lambda *xs: jnp.stack(xs), *values)

  def embed(outer):  # each micro-batch's stack input and floating values, [A, ...]
    cuts = [cut.before_layers(loss, with_layers(outer), micro(a)) for a in range(n_micro)]
    return stacked([x.carry for x in cuts]), stacked([cut.floats_of(x.consts) for x in cuts])

  (inputs, float_consts), embed_vjp = jax.vjp(embed, outer)
  per_stage = jax.tree.map(lambda w: w.reshape(stages, n_layers // stages, *w.shape[1:]),
                           layers)

  def stage_forward(weights, x, floats):
    consts = cut.with_floats(first.consts, floats)
    return jax.lax.scan(lambda c, w: (first.layer(c, w, *consts)[0], None), x, weights)[0]

  def stage_backward(weights, x, floats, ct):
    return jax.vjp(stage_forward, weights, x, floats)[1](ct)

  forward = jax.vmap(stage_forward, spmd_axis_name=PIPELINE)
  backward = jax.vmap(stage_backward, spmd_axis_name=PIPELINE)

  def head(outer, carry, batch):
    value = cut.after_layers(loss, with_layers(outer), batch, carry)
    return value * scale[0] if scale else value, value

  # Every stage runs the head on its own output (only the last stage's counts): the
  # last stage's output then never leaves it, and the head's weight gradients cross
  # `pipeline` once a step, summed, instead of an activation every tick.
  heads = jax.vmap(jax.value_and_grad(head, argnums=(0, 1), has_aux=True),
                   in_axes=(None, 0, 0), spmd_axis_name=PIPELINE)
  by_stage = lambda tree: jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P(PIPELINE, *[P.UNCONSTRAINED] * (x.ndim - 1)))), tree)
  per_device, stashed = stage_constraint(mesh), stage_constraint(mesh, unsplit=1)
  # Stage 0 keeps 2S - 2 inputs between ticks; the one read back this tick is read before
  # the tick's own is written.
  slots = 2 * stages - 2
  stage = jnp.arange(stages)
  take = lambda tree, idx: jax.tree.map(lambda x: x[idx], tree)

  def tick(loop, t):
    fwd, bwd, stash, layer_sum, outer_sum, ct_inputs, ct_floats, loss_sum = loop
    i, j = t - stage, t - (2 * stages - 2) + stage  # each stage's forward and backward
    f_ok, b_ok = (i >= 0) & (i < n_micro), (j >= 0) & (j < n_micro)
    i, j = jnp.clip(i, 0, n_micro - 1), jnp.clip(j, 0, n_micro - 1)
    x = per_device(jax.tree.map(lambda s, inp: s.at[0].set(inp[i[0]]), fwd, inputs))
    saved = jax.tree.map(lambda st, x: jax.vmap(lambda s, k: s[k])(st, j % slots).at[-1].set(
        x[-1]), stash, x)
    # Past its last micro-batch a stage computes on stale rows: nothing of it is kept.
    stash = stashed(jax.tree.map(lambda st, x: jax.vmap(
        lambda s, v, k, ok: s.at[k].set(jnp.where(ok, v, s[k])))(st, x, i % slots, f_ok),
        stash, x))
    y = per_device(forward(per_stage, x, take(float_consts, i)))
    # The micro-batch leaving the last stage: its loss, and the gradient it sends back.
    (_, values), (g_outer, ct_head) = heads(outer, y, take(batch_Ax, i))
    done = (stage == stages - 1) & f_ok
    at_stage = lambda ok, g: ok.reshape(-1, *[1] * (g.ndim - 1))
    loss_sum = loss_sum + jnp.sum(jnp.where(done, values, 0))
    outer_sum = by_stage(jax.tree.map(
        lambda a, g: a + jnp.where(at_stage(done, g), g, 0).astype(grad_dtype), outer_sum,
        g_outer))
    ct = per_device(jax.tree.map(lambda b, c: jnp.where(at_stage(stage == stages - 1, c), c, b),
                                 bwd, ct_head))
    g_w, g_x, g_floats = backward(per_stage, saved, take(float_consts, j), ct)
    valid = lambda g: jnp.where(at_stage(b_ok, g), g, 0)
    layer_sum = jax.tree.map(lambda a, g: a + valid(g).astype(grad_dtype), layer_sum, g_w)
    ct_inputs = jax.tree.map(lambda c, g: c.at[j[0]].add(jnp.where(b_ok[0], g[0], 0)),
                             ct_inputs, g_x)
    ct_floats = jax.tree.map(lambda c, g: c.at[j].add(valid(g)), ct_floats, g_floats)
    fwd, bwd = jax.tree.map(_shift, y), jax.tree.map(_shift_back, g_x)
    return (fwd, bwd, stash, layer_sum, outer_sum, ct_inputs, ct_floats, loss_sum), None

  zeros = lambda tree, lead, dtype=None: jax.tree.map(
      lambda x: jnp.zeros((*lead, *x.shape[1:]), dtype or x.dtype), tree)
  loop = (per_device(zeros(inputs, (stages,))), per_device(zeros(inputs, (stages,))),
          stashed(zeros(inputs, (stages, slots))),
          jax.tree.map(lambda w: jnp.zeros(w.shape, grad_dtype), per_stage),
          by_stage(jax.tree.map(lambda w: jnp.zeros((stages, *w.shape), grad_dtype), outer)),
          jax.tree.map(jnp.zeros_like, inputs), jax.tree.map(jnp.zeros_like, float_consts),
          jnp.zeros((), jnp.float32))
  loop, _ = jax.lax.scan(tick, loop, jnp.arange(n_micro + 2 * stages - 2))
  _, _, _, layer_sum, outer_sum, ct_inputs, ct_floats, loss_sum = loop
  (embed_grads,) = embed_vjp((ct_inputs, ct_floats))
  grads = jax.tree.map(lambda a, g: a.sum(0) + g.astype(grad_dtype), outer_sum, embed_grads)
  grads[layers_key] = jax.tree.map(lambda g: g.reshape(n_layers, *g.shape[2:]), layer_sum)
  return grads, loss_sum / n_micro


def _shift(y):
  """Stage s's output as stage s + 1's input: one collective-permute between neighbours
  (stage 0's row, which it replaces with the next micro-batch, is zeros)."""
  return jnp.concatenate([jnp.zeros_like(y[:1]), y[:-1]])


def _shift_back(g):
  """Stage s's input gradient as stage s - 1's output gradient (the last stage's row,
  which the head's gradient replaces, is zeros)."""
  return jnp.concatenate([g[1:], jnp.zeros_like(g[:1])])


# Each schedule's bubble, as the plan prints it (bubble_fraction computes it).
BUBBLE_FORMULAS = {"gpipe": "(S-1)/(M+S-1)", "1f1b": "(2S-2)/(M+2S-2)",
                   "interleaved": "(S-1)/(VM+S-1)"}


def bubble_fraction(stages: int, micro: int, schedule: str = "gpipe", virtual: int = 1) -> float:
  """The idle share of a pipelined step: (S - 1) / (M + S - 1) for GPipe, (S - 1) /
  (V M + S - 1) interleaved over V virtual stages; (2S - 2) / (M + 2S - 2) for this
  module's lockstep 1F1B, whose backward reaches stage 0 S - 1 ticks after GPipe's would."""
  if schedule == "1f1b":
    return 2 * (stages - 1) / (micro + 2 * (stages - 1))
  work = micro * (virtual if schedule == "interleaved" else 1)
  return (stages - 1) / (work + stages - 1)


def inputs_held(stages: int, micro: int, schedule: str = "gpipe") -> int:
  """Micro-batches whose stage inputs a device holds at once: all M for GPipe (and
  interleaved, whose backward recomputes each tick's chunk from its input); for 1F1B
  stage 0's 2S - 2 stash slots and the input it runs."""
  return min(micro, 2 * stages - 1) if schedule == "1f1b" else micro
