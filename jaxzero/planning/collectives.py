"""The collectives of an optimized, SPMD-partitioned HLO module, and the bytes each sends.

Counts each op's bytes the way the ZeRO paper does: all-gather result bytes; reduce-scatter,
all-to-all and collective-permute operand bytes; all-reduce 2 x operand bytes, or once where
XLA:GPU makes it a reduce-scatter; each times how often it runs per call. XLA:CPU's all-reduce
combining and bf16-to-f32 widening are undone, so the count is that of the partitioned
program. The per-step report is jaxzero.planning.comm_report's.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re
from typing import Iterator

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# What a value may pass through on its way to a dynamic-slice (and still make
# the all-reduce a reduce-scatter), or from a widening convert to a collective.
PASS_THROUGH = frozenset({"bitcast", "reshape", "copy", "convert", "all-reduce-done"})
# ... and what moves elements without changing them, between a widening convert
# and a collective (e.g. a gradient's vocabulary chunks laid out as one weight).
KEEPS_VALUES = PASS_THROUGH | {"transpose"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_INST = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*->.*\{\s*$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
                    r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
# One HLO instruction; attrs: the text after "opcode(": operands, then attributes.
_Inst = collections.namedtuple("_Inst", "name shape opcode operands attrs")
Groups = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of the program, per device.

  Attributes:
    name, op: the instruction's name, and its opcode without ``-start``.
    dtype: of the values sent ("bf16", or "f32+bf16" for a tuple), narrowed back
      where XLA:CPU widened them; compiled_dtype: then what XLA:CPU sends.
    shape: the result, without layouts; operand_bytes, result_bytes: per run.
    replica_groups: device ids per group: positions in the device assignment.
    computation: where the op sits; runs: how often it executes per call.
    sliced_bytes: operand bytes of an all-reduce used only by dynamic-slices.
  """
  name: str
  op: str
  dtype: str
  shape: str
  operand_bytes: int
  result_bytes: int
  replica_groups: Groups
  computation: str
  runs: int
  sliced_bytes: int = 0
  compiled_dtype: str = ""

  @property
  def as_reduce_scatter(self) -> bool:
    """An all-reduce all of whose elements XLA:GPU would make a reduce-scatter."""
    return self.op == "all-reduce" and self.sliced_bytes == self.operand_bytes > 0

  @property
  def bytes_per_run(self) -> int:
    """The ZeRO count of one execution (0 when no group has two devices)."""
    if max(map(len, self.replica_groups), default=0) <= 1:
      return 0
    if self.op == "all-reduce":
      return 2 * self.operand_bytes - self.sliced_bytes
    return self.result_bytes if self.op == "all-gather" else self.operand_bytes

  @property
  def counted_bytes(self) -> int:
    return self.bytes_per_run * self.runs


