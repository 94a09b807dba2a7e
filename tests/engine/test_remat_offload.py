"""Remat policies and host offload change where memory goes, never the numbers."""

import pathlib

import jax
import numpy as np
import pytest

from jaxzero import config
from jaxzero.engine.remat import POLICY_NAMES
from jaxzero.training import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_zero3.py")
# test_step's tiny model (float32, ZeRO-3 on 8 devices), for four steps.
SMALL = {"model.dim": "64", "model.n_layers": "2", "model.mlp_dim": "128",
         "train.global_batch": "16", "train.seq_len": "32", "train.steps": "4",
         "train.log_every": "1", "data.max_bytes": "500000"}
# Runs that only compare losses save no checkpoint at their last step.
NO_SAVE = {"checkpoint.at_end": "false"}


def train_losses(workdir: pathlib.Path, **overrides) -> np.ndarray:
  """Losses of loop.train (what `python -m jaxzero.train` runs) on the small model.

  In this process, which compiles with the planner's fast-compile flags
  (conftest.py): LLVM optimisation off, which triples the speed of this test
  and changes no arithmetic (every run here uses the same flags).
  """
  cfg = config.load(TINY, [f"{key}={value}"
                           for key, value in {**SMALL, **NO_SAVE, **overrides}.items()])
  history = loop.train(cfg, workdir, devices=jax.devices()[:8], progress=False)
  return np.array([h["loss"] for h in history])


@pytest.fixture(scope="module")
def default_losses(tmp_path_factory):
  got = train_losses(tmp_path_factory.mktemp("default"))
  assert len(got) == 4 and got[-1] < got[0]
  return got


# The fast lane keeps save_attention; the other policies are slow.
@pytest.mark.parametrize("policy", [
    pytest.param(p, marks=pytest.mark.slow) if p != "save_attention" else p
    for p in POLICY_NAMES if p != "none"])
def test_remat_policy_trains_to_the_same_losses(policy, default_losses, tmp_path):
  got = train_losses(tmp_path, **{"remat.policy": policy})
  np.testing.assert_allclose(got, default_losses, rtol=1e-5)


def memory_kinds(tree) -> set[str]:
  return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def check_offloaded(state):
  """The weights in pinned_host; the master weights and Adam moments in the host
  runner's store (none in the state's arrays); the step and optax's scalar step counts
  on the device."""
  assert memory_kinds(state.params) == {"pinned_host"}
  assert jax.tree.leaves(state.master) == []  # None at every leaf: the store holds them
  assert state.store.host_bytes == 12 * sum(x.size for x in jax.tree.leaves(state.params))
  scalars = jax.tree.leaves(state.opt_state)
  assert scalars and all(not x.ndim for x in scalars) and memory_kinds(scalars) == {"device"}
  assert memory_kinds(state.step) == {"device"}


@pytest.mark.slow
def test_offloaded_state_lives_in_pinned_host_after_init_and_after_a_step(default_losses):
  cfg = config.load(TINY, [f"{k}={v}" for k, v in SMALL.items()]
                    + ["offload.optimizer=pinned_host", "offload.params=pinned_host"])
  run = loop.build(cfg)
  state = run.runner.init()
  check_offloaded(state)
  batch = run.batch(0)
  state, metrics = run.runner.compile(state, batch)(state, batch)
  check_offloaded(state)
  run.runner.close()
  np.testing.assert_allclose(float(metrics["loss"]), default_losses[0], rtol=1e-5)
