"""Benchmark of ZeRO-Infinity (offload.params=nvme with offload.optimizer=nvme) on one
device: a model whose training state is larger than the machine's RAM.

    python scripts/infinity_bench.py --nvme-dir DIR [--dim 3072 --layers 28 --mlp 8192
        --heads 24 --kv-heads 8 --vocab 128256 --seq 128 --steps 3] [--untied]

The defaults are Llama-3.2-3B's shape (tied embeddings, as it has). Its state, 16 bytes a
parameter (fp32 master, Adam's two moments and the gradient sum; the compute copy is never
stored), lives in DIR; stage 3, bf16 compute and gradients (summed in fp32 on disk), AdamW
at lr 1e-5. Its random weights are
drawn chunk by chunk (normal(0, init_std) with numpy: TrainProgram.init would draw each stacked
weight whole). Every step trains on the same batch, 1 x --seq tokens of the Python standard
library, so that the losses show the optimizer at work, not one batch against another.
Prints progress, then one JSON line:

* ``state_bytes``: the training state (16 bytes a parameter); ``peak_rss_bytes``: the
  process's peak RSS (``ru_maxrss``) over everything it did, initialisation included;
* ``losses`` and ``step_s`` of each step (the first compiles the programs);
* ``nvme_read_bytes_per_step`` and ``nvme_write_bytes_per_step``: what a step reads and
  writes in DIR (the tier's own count, jaxzero.runners.infinity);
* ``sequential_read_gbps`` and ``sequential_write_gbps``: the disk's own bandwidth in DIR,
  measured in this run (one O_DIRECT stream of 16 MiB blocks, as scripts/nvme_bench.py);
* ``io_alone_s``: a measured pass of the step's reads and writes through the tier's
  store, with nothing computed (each layer's masters read twice, the gradients written,
  the optimizer's chunks read with their gradients and written back);
* ``compute_alone_s``: the step's programs with nothing read or written: one layer's
  weights, already in memory, run through every layer forward and backward, and the
  update's program run on resident chunks as many times as a step runs it;
* ``overlap_efficiency`` = max(io_alone_s, compute_alone_s) / the mean time of the steps
  after the first: 1 where I/O and compute overlap perfectly;
* ``plan_device_bytes``, ``plan_predicted_step_s``, ``plan_bound``: jaxzero.plan's figures
  for this run (jaxzero.planning.infinity_plan), the step predicted at this run's measured
  disk bandwidth, --tflops and --pcie-gbps (on a CPU the latter two mean nothing);
* ``peak_device_bytes``: on a GPU, the device's own peak (``memory_stats``); null on a CPU,
  whose device memory is the process's RSS. Cap a GPU below the model's state with
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (e.g. 0.15 of an 80 GB H100: 12 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from nvme_bench import (BLOCK, peak_rss,  # noqa: E402  pylint: disable=wrong-import-position
                        sequential_gbps)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--nvme-dir", required=True, help="a directory on the disk to use")
  parser.add_argument("--dim", type=int, default=3072)
  parser.add_argument("--layers", type=int, default=28)
  parser.add_argument("--mlp", type=int, default=8192)
  parser.add_argument("--heads", type=int, default=24)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=128256)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--untied", action="store_true", help="a separate output head")
  parser.add_argument("--tflops", type=float, default=400.0,
                      help="the device's TFLOP/s for the plan's predicted step (default 400)")
  parser.add_argument("--pcie-gbps", type=float, default=25.0,
                      help="host<->device GB/s for the plan's predicted step (default 25)")
  parser.add_argument("--seq-gb", type=float, default=4.0,
                      help="GB written and read to measure the disk's sequential bandwidth")
  args = parser.parse_args(argv)
  if args.steps < 2 or args.seq_gb * 1e9 < BLOCK:
    parser.error(f"--steps must be >= 2 and --seq-gb at least {BLOCK / 1e9:.3f} (one block)")
  # SIGTERM (a scheduler's, or kill) exits through the clean-up below, as an error does.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  from jaxzero.parallel import mesh  # pylint: disable=import-outside-toplevel
  mesh.use_virtual_cpu_devices(1)
  from jaxzero import cli  # pylint: disable=import-outside-toplevel
  return cli.run_main("infinity_bench.py", lambda: bench(args))


def bench(args) -> int:
  """The benchmark; a bad --nvme-dir, or one without room, is one line (exit 2)
  before anything is written; whatever it wrote is deleted, also after an error."""
  import jax  # pylint: disable=import-outside-toplevel

  from jaxzero import config, errors  # pylint: disable=import-outside-toplevel
  from jaxzero.offload import targets as offload_targets  # pylint: disable=import-outside-toplevel
  from jaxzero.offload import nvme_store  # pylint: disable=import-outside-toplevel
  from jaxzero.training import loop  # pylint: disable=import-outside-toplevel

  nvme_dir = pathlib.Path(args.nvme_dir).expanduser()
  sets = [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.mlp_dim={args.mlp}",
          f"model.n_heads={args.heads}", f"model.n_kv_heads={args.kv_heads}",
          f"model.vocab_size={args.vocab}", f"model.tie_embeddings={not args.untied}",
          "mesh.fsdp=1", "zero.stage=3", "train.global_batch=1", "train.grad_accum=1",
          f"train.seq_len={args.seq}", f"train.steps={args.steps}", "precision.compute=bfloat16",
          "zero.grad_dtype=bfloat16",
          "remat.policy=full", "train.lr=1e-5", "train.warmup_steps=0", "data.max_bytes=1000000",
          "offload.optimizer=nvme", "offload.params=nvme", f"offload.nvme_dir={nvme_dir}"]
  cfg = config.load(str(ROOT / "configs" / "tiny_zero3.py"), sets)
  devices = jax.devices()[:1]
  offload_targets.check_offload(cfg, devices)
  seq_size = int(args.seq_gb * 1e9) // BLOCK * BLOCK
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxzero-infinity-bench-", dir=nvme_dir))
  run = None
  try:
    # The benchmark checks the room itself: the state and the disk measurement.
    run = loop.build(cfg, devices, workdir, progress=False,
                     runner=loop.prepare(cfg, devices, workdir, check=False))
    tier = run.runner
    store = nvme_store.bytes_needed(tier.leaves) + nvme_store.bytes_needed(tier.grad_leaves)
    needed, free = store + seq_size, shutil.disk_usage(nvme_dir).free
    if free < needed:
      raise errors.PathError(
          f"--nvme-dir {nvme_dir} has {free / 1e9:.1f} GB free; the benchmark needs about "
          f"{needed / 1e9:.1f} GB (the state {store / 1e9:.1f} GB, measuring the disk "
          f"{seq_size / 1e9:.1f} GB): free space, lower --seq-gb or choose another directory")
    return measure(args, nvme_dir, run, seq_size)
  finally:
    try:
      if run is not None:
        run.runner.close()  # waits for the writes in flight, deletes the store's files
    finally:  # also when the store failed part way, or a write did
      for directory in ([run.runner.directory.parent] if run is not None else []) + [workdir]:
        shutil.rmtree(directory, ignore_errors=True)


def measure(args, nvme_dir: pathlib.Path, run, seq_size: int) -> int:
  """Measures the disk, initialises, trains, times I/O and compute alone; prints."""
  from jaxzero.planning import memory_check  # pylint: disable=import-outside-toplevel

  tier = run.runner
  phi = run.program.n_params
  print(f"model: {phi / 1e9:.3f} B parameters; state 16 bytes x {phi:,} = {16 * phi / 1e9:.1f} GB "
        f"in {nvme_dir}; {memory_check.host_memory_bytes() / 1e9:.1f} GB of RAM", flush=True)
  seq_write, seq_read = sequential_gbps(nvme_dir, seq_size)
  print(f"disk, sequential: write {seq_write:.2f} GB/s, read {seq_read:.2f} GB/s", flush=True)
  start = time.perf_counter()
  state = tier.init(boxes=random_boxes(run.cfg))
  tier.store.writes.wait()
  print(f"init: {time.perf_counter() - start:.0f} s, peak RSS {peak_rss() / 1e9:.2f} GB",
        flush=True)
  step_fn = tier.compile(state, run.batch(0))
  losses, step_s = [], []
  for step in range(args.steps):
    start = time.perf_counter()
    state, metrics = step_fn(state, run.batch(0))  # one batch: the loss shows the optimizer
    tier.store.writes.wait()
    step_s.append(time.perf_counter() - start)
    losses.append(float(metrics["loss"]))
    print(f"step {step + 1}: loss {losses[-1]:.4f}, {step_s[-1]:.1f} s, peak RSS "
          f"{peak_rss() / 1e9:.2f} GB", flush=True)
  io_s = io_alone(tier)
  print(f"I/O alone: {io_s:.1f} s", flush=True)
  compute_alone(tier, state, run.batch(0))  # once to warm up, then measured
  compute_s = compute_alone(tier, state, run.batch(0))
  print(f"compute alone: {compute_s:.1f} s", flush=True)
  steady = sum(step_s[1:]) / len(step_s[1:])
  # The plan's figures for the same run: its device bytes, and its step predicted at this
  # run's measured disk bandwidth (compute at --tflops, PCIe at --pcie-gbps).
  from jaxzero.planning import infinity_plan  # pylint: disable=import-outside-toplevel
  planned = infinity_plan.plan(run.cfg, 1, args.tflops, args.pcie_gbps,
                               2 / (1 / seq_read + 1 / seq_write), tier=tier)
  device = run.devices[0]
  peak_device = (device.memory_stats() or {}).get("peak_bytes_in_use") \
      if device.platform != "cpu" else None
  result = {
      "machine": f"{platform.node()} ({os.cpu_count()} CPUs, "
                 f"{memory_check.host_memory_bytes() / 2**30:.0f} GiB RAM), {platform.platform()}",
      "shape": {k: getattr(args, k) for k in ("dim", "layers", "mlp", "heads", "kv_heads", "vocab",
                                              "seq")},
      "params": phi, "state_bytes": 16 * phi, "peak_rss_bytes": peak_rss(),
      "ram_bytes": memory_check.host_memory_bytes(), "losses": losses, "step_s": step_s,
      "nvme_read_bytes_per_step": tier.io_bytes["read"],
      "nvme_write_bytes_per_step": tier.io_bytes["written"],
      "sequential_read_gbps": seq_read, "sequential_write_gbps": seq_write,
      "io_alone_s": io_s, "compute_alone_s": compute_s,
      "overlap_efficiency": max(io_s, compute_s) / steady,
      "plan_device_bytes": planned.device_bytes, "plan_predicted_step_s": planned.predicted_step_s,
      "plan_bound": planned.bound, "peak_device_bytes": peak_device,
  }
  print(json.dumps(result))
  return 0


def random_boxes(cfg):
  """Draws the Llama's weights box by box with numpy: normal(0, init_std), norm
  weights ones. (TrainProgram.init draws each stacked weight whole, with three times its
  size in random bits: 8.5 GB for this shape's largest.)"""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxzero.checkpoint import integrity  # pylint: disable=import-outside-toplevel
  from jaxzero.models import llama  # pylint: disable=import-outside-toplevel

  specs = {integrity.leaf_name(path): spec for path, spec in jax_tree_with_path(
      llama.param_specs(cfg.model), llama.is_param_spec)}
  rng = np.random.default_rng(cfg.seed)

  def draw(name, box):
    shape, kind = [b - a for a, b in box], specs[name].init
    if kind != "normal":
      return (np.ones if kind == "ones" else np.zeros)(shape, np.float32)
    return rng.standard_normal(shape, np.float32) * np.float32(cfg.model.init_std)

  return draw


def jax_tree_with_path(tree, is_leaf):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]


