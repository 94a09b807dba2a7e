"""Context parallelism (mesh.context): a device's queries against keys and values gathered
over the context axis, or coming round the ring, give the attention of the whole sequence,
load balanced or not, packed sequences crossing devices; training at context 2, 4 and 8,
alone and with fsdp x tensor at ZeRO-3, GPipe stages or stage 1 in bf16, equals one
device; the compiled step gathers keys and values (or passes them round), never queries;
checkpoints move between context sizes."""

import collections
import contextlib
import io
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero import config
from jaxzero.models.attention import attention

TINY = "configs/tiny_zero3.py"
# The fast lane keeps each strategy's attention, one 10-step mesh (fsdp x context x tensor)
# and each strategy's compiled collectives; the rest of the meshes, the resume and the plan
# are the full suite's.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize("window, packed", [(0, False), (20, False), (0, True)])
def test_attention_of_each_part_of_the_sequence_is_that_of_the_whole(implementation, window,
                                                                     packed):
  rng = np.random.default_rng(0)
  B, T, H, K, E, parts = 2, 64, 4, 2, 8, 4
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, E)), jnp.float32) for n in (H, K, K))
  seg = jnp.asarray(np.repeat(np.arange(4), [10, 20, 30, 4])[None].repeat(B, 0)) if packed \
      else None
  kwargs = dict(implementation=implementation, block=8, window=window)

  def whole(q, k, v):
    return attention(q, k, v, segment_ids_BxT=seg, **kwargs)

  def in_parts(q, k, v):  # as each device of a context axis of 4 computes it
    n = T // parts
    return jnp.concatenate([
        attention(q[:, c * n:(c + 1) * n], k, v, **kwargs, kv_segment_ids_BxS=seg,
                  segment_ids_BxT=None if seg is None else seg[:, c * n:(c + 1) * n],
                  q_offset=jnp.int32(c * n)) for c in range(parts)], axis=1)

  chex.assert_trees_all_close(in_parts(q, k, v), whole(q, k, v), atol=1e-6)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  chex.assert_trees_all_close(jax.grad(loss(in_parts), argnums=(0, 1, 2))(q, k, v),
                              jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v), atol=1e-5)


@pytest.mark.parametrize("strategy, balanced, implementation, window, packed", [
    ("all_gather", True, "blockwise", 0, True), ("all_gather", False, "xla", 6, False),
    pytest.param("ring", True, "blockwise", 0, True, marks=SLOW),
    pytest.param("ring", True, "xla", 12, True, marks=SLOW),
    ("ring", False, "blockwise", 20, False),
    pytest.param("ring", True, "blockwise", 6, True, marks=SLOW)])
def test_each_strategy_attends_as_the_whole_sequence(strategy, balanced, implementation, window,
                                                     packed):
  import functools
  from jaxzero.engine.hooks import LayoutHooks
  from jaxzero.parallel.mesh import make_mesh
  from jaxzero.parallel.zero import Layout
  rng = np.random.default_rng(1)
  # Parts of 16 positions, chunks of 8 balanced: some windows are longer than a piece.
  B, T, H, K, E, C = 2, 64, 4, 2, 8, 4
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, E)), jnp.float32) for n in (H, K, K))
  # Segments that cross the devices' parts (and, balanced, their chunks).
  seg = jnp.asarray(np.repeat(np.arange(4), [5, 30, 20, 9])[None].repeat(B, 0)) if packed \
      else None
  attend = functools.partial(attention, implementation=implementation, block=4,
                             window=window)
  layout = Layout(make_mesh(1, 1, jax.devices()[:C], context=C), 3,
                  context_strategy=strategy, context_balance=balanced)
  hooks = LayoutHooks(layout)
  order = hooks.sequence_order(T)
  assert (order is not None) == balanced
  order = np.arange(T) if order is None else order
  inverse = np.argsort(order)

  def split(q, k, v):  # in the devices' order, and back
    out = hooks.context(attend)(q[:, order], k[:, order], v[:, order],
                                None if seg is None else seg[:, order])
    return out[:, inverse]

  def whole(q, k, v):
    return attention(q, k, v, implementation="xla", window=window, segment_ids_BxT=seg)

  chex.assert_trees_all_close(jax.jit(split)(q, k, v), whole(q, k, v), atol=1e-6)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  chex.assert_trees_all_close(jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(q, k, v),
                              jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v), atol=1e-5)


