"""The plan of a ZeRO-Infinity run (offload.params=nvme): device, host and NVMe bytes,
the bytes each link moves per step, and a predicted step time.

The driver (jaxzero.runners.infinity) runs one jitted program at a time: before the
layer stack (`pre`, and its backward), one layer forward or backward, after the stack
(`post`, with its gradient), and the update of one chunk. Each is compiled here ahead
of time, from shapes and shardings only. A program's device bytes are XLA's own
memory analysis of it (arguments + outputs - aliased + temporaries); beside it the
device holds what the driver keeps there between programs: the activation checkpoints
of the layers run so far, the next layer's weights being put on the device, and the
previous layer's gradient still being written. The per-device figure is the largest
sum. XLA:CPU has no memory kinds, so nothing here depends on them: these are the
programs' own buffers, whatever backend compiles them (XLA:CPU also computes bf16
matmuls in f32, so its temporaries overstate a GPU's).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxzero.engine.state import dtype_of
from jaxzero.offload import nvme_store
from jaxzero.planning import planner, variants
from jaxzero.planning.flops import model_flops_per_token
from jaxzero.utils.formatting import format_bytes

# Defaults of the step-time prediction (jaxzero.plan's flags): dense bf16 at about 40%
# of an H100's peak, PCIe 5.0 x16 one way in practice, one datacenter NVMe drive.
DEFAULT_TFLOPS = 400.0
DEFAULT_PCIE_GBPS = 25.0
DEFAULT_DISK_GBPS = 6.0


@dataclasses.dataclass
class Program:
  """One program of the step, per device."""
  name: str
  runs_per_step: int
  program_bytes: int  # XLA's arguments + outputs - aliased + temporaries
  resident_bytes: int  # what the driver keeps on the device beside it

  @property
  def device_bytes(self) -> int:
    return self.program_bytes + self.resident_bytes


@dataclasses.dataclass
class InfinityPlan:
  """Per device (device bytes) or per process (host and NVMe), per step."""
  devices: int
  n_params: int
  micro_batch: int
  grad_accum: int
  seq_len: int
  programs: list[Program]
  device_bytes: int  # the largest program with what is resident beside it
  host_bytes: int  # the driver's host buffers (this process)
  nvme_bytes: int  # the store and the gradient sums (this process)
  nvme_read_bytes: int  # per step
  nvme_write_bytes: int
  host_to_device_bytes: int  # per step, per device
  device_to_host_bytes: int
  flops_per_device: float  # per step, with the recomputed forward
  seconds: dict[str, float]  # compute, pcie, disk: each alone at the given rates
  bound: str  # the largest of `seconds`
  predicted_step_s: float  # max(seconds): I/O overlapped with compute
  rates: dict[str, float]
  accounting: str = ""  # what the per-device figure is, in words


def plan(cfg, n_devices: int, tflops: float = DEFAULT_TFLOPS,
         pcie_gbps: float = DEFAULT_PCIE_GBPS, disk_gbps: float = DEFAULT_DISK_GBPS,
         tier=None) -> InfinityPlan:
  """The plan of `cfg` on `n_devices` devices: the default backend's where it is a GPU
  with that many, else virtual CPU devices (or of a built `tier`:
  jaxzero.runners.infinity.InfinityRunner, whose programs are then the ones compiled)."""
  if tier is None:
    tier = _tier(cfg, n_devices)
  engine, p = tier.program, tier.programs
  cfg, layout = engine.cfg, engine.layout
  n = layout.mesh.size
  micro = cfg.train.global_batch // cfg.train.grad_accum
  compute = np.dtype(dtype_of(cfg.precision.compute))
  grad_dtype = np.dtype(dtype_of(cfg.zero.grad_dtype))
  # One micro-batch as the runner feeds it: token windows, or a fine-tuning format's
  # dict (packed rows carry their segment ids and positions through the layers).
  batch = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=layout.batch_sharding()),
      engine.abstract_batch(micro // layout.data_parallel_size))
  outer = {leaf.name: _abstract(leaf.shape, compute, leaf.sharding)
           for leaf in tier.outer_leaves(tier.leaves)}
  pre_in = {name: outer[name] for name in p.outer_names("pre", batch)}
  post_in = {name: outer[name] for name in p.outer_names("post", batch)}
  layer_leaves = tier.layer_leaves(tier.leaves)
  weights = tier.nest({leaf.name: _abstract((1, *leaf.shape[1:]), compute, leaf.sharding)
                       for leaf in layer_leaves})
  pre = _compile(p.pre, pre_in, batch)
  carry, consts = _outputs(pre)
  forward = _compile(p.layer_forward, weights, carry, consts)
  post = _compile(p.post_grad, post_in, batch, carry)
  ct_carry = _outputs(post)[-1][-1]  # (float0 for a carry's integer leaves)
  ct_consts = p.float_consts(consts)
  backward = _compile(p.layer_backward, weights, carry, consts, ct_carry)
  pre_back = _compile(p.pre_backward, pre_in, batch, ct_carry, ct_consts)

  layer_weights = sum(_local_bytes(a) for a in jax.tree.leaves(weights))
  layer_grads = layer_weights // compute.itemsize * grad_dtype.itemsize
  L = tier.n_layers
  checkpoints = (L * sum(_local_bytes(a) for a in jax.tree.leaves(carry))
                 + sum(_local_bytes(c) for c in consts))
  A = cfg.train.grad_accum
  programs = [
      Program("pre (embedding)", A, _bytes(pre), 0),
      Program("layer forward", A * L, _bytes(forward), checkpoints + layer_weights),
      Program("post (head, loss, gradient)", A, _bytes(post), checkpoints),
      Program("layer backward", A * L, _bytes(backward),
              checkpoints + layer_weights + layer_grads),
      Program("pre backward", A, _bytes(pre_back), 0),
  ]
  largest = max(tier.leaves, key=lambda leaf: leaf.local_bytes // len(leaf.starts()))
  update = _update_program(tier, largest)
  programs.append(Program(f"update, one chunk ({largest.name})",
                          sum(len(leaf.starts()) for leaf in tier.leaves), _bytes(update), 0))

  # The links, per step and device. The weights go to the device in the compute
  # dtype: the outer ones read by each side of the cut, and every layer twice;
  # gradients come back in grad_dtype; the update moves each chunk and gradient in,
  # and the new chunk out.
  outer_in = sum(_local_bytes(a) for a in (*pre_in.values(), *pre_in.values(),
                                           *post_in.values()))
  local = len(layout.mesh.local_devices)
  state_local = sum(leaf.local_bytes for leaf in tier.leaves) // local
  master_local = sum(leaf.local_bytes // len(leaf.kinds) for leaf in tier.leaves) // local
  to_device = A * (outer_in + 2 * L * layer_weights) + state_local + master_local
  to_host = A * (master_local // 4 * grad_dtype.itemsize) + state_local
  tokens = cfg.train.global_batch * cfg.train.seq_len
  flops = model_flops_per_token(cfg, engine.n_params) * tokens * 4 / 3 / n
  io = tier.io_bytes
  seconds = {"compute": flops / (tflops * 1e12),
             "pcie": max(to_device, to_host) / (pcie_gbps * 1e9),
             "disk": (io["read"] + io["written"]) / (disk_gbps * 1e9)}
  bound = max(seconds, key=seconds.get)
  # The host holds the outer weights through the step, a layer's weights being cast (and
  # the next one's), and the store's buffers: a layer's chunks read ahead, and the
  # update's chunks in flight each way.
  chunks_per_layer = sum(len(leaf.starts()) // L for leaf in layer_leaves)
  host = (local * (sum(_local_bytes(a) for a in outer.values()) + 2 * layer_weights)
          + (chunks_per_layer + 2 * nvme_store.IN_FLIGHT) * nvme_store.CHUNK_BYTES)
  return InfinityPlan(
      devices=n, n_params=engine.n_params, micro_batch=micro, grad_accum=A,
      seq_len=cfg.train.seq_len, programs=programs,
      device_bytes=max(prog.device_bytes for prog in programs), host_bytes=host,
      nvme_bytes=tier.bytes_needed(), nvme_read_bytes=io["read"], nvme_write_bytes=io["written"],
      host_to_device_bytes=to_device, device_to_host_bytes=to_host, flops_per_device=flops,
      seconds=seconds, bound=bound, predicted_step_s=seconds[bound],
      rates={"tflops": tflops, "pcie_gbps": pcie_gbps, "disk_gbps": disk_gbps},
      accounting=(f"XLA:{layout.mesh.devices.flat[0].platform.upper()}'s memory analysis of each "
                  "program, plus what the driver keeps on the device beside it; no memory kinds "
                  "are involved: every buffer counted is a device buffer"))


def _tier(cfg, n_devices: int):
  from jaxzero.engine import TrainProgram  # pylint: disable=import-outside-toplevel
  from jaxzero.config.builtin_model import builtin_model  # pylint: disable=import-outside-toplevel
  from jaxzero.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from jaxzero.parallel.zero import Layout  # pylint: disable=import-outside-toplevel
  from jaxzero.runners.choose import make_runner  # pylint: disable=import-outside-toplevel

  # On a GPU with the devices asked for, the programs are XLA:GPU's: the ones that run.
  local = jax.local_devices()
  if jax.default_backend() != "cpu" and len(local) >= n_devices:
    devices = local[:n_devices]
  else:
    cfg, devices = variants.for_cpu(cfg)[0], variants.cpu_devices(n_devices)
  mesh = mesh_lib.mesh_for(cfg.mesh, devices)
  program = TrainProgram(cfg, Layout.from_config(cfg, mesh), builtin_model(cfg))
  # Planned only: nothing is opened or written under the store's directory.
  return make_runner(program, check=False)


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _local_bytes(a) -> int:
  """Bytes of one device's shard of `a` (an abstract or real array)."""
  shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) else a.shape
  return int(np.prod(shape)) * np.dtype(a.dtype).itemsize


