"""Before anything is allocated: whether the run fits in memory.

:func:`check` is the start-up memory check: model state per device from the
shardings (the runner's ``plan()``, exact) plus an analytic estimate of the
step's activations, against the device's memory (``memory_stats()``'s
``bytes_limit``) or, on a CPU, the host's RAM shared by its CPU devices. It runs
in well under a second, before the state is created, and a run that cannot
fit stops with one line saying what would fit. Compiling the step, as
``jaxzero.plan`` does, measures XLA's own figure; this only estimates it.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import zlib

from jaxzero.errors import ConfigError
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.planning import host_memory
from jaxzero.runtime import memory, pinned_pool
from jaxzero.utils.formatting import format_bytes

log = logging.getLogger(__name__)

# Activation bytes are an estimate; a step also needs room for XLA's own buffers. What the
# check's prediction met on a GPU sets it: one H200, 2026-11-27, the measured peak was 0.98x
# the prediction for Llama-3.1-8B whole (129.5 of 132.1 GB) and 0.85x for the 1B shape;
# 5% covers the first with room, where 10% refused a run that fits.
HEADROOM = 1.05


class DoesNotFitError(ConfigError):
  """The run does not fit the devices' memory (jaxzero.train --force goes on anyway)."""


# ----------------------------------------------------------------------------
# Accounting


@dataclasses.dataclass
class Budget:
  """Per-device bytes of a run, and what this machine offers."""
  params: int
  grads: int
  optimizer: int
  host: int  # of the state above, placed in pinned_host
  activations: int  # estimate of the step's temporaries
  available: int | None  # device memory per device; None = unknown
  where: str  # what `available` is, in words
  devices: int
  platform: str
  disk: int = 0  # of the state above, in files (offload.optimizer=nvme)
  # Host memory (off a CPU): what each process holds there (the offloaded state, the
  # update's workspace, XLA's pinned pool), how many processes share this host, its RAM.
  host_process: int = 0
  host_processes: int = 1
  host_ram: int | None = None
  local_devices: int = 1  # this process's
  # Of host_process, what XLA's pinned pool holds, and the pool's size (None: unknown).
  pinned_process: int = 0
  pinned_limit: int | None = None
  save_copy: int = 0  # of host_process, a checkpoint save's copy of the device state
  # False for a user's model (model_factory): its activations are not estimated (0 above).
  activations_estimated: bool = True
  delayed: int = 0  # what DPU keeps on the device beside the state (its weights' copy)

  @property
  def activations_text(self) -> str:
    return (f"activations ~{format_bytes(self.activations)}" if self.activations_estimated
            else "activations not estimated")

  @property
  def off_device_text(self) -> str:
    """What of the state `needed` leaves out, as ", less X in host memory and Y on disk"."""
    parts = [f"{format_bytes(self.host)} in host memory"] if self.platform != "cpu" and (
        self.host) else []
    parts += [f"{format_bytes(self.disk)} on disk"] if self.disk else []
    return f", less {' and '.join(parts)}," if parts else ""

  @property
  def host_fits(self) -> bool:
    """Whether this host's processes' host memory fits its RAM (on a CPU, host memory is
    device memory: `fits` counts it)."""
    return self.platform == "cpu" or (
        (self.host_ram is None
         or self.host_process * self.host_processes * HEADROOM <= self.host_ram)
        and (self.pinned_limit is None or self.pinned_process * HEADROOM <= self.pinned_limit))

  @property
  def state(self) -> int:
    return self.params + self.grads + self.optimizer

  @property
  def needed(self) -> int:
    """What must fit in `available`: on a CPU host memory is device memory."""
    on_device = self.state + self.delayed + self.activations - self.disk
    return on_device if self.platform == "cpu" else on_device - self.host

  @property
  def fits(self) -> bool:
    return self.available is None or self.needed * HEADROOM <= self.available


