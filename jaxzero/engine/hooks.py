"""The model's hooks (jaxzero.models.interface.Hooks) for one layout.

`shard` constrains an activation to the layout's placement; `gather` brings a weight
to its compute layout where it is used, and sends its gradient back in the reduce
layout. Constraints name the mesh being traced: the layout's, or inside a
``shard_map`` over some of its axes (1F1B's, over ``pipeline``) the traced one, where
those axes are Manual. Under a vmap over groups of data axes (jaxzero.engine.groups),
`vmapped_axes` are already split by the vmap: activations are not split over them
again, and gradients are not reduced over them inside it. With ``mesh.context``,
`context` runs attention on each device's part of the sequence (context parallelism),
and `sequence_order` says how the sequence is laid out over those devices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.engine import context as context_parallel
from jaxzero.models.interface import Hooks, Model
from jaxzero.parallel.mesh import AXES, CONTEXT, TENSOR
from jaxzero.parallel.padding import padded_shape
from jaxzero.parallel.zero import Layout


# The layouts of Hooks.context's attention inputs, [B, T, heads, E] and [B, T, kv heads, E].
Q_AXES = ("batch", "seq", "heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")


def traced_mesh(layout: Layout):
  """The mesh a constraint names now: the layout's, or the traced one inside a
  ``shard_map`` (whose Manual axes a constraint may not name)."""
  traced = jax.sharding.get_abstract_mesh()
  return traced if traced.manual_axes else layout.mesh


@dataclasses.dataclass(frozen=True)
class LayoutHooks:
  """`shard` and `gather` for `layout`, with `vmapped_axes` split by an enclosing vmap."""
  layout: Layout
  vmapped_axes: tuple[str, ...] = ()

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The data axes an activation's batch is split over: those the vmap leaves."""
    return tuple(a for a in AXES if a not in self.vmapped_axes)

  def hooks(self, remat: Callable, scan: Callable | None = None) -> Hooks:
    hooks = Hooks(shard=self.shard, gather=self.gather, remat=remat)
    if self.layout.context_size > 1:
      hooks = dataclasses.replace(hooks, context=self.context,
                                  sequence_order=self.sequence_order)
    return hooks if scan is None else dataclasses.replace(hooks, scan=scan)

  def sequence_order(self, T: int):
    """The order of a sequence's positions over ``context`` (jaxzero.engine.context)."""
    layout = self.layout
    return context_parallel.sequence_order(T, layout.context_size, layout.context_balance)

  def context(self, attend: Callable) -> Callable:
    """`attend` on each device's part of the sequence, by the layout's context strategy
    (jaxzero.engine.context). A shard_map because XLA cannot get there alone:
    partitioning the blockwise kernel's loop over query blocks, it gathers every query
    to every device and runs the whole attention on each (the compiled program shows
    the all-gather), and it has no ring. Rows and heads stay where the activations
    have them."""
    mesh = traced_mesh(self.layout)
    place = lambda x, axes: self.layout.activation_spec(x.shape, axes, self.batch_axes)
    local = functools.partial(context_parallel.ATTENTION[self.layout.context_strategy], attend,
                              C=self.layout.context_size, balanced=self.layout.context_balance)

    def run(q, k, v, segment_ids=None):
      context_parallel.check_sequence(q.shape[1], self.layout.context_size,
                                      self.layout.context_balance)
      args = (q, k, v) + (() if segment_ids is None else (segment_ids,))
      specs = (place(q, Q_AXES), place(k, KV_AXES), place(v, KV_AXES)) + (
          () if segment_ids is None else (place(segment_ids, ("batch", "seq")),))
      if CONTEXT not in str(specs[0][1]):  # (config validation keeps the parts equal)
        raise ValueError(f"queries {q.shape} are not split over {CONTEXT} by sequence")
      if specs[0][2] != specs[1][2]:  # KV heads replicated over `tensor`: so is attention
        specs = tuple(P(*[None if e == TENSOR else e for e in spec]) for spec in specs)
      # Every axis is manual inside: the ones no spec names hold copies. (XLA:CPU fails
      # to compile a bfloat16 gather's transpose in a partly manual region.)
      outer = set(getattr(mesh, "manual_axes", ()))
      return jax.shard_map(lambda q, k, v, *seg: local(q, k, v, seg[0] if seg else None),
                           mesh=mesh, in_specs=specs, out_specs=specs[0],
                           axis_names=frozenset(set(mesh.axis_names) - outer),
                           check_vma=False)(*args)
    return run

  def shard(self, x: jax.Array, logical_axes: tuple[str, ...]) -> jax.Array:
    """An activation in its place: batch over the data axes the vmap leaves."""
    spec = self.layout.activation_spec(x.shape, logical_axes, self.batch_axes)
    return jax.lax.with_sharding_constraint(x, NamedSharding(traced_mesh(self.layout), spec))

  def gather(self, w: jax.Array, logical_axes: tuple[str, ...]) -> jax.Array:
    """A weight in the compute layout (replicated over the data axes, split over
    `tensor`) where it is used; its gradient leaves in the reduce layout."""
    layout, mesh = self.layout, traced_mesh(self.layout)
    # A weight stored padded (jaxzero.parallel.padding) arrives at its true shape: it is
    # placed by its stored shape's layout, an uneven split XLA pads internally.
    shape = padded_shape(w.shape, logical_axes, layout.shard_size,
                         skip=layout.tensor_dim(w.shape, logical_axes))
    if layout.params_memory == "pinned_host":
      # Offloaded weights (stage 3): each layer's shard comes to the device here,
      # inside the layer scan, one layer at a time (a no-op for those already there).
      # Placed by its true shape: a transfer's layout must divide it (a frozen leaf is
      # never stored padded; a small quantization part may divide nothing).
      w = jax.device_put(w, NamedSharding(mesh, layout.spec(w.shape, logical_axes, "params"),
                                          memory_kind="device"))
    compute = NamedSharding(mesh, layout.spec(shape, logical_axes, "compute"))
    if set(AXES) <= set(self.vmapped_axes):  # a per-device gradient stays whole, unreduced
      return w if layout.tensor_size == 1 else jax.lax.with_sharding_constraint(w, compute)
    reduced = layout.spec(shape, logical_axes, layout.reduce_role)
    return gather_for_compute(w, compute, NamedSharding(mesh, reduced),
                              jax.numpy.dtype(layout.reduce_dtype))


