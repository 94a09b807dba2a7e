"""Reading a checkpoint's leaves to the host, one leaf (or one layer of a stacked leaf) at a
time, for export. Nothing here writes or deletes anything.
"""

from __future__ import annotations

import logging
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxzero.checkpoint import read_errors
from jaxzero.checkpoint.directory import STATE, TRUE_SHAPES, CheckpointDirectory, saved_array
from jaxzero.checkpoint.external_leaves import SideItem
from jaxzero.errors import CheckpointError

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
    true_shapes = self.info(step).get(TRUE_SHAPES, {})
    return {name: tuple(true_shapes.get(name, shape))
            for name, shape in super().leaf_shapes(step).items()}

  def read(self, step: int, path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """One saved leaf as a host array of `shape` (only that leaf is read; a leaf
    stored padded, jaxzero.parallel.padding, comes without its padding)."""
    saved = self._side_view(step, path)
    if saved is not None:
      return np.asarray(saved.read().result(), dtype=np.float32)
    item = _nested(path, jax.ShapeDtypeStruct(shape, np.float32))
    restore_args = _nested(path, ocp.RestoreArgs(restore_type=np.ndarray))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True)))[STATE]
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(read_errors.read_error(self.step_dir(step), e,
                                                   f"leaf {'/'.join(path)}")) from e
    for key in path:
      restored = restored[key]
    return np.asarray(restored)[tuple(slice(0, d) for d in shape)]

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
    return _LayerReader(store, tuple(shape))

  def _side_view(self, step: int, path: Path):
    """The leaf at `path` if checkpoint `step` keeps it in its side item, else None."""
    item = self.side_saved(step)
    return None if item is None else item.view("/".join(path))


class _LayerReader:
  """A saved array whose `[i]` reads layer i only, as float32 numpy."""

  def __init__(self, store, shape: tuple[int, ...]):
    self._store = store
    self.shape = shape  # the leaf's true shape: a padded leaf's padding is not read

  def __getitem__(self, layer: int) -> np.ndarray:
    inside = tuple(slice(0, n) for n in self.shape[1:])
    return np.asarray(self._store[(layer, *inside)].read().result(), dtype=np.float32)


def _nested(path: Path, leaf) -> dict:
  for key in reversed(path):
    leaf = {key: leaf}
  return leaf
