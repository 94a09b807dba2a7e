"""Helpers for tests that run jaxzero's command-line tools and scripts."""

import importlib.util
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny_zero3.py")
# The planner's fast-compile flags (jaxzero.planning.planner.FAST_COMPILE_OPTIONS) for
# every test process (conftest.py) and the CLI processes the tests start: LLVM's
# optimisations and the MLIR fusion emitters only make the CPU kernels faster,
# and off they compile the tests' tiny programs about 3x faster. The partitioned
# program (shardings, collectives and their bytes, argument bytes) is the same,
# and every run a test compares with another is compiled with the same flags.
# The CPU collectives' rendezvous waits 600 s, not XLA's 40 s, before it aborts the
# process: on a loaded 2-core machine two test workers' 16 device threads (and the
# compiler's) share the cores, and one device of a collective can arrive more than 40 s
# after the others (seen as "Fatal Python error: Aborted" in a worker mid-step).
FAST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_collective_call_terminate_timeout_seconds=600")


# What would make a child join other processes (jaxzero.runtime.distributed) or size its
# devices as this process's were sized.
_NOT_ALONE = ("JAX_NUM_CPU_DEVICES", "JAXZERO_", "SLURM_", "OMPI_", "KUBERNETES_")


def child_env(compilation_cache: pathlib.Path | None = None, *, alone: bool = False,
              pythonpath: bool = False, **extra) -> dict:
  """The environment for a process a test starts: this one's, with XLA_FLAGS holding only
  the fast-compile flags (the child makes its own devices).

  Args:
    compilation_cache: a persistent XLA compilation cache that the children share, so
      that identical programs compile once.
    alone: on CPU and without anything that would make the child join others or size
      its devices (_NOT_ALONE): `extra` and its arguments say what it joins and how many
      devices it makes.
    pythonpath: this checkout's jaxzero importable from any working directory.
    **extra: variables set last.
  """
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("XLA_FLAGS", *(_NOT_ALONE if alone else ())))}
  env["XLA_FLAGS"] = FAST_XLA_FLAGS
  if alone:
    env["JAX_PLATFORMS"] = "cpu"
  if compilation_cache is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = str(compilation_cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  if pythonpath:
    env["PYTHONPATH"] = str(ROOT)
  return {**env, **extra}


def run_python(*args, env: dict | None = None, cwd=ROOT, timeout: float | None = 300
               ) -> subprocess.CompletedProcess:
  """``python ARGS`` (e.g. ``"-m", "jaxzero.train", ...``) run to its end from `cwd`, in
  `env` (default: child_env()); stdout and stderr captured as text, the exit code left to
  the caller."""
  return subprocess.run([sys.executable, *args], cwd=cwd,
                        env=child_env() if env is None else env, capture_output=True,
                        text=True, timeout=timeout, check=False)


def logged(workdir) -> list[dict]:
  """A run's metrics.jsonl records (a line being written is skipped)."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  lines = path.read_text().splitlines() if path.exists() else []
  return [json.loads(line) for line in lines if line.endswith("}")]


def losses(workdir) -> dict[int, float]:
  """{step: loss} of a run's logged steps."""
  return {r["step"]: r["loss"] for r in logged(workdir)}


def wait_for(condition, process, timeout=300):
  """Polls `condition` until true; fails with the process's stderr if it exits first."""
  deadline = time.monotonic() + timeout
  while not condition():
    if process.poll() is not None:
      raise AssertionError(f"training exited early ({process.returncode}): "
                           + process.communicate()[1][-3000:])
    if time.monotonic() > deadline:
      process.kill()
      raise AssertionError("timed out: " + process.communicate()[1][-3000:])
    time.sleep(0.05)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def load_script(name: str):
  """`scripts/NAME.py` as a module (the scripts are not a package)."""
  spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def at_step(workdir, step, copy):
  """A copy of `workdir` as it was when it had saved `step`."""
  shutil.copytree(workdir, copy)
  for later in (p for p in (copy / "checkpoints").iterdir() if int(p.name) > step):
    shutil.rmtree(later)
  (copy / "metrics.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in logged(copy)
                                              if r["step"] <= step))
  return copy
