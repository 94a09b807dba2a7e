"""Memory-light attention and cross-entropy equal the plain ones, and stay light.

* jaxzero.models.attention "blockwise" (flash attention in plain JAX, custom_vjp)
  against jax.nn.dot_product_attention's XLA kernel: outputs and gradients, with and
  without a sliding window (and the XLA kernel's window against a numpy mask).
* jaxzero.models.loss.cross_entropy (chunked over the vocabulary) against optax on the
  full logits: value and gradients.
* The whole model's loss and gradients: blockwise attention + chunked loss
  against XLA attention + full logits.
* XLA's own temporary-buffer figures: neither builds a T×T or a [B, T, V] f32
  array; and the chunked loss reduces the head's gradient across devices once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.config import ConfigError, apply_overrides, base
from jaxzero.engine.remat import remat_wrapper
from jaxzero.models.attention import attention
from jaxzero.models.llama import LlamaConfig
from jaxzero.models.loss import cross_entropy
from jaxzero.planning import comm_report

from test_model import graphdef, make_cfg, random_params, random_tokens

TOL = 1e-5


def _normal(key: int, *shape: int, scale: float = 1.0) -> jax.Array:
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _qkv(B: int, T: int, H: int, K: int, E: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  return _normal(0, B, T, H, E), _normal(1, B, T, K, E), _normal(2, B, T, K, E)


def _max_diff(a, b) -> float:
  return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("B, T, H, K, E, block, window", [
    pytest.param(2, 24, 4, 2, 16, 8, 0, id="gqa-batch2-3blocks"),
    pytest.param(1, 37, 4, 1, 8, 16, 0, id="mqa-T-not-multiple-of-block"),
    # Windows within a block, across blocks, of two keys and of a whole block.
    pytest.param(2, 24, 4, 2, 16, 8, 5, id="gqa-window5-block8"),
    pytest.param(1, 37, 4, 1, 8, 16, 20, id="mqa-window20-block16-ragged"),
    pytest.param(1, 40, 2, 2, 8, 8, 2, id="mha-window2"),
    pytest.param(1, 40, 2, 2, 8, 8, 8, id="mha-window-equals-block"),
])  # a block longer than T (one block) is the whole-model test's case
def test_blockwise_matches_xla(B, T, H, K, E, block, window):
  q, k, v = _qkv(B, T, H, K, E)
  dout = _normal(3, B, T, H, E)

  @jax.jit
  def both(q, k, v):
    results = []
    for impl in ("xla", "blockwise"):
      out, vjp = jax.vjp(lambda *a: attention(*a, implementation=impl, block=block,
                                              window=window), q, k, v)
      results.append((out, vjp(dout)))
    return results

  (want, want_grads), (got, got_grads) = both(q, k, v)
  assert got.shape == (B, T, H, E) and got.dtype == jnp.float32
  assert _max_diff(got, want) <= TOL
  assert all(float(jnp.abs(g).max()) > 0.1 for g in want_grads)
  assert _max_diff(got_grads, want_grads) <= TOL
  if window:  # the reference itself applies Mistral's window: i - W < j <= i
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = (j <= i) & (j > i - window)
    ref = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)[None, None])
    assert _max_diff(want, ref) <= TOL
    assert _max_diff(want, attention(q, k, v, implementation="xla")) > 0.1


@pytest.mark.parametrize("T, S, q_offset, block", [(8, 12, 16, 8), (8, 10, 8, 4), (6, 9, 6, 6),
                                                   (8, 8, -8, 8)])
def test_a_part_of_the_queries_attends_as_a_plain_softmax_over_the_keys_it_sees(T, S, q_offset,
                                                                               block):
  """Queries at q_offset among S keys, S not whole tiles (the padding was seen as earlier
  keys past the end) and queries that see no key (0 from both kernels, not the values'
  mean): values and gradients as a float64 softmax over the visible keys."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((1, T, 2, 16), (1, S, 1, 16), (1, S, 1, 16)))

  def reference(q, k, v):
    visible = (q_offset + jnp.arange(T))[:, None] >= jnp.arange(S)[None, :]
    scores = jnp.einsum("bthe,bse->bhts", q, k[:, :, 0]) / 4.0
    weights = jnp.where(visible, jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), -1), 0.0)
    return jnp.einsum("bhts,bse->bthe", jnp.nan_to_num(weights), v[:, :, 0])

  # Values and gradients in one jitted call each (op by op, the test took seconds).
  both = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))),
                                              argnums=(0, 1, 2)))
  check = lambda f: jax.jit(f)(q, k, v)
  want, (want_sum, want_grads) = check(reference), both(reference)(q, k, v)
  for implementation in ("xla", "blockwise"):
    run = lambda q, k, v: attention(q, k, v, implementation=implementation, q_offset=q_offset,
                                    block=block)
    assert float(jnp.abs(check(run) - want).max()) <= 1e-5, implementation
    got_sum, got_grads = both(run)(q, k, v)
    assert abs(float(got_sum - want_sum)) <= 1e-4, implementation
    assert _max_diff(got_grads, want_grads) <= 1e-5, implementation


