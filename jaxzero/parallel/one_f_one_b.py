"""1F1B pipelining: each stage runs its own schedule of forwards and backwards, so that
a stage keeps the inputs of at most S micro-batches whatever M is (stage s holds S - s
of them live, in S slots that every stage allocates).

Tick t is one slot on every stage: stage s runs the forward of micro-batch (t - s) / 2
or the backward of (t - 2S + 1 + s) / 2, whichever is whole and in range (they differ
in parity, so never both), then neighbours s, s + 1 with s = t mod 2 swap what they
made, an activation forward and a gradient back: each is the other's next input. A
step is 2 (M + S - 1) slots, each stage busy in 2M: the bubble is GPipe's,
(S - 1) / (M + S - 1), of the slots. A slot lasts as long as the slowest stage's work
in it, so the slots are evened out: in the forward's slot before each backward, a stage
runs its layers again from the input it kept, keeping the residuals for the backward
(two forwards' work against a backward's two).

Each stage doing different work in the same tick is a ``shard_map`` over ``pipeline``
(the other axes stay XLA's): a ``vmap`` over stages runs the same work on every stage,
and the only 1F1B it can express keeps 2S - 1 inputs. Only the layer stack runs inside
it: the embedding and the head run outside, on every stage (only the first's, and the
last's, count), because XLA:CPU's partitioner aborts on gathers whose operands are split
over the data axes inside a ``shard_map`` (the lookup, the label's logit).

Frozen weights (Model.frozen_specs: a LoRA base) join the trained ones wherever the loss
runs, the layers' split over stages as theirs are, and get no gradient; like the
trained layers, a stage's frozen layers are never kept per micro-batch as residuals.

Invariants: the losses and gradients are the unpipelined model's (every row goes
through every layer in order, once forward and once back); slots outside a stage's
schedule compute nothing that is kept.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.models.interface import merge
from jaxzero.parallel import layer_cut, pipeline
from jaxzero.parallel.mesh import AXES, PIPELINE


def one_f_one_b(loss: Callable, layers_key: str, stages: int, mesh, layer_specs, grad_dtype,
                params, batch_Ax, scale=None, frozen=None):
  """1F1B over `stages` stages of ``params[layers_key]``, the micro-batches being
  `batch_Ax`'s leading axis: (the sum of the micro-batches' gradients in `grad_dtype`,
  the layers' laid out by `layer_specs`, and their mean loss). `loss(params, batch, scan)`
  is the model's loss (jaxzero.parallel.layer_cut); `scale`, where not None, multiplies each
  micro-batch's loss before its gradient. `frozen`: weights used and not trained, a
  nested dict merged into `params` (jaxzero.models.interface.merge)."""
  n_micro = jax.tree.leaves(batch_Ax)[0].shape[0]
  layers = params[layers_key]
  frozen = frozen or {}
  frozen_layers = frozen.get(layers_key, {})
  frozen_outer = {k: v for k, v in frozen.items() if k != layers_key}
  # The loss of the trained parameters, the frozen ones merged in wherever it runs.
  loss = _with_frozen(loss, layers_key, frozen_outer)
  outer = {k: v for k, v in params.items() if k != layers_key}
  n_layers = jax.tree.leaves(layers)[0].shape[0]
  if n_layers % stages or n_micro < stages:
    raise ValueError(f"{n_layers} layers and {n_micro} micro-batches do not fill {stages} "
                     "stages")
  micro = lambda a: _take(batch_Ax, a)
  with_layers = lambda outer: {**outer, layers_key: merge(layers, frozen_layers)}
  stacked = lambda values: jax.tree.map(lambda *xs: jnp.stack(xs), *values)
  embed = lambda outer, a: layer_cut.before_layers(loss, with_layers(outer), micro(a)).carry

  def all_floats(outer):  # the layers' floating values for every micro-batch, [M, ...]
    return stacked([layer_cut.floats_of(
        layer_cut.before_layers(loss, with_layers(outer), micro(a)).consts)
        for a in range(n_micro)])

  # Held through the step, M times what the layers close over (for Llama, the RoPE
  # tables); their gradient is taken once, at the end.
  float_consts, floats_vjp = jax.vjp(all_floats, outer)

  def head(outer, carry, batch):
    value = layer_cut.after_layers(loss, with_layers(outer), batch, carry)
    return (value if scale is None else value * scale), value

  # Outside the shard_map, a vmap over stages with `spmd_axis_name` runs on each stage
  # its own row: the head on every stage's output (the last stage's counts), and the
  # embedding's gradient from every stage's input gradient (stage 0's counts). So no
  # activation crosses `pipeline` for them, and their weights' gradients cross once.
  heads = jax.vmap(jax.value_and_grad(head, argnums=(0, 1), has_aux=True),
                   in_axes=(None, 0, None), spmd_axis_name=PIPELINE)
  embed_grads = jax.vmap(lambda outer, a, g: jax.vjp(lambda o: embed(o, a), outer)[1](g)[0],
                         in_axes=(None, None, 0), spmd_axis_name=PIPELINE)
  embeds = jax.vmap(embed, in_axes=(None, 0), spmd_axis_name=PIPELINE)
  per_stage, stash_layout = pipeline.stage_constraint(mesh), pipeline.stage_constraint(mesh, 1)
  by_stage = lambda tree: jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P(PIPELINE, *[P.UNCONSTRAINED] * (x.ndim - 1)))), tree)
  stage = jnp.arange(stages)
  on_stage = lambda ok, x: ok.reshape(-1, *[1] * (x.ndim - 1))
  zeros = lambda tree, lead, dtype=None: jax.tree.map(
      lambda x: jnp.zeros((*lead, *x.shape), dtype or x.dtype), tree)
  carry_shape = jax.eval_shape(lambda: embed(outer, 0))
  if any(not jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in jax.tree.leaves(carry_shape)):
    # (The config refuses packed rows and LoRA dropout with 1F1B: they carry integers.)
    raise ValueError("1F1B sends each stage's input and its gradient between stages: a "
                     "carry with integer leaves (packed rows' segment ids, dropout keys) "
                     "has none to send; use the gpipe or interleaved schedule")
  split_layers = jax.tree.map(lambda _: P(PIPELINE), layers)
  reduce_specs = jax.tree.map(_within_stage, layer_specs, is_leaf=lambda x: isinstance(x, P))
  # One per parity of t: the pairs that swap after the tick are (s, s + 1), s = t mod 2.
  split_frozen = jax.tree.map(lambda _: P(PIPELINE), frozen_layers)
  stage_ticks = [jax.shard_map(
      _stage_tick(loss, layers_key, stages, grad_dtype, reduce_specs, parity), mesh=mesh,
      in_specs=(split_layers, *[P(PIPELINE)] * 3, split_layers, *[P(PIPELINE)] * 4, P(), P(),
                split_frozen),
      out_specs=(*[P(PIPELINE)] * 4, split_layers, P(PIPELINE)),
      axis_names={PIPELINE}, check_vma=False) for parity in (0, 1)]
  # What a stage keeps from a forward for its backward (the layers aside), one micro-batch's.
  residual_shapes = jax.eval_shape(jax.shard_map(
      _stage_residuals(loss, layers_key), mesh=mesh,
      in_specs=(split_layers, P(PIPELINE), P(PIPELINE), P(), P(), split_frozen),
      out_specs=P(PIPELINE), axis_names={PIPELINE}, check_vma=False),
      layers, zeros(carry_shape, (stages,)), _take(float_consts, stage), outer, micro(0),
      frozen_layers)

  def tick(loop, t, parity):
    inbox, stash, residuals, layer_sum, outer_sum, ct_floats, loss_sum = loop
    f_ok, i, b_ok, j = slot_work(t, stage, stages, n_micro)
    i, j = jnp.clip(i, 0, n_micro - 1), jnp.clip(j, 0, n_micro - 1)
    kind = jnp.where(f_ok, 1, jnp.where(b_ok, 2, 0))  # idle, forward, backward
    # A stage whose backward comes next tick runs its stage forward again now, keeping the
    # residuals: that work sits in a forward's slot, which waits for a backward anyway.
    _, _, prepares, j_next = slot_work(t + 1, stage, stages, n_micro)
    j_next = jnp.clip(j_next, 0, n_micro - 1)
    schedule = {"kind": kind, "slot": i % stages, "prepares": prepares,
                "prepared_slot": j_next % stages}
    # Stage 0's input, at the even ticks where it runs forwards (made on every stage:
    # a lookup costs less than sending it).
    first_input = per_stage(embeds(outer, i) if parity == 0 else zeros(carry_shape, (stages,)))
    sent, received, stash, residuals, layer_sum, g_floats = stage_ticks[parity](
        layers, inbox, stash, residuals, layer_sum, schedule, first_input,
        _take(float_consts, i), _take(float_consts, j_next), outer, micro(0), frozen_layers)
    ct_floats = jax.tree.map(
        lambda c, g: c.at[j].add(jnp.where(on_stage(b_ok, g), g, 0)), ct_floats, g_floats)
    if (stages - 1) % 2 == parity:  # the last stage ran a forward, or was idle
      done = (stage == stages - 1) & f_ok
      (_, values), (g_outer, ct_head) = heads(outer, sent, micro(i[-1]))
      loss_sum = loss_sum + jnp.sum(jnp.where(done, values, 0))
      outer_sum = by_stage(jax.tree.map(
          lambda a, g: a + jnp.where(on_stage(done, g), g, 0).astype(grad_dtype), outer_sum,
          g_outer))
      received = per_stage(jax.tree.map(lambda c, r: jnp.where(on_stage(done, c), c, r),
                                        ct_head, received))
    if parity == 1:  # stage 0 ran a backward (its ticks are odd), or was idle
      g_in = jax.tree.map(lambda g: jnp.where(on_stage((stage == 0) & b_ok, g), g, 0), sent)
      outer_sum = by_stage(jax.tree.map(lambda a, g: a + g.astype(grad_dtype), outer_sum,
                                        embed_grads(outer, j[0], g_in)))
    return (received, stash, residuals, layer_sum, outer_sum, ct_floats, loss_sum)

  def two_ticks(loop, t):
    return tick(tick(loop, t, 0), t + 1, 1), None

  loop = (per_stage(zeros(carry_shape, (stages,))),
          stash_layout(zeros(carry_shape, (stages, stages))), zeros(residual_shapes, ()),
          jax.tree.map(lambda w: jnp.zeros(w.shape, grad_dtype), layers),
          by_stage(zeros(outer, (stages,), grad_dtype)), jax.tree.map(jnp.zeros_like, float_consts),
          jnp.zeros((), jnp.float32))
  loop, _ = jax.lax.scan(two_ticks, loop, 2 * jnp.arange(n_micro + stages - 1))
  _, _, _, layer_sum, outer_sum, ct_floats, loss_sum = loop
  (float_grads,) = floats_vjp(ct_floats)
  grads = jax.tree.map(lambda a, g: a.sum(0) + g.astype(grad_dtype), outer_sum, float_grads)
  grads[layers_key] = layer_sum
  return grads, loss_sum / n_micro


def slot_work(t, stage, stages: int, n_micro: int):
  """What `stage` runs in slot t, as (runs a forward, of which micro-batch, runs a
  backward, of which micro-batch): the forward of (t - s) / 2 and the backward of
  (t - 2S + 1 + s) / 2, each where it is whole and one of the M. Ints or arrays."""
  twice_f, twice_b = t - stage, t - (2 * stages - 1) + stage
  scheduled = lambda k: (k % 2 == 0) & (k >= 0) & (k < 2 * n_micro)
  return scheduled(twice_f), twice_f // 2, scheduled(twice_b), twice_b // 2


def _with_frozen(loss: Callable, layers_key: str, frozen_outer: dict) -> Callable:
  """`loss` on params whose layers already hold the frozen layers, the frozen leaves
  outside the layers merged in."""
  if not frozen_outer:
    return loss
  return lambda params, batch, scan: loss(merge(params, frozen_outer), batch, scan)


def _stage_vjp(loss: Callable, layers_key: str, layers, outer, batch, frozen_layers):
  """Inside the shard_map: (run, residuals_of, restore). ``run(layers, x, floats)`` is the
  stage's layers (with its `frozen_layers` merged in) on input x (the layer function
  traced here, so that its hooks' constraints name the traced mesh; what runs before the
  layers is traced too, and dropped: nothing uses it). ``residuals_of(x, floats)`` runs
  it keeping what its backward needs, less the layers themselves; ``restore(residuals)``
  is that backward, giving no gradient to the frozen layers."""
  stage_cut = layer_cut.before_layers(
      loss, {**outer, layers_key: merge(layers, frozen_layers)}, batch)

  def run(layers, x, floats):  # floats: this micro-batch's (integer values stay `batch`'s)
    consts = layer_cut.with_floats(stage_cut.consts, floats)
    return jax.lax.scan(lambda h, w: (stage_cut.layer(h, w, *consts)[0], None), x,
                        merge(layers, frozen_layers))[0]

  # The same arrays every micro-batch: left out of the residuals and put back.
  weights = jax.tree.leaves(layers) + jax.tree.leaves(frozen_layers)
  structure = {}

  def residuals_of(x, floats):
    leaves, structure["tree"] = jax.tree.flatten(jax.vjp(run, layers, x, floats)[1])
    # The layers are residuals too (a matmul's input gradient needs its weight): they are
    # the same arrays every micro-batch, so they are left out and put back.
    structure["weight"] = [next((k for k, w in enumerate(weights) if leaf is w), None)
                           for leaf in leaves]
    return [leaf for leaf, k in zip(leaves, structure["weight"]) if k is None]

  def restore(residuals):
    kept = iter(residuals)
    return jax.tree.unflatten(structure["tree"], [next(kept) if k is None else weights[k]
                                                  for k in structure["weight"]])

  return run, residuals_of, restore


def _stage_residuals(loss: Callable, layers_key: str):
  """The residuals' shapes, for a stage's layers (inside the shard_map)."""
  def body(layers, x, floats, outer, batch, frozen_layers):
    _, residuals_of, _ = _stage_vjp(loss, layers_key, layers, outer, batch, frozen_layers)
    return [r[None] for r in residuals_of(x[0], jax.tree.map(lambda f: f[0], floats))]
  return body


def _stage_tick(loss: Callable, layers_key: str, stages: int, grad_dtype, reduce_specs,
                parity: int):
  """One tick of parity `parity` on one stage, inside the shard_map: its slot's work on
  its own layers (`schedule`: its kind, 0 idle, 1 forward, 2 backward; its stash slot;
  whether to prepare next tick's backward, from which slot), then the swap with its
  neighbour. Returns (what it made, what it received, its stash, its residuals, its
  layers' gradient sum, its layers' floating values' gradient)."""

  def body(layers, inbox, stash, residuals, layer_sum, schedule, first_input, floats_f,
           floats_next, outer, batch, frozen_layers):
    stage = jax.lax.axis_index(PIPELINE)
    run, residuals_of, restore = _stage_vjp(loss, layers_key, layers, outer, batch,
                                            frozen_layers)
    inbox, stash, residuals, schedule, first_input, floats_f, floats_next = (
        jax.tree.map(lambda x: x[0], v)
        for v in (inbox, stash, residuals, schedule, first_input, floats_f, floats_next))
    # The branches must agree on their results' layouts: rows over the data axes, the
    # gradient sum in its reduce layout.
    by_rows = lambda tree, lead=0: jax.tree.map(lambda x: _constrain_traced(
        x, P(*[None] * lead, AXES, *[P.UNCONSTRAINED] * (x.ndim - 1 - lead))), tree)
    reduced = lambda sums: jax.tree.map(lambda sp, x: _constrain_traced(x, sp), reduce_specs,
                                        sums, is_leaf=lambda x: isinstance(x, P))
    no_floats = jax.tree.map(jnp.zeros_like, floats_f)
    # Traces the residuals' structure, which `restore` needs: the backward's branch is
    # traced before the cond that makes them.
    jax.eval_shape(residuals_of, jax.tree.map(lambda st: st[0], stash), floats_f)

    def idle():
      return (by_rows(jax.tree.map(jnp.zeros_like, inbox)), by_rows(stash, 1),
              reduced(layer_sum), no_floats)

    def forward():
      x = jax.tree.map(lambda f, r: jnp.where(stage == 0, f, r), first_input, inbox)
      kept = jax.tree.map(lambda st, v: st.at[schedule["slot"]].set(v), stash, x)
      return by_rows(run(layers, x, floats_f)), by_rows(kept, 1), reduced(layer_sum), no_floats

    def backward():
      g_layers, g_x, g_floats = restore(residuals)(inbox)
      summed = jax.tree.map(lambda a, g: a + g.astype(grad_dtype), layer_sum, g_layers)
      return by_rows(g_x), by_rows(stash, 1), reduced(summed), g_floats

    sent, stash, layer_sum, g_floats = jax.lax.switch(schedule["kind"], (idle, forward, backward))
    residuals = jax.lax.cond(
        schedule["prepares"],
        lambda: residuals_of(jax.tree.map(lambda st: st[schedule["prepared_slot"]], stash),
                             floats_next),
        lambda: residuals)
    pairs = [(s + d, s + 1 - d) for s in range(parity, stages - 1, 2) for d in (0, 1)]
    received = (jax.tree.map(lambda v: jax.lax.ppermute(v, PIPELINE, pairs), sent) if pairs
                else jax.tree.map(jnp.zeros_like, sent))  # 2 stages, odd ticks: no pair
    lead = lambda tree: jax.tree.map(lambda x: x[None], tree)
    return lead(sent), lead(received), lead(stash), lead(residuals), layer_sum, lead(g_floats)

  return body


def _take(tree, idx):
  return jax.tree.map(lambda x: x[idx], tree)


def _within_stage(spec: P) -> P:
  """`spec` as a ``shard_map`` over ``pipeline`` sees it (no dimension over it)."""
  def drop(entry):
    if isinstance(entry, tuple):
      return tuple(a for a in entry if a != PIPELINE) or None
    return None if entry == PIPELINE else entry
  return P(*map(drop, spec))


def _constrain_traced(x, spec: P):
  """Inside a ``shard_map``, a constraint names the traced mesh (``pipeline`` Manual)."""
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))
