"""Damaged checkpoints are never trained on: checksums, fallback, refusal.

One run saves checkpoints 2, 4 and 6; each test damages a copy of its newest
checkpoint in another way and resumes it.
"""

import dataclasses
import errno
import hashlib
import logging
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero.checkpoint import checkpointer, integrity, read_errors
from jaxzero.checkpoint.directory import checkpoint_dir, damaged_dir
from jaxzero.errors import CheckpointError, DamagedCheckpointError
from jaxzero.training import loop

from damage import damage_data, garbage_at_several_offsets, truncate_to
from tiny import tiny_config

DEVICES = 8


def make_config(on_damaged="fallback", steps=6):
  cfg = tiny_config(3, "stop")
  return dataclasses.replace(
      cfg, train=dataclasses.replace(cfg.train, steps=steps),
      checkpoint=config.CheckpointConfig(every=2, keep=10, on_damaged=on_damaged))


def snapshot(directory):
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run to step 6 (checkpoints 2, 4, 6) and its logged losses."""
  workdir = tmp_path_factory.mktemp("run")
  history = loop.train(make_config(), workdir, devices=jax.devices()[:DEVICES],
                          progress=False)
  return workdir, {r["step"]: r["loss"] for r in history}


@pytest.fixture
def copy_of(trained, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(trained[0], workdir)
  return workdir


def delete(data_file):
  data_file.unlink()


@pytest.mark.parametrize("damage", [
    pytest.param(garbage_at_several_offsets, marks=pytest.mark.slow),
    pytest.param(truncate_to(0.5), marks=pytest.mark.slow), delete],
    ids=["garbage", "truncate", "delete"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_good_one(damage, trained, copy_of,
                                                                       caplog):
  workdir, losses = copy_of, trained[1]
  directory = checkpoint_dir(workdir)
  earlier = {step: snapshot(directory / step) for step in ("2", "4")}
  damage_data(directory / "6", damage, at_least=2 if damage is garbage_at_several_offsets else 1)
  with caplog.at_level(logging.WARNING):
    outcome = loop.run_training(make_config(), workdir, steps=6,
                                   devices=jax.devices()[:DEVICES], progress=False)
  assert outcome.start_step == 4
  # Steps 5 and 6 trained again from the good state: the same losses to the bit.
  assert {r["step"]: r["loss"] for r in outcome.history} == {5: losses[5], 6: losses[6]}
  assert f"checkpoint {directory / '6'} is damaged: " in caplog.text
  assert "resuming from checkpoint 4, the newest that verifies" in caplog.text
  assert {step: snapshot(directory / step) for step in ("2", "4")} == earlier
  assert (damaged_dir(workdir) / "6").is_dir()  # kept, not deleted
  assert (directory / "6").is_dir()  # saved anew


def test_when_no_checkpoint_verifies_none_is_moved(copy_of):
  """Every checkpoint unreadable (damage, or a file system failing every read): the run
  stops, and the checkpoints stay where they were for the next attempt."""
  directory = checkpoint_dir(copy_of)
  for step in ("2", "4", "6"):
    damage_data(directory / step, delete)
  before = snapshot(copy_of)
  with pytest.raises(DamagedCheckpointError) as error:
    loop.run_training(make_config(), copy_of, devices=jax.devices()[:DEVICES], progress=False)
  assert str(error.value).startswith(f"checkpoint {directory / '2'} is damaged: ")
  assert "no checkpoint verifies (none was moved)" in str(error.value)
  assert snapshot(copy_of) == before and not damaged_dir(copy_of).exists()


@pytest.mark.parametrize("failure, reason", [
    (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                "1.00GiB."), "RESOURCE_EXHAUSTED: Out of memory"),
    (ValueError('PERMISSION_DENIED: Error opening file "x/d/0": [OS error: Permission denied]'),
     "PERMISSION_DENIED"),
    (OSError(errno.EMFILE, "Too many open files"), "Too many open files")],
    ids=["device_memory", "permission", "file_handles"])
def test_a_read_that_fails_for_want_of_memory_or_a_right_stops_and_moves_nothing(
    copy_of, monkeypatch, failure, reason):
  """Not damage: falling back would redo steps and set a good checkpoint aside. The run
  stops in one line naming the checkpoint and why, with every checkpoint in place."""
  def fail(self, step, *args, **kwargs):
    raise ValueError("reading the state failed") from failure
  monkeypatch.setattr(checkpointer.Checkpointer, "_restore_fields", fail)
  before = snapshot(copy_of)
  with pytest.raises(CheckpointError) as error:
    loop.run_training(make_config(), copy_of, devices=jax.devices()[:DEVICES], progress=False)
  message = str(error.value)
  assert not isinstance(error.value, DamagedCheckpointError), message
  assert message.startswith(f"checkpoint {checkpoint_dir(copy_of) / '6'}: ") and reason in message
  assert "not damage: no checkpoint was skipped or moved" in message and "\n" not in message
  assert snapshot(copy_of) == before and not damaged_dir(copy_of).exists()


@pytest.mark.parametrize("error, damaged", [
    (ValueError('DATA_LOSS: Error reading "master.w/0" in /runs/UNAVAILABLE_again/: bad crc'),
     True),  # a status word in a path is not the status
    (ValueError("FAILED_PRECONDITION: ZSTD_decompressStream() failed: Data corruption"), True),
    (OSError(errno.EIO, "Input/output error"), True),
    (ValueError("ABORTED: Error opening file: [OS error: Stale file handle]"), False),
    (OSError(errno.ESTALE, "Stale file handle"), False),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), False),
    (MemoryError(), False)])
def test_a_read_error_is_damage_unless_it_names_a_resource_a_right_or_a_moment(error, damaged):
  try:
    raise ValueError("restore failed") from error
  except ValueError as chained:
    failure = read_errors.read_failure(pathlib.Path("/runs/r/checkpoints/6"), chained)
  assert isinstance(failure, DamagedCheckpointError) == damaged, str(failure)


def test_resuming_under_another_rope_theta_says_so_and_a_kernel_choice_does_not(copy_of, caplog):
  """The weights fit, so the run goes on (a longer context's rope_theta is a fine-tune users
  make), but never unawares; the attention kernel is not the model and passes silently."""
  cfg = make_config()
  for model, warned in [(dict(rope_theta=500_000.0), True), (dict(attention="xla"), False)]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      outcome = loop.run_training(
          dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model)), copy_of,
          devices=jax.devices()[:DEVICES], progress=False)
    assert outcome.start_step == 6
    assert (f"checkpoint {checkpoint_dir(copy_of) / '6'} was trained with another model "
            "(model.rope_theta=10000.0 in the checkpoint, 500000.0 here): its weights fit, and "
            "compute with this config's settings from here on" in caplog.text) == warned
    assert ("trained with another model" in caplog.text) == warned


def test_a_step_set_aside_again_takes_the_first_free_name(tmp_path):
  """checkpoints.damaged keeps every copy of a step damaged twice or more, under a name
  that is free even after some were deleted (the count of copies was taken before)."""
  state = {"w": jnp.ones(4)}
  damaged = damaged_dir(tmp_path)
  with checkpointer.Checkpointer(tmp_path, 3, {}) as checkpoints:
    for existing in ("5", "5.2"):
      (damaged / existing).mkdir(parents=True)
    checkpoints.save(5, state, wait=True)
    assert checkpoints.set_aside(5) == damaged / "5.1"
    checkpoints.save(5, state, wait=True)
    assert checkpoints.set_aside(5) == damaged / "5.3"
  assert sorted(p.name for p in damaged.iterdir()) == ["5", "5.1", "5.2", "5.3"]
  assert (damaged / "5.3" / "state").is_dir()


def test_refuse_names_the_damage_and_changes_nothing(copy_of):
  directory = checkpoint_dir(copy_of)
  damage_data(directory / "6", garbage_at_several_offsets, at_least=2)
  before = snapshot(copy_of)
  with pytest.raises(DamagedCheckpointError) as error:
    loop.run_training(make_config(on_damaged="refuse"), copy_of,
                         devices=jax.devices()[:DEVICES], progress=False)
  message = str(error.value)
  assert message.startswith(f"checkpoint {directory / '6'} is damaged: ")
  assert "(checkpoint.on_damaged=refuse; --resume-step 4 resumes from the one before it)" in message
  assert "\n" not in message
  assert snapshot(copy_of) == before


def test_a_checkpoint_saved_with_checksums_that_lost_them_is_damaged(copy_of):
  """Its run record says it was saved with them: not an older jaxzero's checkpoint, whose
  values are only checked to be finite (that turned verification off unsaid)."""
  directory = checkpoint_dir(copy_of)
  shutil.rmtree(directory / "6" / "checksums")
  with pytest.raises(DamagedCheckpointError) as error:
    loop.run_training(make_config(on_damaged="refuse"), copy_of,
                      devices=jax.devices()[:DEVICES], progress=False)
  assert str(error.value).startswith(
      f"checkpoint {directory / '6'} is damaged: its checksums (checksums/) are missing")


def test_values_that_differ_from_their_checksum_are_caught(copy_of, monkeypatch):
  """Damage that still decodes (here: one weight changed after its checksum was
  taken) is caught by the checksum alone."""
  record = integrity.record

  def record_then_change(state, true_shapes=None):
    saved = record(state, true_shapes)
    state.master["final_norm"] += 1.0  # in place of bytes changed on disk
    return saved
  workdir = copy_of
  shutil.rmtree(checkpoint_dir(workdir) / "6")
  cfg = make_config()
  monkeypatch.setattr(integrity, "record", record_then_change)
  loop.run_training(cfg, workdir, steps=6, devices=jax.devices()[:DEVICES], progress=False)
  monkeypatch.undo()
  with pytest.raises(DamagedCheckpointError, match=r"the values of leaf master/final_norm do "
                     "not match the checksum saved with them"):
    loop.run_training(make_config(on_damaged="refuse"), workdir,
                         devices=jax.devices()[:DEVICES], progress=False)


def test_a_restored_state_must_be_finite(copy_of):
  directory = checkpoint_dir(copy_of)
  cfg = make_config(on_damaged="refuse")
  run = loop.build(cfg, jax.devices()[:DEVICES])
  info = checkpointer.run_info(cfg.model, cfg.precision.compute, cfg.seed)
  with checkpointer.Checkpointer(copy_of, 10, info) as checkpoints:
    state = checkpoints.restore(6, run.program.abstract_state())
    poisoned = state._replace(step=state.step + 1, master=dict(
        state.master, final_norm=state.master["final_norm"].at[0].set(jnp.nan)))
    checkpoints.save(7, poisoned, wait=True)  # its checksums match: only finiteness fails
  with pytest.raises(DamagedCheckpointError, match=r"the values of leaf master/final_norm are "
                     "not finite"):
    loop.run_training(cfg, copy_of, devices=jax.devices()[:DEVICES], progress=False)
  assert (directory / "7").is_dir()


def test_checksums_do_not_depend_on_the_sharding():
  mesh = jax.make_mesh((DEVICES,), ("d",))
  x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128) / 7
  by_rows = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  by_cols = jax.device_put(x, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "d")))
  state = {"w": x, "b": jnp.ones(3, jnp.bfloat16), "step": jnp.int32(4)}
  recorded = integrity.record(state)
  assert integrity.record(dict(state, w=by_rows)) == recorded
  assert integrity.record(dict(state, w=by_cols)) == recorded
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])  # same values, other places
  assert integrity.mismatches(dict(state, w=swapped), integrity.record(state)) == (["w"], [])


def test_the_host_checksum_of_a_leaf_or_the_sum_of_its_layers_is_the_recorded_one():
  """Export checks what it reads on the host (jaxzero.checkpoint.reader): a whole leaf's
  checksum, or the sum of its layers' parts, equals the devices' record, for every
  dtype a checkpoint holds."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 5, 7)).astype(np.float32)
  state = {"w": x, "b": x.astype(jnp.bfloat16), "h": x.astype(np.float16),
           "codes": rng.integers(0, 255, (3, 5, 7)).astype(np.uint8), "step": np.int32(4),
           "big": rng.standard_normal((2, 300, 257)).astype(np.float32)}  # in several chunks
  recorded = integrity.record(jax.tree.map(jnp.asarray, state))
  for name, leaf in state.items():
    leaf = np.asarray(leaf)
    want = integrity.recorded_checksum(recorded, name)
    assert integrity.host_checksum(leaf) == want, name
    if leaf.ndim:
      parts = [integrity.host_checksum(layer, i * layer.size) for i, layer in enumerate(leaf)]
      assert sum(parts) % 2**32 == want, name
  assert integrity.host_checksum(np.where(x == x[0, 0, 0], x[0, 0, 1], x)) != \
      integrity.recorded_checksum(recorded, "w")
  assert integrity.recorded_checksum({**recorded, "algorithm": "other"}, "w") is None


