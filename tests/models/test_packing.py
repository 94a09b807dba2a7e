"""Packed sequences: examples packed into one row with segment ids give each example the
loss and gradient it has alone in a row (attention and positions stay within it, in the
XLA and blockwise attention paths), and tokens the loss mask leaves out contribute
nothing to the loss or the gradient."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.models import trainable
from jaxzero.models.attention import attention
from jaxzero.models.interface import Hooks
from jaxzero.models.llama import LlamaConfig

CFG = LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64,
                  rope_theta=10_000.0)
LENGTHS = (7, 12, 5)  # three examples packed into one row of 24 tokens (T + 1)


def examples():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 97, n).astype(np.int32) for n in LENGTHS]


@pytest.mark.slow  # the loss-level test below keeps packing in the fast lane
@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_packed_attention_is_each_segment_alone(implementation):
  rng = np.random.default_rng(1)
  seg = np.repeat(np.arange(3), [5, 8, 3])[None]  # T = 16
  q, k, v = (jnp.asarray(rng.standard_normal((1, 16, 4, 8)), jnp.float32) for _ in range(3))

  def packed(q, k, v):
    return attention(q, k, v, implementation=implementation, block=4,
                     segment_ids_BxT=jnp.asarray(seg))

  def alone(q, k, v):
    bounds = np.cumsum([0, 5, 8, 3])
    return jnp.concatenate([attention(q[:, a:b], k[:, a:b], v[:, a:b], implementation="xla")
                            for a, b in zip(bounds[:-1], bounds[1:])], axis=1)

  chex.assert_trees_all_close(packed(q, k, v), alone(q, k, v), atol=1e-5)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  chex.assert_trees_all_close(jax.grad(loss(packed), argnums=(0, 1, 2))(q, k, v),
                              jax.grad(loss(alone), argnums=(0, 1, 2))(q, k, v), atol=1e-5)


@pytest.mark.parametrize("attention_path",
                         [pytest.param("xla", marks=pytest.mark.slow), "blockwise"])
def test_a_packed_row_gives_each_example_its_own_loss_and_gradient(attention_path):
  cfg = dataclasses.replace(CFG, attention=attention_path)
  model = trainable.llama(cfg)
  params = model.init(jax.random.key(0))
  parts = examples()
  # Packed: one row of the three examples; a loss mask that keeps the middle example's
  # second half only (an "assistant's answer").
  tokens = np.concatenate(parts)[None]
  segment_ids = np.repeat(np.arange(3), LENGTHS)[None].astype(np.int32)
  loss_mask = np.zeros_like(tokens)
  loss_mask[0, 7 + 6:7 + 12] = 1
  packed = {"tokens": tokens, "segment_ids": segment_ids, "loss_mask": loss_mask}

  def packed_loss(p):
    return model.loss(p, jax.tree.map(jnp.asarray, packed), Hooks())

  # Alone: the middle example in a row of its own, with the same loss mask.
  alone = {"tokens": parts[1][None], "loss_mask": loss_mask[:, 7:19]}

  def alone_loss(p):
    return model.loss(p, jax.tree.map(jnp.asarray, alone), Hooks())

  np.testing.assert_allclose(packed_loss(params), alone_loss(params), rtol=1e-5)
  chex.assert_trees_all_close(jax.grad(packed_loss)(params), jax.grad(alone_loss)(params),
                              atol=1e-6)


@pytest.mark.slow
def test_masked_tokens_contribute_nothing():
  model = trainable.llama(CFG)
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, 97, (2, 17)).astype(np.int32)
  mask = np.zeros_like(tokens)
  mask[:, 9:] = 1  # the "prompt" is tokens 0..8: never predicted
  batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask)}
  weights = trainable.unpack_batch(batch)[2]
  assert np.all(np.asarray(weights)[:, :8] == 0) and np.all(np.asarray(weights)[:, 8:] == 1)
  # The loss equals the plain mean over the kept targets only.
  from jaxzero.models.llama import decoder_forward  # pylint: disable=import-outside-toplevel
  x, head = decoder_forward(CFG, params, jnp.asarray(tokens[:, :-1]))
  logits = jnp.einsum("btd,dv->btv", x, head)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens[:, 1:, None]),
                             axis=-1)[..., 0]
  want = float(jnp.mean(nll[:, 8:]))
  np.testing.assert_allclose(float(model.loss(params, batch, Hooks())), want, rtol=1e-5)
  # A batch that predicts nothing: loss 0 and no gradient.
  nothing = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.zeros_like(jnp.asarray(mask))}
  grads = jax.grad(lambda p: model.loss(p, nothing, Hooks()))(params)
  assert float(model.loss(params, nothing, Hooks())) == 0.0
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