def test_a_numpy_offset_is_checked_as_an_int_not_floored():
  q = k = v = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match=r"q_offset=6 is not a multiple of the 4-position tile"):
    attention(q, k, v, implementation="blockwise", q_offset=np.int64(6), block=4)


def test_window_edges():
  q, k, v = _qkv(1, 16, 2, 1, 8)
  for impl in ("xla", "blockwise"):  # a window of 1: each query sees its own key only
    out = attention(q, k, v, implementation=impl, block=8, window=1)
    assert _max_diff(out, jnp.repeat(v, 2, axis=2)) <= TOL
  # A window as long as the sequence is full causal attention.
  full = attention(q, k, v, implementation="blockwise", block=8)
  for window in (16, 1000):
    assert jnp.array_equal(attention(q, k, v, implementation="blockwise", block=8,
                                     window=window), full)
  with pytest.raises(ValueError, match="window -1 must not be negative"):
    attention(q, k, v, window=-1)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
@pytest.mark.parametrize("window", [0, 100])
def test_cudnn_window_matches_xla(window):
  q, k, v = (a.astype(jnp.bfloat16) for a in _qkv(2, 512, 8, 2, 64))
  dout = _normal(3, 2, 512, 8, 64).astype(jnp.bfloat16)

  def run(impl):
    out, vjp = jax.vjp(lambda *a: attention(*a, implementation=impl, window=window), q, k, v)
    return [x.astype(jnp.float32) for x in (out, *vjp(dout))]

  assert _max_diff(jax.jit(lambda: run("cudnn"))(), jax.jit(lambda: run("xla"))()) <= 0.05


def test_blockwise_keeps_bfloat16():
  q, k, v = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in _qkv(1, 40, 4, 2, 16))
  loss = lambda *a: attention(*a, implementation="blockwise", block=16).astype(jnp.float32).sum()
  out = jax.eval_shape(lambda *a: attention(*a, implementation="blockwise", block=16), q, k, v)
  grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  assert [a.dtype for a in (out, *grads)] == [jnp.bfloat16] * 4


def test_auto_is_blockwise_on_cpu_and_names_are_checked():
  q, k, v = _qkv(1, 8, 2, 1, 8)
  jaxpr = str(jax.make_jaxpr(lambda *a: attention(*a, implementation="auto"))(q, k, v))
  assert "custom_vjp" in jaxpr
  with pytest.raises(ValueError, match="blockwise"):
    attention(q, k, v, implementation="flash")
  with pytest.raises(ValueError, match="model.attention='flash'.*auto, xla, cudnn, blockwise"):
    LlamaConfig(attention="flash").validate()
  with pytest.raises(ConfigError, match="model.attention"):
    apply_overrides(base(), ["model.attention=flash"])


def test_blockwise_holds_no_TxT_buffer():
  """Forward + backward at T = 2048: XLA's temporaries stay far below one f32
  [B, H, T, T] score buffer, which the XLA kernel needs several of."""
  B, T, H, K, E = 1, 2048, 4, 2, 16
  q = jax.ShapeDtypeStruct((B, T, H, E), jnp.float32)
  kv = jax.ShapeDtypeStruct((B, T, K, E), jnp.float32)
  scores_bytes = B * H * T * T * 4

  def temp_bytes(impl: str) -> int:
    loss = lambda *a: attention(*a, implementation=impl, block=128).sum()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes("xla") >= scores_bytes  # the criterion can tell them apart
  assert temp_bytes("blockwise") < scores_bytes / 8


# ----------------------------------------------------------------------------- cross-entropy


def _full_cross_entropy(x_BxTxD, head_DxV, labels_BxT):
  logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV, preferred_element_type=jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, labels_BxT).mean()


