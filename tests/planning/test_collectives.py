"""The communication report: parsing collectives out of HLO text, and one compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.parallel.mesh import make_mesh
from jaxzero.planning import collectives, comm_report


def _module(*computations: str, entry: str) -> str:
  """A module text: computations, then ENTRY with `entry`'s instructions."""
  return "\n\n".join(["HloModule m, num_partitions=8", *computations,
                      f"ENTRY %main (p0: f32[4]) -> f32[4] {{\n{entry}\n}}"])


def _one(text: str) -> collectives.Collective:
  (found,) = collectives.collectives(text)
  return found


@pytest.mark.parametrize("groups, expected", [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{}", (tuple(range(8)),)),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=2,'b'=4] {'b'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=1,'b'=4,'c'=2], device_ids=([2,4]T(1,0)) {'b'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
])
def test_replica_group_forms(groups, expected):
  c = _one(_module(entry=f"  %p0 = f32[4]{{0}} parameter(0)\n  ROOT %ar = f32[4]{{0}} "
                         f"all-reduce(%p0), replica_groups={groups}, to_apply=%add"))
  assert c.replica_groups == expected


def test_runs_multiply_nested_trip_counts_and_sum_over_call_sites():
  inner = """%inner (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ag = f32[4]{0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}
}"""
  fused = """%fused (fp: f32[4]) -> f32[4] {
  ROOT %fp = f32[4]{0} parameter(0)
}"""
  outer = """%outer (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  %w = f32[4]{0} while(%q), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %f = f32[4]{0} fusion(%w), kind=kLoop, calls=%fused
}"""
  cond = "%cond (c: f32[4]) -> pred[] {\n  ROOT %k = pred[] constant(true)\n}"
  entry = """  %p0 = f32[4]{0} parameter(0)
  %w1 = f32[4]{0} while(%p0), condition=%cond, body=%outer, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %c1 = f32[4]{0} call(%w1), to_apply=%outer"""
  c = _one(_module(inner, fused, outer, cond, entry=entry))
  assert (c.op, c.computation, c.runs) == ("all-gather", "inner", 3 * 4 + 4)
  assert c.counted_bytes == 16 * 16



def test_only_loops_of_unknown_trip_count_with_collectives_inside_are_noted():
  """Such a loop's collectives are counted as running once, so the total may be
  low: the report says so, and stays quiet about loops that move nothing."""
  gathers = """%gathers (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} call(%p), to_apply=%inner
}"""
  inner = """%inner (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %ag = f32[4]{0} all-gather(%q), replica_groups=[2,4]<=[8], dimensions={0}
}"""
  computes = """%computes (r: f32[4]) -> f32[4] {
  %r = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%r)
}"""
  cond = "%cond (c: f32[4]) -> pred[] {\n  ROOT %k = pred[] constant(true)\n}"
  entry = """  %p0 = f32[4]{0} parameter(0)
  %w1 = f32[4]{0} while(%p0), condition=%cond, body=%computes
  ROOT %w2 = f32[4]{0} while(%w1), condition=%cond, body=%gathers"""
  rep = comm_report.report(_module(gathers, inner, computes, cond, entry=entry), None, n_params=8)
  assert [n for n in rep.notes if "trip count" in n] == [
      "1 while loop(s) with collectives inside and no known trip count: counted as running once"]

def test_tuple_all_reduce_counts_every_element():
  entry = """  %a = f32[4]{0} parameter(0)
  %b = bf16[8,2]{1,0} parameter(1)
  %ar = (f32[4]{0}, /*index=1*/bf16[8,2]{1,0}) all-reduce(%a, %b), replica_groups={}, to_apply=%add
  ROOT %g = f32[4]{0} get-tuple-element(%ar), index=0"""
  c = _one(_module(entry=entry))
  assert (c.dtype, c.shape, c.operand_bytes) == ("f32+bf16", "f32[4], bf16[8,2]", 16 + 32)
  assert (c.sliced_bytes, c.bytes_per_run) == (0, 2 * 48)


