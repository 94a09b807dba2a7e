"""Every test process sees 8 virtual CPU devices, made the way jaxzero makes them,
compiles with the fast-compile XLA flags (processes.FAST_XLA_FLAGS; flags already
in XLA_FLAGS come after them and win), and shares one persistent XLA compilation
cache with the session's other xdist workers: the many tests that build the same
program (a run and its resume, or the same layout in two files) compile it once."""

import os
import tempfile

import jax

from jaxzero.parallel import mesh

from processes import FAST_XLA_FLAGS

# Before JAX's backend starts (it reads XLA_FLAGS once, at its first use).
os.environ["XLA_FLAGS"] = " ".join(filter(None, [FAST_XLA_FLAGS, os.environ.get("XLA_FLAGS")]))
mesh.use_virtual_cpu_devices(8)
# Made by the first process to load this file (xdist's controller, before it starts the
# workers, which inherit it).
if "JAXZERO_TESTS_XLA_CACHE" not in os.environ:
  os.environ["JAXZERO_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxzero_test_xla_cache_")
jax.config.update("jax_compilation_cache_dir", os.environ["JAXZERO_TESTS_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
