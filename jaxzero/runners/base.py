"""The runner protocol, and the runner whose whole state is in memory.

A runner owns how a state is trained: its creation, the step, where the state lives
between steps, how a checkpoint saves and restores it, and what it costs a device.
Every runner trains with a jaxzero.engine.TrainProgram (the model, the layout, the
shardings); the in-memory one runs the program's jitted step as it is.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Protocol

import jax

from jaxzero.checkpoint.checkpointer import Checkpointer
from jaxzero.checkpoint.directory import tree_leaf_shapes
from jaxzero.engine import TrainProgram
from jaxzero.offload import nvme_checkpoint, targets

OPTIONAL_LEAVES = ("loss_scale",)  # a float16 run's scaler: absent from other runs' saves


def checkpointer(workdir: str | pathlib.Path, keep: int | None,
                 info: dict[str, Any]) -> Checkpointer:
  """The checkpoints of a run in `workdir`, whatever its runner: each may resume
  another's (an NVMe runner's leaves are its checkpoints' side item)."""
  return Checkpointer(workdir, keep, info, side=nvme_checkpoint.SIDE_ITEM)


def padded_leaves(program: TrainProgram) -> dict[str, tuple[int, ...]]:
  """{state leaf name: true shape} of the leaves `program` stores padded
  (jaxzero.parallel.padding): what its checkpoints record and verify."""
  if not program.padding.any:
    return {}
  stored = tree_leaf_shapes(program.abstract)
  return {n: s for n, s in tree_leaf_shapes(program.true_abstract).items() if stored[n] != s}


class Runner(Protocol):
  """How a state is trained, saved and restored, and what it costs a device."""
  program: TrainProgram
  # What runs on the device each step: the whole step ("step"), or the gradient step
  # ("gradients"), the update then running outside it.
  device_program: str

  def check(self) -> None:
    """Before the state exists: one line (ConfigError or PathError) for a target this
    runner cannot use (a memory kind the backend lacks, a directory without room)."""

  def init(self, master: Any = None, key: jax.Array | None = None, frozen: Any = None) -> Any:
    """Step 0: `master` placed by ``program.shardings.master``, or random from `key`;
    `frozen` (a model's frozen leaves, placed by ``program.shardings.frozen``) likewise."""

  def compile(self, state, batch) -> Callable:
    """The step for these arguments, compiled now: (state, batch) -> (state, metrics)."""

  def step(self, state, batch) -> tuple[Any, dict]:
    """One optimizer step; `state` is consumed."""

  def lower(self, state_shapes, batch_shapes) -> jax.stages.Lowered:
    """The program that runs on the device each step, lowered from shapes (for plans)."""

  def save(self, checkpoints, step: int, state, wait: bool = False) -> pathlib.Path:
    """Saves `state` as checkpoint `step` (jaxzero.checkpoint.checkpointer)."""

  def restore(self, checkpoints, step: int, target) -> Any:
    """Checkpoint `step`, read into `target`'s shardings and into what the runner keeps."""

  def current(self, state) -> Any:
    """`state` with every update applied (DPU's in flight: jaxzero.runners.host): what a
    checkpoint of it saves, and what an evaluation of it sees."""

  def compute_copy(self, state) -> Any:
    """The compute-dtype weights cast from `state`'s float32 masters, as a step makes them
    (for a checkpoint restored from another precision: jaxzero.runners.resume)."""

  def plan(self) -> dict[str, int]:
    """Per-device bytes of the state: by role (params, grads, optimizer), in pinned_host
    (host), in files (nvme), and moved between host and device per step (transfer)."""

  def close(self) -> None:
    """Releases what the runner keeps outside memory (a checkpoint holds the state)."""


class InMemoryRunner:
  """The state in device (or pinned host) memory; the step is the program's."""

  device_program = "step"

  def __init__(self, program: TrainProgram):
    self.program = program

  def check(self) -> None:
    targets.check_offload(self.program.cfg, list(self.program.layout.mesh.devices.flat))

  def init(self, master: Any = None, key: jax.Array | None = None, frozen: Any = None):
    return self.program.init(master, key, frozen)

  def compile(self, state, batch):
    return self.program.train_step.lower(state, batch).compile()

  def step(self, state, batch):
    return self.program.train_step(state, batch)

  def lower(self, state_shapes, batch_shapes):
    return self.program.train_step.lower(state_shapes, batch_shapes)

  def save(self, checkpoints, step: int, state, wait: bool = False) -> pathlib.Path:
    return checkpoints.save(step, state, wait=wait, true_shapes=padded_leaves(self.program))

  def restore(self, checkpoints, step: int, target):
    return checkpoints.restore(step, target, optional=OPTIONAL_LEAVES,
                               true_shapes=padded_leaves(self.program))

  def current(self, state):
    return state

  def compute_copy(self, state):
    return self.program.compute_copy(state.master)

  def plan(self) -> dict[str, int]:
    return {**self.program.state_bytes(), "nvme": 0}

  def close(self) -> None:
    pass
