"""XLA's pinned host pool is sized from the run before the backend starts, never below
XLA's default, never over the host's RAM, and never over what the user set."""

import pytest

from jaxzero import config
from jaxzero.runtime import pinned_pool

from processes import ROOT

GPU = {"JAX_PLATFORMS": "cuda"}


def llama8b(*sets):
  return config.load(str(ROOT / "configs/llama8b_zero3.py"),
                     ["mesh.fsdp=1", "train.global_batch=1", "train.grad_accum=1", *sets])


def test_weights_in_pinned_host_size_the_pool_for_them(monkeypatch):
  monkeypatch.setattr(pinned_pool.memory, "host_ram_bytes", lambda: 1024 * 10**9)  # 1 TB
  # Llama-3-70B at stage 3 on 8 GPUs, weights in pinned_host: each GPU's shards of the
  # bf16 weights and of a micro-step's bf16 gradient, 70.6e9 x 4 / 8 bytes, 8 of them.
  cfg = config.load(str(ROOT / "configs/llama70b_zero3_offload.py"),
                    ["offload.params=pinned_host", "mesh.fsdp=8", "zero.grad_dtype=bfloat16"])
  needed = pinned_pool.run_bytes(cfg, local_devices=8)
  assert 4 * 70.0e9 <= needed <= 4 * 71.0e9
  environ = dict(GPU)
  gb = pinned_pool.size_for_run(cfg, 8, environ)
  assert gb == int(environ[pinned_pool.ENV]) and gb > pinned_pool.XLA_DEFAULT_GB
  assert gb * 2**30 >= needed * pinned_pool.ROOM > (gb - 1) * 2**30  # XLA reads GiB
  # What the user set wins; no GPU, no setting; ZeRO-Offload's optimizer alone needs no pool
  # (the host runner keeps its state outside it).
  assert pinned_pool.size_for_run(cfg, 1, {**GPU, pinned_pool.ENV: "100"}) is None
  assert pinned_pool.size_for_run(cfg, 1, {"JAX_PLATFORMS": "cpu"}) is None
  assert pinned_pool.run_bytes(llama8b("offload.optimizer=pinned_host"), 1) == 0
  # The 8B on one GPU with its weights in pinned_host: XLA's 64 GB hold them.
  assert pinned_pool.size_for_run(llama8b("offload.params=pinned_host"), 1, dict(GPU)) is None


def test_the_pool_never_exceeds_the_host(monkeypatch):
  monkeypatch.setattr(pinned_pool.memory, "host_ram_bytes", lambda: 100 * 10**9)  # 100 GB
  environ = dict(GPU)
  gb = pinned_pool.size_for_host(environ)
  assert gb == int(environ[pinned_pool.ENV]) == 83  # 90 GB is 83.8 GiB
  cfg = llama8b("offload.params=pinned_host", "remat.policy=offload_matmuls")
  assert pinned_pool.size_for_run(cfg, 8, dict(GPU)) == 83


@pytest.mark.parametrize("processes, fits", [(1, True), (2, False)])
def test_the_start_up_check_counts_each_hosts_processes_host_memory(processes, fits):
  from jaxzero.planning import memory_check  # pylint: disable=import-outside-toplevel
  b = memory_check.Budget(params=1, grads=1, optimizer=96 * 10**9, host=96 * 10**9,
                          activations=1, available=80 * 10**9, where="one GPU", devices=1,
                          platform="gpu", host_process=97 * 10**9, host_processes=processes,
                          host_ram=200 * 10**9)
  assert b.host_fits is fits and b.fits
  if not fits:
    line = memory_check.host_message(b)
    assert line.startswith("this run keeps about 97.0 GB in host memory per process")
    assert "x 2 processes on this host = 194.0 GB, but this host has 200.0 GB of RAM" in line
    assert "offload.optimizer=nvme" in line and "\n" not in line


