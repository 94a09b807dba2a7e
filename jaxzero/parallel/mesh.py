"""The named device mesh ``(replica, fsdp, tensor)``, with ``pipeline`` after
``replica`` and ``context`` before ``tensor`` when they are larger than 1: how many
devices, their shape and order, the batch arithmetic over them, and virtual CPU
devices for laptops.

``replica`` and ``fsdp`` are the data axes: the batch is split over them and
ZeRO shards the state over them. ``tensor`` is innermost (it stays inside a
host, on NVLink): Megatron-style tensor and sequence parallelism (zero.py).
``pipeline`` (present only when larger than 1) splits the layer stack into stages
(jaxzero.parallel.pipeline); it lies outside ``fsdp``, so that stages span hosts and
only activations cross the slower links. ``context`` (present only when larger than 1)
splits every activation's sequence; its devices share their rows of the batch, and
ZeRO shards the state over it as over the data axes (jaxzero.parallel.zero). It lies
inside ``fsdp``, next to ``tensor``: attention gathers keys and values over it every
layer.

Importing this module does not start JAX, so the command-line tools can ask
for virtual devices first.
"""

from __future__ import annotations

import math
import os

from jaxzero.errors import ConfigError

AXES = ("replica", "fsdp")  # the data-parallel axes
TENSOR = "tensor"
PIPELINE = "pipeline"
CONTEXT = "context"
MESH_AXES = (*AXES, TENSOR)
DEFAULT_DEVICES = 8  # one GPU node, when a mesh takes "all remaining" devices
ENV_CPU_DEVICES = "JAX_NUM_CPU_DEVICES"


def use_virtual_cpu_devices(n: int, *, exact: bool = False) -> None:
  """Asks JAX for `n` host (CPU) devices (at least `n`, unless `exact`); has
  effect only before JAX starts.

  This is the one way jaxzero makes virtual devices: JAX's
  ``jax_num_cpu_devices`` option (``JAX_NUM_CPU_DEVICES`` in the environment,
  which is how ``jaxzero.launch`` gives each process its own). It only affects
  the CPU platform, so on a GPU machine it is harmless. Once JAX's backends
  run the count is fixed; the mesh then reports any shortfall by name.
  """
  import jax  # pylint: disable=import-outside-toplevel
  current = jax.config.jax_num_cpu_devices
  if current == n or (not exact and (n <= 1 or current >= n)):
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # backends already started: the devices are what they are
    pass


def devices_needed(mesh_cfg) -> int:
  """Devices a MeshConfig asks for, or 0 when it takes 'all remaining'."""
  replica, fsdp = mesh_cfg.replica, mesh_cfg.fsdp
  return (replica * fsdp * _inner(mesh_cfg) if replica > 0 and fsdp > 0 else 0)


def _inner(mesh_cfg) -> int:
  """Devices per data-parallel position: tensor x pipeline x context."""
  return mesh_cfg.tensor * mesh_cfg.pipeline * mesh_cfg.context


def data_parallel_needed(mesh_cfg) -> int:
  """Data-parallel devices (replica x fsdp) a MeshConfig asks for, or 0 for 'all remaining'."""
  return devices_needed(mesh_cfg) // _inner(mesh_cfg)


def devices_for(mesh_cfg, environ=None) -> int:
  """The device count a mesh means for jaxzero.plan, and for jaxzero.train on CPU.

  ``jaxzero.train`` and ``jaxzero.plan`` resolve ``mesh.fsdp=-1`` (or
  ``mesh.replica=-1``) through this, so the two agree: the mesh's own size when
  it names one; else ``JAX_NUM_CPU_DEVICES`` when set (as ``jaxzero.launch``
  sets it per process); else DEFAULT_DEVICES, one GPU node. On a GPU machine
  training takes every GPU instead (JAX's device count).
  """
  environ = os.environ if environ is None else environ
  needed = devices_needed(mesh_cfg)
  if needed:
    return needed
  text = environ.get(ENV_CPU_DEVICES, "").strip()
  return int(text) if text.isdigit() and int(text) > 0 else DEFAULT_DEVICES


