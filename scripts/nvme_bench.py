"""Benchmark of the NVMe tier (offload.optimizer=nvme) on one CPU device.

    python scripts/nvme_bench.py --nvme-dir DIR [--dim 2048 --layers 16 --mlp 8192]
                                 [--steps 3] [--seq-len 32] [--seq-gb 2] [--json]

Trains a Llama of the given shape (vocabulary 256, bf16 compute and gradients,
batch 1) with its fp32 master weights and Adam moments in DIR, and prints:

* the process's peak RSS (``resource.getrusage``'s ru_maxrss, after
  initialisation, training and a checkpoint save), beside the optimizer state
  on disk (12 bytes a parameter): the tier's point is that the second exceeds
  the first;
* bytes on disk (the files' sizes, and the blocks they take);
* per step: its time, the gradient step's, and the update's (until its last
  write is on disk), with the update's achieved disk throughput: the bytes it
  read and wrote over its time, and the process's CPU time (user and system)
  over the step;
* the disk's own sequential write and read bandwidth in DIR, measured by this
  script in the same run, before training and again after it (O_DIRECT, 16 MiB
  blocks, one stream, so the page cache plays no part; the tier's store is
  O_DIRECT too), and the update's efficiency: the time sequential I/O of the
  same bytes would take (read bytes / sequential read + written bytes /
  sequential write) over the update's time.

XLA:CPU converts bf16 weights to f32 for its matmuls and hoists the converts
of the stacked layer weights out of the layer loop (an f32 copy of every
layer, 4 bytes a parameter; a GPU makes none); the benchmark disables that
hoisting (``--xla_disable_hlo_passes=while-loop-invariant-code-motion``,
before JAX starts) so that the weights are converted one layer at a time, as
jaxzero's DESIGN.md says a CPU memory bound needs. ``--keep-hoisting`` leaves
XLA's default.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import platform
import resource
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BLOCK = 16 << 20


def sequential_gbps(directory: pathlib.Path, size: int) -> tuple[float, float]:
  """(write, read) GB/s of one O_DIRECT stream of `size` bytes in 16 MiB blocks."""
  buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
  buffer.write(os.urandom(1 << 20) * (BLOCK >> 20))
  fd, path = tempfile.mkstemp(dir=directory, prefix=".jaxzero-seq-")
  os.close(fd)
  try:
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    start = time.perf_counter()
    for offset in range(0, size, BLOCK):
      os.pwritev(fd, [buffer], offset)
    os.fsync(fd)
    write = size / (time.perf_counter() - start) / 1e9
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    start = time.perf_counter()
    for offset in range(0, size, BLOCK):
      os.preadv(fd, [buffer], offset)
    read = size / (time.perf_counter() - start) / 1e9
    os.close(fd)
  finally:
    os.remove(path)
  return write, read


def peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def disk_bytes(directory: pathlib.Path) -> tuple[int, int]:
  files = [p for p in directory.rglob("*") if p.is_file()]
  return sum(p.stat().st_size for p in files), sum(p.stat().st_blocks * 512 for p in files)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--nvme-dir", required=True, help="a directory on the disk to measure")
  parser.add_argument("--dim", type=int, default=2048)
  parser.add_argument("--layers", type=int, default=16)
  parser.add_argument("--mlp", type=int, default=8192)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=32)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--seq-gb", type=float, default=2.0,
                      help="GB written and read to measure the disk's sequential bandwidth")
  parser.add_argument("--keep-hoisting", action="store_true")
  parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.seq_gb * 1e9 < BLOCK:
    parser.error(f"--steps must be >= 1 and --seq-gb at least {BLOCK / 1e9:.3f} (one block)")
  if not args.keep_hoisting:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_disable_hlo_passes=while-loop-invariant-code-motion")
  from jaxzero.parallel import mesh  # pylint: disable=import-outside-toplevel
  mesh.use_virtual_cpu_devices(1)
  from jaxzero import cli  # pylint: disable=import-outside-toplevel
  return cli.run_main("nvme_bench.py", lambda: bench(args))


def bench(args) -> int:
  """The benchmark; a bad --nvme-dir is one line (exit 2) before anything is measured."""
  # pylint: disable-next=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  from jaxzero import config, errors
  from jaxzero.models.llama import count_params  # pylint: disable=import-outside-toplevel
  from jaxzero.offload import targets as offload_targets
  from jaxzero.offload import nvme_store
  from jaxzero.training import loop

  nvme_dir = pathlib.Path(args.nvme_dir).expanduser()
  sets = [f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.mlp_dim={args.mlp}",
          f"model.n_heads={args.heads}", f"model.n_kv_heads={max(1, args.heads // 4)}",
          "model.vocab_size=256", "mesh.fsdp=1", "zero.stage=3", "train.global_batch=1",
          "train.grad_accum=1", f"train.seq_len={args.seq_len}", f"train.steps={args.steps}",
          "precision.compute=bfloat16", "zero.grad_dtype=bfloat16", "remat.policy=full",
          "train.lr=1e-4", "train.warmup_steps=0", "data.max_bytes=1000000",
          "offload.optimizer=nvme", f"offload.nvme_dir={nvme_dir}"]
  cfg = config.load(str(ROOT / "configs" / "tiny_zero3.py"), sets)
  devices = jax.devices()[:1]
  offload_targets.check_offload(cfg, devices)

  seq_size = int(args.seq_gb * 1e9) // BLOCK * BLOCK
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="jaxzero-nvme-bench-", dir=nvme_dir))
  run = None
  try:
    # The benchmark checks the room itself: the state and the disk measurement.
    run = loop.build(cfg, devices, workdir, progress=False,
                     runner=loop.prepare(cfg, devices, workdir, check=False))
    # At most on disk at once: the checkpoint (a copy of the store and the bf16
    # weights) beside the store, or beside the file that measures the disk.
    store = nvme_store.bytes_needed(run.runner.leaves)
    saved = store + 2 * count_params(cfg.model)
    needed, free = saved + max(store, seq_size), shutil.disk_usage(nvme_dir).free
    if free < needed:
      raise errors.PathError(
          f"--nvme-dir {nvme_dir} has {free / 1e9:.1f} GB free; the benchmark needs about "
          f"{needed / 1e9:.1f} GB (the store {store / 1e9:.1f} GB, a checkpoint "
          f"{saved / 1e9:.1f} GB, measuring the disk {seq_size / 1e9:.1f} GB): free space, "
          "lower --seq-gb or choose another directory")
    return measure(args, nvme_dir, cfg, run, workdir, seq_size)
  finally:
    try:
      if run is not None:
        run.runner.close()  # waits for the writes in flight, deletes the store's files
    finally:  # also when the store failed part way, or a write did
      for directory in ([run.runner.directory.parent] if run is not None else []) + [workdir]:
        shutil.rmtree(directory, ignore_errors=True)


def measure(args, nvme_dir: pathlib.Path, cfg, run, workdir: pathlib.Path, seq_size: int) -> int:
  """Measures the disk, trains, saves, measures the disk again; prints the figures."""
  import jax  # pylint: disable=import-outside-toplevel

  from jaxzero.checkpoint import checkpointer  # pylint: disable=import-outside-toplevel
  from jaxzero.models.llama import count_params  # pylint: disable=import-outside-toplevel
  from jaxzero.offload import nvme_checkpoint  # pylint: disable=import-outside-toplevel
  from jaxzero.planning import memory_check  # pylint: disable=import-outside-toplevel

  seq_before = sequential_gbps(nvme_dir, seq_size)
  print(f"disk, sequential (O_DIRECT, 16 MiB blocks, {seq_size / 1e9:.1f} GB): "
        f"write {seq_before[0]:.2f} GB/s, read {seq_before[1]:.2f} GB/s", flush=True)
  tier = run.runner
  phi = count_params(cfg.model)
  print(f"model: {phi / 1e9:.3f} B parameters (dim {args.dim}, {args.layers} layers, mlp "
        f"{args.mlp}); optimizer state 12 bytes x {phi:,} = {12 * phi / 1e9:.2f} GB on disk; "
        f"{len(tier.leaves)} weights in {sum(len(l.starts()) for l in tier.leaves)} chunks",
        flush=True)
  phases = {"build": peak_rss()}
  start = time.perf_counter()
  state = tier.init()
  tier.store.writes.wait()
  init_s = time.perf_counter() - start
  phases["init"] = peak_rss()
  on_disk = disk_bytes(tier.directory)
  print(f"init: {init_s:.1f} s; store {tier.directory}: {on_disk[0] / 1e9:.2f} GB in files "
        f"({on_disk[1] / 1e9:.2f} GB of blocks); peak RSS so far {peak_rss() / 1e9:.2f} GB",
        flush=True)
  compiled = tier.compile(state, run.batch(0))
  phases["compile"] = peak_rss()
  # The gradient step alone (no update: the state is unchanged), for its own peak.
  jax.block_until_ready(run.program.grad_step(state.params, run.batch(0), None))
  phases["gradients alone"] = peak_rss()
  steps = []
  for step in range(args.steps):
    start, cpu = time.perf_counter(), os.times()
    state, metrics = compiled(state, run.batch(step))
    tier.store.writes.wait()
    total = time.perf_counter() - start
    user_s, system_s = (b - a for a, b in zip(cpu[:2], os.times()[:2]))
    phases[f"step {step + 1}"] = peak_rss()
    update = total - tier.stats["grad_s"]
    moved = 2 * tier.step_bytes
    steps.append({"step": step + 1, "loss": float(metrics["loss"]), "step_s": total,
                  "grad_s": tier.stats["grad_s"], "update_s": update,
                  "update_gbps": moved / update / 1e9, "cpu_user_s": user_s,
                  "cpu_system_s": system_s})
    print(f"step {step + 1}: loss {steps[-1]['loss']:.4f}, {total:.1f} s (gradients "
          f"{tier.stats['grad_s']:.1f} s, update {update:.1f} s: read and wrote "
          f"{moved / 1e9:.2f} GB at {moved / update / 1e9:.2f} GB/s); CPU time "
          f"{user_s:.1f} s user, {system_s:.1f} s system", flush=True)
  train_peak = peak_rss()
  (workdir / "checkpoints").mkdir()
  info = checkpointer.run_info(cfg.model, "bfloat16", 0)
  with checkpointer.Checkpointer(workdir, 1, info, side=nvme_checkpoint.SIDE_ITEM) as ckpt:
    start = time.perf_counter()
    ckpt.save(args.steps, state, wait=True)
    save_s = time.perf_counter() - start
  phases["checkpoint save"] = peak_rss()
  saved = disk_bytes(workdir / "checkpoints")
  save_peak = peak_rss()
  tier.close()
  seq_after = sequential_gbps(nvme_dir, seq_size)
  seq_write, seq_read = [(a + b) / 2 for a, b in zip(seq_before, seq_after)]
  measured = steps[1:] or steps  # the first update compiles its functions
  update_s = sum(s["update_s"] for s in measured) / len(measured)
  sequential_s = tier.step_bytes / (seq_read * 1e9) + tier.step_bytes / (seq_write * 1e9)
  result = {
      "machine": f"{platform.node()} ({os.cpu_count()} CPUs, "
                 f"{memory_check.host_memory_bytes() / 2**30:.0f} GiB RAM), {platform.platform()}",
      "params": phi, "optimizer_state_bytes": 12 * phi, "store_bytes": on_disk[0],
      "store_disk_blocks_bytes": on_disk[1], "peak_rss_bytes_training": train_peak,
      "peak_rss_bytes_with_save": save_peak, "state_over_peak_rss": 12 * phi / train_peak,
      "peak_rss_bytes_by_phase": phases, "init_s": init_s, "steps": steps, "checkpoint_save_s": save_s,
      "checkpoint_bytes": saved[0], "sequential_write_gbps": [seq_before[0], seq_after[0]],
      "sequential_read_gbps": [seq_before[1], seq_after[1]],
      "update_gbps": 2 * tier.step_bytes / update_s / 1e9,
      "update_efficiency": sequential_s / update_s,
  }
  print(f"disk, sequential again: write {seq_after[0]:.2f} GB/s, read {seq_after[1]:.2f} GB/s")
  print(f"peak RSS {train_peak / 1e9:.2f} GB training ({save_peak / 1e9:.2f} GB after a "
        f"checkpoint save of {saved[0] / 1e9:.2f} GB in {save_s:.1f} s); optimizer state on disk "
        f"{12 * phi / 1e9:.2f} GB = {12 * phi / train_peak:.2f} x the peak RSS")
  print("peak RSS so far, after each phase: " + ", ".join(f"{k} {v / 1e9:.2f} GB"
                                                         for k, v in phases.items()))
  print(f"update (steps {measured[0]['step']}-{measured[-1]['step']}): {result['update_gbps']:.2f} "
        f"GB/s read+write; sequential I/O of the same bytes (read {seq_read:.2f}, write "
        f"{seq_write:.2f} GB/s) would take {sequential_s:.1f} s of its {update_s:.1f} s: "
        f"{100 * result['update_efficiency']:.0f}% of the disk's sequential bandwidth")
  if args.json:
    print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