def test_per_shard_checksums_equal_the_global_view_and_cross_devices_once():
  mesh = jax.make_mesh((2, 4), ("a", "b"))

  def put(x, *spec):
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))

  x = (jnp.arange(8 * 16 * 3, dtype=jnp.float32).reshape(8, 16, 3) / 7).at[5, 1, 2].set(jnp.inf)
  leaves = [put(x, ("a", "b")), put(x, None, ("b", "a")),
            put(x, "b"),  # copies along "a": each counted once
            put(x.astype(jnp.bfloat16), None, "a"), put(x), put(jnp.int32(7)),  # replicated
            jnp.ones(5)]  # one device, not on the mesh: the global view
  unpadded = (None,) * len(leaves)
  want = np.asarray(integrity._checksums_and_finite(leaves, unpadded))
  np.testing.assert_array_equal(integrity._compute(leaves, True, unpadded), want)
  np.testing.assert_array_equal(integrity._compute(leaves, False, unpadded), want[:1])
  # A leaf stored padded (jaxzero.parallel.padding) sums its true shape alone: the
  # unpadded leaf's checksum, whatever the padding and the sharding.
  y = x[:7, :13]
  for padded in (jnp.pad(y, ((0, 1), (0, 3), (0, 0))), jnp.pad(y, ((0, 5), (0, 7), (0, 0)))):
    got = integrity._compute([put(padded, "b", "a")], False, [(7, 13, 3)])
    assert got == integrity._compute([y], False, [None])
  # One all-reduce of a [2, leaves] vector, not a tuple of a scalar per leaf.
  on_mesh = leaves[:-1]
  hlo = integrity._per_shard_sums(mesh, tuple(map(integrity._dims_axes, on_mesh)), True,
                                  unpadded[:-1]).lower(
      on_mesh).compile().as_text()
  assert hlo.count(" all-reduce(") == 1 and "u32[2,6]{1,0} all-reduce(" in hlo, hlo