def test_a_balanced_device_holds_a_chunk_and_its_mirror():
  from jaxzero.engine.context import sequence_order
  np.testing.assert_array_equal(sequence_order(8, 2, True), [0, 1, 6, 7, 2, 3, 4, 5])
  assert sequence_order(8, 2, False) is None and sequence_order(8, 1, True) is None


@pytest.mark.parametrize("T, balanced, message", [
    (15, False, "a sequence of 15 positions over context=2: attention cuts it into 2 equal "
     "pieces of at most 512 positions or a multiple of 128; give sequences of such a length "
     "(the next is 16)"),
    (18, True, "into 4 equal pieces (2 a device: load-balanced) of at most 512 positions or a "
     "multiple of 128; give sequences of such a length (the next is 20), or "
     "jaxzero.Context(load_balance=False)"),
    (2084, False, "(the next is 2304)"),  # pieces of 1042: tiles of 1 x 1, 30x slower
])
def test_a_sequence_context_cannot_cut_for_attention_is_one_line_as_it_is_traced(
    T, balanced, message):
  """A model of one's own (jaxzero.Engine) meets the rules jaxzero.train's config checks
  on train.seq_len when its sequences are traced."""
  from jaxzero.engine.hooks import LayoutHooks
  from jaxzero.errors import ConfigError
  from jaxzero.parallel.mesh import make_mesh
  from jaxzero.parallel.zero import Layout
  hooks = LayoutHooks(Layout(make_mesh(1, 1, jax.devices()[:2], context=2), 3,
                             context_balance=balanced))
  q = jax.ShapeDtypeStruct((2, T, 4, 8), jnp.float32)
  with pytest.raises(ConfigError, match=re.escape(message)):
    jax.eval_shape(hooks.context(lambda q, k, v, **_: q), q, q, q)


def tiny(*overrides):
  # 8 rows (the fewest the replica 2 x fsdp 2 mesh takes at grad_accum 2) of 64 positions
  # (8 a device at context 8) on a 64-wide model: the equalities hold at any size, and the
  # steps cost a quarter of the embedded default's 32 rows at width 128.
  return config.load(TINY, ["model.n_layers=2", "model.dim=64", "model.mlp_dim=128",
                            "train.seq_len=64", "train.global_batch=8", "train.log_every=1",
                            "data.max_bytes=200000", "train.steps=10", *overrides])


def losses(cfg, workdir, n_devices, steps=None, save=False):
  """The losses of `cfg`'s run; its last step saved only where `save` (a run that only
  compares losses skips the save and its checksums: about 0.7 s a run here)."""
  from jaxzero.training import loop
  if not save:
    cfg = config.apply_overrides(cfg, ["checkpoint.at_end=false"])
  with contextlib.redirect_stdout(io.StringIO()):
    history = loop.train(cfg, workdir, steps, devices=jax.devices()[:n_devices],
                         progress=False)
  return [r["loss"] for r in history]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  return losses(tiny("mesh.fsdp=1"), tmp_path_factory.mktemp("one"), 1)


@pytest.fixture(scope="module")
def one_device_bf16(tmp_path_factory):
  return losses(tiny("mesh.fsdp=1", "precision.compute=bfloat16"),
                tmp_path_factory.mktemp("one_bf16"), 1)


