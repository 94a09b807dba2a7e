"""One chunk of a weight in the NVMe store: which optimizer leaves mirror a weight, and
the in-memory step's update of one chunk [K, ...] (its master weight, then the
optimizer's per-weight leaves). The NVMe, host and Infinity runners (jaxzero.runners)
stream these; a chunk's box is cut from a whole weight as raw bits, so no float32 copy of
a bfloat16 stack is compiled. That is the in-memory update only for an optimizer whose
update of a box is that box of its update of the whole weight (check_updates_by_box).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero import engine as engine_lib
from jaxzero.checkpoint import integrity
from jaxzero.errors import ConfigError
from jaxzero.offload import nvme_store


class _Weight:
  """Marks the leaf of an optimizer state that mirrors weight `name`."""

  def __init__(self, name: str):
    self.name = name


def weight_copies(tx: optax.GradientTransformation, opt_state: Any,
                  master: Any) -> dict[str, tuple[str, ...]]:
  """{weight: the TrainState leaves of its copies}: "master/<weight>", then each
  per-weight leaf of the optimizer state in its order (e.g. Adam's mu, nu)."""
  weights = jax.tree_util.tree_map_with_path(
      lambda p, _: _Weight(integrity.leaf_name(p)), master)
  # A masked-out weight's place in a masked or multi_transform state is a MaskedNode: no
  # copy of it there.
  marked = optax.tree_map_params(
      tx, lambda leaf, w: None if _masked(leaf) else w, opt_state, weights,
      transform_non_params=lambda v: jax.tree.map(lambda _: None, v), is_leaf=_masked)
  copies = {w.name: [f"master/{w.name}"] for w in jax.tree.leaves(weights)}
  for path, w in jax.tree_util.tree_flatten_with_path(
      marked, is_leaf=lambda x: isinstance(x, _Weight))[0]:
    copies[w.name].append(f"opt_state/{integrity.leaf_name(path)}")
  return {name: tuple(kinds) for name, kinds in copies.items()}


def weight_flags(tx: optax.GradientTransformation, state: Any) -> list[bool]:
  """For each leaf of `state`: whether it mirrors a weight (else a scalar, e.g. a count)."""
  return jax.tree.leaves(optax.tree_map_params(
      tx, lambda leaf: leaf if _masked(leaf) else True, state,
      transform_non_params=lambda v: jax.tree.map(lambda _: False, v), is_leaf=_masked))


def _masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def nest(name: str, value: Any) -> dict:
  """{"layers": {"w_up_LxDxF": value}} for "layers/w_up_LxDxF": the optimizer's
  decay mask goes by these names."""
  return _nested({name: value})


def update_chunk(cfg, inner: optax.GradientTransformation, name: str, grad_sum: jax.Array,
                 chunk: jax.Array, scalars: list, grad_norm: jax.Array, scale: jax.Array):
  """The in-memory step's update of one chunk [K, ...] of weight `name` (its master
  weight, then the optimizer's per-weight leaves), from the gradient sum over the
  step's micro-steps of the same box: (new chunk, the optimizer's new scalars)."""
  g = engine_lib.mean_grad(grad_sum, cfg.train.grad_accum)
  if cfg.precision.scales_loss:  # unscaled before clipping, as in memory
    g = g / scale
  if cfg.train.clip_norm > 0:
    g = engine_lib.clip_by_norm(g, grad_norm, cfg.train.clip_norm)
  master = nest(name, chunk[0])
  template = inner.init(master)  # its zeros are replaced (and never computed)
  flags = weight_flags(inner, template)
  copies, counts = iter(list(chunk[1:])), iter(scalars)
  # A copy is stored in float32; the optimizer computes it in its own dtype (mu_dtype=
  # bfloat16's moment, whose values float32 holds exactly), as in memory.
  state = jax.tree.unflatten(jax.tree.structure(template), [
      next(copies).astype(leaf.dtype) if f else next(counts)
      for f, leaf in zip(flags, jax.tree.leaves(template))])
  updates, state = inner.update(nest(name, g), state, master)
  new_master = jax.tree.leaves(optax.apply_updates(master, updates))[0]
  leaves = jax.tree.leaves(state)
  new_copies = [x for x, f in zip(leaves, flags) if f]
  new_scalars = [x for x, f in zip(leaves, flags) if not f]
  return jnp.stack([new_master, *new_copies]), new_scalars


# The updates probed, each on gradients of another scale: an update that is zero at first
# (a warm-up from 0, MultiSteps of up to 4 micro-steps) shows by the last.
_PROBE_SCALES = (1.0, 3.0, 0.2, 5.0, 1.0)


def check_updates_by_box(inner: optax.GradientTransformation, weights: dict[str, tuple],
                         where: str) -> None:
  """Refuses, in one line, an optimizer whose updates of a box of a weight, alone, are not
  that box of its updates of the whole model: one that reduces over a weight or the model
  (global-norm clipping, LAMB's trust ratios, Adafactor's factored moments), which the
  box-by-box update would compute per box. Probed over stand-ins for `weights` ({name:
  shape}: the names, so that rules by name apply; the ranks, and each dimension up to 256,
  a layer stack's up to 4), each cut in two along its first dimension; `where` names the
  setting that updates box by box."""
  rng = np.random.default_rng(0)
  shapes = {name: _stand_in(name, shape) for name, shape in weights.items()}
  params = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
  grads = [{n: (k * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
           for k in _PROBE_SCALES]

  def trained(params, grads):  # each of `params`' trees trained alone on its gradients
    return [engine_lib.trained_alone(inner, p, gs) for p, gs in zip(params, grads)]

  def boxes(tree):  # each weight's two halves, each a tree of its own
    return [_nested({n: x[half]}) for n, x in sorted(tree.items()) for half in _halves(x.shape)]

  why = ""
  try:
    whole, *parts = jax.jit(trained)([_nested(params)] + boxes(params),
                                     [[_nested(g) for g in grads]]
                                     + [list(gs) for gs in zip(*map(boxes, grads))])
    whole = {n: np.asarray(x) for n, x in _flat(whole).items()}
    by_box = boxes(whole)
    if not all(np.allclose(_only_leaf(a), _only_leaf(b), rtol=1e-5, atol=1e-7)
               for a, b in zip(parts, by_box)):
      why = ("its updates of a box of a weight are not that box of its updates of the whole "
             "model (as where it reduces over a weight or the model: global-norm clipping, "
             "LAMB's trust ratios, Adafactor's factored moments)")
  except Exception as e:  # pylint: disable=broad-except
    why = f"it fails on one box of one weight: {type(e).__name__}: {str(e).splitlines()[0]}"
    if "pytree structure" in str(e):  # a mask or labels given as a tree of every weight
      why += ("; a mask= or multi_transform's labels given as a tree of the parameters "
              "cannot take one weight alone: give them as a function of the parameters")
  if why:
    raise ConfigError(f"{where} updates each weight a box at a time, and this optimizer "
                      f"cannot be: {why}; use an elementwise optimizer (optax.adamw, sgd, "
                      "...) with clip_norm= for clipping, or keep the optimizer on the device")


def _stand_in(name: str, shape: tuple) -> tuple:
  first = 4 if name.startswith("layers/") else 256
  return tuple(min(d, first if i == 0 else 256) for i, d in enumerate(shape))


def _halves(shape: tuple) -> list:
  if not shape or shape[0] < 2:
    return [()]  # uncut: the whole weight is its one box
  return [slice(0, shape[0] // 2), slice(shape[0] // 2, None)]


def _nested(flat: dict) -> dict:
  """{"a/b": x, "a/c": y} -> {"a": {"b": x, "c": y}} (nest, for several names)."""
  tree: dict = {}
  for name, value in flat.items():
    *path, last = name.split("/")
    node = tree
    for key in path:
      node = node.setdefault(key, {})
    node[last] = value
  return tree


def _flat(tree) -> dict:
  return {integrity.leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _only_leaf(tree) -> np.ndarray:
  return np.asarray(jax.tree.leaves(tree)[0])


def corner(leaf: nvme_store.Leaf, starts) -> list:
  """A chunk's first index: `starts` (traced) along the cut dimensions, 0 elsewhere
  (static, so that a split dimension is never sliced)."""
  where = dict(zip(leaf.cut, starts))
  return [where.get(d, 0) for d in range(len(leaf.shape))]


def box_of(leaf: nvme_store.Leaf, x: jax.Array, starts) -> jax.Array:
  """The chunk of `x` (a whole weight) that starts at `starts`."""
  if not leaf.cut:
    return x
  return as_dtype(x.dtype, jax.lax.dynamic_slice(bits(x), corner(leaf, starts), leaf.chunk))


# A chunk is written into, and sliced out of, a whole (stacked) weight as raw
# bits: XLA:CPU moves bfloat16 data as float32, so updating one chunk of a bf16
# weight converted all of it, there and back, for every chunk (a whole stacked
# weight per chunk: most of the update's time). Slicing fused the conversion
# away, but goes through bits too, so no f32 copy of a stack is ever compiled.
# The bitcasts cost nothing, here or on a GPU.
bits = integrity.bits


def as_dtype(dtype, bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, dtype)


class All:
  """The results of several futures, as one (the stores' reads of one unit)."""

  def __init__(self, futures):
    self._futures = futures

  def result(self):
    return [f.result() for f in self._futures]
