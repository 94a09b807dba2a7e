"""A workdir's checkpoints as orbax lays them out: the steps, their records and shapes.

A step directory ``WORKDIR/checkpoints/<step>`` holds the items ``state``, ``info`` and
``checksums``, and for a run that keeps leaves outside memory a side item (:class:`SideItem`;
``state`` then holds None at those leaves). A step directory that exists is complete (orbax
renames it into place once every file is written). :class:`CheckpointDirectory` lists and
describes the steps for the training loop's Checkpointer and export's CheckpointReader.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxzero.checkpoint import integrity, read_errors
from jaxzero.checkpoint.external_leaves import SavedSide, SideItem
from jaxzero.errors import CheckpointError, DamagedCheckpointError

STATE, INFO, CHECKSUMS = "state", "info", "checksums"
# The info key of a checkpoint's padded leaves: {leaf name: true shape}.
TRUE_SHAPES = "true_shapes"
# The info key that says the checkpoint was saved with its checksums (CHECKSUMS/).
HAS_CHECKSUMS = "has_checksums"

log = logging.getLogger(__name__)


def checkpoint_dir(workdir: str | pathlib.Path) -> pathlib.Path:
  # Absolute: orbax refuses relative paths (e.g. the default runs/<config>).
  return pathlib.Path(workdir).absolute() / "checkpoints"


def damaged_dir(workdir: str | pathlib.Path) -> pathlib.Path:
  """Where checkpoints that failed verification are moved, kept for inspection."""
  return pathlib.Path(workdir).absolute() / "checkpoints.damaged"


class CheckpointDirectory:
  """Listing and metadata, shared by the training loop's Checkpointer and export's reader."""

  def __init__(self, workdir, state_handler, side: SideItem | None = None, **options):
    read_errors.quiet_abandoned_reads()
    self.directory = checkpoint_dir(workdir)
    self._side = side
    handlers = {STATE: state_handler, INFO: ocp.JsonCheckpointHandler(),
                CHECKSUMS: ocp.JsonCheckpointHandler()}
    if side is not None:
      handlers[side.name] = side.handler()
    self._manager = ocp.CheckpointManager(
        self.directory, item_names=tuple(handlers), item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(create=False, **options))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint (unfinished saves are never listed)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every complete checkpoint's step, oldest first."""
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> pathlib.Path:
    return self.directory / str(step)

  def info(self, step: int) -> dict[str, Any]:
    try:
      return self._manager.restore(step, args=ocp.args.Composite(info=ocp.args.JsonRestore()))[INFO]
    except Exception as e:  # pylint: disable=broad-except
      raise read_errors.read_failure(self.step_dir(step), e, f"its run record ({INFO}/)") from e

  def leaf_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
    """{leaf name: shape} of the saved state, from its metadata (reads no arrays)."""
    metadata = f"its state metadata ({STATE}/_METADATA)"
    try:
      tree = self._manager.item_metadata(step)[STATE]
    except Exception as e:  # pylint: disable=broad-except
      raise read_errors.read_failure(self.step_dir(step), e, metadata) from e
    if tree is None:
      raise DamagedCheckpointError(
          f"checkpoint {self.step_dir(step)} is damaged: {metadata} is missing")
    item = self.side_saved(step)
    return {**tree_leaf_shapes(tree), **(item.shapes() if item else {})}

  def recorded_checksums(self, step: int, item: SavedSide | None = None,
                         unchecked: str = "only checked to be finite") -> dict:
    """The checksums saved with checkpoint `step` (with its side item's, `item`). A
    checkpoint from before checksums were saved has none: a warning says what its values
    are then (`unchecked`: a restore checks them to be finite)."""
    where = self.step_dir(step)
    recorded = {}
    if (where / CHECKSUMS).exists():
      try:
        recorded = self._manager.restore(
            step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore()))[CHECKSUMS]
      except Exception as e:  # pylint: disable=broad-except
        raise read_errors.read_failure(where, e, f"its checksums ({CHECKSUMS}/)") from e
    elif self.info(step).get(HAS_CHECKSUMS):  # saved with them: lost since
      raise DamagedCheckpointError(f"checkpoint {where} is damaged: its checksums "
                                   f"({CHECKSUMS}/) are missing")
    else:
      log.warning("checkpoint %s has no checksums (saved by an older jaxzero): its values are "
                  "%s", where, unchecked)
    if item:
      saved, _ = item.recorded()
      recorded = {**recorded, "checksums": {**recorded.get("checksums", {}),
                                            **saved["checksums"]}}
    return recorded

  def side_saved(self, step: int) -> SavedSide | None:
    """Checkpoint `step`'s side item, if it has one (and this reader knows its kind)."""
    if self._side is None:
      return None
    where = self.step_dir(step) / self._side.name
    if not where.exists():
      return None
    try:
      return self._side.open(where)
    except Exception as e:  # pylint: disable=broad-except
      raise read_errors.read_failure(self.step_dir(step), e, f"its {self._side.name} index "
                                f"({self._side.name}/{self._side.index_file})") from e

  def close(self) -> None:
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def tree_leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{"master/layers/w_up_LxDxF": shape, ...}: names that match however the
  tree is nested (a saved TrainState comes back as dicts and lists)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {integrity.leaf_name(path): tuple(leaf.shape) for path, leaf in leaves}


def saved_array(state_dir: pathlib.Path, name: str):
  """A leaf of orbax's saved state (zarr in an OCDBT database, orbax's default),
  opened for reading boxes of it."""
  # os.path.abspath: TensorStore refuses ".." in a path (a workdir such as runs/a/../b).
  spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt",
                                        "base": f"file://{os.path.abspath(state_dir)}",
                                        "path": name.replace("/", ".")}}
  return ts.open(spec, open=True, read=True).result()


def check_fits(saved: dict, wanted: dict, where: pathlib.Path, against: str,
               hint: str = "") -> None:
  """Raises CheckpointError naming the first leaf that differs between two
  {leaf name: shape} dicts: `saved` in checkpoint `where`, `wanted` by `against`."""
  unfit = f"checkpoint {where} does not fit {against}"
  settings_hint = hint or " (were optimizer settings changed?)"
  for name, shape in wanted.items():
    if name not in saved:
      raise CheckpointError(f"{unfit}: it has no leaf {name}{settings_hint}")
    if saved[name] != shape:
      raise CheckpointError(f"{unfit}: leaf {name} has shape {saved[name]} in the checkpoint "
                            f"but {shape} in {against}{hint}")
  extra = sorted(saved.keys() - wanted.keys())
  if extra:
    raise CheckpointError(f"{unfit}: it has a leaf {extra[0]} that {against} lacks{settings_hint}")