def activation_bytes(cfg, micro_batch: int, shard_size: int, params_sharded: bool) -> int:
  """Estimated per-device bytes of the step's temporaries.

  Saved activations of this device's layers by remat.policy (in the compute dtype) for
  each micro-batch its pipeline stage holds at once, one layer's recomputed working set
  in fp32 (attention in tiles of 512 keys), the loss's logits over one vocabulary chunk,
  and under stage 3 one layer's gathered weights twice (the gather of the next layer
  overlaps the current). The mesh divides it: mesh.context splits each row's tokens
  (attention gathers the whole row's keys and values), mesh.tensor the heads, the MLP
  and the vocabulary, mesh.pipeline the layers, with what a stage keeps for its backward
  (jaxzero.parallel.pipeline.kept_for_backward); GPipe and interleaved take the loss of
  the merged batch.
  """
  from jaxzero.models.llama import count_params  # pylint: disable=import-outside-toplevel
  from jaxzero.parallel.pipeline import kept_for_backward  # pylint: disable=import-outside-toplevel
  m, t, mesh = cfg.model, cfg.train, cfg.mesh
  c = 4 if cfg.precision.compute == "float32" else 2
  row = t.seq_len // mesh.context  # this device's tokens of a row
  tokens = micro_batch * row
  heads, mlp = m.n_heads / mesh.tensor, m.mlp_dim / mesh.tensor
  kv = 2 * m.n_kv_heads * (m.dim // m.n_heads) / mesh.tensor
  # Per layer and token: its input (split along the sequence over mesh.tensor, sequence
  # parallelism, where mesh.context does not split it and mesh.tensor divides it:
  # jaxzero.parallel.zero's Layout.activation_spec) plus the names remat keeps
  # (jaxzero.engine.remat).
  sequence_parallel = mesh.context == 1 and t.seq_len % mesh.tensor == 0
  layer_input = m.dim / (mesh.tensor if sequence_parallel else 1)
  saved_per_token = layer_input + {
      "none": 4 * m.dim + kv + 2 * mlp,
      "save_matmuls": 3 * m.dim + kv + 2 * mlp,
      "save_attention": 2 * m.dim + kv,
  }.get(cfg.remat.policy, 0)  # full and offload_matmuls keep the input only
  layers = m.n_layers // mesh.pipeline
  saved = layers * tokens * saved_per_token * c
  if mesh.pipeline > 1:
    residual_sets, inputs = kept_for_backward(mesh.pipeline, t.grad_accum,
                                              cfg.pipeline.schedule, cfg.pipeline.virtual_stages)
    saved = residual_sets * saved + inputs * tokens * layer_input * c
  working = tokens * (4 * m.dim + 3 * mlp) * 4
  working += micro_batch * heads * row * min(t.seq_len, 512) * 4
  if mesh.context > 1:  # a layer's gathered keys and values, and their gradients
    working += micro_batch * t.seq_len * kv * (c + 4)
  merged = mesh.pipeline > 1 and cfg.pipeline.schedule != "1f1b"
  vocab_chunk = min(m.vocab_size / mesh.tensor, 8192)
  logits = 2 * tokens * (t.grad_accum if merged else 1) * vocab_chunk * 4
  layer_params = count_params(m) / m.n_layers / mesh.tensor
  gathered = (2 * layer_params * c if params_sharded and (shard_size > 1
                                                           or cfg.offload.params == "nvme") else 0)
  layer_grads = layer_params * 4
  return int(saved + working + logits + gathered + layer_grads)


def available_bytes(devices, count_processes: bool = True) -> tuple[int | None, str]:
  """Memory per device and what it is: a GPU's limit, or host RAM over the CPU devices
  (of this host's processes where `count_processes`: a collective)."""
  import jax  # pylint: disable=import-outside-toplevel
  mine = [d for d in devices if d.process_index == jax.process_index()]
  if not mine:  # a process that holds none of the mesh's devices
    return None, "this process holds none of the mesh's devices"
  device = mine[0]
  if device.platform == "cpu":
    processes = processes_on_this_host() if count_processes else 1
    local = len(mine) * processes  # jaxzero.launch gives each process the same share
    ram = host_memory_bytes()
    where = f" in {processes} processes" if processes > 1 else ""
    return ram // local, (f"{local} CPU devices{where} share this host's {format_bytes(ram)} "
                          f"of RAM ({format_bytes(ram // local)} each)")
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  if not limit:
    return None, f"the {device.device_kind}'s memory limit is not reported"
  return int(limit), f"each {device.device_kind} has {format_bytes(limit)}"


