"""Bytes each device communicates per train step, read from the compiled program.

Every collective of the step (jaxzero.planning.collectives) grouped into rows of alike ops,
with the total per device, what crosses each mesh axis, and the ZeRO paper's figure to set
beside it (and the formulas for what crosses ``pipeline`` and ``context`` alone); as JSON
(``jaxzero.plan --json``) or as a table (``jaxzero.plan --comm``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxzero.engine.state import dtype_of
from jaxzero.models.llama import count_params
from jaxzero.planning.collectives import Collective, Groups, HloModule
from jaxzero.utils.formatting import format_bytes


def mesh_axes(groups: Groups, mesh) -> tuple[str, ...]:
  """The axes of `mesh` along which the devices of some group differ. Ids in HLO
  are positions in the device assignment: for a jit over `mesh`, ``mesh.devices.flat``."""
  spanned = set()
  for group in groups:
    if max(group, default=0) >= mesh.devices.size:
      raise ValueError(f"replica group {group} names devices beyond the mesh {dict(mesh.shape)}")
    coords = np.unravel_index(np.asarray(group, dtype=int), mesh.devices.shape)
    spanned |= {k for k, c in enumerate(coords) if len(set(c.tolist())) > 1}
  return tuple(name for k, name in enumerate(mesh.axis_names) if k in spanned)


def zero_paper_units(stage: int, grad_accum: int = 1, weight_bytes: int = 2,
                     gradient_bytes: int = 2) -> float:
  """The ZeRO paper's figure, counted as jaxzero.planning.collectives counts, in units of
  Φ x 2 bytes; a hybrid stage has its stage's. The paper sends fp16 weights and gradients;
  `weight_bytes` and `gradient_bytes` are a run's (gathered in the compute dtype, reduced
  in zero.reduce_dtype): the figure at those dtypes."""
  weights, gradients = {0: (0, 2), 1: (1, 1), 2: (1, grad_accum),
                        3: (2 * grad_accum, grad_accum)}[stage]
  return (weights * weight_bytes + gradients * gradient_bytes) / 2


@dataclasses.dataclass(frozen=True)
class Row:
  """`count` collectives alike in op, dtype, shape, runs and mesh axes."""
  op: str
  dtype: str
  shape: str
  runs: int
  axes: tuple[str, ...]
  count: int
  bytes_per_run: int  # all `count` together
  counted_bytes: int  # per device per step
  sliced_bytes: int  # per run: all-reduce bytes counted once, as a reduce-scatter


@dataclasses.dataclass
class CommReport:
  rows: list[Row]  # largest first
  collectives: list[Collective]
  total_bytes: int  # per device per step
  units: float  # total_bytes / (Φ × unit_bytes_per_param)
  axis_bytes: dict[str, int]  # of the collectives whose groups span each mesh axis
  n_params: int
  unit_bytes_per_param: int
  paper_units: float | None  # the ZeRO paper's figure, when the stage is known
  notes: list[str]
  # With a pipeline axis: what crosses it alone (of which collective-permutes), and the
  # formula's bytes (2 x micro-batches x one micro-batch's activations per boundary).
  pipeline_bytes: int = 0
  pipeline_permute_bytes: int = 0
  pipeline_formula_bytes: int | None = None
  # With a context axis: what crosses it alone (attention's keys and values), and the
  # formula's bytes for the strategy (see `report`).
  context_bytes: int = 0
  context_formula_bytes: int | None = None
  context_formula: str = ""


def hlo_text(compiled_or_text: Any) -> str:
  """The optimized, partitioned HLO of a ``Compiled`` (or ``Lowered``), or the text itself."""
  if isinstance(compiled_or_text, jax.stages.Lowered):
    compiled_or_text = compiled_or_text.compile()
  return compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()


def report(compiled_or_text: Any, mesh, n_params: int, unit_bytes_per_param: int = 2, *,
           stage: int | None = None, grad_accum: int = 1, tensor: int = 1,
           activation_bytes: int | None = None, kv_bytes: int | None = None,
           context: int = 1, context_strategy: str = "all_gather",
           kv_runs: int = 0, dtype_bytes: tuple[int, int] = (2, 2)) -> CommReport:
  """Every collective of a compiled step, and the bytes per device per step.

  Args:
    compiled_or_text: a ``jax.stages.Compiled`` (or ``Lowered``), or HLO text.
    mesh: the ``jax.sharding.Mesh`` it was compiled for; None leaves axes empty.
    n_params: Φ; unit_bytes_per_param: the bytes of one unit per parameter.
    stage, grad_accum: when the stage is given, the ZeRO paper's figure is added, at
      `dtype_bytes` (the bytes of a gathered weight and of a reduced gradient).
    tensor: `mesh.tensor`; each device then holds 1/tensor of every weight, so the
      paper's figure (for the data axes) is divided by it.
    activation_bytes: with a ``pipeline`` axis, one micro-batch's activations at a stage
      boundary on one device: the pipeline sends are set beside 2 x grad_accum x them.
    kv_bytes, context, context_strategy, kv_runs: with a ``context`` axis of `context`
      devices, the keys and values of one layer's whole sequence for a device's rows, and
      how many times a step attends (layers x micro-batches): what crosses `context` is
      set beside 3 x kv_runs x kv_bytes for "all_gather" (gathered whole, counted as
      above), or 3 x kv_runs x (context - 1) / context x kv_bytes for "ring" (C - 1 hops
      of one part): 3 passes, the forward, its recomputation in the backward (every remat
      policy recomputes the gathered keys and values rather than keep the whole
      sequence's), and their gradients back.
  """
  module = HloModule(hlo_text(compiled_or_text))
  # A weight's gradient reduced in float32 (dtype_bytes[1] == 4), across the data axes (and
  # `context`, whose devices share the weights), is sent so; other float32 casts into a
  # collective are XLA:CPU's widening of bf16, undone.
  def reduced_wide(op, groups) -> bool:
    if dtype_bytes[1] != 4 or mesh is None or op not in ("all-reduce", "reduce-scatter"):
      return False
    axes = set(mesh_axes(groups, mesh))
    return bool(axes & {"replica", "fsdp"}) and axes <= {"replica", "fsdp", "context"}
  found = list(module.collectives(reduced_wide))
  alike: dict[tuple, list[Collective]] = {}
  for c in found:
    axes = mesh_axes(c.replica_groups, mesh) if mesh is not None else ()
    alike.setdefault((c.op, c.dtype, c.shape, c.runs, axes), []).append(c)
  rows = sorted((Row(*key, count=len(cs), bytes_per_run=sum(c.bytes_per_run for c in cs),
                     counted_bytes=sum(c.counted_bytes for c in cs),
                     sliced_bytes=sum(c.sliced_bytes for c in cs))
                 for key, cs in alike.items()), key=lambda r: -r.counted_bytes)
  total = sum(r.counted_bytes for r in rows)
  counts = (sum(c.sliced_bytes > 0 for c in found), sum(bool(c.compiled_dtype) for c in found),
            module.unknown_trips)
  notes = [note.format(n) for n, note in zip(counts, (
      "{} all-reduce(s) feed dynamic-slices only (all or some elements): counted once, as the "
      "reduce-scatter XLA:GPU makes (XLA:CPU never forms one)",
      "{} collective(s) send values that XLA:CPU widened to f32; counted at the dtype the "
      "partitioned program sends",
      "{} while loop(s) with collectives inside and no known trip count: counted as running "
      "once")) if n]
  if stage is not None and dtype_bytes != (2, 2):
    notes.append(f"the ZeRO paper's figure at this run's dtypes: weights gathered in "
                 f"{dtype_bytes[0]}-byte, gradients reduced in {dtype_bytes[1]}-byte values "
                 f"(the paper's fp16 throughout: {zero_paper_units(stage, grad_accum) / tensor:g})")
  if tensor > 1:
    notes.append(f"mesh.tensor={tensor}: the ZeRO paper's figure is over the data axes, for "
                 f"the 1/{tensor} of each weight a device holds; what crosses `tensor` "
                 f"(activations) comes on top")
  alone = [r for r in rows if r.axes == ("pipeline",)]
  formula = None if activation_bytes is None else 2 * grad_accum * activation_bytes
  if formula is not None:
    notes.append("across `pipeline`: each tick's sends, the bubble's too; with GPipe and "
                 "interleaved also the last stage's outputs to all stages and the input "
                 "gradients back (the embedding and head run on every stage)")
  context_formula, context_formula_bytes = "", None
  if kv_bytes is not None and context > 1:
    share = 1.0 if context_strategy == "all_gather" else (context - 1) / context
    context_formula_bytes = int(3 * kv_runs * share * kv_bytes)
    context_formula = ("3 passes x attentions x K,V of the whole sequence" if share == 1 else
                       f"3 passes x attentions x {context - 1}/{context} x K,V of the whole "
                       "sequence")
    notes.append("across `context`: the keys and values go forward, again when the "
                 "backward pass recomputes the layer (they are not kept), and their "
                 "gradients back; packed sequences' segment ids go with them")
  return CommReport(
      rows, found, total, total / (n_params * unit_bytes_per_param),
      {a: sum(r.counted_bytes for r in rows if a in r.axes) for a in getattr(mesh, "axis_names", ())},
      n_params, unit_bytes_per_param,
      None if stage is None else zero_paper_units(stage, grad_accum, *dtype_bytes) / tensor,
      notes,
      sum(r.counted_bytes for r in alone),
      sum(r.counted_bytes for r in alone if r.op == "collective-permute"), formula,
      sum(r.counted_bytes for r in rows if r.axes == ("context",)), context_formula_bytes,
      context_formula)


def for_program(compiled: Any, program, micro: int) -> CommReport:
  """`report` for a train program's (jaxzero.engine.TrainProgram's) compiled step at
  `micro` rows a device: the ZeRO paper's figure for its stage, and the formulas for
  what crosses ``pipeline`` and ``context``."""
  cfg, layout = program.cfg, program.layout
  return report(compiled, layout.mesh, count_params(cfg.model), stage=layout.stage,
                grad_accum=cfg.train.grad_accum, tensor=layout.tensor_size,
                activation_bytes=boundary_bytes(program, micro),
                kv_bytes=kv_bytes(program, micro), context=layout.context_size,
                context_strategy=layout.context_strategy,
                kv_runs=cfg.model.n_layers // layout.pipeline_size * cfg.train.grad_accum,
                dtype_bytes=(np.dtype(dtype_of(cfg.precision.compute)).itemsize,
                             np.dtype(dtype_of(cfg.zero.reduce_dtype
                                               or cfg.zero.grad_dtype)).itemsize))


def boundary_bytes(program, micro: int) -> int | None:
  """With pipeline stages: one micro-batch's activations at a stage boundary on one
  device (its rows x sequence x width, in the compute dtype, split over `tensor` by
  sequence parallelism; interleaved, V times: it goes round V times); else None."""
  layout, cfg = program.layout, program.cfg
  if layout.pipeline_size == 1:
    return None
  itemsize = np.dtype(dtype_of(cfg.precision.compute)).itemsize
  return (micro * cfg.train.seq_len * cfg.model.dim * itemsize // layout.tensor_size
          * cfg.pipeline.virtual_stages)


def kv_bytes(program, micro: int) -> int:
  """One layer's keys and values for the whole sequence of a device's `micro` rows, in
  the compute dtype (the KV heads split over `tensor` where it divides them)."""
  cfg, layout = program.cfg, program.layout
  heads = cfg.model.n_kv_heads
  heads //= layout.tensor_size if heads % layout.tensor_size == 0 else 1
  itemsize = np.dtype(dtype_of(cfg.precision.compute)).itemsize
  return 2 * micro * cfg.train.seq_len * heads * cfg.model.head_dim * itemsize


def as_json(rep: CommReport) -> dict:
  """The report as plain JSON values (``jaxzero.plan --json``)."""
  return dict(dataclasses.asdict(rep), collectives=[
      dict(dataclasses.asdict(c), as_reduce_scatter=c.as_reduce_scatter,
           bytes_per_run=c.bytes_per_run, counted_bytes=c.counted_bytes,
           replica_groups=[list(g) for g in c.replica_groups]) for c in rep.collectives])


def format_table(rep: CommReport) -> str:
  """A plain aligned table: one line per distinct collective, then the totals."""
  size = lambda n: format_bytes(n, digits=2, smallest="KB")
  header = ["op", "dtype", "shape", "count", "runs/step", "mesh axes", "bytes/run",
            "bytes/device/step"]
  body = []
  for r in rep.rows:
    reduce_scatter = ("" if not r.sliced_bytes else " (as reduce-scatter)"
                      if r.sliced_bytes == r.bytes_per_run else " (partly as reduce-scatter)")
    body.append([r.op + reduce_scatter, r.dtype, r.shape, str(r.count), str(r.runs),
                 ",".join(r.axes) or "-", size(r.bytes_per_run), size(r.counted_bytes)])
  widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
  fmt = lambda line: "  ".join(c.ljust(w) if i in (0, 1, 2, 5) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths))).rstrip()
  lines = [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body),
           f"total {rep.total_bytes / 1e9:.3g} GB per device per step = {rep.units:.2f} × "
           f"(Φ×{rep.unit_bytes_per_param} bytes); ZeRO paper: "
           f"{'-' if rep.paper_units is None else f'{rep.paper_units:g}'}"]
  lines += [f"crossing {axis}: {size(b)}" for axis, b in rep.axis_bytes.items()]
  if rep.pipeline_formula_bytes is not None:
    lines.append(f"across pipeline alone: {size(rep.pipeline_bytes)} (collective-permutes "
                 f"{size(rep.pipeline_permute_bytes)}); the formula, 2 x micro-batches x "
                 f"activations per stage boundary: {size(rep.pipeline_formula_bytes)}")
  if rep.context_formula_bytes is not None:
    lines.append(f"across context alone: {size(rep.context_bytes)}; the formula, "
                 f"{rep.context_formula}: {size(rep.context_formula_bytes)}")
  return "\n".join(lines + [f"note: {n}" for n in rep.notes])