def test_under_hybrid_shard_the_pool_holds_a_weight_split_over_fsdp_alone():
  """replica 2 x fsdp 4, HYBRID_SHARD: each device keeps a quarter of each weight, not an
  eighth."""
  sets = ["offload.params=pinned_host", "mesh.replica=2", "mesh.fsdp=4"]
  plain = config.load(str(ROOT / "configs/llama70b_zero3_offload.py"), sets)
  hybrid = config.load(str(ROOT / "configs/llama70b_zero3_offload.py"),
                       [*sets, "zero.hybrid=true"])
  assert pinned_pool.run_bytes(hybrid, 8) == pytest.approx(2 * pinned_pool.run_bytes(plain, 8),
                                                            rel=1e-6)


@pytest.mark.parametrize("files, expected_gb", [
    ({"memory/slurm/uid_0/job_7/memory.limit_in_bytes": "16000000000",
      "memory/slurm/uid_0/memory.limit_in_bytes": "9223372036854771712"}, 16),  # v1, Slurm
    ({"memory.max": "max", "job/memory.max": "8000000000"}, 8),  # v2
    ({"job/memory.max": "max"}, None),  # no limit: the host's RAM
])
def test_host_ram_is_the_cgroups_limit_where_smaller(tmp_path, files, expected_gb):
  from jaxzero.runtime import memory
  v1 = any(name.startswith("memory/") for name in files)
  proc = tmp_path / "cgroup"
  proc.write_text("4:memory:/slurm/uid_0/job_7\n" if v1 else "0::/job\n")
  for name, text in files.items():
    path = tmp_path / "fs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
  physical = memory.host_ram_bytes(str(tmp_path / "none"), str(tmp_path / "none"))
  ram = memory.host_ram_bytes(str(tmp_path / "fs"), str(proc))
  assert ram == (physical if expected_gb is None else min(physical, expected_gb * 10**9))


def test_offloaded_matmuls_are_held_for_every_micro_batch_a_pipeline_stage_holds():
  """remat.policy=offload_matmuls under GPipe keeps every tick's matmul outputs until its
  backward (M + S - 1 ticks, the bubble's too): the pool's share does not shrink as
  grad_accum cuts the rows, and a stage holds its own layers' only. Interleaved recomputes
  each chunk from its input: one chunk's. Context and tensor split them too (tensor the
  sequence between blocks only where context does not split it)."""
  tiny = lambda *sets: config.load(str(ROOT / "configs/tiny_zero3.py"), [
      "remat.policy=offload_matmuls", "train.global_batch=32", "precision.compute=bfloat16",
      *sets])
  m = tiny().model
  per_token = (3 * m.dim + 2 * m.n_kv_heads * (m.dim // m.n_heads) + 2 * m.mlp_dim) * 2
  tokens = 32 * tiny().train.seq_len
  for accum in (4, 8):
    gpipe = tiny("mesh.pipeline=2", f"train.grad_accum={accum}")
    assert pinned_pool.offloaded_matmul_bytes(gpipe, 32 // accum) == \
        tokens // accum * (accum + 1) * m.n_layers // 2 * per_token
  interleaved = tiny("mesh.pipeline=2", "train.grad_accum=4", "pipeline.schedule=interleaved",
                     "pipeline.virtual_stages=2")
  assert pinned_pool.offloaded_matmul_bytes(interleaved, 8) == \
      tokens // 4 * m.n_layers // 2 // 2 * per_token
  one = tiny("train.grad_accum=4")
  assert pinned_pool.offloaded_matmul_bytes(one, 8) == tokens // 4 * m.n_layers * per_token
  tensor = tiny("train.grad_accum=4", "mesh.tensor=2")  # (sequence parallel: all halved)
  assert pinned_pool.offloaded_matmul_bytes(tensor, 8) == tokens // 4 * m.n_layers * per_token // 2
  # A sequence tensor does not divide is not split over it: o's and down's outputs whole.
  odd = tiny("train.grad_accum=4", "mesh.tensor=2", "train.seq_len=127")
  assert pinned_pool.offloaded_matmul_bytes(odd, 8) == \
      32 * 127 // 4 * m.n_layers * (per_token // 2 + 2 * m.dim * 2 // 2)
  # Under context parallelism o's and down's outputs are whole over tensor.
  split = tiny("train.grad_accum=4", "mesh.context=2", "mesh.tensor=2")
  assert pinned_pool.offloaded_matmul_bytes(split, 8) == \
      tokens // 4 // 2 * m.n_layers * (per_token // 2 + 2 * m.dim * 2 // 2)