def test_all_reduce_feeding_only_dynamic_slices_counts_once():
  fused = """%fused_ds (fp: f32[8], fi: s32[]) -> f32[2] {
  %fp = f32[8]{0} parameter(0)
  %fi = s32[] parameter(1)
  %cv = f32[8]{0} convert(%fp)
  ROOT %ds = f32[2]{0} dynamic-slice(%cv, %fi), dynamic_slice_sizes={2}
}"""
  entry = """  %p0 = f32[8]{0} parameter(0)
  %i = s32[] parameter(1)
  %ar = f32[8]{0} all-reduce(%p0), replica_groups=[2,4]<=[8], to_apply=%add
  %bc = f32[2,4]{1,0} bitcast(%ar)
  %re = f32[8]{0} reshape(%bc)
  %d1 = f32[2]{0} dynamic-slice(%re, %i), dynamic_slice_sizes={2}
  ROOT %f = f32[2]{0} fusion(%ar, %i), kind=kLoop, calls=%fused_ds"""
  c = _one(_module(fused, entry=entry))
  assert c.as_reduce_scatter and c.bytes_per_run == 32
  # Any other use (here an add) keeps the full all-reduce.
  c = _one(_module(fused, entry=entry.replace("ROOT %f = f32[2]{0} fusion(%ar, %i)",
                                              "%x = f32[8]{0} add(%ar, %ar)\n  ROOT %f = "
                                              "f32[2]{0} fusion(%ar, %i)")))
  assert not c.as_reduce_scatter and c.bytes_per_run == 64
  # So does a slice that keeps more than one device's part (groups of 4: 2 of 8 elements).
  c = _one(_module(fused, entry=entry.replace("[2,4]<=[8]", "[4,2]<=[8]")))
  assert not c.as_reduce_scatter and c.bytes_per_run == 64


def test_async_start_done_pairs_count_once():
  entry = """  %p0 = f32[2]{0} parameter(0)
  %ags = (f32[2]{0}, f32[8]{0}) all-gather-start(%p0), replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  %ars = f32[8]{0} all-reduce-start(%agd), replica_groups=[2,4]<=[8], to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %i = s32[] parameter(1)
  ROOT %ds = f32[2]{0} dynamic-slice(%ard, %i), dynamic_slice_sizes={2}"""
  gather, reduce = collectives.collectives(_module(entry=entry))
  assert (gather.op, gather.shape, gather.result_bytes, gather.counted_bytes) == (
      "all-gather", "f32[8]", 32, 32)
  assert (reduce.op, reduce.as_reduce_scatter, reduce.counted_bytes) == ("all-reduce", True, 32)


def test_values_widened_by_xla_cpu_count_at_their_narrow_dtype():
  fused = """%widen (fp: f32[4]) -> f32[4] {
  %fp = f32[4]{0} parameter(0)
  %nb = bf16[4]{0} convert(%fp)
  ROOT %nf = f32[4]{0} convert(%nb)
}"""
  entry = """  %p0 = f32[4]{0} parameter(0)
  %w = f32[4]{0} fusion(%p0), kind=kLoop, calls=%widen
  ROOT %ag = f32[16]{0} all-gather(%w), replica_groups=[2,4]<=[8], dimensions={0}"""
  c = _one(_module(fused, entry=entry))
  assert (c.dtype, c.compiled_dtype, c.shape, c.result_bytes) == ("bf16", "f32", "bf16[16]", 32)


def test_a_value_widened_then_transposed_counts_at_its_narrow_dtype():
  """As a head's gradient: bf16 vocabulary chunks, widened by XLA:CPU and laid
  out as one [D, V] weight (a transpose) before the all-reduce."""
  fused = """%widen (fp: bf16[2,3]) -> f32[3,2] {
  %fp = bf16[2,3]{1,0} parameter(0)
  %nf = f32[2,3]{1,0} convert(%fp)
  %t = f32[3,2]{0,1} transpose(%nf), dimensions={1,0}
  %c = f32[3,2]{1,0} copy(%t)
  ROOT %b = f32[3,2]{1,0} bitcast(%c)
}"""
  entry = """  %p0 = bf16[2,3]{1,0} parameter(0)
  %w = f32[3,2]{1,0} fusion(%p0), kind=kLoop, calls=%widen
  ROOT %ar = f32[3,2]{1,0} all-reduce(%w), replica_groups=[1,8]<=[8], to_apply=%add"""
  c = _one(_module(fused, entry=entry))
  assert (c.dtype, c.compiled_dtype, c.operand_bytes) == ("bf16", "f32", 12)