@pytest.mark.parametrize("mesh", [
    pytest.param(["mesh.fsdp=1", "mesh.context=8", "context.strategy=ring"], marks=SLOW),
    ["mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2", "zero.stage=3"],
    pytest.param(["mesh.fsdp=2", "mesh.context=2", "mesh.pipeline=2", "train.grad_accum=2",
                  "context.strategy=ring"], marks=SLOW),
    pytest.param(["mesh.replica=2", "mesh.fsdp=2", "mesh.context=2", "zero.stage=1",
                  "precision.compute=bfloat16", "context.load_balance=False"], marks=SLOW),
])
@pytest.mark.slow
def test_ten_steps_at_context_c_equal_one_device(mesh, one_device, one_device_bf16, tmp_path):
  want = one_device_bf16 if "precision.compute=bfloat16" in mesh else one_device
  np.testing.assert_allclose(losses(tiny(*mesh), tmp_path, 8), want,
                             rtol=1e-5 if want is one_device else 2e-3)


@pytest.mark.parametrize("strategy", ["all_gather", pytest.param("ring", marks=SLOW)])
def test_the_step_moves_keys_and_values_over_context_never_queries(strategy):
  from jaxzero.training import loop
  cfg = config.load(TINY, ["model.n_layers=1", "train.seq_len=2048", "train.global_batch=8",
                           "train.grad_accum=1", "mesh.fsdp=2", "mesh.context=4",
                           f"context.strategy={strategy}", "model.attention=blockwise",
                           "data.max_bytes=200000"])
  runner = loop.prepare(cfg, devices=jax.devices()[:8])
  program = runner.program
  text = runner.lower(program.abstract_state(), program.abstract_batch(2)).compile().as_text()
  ops = collections.Counter(re.findall(
      r"= (\S+?)\{[^}]*\} (all-gather|reduce-scatter|collective-permute)(?:-start)?\(", text))
  # 2 rows a device, 2 KV heads of 32, 512 of the 2048 positions a device.
  if strategy == "all_gather":  # k and v gathered whole, dk and dv reduce-scattered back
    assert ops[("f32[2,2048,2,32]", "all-gather")] == 2
    assert ops[("f32[2,512,2,32]", "reduce-scatter")] == 2
    assert not ops[("f32[2,512,2,32]", "collective-permute")]
  else:  # k and v 3 hops forward, dk and dv 3 hops back (and the forward's hops again
    # where the backward recomputes them, 3 passes at most); nothing gathered whole
    from jaxzero.planning.collectives import HloModule
    hops = [c for c in HloModule(text).collectives() if c.op == "collective-permute"]
    assert {c.shape for c in hops} == {"f32[2,512,2,32]"}
    assert 2 * 3 * 2 <= sum(c.runs for c in hops) <= 3 * 3 * 2
    assert not [shape for shape, _ in ops if ",2048," in shape]
  # The 4 query heads never gathered.
  assert not [shape for shape, _ in ops if re.match(r"f32\[\d+,2048,4,32\]", shape)]


def test_the_embedding_lookup_reaches_its_rows_without_a_whole_sequence_copy():
  """The lookup's result leaves the embedding's split (model dimension over fsdp x
  context) for the residual stream's (rows over fsdp, sequence over context) one mesh axis
  at a time: XLA moving both at once replicated it, the whole sequence on each device."""
  from jaxzero.training import loop
  cfg = config.load(TINY, ["model.n_layers=1", "model.dim=256", "model.vocab_size=32000",
                           "model.mlp_dim=512", "model.n_heads=4", "model.n_kv_heads=2",
                           "train.seq_len=4096", "train.global_batch=8", "train.grad_accum=1",
                           "mesh.fsdp=2", "mesh.context=4", "model.attention=blockwise",
                           "data.max_bytes=200000"])
  runner = loop.prepare(cfg, devices=jax.devices()[:8])
  program = runner.program
  text = runner.lower(program.abstract_state(), program.abstract_batch(2)).compile().as_text()
  gathered = re.findall(r"= \S+?(\[\d+,\d+,256\])\{[^}]*\} all-gather(?:-start)?\(", text)
  assert gathered and not [shape for shape in gathered if ",4096," in shape], gathered