def processes_on_this_host() -> int:
  """How many of the run's processes share this host (one collective: every process
  must call it)."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.process_count() == 1:
    return 1
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  mine = zlib.crc32(socket.gethostname().encode())
  hosts = np.asarray(multihost_utils.process_allgather(np.array([mine], np.uint32)))
  return int((hosts == mine).sum())


def host_memory_bytes() -> int:
  """The host's RAM, or its cgroup's limit where smaller (jaxzero.runtime.memory)."""
  return memory.host_ram_bytes()


def budget(runner, devices, estimate_activations: bool | None = None,
           whole_run: bool = True) -> Budget:
  """The per-device accounting of `runner`'s run (jaxzero.runners) on `devices`
  (nothing is allocated). Activations are estimated for the built-in models only (unless
  `estimate_activations` says otherwise: jaxzero.Engine's model is the user's). A
  `whole_run` (jaxzero.train's) also counts a save's copy of the state, and the processes
  sharing this host (a collective: every process must call it); an Engine, which saves
  only when asked and may be built by some processes alone, does neither."""
  layout = runner.program.layout
  state = runner.plan()
  if estimate_activations is None:
    estimate_activations = not runner.program.cfg.model_factory
  available, where = available_bytes(devices, count_processes=whole_run)
  # A user's model has no estimate: its state is counted, its activations not.
  cfg, disk = runner.program.cfg, state["nvme"]
  if cfg.offload.params == "nvme":
    # ZeRO-Infinity (jaxzero.runners.infinity): the whole state is in files, the device
    # runs one layer at a time with a checkpoint per layer (full remat) and holds that
    # layer's weights and the next one's (the estimate's "gathered" term).
    disk = state["params"] + state["grads"] + state["optimizer"]
    cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, policy="full"))
  activations = 0 if not estimate_activations else activation_bytes(
      cfg, mesh_lib.micro_batch(cfg.train, layout.data_parallel_size), layout.shard_size,
      layout.is_sharded("params") or cfg.offload.params == "nvme")
  on_a_cpu = devices[0].platform == "cpu"
  local = len(host_memory.process_devices(devices))
  host = (host_memory.HostMemory(0, 0, 0) if on_a_cpu else host_memory.per_process(
      runner, state, list(layout.mesh.local_devices),
      estimate_activations=estimate_activations, count_save=whole_run))
  return Budget(state["params"], state["grads"], state["optimizer"], state["host"], activations,
                available, where, len(devices), devices[0].platform, disk=disk,
                host_process=host.process,
                host_processes=(processes_on_this_host() if whole_run and host.process else 1),
                host_ram=None if on_a_cpu else host_memory_bytes(),
                local_devices=local, pinned_process=host.pinned, save_copy=host.save_copy,
                pinned_limit=None if not host.pinned else pinned_pool.limit_bytes(),
                activations_estimated=estimate_activations,
                delayed=state.get("delayed_device", 0))


# ----------------------------------------------------------------------------
# The check


def check(runner, devices, force: bool = False, estimate_activations: bool | None = None,
          whole_run: bool = True, force_hint: str = "--force starts it anyway") -> Budget:
  """The run's Budget (see budget); raises DoesNotFitError (one line, ending in
  `force_hint`) when it cannot fit, unless `force`."""
  b = budget(runner, devices, estimate_activations, whole_run)
  if not b.host_fits:
    message = host_message(b)
  elif b.fits:
    return b
  else:
    message = device_message(runner.program, b)
  if force:
    log.warning("forced: %s", message)
    return b
  raise DoesNotFitError(f"{message}; {force_hint}")


def host_message(b: Budget) -> str:
  """The line for a run whose host memory does not fit this host's RAM, or whose pinned
  memory does not fit XLA's pinned pool."""
  ram_fits = b.host_ram is None or b.host_process * b.host_processes * HEADROOM <= b.host_ram
  if ram_fits:  # the pool is what does not fit
    return (f"this run places about {format_bytes(b.pinned_process)} per process in XLA's "
            f"pinned host pool (the weights in pinned_host with a micro-step's gradient, and "
            f"offloaded activations), but the pool holds {b.pinned_limit / (1 << 30):g} GiB "
            f"({pinned_pool.ENV}, headroom {HEADROOM:g}x); raise {pinned_pool.ENV} (GiB, "
            "within the host's RAM), or shard over more devices")
  total = b.host_process * b.host_processes
  shared = (f" x {b.host_processes} processes on this host = {format_bytes(total)}"
            if b.host_processes > 1 else "")
  parts = ([f"{format_bytes(b.pinned_process)} in XLA's pinned pool: weights in pinned_host, "
            "a micro-step's gradient, offloaded activations"] if b.pinned_process else [])
  offloaded = b.host_process - b.pinned_process - b.save_copy
  if offloaded > 0:
    parts.append(f"{format_bytes(offloaded)} of offloaded optimizer state and its update's "
                 "workspace")
  if b.save_copy:
    parts.append(f"{format_bytes(b.save_copy)} a checkpoint save copies off the devices")
  fixes = ("offload.optimizer=nvme keeps the optimizer state on disk, or "
           if offloaded > 0 else "")
  return (f"this run keeps about {format_bytes(b.host_process)} in host memory per process "
          f"({'; '.join(parts)}){shared}, but this host has {format_bytes(b.host_ram)} of RAM "
          f"(headroom {HEADROOM:g}x); {fixes}more devices shard it")


def device_message(program, b: Budget) -> str:
  """The line for a run that does not fit the devices' memory."""
  return (f"this run needs about {format_bytes(b.needed)} per device (model state "
          f"{format_bytes(b.state)}{b.off_device_text} + {b.activations_text}), "
          f"{format_bytes(b.needed * HEADROOM)} with the check's {HEADROOM:g}x headroom, "
          f"on {b.devices} devices, but {b.where}; {suggest(program, b)}")