def test_zero_paper_units():
  assert [comm_report.zero_paper_units(s, 4) for s in range(4)] == [2, 2, 5, 12]
  assert [comm_report.zero_paper_units(s) for s in range(4)] == [2, 2, 2, 3]
  # bf16 weights gathered, gradients reduced in float32 (zero.grad_dtype's default).
  assert [comm_report.zero_paper_units(s, 2, 2, 4) for s in range(4)] == [4, 3, 5, 8]


@pytest.mark.parametrize("axis, dtype_bytes, sent", [
    ("fsdp", (2, 4), ("f32", 24)),  # a gradient reduced in float32: sent so
    ("fsdp", (2, 2), ("bf16", 12)),  # reduced in bf16: the float32 is XLA:CPU's widening
    ("tensor", (2, 4), ("bf16", 12)),  # activations across `tensor`: XLA:CPU's widening
])
def test_a_gradient_reduced_in_float32_counts_as_float32(axis, dtype_bytes, sent):
  """A bf16 gradient cast to float32 for its reduce looks like XLA:CPU's widening; across
  the data axes with zero.reduce_dtype float32 it is the program's, and counted so."""
  fused = """%widen (fp: bf16[2,3]) -> f32[2,3] {
  %fp = bf16[2,3]{1,0} parameter(0)
  ROOT %nf = f32[2,3]{1,0} convert(%fp)
}"""
  entry = """  %p0 = bf16[2,3]{1,0} parameter(0)
  %w = f32[2,3]{1,0} fusion(%p0), kind=kLoop, calls=%widen
  ROOT %ar = f32[2,3]{1,0} all-reduce(%w), replica_groups=[1,8]<=[8], to_apply=%add"""
  mesh = Mesh(np.array(jax.devices()[:8]), (axis,))
  rep = comm_report.report(_module(fused, entry=entry), mesh, n_params=6, stage=0,
                           dtype_bytes=dtype_bytes)
  (c,) = rep.collectives
  assert (c.dtype, c.operand_bytes) == sent


def _scan_step(mesh):
  """A layer scan gathering a weight sharded over fsdp; a loss summed over every device."""
  def f(w_LxDxD, x_BxD, v_RxD):
    def layer(h, w):
      return h @ jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())), None
    h, _ = jax.lax.scan(layer, x_BxD, w_LxDxD)
    return h.sum(), v_RxD.sum(0)

  w = jax.ShapeDtypeStruct((5, 16, 16), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32,
                           sharding=NamedSharding(mesh, P(("replica", "fsdp"))))
  v = jax.ShapeDtypeStruct((2, 16), jnp.float32, sharding=NamedSharding(mesh, P("replica")))
  return jax.jit(f).lower(w, x, v).compile()


@pytest.mark.parametrize("order", ["in order", "permuted"])
def test_compiled_scan_on_a_2x4_mesh(order):
  devices = jax.devices()[:8]
  if order == "permuted":  # ids in the HLO are positions in the mesh, not device ids
    devices = [devices[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
  mesh = (make_mesh(2, 4, devices) if order == "in order" else
          Mesh(np.asarray(devices).reshape(2, 4), ("replica", "fsdp"),
               axis_types=(AxisType.Auto,) * 2))
  rep = comm_report.report(_scan_step(mesh), mesh, n_params=5 * 16 * 16, stage=3)
  by_op = {(r.op, r.axes): r for r in rep.rows}
  gather = by_op["all-gather", ("fsdp",)]
  assert (gather.runs, gather.dtype, gather.counted_bytes) == (5, "bf16", 5 * 16 * 16 * 2)
  assert ("all-reduce", ("replica", "fsdp")) in by_op  # the loss: over every device
  assert ("all-reduce", ("replica",)) in by_op  # v's rows: over replica only
  assert rep.total_bytes == sum(r.counted_bytes for r in rep.rows)
  assert rep.axis_bytes["fsdp"] >= gather.counted_bytes
  assert rep.units == pytest.approx(rep.total_bytes / (5 * 16 * 16 * 2))
  table = comm_report.format_table(rep)
  assert "all-gather" in table and "ZeRO paper: 3" in table and "per device per step" in table
  assert comm_report.as_json(rep)["collectives"][0]["replica_groups"]
