"""Checkpoints of the train state: save, and resume on any mesh and stage.

A restore reads each shard straight into the current mesh and stage, so no device ever holds
the full model, and verifies the checksums, so bytes damaged on disk are never trained on.
The data position is the step: nothing else is needed to resume. What a step directory holds
is jaxzero.checkpoint.directory's; reading leaves to the host (export) is
jaxzero.checkpoint.reader's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pathlib
import shutil
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp
from orbax.checkpoint import multihost

from jaxzero.checkpoint import integrity, read_errors
from jaxzero.checkpoint.directory import (HAS_CHECKSUMS, STATE, TRUE_SHAPES, CheckpointDirectory,
                                          check_fits, damaged_dir, saved_array,
                                          tree_leaf_shapes)
from jaxzero.checkpoint.external_leaves import SideItem, SideTarget
from jaxzero.errors import CheckpointError, DamagedCheckpointError
from jaxzero.models.llama import LlamaConfig

log = logging.getLogger(__name__)


# LlamaConfig fields that choose a kernel, not the architecture: not recorded.
_NOT_ARCHITECTURE = ("attention",)
# Recorded fields that do not change what restored weights compute: not worth a warning.
_NOT_ON_RESUME = ("init_std",)


def run_info(model: LlamaConfig, compute_dtype: str, seed: int,
             factory: str = "", lora: dict | None = None,
             data: dict | None = None) -> dict[str, Any]:
  """What a checkpoint records about its run besides the state: the architecture
  (for shape checks and export; a user's model: its factory), the compute dtype,
  the data seed, a LoRA run's adapters (jaxzero.models.lora.run_record), and the
  settings that place a step in the data (`data`: config key -> value)."""
  architecture = ({"factory": factory} if factory else
                  {k: v for k, v in dataclasses.asdict(model).items()
                   if k not in _NOT_ARCHITECTURE})
  info = {"model": architecture, "compute_dtype": compute_dtype, "seed": seed}
  if lora:
    info["lora"] = lora
  if data:
    info["data"] = data
  return info


class Checkpointer(CheckpointDirectory):
  """The training loop's checkpoints: asynchronous saves, restores into any layout.

  Keeps the newest `keep` steps (checkpoint.keep; None keeps all, as jaxzero.Engine.save
  does). The first save removes the temporary directories of saves that never completed
  (a killed run's), so a run that fails to start leaves the directory as it found it.
  """

  def __init__(self, workdir: str | pathlib.Path, keep: int | None, info: dict[str, Any],
               side: SideItem | None = None):
    """The latest `keep` checkpoints are kept (None: all); `info` (see run_info) is saved
    with every step and checked on restore; `side` saves and reads the leaves a state
    keeps outside memory."""
    super().__init__(
        workdir, ocp.StandardCheckpointHandler(), side,
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=True)
    self._info = info
    self._unfinished_removed = False
    read_errors.quiet_background_saves()

  def save(self, step: int, state, *, wait: bool = False,
           true_shapes: dict[str, tuple[int, ...]] | None = None) -> pathlib.Path:
    """Saves `state` as checkpoint `step`; a step that already exists is kept as is.

    Returns once the arrays are copied off the devices (so the caller may donate
    them) and the files are written in the background; `wait` waits for them.
    `true_shapes` ({leaf name: true shape}) names the leaves stored padded
    (jaxzero.parallel.padding): the checkpoint records their true shapes, and their
    checksums cover those alone.
    """
    self._remove_unfinished_saves()
    if step not in self._manager.all_steps():
      items = {}
      if self._side is not None:
        state, side_args = self._side.split(state)
        if side_args is not None:
          items[self._side.name] = side_args
      # Computed on the devices before the save copies the state off them.
      checksums = integrity.record(state, true_shapes)
      info = {**self._info, HAS_CHECKSUMS: True,
              **({TRUE_SHAPES: true_shapes} if true_shapes else {})}
      try:  # (orbax raises here what an earlier save, written in the background, met)
        self._manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), info=ocp.args.JsonSave(info),
            checksums=ocp.args.JsonSave(checksums), **items))
      except Exception as e:  # pylint: disable=broad-except
        raise self._write_failure(e) from e
    if wait:
      self.wait()
    return self.step_dir(step)

  def check_saves(self) -> None:
    """Raises CheckpointError where a save written in the background has failed (a full
    disk, a lost mount): said when it happens, not at the next save."""
    try:
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_failure(e) from e

  def _write_failure(self, error: BaseException) -> CheckpointError:
    """One line for a failed save; its unfinished files go, freeing what they hold."""
    self._unfinished_removed = False
    try:
      self._remove_unfinished_saves()
    except OSError:
      pass
    complete = sorted(int(p.name) for p in self.directory.iterdir()
                      if p.name.isdigit()) if self.directory.is_dir() else []
    kept = (f"the last complete checkpoint is step {complete[-1]}, which a new run resumes"
            if complete else "no checkpoint is complete")
    return CheckpointError(f"a checkpoint could not be written in {self.directory}: "
                           f"{read_errors.write_reason(error)}; {kept}")

  def _remove_unfinished_saves(self) -> None:
    # orbax's own cleanup_tmp_directories runs in a thread that close() does not
    # join, so a run stopping right after it started could cut it short.
    if self._unfinished_removed:
      return
    self._unfinished_removed = True
    if jax.process_index() == 0:
      for unfinished in ocp.path.step.all_temporary_paths(self.directory):
        log.info("removing %s, a save that never completed", unfinished.get())
        shutil.rmtree(unfinished.get())

  def wait(self) -> None:
    """Blocks until every save has been written and renamed into place."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_failure(e) from e

  def check_model_shape(self, step: int) -> None:
    """Raises CheckpointError when checkpoint `step` was saved for a model of another shape
    (a reused workdir): at once, from its run record, before the run is built. A record
    that cannot be read is left to the restore (which may fall back to an older one)."""
    try:
      info = self.info(step)
    except CheckpointError:
      return
    saved = info.get("model", {})
    current = {k: v for k, v in self._info["model"].items() if k in SHAPE_FIELDS and k in saved}
    if any(saved[k] != v for k, v in current.items()):
      raise CheckpointError(f"checkpoint {self.step_dir(step)} does not fit this config"
                            f"{_model_difference(saved, current)}; another model needs "
                            "another --workdir")
    lora = _lora_difference(info.get("lora"), self._info.get("lora"))
    if lora:
      raise CheckpointError(f"checkpoint {self.step_dir(step)} does not fit this config "
                            f"({'; '.join(lora)}); {_lora_settings(info)} to resume it, or "
                            "train other adapters in another --workdir")
    check_same_lora_scale(info.get("lora"), self._info.get("lora"), self.step_dir(step))

  def restore(self, step: int, target, into: SideTarget | None = None,
              optional: tuple[str, ...] = (),
              true_shapes: dict[str, tuple[int, ...]] | None = None):
    """Checkpoint `step`, each leaf read straight into the sharding of its
    ShapeDtypeStruct in `target` (e.g. Engine.abstract_state()), and verified
    against the checksums saved with it. With `into` (e.g. the NVMe tier), the
    leaves it keeps are given to it instead, and its state is returned.
    The fields of `target` named in `optional` may be missing on either side:
    the checkpoint's are not read when `target` has none, and a field the
    checkpoint lacks comes back None. `true_shapes`: as for :meth:`save`, of
    `target`; a leaf padded differently in the checkpoint is read at its true
    shape and padded anew with zeros.

    Raises:
      CheckpointError: naming the first leaf whose shape differs from `target`, or a
        LoRA scale (lora.alpha) other than the checkpoint's.
      DamagedCheckpointError: naming the leaf or file that cannot be read, or
        whose values differ from its checksum or are not finite.
    """
    where = self.step_dir(step)
    info = self.info(step)
    lora = _lora_difference(info.get("lora"), self._info.get("lora"))
    hint = (_model_difference(info.get("model", {}), self._info["model"])
            or (f" ({'; '.join(lora)})" if lora else ""))
    saved = self.leaf_shapes(step)
    clip = None if into is not None or self.side_saved(step) else \
        _clip_change(saved, tree_leaf_shapes(target))
    if clip is not None:
      log.warning("checkpoint %s was saved %s gradient clipping: its optimizer state restores, "
                  "and steps clip as train.clip_norm says from here on", where,
                  "with" if clip == "saved" else "without")
      target = _as_saved(target, clip)
    wanted = tree_leaf_shapes(target)
    stored = dict(saved)  # as stored: padded where the saving mesh padded
    saved.update({n: tuple(s) for n, s in info.get(TRUE_SHAPES, {}).items()})
    repadded = {n for n, s in wanted.items() if n in stored and stored[n] != s}
    wanted.update(true_shapes or {})
    in_field = lambda names, field: any(n.startswith(field + "/") for n in names)
    unsaved = [f for f in optional if in_field(wanted, f) and not in_field(saved, f)]
    unwanted = [f for f in optional if in_field(saved, f) and not in_field(wanted, f)]
    skipped = tuple(f + "/" for f in unsaved + unwanted)
    check_fits({n: s for n, s in saved.items() if not n.startswith(skipped)},
               {n: s for n, s in wanted.items() if not n.startswith(skipped)}, where,
               "this config", hint)
    check_same_lora_scale(info.get("lora"), self._info.get("lora"), where)
    changed = _changed_settings(info.get("model", {}), self._info["model"])
    if changed:  # e.g. a longer context's rope_theta: allowed, but never unawares
      log.warning("checkpoint %s was trained with another model%s: its weights fit, and compute "
                  "with this config's settings from here on", where, changed)
    if info.get("seed") != self._info["seed"]:
      log.warning("checkpoint %s was trained with seed=%s, this config has seed=%s: the data "
                  "order changes from here on", where, info.get("seed"), self._info["seed"])
    saved_data, data = info.get("data", {}), self._info.get("data", {})
    moved = [f"{key}={saved_data[key]} (now {value})" for key, value in data.items()
             if key in saved_data and saved_data[key] != value]
    if moved:  # a step's rows are found from these: the run goes on at another place
      log.warning("checkpoint %s was trained with %s: the steps from here on read other "
                  "rows than an uninterrupted run would (rows may repeat or be skipped)",
                  where, ", ".join(moved))
    item = self.side_saved(step)
    # The leaves on the side (saved in the side item, or to be restored into
    # `into`) are not in `state`, or not read from it.
    kept = set(into.names) if into else set()
    partial = _without(target, kept | set(item.shapes() if item else ()))
    # An optional field the checkpoint lacks (a float16 run's scaler, resumed from
    # another precision's save) is not read: the caller makes it afresh.
    partial = partial._replace(**{f: None for f in unsaved})
    try:
      restored = self._restore_fields(step, partial, unwanted, strict=not repadded)
      if item:  # what the item holds and `into` does not keep: read from the item
        restored = item.with_leaves(restored, target._replace(**{f: None for f in unsaved}),
                                    kept)
    except Exception as e:  # pylint: disable=broad-except
      # orbax and tensorstore report a damaged file as a bare Exception.
      raise self._lone_failure(step, read_errors.read_failure(where, e)) from e
    if int(restored.step) != step:
      raise DamagedCheckpointError(f"checkpoint {where} holds a state at step "
                                   f"{int(restored.step)}, not {step}")
    recorded = self.recorded_checksums(step, item)
    _raise_if_damaged(where, *integrity.mismatches(restored, recorded, true_shapes))
    if into is None:
      return _as_wanted(restored, clip)
    try:  # its leaves: from the side item, or from an in-memory run's `state`
      differ = into.fill(recorded, item, lambda kind: saved_array(where / STATE, kind))
    except read_errors.ReadError as e:  # this process's part of them
      raise self._lone_failure(step, read_errors.read_failure(where, e.__cause__)) from e
    _raise_if_damaged(where, *differ)  # global sums: seen by every process alike
    return into.state(restored)

  def _lone_failure(self, step: int, failure: CheckpointError) -> CheckpointError:
    """`failure`, of a read only this process made (its shards): damage, which a run
    answers by resuming an older checkpoint, where this is the only process. With others,
    which may have read theirs, a process resuming an older checkpoint alone would meet
    them in another step's collectives (seen: a 30 s collective timeout, a traceback); it
    stops instead, and they with it (jaxzero.runtime.peerwatch), the checkpoints as they
    were."""
    if jax.process_count() == 1 or not isinstance(failure, DamagedCheckpointError):
      return failure
    older = [s for s in self.all_steps() if s < step]
    return CheckpointError(
        f"{failure}; process {jax.process_index()} of {jax.process_count()} read this, and a "
        "process does not resume an older checkpoint alone, so the run stops and moves "
        "nothing" + (f" (--resume-step {older[-1]} resumes the one before it on every process)"
                     if older else ""))

  def _restore_fields(self, step: int, target, unwanted: list[str], strict: bool = True):
    """The saved state read into `target` (a NamedTuple of abstract arrays).

    orbax matches the saved tree field by field, so the request names exactly
    the fields saved: a field `target` leaves None and the checkpoint lacks
    (e.g. a newer optional field) is left out and comes back None, and a saved
    field in `unwanted` is read (replicated: it is small) and dropped. Not
    `strict`: a leaf stored at another padded shape is truncated or padded with
    zeros at the end of each dimension to its target's (orbax's own reading).
    """
    saved = self._manager.item_metadata(step)[STATE]
    request = {f: v for f, v in target._asdict().items() if f in saved.keys()}
    replicated = jax.sharding.NamedSharding(target.step.sharding.mesh,
                                            jax.sharding.PartitionSpec())
    for f in unwanted:
      request[f] = jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated), saved[f])
    tree = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(request, strict=strict))
    )[STATE]
    return type(target)(**{f: None if f in unwanted else tree.get(f) for f in target._fields})

  def set_aside(self, step: int) -> pathlib.Path:
    """Moves damaged checkpoint `step` out of the way, into damaged_dir, so that
    the run can save that step again; nothing is deleted."""
    source = self.step_dir(step)
    target = damaged_dir(self.directory.parent) / source.name
    if jax.process_index() == 0:
      target.parent.mkdir(exist_ok=True)
      # Damaged again at the same step: keep both, under the first free name (not the
      # count of what is there: a user may have deleted some).
      copies = (target.with_name(f"{source.name}.{n}") for n in itertools.count(1))
      target = target if not target.exists() else next(t for t in copies if not t.exists())
      source.rename(target)
    multihost.sync_global_processes(f"jaxzero:set aside checkpoint {step}",
                                    processes=set(range(jax.process_count())))
    self._manager.reload()
    return target

  def close(self) -> None:
    """Waits for saves in flight, then releases orbax's threads."""
    self.wait()
    super().close()