def suggest(program, b: Budget) -> str:
  """What would fit, from the analytic accounting: another stage or remat policy,
  offload, a smaller micro-batch, or more devices (for a model whose activations are not
  estimated, jaxzero.Engine's: the state's ideas alone)."""
  from jaxzero.parallel.zero import SHARDED_ROLES  # pylint: disable=import-outside-toplevel
  cfg, layout = program.cfg, program.layout
  phi = program.n_params  # trained (a LoRA run's adapters)
  frozen = program.frozen_bytes if program.n_frozen else 0
  c = 4 if cfg.precision.compute == "float32" else 2
  g = 4 if cfg.zero.grad_dtype == "float32" else 2
  estimated = b.activations_estimated
  micro = mesh_lib.micro_batch(cfg.train, layout.data_parallel_size) if estimated else 1
  cpu = b.platform == "cpu"

  def needed(stage=layout.stage, n=layout.shard_size, policy=cfg.remat.policy, m=micro,
             offload=cfg.offload.optimizer) -> int:
    shard = lambda role: n if role in SHARDED_ROLES[stage] else 1
    opt = 12 * phi / shard("optimizer")
    state = c * phi / shard("params") + g * phi / shard("grads")
    state += opt if offload == "device" or (cpu and offload == "pinned_host") else 0
    state += frozen / n  # a LoRA base, sharded at every stage
    policy_cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, policy=policy))
    state /= getattr(layout, "tensor_size", 1)  # mesh.tensor splits every weight further
    state /= getattr(layout, "pipeline_size", 1)  # a stage holds its layers (about 1/S)
    return int(state + (activation_bytes(policy_cfg, m, n, stage == 3 and n > 1)
                        if estimated else 0))

  fits = lambda n_bytes: n_bytes * HEADROOM <= b.available
  ideas = []
  if layout.stage < 3 and fits(needed(stage=3)):
    ideas.append(f"zero.stage=3 (~{format_bytes(needed(stage=3))})")
  if estimated and cfg.remat.policy != "full" and fits(needed(policy="full")):
    ideas.append(f"remat.policy=full (~{format_bytes(needed(policy='full'))})")
  # ZeRO-Offload's host holds 12Φ/N for each of its processes' devices.
  host_holds = b.host_ram is None or (12 * phi / layout.shard_size * b.local_devices
                                      * b.host_processes * HEADROOM <= b.host_ram)
  offloadable = not cfg.lora.rank  # a LoRA run's adapters stay with their base
  if (offloadable and not cpu and cfg.offload.optimizer == "device" and host_holds
      and fits(needed(offload="pinned_host"))):
    ideas.append(f"offload.optimizer=pinned_host (~{format_bytes(needed(offload='pinned_host'))})")
  elif (offloadable and cfg.offload.optimizer != "nvme" and cfg.mesh.pipeline == 1
        and fits(needed(offload="nvme"))):  # (a pipeline keeps its optimizer in memory)
    ideas.append(f"offload.optimizer=nvme with offload.nvme_dir=PATH "
                 f"(~{format_bytes(needed(offload='nvme'))})")
  if micro > 1 and fits(needed(m=1)):
    ideas.append(f"micro-batch 1, i.e. train.grad_accum={cfg.train.grad_accum * micro} "
                 f"(~{format_bytes(needed(m=1))})")
  if ideas:
    return "what would fit: " + " or ".join(ideas)
  smallest = needed(stage=3, policy="full", m=1)
  how = "ZeRO-3 with remat.policy=full and micro-batch 1" if estimated else "ZeRO-3"
  already = (layout.stage, cfg.remat.policy, micro) == (3, "full", 1)
  if fits(smallest) and not already:  # no one change fits, all of them together do
    return f"what would fit: {how} (~{format_bytes(smallest)})"
  if cpu:
    return (f"nothing fits this host: even {how} "
            f"needs ~{format_bytes(smallest)} per device, the model state alone "
            f"{format_bytes((c + g + 12) * phi)} in all; train a smaller model here, or "
            + ("plan GPUs with jaxzero.plan --config ... --hbm-gb G" if estimated else
               "on GPUs (jaxzero.Engine(..., force=True).plan(batch) gives XLA's figure)"))
  # The devices each shard group has beside it (tensor, pipeline, context, replicas) stay.
  beside = max(1, b.devices // layout.shard_size)
  for n in (2 ** k for k in range(1, 17)):
    if n > layout.shard_size and fits(needed(stage=3, policy="full", m=1, n=n)):
      return (f"{how} would fit on {n * beside} such devices"
              + (f", each weight split {n} ways" if beside > 1 else "")
              + f" (~{format_bytes(needed(stage=3, policy='full', m=1, n=n))} each)")
  return f"even {how} needs ~{format_bytes(smallest)}"