@SLOW
def test_a_checkpoint_moves_between_context_sizes(one_device, tmp_path):
  # (Context 2 and 4, the second with the XLA attention kernel: 10 steps in all.)
  first = losses(tiny("mesh.fsdp=4", "mesh.context=2"), tmp_path, 8, steps=4, save=True)
  rest = losses(tiny("mesh.fsdp=2", "mesh.context=4", "model.attention=xla"), tmp_path, 8)
  np.testing.assert_allclose(first + rest, one_device, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.context=3"], "mesh.context=3 does not divide train.seq_len=64 into equal parts; "
     "valid values: 1, 2, 4, 8, 16, 32"),  # (64 is 32 chunks of 2 too many, balanced)
    (["mesh.context=5", "train.seq_len=48"], "valid values: 1, 2, 3, 4, 6, 8, 12, 24"),
    (["mesh.context=3", "context.load_balance=False"], "valid values: 1, 2, 4, 8, 16, 32, 64"),
    (["mesh.context=2", "mesh.pipeline=2", "train.grad_accum=2", "pipeline.schedule=1f1b",
      "context.strategy=ring"], "context.strategy=ring with pipeline.schedule=1f1b is not "
     "supported; use context.strategy=all_gather, or pipeline.schedule=gpipe or interleaved"),
    (["mesh.context=2", "model_factory=m:f"], "a model_factory model trains with mesh.context=1"),
    (["mesh.context=2", "model.attention=cudnn"], "mesh.context=2 with model.attention=cudnn"),
    (["mesh.context=2", "train.seq_len=4098"],
     "context.load_balance needs train.seq_len=4098 cut into 2 x mesh.context=4 equal chunks"),
    (["mesh.context=2", "train.seq_len=4100"],
     "mesh.context=2 leaves attention pieces of 1025 positions of train.seq_len=4100"),
    (["mesh.context=2", "train.seq_len=4098", "context.load_balance=False"],
     "mesh.context=2 leaves attention pieces of 2049 positions of train.seq_len=4098"),
    (["mesh.context=2", "context.strategy=tree"],
     "context.strategy='tree' is not valid; choose one of: all_gather, ring"),
])
def test_bad_context_settings_are_one_line(overrides, message):
  with pytest.raises(config.ConfigError, match=re.escape(message)) as error:
    config.validate(config.apply_overrides(config.load(TINY, ["train.seq_len=64"]), overrides))
  if "valid values: " in message:  # the whole list
    assert str(error.value).endswith(message), error.value


@SLOW
def test_plan_comm_sets_what_crosses_context_beside_the_formula():
  from jaxzero.planning import comm_report, planner
  cfg = config.load(TINY, ["model.n_layers=2", "train.seq_len=1024", "mesh.fsdp=2",
                           "mesh.context=4", "context.strategy=ring"])
  plan = planner.plan(cfg, 8, 80e9, sweep=[planner.Variant(3, False, cfg.remat.policy)],
                      search=False, comm=True)
  rep = plan.rows[0].comm_report
  # One layer's K and V for the whole sequence of a device's 8 rows: 2 x 8 x 1024 x 2 KV
  # heads x 32 x 4 bytes; 2 layers x 2 micro-batches; 3 passes of 3 hops of a quarter.
  kv_bytes = 2 * 8 * 1024 * 2 * 32 * 4
  assert rep.context_formula_bytes == 3 * 4 * 3 * kv_bytes // 4
  permutes = [r for r in rep.rows if r.op == "collective-permute" and r.axes == ("context",)]
  assert sum(r.counted_bytes for r in permutes) == rep.context_formula_bytes
  assert ("across context alone: 38.28 MB; the formula, 3 passes x attentions x 3/4 x K,V of "
          "the whole sequence: 37.75 MB") in comm_report.format_table(rep)
