"""ZeRO-Offload: the optimizer runs on the host where its state lives, and every
offload setting (the NVMe tier's too) trains to the losses of no offload.

The CUDA lowering of the step (made on this CPU machine) shows what a GPU
would run: the master weights and Adam moments are used only by the update,
which is host compute; only the new compute copy goes to the device.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero.engine import TrainProgram
from jaxzero.models import trainable
from jaxzero.models.llama import LlamaConfig
from jaxzero.offload import nvme_store
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.parallel.zero import Layout
from jaxzero.planning import planner
from jaxzero.runners import nvme
from jaxzero.training import loop

from processes import TINY, child_env, run_python

STEPS = 3


def tiny(stage: int, optimizer="device", params="device", compute="float32",
         nvme_dir="") -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128,
                        rope_theta=10_000.0),
      zero=config.ZeroConfig(stage=stage),
      mesh=config.MeshConfig(replica=1, fsdp=8),
      train=dataclasses.replace(c.train, steps=STEPS, global_batch=16, grad_accum=2, seq_len=32,
                                lr=3e-3, warmup_steps=1, clip_norm=0.05),
      precision=config.PrecisionConfig(compute=compute),
      offload=config.OffloadConfig(optimizer=optimizer, params=params, nvme_dir=nvme_dir))


def engine(cfg: config.Config) -> TrainProgram:
  mesh = mesh_lib.make_mesh(1, 8, jax.devices()[:8])
  return TrainProgram(cfg, Layout.from_config(cfg, mesh), trainable.llama(cfg.model))


def losses(cfg: config.Config) -> np.ndarray:
  e = engine(cfg)
  tokens = jax.random.randint(jax.random.key(0), (STEPS, 2, 16, 33), 0, 256, jnp.int32)
  tier = None
  if cfg.offload.optimizer == "nvme":  # the state in files; the update streamed outside the step
    tier = nvme.NvmeRunner(e, nvme.store_directory(cfg.offload.nvme_dir, cfg.offload.nvme_dir))
    state = tier.init()
    step = tier.compile(state, jax.device_put(tokens[0], e.batch_sharding))
  else:
    state = e.init()
    step = e.train_step.lower(state, e.abstract_batch(2)).compile(
        compiler_options=planner.FAST_COMPILE_OPTIONS)
  out = []
  for batch in tokens:
    state, metrics = step(state, jax.device_put(batch, e.batch_sharding))
    out.append(float(metrics["loss"]))
  if tier is not None:
    tier.close()  # deletes its files
  return np.array(out)


@pytest.fixture(scope="module")
def no_offload():
  got = {stage: losses(tiny(stage)) for stage in (1, 2, 3)}
  assert all(np.all(np.diff(g) != 0) for g in got.values())  # the updates change the losses
  return got


# clip_norm=0.05 clips every step, so the host's clipping (by the norm computed
# on the device) is exercised too. At stage 2 the NVMe tier streams its update
# in chunks of at most 4 KiB, so that weights are cut along their unsplit
# dimensions as well as by layer (the weights of a chunk then go into the
# replicated compute copy in place).
@pytest.mark.parametrize("stage,optimizer,params", [
    (1, "pinned_host", "device"), (2, "pinned_host", "device"), (3, "pinned_host", "device"),
    (3, "device", "pinned_host"), (3, "pinned_host", "pinned_host"),
    (1, "nvme", "device"), (2, "nvme", "device"), (3, "nvme", "device"),
    (3, "nvme", "pinned_host")])
def test_offload_trains_like_no_offload(no_offload, stage, optimizer, params, tmp_path,
                                       monkeypatch):
  if stage == 2:
    monkeypatch.setattr(nvme_store, "CHUNK_BYTES", 4096)
  got = losses(tiny(stage, optimizer, params, nvme_dir=str(tmp_path)))
  np.testing.assert_allclose(got, no_offload[stage], rtol=1e-6, atol=0)


def functions(text: str) -> dict[str, str]:
  """{name: body} of every function of a lowered module."""
  parts = re.split(r"\n  func\.func (?:public|private) @(\w+)\(", text)
  return dict(zip(parts[1::2], parts[2::2]))


def cuda_main(cfg: config.Config) -> tuple[dict[str, str], str, str]:
  """The CUDA-lowered step: (its functions, main's signature, main's body)."""
  e = engine(cfg)
  fns = functions(e.train_step.trace(e.abstract_state(), e.abstract_batch(2)).lower(
      lowering_platforms=("cuda",)).as_text())
  signature, body = fns["main"].split("\n", 1)
  return fns, signature, body


def host_arguments(signature: str) -> list[str]:
  args = re.findall(r"(%arg\d+): tensor<([^>]*)> \{([^}]*)\}", signature)
  return [(name, shape) for name, shape, attrs in args if '"pinned_host"' in attrs]


@pytest.mark.parametrize("stage", [1, 3])
def test_cuda_step_keeps_optimizer_state_on_the_host(stage):
  cfg = tiny(stage, optimizer="pinned_host", compute="bfloat16")
  fns, signature, body = cuda_main(cfg)
  host = host_arguments(signature)
  n_weights = len(jax.tree.leaves(engine(cfg).abstract.master))
  assert len(host) == 3 * n_weights  # master, Adam mu, Adam nu; all float32
  assert all(shape.endswith("xf32") for _, shape in host)
  # Each is used by one operation only: the call of the host-compute update.
  calls = re.findall(r"= call @(\w+)\(([^)]*)\)", body)
  for name, _ in host:
    users = [callee for callee, operands in calls if re.search(rf"{name}\b", operands)]
    assert len(users) == 1, name
    assert len(re.findall(rf"{name}\b", body)) == 1, f"{name} has a use besides the update"
  (update,) = {callee for callee, operands in calls if host[0][0] in operands}
  fn = fns[update]
  # Every array operation is marked host compute (scalars, e.g. Adam's step
  # count as a float, and constants may be left to the device).
  ops = [line for line in fn.splitlines()[1:] if " = stablehlo." in line
         and "x" in re.findall(r"tensor<([^>]*)>", line)[-1]]
  assert len(ops) > 10 * n_weights
  assert all('_xla_compute_type = "host"' in line for line in ops)
  # What comes back to the device: the gradient shards go down to the host,
  # and the only device placements after the update are the new bf16 weights.
  after = body[body.index(f"call @{update}("):]
  to_device = re.findall(r'annotate_device_placement\(%[\w#]+\) \{[^}]*_xla_buffer_placement = '
                         r'"device"\}[^:]*: \(tensor<([^>]*)>\)', after)
  arrays_to_device = [s for s in to_device if "x" in s]  # (scalars: the step, metrics)
  assert len(arrays_to_device) >= n_weights
  assert all(s.endswith("xbf16") for s in arrays_to_device), arrays_to_device
  to_host = re.findall(r'_xla_buffer_placement = "pinned_host"\}[^:]*: \(tensor<([^>]*)>\)', body)
  assert len(to_host) >= n_weights


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
      cfg = config.load(TINY, LAUNCH_SETS + [f"zero.stage={stage}"])
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