def _compile(fn, *args):
  lowered = fn.lower(*args)
  if jax.default_backend() != "cpu":  # planned on the GPU: compiled exactly as the run does
    return lowered.compile()
  try:
    return lowered.compile(compiler_options=planner.MEMORY_COMPILE_OPTIONS)
  except jax.errors.JaxRuntimeError as e:
    if "No such compile option" not in str(e):
      raise
    return lowered.compile()


def _bytes(compiled) -> int:
  return planner.xla_total_bytes(compiled.memory_analysis())


def _outputs(compiled):
  """The compiled program's outputs as abstract arrays with their shardings."""
  shapes = compiled.out_info
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, compiled.output_shardings)


def _update_program(tier, leaf):
  """The update of one chunk of `leaf`, compiled from shapes."""
  replicated = tier.program.layout.replicated()
  grad = dataclasses.replace(leaf, kinds=("grad",))
  args = (_abstract((1, *leaf.chunk), np.float32, grad.chunk_sharding),
          _abstract((len(leaf.kinds), *leaf.chunk), np.float32, leaf.chunk_sharding),
          tier.abstract_scalars(), _abstract((), np.float32, replicated),
          _abstract((), np.float32, replicated))
  return _compile(tier._chunk_unit(leaf), *args)


def format_text(plan_: InfinityPlan, title: str) -> str:
  gb = format_bytes
  lines = [title,
           f"ZeRO-Infinity (offload.params=nvme): Φ = {plan_.n_params / 1e9:.2f} B parameters "
           f"on {plan_.devices} device(s); micro-batch {plan_.micro_batch} x {plan_.seq_len} "
           f"tokens (over all devices), grad_accum {plan_.grad_accum}",
           f"per device: {gb(plan_.device_bytes)} ({plan_.accounting})", ""]
  width = max(len(prog.name) for prog in plan_.programs)
  lines.append(f"{'program':{width}}  runs/step  program  + resident  = device")
  for prog in plan_.programs:
    lines.append(f"{prog.name:{width}}  {prog.runs_per_step:9d}  {gb(prog.program_bytes):>7}  "
                 f"{gb(prog.resident_bytes):>10}  {gb(prog.device_bytes):>8}")
  r = plan_.rates
  lines += ["",
            f"host (this process): {gb(plan_.host_bytes)}; NVMe: {gb(plan_.nvme_bytes)}",
            f"per step: NVMe read {gb(plan_.nvme_read_bytes)}, written "
            f"{gb(plan_.nvme_write_bytes)}; host->device {gb(plan_.host_to_device_bytes)}, "
            f"device->host {gb(plan_.device_to_host_bytes)} per device; "
            f"{plan_.flops_per_device / 1e12:.1f} TFLOP per device (with the recomputed forward)",
            f"predicted step: {plan_.predicted_step_s:.1f} s, {plan_.bound}-bound (compute "
            f"{plan_.seconds['compute']:.1f} s at {r['tflops']:g} TFLOP/s, PCIe "
            f"{plan_.seconds['pcie']:.1f} s at {r['pcie_gbps']:g} GB/s, disk "
            f"{plan_.seconds['disk']:.1f} s at {r['disk_gbps']:g} GB/s; each overlapped with "
            "the others)"]
  if plan_.accounting.startswith("XLA:CPU"):
    lines.append("note: XLA's CPU compiler computes bf16 matmuls in fp32: a GPU's temporaries "
                 "are smaller")
  return "\n".join(lines)


def as_json(plan_: InfinityPlan) -> dict:
  out = dataclasses.asdict(plan_)
  out["programs"] = [dict(dataclasses.asdict(prog), device_bytes=prog.device_bytes)
                     for prog in plan_.programs]
  return out
