"""What one process of a run holds in host memory, before anything is allocated.

Three parts, each from the resolved mesh and the state's own shardings: what the runner
keeps on the host (ZeRO-Offload's optimizer state and its update's workspace: the
runner's plan), what XLA's pinned pool holds (weights in pinned_host with a micro-step's
gradient, remat.policy=offload_matmuls's activations), and the copy a checkpoint save
takes of the process's device state before writing it (orbax's asynchronous save: each
distinct shard once). jax.process_index() alone is read: no collective.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.parallel import mesh as mesh_lib
from jaxzero.runtime import pinned_pool


class HostMemory(NamedTuple):
  """One process's host memory, in bytes, and two of its parts."""
  process: int  # all of it: the runner's share, the pool's, a save's copy
  pinned: int  # of which, in XLA's pinned pool
  save_copy: int  # of which, a checkpoint save's copy of the device state


def process_devices(devices) -> list:
  """Of `devices`, this process's."""
  return [d for d in devices if d.process_index == jax.process_index()]


def per_process(runner, state: dict, devices, *, estimate_activations: bool,
                count_save: bool = True) -> HostMemory:
  """The host memory, on a GPU, of the process whose devices are `devices` (of the mesh),
  for `runner` (whose plan() is `state`). The planner poses a process of some of its
  virtual devices (all of them are its own): the runner's store then counts the share of
  those devices (runner_share)."""
  pinned = pinned_bytes(runner.program, state, len(devices), estimate_activations)
  saved = save_copy_bytes(runner, devices) if count_save else 0
  return HostMemory(runner_share(state, len(devices)) + pinned + saved, pinned, saved)


def runner_share(state: dict, devices: int) -> int:
  """What the runner keeps in host memory for a process of `devices` devices: its store
  (at most `devices` devices' share of it: each holds a different shard but where shards
  repeat) with what grows with it, and the update's workspace."""
  process, store = state.get("host_process", 0), state.get("host_store", 0)
  if not store:
    return process
  per_device = state["host"] - state.get("pinned_pool", 0)  # the store's, on one device
  workspace = state.get("host_workspace", 0)
  return workspace + (process - workspace) * min(store, devices * per_device) // store


def pinned_bytes(program, state: dict, local_devices: int, estimate_activations: bool) -> int:
  """What this process places in XLA's pinned pool: each of its devices' weights in
  pinned_host (exact, from the shardings; under DPU twice, its copy too) with a
  micro-step's gradient of the trained ones on its way back (a frozen LoRA base has none),
  and the matmul outputs remat.policy=offload_matmuls keeps there
  (pinned_pool.offloaded_matmul_bytes)."""
  cfg = program.cfg
  weights = state.get("pinned_pool", state["host"])  # per device
  trained = weights - state.get("host_frozen", 0)
  compute = jnp.dtype(cfg.precision.compute).itemsize
  gradient = (trained * jnp.dtype(cfg.zero.grad_dtype).itemsize // compute
              if cfg.offload.params == "pinned_host" else 0)
  activations = 0
  if estimate_activations and cfg.remat.policy == "offload_matmuls":
    rows = mesh_lib.micro_batch(cfg.train, program.layout.data_parallel_size)
    activations = pinned_pool.offloaded_matmul_bytes(cfg, rows)
  return (weights + state.get("delayed_pinned", 0) + gradient + activations) * local_devices


def save_copy_bytes(runner, devices) -> int:
  """The bytes a save copies off the process's `devices`: each distinct shard of the
  device-resident state once (a replicated leaf's copies are one). A runner whose
  optimizer state is the host's or the disk's saves it chunk by chunk from there, so only
  its weights are copied; ZeRO-Infinity's state is all on disk."""
  program = runner.program
  if program.cfg.offload.params == "nvme":
    return 0
  abstract, shardings = program.abstract, program.shardings
  # A runner whose device runs the gradient step alone (host, NVMe) keeps the rest of the
  # state off the device: jaxzero.runners.
  if runner.device_program != "step":
    abstract, shardings = abstract.params, shardings.params
  return unique_bytes(abstract, shardings, devices)


def unique_bytes(abstract, shardings, devices) -> int:
  """Bytes of the distinct shards of `abstract`'s leaves on `devices`."""
  devices, total = set(devices), 0
  for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
    shards = {tuple(s.indices(n)[:2] for s, n in zip(index, shape))
              for device, index in sharding.devices_indices_map(shape).items()
              if device in devices}
    total += sum(math.prod(stop - start for start, stop in shard) for shard in shards) * itemsize
  return total
