"""Benchmark of ZeRO-Offload (offload.optimizer=pinned_host): host memory, the host
update's bandwidth against the machine's, and how much of it overlaps.

    python scripts/offload_bench.py [--config configs/tiny_zero3.py] [--set KEY=VALUE ...]
                                    [--steps 4] [--json]

Each run is its own process (so that each peak is its own): the config without offload
(where the start-up check says it fits), with the optimizer in host memory, and with the
one-step delayed update (DPU). Printed, or with --json one line:

* ``state_bytes``: the optimizer state in host memory (this process's store);
  ``host_peak_bytes``: the process's peak resident memory during the timed steps
  (sampled every 5 ms) less what it held before the state was created (on a CPU
  the device arrays live in host memory too: the weights, gradients and activations, and
  what XLA's compilations keep); ``host_transient_bytes``: that peak less what the
  process held when the timed steps began (what a step adds, and gives back);
  ``device_peak_bytes``: the device's peak (``memory_stats``), or on a CPU XLA's compiled
  figure for the device program;
* ``step_s`` (median), ``step_s_no_offload``, ``step_s_delayed``;
* ``host_update_s``: the update's time in a step (``HostRunner.stats``), and
  ``host_update_gbps``: the bytes it reads and writes (the plan's ``host_update``) over
  that time, beside ``host_copy_gbps``: this host's copy bandwidth measured in the same
  run (every core copying its part of a 1 GB buffer, bytes read and written), and their
  ratio ``host_update_fraction``;
* ``overlap_efficiency``: of the shorter of the gradient step and the update, the share
  that DPU hides: (grad_s + update_s - step_s_delayed) / min(grad_s, update_s);
* ``predicted``: the plan's figures for the same run (host bytes per process, device
  bytes, the step at the plan's default rates and at the measured update bandwidth).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The tiny preset, larger, in bf16.
# On a CPU the host's devices are the mesh's: one per core, so that the update has them all.
CORES = os.cpu_count() or 1
CPU_SHAPE = ["model.dim=512", "model.n_layers=4", "model.mlp_dim=1536", "train.seq_len=64",
             f"train.global_batch={2 * CORES}", "train.grad_accum=2", "data.max_bytes=400000",
             f"mesh.fsdp={CORES}", "precision.compute=bfloat16", "zero.grad_dtype=bfloat16"]


def host_copy_gbps(size: int = 1 << 30, repeats: int = 3) -> float:
  """GB/s (read and written) of every core copying its part of a `size`-byte buffer."""
  threads = os.cpu_count() or 1
  source = np.ones(size // 8, np.float64)
  target = np.empty_like(source)
  parts = np.array_split(np.arange(source.size), threads)
  bounds = [(p[0], p[-1] + 1) for p in parts if p.size]
  best = float("inf")
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for _ in range(repeats):
      start = time.perf_counter()
      list(pool.map(lambda b: np.copyto(target[b[0]:b[1]], source[b[0]:b[1]]), bounds))
      best = min(best, time.perf_counter() - start)
  return 2 * size / best / 1e9


def one_run(config: str, sets: list[str], steps: int) -> dict:
  """Trains `steps` steps after one warm-up; returns its figures (in this process)."""
  from jaxzero import config as config_lib  # pylint: disable=import-outside-toplevel
  from jaxzero.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(config, sets)
  mesh_lib.use_cpu_devices_for(cfg.mesh)  # before JAX starts (harmless on a GPU)
  import jax  # pylint: disable=import-outside-toplevel
  from jaxzero.planning import memory_check, planner  # pylint: disable=import-outside-toplevel
  from jaxzero.training import loop  # pylint: disable=import-outside-toplevel
  run = loop.build(cfg, progress=False)
  runner = run.runner
  budget = memory_check.budget(runner, run.devices)
  if not (budget.fits and budget.host_fits):
    return {"fits": False}
  before = _rss()
  state = runner.init()
  compiled = runner.compile(state, run.batch(0))
  state, _ = compiled(state, run.batch(0))  # the warm-up step: each program compiles
  if hasattr(runner, "finish_update"):  # DPU: the warm-up's update (its compiles) ends first
    state = runner.finish_update(state)
  exact = hasattr(runner, "host_unit") and not runner.delayed
  alone = host_math_seconds(runner, state) if exact else 0.0
  times, grads, updates = [], [], []
  steady = _rss()
  sampler = RssSampler()
  for step in range(1, steps + 1):
    start = time.perf_counter()
    state, metrics = compiled(state, run.batch(step))
    jax.block_until_ready((state.params, metrics["loss"]))
    times.append(time.perf_counter() - start)
    stats = getattr(runner, "stats", {})
    grads.append(stats.get("grad_s", 0.0))
    updates.append(stats.get("update_s", 0.0))
  peak_rss = sampler.stop()
  device = run.devices[0]
  peak = (device.memory_stats() or {}).get("peak_bytes_in_use") if device.platform != "cpu" \
      else None
  if peak is None:
    shapes = runner.program.abstract_state()
    micro = mesh_lib.micro_batch(cfg.train, run.layout.data_parallel_size)
    lowered = runner.lower(shapes, runner.program.abstract_batch(micro))
    peak = planner.xla_total_bytes(lowered.compile().memory_analysis())
  plan = runner.plan()
  result = {"fits": True, "step_s": statistics.median(times), "host_math_s": alone,
            "grad_s": statistics.median(grads), "update_s": statistics.median(updates),
            "host_peak_bytes": peak_rss - before, "host_transient_bytes": peak_rss - steady,
            "device_peak_bytes": int(peak),
            "state_bytes": getattr(runner, "host_bytes", lambda: 0)(),
            "plan": {k: int(v) for k, v in plan.items()},
            "budget_device_bytes": budget.needed, "n_params": runner.program.n_params,
            "tokens_per_step": cfg.train.global_batch * cfg.train.seq_len,
            "platform": device.platform, "device_kind": device.device_kind}
  runner.close()
  return result


def host_math_seconds(runner, state) -> float:
  """The host's update alone, as a GPU machine's host runs it (its device's part on the
  GPU): every host chunk's update from a zero gradient, dispatched in turn over the host's
  devices, best of three (this moves the state on; the run is discarded after)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  store = state.store
  chunks = [(leaf, region, starts) for leaf, region, starts in store.chunks()
            if not runner.keeps_on_device(leaf, starts)]
  grad_dtype = jnp.dtype(runner.cfg.zero.grad_dtype)
  zeros = {(leaf.name, region.box, starts): jax.device_put(
      jnp.zeros([b - a for a, b in leaf.chunk_box(region, starts)], grad_dtype),
      store.device_of(leaf, region, starts)) for leaf, region, starts in chunks}
  scalars = jax.tree.leaves(state.opt_state)
  args = {d: jax.device_put((scalars, jnp.float32(1.0), jnp.float32(1.0)), d)
          for d in {store.device_of(*c) for c in chunks}}
  best = float("inf")
  for _ in range(3):
    start, outs = time.perf_counter(), []
    for leaf, region, starts in chunks:
      copies, box, _ = runner.host_unit(leaf)(zeros[leaf.name, region.box, starts],
                                              store.take(leaf, region, starts),
                                              *args[store.device_of(leaf, region, starts)])
      store.write(leaf, region, starts, copies)
      outs.append(box)
    jax.block_until_ready(outs)
    best = min(best, time.perf_counter() - start)
  return best


