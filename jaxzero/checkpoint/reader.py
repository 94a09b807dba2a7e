"""Reading a checkpoint's leaves to the host, one leaf (or one layer of a stacked leaf) at a
time, for export. Every leaf read whole, and every stacked leaf once all its layers are
read, is checked against the checksum saved with it, as a restore checks the state.
Nothing here writes or deletes anything.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxzero.checkpoint import integrity, read_errors
from jaxzero.checkpoint.directory import STATE, TRUE_SHAPES, CheckpointDirectory, saved_array
from jaxzero.checkpoint.external_leaves import SideItem
from jaxzero.errors import CheckpointError, DamagedCheckpointError

log = logging.getLogger(__name__)

Path = tuple[str, ...]


def latest_step(workdir: str | pathlib.Path) -> int | None:
  """The newest complete checkpoint in `workdir`, or None; reads and writes nothing."""
  with CheckpointReader(workdir) as reader:
    return reader.latest_step()


class CheckpointReader(CheckpointDirectory):
  """Reads leaves one at a time, to the host (for export). It has no way to save,
  so it never writes or deletes anything (orbax's read_only mode would do the
  same, with a warning on every use)."""

  def __init__(self, workdir: str | pathlib.Path, side: SideItem | None = None):
    super().__init__(workdir, ocp.PyTreeCheckpointHandler(), side, save_root_metadata=False,
                     enable_async_checkpointing=False)
    self._records: dict[int, _StepRecord] = {}

  def resolve_step(self, step: int | None) -> int:
    """`step`, or the latest; raises CheckpointError when there is none."""
    steps = sorted(self._manager.all_steps())
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}: --workdir must be a "
                            "jaxzero.train workdir that has saved at least once")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; "
                            f"available steps: {', '.join(map(str, steps))}")
    return step

  def leaf_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """{leaf name: shape} as the model has them: a leaf stored padded
    (jaxzero.parallel.padding) has its true shape, the one its reads return."""
    record = self._record(step)
    return {name: tuple(record.true_shapes.get(name, shape))
            for name, shape in record.shapes.items()}

  def read(self, step: int, path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """One saved leaf as a float32 host array of `shape` (only that leaf is read; a leaf
    stored padded, jaxzero.parallel.padding, comes without its padding), checked
    against the checksum saved with it."""
    name = "/".join(path)
    self._record(step)  # (its own errors say what failed: the metadata or the checksums)
    saved = self._side_view(step, path)
    try:
      leaf = np.asarray(saved.read().result()) if saved is not None else \
          self._restore_leaf(step, path)
    except Exception as e:  # pylint: disable=broad-except
      raise read_errors.read_failure(self.step_dir(step), e, f"leaf {name}") from e
    checked = self._checked_shape(step, name, leaf.shape)
    self._verify(step, name, [integrity.host_checksum(leaf[_box(checked)])])
    return leaf[_box(shape)].astype(np.float32, copy=False)

  def _restore_leaf(self, step: int, path: Path) -> np.ndarray:
    """The leaf at `path` as saved: its dtype, its stored shape (padding included)."""
    name = "/".join(path)
    record = self._record(step)
    item = _nested(path, jax.ShapeDtypeStruct(record.shapes[name], record.dtypes[name]))
    restore_args = _nested(path, ocp.RestoreArgs(restore_type=np.ndarray))
    restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True)))[STATE]
    for key in path:
      restored = restored[key]
    return np.asarray(restored)

  def _checked_shape(self, step: int, name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The part of a stored leaf its checksum covers: its true shape where the checkpoint
    records one (a leaf stored padded), else all of it."""
    return tuple(self._record(step).true_shapes.get(name, stored))

  def _verify(self, step: int, name: str, parts: list[int]) -> None:
    """Raises DamagedCheckpointError when the sum of a leaf's checksum `parts` is not the
    checksum saved with it (a checkpoint without one is not checked)."""
    expected = integrity.recorded_checksum(self._record(step).checksums, name)
    if expected is not None and sum(parts) % 2**32 != expected:
      raise DamagedCheckpointError(f"checkpoint {self.step_dir(step)} is damaged: the values "
                                   f"of leaf {name} do not match the checksum saved with them")

  def _record(self, step: int) -> _StepRecord:
    """What checkpoint `step` says of its leaves, read once."""
    if step not in self._records:
      shapes = super().leaf_shapes(step)
      try:
        leaves, _ = jax.tree_util.tree_flatten_with_path(self._manager.item_metadata(step)[STATE])
      except Exception as e:  # pylint: disable=broad-except
        raise read_errors.read_failure(self.step_dir(step), e,
                                       f"its state metadata ({STATE}/_METADATA)") from e
      self._records[step] = _StepRecord(
          shapes=shapes,
          dtypes={integrity.leaf_name(p): np.dtype(leaf.dtype) for p, leaf in leaves
                  if hasattr(leaf, "dtype")},
          true_shapes=self.info(step).get(TRUE_SHAPES, {}),
          checksums=self.recorded_checksums(step, self.side_saved(step),
                                            unchecked="not checked"))
    return self._records[step]

  def read_by_layer(self, step: int, path: Path, shape: tuple[int, ...]):
    """A saved stacked leaf of true `shape` that reads one layer (its first index) when
    indexed, without any padding it is stored with.

    orbax restores whole leaves only, and a stacked leaf holds every layer of a
    weight (75 GB in fp32 for a 70B MLP weight); tensorstore reads a slice of
    orbax's own files. If the files are not in the layout expected (zarr in an
    OCDBT database, orbax's default), the whole leaf is read instead.
    """
    store = self._side_view(step, path)
    try:
      if store is None:
        store = saved_array(self.step_dir(step) / STATE, "/".join(path))
    except Exception as e:  # pylint: disable=broad-except
      log.warning("reading %s whole: its layers cannot be read one by one (%s)",
                  "/".join(path), read_errors.reason(e))
      return self.read(step, path, shape)
    stored = tuple(store.shape)
    # Stored padded (jaxzero.parallel.padding): larger, never smaller, and never in layers.
    if (len(stored) != len(shape) or stored[0] != shape[0]
        or any(s < t for s, t in zip(stored, shape))):
      raise CheckpointError(f"checkpoint {self.step_dir(step)}: leaf {'/'.join(path)} has shape "
                            f"{stored}, expected {tuple(shape)}")
    name = "/".join(path)
    checked = self._checked_shape(step, name, stored)
    return _LayerReader(store, tuple(shape), checked,
                        lambda parts: self._verify(step, name, parts),
                        lambda e: read_errors.read_error(self.step_dir(step), e, f"leaf {name}"))

  def _side_view(self, step: int, path: Path):
    """The leaf at `path` if checkpoint `step` keeps it in its side item, else None."""
    item = self.side_saved(step)
    return None if item is None else item.view("/".join(path))


