"""The NVMe tier's files: each process's shards of the fp32 master weights and
optimizer moments, on local disk.

A *chunk* is a box of one shard holding all K copies of a weight (the master weight, then the
optimizer's per-weight leaves), [K, *box], read and written whole with O_DIRECT at a fixed
offset of one file per weight under ``offload.nvme_dir/jaxzero-<run>/process_<i>``. A process
reads and writes only its own shards, and nothing here is read back after a restart: a run
rebuilds its store from its last checkpoint, so a store half-written by a killed run cannot
reach a checkpoint or a resumed run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import functools
import itertools
import json
import logging
import math
import mmap
import os
import pathlib
import queue
import shutil
import socket
import weakref
from typing import Callable, Iterable, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.checkpoint import integrity
from jaxzero.errors import PathError
from jaxzero.parallel import mesh as mesh_lib

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # most bytes of a chunk (all K copies of a device's box) where cut
MARKER = "jaxzero-nvme-store.json"  # marks a directory this module made (and may delete)
IN_FLIGHT = 3  # chunks read ahead, and chunks being written, at a time
IO_THREADS = 4
_ALIGN = 4096  # O_DIRECT's alignment of offsets, sizes and buffers

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class Region:
  """One shard of a weight held by this process."""
  box: Box  # where it lies in the weight
  devices: tuple  # the local devices holding it (more than one only when replicated)
  owner: bool  # this process writes it into checkpoints (one process per shard)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One weight as the NVMe tier keeps it, cut into chunks."""
  name: str  # its path in the master tree, e.g. "layers/w_up_LxDxF"
  shape: tuple[int, ...]
  kinds: tuple[str, ...]  # the TrainState leaf of each of its K copies
  sharding: NamedSharding  # the optimizer's layout, in device memory
  chunk: tuple[int, ...]  # a chunk's length in each dimension (all of it where uncut)
  # Stored padded (jaxzero.parallel.padding): the weight's true shape, which checksums cover.
  true_shape: tuple[int, ...] | None = None
  stacked: bool = False  # a layer stack (the model's layers_key): dimension 0 is the layer

  def layer(self, starts: tuple[int, ...]) -> int:
    """The layer a chunk at `starts` holds (-1: a weight outside the layer stack; 0 for a
    stack of one layer, whose layer dimension is not cut)."""
    if not self.stacked:
      return -1
    return starts[self.cut.index(0)] if 0 in self.cut else 0

  @property
  def cut(self) -> tuple[int, ...]:
    """The dimensions chunks cut (never one a mesh axis splits)."""
    return tuple(d for d, (n, c) in enumerate(zip(self.shape, self.chunk)) if c < n)

  def starts(self) -> list[tuple[int, ...]]:
    """Where each chunk starts along the cut dimensions, in order."""
    return list(itertools.product(*(range(0, self.shape[d], self.chunk[d]) for d in self.cut)))

  @property
  def chunk_sharding(self) -> NamedSharding:
    """Of a chunk [K, *chunk] as one global array: each device its own box."""
    spec = mesh_lib.spec_per_dimension(self.sharding, len(self.shape))
    return NamedSharding(self.sharding.mesh, P(None, *spec))

  def chunk_box(self, region: Region, starts: tuple[int, ...]) -> Box:
    box = list(region.box)
    for d, start in zip(self.cut, starts):
      box[d] = (start, start + self.chunk[d])
    return tuple(box)

  @functools.cached_property
  def regions(self) -> tuple[Region, ...]:
    """This process's shards, each once, in the order of the devices holding them."""
    holders: dict[Box, list] = collections.defaultdict(list)
    for device, index in self.sharding.devices_indices_map(self.shape).items():
      holders[_box(index, self.shape)].append(device)
    me = jax.process_index()
    regions = []
    for box, devices in holders.items():
      local = tuple(d for d in devices if d.process_index == me)
      if local:
        owner = min(devices, key=lambda d: d.id).process_index == me
        regions.append(Region(box, local, owner))
    return tuple(regions)

  @property
  def local_bytes(self) -> int:
    return sum(len(self.kinds) * 4 * math.prod(b - a for a, b in r.box) for r in self.regions)


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def plan_leaf(name: str, shape: tuple[int, ...], kinds: tuple[str, ...],
              sharding: NamedSharding, stacked: bool, chunk_bytes: int | None = None,
              true_shape: tuple[int, ...] | None = None) -> Leaf:
  """How a weight is cut into chunks: a stacked weight one layer at a time, then
  (any weight) along the dimensions no mesh axis splits, first to last, until a
  device's box of all K copies is at most `chunk_bytes`."""
  chunk_bytes = chunk_bytes or CHUNK_BYTES
  chunk = list(sharding.shard_shape(shape))
  spec = mesh_lib.spec_per_dimension(sharding, len(shape))
  free = [d for d, axes in enumerate(spec) if axes is None]
  if stacked:
    chunk[0] = 1
  for d in free:
    size = len(kinds) * 4 * math.prod(chunk)
    if size <= chunk_bytes:
      break
    row = size // chunk[d]
    chunk[d] = max([b for b in range(1, chunk[d] + 1)
                    if chunk[d] % b == 0 and b * row <= chunk_bytes] or [1])
  # In global terms a chunk spans the whole of every split dimension.
  return Leaf(name, shape, kinds, sharding,
              tuple(n if d not in free else c for d, (n, c) in enumerate(zip(shape, chunk))),
              None if true_shape is None or tuple(true_shape) == tuple(shape)
              else tuple(true_shape), stacked)


