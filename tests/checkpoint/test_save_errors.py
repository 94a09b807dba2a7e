"""A checkpoint save that fails (a full disk, a lost mount) is one line naming why and the
last complete checkpoint; its unfinished files go, freeing what they hold."""

import jax.numpy as jnp
import pytest

from jaxzero.checkpoint.checkpointer import Checkpointer
from jaxzero.errors import CheckpointError

# What tensorstore reports, through orbax, when the disk fills during a background save.
FULL_DISK = ('RESOURCE_EXHAUSTED: Error writing "master.w/0.0" in OCDBT database at local '
             'file "/w/checkpoints/2.orbax-checkpoint-tmp/state": Failed writing: "/w/d/49": '
             "Failed to write 231477 bytes to file 9: No space left on device "
             "[os_error_code='28']")


@pytest.mark.parametrize("surfaces_in", ["check_for_errors", "wait_until_finished", "save"])
def test_a_failed_save_is_one_line_and_its_files_go(surfaces_in, tmp_path, monkeypatch):
  (tmp_path / "checkpoints").mkdir()
  checkpoints = Checkpointer(tmp_path, None, {"model": {}, "seed": 0})
  checkpoints.save(1, {"w": jnp.ones((8,))}, wait=True)
  unfinished = checkpoints.directory / "2.orbax-checkpoint-tmp"
  unfinished.mkdir()

  def failed(*args, **kwargs):
    raise ValueError(FULL_DISK)
  monkeypatch.setattr(checkpoints._manager, surfaces_in, failed)  # pylint: disable=protected-access
  use = {"check_for_errors": checkpoints.check_saves, "wait_until_finished": checkpoints.wait,
         "save": lambda: checkpoints.save(3, {"w": jnp.ones((8,))})}[surfaces_in]
  with pytest.raises(CheckpointError) as error:
    use()
  assert str(error.value) == (
      f"a checkpoint could not be written in {checkpoints.directory}: no space left on "
      "device; the last complete checkpoint is step 1, which a new run resumes")
  assert not unfinished.exists() and (checkpoints.directory / "1").is_dir()
  monkeypatch.undo()
  checkpoints.close()
