"""Helpers for tests that run jaxzero's command-line tools and scripts."""

import importlib.util
import json
import os
import pathlib
import shutil
import socket
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny_zero3.py")
# The planner's fast-compile flags (jaxzero.planning.planner.FAST_COMPILE_OPTIONS) for
# every test process (conftest.py) and the CLI processes the tests start: LLVM's
# optimisations and the MLIR fusion emitters only make the CPU kernels faster,
# and off they compile the tests' tiny programs about 3x faster. The partitioned
# program (shardings, collectives and their bytes, argument bytes) is the same,
# and every run a test compares with another is compiled with the same flags.
FAST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false")


def cli_env(compilation_cache: pathlib.Path) -> dict:
  """The environment for a CLI process: no XLA_FLAGS but the fast-compile ones (the
  CLI makes its own devices) and a shared XLA compilation cache, so identical
  programs compile once."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return {**env, "XLA_FLAGS": FAST_XLA_FLAGS, "JAX_COMPILATION_CACHE_DIR": str(compilation_cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


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


def clean_env(**extra) -> dict:
  """This environment without anything that would make a child join or size its
  devices; XLA_FLAGS holds only the tests' fast-compile flags."""
  drop = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAXZERO_", "SLURM_", "OMPI_", "KUBERNETES_")
  env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
  return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_XLA_FLAGS, **extra}


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