def index(box: Box) -> tuple[slice, ...]:
  return (slice(None), *(slice(a, b) for a, b in box))


def key(name: str) -> str:
  return name.replace("/", ".")


class Writes:
  """Writes in flight, at most `limit` (each holds its chunk's bytes until done)."""

  def __init__(self, limit: int = IN_FLIGHT):
    self._pending: collections.deque = collections.deque()
    self._limit = limit

  def add(self, future) -> None:
    self._pending.append(future)
    while len(self._pending) > self._limit:
      self._pending.popleft().result()

  def wait(self) -> None:
    while self._pending:
      self._pending.popleft().result()


def prefetched(keys: Iterable, read: Callable, depth: int = IN_FLIGHT) -> Iterator:
  """(key, value) for each key, with the next `depth` reads in flight."""
  keys = iter(keys)
  pending: collections.deque = collections.deque()

  def more():
    for key in keys:
      pending.append((key, read(key)))
      return

  for _ in range(depth):
    more()
  while pending:
    key, future = pending.popleft()
    more()
    yield key, future.result()


@jax.tree_util.register_static
class Store:
  """One process's working copy of the NVMe tier's state (see the module's docstring).

  A static pytree node: a state holding it flattens to its in-memory leaves.
  """

  def __init__(self, directory: pathlib.Path, leaves: list[Leaf], derived: str | None = None):
    """`derived`: where the run keeps no compute copy of the weights (offload.params=nvme),
    its dtype: a checkpoint then records ``params/<weight>`` as the master cast to it."""
    self.directory = directory
    self.leaves = leaves
    self.derived = derived
    self.writes = Writes()
    if directory.exists():
      remove(directory)  # a killed run's: never read, the checkpoint is the state
    directory.mkdir(parents=True)
    (directory / MARKER).write_text(json.dumps({"process": jax.process_index()}) + "\n")
    self._threads = concurrent.futures.ThreadPoolExecutor(IO_THREADS, "jaxzero-nvme")
    self._files, self._slots = {}, {}
    for leaf in leaves:
      size = 0
      for region, starts, shape, padded in _slots(leaf):
        self._slots[leaf.name, region.box, starts] = (size, shape, padded)
        size += padded
      self._files[leaf.name] = fd = _open_direct(directory / f"{key(leaf.name)}.f32")
      if size:
        os.posix_fallocate(fd, 0, size)
    self._buffers = _Buffers(max((padded for _, _, padded in self._slots.values()),
                                 default=_ALIGN))
    self._partial: dict[int, _Buffers] = {}  # reads of a chunk's first copies, by size

  def read(self, leaf: Leaf, region: Region, starts: tuple[int, ...], copies: int | None = None):
    """Future of a chunk [K, ...] of `region` (float32 numpy), or of its first
    `copies` copies only (the copies lie one after the other: only those are read)."""
    offset, shape, padded = self._slots[leaf.name, region.box, starts]
    fd = self._files[leaf.name]
    buffers = self._buffers
    if copies is not None:  # into a buffer of their size: a third of one, for a master weight
      shape = (copies, *shape[1:])
      padded = -(-4 * math.prod(shape) // _ALIGN) * _ALIGN
      buffers = self._partial.setdefault(padded, _Buffers(padded))

    def read():
      buffer = buffers.lend()
      _transfer(os.preadv, fd, buffer[:padded], offset)
      return buffer[:4 * math.prod(shape)].view(np.float32).reshape(shape)

    return self._threads.submit(read)

  def write(self, leaf: Leaf, region: Region, starts: tuple[int, ...], chunk: np.ndarray) -> None:
    offset, shape, padded = self._slots[leaf.name, region.box, starts]
    fd = self._files[leaf.name]

    def write():  # O_DIRECT writes from an aligned buffer: `chunk` is copied there
      buffer = self._buffers.lend()
      buffer[:4 * math.prod(shape)].view(np.float32).reshape(shape)[...] = chunk
      _transfer(os.pwritev, fd, buffer[:padded], offset)

    self.writes.add(self._threads.submit(write))

  def chunks(self) -> Iterator[tuple[Leaf, Region, tuple[int, ...]]]:
    """Every chunk this process keeps."""
    return chunks_of(self.leaves)

  def close(self) -> None:
    """Waits for writes in flight and deletes the files (the checkpoint keeps the state)."""
    self.writes.wait()
    self._threads.shutdown()
    for fd in self._files.values():
      os.close(fd)
    for buffers in (self._buffers, *self._partial.values()):
      buffers.clear()
    remove(self.directory)


def chunks_of(leaves: list[Leaf]) -> Iterator[tuple[Leaf, Region, tuple[int, ...]]]:
  """Every chunk of `leaves` this process keeps: (leaf, region, chunk start)."""
  for leaf in leaves:
    for region in leaf.regions:
      for starts in leaf.starts():
        yield leaf, region, starts


def _slots(leaf: Leaf) -> Iterator[tuple[Region, tuple[int, ...], tuple[int, ...], int]]:
  """(region, starts, chunk shape, bytes on disk) of each chunk of `leaf` this process keeps."""
  for region in leaf.regions:
    for starts in leaf.starts():
      shape = (len(leaf.kinds), *(b - a for a, b in leaf.chunk_box(region, starts)))
      yield region, starts, shape, -(-4 * math.prod(shape) // _ALIGN) * _ALIGN


_DIRECT = getattr(os, "O_DIRECT", 0)


def _open_direct(path: pathlib.Path) -> int:
  """A new file for O_DIRECT reads and writes (buffered where the filesystem
  refuses O_DIRECT, e.g. tmpfs)."""
  try:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _DIRECT, 0o600)
  except OSError as e:
    if not _DIRECT or e.errno != errno.EINVAL:
      raise
  log.warning("%s: the filesystem refuses O_DIRECT; the NVMe tier goes through the page cache",
              path.parent)
  if path.exists():
    os.remove(path)
  return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)