# A custom_vjp because the partitioned HLO shows XLA cannot get there alone: the
# transpose of a sharding constraint constrains the cotangent to the same
# (replicated) layout, so each gradient was all-reduced whole and only then
# sliced to its shard (all-reduce -> transpose -> copy -> dynamic-slice, which
# XLA:GPU does not turn into a reduce-scatter). Constraining the cotangent to
# the reduce layout where it is produced lets the partitioner emit the
# reduce-scatter (on CPU: an all-reduce feeding only a dynamic-slice).
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_for_compute(w: jax.Array, compute: NamedSharding, reduced: NamedSharding,
                       reduce_dtype) -> jax.Array:
  """`w` in the `compute` layout; its gradient reduced into `reduced`, in `reduce_dtype`."""
  return jax.lax.with_sharding_constraint(w, compute)


def _gather_fwd(w, compute, reduced, reduce_dtype):
  return gather_for_compute(w, compute, reduced, reduce_dtype), None


def _gather_bwd(compute, reduced, reduce_dtype, _, g):
  del compute
  g_reduced = jax.lax.with_sharding_constraint(g.astype(reduce_dtype), reduced)
  return (g_reduced.astype(g.dtype),)


gather_for_compute.defvjp(_gather_fwd, _gather_bwd)


def loss_with_hooks(model: Model, params, batch, layout: Layout, remat, scan=None) -> jax.Array:
  """The model's mean loss over `batch` with `layout`'s hooks (and `scan`, where given)."""
  return model.loss(params, batch, LayoutHooks(layout).hooks(remat, scan))
