"""Host memory and cores for offloading, set up before the backend starts: XLA's pinned
host pool, and a CPU device per core for the host's update.

On a GPU, what a jitted program places in ``pinned_host`` memory comes from one pool
(``xla_gpu_host_bfc``), 64 GiB unless ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` says otherwise
when the backend starts. jaxzero puts there the stage-3 weights of
``offload.params=pinned_host`` (with their gradients on the way back) and the
activations of ``remat.policy=offload_matmuls``; the optimizer state of
``offload.optimizer=pinned_host`` lives in the host runner's own memory, not in the pool.
:func:`size_for_run` sets the variable from the run's needs, :func:`size_for_host` (for a
library user, whose model is not known yet) from the host's RAM; a value the user set
always wins, and the pool is never made smaller than XLA's default. The pool is a limit:
XLA takes host memory from it as the program needs it.
"""

from __future__ import annotations

import math
import os

from jaxzero.runtime import memory, xla_flags

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # in GiB, whatever its name: XLA multiplies by 2**30
GIB = 1 << 30
XLA_DEFAULT_GB = 64
ROOM = 1.25  # over the estimate: XLA's own buffers in the pool, fragmentation


def run_bytes(cfg, local_devices: int) -> int:
  """What one process of `cfg`'s run places in pinned_host (the Llama family's;
  0 for a model_factory model, whose size is not known before it is built)."""
  if cfg.model_factory:
    return 0
  from jaxzero.models.llama import count_params  # pylint: disable=import-outside-toplevel
  from jaxzero.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  m, t = cfg.model, cfg.train
  phi = count_params(m)
  compute = 4 if cfg.precision.compute == "float32" else 2
  grad = 4 if cfg.zero.grad_dtype == "float32" else 2
  _, hybrid = cfg.zero.resolved
  # The devices a weight is split over: the data axes, fsdp alone under HYBRID_SHARD (a
  # size of -1 is not known yet: counted as 1, so the pool is larger than needed).
  shards = max(1, cfg.mesh.fsdp if hybrid else mesh_lib.data_parallel_needed(cfg.mesh))
  needed = 0
  if cfg.offload.params == "pinned_host":  # the weights, and a micro-step's gradient
    copies = 2 if cfg.offload.delayed_update else 1  # DPU: the copy its update writes
    needed += (copies * compute + grad) * phi // shards * local_devices
  if cfg.remat.policy == "offload_matmuls":
    data = max(1, mesh_lib.data_parallel_needed(cfg.mesh))
    rows = max(1, t.global_batch // (t.grad_accum * data))
    needed += offloaded_matmul_bytes(cfg, rows) * local_devices
  return needed


def offloaded_matmul_bytes(cfg, rows: int) -> int:
  """Per device: the matmul outputs remat.policy=offload_matmuls keeps in pinned_host
  during a step, for micro-batches of `rows` rows: each of the device's layers' (over the
  mesh's split of tokens, layers and heads), as many sets as its pipeline stage keeps
  for its backward (GPipe: every tick's; interleaved: one chunk's;
  jaxzero.parallel.pipeline.kept_for_backward)."""
  from jaxzero.parallel.pipeline import kept_for_backward  # pylint: disable=import-outside-toplevel
  m, t, mesh = cfg.model, cfg.train, cfg.mesh
  compute = 4 if cfg.precision.compute == "float32" else 2
  kv = 2 * m.n_kv_heads * (m.dim // m.n_heads)
  held = kept_for_backward(mesh.pipeline, t.grad_accum, cfg.pipeline.schedule,
                           cfg.pipeline.virtual_stages)[0] if mesh.pipeline > 1 else 1
  # q, k, v, gate and up are split over mesh.tensor by heads and MLP columns; o's and
  # down's outputs by the sequence (sequence parallelism) where mesh.context does not split
  # it and mesh.tensor divides it (jaxzero.parallel.zero's Layout.activation_spec).
  sequence_parallel = mesh.context == 1 and t.seq_len % mesh.tensor == 0
  per_token = ((m.dim + kv + 2 * m.mlp_dim) / mesh.tensor
               + 2 * m.dim / (mesh.tensor if sequence_parallel else 1))
  return int(rows * t.seq_len // mesh.context * (m.n_layers // mesh.pipeline) * held
             * per_token * compute)


def size_for_run(cfg, local_devices: int, environ=os.environ) -> int | None:
  """Sets the pool for `cfg`'s run where a GPU will be used; returns the GB set, or None
  where the user set it, no GPU is used, or XLA's default holds the run."""
  return _size(math.ceil(run_bytes(cfg, local_devices) * ROOM / GIB), environ)


def limit_bytes(environ=os.environ) -> int:
  """The pool's size where the backend starts with `environ`."""
  text = environ.get(ENV, "").strip()
  return (int(text) if text.isdigit() else XLA_DEFAULT_GB) * GIB


def size_for_host(environ=os.environ) -> int | None:
  """Sets the pool to most of the host's RAM where a GPU will be used (a library user's
  model is not known before the backend starts); returns the GB set, or None."""
  return _size(_ram_gb(), environ)


def use_host_cores(environ=os.environ) -> None:
  """Where a GPU will be used: a CPU device per core, on which the host runner spreads its
  update (XLA:CPU runs one program at a time per device). The CPU devices are nothing
  else's on a GPU machine; on a CPU machine they are the mesh's, and left as they are."""
  if xla_flags.gpu_will_be_used(environ):
    from jaxzero.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
    mesh_lib.use_virtual_cpu_devices(os.cpu_count() or 1)


def _size(gb: int, environ) -> int | None:
  if ENV in environ or not xla_flags.gpu_will_be_used(environ):
    return None
  gb = min(gb, _ram_gb())
  if gb <= XLA_DEFAULT_GB:
    return None
  environ[ENV] = str(gb)
  return gb


def _ram_gb() -> int:
  """The most of the host's RAM the pool may take, in whole GiB."""
  return memory.host_ram_bytes() * 9 // 10 // GIB