class _Buffers:
  """Page-aligned buffers (as O_DIRECT needs) of the largest chunk's size, reused.

  A fresh anonymous map costs a page fault per 4 KiB on its first touch: for
  every chunk read, most of the update's system time. A buffer is lent as a
  new uint8 array over it and comes back once that array is gone. Every numpy
  view of it keeps it alive (a view's base is the first array of its chain),
  and so does JAX where a CPU device aliases a read chunk instead of copying
  it; so a buffer is never reused while anything can still see it. The pool
  never holds more buffers than were in use at once, as fresh maps would.
  """

  def __init__(self, size: int):
    self._size = size
    # Reentrant, unlike a list under a lock: a buffer can come back from a
    # finalizer that garbage collection runs in the middle of lend().
    self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()

  def lend(self) -> np.ndarray:
    try:
      buffer = self._free.get_nowait()
    except queue.Empty:
      buffer = mmap.mmap(-1, self._size)
    whole = np.frombuffer(buffer, np.uint8)
    weakref.finalize(whole, self._free.put, buffer)
    return whole

  def clear(self) -> None:
    """Unmaps the buffers not lent out."""
    while not self._free.empty():
      self._free.get_nowait().close()


def _transfer(call, fd: int, buffer, offset: int) -> None:
  """All of `buffer` read or written at `offset` (a transfer may stop short)."""
  view, done = memoryview(buffer), 0
  while done < len(view):
    n = call(fd, [view[done:]], offset + done)
    if n <= 0:
      raise OSError(f"the NVMe tier's file ended at byte {offset + done}")
    done += n