@pytest.mark.parametrize("chunk, C", [(8, 8), (64, 50)])
def test_chunked_cross_entropy_matches_optax(chunk, C):
  B, T, D, V = 2, 23, 16, 50  # chunk 8: 7 chunks of 8, the last padded; 64: one chunk
  x, head = _normal(0, B, T, D), _normal(1, D, V, scale=0.5)
  labels = jax.random.randint(jax.random.key(2), (B, T), 0, V)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, head, labels)
  (want, want_grads) = grad(_full_cross_entropy)
  seen = []
  (got, got_grads) = grad(lambda x, h, l: cross_entropy(
      x, h, l, chunk=chunk, shard=lambda a, axes: seen.append((a.shape, axes)) or a))
  assert seen == [((B, T, C), ("batch", "seq", "vocab"))]
  assert abs(float(got - want)) <= TOL
  assert _max_diff(got_grads, want_grads) <= TOL


@pytest.mark.parametrize("weights", [[[1.0, 1.0, 0.0]], [[0.25, 0.25, 0.0]], [[0.5, 0.0, 0.0]],
                                     [[0.0, 0.0, 0.0]]])
def test_weighted_cross_entropy_is_the_weighted_mean(weights):
  """Any weights, those summing below 1 too (they were divided by 1); none: loss 0."""
  x, head = _normal(0, 1, 3, 16), _normal(1, 16, 13, scale=0.5)
  labels = jnp.array([[1, 5, 7]])
  w = jnp.asarray(weights)
  logits = jnp.einsum("btd,dv->btv", x, head)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  want = float((w * nll).sum() / w.sum()) if float(w.sum()) else 0.0
  assert abs(float(cross_entropy(x, head, labels, chunk=8, weights_BxT=w)) - want) <= TOL


def test_chunked_cross_entropy_holds_no_full_logits():
  B, T, D, V, chunk = 2, 512, 32, 4096, 512
  args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
          jax.ShapeDtypeStruct((B, T), jnp.int32))
  logits_bytes = B * T * V * 4

  def temp_bytes(f) -> int:
    compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(_full_cross_entropy) >= logits_bytes
  assert temp_bytes(lambda x, h, l: cross_entropy(x, h, l, chunk=chunk)) < logits_bytes / 2


def test_chunked_cross_entropy_reduces_head_gradient_once():
  """Batch split over 8 devices: each vocabulary chunk's columns of the head's
  gradient are all-reduced once (2 x its bytes in all), not every chunk's
  whole [D, V] gradient in every iteration, as sequence chunks would be."""
  B, T, D, V = 8, 64, 32, 1024
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = lambda *axes: NamedSharding(mesh, P(*axes))
  shard = lambda a, axes: jax.lax.with_sharding_constraint(
      a, spec(*["data" if axis == "batch" else None for axis in axes]))
  args = (jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=spec("data")),
          jax.ShapeDtypeStruct((D, V), jnp.float32, sharding=spec()),
          jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=spec("data")))
  loss = lambda x, h, l: cross_entropy(x, h, l, chunk=128, shard=shard)
  compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
  head_bytes = D * V * 4
  sent = comm_report.report(compiled, mesh, n_params=D * V).total_bytes
  assert head_bytes <= sent <= 2 * head_bytes + 1024


# ----------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("family, window", [("llama", 0), ("qwen2", 7)])
def test_model_loss_matches_full_logits(family, window):
  # Tied: the embedding's gradient gathers the lookup's and the head's parts.
  cfg = make_cfg(n_kv_heads=2, tied=True, family=family, window=window)
  params = jax.tree.map(jnp.asarray, random_params(cfg))
  tokens = random_tokens(cfg)

  def old_loss(params):
    model = nnx.merge(graphdef(dataclasses.replace(cfg, attention="xla")), params)
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def new_loss(params):
    model = nnx.merge(graphdef(dataclasses.replace(cfg, attention="blockwise")), params)
    # Saving "attention" keeps the blockwise residuals, named in its forward rule.
    x, head = model.forward(tokens[:, :-1], remat=remat_wrapper("save_attention"))
    return cross_entropy(x, head, tokens[:, 1:], chunk=16)  # V = 97: 7 chunks

  want, want_grads = jax.jit(jax.value_and_grad(old_loss))(params)
  got, got_grads = jax.jit(jax.value_and_grad(new_loss))(params)
  assert abs(float(got - want)) <= TOL
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    assert float(jnp.abs(g).max()) > 0, path
  assert _max_diff(got_grads, want_grads) <= TOL