def io_alone(tier) -> float:
  """Seconds of one step's reads and writes through the store, nothing computed. The
  gradients are written as zeros (the next step overwrites them before reading them)
  and the optimizer's chunks written back as read."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxzero.offload import nvme_chunks, nvme_store  # pylint: disable=import-outside-toplevel

  store, grads = tier.store, tier.grad_store
  layers = tier.layer_leaves(tier.leaves)
  outer = tier.outer_leaves(tier.leaves)
  start = time.perf_counter()
  _Read(store, outer, None).result()
  for order in (range(tier.n_layers), reversed(range(tier.n_layers))):
    for _ in nvme_store.prefetched(order, lambda i: _Read(store, layers, i), depth=1):
      pass
  for leaf in tier.grad_leaves:
    for region in leaf.regions:
      for starts in leaf.starts():
        box = leaf.chunk_box(region, starts)
        grads.write(leaf, region, starts, np.zeros((1, *(b - a for a, b in box)), np.float32))
  units = [(leaf, g, s) for leaf, g in zip(tier.leaves, tier.grad_leaves) for s in leaf.starts()]

  def read(unit):
    leaf, g, starts = unit
    return nvme_chunks.All([store.read(leaf, r, starts) for r in leaf.regions]
                + [grads.read(g, r, starts) for r in g.regions])

  grads.writes.wait()
  for (leaf, _, starts), chunks in nvme_store.prefetched(units, read):
    for region, chunk in zip(leaf.regions, chunks):
      store.write(leaf, region, starts, chunk)
  store.writes.wait()
  return time.perf_counter() - start


class _Read:
  """Reads the master copies of `leaves` (of one layer), waited for on `result()`."""

  def __init__(self, store, leaves, layer):
    self._futures = [store.read(leaf, r, s, copies=1) for leaf in leaves for r in leaf.regions
                     for s in leaf.starts() if layer is None or s[0] == layer]

  def result(self):
    return [f.result() for f in self._futures]


def compute_alone(tier, state, batch_Ax) -> float:
  """Seconds of one step's programs with their inputs resident (see the docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  p = tier.programs
  outer = tier.read_weights(tier.outer_leaves(tier.leaves), None).result()
  batch = jax.tree.map(lambda x: x[0], batch_Ax)
  pre_in, post_in = ({n: outer[n] for n in p.outer_names(side, batch)} for side in ("pre", "post"))
  weights = tier.read_weights(tier.layer_leaves(tier.leaves), 0).result()
  units = [(leaf, g, s) for leaf, g in zip(tier.leaves, tier.grad_leaves) for s in leaf.starts()]
  first = {}
  for leaf, g, starts in units:  # one resident chunk (and gradient) of each weight
    if leaf.name not in first:
      chunk = [state.store.read(leaf, r, starts).result() for r in leaf.regions]
      grad = [tier.grad_store.read(g, r, starts).result() for r in g.regions]
      first[leaf.name] = (tier._global_chunk(g, grad), tier._global_chunk(leaf, chunk))
  scalars = jax.tree.leaves(state.opt_state)
  norm = scale = jax.device_put(np.float32(1.0), tier.program.layout.replicated())
  jax.block_until_ready(first)
  start = time.perf_counter()
  carry, consts = p.pre(pre_in, batch)
  checkpoints = []
  for _ in range(tier.n_layers):
    checkpoints.append(carry)
    carry = p.layer_forward(weights, carry, consts)
  _, (grads, ct) = p.post_grad(post_in, batch, carry)
  for _ in range(tier.n_layers):
    layer_grads, ct, _ = p.layer_backward(weights, checkpoints.pop(), consts, ct)
    np.asarray(jax.tree.leaves(layer_grads)[0])  # as the step waits to write it
  jax.block_until_ready(p.pre_backward(pre_in, batch, ct, p.float_consts(consts)))
  for leaf, _, _ in units:
    out = tier._chunk_unit(leaf)(*first[leaf.name], scalars, norm, scale)
    np.asarray(out[0])  # as the step waits to write it
  return time.perf_counter() - start


if __name__ == "__main__":
  sys.exit(main())