def remove(directory: pathlib.Path) -> None:
  """Deletes a store directory, only if this module made it (or it is empty: one a kill
  left between making it and marking it); then its run's directory if that is left
  empty."""
  if not (directory / MARKER).exists() and any(directory.iterdir()):
    raise PathError(f"{directory} exists but was not made by jaxzero's NVMe tier: "
                          "it is left alone; move it away")
  shutil.rmtree(directory)
  try:
    directory.parent.rmdir()
  except OSError:
    pass  # other processes' stores are still there


# An engine's store directory is jaxzero-engine-HOST-PID-ID (jaxzero.runners.nvme).
ENGINE_PREFIX = "engine-"


def remove_dead_engine_stores(root: pathlib.Path) -> None:
  """Deletes the stores of this host's engines whose process has ended (a killed
  notebook's): nothing else would find them again."""
  host = socket.gethostname()
  for run in root.glob(f"jaxzero-{ENGINE_PREFIX}{host}-*"):
    pid = run.name[len(f"jaxzero-{ENGINE_PREFIX}{host}-"):].split("-")[0]
    if not pid.isdigit() or _alive(int(pid)):
      continue
    for store in run.glob("process_*"):
      if (store / MARKER).exists():
        remove(store)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's
    return True
  return True


# ----------------------------------------------------------------------------- checksums


class Sums:
  """Checksums (and finiteness) of the boxes a process owns, per TrainState leaf."""

  def __init__(self):
    self.sums: dict[str, int] = collections.defaultdict(int)
    self.finite: dict[str, bool] = collections.defaultdict(lambda: True)

  def add(self, leaf: Leaf, box: Box, chunk: np.ndarray, kinds=None) -> None:
    offsets = np.array([a for a, _ in box], np.int32)
    values = np.asarray(integrity.box_checksums(_on_cpu(chunk), offsets, leaf.shape,
                                                leaf.true_shape))
    for k, kind in enumerate(kinds or leaf.kinds):
      self.sums[kind] = (self.sums[kind] + int(values[0, k])) % 2**32
      self.finite[kind] &= bool(values[1, k])

  def as_json(self) -> dict:
    return {"algorithm": integrity.ALGORITHM, "sums": dict(self.sums),
            "nonfinite": sorted(k for k, ok in self.finite.items() if not ok)}

  def global_totals(self, kinds: list[str]) -> tuple[dict[str, str], list[str]]:
    """({leaf: hex checksum}, non-finite leaves) over every process's boxes."""
    local = np.array([[self.sums[k] for k in kinds], [self.finite[k] for k in kinds]],
                     np.uint32).reshape(2, len(kinds))
    if jax.process_count() > 1:
      local = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 2, len(kinds))
    local = local.reshape(-1, 2, len(kinds)).astype(np.uint64)
    sums = local[:, 0].sum(axis=0) % 2**32
    finite = local[:, 1].all(axis=0)
    return ({k: f"{int(s):08x}" for k, s in zip(kinds, sums)},
            [k for k, ok in zip(kinds, finite) if not ok])


@functools.cache
def _cpu():
  """Where checksums are computed: the host (any local device if JAX hides it)."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return jax.local_devices()[0]


def _on_cpu(chunk: np.ndarray) -> jax.Array:
  return jax.device_put(chunk, _cpu())


def derived_kind(name: str) -> str:
  """The TrainState leaf of weight `name`'s compute copy, where derived from its master."""
  return f"params/{name}"


def bytes_needed(leaves: list[Leaf]) -> int:
  """Bytes this process's store takes on disk."""
  return sum(padded for leaf in leaves for *_, padded in _slots(leaf))


def directory_bytes(directory: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