class HloModule:
  """The parts of an HLO module text that counting needs."""

  def __init__(self, text: str):
    text = re.sub(r"/\*.*?\*/", "", text)
    self.comps: dict[str, list[_Inst]] = {}
    self.root: dict[str, str] = {}
    self.entry, current = None, None
    for line in text.splitlines():
      if current is None:
        if m := _HEADER.match(line):
          current = m.group(2)
          self.comps[current] = []
          self.entry = current if m.group(1) else self.entry
      elif line.strip() == "}":
        current = None
      elif m := _INST.match(line):
        rest = m.group(3)
        if rest.startswith("("):  # a tuple shape
          end = _closing(rest, 0)
          shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
        else:
          shape, _, rest = rest.partition(" ")
        opcode, _, rest = rest.partition("(")
        operands = re.findall(r"%([\w.\-]+)", rest[:_closing("(" + rest, 0) - 1])
        self.comps[current].append(_Inst(m.group(2), shape, opcode.strip(), tuple(operands), rest))
        if m.group(1):
          self.root[current] = m.group(2)
    counts = [re.search(rf"{k}=(\d+)", text) for k in ("num_partitions", "replica_count")]
    self.n_devices = math.prod(int(m.group(1)) for m in counts if m)
    self.roots = set(self.root.values())
    self.insts = {i.name: i for insts in self.comps.values() for i in insts}
    self.users: dict[str, list[tuple[_Inst, int]]] = {}
    self.params: dict[tuple[str, int], str] = {}
    callers: dict[str, list[tuple[str, int]]] = {}
    unknown_trip_bodies = []
    for comp, insts in self.comps.items():
      for inst in insts:
        for k, operand in enumerate(inst.operands):
          self.users.setdefault(operand, []).append((inst, k))
        if inst.opcode == "parameter":
          self.params[comp, int(re.match(r"\s*(\d+)", inst.attrs)[1])] = inst.name
        for key, callee in self.called(inst):
          m = key in ("body", "condition") and re.search(r'"known_trip_count":\{"n":"(\d+)"',
                                                         inst.attrs)
          if key == "body" and not m:
            unknown_trip_bodies.append(callee)
          callers.setdefault(callee, []).append((comp, int(m.group(1)) if m else 1))
    runs: dict[str, int] = {}

    def of(comp: str) -> int:
      if comp not in runs:
        runs[comp] = 0  # a (malformed) cycle counts nothing
        runs[comp] = (comp == self.entry) + sum(of(c) * t for c, t in callers.get(comp, ()))
      return runs[comp]

    self.runs = {comp: of(comp) for comp in self.comps}
    # Only a loop with collectives inside can make the total too low.
    self.unknown_trips = sum(map(self.holds_collectives, unknown_trip_bodies))

  def holds_collectives(self, comp: str, seen: set[str] | None = None) -> bool:
    """Whether computation `comp`, or one it calls, runs a collective."""
    seen = set() if seen is None else seen
    seen.add(comp)
    return any(inst.opcode.removesuffix("-start") in COLLECTIVES
               or any(c not in seen and self.holds_collectives(c, seen)
                      for _, c in self.called(inst))
               for inst in self.comps.get(comp, ()))

  def called(self, inst: _Inst, key: str | None = None) -> list[tuple[str, str]]:
    """(attribute, computation) of each computation `inst` calls."""
    if inst.opcode in ("async-update", "async-done"):  # they repeat the start's calls=
      return []
    return [(k, name.lstrip("%")) for k, value in _CALLS.findall(inst.attrs)
            for name in re.findall(r"%?[\w.\-]+", value) if key in (None, k)]

  def feeds_only_slices(self, name: str, size: int, exits: tuple[str, ...] = ()) -> bool:
    """Whether every use of value `name` is the sliced operand of a dynamic-slice
    keeping `size` elements: one device's part of a reduce-scatter. `exits` are
    the fusions entered: a fused computation's root continues with their users."""
    if not (exits and self.feeds_only_slices(exits[-1], size, exits[:-1])
            if name in self.roots else name in self.users):
      return False
    for inst, k in self.users.get(name, ()):
      if inst.opcode == "dynamic-slice" and k == 0:
        if math.prod(_arrays(inst.shape)[0][1]) != size:
          return False
      elif not (inst.opcode in PASS_THROUGH and self.feeds_only_slices(inst.name, size, exits)):
        fused = self.called(inst, "calls") if inst.opcode == "fusion" else []
        param = fused and self.params.get((fused[0][1], k))
        if not (param and self.feeds_only_slices(param, size, exits + (inst.name,))):
          return False
    return True

  def narrow_dtype(self, name: str) -> str | None:
    """The narrower float dtype value `name` was widened from, if it was."""
    inst = self.insts.get(name)
    while inst is not None and inst.opcode != "convert":
      fused = self.called(inst, "calls") if inst.opcode == "fusion" else []
      inst = (self.insts.get(self.root.get(fused[0][1], "")) if fused else
              self.insts.get(inst.operands[0]) if inst.opcode in KEEPS_VALUES else None)
    if inst is None or (source := self.insts.get(inst.operands[0])) is None:
      return None
    wide, narrow = _arrays(inst.shape)[0][0], _arrays(source.shape)[0][0]
    return narrow if wide in ("f32", "f64") and narrow in ("bf16", "f16") else None

  def collectives(self, sent_wide=lambda op, groups: False) -> Iterator[Collective]:
    """Every collective; a widening convert into one is XLA:CPU's, and undone, but where
    `sent_wide(op, replica_groups)` says the program itself sends the wide values (a
    gradient reduced in float32, converted from bfloat16 just before, looks alike)."""
    dtypes = lambda arrays: "+".join(dict.fromkeys(dt for dt, _ in arrays))
    for comp, insts in self.comps.items():
      for inst in insts:
        op = inst.opcode.removesuffix("-start")
        if op not in COLLECTIVES:
          continue
        operands = [self.insts[o] for o in inst.operands if o in self.insts]
        compiled = [a for o in operands for a in _arrays(o.shape)]
        groups = replica_groups(inst.attrs, self.n_devices)
        wide = sent_wide(op, groups)
        sent = [((None if wide else self.narrow_dtype(o.name)) or dt, dims)
                for o in operands for dt, dims in _arrays(o.shape)]
        results = _arrays(inst.shape)
        if inst.opcode == "all-gather-start":  # (operands..., results...)
          results = results[len(sent):]
        elif op == "collective-permute":
          results = sent
        elif len(results) == len(sent):  # the element types of the (narrowed) operands
          results = [(s[0], r[1]) for s, r in zip(sent, results)]
        yield Collective(
            name=inst.name, op=op, dtype=dtypes(sent),
            shape=", ".join(f"{dt}[{','.join(map(str, dims))}]" for dt, dims in results),
            operand_bytes=_nbytes(sent), result_bytes=_nbytes(results),
            replica_groups=groups, computation=comp, runs=self.runs.get(comp, 0),
            sliced_bytes=(self.sliced_bytes(inst, sent, max(map(len, groups)))
                          if op == "all-reduce" else 0),
            compiled_dtype=dtypes(compiled) if dtypes(compiled) != dtypes(sent) else "")

  def sliced_bytes(self, inst: _Inst, sent, n: int) -> int:
    """Operand bytes of all-reduce `inst` (over groups of `n`) used only by
    dynamic-slices that keep 1/n of them: what XLA:GPU makes a reduce-scatter."""
    part = lambda element: math.prod(element[1]) // n
    if not inst.shape.startswith("("):
      return _nbytes(sent) if sent and self.feeds_only_slices(inst.name, part(sent[0])) else 0
    users = [u for u, _ in self.users.get(inst.name, [])]
    if any(u.opcode != "get-tuple-element" for u in users):
      return 0
    index = lambda u: int(re.search(r"index=(\d+)", u.attrs)[1])
    return sum(_nbytes([element]) for k, element in enumerate(sent)
               if (gtes := [u for u in users if index(u) == k])
               and all(self.feeds_only_slices(g.name, part(element)) for g in gtes))