# ----------------------------------------------------------------------------- checks


def check_same_lora_scale(saved: dict | None, wanted: dict | None, where: pathlib.Path) -> None:
  """Refuses to resume adapters under another lora.alpha: the shapes fit, but each
  adapter's update would be scaled otherwise, a different model from the first step on
  (a PEFT adapter with another alpha, lora.init_from, is refused likewise)."""
  if saved and wanted and saved.get("alpha") != wanted.get("alpha"):
    was, now = saved["alpha"], wanted["alpha"]
    if _made_by_lora_call(saved):
      raise CheckpointError(f"checkpoint {where} was trained with jaxzero.lora(alpha={was:g}), "
                            f"this model has alpha={now:g}: the adapters would be scaled "
                            f"otherwise; make it with jaxzero.lora(..., alpha={was:g})")
    raise CheckpointError(f"checkpoint {where} was trained with lora.alpha={was:g}, this "
                          f"config has lora.alpha={now:g}: the adapters would be scaled "
                          f"otherwise; set lora.alpha={was:g}")


# The optimizer's state under global-norm clipping, optax.chain(clip, inner): the clip's
# EmptyState (no leaves), then the inner state, whose leaves move one level down.
_CLIPPED = "opt_state/1/"


def _clip_change(saved: dict, wanted: dict) -> str | None:
  """"saved" where only the checkpoint's optimizer state is a clipped chain's, "wanted"
  where only the target's is (train.clip_norm changed on resume, which DeepSpeed and
  torch allow: clipping keeps no state); else None."""
  opt = lambda names: {n[len("opt_state/"):] for n in names if n.startswith("opt_state/")}
  clipped = lambda names: {_CLIPPED + n for n in opt(names)}
  saved_opt = {n for n in saved if n.startswith("opt_state/")}
  wanted_opt = {n for n in wanted if n.startswith("opt_state/")}
  if saved_opt and saved_opt != wanted_opt:
    if saved_opt == clipped(wanted):
      return "saved"
    if wanted_opt == clipped(saved):
      return "wanted"
  return None


