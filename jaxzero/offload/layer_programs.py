"""Any model cut at its layer scan into jitted programs, for a driver that runs them
one layer at a time (jaxzero.runners.infinity).

The cut is jaxzero.parallel.layer_cut's, at ``Hooks.scan``: what runs before it (e.g. the
embedding) is `pre`, one scan step is `layer`, what runs after it (final norm,
head, loss) is `post`. The values the layer function closes over (e.g. RoPE
tables) are hoisted into arguments with ``jax.closure_convert`` and passed from
`pre` to every layer. Weights enter every program in the compute dtype (the driver
casts the master weights on the host, as the in-memory step casts them after each
update) and gradients leave in ``zero.grad_dtype``, in the master weights' layout (at
stage 3 a reduce-scatter), so nothing whole is ever held. A layer's backward program
recomputes its forward from its input (full remat at layer boundaries).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaxzero.checkpoint import integrity
from jaxzero.engine.hooks import loss_with_hooks
from jaxzero.engine.remat import remat_wrapper
from jaxzero.engine.state import dtype_of
from jaxzero.errors import ConfigError
from jaxzero.parallel import layer_cut


def used_inputs(fn, *args) -> list[bool]:
  """For each leaf of `args`: whether `fn`'s outputs depend on it, dead code left out
  (``jax.make_jaxpr`` keeps dead code; a program needs only the live inputs)."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  live = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if isinstance(v, jex.Var))
  return [v in live for v in jaxpr.invars]


class LayerPrograms:
  """The jitted programs of one model, config and layout.

  ``pre(outer, batch) -> (carry, consts)``; ``layer_forward(weights, carry, consts) ->
  carry``; ``post_grad(outer, batch, carry, scale=None) -> (loss, (outer grads, carry
  grad))``; ``layer_backward(weights, carry, consts, carry grad) -> (weights grads,
  carry grad, consts grads)``; ``pre_backward(outer, batch, carry grad, consts grads)
  -> outer grads``. `outer` is {leaf name: fp32 master weight} of the weights outside
  ``params[layers_key]`` that the program reads (:meth:`outer_names`), and its
  gradients are keyed alike; `weights` is one layer's master weights, each with a
  leading axis of 1, nested as ``params[layers_key]``.
  """

  def __init__(self, program):
    model, layout, cfg = program.model, program.layout, program.cfg
    if model.layers_key is None:
      raise ConfigError("offload.params=nvme runs a model one layer at a time: it must declare "
                        "Model.layers_key and run those layers through Hooks.scan")
    self.key = key = model.layers_key
    compute = dtype_of(cfg.precision.compute)
    remat = remat_wrapper(cfg.remat.policy)
    master = program.abstract.master
    self._outer_specs = {integrity.leaf_name(path): a
                         for path, a in jax.tree_util.tree_flatten_with_path(master)[0]
                         if not integrity.leaf_name(path).startswith(key + "/")}
    self._outer_sh = {integrity.leaf_name(path): s for path, s in
                      jax.tree_util.tree_flatten_with_path(program.shardings.master)[0]
                      if not integrity.leaf_name(path).startswith(key + "/")}
    layer_sh = program.shardings.master[key]
    scales_loss = cfg.precision.scales_loss
    cast = lambda tree: jax.tree.map(lambda w: w.astype(compute), tree)
    self._layer = None  # the layer function with its closure hoisted, set by tracing `pre`
    self._names: dict[str, list[str]] = {}

    def params_of(outer):
      # Weights a program does not read (the stacked layers, and outer weights used only on
      # the other side of the cut) are zeros that XLA removes.
      def leaf(path, a):
        name = integrity.leaf_name(path)
        return outer[name].astype(compute) if name in outer else jnp.zeros(a.shape, compute)
      return jax.tree_util.tree_map_with_path(leaf, master)

    grad_dtype = dtype_of(cfg.zero.grad_dtype)

    def reduced(grads):  # each outer weight's gradient leaves in its master layout
      return {n: jax.lax.with_sharding_constraint(g.astype(grad_dtype), self._outer_sh[n])
              for n, g in grads.items()}

    def loss(params, batch, scan):
      return loss_with_hooks(model, params, batch, layout, remat, scan=scan)

    def pre(outer, batch):
      carry, consts, self._layer = layer_cut.before_layers(loss, params_of(outer), batch)
      return carry, consts

    def run_layer(weights, carry, consts):
      one = jax.tree.map(lambda w: w[0], weights)
      return self._layer(carry, cast(one), *consts)[0]

    def layer_backward(weights, carry, consts, ct_carry):
      def f(weights, carry, float_consts):
        return run_layer(weights, carry, layer_cut.with_floats(consts, float_consts))
      _, vjp = jax.vjp(f, weights, carry, layer_cut.floats_of(consts))
      grads, ct_carry, ct_consts = vjp(ct_carry)
      return jax.tree.map(lambda g: g.astype(grad_dtype), grads), ct_carry, ct_consts

    def post(outer, batch, carry, scale=None):
      value = layer_cut.after_layers(loss, params_of(outer), batch, carry)
      return (value * scale, value) if scales_loss else value

    def pre_backward(outer, batch, ct_carry, ct_float_consts):
      def f(outer):
        carry, consts = pre(outer, batch)
        return carry, layer_cut.floats_of(consts)
      _, vjp = jax.vjp(f, outer)
      return reduced(vjp((ct_carry, ct_float_consts))[0])

    def post_grad(outer, batch, carry, scale=None):
      # (A carry may hold integers, a packed row's segment ids: their cotangent is float0.)
      value, (grads, ct_carry) = jax.value_and_grad(post, argnums=(0, 2), has_aux=scales_loss,
                                                    allow_int=True)(outer, batch, carry, scale)
      return value, (reduced(grads), ct_carry)

    self._pre = pre
    self._post = post
    self.pre = jax.jit(pre)
    self.layer_forward = jax.jit(run_layer)
    self.post_grad = jax.jit(post_grad)
    self.layer_backward = jax.jit(layer_backward, out_shardings=(layer_sh, None, None))
    self.pre_backward = jax.jit(pre_backward)

  def outer_names(self, side: str, batch) -> list[str]:
    """The outer weights that `side` ("pre" or "post") reads, for a micro-batch like
    `batch` (traced once, nothing computed)."""
    if side not in self._names:
      specs = dict(self._outer_specs)
      batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
      carry, _ = jax.eval_shape(self._pre, specs, batch)
      n = len(specs)  # the outer weights come first among the traced inputs, sorted by name
      self._names["pre"] = [name for name, used in zip(sorted(specs), used_inputs(
          self._pre, specs, batch)[:n]) if used]
      # (A float16 run's post takes the loss scale: a stand-in is traced with it.)
      self._names["post"] = [name for name, used in zip(sorted(specs), used_inputs(
          self._post, specs, batch, carry, jnp.float32(1.0))[:n]) if used]
    return self._names[side]

  def outer_sharding(self, name: str):
    return self._outer_sh[name]

  @staticmethod
  def float_consts(consts: list) -> list:
    return layer_cut.floats_of(consts)

  @staticmethod
  def add(a: Any, b: Any) -> Any:
    return b if a is None else jax.tree.map(jnp.add, a, b)
