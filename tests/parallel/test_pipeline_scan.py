"""The pipelined layer scan (jaxzero.parallel.pipeline): the plain scan's values and
gradients, with the stages on the devices of the pipeline axis and only activations
crossing between them (a collective-permute), for 2 and 4 stages, and circular over 2
and 4 virtual stages."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.parallel import one_f_one_b, pipeline


def layer(x, w):
  return jnp.tanh(x @ w), None


def plain(stacked, x):
  return jax.lax.scan(layer, x, stacked)[0]


@pytest.mark.parametrize("stages,micro,virtual", [(2, 4, 1), (4, 4, 1), (4, 8, 1), (2, 3, 2),
                                                  (2, 2, 4)])
def test_values_and_gradients_are_the_plain_scan(stages, micro, virtual):
  mesh = jax.make_mesh((stages,), (pipeline.PIPELINE,), devices=jax.devices()[:stages],
                       axis_types=(jax.sharding.AxisType.Auto,))
  by_stage = NamedSharding(mesh, P(pipeline.PIPELINE))
  scan = pipeline.gpipe_scan(stages, micro, lambda t: jax.lax.with_sharding_constraint(t, by_stage),
                             virtual)
  k1, k2 = jax.random.split(jax.random.key(0))
  stacked = jax.device_put(jax.random.normal(k1, (8, 16, 16)) / 4, by_stage)
  x = jax.random.normal(k2, (micro * 2, 16))
  loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)
  piped = jax.jit(jax.value_and_grad(loss(lambda w, x: scan(layer, x, w)), argnums=(0, 1)))
  expected = jax.value_and_grad(loss(plain), argnums=(0, 1))(np.asarray(stacked), x)
  chex.assert_trees_all_close(piped(stacked, x), expected, rtol=1e-5, atol=1e-6)
  hlo = piped.lower(stacked, x).compile().as_text()
  assert "collective-permute" in hlo
  if virtual == 1:  # each device holds its own stage's layers, never the stack
    grads = piped(stacked, x)[1][0]
    assert grads.sharding.shard_shape(grads.shape) == (8 // stages, 16, 16)


def test_the_bubble():
  assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pipeline.bubble_fraction(4, 8, "1f1b") == pytest.approx(3 / 11)
  assert pipeline.bubble_fraction(4, 8, "interleaved", virtual=2) == pytest.approx(3 / 19)
  assert (pipeline.inputs_held(4, 8), pipeline.inputs_held(4, 8, "1f1b")) == (8, 4)
  # Kept for the backward (residual sets, extra stage inputs): GPipe every tick's
  # residuals, the bubble's too; interleaved each tick's chunk input and one chunk's
  # residuals (it was counted as GPipe's, 2.9x over XLA's); 1F1B S inputs.
  assert pipeline.kept_for_backward(4, 8) == (11, 0)
  assert pipeline.kept_for_backward(4, 8, "interleaved", virtual=2) == (0.5, 19)
  assert pipeline.kept_for_backward(4, 8, "1f1b") == (2, 4)
  np.testing.assert_equal(pipeline.bubble_fraction(1, 8), 0.0)


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_1f1b_slots(stages):
  """Each stage runs every micro-batch's forward and backward once, one a slot; its input
  comes from the slot before (the previous stage's forward, the next stage's backward,
  the last stage's own forward); at most S - s micro-batches are live on stage s; a step
  is 2 (M + S - 1) slots."""
  for micro in range(stages, stages + 4):
    slots = 2 * (micro + stages - 1)
    forward, backward = {}, {}
    for t in range(slots + 2):
      for s in range(stages):
        f_ok, i, b_ok, j = one_f_one_b.slot_work(t, s, stages, micro)
        assert not (f_ok and b_ok)
        assert t < slots or not (f_ok or b_ok)
        if f_ok:
          forward[s, i] = t
        if b_ok:
          backward[s, j] = t
    every = {(s, m) for s in range(stages) for m in range(micro)}
    assert set(forward) == set(backward) == every
    for s, m in every:
      if s:
        assert forward[s, m] == forward[s - 1, m] + 1
      after = forward[s, m] if s == stages - 1 else backward[s + 1, m]
      assert backward[s, m] == after + 1
      live = sum(forward[s, k] <= forward[s, m] < backward[s, k] for k in range(micro))
      assert live <= stages - s