def _closing(text: str, start: int) -> int:
  """Index of the bracket that closes the one at `start`."""
  depths = itertools.accumulate((c in "({[") - (c in ")}]") for c in text[start:])
  return next((start + i for i, depth in enumerate(depths) if depth == 0), len(text))


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of each array in a (tuple) shape; layouts ignored."""
  return [(dt, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d))
          for dt, dims in _ARRAY.findall(re.sub(r"\{[^{}]*\}", "", shape))]


def _nbytes(arrays) -> int:
  return sum(DTYPE_BYTES.get(dt, 0) * math.prod(dims) for dt, dims in arrays)


def replica_groups(attrs: str, n_devices: int) -> Groups:
  """The groups of an op's attributes, in any of XLA's forms: explicit
  ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]T(1,0)``, or mesh axes
  ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` (sub-axes: ``'b':(1)2``)."""

  def iota(reshape: str, perm: str | None) -> np.ndarray:
    dims = [int(d) for d in reshape.split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids

  if m := re.search(r"(?:replica_groups|source_target_pairs)=\{", attrs):
    body = attrs[m.end():_closing(attrs, m.end() - 1)]
    groups = tuple(tuple(map(int, re.findall(r"\d+", g))) for g in re.findall(r"\{[^{}]*\}", body))
    return groups or (tuple(range(n_devices)),)
  if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
    ids = iota(m.group(2), m.group(3)).reshape([int(d) for d in m.group(1).split(",")])
    return tuple(map(tuple, ids.tolist()))
  if not (m := re.search(r"replica_groups=mesh\[([^\]]*)\]", attrs)):
    return (tuple(range(n_devices)),)
  axes = re.findall(r"'?([^'=,\s]+)'?=(\d+)", m.group(1))
  names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
  ids, rest = np.arange(math.prod(sizes)), attrs[m.end():]
  if m := re.match(r",\s*device_ids=\(", rest):
    end = _closing(rest, m.end() - 1)
    body, rest = rest[m.end():end], rest[end + 1:]
    form = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", body)
    ids = iota(*form.groups()) if form else np.array([int(i) for i in re.findall(r"\d+", body)])
  refs = [(names.index(a), int(p) if p else None, int(s) if s else None) for a, p, s in
          re.findall(r"'?([^':,\s{}]+)'?(?::\((\d+)\)(\d+))?", re.search(r"\{([^}]*)\}", rest)[1])]
  # Split each mesh dimension into its sub-axes, major first; group over the named ones.
  factors, position = [], {}
  for dim, size in enumerate(sizes):
    boundary = 1
    for pre, sub in sorted((p, s) for d, p, s in refs if d == dim and s):
      if pre != boundary:
        factors.append(pre // boundary)
      position[dim, pre] = len(factors)
      factors.append(sub)
      boundary = pre * sub
    position.setdefault((dim, None), len(factors))
    if boundary != size:
      factors.append(size // boundary)
  grouped = [position[d, p] for d, p, _ in refs]
  order = [i for i in range(len(factors)) if i not in grouped] + grouped
  ids = ids.reshape(factors).transpose(order).reshape(-1, math.prod(factors[i] for i in grouped))
  return tuple(map(tuple, ids.tolist()))


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective op of an HLO module text, with its bytes and runs per call."""
  return list(HloModule(hlo_text).collectives())
