"""Every test process sees 8 virtual CPU devices, made the way jaxzero makes them,
and one persistent XLA compilation cache for the session: the many tests that
build the same program (a run and its resume) compile it once."""

import tempfile

import jax

from jaxzero import mesh

mesh.use_virtual_cpu_devices(8)
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxzero_test_xla_cache_"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# The longest files first: with one worker per core and each file on one worker
# (pytest-xdist's loadfile), the run then ends with short files, not one long one.
LONGEST_FIRST = ("test_launch.py", "test_nonfinite_processes.py", "test_peerwatch.py",
                 "test_checkpoint.py", "test_workdir.py", "test_tensor.py", "test_operate.py",
                 "test_plan.py", "test_model.py", "test_step.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
