"""The start-up memory check's activation estimate against XLA's compiled figure on the
meshes that divide a step's activations: context (tokens), tensor (heads, MLP, vocabulary,
and the sequence between blocks), pipeline (layers, and the micro-batches a stage holds)."""

import jax
import pytest

from jaxzero import config
from jaxzero.planning import host_memory, memory_check, planner
from jaxzero.planning.planner import Variant
from jaxzero.training import loop

from processes import TINY

# float32: XLA:CPU keeps float32 copies of bfloat16 weights, which a GPU does not.
SHAPE = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
         "model.mlp_dim=768", "model.vocab_size=4096", "train.seq_len=1024",
         "precision.compute=float32", "data.max_bytes=200000"]


@pytest.mark.parametrize("mesh", [
    pytest.param(["mesh.fsdp=1", "mesh.context=8", "train.global_batch=2", "remat.policy=full"],
                 marks=pytest.mark.slow),
    ["mesh.fsdp=2", "mesh.tensor=4", "train.global_batch=4", "remat.policy=full"],
    pytest.param(["mesh.fsdp=4", "mesh.pipeline=2", "train.global_batch=32",
                  "train.grad_accum=8"], marks=pytest.mark.slow),
    pytest.param(["mesh.fsdp=4", "mesh.pipeline=2", "train.global_batch=32", "train.grad_accum=8",
                  "pipeline.schedule=1f1b"], marks=pytest.mark.slow),
    pytest.param(["mesh.fsdp=4", "mesh.pipeline=2", "train.global_batch=32", "train.grad_accum=8",
                  "pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
                 marks=pytest.mark.slow),
], ids=["context8", "tensor4", "gpipe", "1f1b", "interleaved"])
def test_the_activation_estimate_follows_the_mesh(mesh):
  """Within 0.6x-2x of XLA's temporaries (it was 8x over at context 8, 2.6x over at tensor
  4, 5x under for GPipe, which holds every micro-batch, and 2.9x over interleaved, whose
  backward recomputes each chunk from its input)."""
  estimate, compiled = estimated_and_compiled(["train.grad_accum=1", *mesh])
  assert 0.6 <= estimate / compiled <= 2.0, (estimate, compiled)


def estimated_and_compiled(sets: list[str]) -> tuple[int, int]:
  """The check's activation bytes for SHAPE with `sets` on 8 devices, and XLA's."""
  cfg = config.load(TINY, [*SHAPE, *sets])
  devices = jax.devices()[:8]
  compiled = planner.plan(cfg, 8, 80 * 10**9, [Variant(3, False, cfg.remat.policy)],
                          search=False).rows[0].activation_bytes
  estimate = memory_check.budget(loop.prepare(cfg, devices, check=False), devices).activations
  return estimate, compiled


def per_layer(sets: list[str], layers: tuple[int, int]) -> float:
  """How the check's bytes grow per layer, against XLA's, from `layers[0]` to `layers[1]`."""
  (estimate_a, compiled_a), (estimate_b, compiled_b) = (
      estimated_and_compiled([*sets, f"model.n_layers={n}"]) for n in layers)
  return (estimate_b - estimate_a) / (compiled_b - compiled_a)


@pytest.mark.slow
def test_under_context_and_tensor_each_layer_keeps_its_whole_input():
  """Context 4 x tensor 2: the sequence is split over context, so a layer's saved input is
  whole over tensor (no sequence parallelism); it was counted halved (0.48x of XLA's
  bytes per layer). Vocabulary 256: a layer's weights, not the embedding's share."""
  growth = per_layer(["model.vocab_size=256", "train.grad_accum=1", "mesh.fsdp=1",
                      "mesh.context=4", "mesh.tensor=2", "train.global_batch=2",
                      "remat.policy=full"], (4, 16))
  assert 0.9 <= growth <= 1.1, growth


@pytest.mark.slow
def test_a_1f1b_stage_keeps_two_micro_batches_residuals_a_layer():
  """1F1B at 4 and 8 layers on 2 stages: the estimate grows per layer as XLA's bytes do
  (0.43x with one micro-batch's residuals; the loop carries one set into the slot that
  makes the next)."""
  growth = per_layer(["mesh.fsdp=4", "mesh.pipeline=2", "train.global_batch=32",
                      "train.grad_accum=8", "pipeline.schedule=1f1b"], (4, 8))
  assert 0.85 <= growth <= 1.15, growth


def test_the_long_context_preset_fits_an_80_gb_device():
  """configs/llama8b_128k.py on 8 devices of 80 GB: the plan compiles it at 32.1 GB a
  device; the check counted every device as holding all 131,072 tokens (100.7 GB)."""
  cfg = config.load("configs/llama8b_128k.py")
  micro = cfg.train.global_batch // cfg.train.grad_accum // (8 // cfg.mesh.context)
  activations = memory_check.activation_bytes(cfg, micro, 8, True)
  state = 16 * 8.03e9 / 8
  assert (state + activations) * memory_check.HEADROOM < 80e9
  assert activations < 20e9


def test_what_would_fit_counts_a_lora_base_and_offers_no_offload_for_it():
  """Llama-3.1-8B LoRA on one 24 GB device: the bf16 base (16 GB) is most of the state,
  so only full remat fits; optimizer offload is not offered (LoRA keeps its adapters'
  state on the device)."""
  import dataclasses
  cfg = config.load("configs/llama8b_lora.py", ["mesh.fsdp=1", "remat.policy=save_attention"])
  runner = loop.prepare(cfg, jax.devices()[:1], check=False)
  budget = memory_check.budget(runner, jax.devices()[:1])
  on_a_gpu = dataclasses.replace(budget, available=24 * 10**9, platform="gpu", host_ram=None)
  assert not on_a_gpu.fits
  assert memory_check.suggest(runner.program, on_a_gpu).startswith(
      "what would fit: remat.policy=full (~20.")
  smaller = dataclasses.replace(on_a_gpu, available=16 * 10**9)
  assert memory_check.suggest(runner.program, smaller).startswith(
      "ZeRO-3 with remat.policy=full and micro-batch 1 would fit on 2 such devices")


def test_what_would_fit_combines_the_fixes_and_counts_a_pipeline_s_devices():
  """No one change fits where all together do (ZeRO-3, full remat, micro-batch 1 on these
  devices); with a pipeline each device holds its stage's layers, and more devices are
  counted with the stages beside each shard group."""
  import dataclasses
  devices = jax.devices()[:8]
  runner = loop.prepare(config.load(TINY, ["zero.stage=2"]), devices, check=False)
  small = dataclasses.replace(memory_check.budget(runner, devices), available=8 * 10**6,
                              platform="gpu", host_ram=None)
  assert memory_check.suggest(runner.program, small).startswith(
      "what would fit: ZeRO-3 with remat.policy=full and micro-batch 1 (~6.")
  cfg = config.load("configs/llama8b_zero3.py", ["mesh.pipeline=2", "mesh.fsdp=4",
                                                 "train.global_batch=8", "train.grad_accum=2"])
  runner = loop.prepare(cfg, devices, check=False)
  budget = dataclasses.replace(memory_check.budget(runner, devices), available=14 * 10**9,
                               platform="gpu", host_ram=None)
  assert memory_check.suggest(runner.program, budget).startswith(
      "ZeRO-3 with remat.policy=full and micro-batch 1 would fit on 32 such devices, each "
      "weight split 16 ways (~12.8")  # (GPipe: 3 ticks of residuals a stage, the bubble's too)
  # A run at all three already, which the rough estimate says would fit: not offered itself.
  at_all = loop.prepare(dataclasses.replace(cfg, remat=dataclasses.replace(
      cfg.remat, policy="full")), devices, check=False)  # (micro-batch 1 already)
  tight = dataclasses.replace(memory_check.budget(at_all, devices), platform="gpu",
                              host_ram=1)  # (no room for offload either)
  tight = dataclasses.replace(tight, available=tight.needed)
  assert "such devices" in memory_check.suggest(at_all.program, tight)


class GPU:
  """A virtual CPU device posing as an 80 GB GPU, for the check's accounting."""
  platform, device_kind = "gpu", "NVIDIA H100"

  def __init__(self, device):
    self._device = device

  def memory_stats(self):
    return {"bytes_limit": 80 * 10**9}

  def __getattr__(self, name):
    return getattr(self._device, name)


def test_weights_in_pinned_host_are_host_memory_checked_against_the_pool(monkeypatch):
  """Llama-3-70B, stage 3 over 8 GPUs with its weights in pinned_host: a process's pool
  holds 8 shards of the weights and of a micro-step's gradient (4 x 70.6e9 / 8 bytes each);
  XLA's default 64 GiB pool does not, and the check says so before anything starts."""
  monkeypatch.setattr(memory_check, "host_memory_bytes", lambda: 2000 * 10**9)
  monkeypatch.delenv(memory_check.pinned_pool.ENV, raising=False)
  cfg = config.load("configs/llama70b_zero3_offload.py",
                    ["offload.params=pinned_host", "offload.optimizer=device", "mesh.fsdp=8",
                     "zero.grad_dtype=bfloat16"])
  devices = jax.devices()[:8]
  runner = loop.prepare(cfg, devices, check=False)
  budget = memory_check.budget(runner, [GPU(d) for d in devices])
  assert 4 * 70.0e9 <= budget.pinned_process == budget.host_process - budget.save_copy <= 4 * 71.0e9
  assert budget.pinned_limit == 64 << 30 and not budget.host_fits
  assert memory_check.host_message(budget).startswith(
      "this run places about 282")
  assert "XLA's pinned host pool" in memory_check.host_message(budget)
  monkeypatch.setenv(memory_check.pinned_pool.ENV, "400")
  assert memory_check.budget(runner, [GPU(d) for d in devices]).host_fits


def test_the_sum_says_what_of_the_state_is_off_the_device():
  """ZeRO-Offload's state is mostly in host memory, ZeRO-Infinity's on disk: the line adds
  up to what the device holds."""
  import dataclasses
  b = memory_check.Budget(params=17_600_000_000, grads=17_600_000_000,
                          optimizer=105_800_000_000, host=105_800_000_000,
                          activations=15_200_000_000, available=180 * 10**9, where="",
                          devices=8, platform="gpu")
  assert b.needed == 17_600_000_000 * 2 + 15_200_000_000
  assert b.off_device_text == ", less 105.8 GB in host memory,"
  on_disk = dataclasses.replace(b, host=0, disk=b.state)
  assert on_disk.needed == b.activations
  assert on_disk.off_device_text == ", less 141.0 GB on disk,"
  assert dataclasses.replace(b, platform="cpu").off_device_text == ""  # host memory is the device's


def test_a_checkpoints_copy_of_the_device_state_is_host_memory(monkeypatch):
  """A save copies a process's share of the state off its devices before writing it:
  Llama-3.1-8B at stage 3 on one 8-GPU host, 14 bytes a parameter (bf16 weights, fp32
  master and moments), 112 GB, which a 100 GB host cannot hold."""
  from jaxzero.models.llama import count_params
  cfg = config.load("configs/llama8b_zero3.py", ["mesh.fsdp=8"])
  devices = jax.devices()[:8]
  runner = loop.prepare(cfg, devices, check=False)
  monkeypatch.setattr(memory_check, "host_memory_bytes", lambda: 100 * 10**9)
  budget = memory_check.budget(runner, [GPU(d) for d in devices])
  assert budget.save_copy == budget.host_process == pytest.approx(14 * count_params(cfg.model),
                                                                  rel=1e-3)
  assert not budget.host_fits
  assert "112.4 GB a checkpoint save copies off the devices" in memory_check.host_message(budget)
  on_a_cpu = memory_check.budget(runner, devices)  # host memory is the devices' memory there
  assert on_a_cpu.save_copy == on_a_cpu.host_process == 0


@pytest.mark.parametrize("sets, bytes_per_param", [
    (["zero.stage=0"], 14),  # replicated on every device: copied once
    (["offload.params=pinned_host", "mesh.fsdp=-1"], 4),  # the pool's: weights and gradient
])
def test_host_memory_comes_from_the_resolved_mesh_and_each_shard_once(sets, bytes_per_param):
  """Llama-3.1-8B on one host of 8 GPUs: a stage-0 save copies the replicated state once
  (14 bytes a parameter, not 8 x 14); the weights in pinned_host (fsdp=-1 resolved to 8) fill
  the pool with an eighth of the bf16 weights and gradient per device, 4 bytes a parameter
  in all (the config alone counted fsdp=-1 as 1 shard: 8 x that)."""
  from jaxzero.models.llama import count_params
  cfg = config.load("configs/llama8b_zero3.py", ["zero.grad_dtype=bfloat16", *sets])
  devices = jax.devices()[:8]
  budget = memory_check.budget(loop.prepare(cfg, devices, check=False),
                               [GPU(d) for d in devices])
  part = budget.pinned_process if "mesh.fsdp=-1" in sets else budget.save_copy
  assert part == pytest.approx(bytes_per_param * count_params(cfg.model), rel=2e-3)


def test_a_lora_base_in_pinned_host_has_no_gradient_in_the_pool(monkeypatch):
  """Llama-3.1-8B LoRA on one GPU with its bf16 base in pinned_host: the pool holds the
  base (16 GB) and the adapters' weights and gradient, not a gradient of the base (which
  made it 48 GB and refused the run on a 64 GB workstation)."""
  from jaxzero.models.llama import count_params
  monkeypatch.setattr(memory_check, "host_memory_bytes", lambda: 64 * 10**9)
  monkeypatch.setenv(memory_check.pinned_pool.ENV, "40")
  cfg = config.load("configs/llama8b_lora.py", ["mesh.fsdp=1", "offload.params=pinned_host"])
  devices = jax.devices()[:1]
  budget = memory_check.budget(loop.prepare(cfg, devices, check=False), [GPU(devices[0])])
  base = 2 * count_params(cfg.model)
  assert base <= budget.pinned_process <= base * 1.02, (budget.pinned_process, base)
  assert budget.host_fits, memory_check.host_message(budget)


def test_one_process_s_host_memory_is_its_devices_share():
  """ZeRO-Offload at stage 3 over 8 devices, as a process of 2 of them holds it: a quarter
  of the host store (12 bytes a parameter) and of a save's copy of the weights, and the
  whole update workspace (the planner poses such a process; its devices are all one's)."""
  cfg = config.load(TINY, ["offload.optimizer=pinned_host", "mesh.fsdp=8",
                           "train.global_batch=64", "train.grad_accum=1"])
  devices = jax.devices()[:8]
  runner = loop.prepare(cfg, devices, check=False)
  state = runner.plan()
  whole = host_memory.per_process(runner, state, devices, estimate_activations=True)
  two = host_memory.per_process(runner, state, devices[:2], estimate_activations=True)
  assert state["host_store"] == 8 * (state["host"] - state["pinned_pool"])
  assert whole.process == state["host_process"] + whole.save_copy
  assert two.save_copy == whole.save_copy // 4
  assert two.process == state["host_workspace"] + state["host_store"] // 4 + two.save_copy


def test_an_engines_check_takes_no_collective(monkeypatch):
  """An Engine may be built by some processes alone: its check must not wait for the others
  (processes_on_this_host is a collective), and counts no save's copy."""
  def collective():
    raise AssertionError("a collective")
  monkeypatch.setattr(memory_check, "processes_on_this_host", collective)
  cfg = config.load("configs/llama8b_zero3.py", ["mesh.fsdp=8"])
  devices = jax.devices()[:8]
  runner = loop.prepare(cfg, devices, check=False)
  for on in (devices, [GPU(d) for d in devices]):
    budget = memory_check.budget(runner, on, estimate_activations=False, whole_run=False)
    assert budget.save_copy == 0 and budget.host_processes == 1


def test_a_saves_copy_counts_each_distinct_shard_once():
  """A split leaf (each of its 4 shards), a replicated one (once) and a scalar, on this
  process's devices (a state's leaves divide evenly: jaxzero.parallel.padding)."""
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxzero.planning import host_memory
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  leaves = {"split": jax.ShapeDtypeStruct((12, 3), np.float32),
            "whole": jax.ShapeDtypeStruct((5,), np.float32),
            "step": jax.ShapeDtypeStruct((), np.int32)}
  shardings = {"split": NamedSharding(mesh, P("fsdp")), "whole": NamedSharding(mesh, P()),
               "step": NamedSharding(mesh, P())}
  assert host_memory.unique_bytes(leaves, shardings, jax.devices()) == (
      12 * 3 * 4 + 5 * 4 + 4)
  # A process of 2 of the 4 devices: 2 of the split leaf's shards.
  assert host_memory.unique_bytes(leaves, shardings, jax.devices()[2:4]) == (
      6 * 3 * 4 + 5 * 4 + 4)
