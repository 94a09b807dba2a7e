"""What the host runner keeps on the device beside its gradient program, as the plan and
the start-up check count it: Twin-Flow's optimizer layers (DeepSpeed's split of them) and
DPU's copy of the weights, and no more (the update in flight holds no gradient that is
already on its way down)."""

import threading

import jax
import pytest

from jaxzero.planning import memory_check, planner
from jaxzero.runners.choose import make_runner

from offload.test_host_offload import batches, engine, tiny


def host_layers(fraction: float) -> int:
  runner = make_runner(engine(tiny(3, "pinned_host", optimizer_fraction=fraction)))
  return runner.n_layers - runner.device_layers


def test_twin_flow_splits_the_layers_as_deepspeed_s_ratio():
  """int((1 - ratio) x layers) stay on the device (DeepSpeed's stage3.py): of 2 layers,
  ratio 0.25 puts 1 on the host (rounding half to even put none), 0.75 both."""
  assert [host_layers(f) for f in (0.0, 0.25, 0.5, 0.75, 1.0)] == [0, 1, 1, 2, 2]


def test_the_plan_and_the_check_count_what_the_runner_keeps_on_the_device():
  devices = jax.devices()[:8]
  def counted(**offload):
    runner = make_runner(engine(tiny(3, "pinned_host", **offload)))
    state = runner.plan()
    budget = memory_check.budget(runner, devices, whole_run=False)
    return state, planner.beside_program(runner, state), budget.needed
  state, all_host, needed = counted()
  _, all_device, _ = counted(optimizer_fraction=0.0)
  _, half, _ = counted(optimizer_fraction=0.5)
  delayed_state, delayed, delayed_needed = counted(delayed_update=True)
  # Twin-Flow at 0 keeps the whole optimizer state beside the program, as no offload
  # does in it (the plan left it out: "fits" where it did not).
  assert all_host <= 8 < half < all_device == state["optimizer"]  # (8: the step counts)
  # DPU: a second copy of the weights, in the plan and in the start-up check.
  assert delayed - all_host == delayed_state["delayed_device"] == state["params"] > 0
  assert delayed_needed == needed + state["params"]


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_delayed_update_holds_what_the_plan_counts_on_the_device(fraction):
  """The device's live bytes after each gradient step: DPU's are one weights' copy over
  the exact update's (it held the whole gradient too, for the update in flight), and
  under Twin-Flow the gradients of the leaves updated on the device: what the plan says."""
  def live_after_gradient_steps(delayed: bool) -> tuple[list[float], int]:
    cfg = tiny(3, "pinned_host", delayed_update=delayed, delayed_update_after=0,
               optimizer_fraction=fraction)
    program = engine(cfg)
    runner = make_runner(program)
    mesh_devices = set(program.layout.mesh.devices.flat)
    seen, gradients = [], runner._gradients  # pylint: disable=protected-access

    def measured(*args, **kwargs):
      out = jax.block_until_ready(gradients(*args, **kwargs))
      live = [a for a in jax.live_arrays() if a.sharding.device_set == mesh_devices]
      seen.append(sum(a.nbytes / (1 if a.sharding.is_fully_replicated else len(mesh_devices))
                      for a in live))
      measured_once.set()
      return out
    runner._gradients = measured  # pylint: disable=protected-access
    # The update in flight waits until the next gradient step is measured: what DPU
    # holds then does not depend on how fast the host updates.
    measured_once, update = threading.Event(), runner._update  # pylint: disable=protected-access

    def held(*args, **kwargs):
      measured_once.wait()
      measured_once.clear()
      return update(*args, **kwargs)
    runner._update = held  # pylint: disable=protected-access
    tokens = batches(cfg)
    state = runner.init()
    step = runner.compile(state, jax.device_put(tokens[0], program.batch_sharding))
    for batch in tokens:
      state, _ = step(state, jax.device_put(batch, program.batch_sharding))
    planned = runner.plan()["delayed_device"]
    runner.close()
    return seen, planned
  exact, _ = live_after_gradient_steps(False)
  delayed, planned = live_after_gradient_steps(True)
  # (Beside it, a few gradient boxes still on their way down: 15-31% seen; the whole
  # gradient held was 100% more.)
  extra = delayed[-1] - exact[-1]
  assert 0.9 * planned <= extra <= 1.4 * planned, (extra, planned)


@pytest.mark.slow
def test_parameters_in_a_top_level_list_update_on_the_host():
  """A user's parameters as a list of subtrees (Model.specs is any tree): the update took
  the list for its flattened gradient leaves (an AttributeError)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import jaxzero  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def init(key):
    k1, k2 = jax.random.split(key)
    return [{"w": jax.random.normal(k1, (16, 64)) * 0.2, "b": jnp.zeros((64,))},
            {"w": jax.random.normal(k2, (64, 8)) * 0.2, "b": jnp.zeros((8,))}]

  def apply(p, x):
    return jnp.tanh(x @ p[0]["w"] + p[0]["b"]) @ p[1]["w"] + p[1]["b"]

  def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
  rng = np.random.default_rng(2)
  batches = [{"x": rng.normal(size=(16, 16)).astype(np.float32),
              "y": rng.normal(size=(16, 8)).astype(np.float32)} for _ in range(2)]
  losses = {}
  for offload in (None, "pinned_host"):
    e = jaxzero.Engine((init, apply), optimizer=optax.adamw(1e-2), loss_fn=loss_fn,
                       zero=jaxzero.Zero(stage=3),
                       mesh=jaxzero.mesh(fsdp=8, devices=jax.devices()[:8]),
                       min_shard_size=0, offload=offload)
    state, losses[offload] = e.init(jax.random.key(0)), []
    for batch in batches:
      state, metrics = e.step(state, batch)
      losses[offload].append(float(metrics["loss"]))
    e.close()
  np.testing.assert_allclose(losses["pinned_host"], losses[None], rtol=1e-6)

