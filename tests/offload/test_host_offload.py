"""ZeRO-Offload: the optimizer state lives in host memory and is updated there, in
place, chunk by chunk (jaxzero.runners.host); every offload setting (the NVMe tier's
too) trains to the losses of no offload, DPU to its one-step-stale reference, and
Twin-Flow at any fraction to the same losses.

The CUDA lowering of the device program (made on this CPU machine) shows what a GPU
would run: the gradient step, with no optimizer state in it; offloaded weights stream
into the layer scan one layer at a time.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero.engine import TrainProgram, update
from jaxzero.models import trainable
from jaxzero.models.llama import LlamaConfig
from jaxzero.offload import host_store
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.parallel.zero import Layout
from jaxzero.runners import host
from jaxzero.runners import nvme as nvme_runner
from jaxzero.runners.choose import make_runner
from jaxzero.training import loop

from processes import TINY, child_env, run_python

STEPS = 3


def tiny(stage: int, optimizer="device", params="device", compute="float32", nvme_dir="",
         accum=2, **offload) -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128,
                        rope_theta=10_000.0),
      zero=config.ZeroConfig(stage=stage),
      mesh=config.MeshConfig(replica=1, fsdp=8),
      train=dataclasses.replace(c.train, steps=STEPS, global_batch=rows(accum) * accum,
                                grad_accum=accum,
                                seq_len=32, lr=3e-3, warmup_steps=1, clip_norm=0.05),
      precision=config.PrecisionConfig(compute=compute),
      offload=config.OffloadConfig(optimizer=optimizer, params=params, nvme_dir=nvme_dir,
                                   **offload))


def rows(accum: int) -> int:
  """A micro-step's rows: 16 a step, at least one per device."""
  return max(8, 16 // accum)


def engine(cfg: config.Config) -> TrainProgram:
  mesh = mesh_lib.make_mesh(1, 8, jax.devices()[:8])
  return TrainProgram(cfg, Layout.from_config(cfg, mesh), trainable.llama(cfg.model))


def batches(cfg: config.Config):
  accum = cfg.train.grad_accum
  return jax.random.randint(jax.random.key(0), (STEPS, accum, rows(accum), 33), 0, 256,
                            jnp.int32)


def losses(cfg: config.Config, steps: int = STEPS) -> np.ndarray:
  """The losses of `steps` steps by the runner `cfg` chooses (jaxzero.runners)."""
  e = engine(cfg)
  runner = make_runner(e, cfg.offload.nvme_dir or None)
  tokens = batches(cfg)
  state = runner.init()
  step = runner.compile(state, jax.device_put(tokens[0], e.batch_sharding))
  out = []
  for batch in tokens[:steps]:
    state, metrics = step(state, jax.device_put(batch, e.batch_sharding))
    out.append(float(metrics["loss"]))
  runner.close()  # the NVMe runner deletes its files
  return np.array(out)


@pytest.fixture(scope="module")
def no_offload():
  got = {}

  def trained(stage, accum=2):
    if (stage, accum) not in got:
      got[stage, accum] = losses(tiny(stage, accum=accum))
      assert np.all(np.diff(got[stage, accum]) != 0)  # the updates change the losses
    return got[stage, accum]
  return trained


# clip_norm=0.05 clips every step, so the host's clipping (by the norm computed
# on the device) is exercised too. At stage 2 the NVMe tier and the host stream their
# updates in chunks of at most 4 KiB, so that weights are cut along their unsplit
# dimensions as well as by layer (the weights of a chunk then go into the
# replicated compute copy in place).
# The fast lane keeps stage 3 with the weights and the optimizer on the host, and the NVMe
# tier at stage 1.
@pytest.mark.parametrize("stage,optimizer,params", [
    pytest.param(1, "pinned_host", "device", marks=pytest.mark.slow),
    pytest.param(2, "pinned_host", "device", marks=pytest.mark.slow),
    pytest.param(3, "pinned_host", "device", marks=pytest.mark.slow),
    pytest.param(3, "device", "pinned_host", marks=pytest.mark.slow),
    (3, "pinned_host", "pinned_host"), (1, "nvme", "device"),
    pytest.param(2, "nvme", "device", marks=pytest.mark.slow),
    pytest.param(3, "nvme", "device", marks=pytest.mark.slow),
    pytest.param(3, "nvme", "pinned_host", marks=pytest.mark.slow)])
def test_offload_trains_like_no_offload(no_offload, stage, optimizer, params, tmp_path,
                                       monkeypatch):
  cfg = tiny(stage, optimizer, params, nvme_dir=str(tmp_path))
  if stage == 2:  # (each runner's own limit: NvmeRunner's was read from nvme_store at import)
    for runner in (host.HostRunner, nvme_runner.NvmeRunner):
      monkeypatch.setattr(runner, "chunk_bytes", 4096)
    leaves = loop.prepare(cfg, jax.devices()[:8], check=False).leaves
    assert any(set(leaf.cut) - {0} for leaf in leaves)  # cut beyond the layers
  got = losses(cfg)
  np.testing.assert_allclose(got, no_offload(stage), rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("stage,accum", [(1, 1), (2, 4), (3, 4)])
def test_host_offload_at_any_accumulation_trains_like_no_offload(no_offload, stage, accum):
  got = losses(tiny(stage, "pinned_host", accum=accum))
  np.testing.assert_allclose(got, no_offload(stage, accum), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_twin_flow_at_any_fraction_trains_like_all_on_the_host(no_offload):
  # Half the layers' state on the device (updated there), half on the host; none on
  # the host but the weights outside the stack; all of it on the device.
  for fraction in (0.5, 0.0):
    got = losses(tiny(3, "pinned_host", optimizer_fraction=fraction))
    np.testing.assert_allclose(got, no_offload(3), rtol=1e-6, atol=0, err_msg=str(fraction))
  runner = make_runner(engine(tiny(3, "pinned_host", optimizer_fraction=0.5)))
  on_device = [(leaf.name, starts) for leaf in runner.leaves for starts in leaf.starts()
               if runner.keeps_on_device(leaf, starts)]
  assert on_device and {starts[0] for _, starts in on_device} == {0}  # the first of 2 layers
  full = make_runner(engine(tiny(3, "pinned_host"))).plan()
  assert runner.plan()["host"] < full["host"]


def one_step_stale(cfg: config.Config) -> np.ndarray:
  """DPU's schedule in memory: step n's gradient is taken on the weights from before
  step n - 1's update (step 0's on the first weights), and applied to the newest."""
  e = engine(dataclasses.replace(cfg, offload=config.OffloadConfig()))
  apply = jax.jit(update.make_update(cfg, e.inner), static_argnums=5)
  state = e.init()
  stale, out = state.params, []
  for batch in batches(cfg):
    grads, loss, norm = e.grad_step(stale, jax.device_put(batch, e.batch_sharding), None)
    stale = state.params
    master, opt_state, params = apply(grads, norm, state.master, state.opt_state,
                                      jnp.isfinite(loss), cfg.train.grad_accum)
    state = state._replace(master=master, opt_state=opt_state,
                           params=jax.device_put(params, e.shardings.params))
    out.append(float(loss))
  return np.array(out)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_delayed_update_equals_its_one_step_stale_reference(no_offload, stage):
  cfg = tiny(stage, "pinned_host", delayed_update=True, delayed_update_after=0)
  got = losses(cfg)
  np.testing.assert_allclose(got, one_step_stale(cfg), rtol=1e-6, atol=0)
  assert not np.allclose(got, no_offload(stage), rtol=1e-6)  # stale: not the exact losses
  # Its warm-up: exact steps first (after 1, step 2's gradient is on the exact weights,
  # step 3's on those before step 2's update); after them all, every step is exact.
  warmed = losses(tiny(stage, "pinned_host", delayed_update=True, delayed_update_after=1))
  np.testing.assert_allclose(warmed[:2], no_offload(stage)[:2], rtol=1e-6, atol=0)
  assert not np.allclose(warmed[2], no_offload(stage)[2], rtol=1e-6)
  np.testing.assert_allclose(losses(tiny(stage, "pinned_host", delayed_update=True)),
                             no_offload(stage), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_the_host_update_runs_in_place_and_its_device_program_holds_no_optimizer_state():
  cfg = tiny(3, "pinned_host", compute="bfloat16")
  e = engine(cfg)
  runner = make_runner(e)
  assert isinstance(runner, host.HostRunner)
  state = runner.init()
  buffers = runner.store.buffer_pointers()
  step = runner.compile(state, jax.device_put(batches(cfg)[0], e.batch_sharding))
  for batch in batches(cfg):
    state, _ = step(state, jax.device_put(batch, e.batch_sharding))
  # Every chunk was donated to its update and came back in the same host buffer.
  assert runner.store.buffer_pointers() == buffers
  state_bytes = sum(leaf.local_bytes for leaf in runner.leaves)
  assert runner.store.host_bytes == state_bytes == runner.host_bytes()
  assert runner.plan()["host_process"] == state_bytes + runner.workspace_bytes()
  # What a GPU runs: the gradient step, whose arguments are the bf16 weights and the
  # batch; no master weight or moment.
  _, signature, _ = cuda_main(cfg)
  arguments = re.findall(r"%arg\d+: tensor<([^>]*)>", signature)
  assert len(arguments) == len(jax.tree.leaves(e.abstract.params)) + 1
  assert not [a for a in arguments if a.endswith("f32")], arguments
  runner.close()


def test_the_chunks_the_update_has_in_flight_are_on_different_host_devices():
  """The store deals its chunks to the CPU devices in the update's order (layer by layer),
  so the chunks of one layer, updated at once, run on different devices (dealt leaf by
  leaf, a layer's chunks all landed on one device when the layers were a multiple of the
  devices)."""
  runner = make_runner(engine(tiny(3, "pinned_host")))
  store = runner.open_store()
  devices = [store.device_of(leaf, region, starts) for _, leaf, starts in runner.update_order()
             for region in leaf.regions if not runner.keeps_on_device(leaf, starts)]
  n = len(host_store.host_devices())
  assert n > 1 and len(devices) > n
  assert all(len(set(devices[i:i + n])) == n for i in range(len(devices) - n + 1))
  runner.close()


def functions(text: str) -> dict[str, str]:
  """{name: body} of every function of a lowered module."""
  parts = re.split(r"\n  func\.func (?:public|private) @(\w+)\(", text)
  return dict(zip(parts[1::2], parts[2::2]))


def cuda_main(cfg: config.Config) -> tuple[dict[str, str], str, str]:
  """The CUDA-lowered device program, the step or (the optimizer in host memory) the
  gradient step: (its functions, main's signature, main's body)."""
  e = engine(cfg)
  if cfg.offload.optimizer == "pinned_host":
    traced = e.grad_step.trace(e.abstract_state().params, e.abstract_batch(2), None)
  else:
    traced = e.train_step.trace(e.abstract_state(), e.abstract_batch(2))
  fns = functions(traced.lower(lowering_platforms=("cuda",)).as_text())
  signature, body = fns["main"].split("\n", 1)
  return fns, signature, body


def called_inside_loops(fns: dict[str, str]) -> set[str]:
  """The functions some `stablehlo.while` body calls, directly or through others."""
  inside = set()
  for body in fns.values():
    lines = body.splitlines()
    for i, line in enumerate(lines):
      if "stablehlo.while(" not in line:
        continue
      indent = line[:len(line) - len(line.lstrip())]
      end = next(j for j in range(i + 1, len(lines)) if lines[j] == indent + "}")
      inside |= set(re.findall(r"\bcall @(\w+)\(", "\n".join(lines[i:end])))
  frontier = set(inside)
  while frontier:
    frontier = {c for f in frontier for c in re.findall(r"\bcall @(\w+)\(", fns[f])} - inside
    inside |= frontier
  return inside


def device_placements(body: str) -> list[tuple[tuple[int, ...], str]]:
  """(shape, the value placed) of every bf16 array a function places in device memory."""
  found = re.findall(r'annotate_device_placement\((%[\w#]+)\) \{[^}]*_xla_buffer_placement = '
                     r'"device"\}[^:]*: \(tensor<([^>]*bf16)>\)', body)
  return [(tuple(int(d) for d in shape.split("x")[:-1]), value) for value, shape in found]


def from_a_loop(body: str, value: str) -> bool:
  """Whether `value` is (a sharding constraint of) a result of a `stablehlo.while`."""
  defined = re.search(rf"\n\s*{re.escape(value)} = (.*)", body).group(1)
  source = re.match(r"sdy\.sharding_constraint (%\w+)#\d+", defined)
  return bool(source) and bool(
      re.search(rf"\n\s*{source.group(1)}:\d+ = stablehlo\.while\(", body))


@pytest.mark.parametrize("optimizer", ["device", "pinned_host"])
def test_cuda_step_streams_offloaded_weights_one_layer_at_a_time(optimizer):
  """With offload.params=pinned_host (stage 3) each layer's weight shards move to
  the device inside the layer scan, one layer at a time; no stacked weight is
  ever placed on the device. (The gradient of a weight left in pinned_host is
  typed pinned_host by JAX: each layer's reduced shard goes down in the backward
  scan, and the micro-step's gradient comes back after it.)"""
  cfg = tiny(3, optimizer=optimizer, params="pinned_host", compute="bfloat16")
  fns, _, _ = cuda_main(cfg)
  stacks = {tuple(s.shape) for s in jax.tree.leaves(engine(cfg).abstract.params["layers"])}
  layers = {shape[1:] for shape in stacks}
  placed = {name: device_placements(body) for name, body in fns.items()}
  # At the start of the step only the embedding, the head and the final norm come over.
  rest = [tuple(s.shape) for k, s in engine(cfg).abstract.params.items() if k != "layers"]
  assert sorted(s for s, _ in placed.pop("main")) == sorted(rest)
  per_layer = {name for name, found in placed.items() if {s for s, _ in found} & layers}
  assert layers <= {s for found in placed.values() for s, _ in found}
  assert per_layer and per_layer <= called_inside_loops(fns), per_layer
  # Stacks come to the device only as the backward layer scan's results: gradients.
  for name, found in placed.items():
    for shape, value in found:
      if shape in stacks:
        assert from_a_loop(fns[name], value), (name, shape, value)


def test_evaluation_streams_offloaded_weights_as_the_step_does():
  """The held-out loss under offload.params=pinned_host brings only the embedding, the
  head and the final norm over at its start; each layer's shards come in the scan."""
  from jaxzero.training import evaluation
  cfg = tiny(3, params="pinned_host", compute="bfloat16")
  e = engine(cfg)
  batches = jax.ShapeDtypeStruct((2, *e.abstract_batch(2).shape[1:]), np.int32,
                                 sharding=e.batch_sharding)
  state = e.abstract_state()
  text = evaluation.make_eval_step(e).trace(state.params, None, batches).lower(
      lowering_platforms=("cuda",)).as_text()
  fns = functions(text)
  rest = [tuple(s.shape) for k, s in e.abstract.params.items() if k != "layers"]
  assert sorted(s for s, _ in device_placements(fns.pop("main").split("\n", 1)[1])) == sorted(
      rest)
  layers = {tuple(s.shape[1:]) for s in jax.tree.leaves(e.abstract.params["layers"])}
  assert layers <= {s for body in fns.values() for s, _ in device_placements(body)}


# Two processes of 4 devices each (jaxzero.launch) with offload, against one
# process without: the optimizer in host memory or in the NVMe tier at stages
# 1-3, the weights in host memory at stage 3 (the only stage that offloads
# them), alone and with the optimizer there. The NVMe tier across processes
# resuming an in-memory checkpoint is in tests/test_nvme.py.
LAUNCH_SETS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.seq_len=32",
               "train.global_batch=16", "train.grad_accum=2", "train.lr=3e-3",
               "train.warmup_steps=1", "train.steps=3", "train.log_every=1",
               "data.max_bytes=200000", "mesh.replica=1", "mesh.fsdp=8"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """losses(stage): one process without offload, trained once per stage."""
  trained = {}

  def losses(stage):
    if stage not in trained:
      cfg = config.load(TINY, LAUNCH_SETS + [f"zero.stage={stage}", "checkpoint.at_end=false"])
      history = loop.train(cfg, tmp_path_factory.mktemp(f"one_stage{stage}"),
                              devices=jax.devices()[:8], progress=False)
      trained[stage] = [h["loss"] for h in history]
    return trained[stage]
  return losses


# Each tier once (the in-process tests cover every stage and tier on one process, and
# tests/offload/test_nvme.py two processes at stage 2 on the NVMe tier).
@pytest.mark.parametrize("stage,offload", [
    (3, ["offload.optimizer=pinned_host", "offload.params=pinned_host"]),
    (1, ["offload.optimizer=nvme"])],
    ids=lambda x: f"stage{x}" if isinstance(x, int) else "+".join(
        s.replace("offload.", "").replace("=", ":") for s in x))
@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_with_offload_train_like_one_without(tmp_path, one_process, stage, offload):
  if "offload.optimizer=nvme" in offload:  # both processes' stores in one directory
    (tmp_path / "nvme").mkdir()
    offload = [*offload, f"offload.nvme_dir={tmp_path / 'nvme'}"]
  sets = LAUNCH_SETS + [f"zero.stage={stage}"]
  # Compiled with the fast-compile flags, as this process compiles (conftest.py).
  result = run_python("-m", "jaxzero.launch", "--nproc", "2", "--devices-per-proc", "4", "--",
                      "--config", TINY, "--workdir", str(tmp_path / "two"), "--no-progress",
                      *[a for s in sets + offload for a in ("--set", s)],
                      env=child_env(alone=True), timeout=400)
  assert result.returncode == 0, result.stderr[-3000:]
  lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
  two = [json.loads(line)["loss"] for line in lines]
  assert len(two) == 3
  np.testing.assert_allclose(two, one_process(stage), rtol=1e-6, atol=0)
  if "offload.optimizer=nvme" in offload[0]:  # the tier ran, and each process deleted its store
    assert (tmp_path / "two" / "checkpoints" / "3" / "nvme" / "index.json").exists()
    assert not list((tmp_path / "nvme").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, params", [
    ("pinned_host", "device"),
    ("nvme", "device"),
    ("nvme", "nvme")],
    ids=["host", "nvme", "infinity"])
def test_a_checkpoint_of_another_precision_resumes_under_offload(optimizer, params, tmp_path):
  """Saved in bfloat16, resumed in float32: every runner makes its compute copy from the
  float32 masters, as its steps do (ZeRO-Infinity keeps none and computes from them), so
  all train on as the in-memory run does; from the bfloat16 copy cast up, the first step
  differed by that rounding (1.6e-4 here)."""
  def run(workdir, steps, compute, *where):
    cfg = tiny(3, *where, compute=compute, nvme_dir=str(tmp_path / "nvme"))
    history = loop.train(cfg, workdir, steps, devices=jax.devices()[:8], progress=False)
    return [h["loss"] for h in history]

  (tmp_path / "nvme").mkdir()
  offloaded = (optimizer, params)
  for workdir, where in ((tmp_path / "in_memory", ()), (tmp_path / "offload", offloaded)):
    run(workdir, 2, "bfloat16", *where)
  want = run(tmp_path / "in_memory", 3, "float32")
  got = run(tmp_path / "offload", 3, "float32", *offloaded)
  assert len(got) == 1 and np.isfinite(got[0])
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("offload", [dict(optimizer="pinned_host"),
                                     dict(optimizer="pinned_host", delayed_update=True,
                                          delayed_update_after=0)],
                         ids=["host", "dpu"])
def test_an_offloaded_run_evaluates_the_state_it_saves(offload, tmp_path):
  """Evaluation under ZeRO-Offload (it crashed: the offloaded state has no frozen weights):
  the held-out loss at the last step is that of the checkpoint the step saves, DPU's update
  in flight applied, as an in-memory run evaluates it."""
  from jaxzero.checkpoint import checkpointer as checkpoint_lib
  from jaxzero.runners import base as runners_base
  from jaxzero.training import evaluation
  sets = dict(data=config.DataConfig(max_bytes=200_000, eval_fraction=0.1),
              eval=config.EvalConfig(every=2, batches=1))
  cfg = dataclasses.replace(tiny(3, **offload), **sets,
                            train=dataclasses.replace(tiny(3).train, steps=2))
  history = loop.train(cfg, tmp_path, devices=jax.devices()[:8], progress=False)
  in_memory = dataclasses.replace(cfg, offload=config.OffloadConfig())
  run = loop.build(in_memory, jax.devices()[:8])
  checkpoints = runners_base.checkpointer(tmp_path, None, checkpoint_lib.run_info(
      cfg.model, cfg.precision.compute, cfg.seed))
  state = run.runner.restore(checkpoints, 2, run.program.abstract_state())
  checkpoints.close()
  saved = evaluation.Evaluator(run.program, run.eval_batches, state)(state)["eval_loss"]
  assert history[-1]["eval_loss"] == pytest.approx(saved, rel=1e-6)
