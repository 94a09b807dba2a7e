"""The NVMe tier's checkpoint item (``nvme``): its state as an NVMe run saves it.

The item holds the store's arrays (one per weight, its K copies stacked, chunked by shard);
each chunk is copied, with its part of the checksums, by the one process that owns its shard,
inside orbax's atomic step directory, so a checkpoint is complete or absent. Restoring reads
boxes of any shape, into an NVMe run's store or an in-memory run's shardings, on any mesh and
stage. :data:`SIDE_ITEM` plugs the item into the checkpointer (jaxzero.checkpoint.external_leaves).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxzero.checkpoint import integrity
from jaxzero.checkpoint.read_errors import ReadError
from jaxzero.offload import host_store, nvme_store

INDEX, FORMAT = "index.json", "jaxzero-nvme-v1"
_ITEM_CONTEXT = {"file_io_sync": True}


def file_kvstore(path: pathlib.Path) -> dict:
  """TensorStore's file kvstore at `path`, written without ".." (a workdir such
  as runs/a/../b), which TensorStore refuses as an invalid path."""
  return {"driver": "file", "path": os.path.abspath(path)}


def open_array(path: pathlib.Path, leaf: nvme_store.Leaf, context: ts.Context) -> ts.TensorStore:
  """The array [K, *S] of `leaf` at `path` (zarr, uncompressed), made by the
  first process to get there, chunked as the store is."""
  shard = leaf.sharding.shard_shape(leaf.shape)
  local = [c if d in leaf.cut else n for d, (c, n) in enumerate(zip(leaf.chunk, shard))]
  spec = {"driver": "zarr", "kvstore": file_kvstore(path),
          "metadata": {"shape": [len(leaf.kinds), *leaf.shape], "chunks": [len(leaf.kinds), *local],
                       "dtype": "<f4", "compressor": None, "fill_value": 0.0}}
  return ts.open(spec, create=True, open=True, context=context).result()


@dataclasses.dataclass
class ItemSave(ocp.args.CheckpointArgs):
  store: nvme_store.Store


@dataclasses.dataclass
class ItemRestore(ocp.args.CheckpointArgs):
  pass


class ItemHandler(ocp.CheckpointHandler):
  """A checkpoint's ``nvme`` item. Saving copies the store (synchronously: the
  next update rewrites it); restoring returns an :class:`ItemReader`."""

  def save(self, directory, args: ItemSave):  # pylint: disable=arguments-differ
    save_item(args.store, pathlib.Path(directory))

  def restore(self, directory, args=None):  # pylint: disable=arguments-differ
    del args
    return ItemReader(pathlib.Path(directory))


ocp.args.register_with_handler(ItemHandler, for_save=True)(ItemSave)
ocp.args.register_with_handler(ItemHandler, for_restore=True)(ItemRestore)


def save_item(store: nvme_store.Store, directory: pathlib.Path) -> None:
  """Copies the chunks of the shards this process owns, with their checksums."""
  store.writes.wait()
  directory.mkdir(parents=True, exist_ok=True)
  context = ts.Context(_ITEM_CONTEXT)
  targets = {leaf.name: open_array(directory / nvme_store.key(leaf.name), leaf, context)
             for leaf in store.leaves}
  sums, writes = nvme_store.Sums(), nvme_store.Writes()
  owned = [c for c in store.chunks() if c[1].owner]
  derived = store.derived and np.dtype(store.derived)
  for (leaf, region, starts), chunk in nvme_store.prefetched(owned, lambda c: store.read(*c)):
    box = leaf.chunk_box(region, starts)
    writes.add(targets[leaf.name][nvme_store.index(box)].write(chunk))
    sums.add(leaf, box, chunk)
    if derived:  # the compute copy a restore derives: cast as XLA casts (nearest even)
      sums.add(leaf, box, chunk[:1].astype(derived), [nvme_store.derived_kind(leaf.name)])
  writes.wait()
  (directory / f"checksums.process_{jax.process_index()}.json").write_text(
      json.dumps(sums.as_json()) + "\n")
  if jax.process_index() == 0:
    index = {"format": FORMAT, "leaves": {leaf.name: {"shape": list(leaf.shape),
                                                      "kinds": list(leaf.kinds)}
                                          for leaf in store.leaves}}
    if store.derived:  # params/<weight>: its master (copy 0) cast to this dtype
      index["derived"] = store.derived
    (directory / INDEX).write_text(json.dumps(index, indent=1) + "\n")


class ItemReader:
  """A saved ``nvme`` item: its leaves, checksums, and any box of them."""

  def __init__(self, directory: pathlib.Path):
    self.directory = directory
    index = json.loads((directory / INDEX).read_text())
    self.leaves = index["leaves"]
    # A run that kept no compute copy (offload.params=nvme) saved none: it is its
    # masters cast to the compute dtype, read as the master and cast by `with_leaves`.
    self.derived = index.get("derived")
    self._context = ts.Context(_ITEM_CONTEXT)
    self._arrays: dict[str, ts.TensorStore] = {}

  def shapes(self) -> dict[str, tuple[int, ...]]:
    """{TrainState leaf: shape} of every copy it holds."""
    return {kind: tuple(v["shape"]) for v in self.leaves.values() for kind in self._kinds(v)}

  def _kinds(self, leaf: dict) -> list[str]:
    """The TrainState leaves a weight's array gives: its copies, then any derived one."""
    master = leaf["kinds"][0]
    return leaf["kinds"] + ([nvme_store.derived_kind(master.split("/", 1)[1])]
                            if self.derived else [])

  def view(self, kind: str) -> ts.TensorStore | None:
    """The saved TrainState leaf `kind` (None if the item does not hold it)."""
    for name, v in self.leaves.items():
      if kind in self._kinds(v):  # a derived copy is its master's (copy 0), cast where read
        return self.array(name)[v["kinds"].index(kind) if kind in v["kinds"] else 0]
    return None

  def with_leaves(self, restored, target, kept=()):
    """`restored` (a TrainState read with None at this item's leaves) with those
    leaves read into the shardings of `target`'s, box by box; those in `kept` (a
    run keeps them itself: jaxzero.checkpoint.external_leaves.SideTarget) stay None."""
    have = {integrity.leaf_name(p): x
            for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}

    def leaf(path, t):
      name = integrity.leaf_name(path)
      if name in have or name in kept:
        return have.get(name)
      saved = self.view(name)
      return jax.make_array_from_callback(
          t.shape, t.sharding,
          lambda index: np.asarray(read_box(saved, _box_of(index, t.shape)).result(), t.dtype))

    return jax.tree_util.tree_map_with_path(leaf, target)

  def array(self, name: str) -> ts.TensorStore:
    """Weight `name`'s saved array [K, *S]."""
    if name not in self._arrays:
      spec = {"driver": "zarr", "kvstore": file_kvstore(self.directory / nvme_store.key(name))}
      self._arrays[name] = ts.open(spec, open=True, read=True, context=self._context).result()
    return self._arrays[name]

  def recorded(self) -> tuple[dict, list[str]]:
    """(checksums as jaxzero.checkpoint.integrity records them, leaves saved non-finite)."""
    sums: dict[str, int] = collections.defaultdict(int)
    nonfinite, algorithm = [], integrity.ALGORITHM
    for path in sorted(self.directory.glob("checksums.process_*.json")):
      part = json.loads(path.read_text())
      algorithm = part["algorithm"]
      nonfinite += part["nonfinite"]
      for kind, value in part["sums"].items():
        sums[kind] = (sums[kind] + value) % 2**32
    return ({"algorithm": algorithm, "checksums": {k: f"{v:08x}" for k, v in sums.items()}},
            nonfinite)