class RssSampler:
  """This process's resident memory, sampled every 5 ms until stopped: its peak."""

  def __init__(self):
    self.peak, self._running = _rss(), True
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while self._running:
      self.peak = max(self.peak, _rss())
      time.sleep(0.005)

  def stop(self) -> int:
    self._running = False
    self._thread.join()
    return max(self.peak, _rss())


def _rss() -> int:
  with open("/proc/self/statm", encoding="ascii") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def in_a_process(args, sets: list[str]) -> dict:
  command = [sys.executable, __file__, "--one", "--config", args.config, "--steps",
             str(args.steps), *[a for s in sets for a in ("--set", s)]]
  done = subprocess.run(command, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise SystemExit(f"offload_bench.py: a run failed: {done.stderr[-2000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  from jaxzero import cli  # pylint: disable=import-outside-toplevel
  parser = cli.Parser(prog="offload_bench.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default=str(ROOT / "configs" / "tiny_zero3.py"))
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--steps", type=int, default=4, help="timed steps, after one warm-up")
  parser.add_argument("--json", action="store_true", help="print one JSON line")
  parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  tiny = pathlib.Path(args.config).name == "tiny_zero3.py"
  sets = (CPU_SHAPE if tiny else []) + args.set
  if args.steps < 1:
    parser.error(f"--steps={args.steps} must be at least 1")
  if args.one:
    print(json.dumps(one_run(args.config, sets, args.steps)))
    return 0
  from jaxzero import config as config_lib  # pylint: disable=import-outside-toplevel
  from jaxzero.errors import UserError  # pylint: disable=import-outside-toplevel
  try:  # the config, checked once here before anything is measured
    config_lib.load(args.config, sets)
  except UserError as e:
    parser.error(str(e))
  copy = host_copy_gbps()
  print(f"host_copy_gbps: {copy:.2f}", file=sys.stderr, flush=True)
  runs = {}
  for name, offload in (("none", ["offload.optimizer=device"]),
                        ("exact", ["offload.optimizer=pinned_host"]),
                        ("delayed", ["offload.optimizer=pinned_host",
                                     "offload.delayed_update=true",
                                     "offload.delayed_update_after=0"])):
    runs[name] = in_a_process(args, [*sets, *offload])
    # Each run's own figures as it ends, on stderr: a run cut short still tells them.
    print(f"{name}: {json.dumps(runs[name], default=str)}", file=sys.stderr, flush=True)
  none, exact, delayed = runs["none"], runs["exact"], runs["delayed"]
  for name in ("exact", "delayed"):
    if not runs[name].get("fits"):
      raise SystemExit(f"offload_bench.py: error: the run with the optimizer in host memory "
                       f"({name}) does not fit this machine, as its start-up check says; "
                       "choose a smaller shape with --set")
  result = summary(copy, none, exact, delayed)
  print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
  return 0


def summary(copy: float, none: dict, exact: dict, delayed: dict) -> dict:
  from jaxzero.planning import planner  # pylint: disable=import-outside-toplevel
  plan = exact["plan"]
  update_gbps = plan["host_update"] / exact["update_s"] / 1e9 if exact["update_s"] else 0.0
  math_gbps = plan["host_update"] / exact["host_math_s"] / 1e9 if exact["host_math_s"] else 0.0
  hidden = exact["grad_s"] + exact["update_s"] - delayed["step_s"]
  shorter = min(exact["grad_s"], exact["update_s"]) or 1.0
  rates = dict(planner.DEFAULT_RATES)
  predicted_update = plan["host_update"] / (rates["host_gbps"] * 1e9)
  return {
      "platform": exact["platform"], "device_kind": exact["device_kind"],
      "n_params": exact["n_params"], "state_bytes": exact["state_bytes"],
      "host_peak_bytes": exact["host_peak_bytes"],
      "host_transient_bytes": exact["host_transient_bytes"],
      "device_peak_bytes": exact["device_peak_bytes"],
      "step_s": round(exact["step_s"], 4),
      "step_s_no_offload": round(none["step_s"], 4) if none.get("fits") else None,
      "step_s_delayed": round(delayed["step_s"], 4),
      "tokens_per_s": round(exact["tokens_per_step"] / exact["step_s"], 1),
      "grad_s": round(exact["grad_s"], 4), "host_update_s": round(exact["update_s"], 4),
      "host_update_gbps": round(update_gbps, 2), "host_copy_gbps": round(copy, 2),
      "host_update_fraction": round(update_gbps / copy, 3),
      "host_math_s": round(exact["host_math_s"], 4), "host_math_gbps": round(math_gbps, 2),
      "host_math_fraction": round(math_gbps / copy, 3),
      "overlap_efficiency": round(max(0.0, min(1.0, hidden / shorter)), 3),
      "predicted": {"host_process_bytes": plan["host_process"],
                    "device_bytes": exact["budget_device_bytes"],
                    "host_update_bytes": plan["host_update"],
                    "host_update_s_at_default_rate": round(predicted_update, 4),
                    "host_update_s_at_measured_copy": round(
                        plan["host_update"] / (copy * 1e9), 4),
                    "rates": rates}}


if __name__ == "__main__":
  sys.exit(main())
