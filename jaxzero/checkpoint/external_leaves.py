"""How a checkpoint holds leaves that a run keeps outside memory: a *side item*.

The checkpointer knows such leaves only through these protocols. The NVMe
tier implements them (jaxzero.offload.nvme_checkpoint): its leaves are saved
by copying its files into the checkpoint's ``nvme`` item, and restored into
its store or, for an in-memory run, into the state's shardings.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Protocol

import orbax.checkpoint as ocp


class SavedSide(Protocol):
  """A side item as saved in one checkpoint."""

  def shapes(self) -> dict[str, tuple[int, ...]]:
    """{TrainState leaf name: shape} of the leaves it holds."""

  def view(self, name: str):
    """Leaf `name` as a TensorStore-like array to read boxes of, or None."""

  def with_leaves(self, restored, target, kept=()):
    """`restored` (None at this item's leaves) with them read into `target`'s shardings,
    but for those in `kept` (left None)."""

  def recorded(self) -> tuple[dict, list[str]]:
    """(its checksums as jaxzero.checkpoint.integrity records them, leaves saved non-finite)."""


class SideItem(Protocol):
  """Leaves of a train state that a checkpoint keeps in an item of their own."""
  name: str  # the item's directory in a step directory
  index_file: str  # the file that must be readable for the item to open

  def handler(self) -> ocp.CheckpointHandler:
    """The orbax handler that saves the item."""

  def open(self, directory: pathlib.Path) -> SavedSide:
    """The item saved in `directory`."""

  def split(self, state) -> tuple[Any, Any]:
    """(what of `state` memory holds, with None at the item's leaves; the save
    args of the item), or (state, None) for a state that keeps no such leaves."""


class SideTarget(Protocol):
  """A run that keeps a side item's leaves itself (e.g. the NVMe tier)."""
  names: frozenset[str] | set[str]  # the TrainState leaves it keeps

  def fill(self, recorded: dict, saved: SavedSide | None,
           open_saved: Callable[[str], Any]) -> tuple[list[str], list[str]]:
    """Takes its leaves from `saved`, else from the checkpoint's `state` arrays
    (opened by leaf name); returns (leaves whose checksums differ from
    `recorded`, leaves not finite). Raises read_errors.ReadError."""

  def state(self, restored):
    """The run's state from `restored` (None at its leaves)."""
