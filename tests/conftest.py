"""Every test process sees 8 virtual CPU devices, made the way jaxzero makes them,
and one persistent XLA compilation cache for the session: the many tests that
build the same program (a run and its resume) compile it once."""

import tempfile

import jax

from jaxzero import mesh

mesh.use_virtual_cpu_devices(8)
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxzero_test_xla_cache_"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
