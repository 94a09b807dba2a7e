"""Damage to a saved checkpoint's data that a restore cannot miss.

An OCDBT data file can hold bytes that no read of the saved values needs (seen
on a busy machine: the largest file cut in half, and every value still read
back, as B-tree nodes that later writes of the same save superseded would be),
so damage to one chosen file can leave the checkpoint good: a test expecting a
damaged one then fails. `damage_data` damages the state's data files, largest
first, until a plain orbax read no longer returns the saved values.
"""

import pathlib
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp


def data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  """The state's data files, largest first."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def _saved_values(step_dir: pathlib.Path) -> list[bytes] | None:
  """Every leaf's bytes as orbax reads them (no verification), or None where it cannot."""
  try:
    with ocp.StandardCheckpointer() as reader:
      return [np.asarray(x).tobytes() for x in jax.tree.leaves(reader.restore(step_dir / "state"))]
  except Exception:  # pylint: disable=broad-except  # any read error is damage that shows
    return None


def damage_data(step_dir: pathlib.Path, damage_file: Callable[[pathlib.Path], None],
                at_least: int = 1) -> list[pathlib.Path]:
  """Applies `damage_file` to the state's data files, largest first (at least
  `at_least` of them), until what the checkpoint reads back is no longer what
  was saved; returns those files."""
  saved = _saved_values(step_dir)
  assert saved is not None, f"{step_dir} cannot be read before it is damaged"
  damaged = []
  for path in data_files(step_dir):
    damage_file(path)
    damaged.append(path)
    if len(damaged) >= at_least and _saved_values(step_dir) != saved:
      return damaged
  raise AssertionError(f"no damage to the data files of {step_dir} changed what it reads")


def truncate_to(fraction: float) -> Callable[[pathlib.Path], None]:
  """A damage: the file cut to `fraction` of its bytes."""
  def damage(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])
  return damage


def garbage_at_several_offsets(path: pathlib.Path) -> None:
  """A damage: 4 KiB of random bytes at 30% and 70% of the file."""
  data = bytearray(path.read_bytes())
  rng = np.random.default_rng(len(data))
  for fraction in (0.3, 0.7):
    at = int(len(data) * fraction)
    data[at:at + 4096] = rng.bytes(len(data[at:at + 4096]))
  path.write_bytes(bytes(data))