def _as_saved(target, clip: str):
  """`target` with its optimizer state nested as the checkpoint's (see _clip_change)."""
  if clip == "saved":
    return target._replace(opt_state=(optax.EmptyState(), target.opt_state))
  return target._replace(opt_state=target.opt_state[1])


def _as_wanted(restored, clip: str | None):
  """A state restored by _as_saved's target, nested as the one asked for."""
  if clip == "saved":
    return restored._replace(opt_state=restored.opt_state[1])
  if clip == "wanted":
    return restored._replace(opt_state=(optax.EmptyState(), restored.opt_state))
  return restored


def _without(tree, names) -> Any:
  """`tree` (e.g. a TrainState) with None at the leaves `names`."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: None if integrity.leaf_name(p) in names else x, tree)


def _raise_if_damaged(where: pathlib.Path, differ: list[str], nonfinite: list[str]) -> None:
  for bad, what in ((differ, "do not match the checksum saved with them"),
                    (nonfinite, "are not finite")):
    if bad:
      more = f" and {len(bad) - 1} more leaves" if len(bad) > 1 else ""
      raise DamagedCheckpointError(f"checkpoint {where} is damaged: the values of leaf "
                                   f"{bad[0]}{more} {what}")


# The model fields that set the state's leaf shapes: another value cannot resume.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_dim",
                "tie_embeddings", "qkv_bias")


def _model_difference(saved: dict, current: dict) -> str:
  diffs = [f"model.{k}={saved.get(k)} in the checkpoint, {v} here"
           for k, v in current.items() if saved.get(k) != v]
  return f" ({'; '.join(diffs)})" if diffs else ""


# The LoRA settings that decide a checkpoint's leaves (jaxzero.models.lora.run_record).
_LORA_SHAPE = ("rank", "targets", "base_dtype")


def _lora_difference(saved: dict | None, current: dict | None) -> list[str]:
  """The LoRA settings (of _LORA_SHAPE) in which two run records differ (only the rank
  where one of them has no LoRA)."""
  if not saved or not current:
    rank = lambda record: record["rank"] if record else 0
    return ([] if rank(saved) == rank(current) else
            [f"lora.rank={rank(saved)} in the checkpoint, {rank(current)} here"])
  # (jaxzero.Engine records jaxzero.lora's targets, a regex, as they were given.)
  value = lambda record, key: (",".join(record[key]) if key == "targets" and not
                               isinstance(record[key], str) else record.get(key, ""))
  return [f"lora.{k}={value(saved, k)} in the checkpoint, {value(current, k)} here"
          for k in _LORA_SHAPE if value(saved, k) != value(current, k)]


def _made_by_lora_call(record: dict | None) -> bool:
  """Whether a run's LoRA record is jaxzero.lora's (targets: a regex), not lora.*'s."""
  return bool(record) and isinstance(record["targets"], str)


def _lora_settings(info: dict) -> str:
  """How to make a checkpoint's LoRA shape again: the --set arguments, or jaxzero.lora's."""
  lora = info.get("lora")
  if not lora:
    return "train without LoRA (lora.rank=0; no jaxzero.lora)"
  if _made_by_lora_call(lora):
    return (f"make the model with jaxzero.lora(rank={lora['rank']}, alpha={lora['alpha']:g}, "
            f"targets={lora['targets']!r})")
  return (f"set lora.rank={lora['rank']}, lora.targets={','.join(lora['targets'])}, "
          f"lora.base_dtype={lora.get('base_dtype', '')}")


def _changed_settings(saved: dict, current: dict) -> str:
  """The model settings both records hold, with different values: not those one of them
  lacks (a field newer than the checkpoint, or a user model's record beside a config's)."""
  diffs = [f"model.{k}={saved[k]} in the checkpoint, {v} here" for k, v in current.items()
           if k in saved and saved[k] != v and k not in _NOT_ON_RESUME]
  return f" ({'; '.join(diffs)})" if diffs else ""