class _NvmeSideItem:
  """The ``nvme`` item as the checkpointer sees it (jaxzero.checkpoint.external_leaves.SideItem)."""
  name, index_file = "nvme", INDEX

  def handler(self) -> ocp.CheckpointHandler:
    return ItemHandler()

  def open(self, directory: pathlib.Path) -> ItemReader:
    return ItemReader(directory)

  def split(self, state) -> tuple[Any, ItemSave | None]:
    store = getattr(state, "store", None)  # jaxzero.runners.nvme.NvmeState
    if not isinstance(store, (nvme_store.Store, host_store.HostStore)):
      return state, None
    # Copied during the save (the next update rewrites the store).
    return state.in_memory(), ItemSave(store)


SIDE_ITEM = _NvmeSideItem()


class _Read:
  """A read started now, whose failure (to start or to finish) is a ReadError."""

  def __init__(self, start: Callable):
    try:
      self._future, self._error = start(), None
    except Exception as e:  # pylint: disable=broad-except
      self._future, self._error = None, e

  def result(self):
    try:
      if self._error is not None:
        raise self._error
      return self._future.result()
    except Exception as e:  # pylint: disable=broad-except
      raise ReadError(str(e)) from e


def fill(store: nvme_store.Store, recorded: dict, item: ItemReader | None,
         open_saved: Callable[[str], ts.TensorStore]) -> tuple[list[str], list[str]]:
  """nvme_store.Writes a checkpoint's copies of the weights into `store`: from its nvme
  item, else (an in-memory run's) from its saved arrays, which `open_saved`
  opens by TrainState leaf name. Returns the leaves whose checksums differ
  from `recorded` (as jaxzero.integrity records them), and those not finite.

  Raises:
    ReadError: a saved array could not be read.
  """
  sums = fill_from_item(store, item) if item else fill_from_arrays(store, open_saved)
  kinds = sorted(kind for leaf in store.leaves for kind in leaf.kinds)
  checksums, nonfinite = sums.global_totals(kinds)
  differ = ([k for k in kinds if recorded.get("checksums", {}).get(k) != checksums[k]]
            if recorded.get("algorithm") == integrity.ALGORITHM else [])
  return differ, nonfinite