@dataclasses.dataclass(frozen=True)
class _StepRecord:
  shapes: dict[str, tuple[int, ...]]  # as stored (padding included)
  dtypes: dict[str, np.dtype]  # as saved
  true_shapes: dict[str, list[int]]  # of the leaves stored padded
  checksums: dict  # integrity.record's


class _LayerReader:
  """A saved array whose `[i]` reads layer i only, as float32 numpy. Once every layer
  has been read, the leaf is checked against the checksum saved with it."""

  def __init__(self, store, shape: tuple[int, ...], checked: tuple[int, ...], verify,
               read_error):
    self._store = store
    self.shape = shape  # the leaf's true shape: a padded leaf's padding is not read
    self._checked = checked  # the part of the stored leaf its checksum covers
    self._verify = verify
    self._read_error = read_error
    self._parts: dict[int, int] = {}  # layer: its part of the leaf's checksum

  def __getitem__(self, layer: int) -> np.ndarray:
    try:
      values = np.asarray(self._store[(layer, *_box(self._checked[1:]))].read().result())
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(self._read_error(e)) from e
    self._parts[layer] = integrity.host_checksum(values, layer * values.size)
    if len(self._parts) == self._checked[0]:
      self._verify(list(self._parts.values()))
    return values[_box(self.shape[1:])].astype(np.float32, copy=False)


def _box(shape: tuple[int, ...]) -> tuple[slice, ...]:
  """The index of an array's first `shape` elements along each dimension."""
  return tuple(slice(0, n) for n in shape)


def _nested(path: Path, leaf) -> dict:
  for key in reversed(path):
    leaf = {key: leaf}
  return leaf