def use_cpu_devices_for(mesh_cfg) -> None:
  """Before JAX starts: as many virtual CPU devices as the mesh means (harmless on GPUs)."""
  use_virtual_cpu_devices(devices_for(mesh_cfg))


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def resolve_shape(mesh_cfg, n_devices: int) -> tuple[int, int, int]:
  """(replica, fsdp, tensor) for `n_devices`, resolving -1; raises if they do not fit."""
  replica, fsdp, tensor = mesh_cfg.replica, mesh_cfg.fsdp, mesh_cfg.tensor
  for key, size in (("mesh.tensor", tensor), ("mesh.pipeline", mesh_cfg.pipeline),
                    ("mesh.context", mesh_cfg.context)):
    if n_devices % size:
      raise ConfigError(f"{key}={size} does not divide the {n_devices} devices; "
                        f"valid values: {', '.join(map(str, divisors(n_devices)))}")
  if n_devices % _inner(mesh_cfg):
    raise ConfigError(f"mesh.tensor={tensor} x mesh.pipeline={mesh_cfg.pipeline} x "
                      f"mesh.context={mesh_cfg.context} does not divide the {n_devices} devices")
  n_data = n_devices // _inner(mesh_cfg)
  if replica == -1:
    replica = n_data // fsdp if n_data % fsdp == 0 else 0
  if fsdp == -1:
    fsdp = n_data // replica if n_data % replica == 0 else 0
  if replica * fsdp != n_data or replica < 1 or fsdp < 1:
    tensor_part = (f" x mesh.tensor={tensor}" if tensor > 1 else "") + (
        f" x mesh.pipeline={mesh_cfg.pipeline}" if mesh_cfg.pipeline > 1 else "") + (
        f" x mesh.context={mesh_cfg.context}" if mesh_cfg.context > 1 else "")
    raise ConfigError(
        f"mesh.replica={mesh_cfg.replica} x mesh.fsdp={mesh_cfg.fsdp}{tensor_part} does not fit "
        f"{n_devices} devices; the product must equal the device count (use -1 for 'all "
        f"remaining')")
  return replica, fsdp, tensor


def micro_batch(train_cfg, n_data_parallel: int) -> int:
  """Per-device micro-batch, from global_batch = micro x data-parallel devices x grad_accum."""
  per_step = n_data_parallel * train_cfg.grad_accum
  if train_cfg.global_batch % per_step:
    raise ConfigError(
        f"train.global_batch={train_cfg.global_batch} is not divisible by data-parallel devices "
        f"({n_data_parallel}) x train.grad_accum ({train_cfg.grad_accum}) = {per_step}; "
        f"global_batch = micro_batch x devices x grad_accum, so use a multiple of {per_step}")
  return train_cfg.global_batch // per_step


def mesh_for(mesh_cfg, devices):
  """The mesh a MeshConfig asks for over `devices` (resolving -1); raises if it does
  not fit them."""
  replica, fsdp, tensor = resolve_shape(mesh_cfg, len(devices))
  return make_mesh(replica, fsdp, devices, tensor, mesh_cfg.pipeline, mesh_cfg.context)


def make_mesh(replica: int, fsdp: int, devices=None, tensor: int = 1, pipeline: int = 1,
              context: int = 1):
  """A mesh ``(replica, fsdp, tensor)``, with ``pipeline`` after ``replica`` and
  ``context`` before ``tensor`` where they are larger than 1, over `devices` (default:
  all), ordered by the hardware's topology.

  ``jax.make_mesh`` puts devices that share the fast links (a node's NVLink)
  next to each other along the innermost axes, ``tensor`` then ``fsdp``. A
  tensor group must lie inside one process (its collectives run every layer);
  one that would span processes is an error. Axes are Auto: XLA's sharding
  propagation decides the layouts between our annotations.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import AxisType  # pylint: disable=import-outside-toplevel

  devices = list(jax.devices() if devices is None else devices)
  axes = [(AXES[0], replica), (PIPELINE, pipeline), (AXES[1], fsdp), (CONTEXT, context),
          (TENSOR, tensor)]
  names, shape = zip(*[(n, size) for n, size in axes if size > 1 or n in MESH_AXES])
  if math.prod(shape) != len(devices):
    raise ConfigError(f"mesh {'x'.join(map(str, shape))} needs {math.prod(shape)} devices, "
                      f"got {len(devices)}")
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)
  check_tensor_groups(mesh.devices.reshape(-1, tensor))
  return mesh


def spec_per_dimension(sharding, ndim: int) -> tuple:
  """A NamedSharding's PartitionSpec entries, one per dimension of a rank-`ndim`
  array: a spec may end early, and the dimensions past its end are unsplit."""
  return tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))


def axes_per_dimension(sharding, ndim: int) -> tuple[tuple[str, ...], ...]:
  """The mesh axes that split each dimension of a rank-`ndim` array (() where none)."""
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
               for e in spec_per_dimension(sharding, ndim))


def check_tensor_groups(groups) -> None:
  """Raises ConfigError when a tensor group (a row of `groups`, devices with a
  ``process_index``) spans processes: its collectives run every layer."""
  processes = [[d.process_index for d in group] for group in groups]
  if all(len(set(p)) == 1 for p in processes):
    return
  per_process = {}
  for p in (i for group in processes for i in group):
    per_process[p] = per_process.get(p, 0) + 1
  local = min(per_process.values())
  raise ConfigError(f"mesh.tensor={len(processes[0])} would span processes (a tensor group must "
                    f"stay inside one process of {local} devices); valid values: "
                    f"{', '.join(map(str, divisors(local)))}")