def fill_from_item(store: nvme_store.Store, reader: ItemReader) -> nvme_store.Sums:
  """nvme_store.Writes the saved item's chunks into the store (any mesh and stage saved it)."""
  sums = nvme_store.Sums()

  def read(chunk):
    leaf, region, starts = chunk
    box = nvme_store.index(leaf.chunk_box(region, starts))
    return _Read(lambda: read_box(reader.array(leaf.name), box))

  for (leaf, region, starts), data in nvme_store.prefetched(list(store.chunks()), read):
    store.write(leaf, region, starts, data)
    if region.owner:
      sums.add(leaf, leaf.chunk_box(region, starts), data)
  store.writes.wait()
  return sums


def fill_from_arrays(store: nvme_store.Store,
                     open_kind: Callable[[str], ts.TensorStore]) -> nvme_store.Sums:
  """nvme_store.Writes into the store the arrays of an in-memory run's checkpoint, read
  one shard of one weight (all K copies) at a time; `open_kind` opens a
  TrainState leaf's saved array."""
  sums = nvme_store.Sums()
  for leaf in store.leaves:
    arrays = [_Read(lambda kind=kind: _Done(open_kind(kind))).result() for kind in leaf.kinds]
    for region in leaf.regions:
      index = tuple(slice(a, b) for a, b in region.box)
      reads = [_Read(lambda a=a: read_box(a, index)) for a in arrays]
      data = np.stack([r.result() for r in reads]).astype(np.float32)
      if region.owner:
        sums.add(leaf, region.box, data)
      for starts in leaf.starts():
        box = leaf.chunk_box(region, starts)
        local = tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region.box))
        store.write(leaf, region, starts, np.ascontiguousarray(data[(slice(None), *local)]))
      del data
  store.writes.wait()
  return sums


def read_box(array: ts.TensorStore, box: tuple[slice, ...]):
  """A read of `box` (slices with start and stop) of a saved array, as a future. Where the
  box reaches past the array (a leaf saved with less padding, jaxzero.parallel.padding),
  the part inside is read and the rest is zeros; padding saved past the box is not read."""
  shape = tuple(array.shape)
  box = tuple(slice(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(box, shape))
  if all(s.stop <= n for s, n in zip(box, shape)):
    return array[box].read()
  inside = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(box, shape))
  part = np.asarray(array[inside].read().result())
  return _Done(np.pad(part, [(0, (s.stop - s.start) - p) for s, p in zip(box, part.shape)]))


def _box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


class _Done:
  def __init__(self, value):
    self._value = value

  def result(self):
    return self._value
