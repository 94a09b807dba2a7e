"""Gradients kept apart per group of data axes, reduced across the groups once a step.

Stages 0-1 keep each device's gradient unreduced over the micro-steps and reduce once,
as DeepSpeed does (with one micro-step too: the explicit reduce sends a tied
embedding's two gradients once, where XLA would reduce them apart). Under hybrid
sharding each ``replica`` group reduce-scatters within ``fsdp`` every micro-step, and
only the shards cross ``replica``, once. A vmap over a leading group axis, which
``spmd_axis_name`` places one row per group, does both; with no such axes every
method is the identity. Each group differentiates its loss times its share of the batch's
targets (Model.batch_weight; 1/groups without one), so that its gradient is its rows' part
of the whole batch's, as one device forms it, and the reduce is a plain sum: a float16
gradient then overflows where one device's would, not at groups x its size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.engine.hooks import LayoutHooks
from jaxzero.parallel.mesh import AXES
from jaxzero.parallel.zero import Layout


def reduces_once(layout: Layout) -> bool:
  """Whether gradients stay unreduced per device until the last micro-step: stages 0-1
  keep replicated gradients, which reduced every micro-step would be all-reduced every
  micro-step; stages 2-3 reduce-scatter every micro-step (their memory saving)."""
  return not layout.is_sharded("grads") and layout.data_parallel_size > 1


def local_axes(layout: Layout) -> tuple[str, ...]:
  """The data axes whose groups keep their gradients apart until the step's end."""
  if reduces_once(layout):
    return AXES
  if layout.hybrid and layout.mesh.shape["replica"] > 1:
    return ("replica",)
  return ()


@dataclasses.dataclass(frozen=True)
class Groups:
  """The groups of `layout`'s local axes (none: every method is the identity)."""
  layout: Layout
  axes: tuple[str, ...]

  @classmethod
  def of(cls, layout: Layout) -> "Groups":
    return cls(layout, local_axes(layout))

  @property
  def count(self) -> int:
    return math.prod(self.layout.mesh.shape[a] for a in self.axes)

  @property
  def hooks(self) -> LayoutHooks:
    """The model's hooks inside the vmap over groups."""
    return LayoutHooks(self.layout, self.axes)

  def sharding(self, spec: P) -> NamedSharding:
    """Of a stack [groups, ...] of values laid out by `spec` within each group."""
    return NamedSharding(self.layout.mesh, P(self.axes, *spec))

  def sum_shardings(self, reduced: Any, compute: Any) -> Any:
    """Where the running gradient sum lives: in the reduce layout; per group, a row
    each, whole within it (split over `tensor` as its weight is used), or, where the
    groups are hybrid sharding's replicas (stages 2-3), in the reduce layout within
    each. (At stage 1 the groups span `fsdp` too, which the reduce layout splits.)"""
    if not self.axes:
      return reduced
    within_replicas = self.layout.hybrid and self.axes == ("replica",)
    return jax.tree.map(lambda r, c: self.sharding((r if within_replicas else c).spec),
                        reduced, compute)

  def sum_shape(self, leaf) -> tuple[int, ...]:
    return (self.count, *leaf.shape) if self.axes else tuple(leaf.shape)

  def per_group(self, micro: Callable, per_layer: bool,
                batch_weight: Callable | None = None) -> Callable:
    """`micro` (params, batch, layers_sum, scale) -> (loss, grads, layers_sum) run once
    per group on its rows, each group's sums a row of the stacked ones. Each group's loss
    is the mean over its own targets; it is differentiated times its share of the batch's
    targets (`batch_weight`, Model.batch_weight: a loss mask gives groups unequal counts;
    without it the groups weigh alike), and times the loss scale, so the groups' losses
    and gradients sum to the whole batch's, as on one device."""
    if not self.axes:
      return micro
    grouped = jax.vmap(micro, in_axes=(None, 0, 0 if per_layer else None, 0),
                       spmd_axis_name=self.axes)
    rows = tuple(a for a in AXES if a not in self.axes) or None

    def run(params, batch, layers_sum, scale):
      split = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
          x.reshape(self.count, -1, *x.shape[1:]),
          self.sharding(P(rows, *[None] * (x.ndim - 1)))), batch)
      share = jnp.full((self.count,), 1.0 / self.count, jnp.float32)
      if batch_weight is not None:
        counts = jax.vmap(batch_weight)(split)
        total = counts.sum()
        share = jnp.where(total > 0, counts / jnp.where(total > 0, total, 1.0), share)
      losses, grads, layers_sum = grouped(params, split, layers_sum,
                                          share if scale is None else scale * share)
      return (losses * share).sum(), grads, layers_sum
    return run

  def reduce(self, grad_sum: Any, shardings: Any, reduce_dtype) -> Any:
    """The one reduce across groups (stage 1: into shards), in `reduce_dtype`: the sum
    of the groups' parts, in float32."""
    if not self.axes:
      return grad_sum
    return jax.tree.map(
        lambda g, sh: jax.lax.with_sharding_constraint(g.astype(reduce_dtype).sum(axis=0), sh)
        .astype(jnp.float32), grad_sum, shardings)
