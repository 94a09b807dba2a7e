"""Any model cut at its layer scan into jitted programs, for a driver that runs them
one layer at a time (jaxzero.offload.infinity).

The cut is ``Hooks.scan`` (``Model.layers_key``): what runs before it (e.g. the
embedding) is `pre`, one scan step is `layer`, what runs after it (final norm,
head, loss) is `post`. The values the layer function closes over (e.g. RoPE
tables) are hoisted into arguments with ``jax.closure_convert`` and passed from
`pre` to every layer. Weights enter every program as fp32 master weights and are
cast to the compute dtype inside it, as the in-memory step casts them after each
update; gradients leave as fp32, in the master weights' layout (at stage 3 a
reduce-scatter), so nothing whole is ever held. A layer's backward program
recomputes its forward from its input (full remat at layer boundaries).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxzero.engine.remat import remat_wrapper
from jaxzero.engine.state import dtype_of
from jaxzero.engine.step import loss_fn


class _Cut(Exception):
  """Raised by the capturing scan hook: the layer stack's input and its function."""

  def __init__(self, carry, consts, layer):
    super().__init__("layer scan reached")
    self.carry, self.consts, self.layer = carry, consts, layer


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


class LayerPrograms:
  """The jitted programs of one model, config and layout.

  ``pre(outer, batch) -> (carry, consts)``; ``layer_forward(weights, carry, consts) ->
  carry``; ``post_grad(outer, batch, carry, *scale) -> (loss, (outer grads, carry
  grad))``; ``layer_backward(weights, carry, consts, carry grad) -> (weights grads,
  carry grad, consts grads)``; ``pre_backward(outer, batch, carry grad, consts grads)
  -> outer grads``. `outer` is the master weights less ``params[layers_key]``;
  `weights` one layer's master weights, each with a leading axis of 1.
  """

  def __init__(self, engine):
    model, layout, cfg = engine.model, engine.layout, engine.cfg
    if model.layers_key is None:
      raise ValueError("offload.params=nvme runs a model one layer at a time: it must declare "
                       "Model.layers_key and run those layers through Hooks.scan")
    self.key = key = model.layers_key
    compute = dtype_of(cfg.precision.compute)
    remat = remat_wrapper(cfg.remat.policy)
    stacked_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, compute),
                                 engine.abstract.master[key])
    master_sh = engine.shardings.master
    outer_sh = {k: v for k, v in master_sh.items() if k != key}
    layer_sh = master_sh[key]
    scales_loss = cfg.precision.scales_loss
    cast = lambda tree: jax.tree.map(lambda w: w.astype(compute), tree)
    self._layer = None  # the layer function with its closure hoisted, set by tracing `pre`

    def params_of(outer):
      # The stacked weights are never read before or after the cut: zeros that XLA removes.
      stacked = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stacked_specs)
      return {**cast(outer), key: stacked}

    def capture(layer, carry, stacked):
      one = jax.tree.map(lambda x: x[0], stacked)
      converted, consts = jax.closure_convert(layer, carry, one)
      raise _Cut(carry, consts, converted)

    def pre(outer, batch):
      try:
        loss_fn(model, params_of(outer), batch, layout, remat, scan=capture)
      except _Cut as cut:
        self._layer = cut.layer
        self._const_is_float = [_is_float(c) for c in cut.consts]
        return cut.carry, list(cut.consts)
      raise ValueError(f"the model declares layers_key={key!r} but its loss never ran "
                       "Hooks.scan")

    def merge(float_consts, consts):
      floats = iter(float_consts)
      return [next(floats) if f else c for f, c in zip(self._const_is_float, consts)]

    def floats(consts):
      return [c for f, c in zip(self._const_is_float, consts) if f]

    def run_layer(weights, carry, consts):
      one = jax.tree.map(lambda w: w[0], weights)
      return self._layer(carry, cast(one), *consts)[0]

    def layer_backward(weights, carry, consts, ct_carry):
      def f(weights, carry, float_consts):
        return run_layer(weights, carry, merge(float_consts, consts))
      _, vjp = jax.vjp(f, weights, carry, floats(consts))
      return vjp(ct_carry)

    def post(outer, batch, carry, *scale):
      loss = loss_fn(model, params_of(outer), batch, layout, remat,
                     scan=lambda layer, _, stacked: carry)
      return (loss * scale[0], loss) if scales_loss else loss

    def pre_backward(outer, batch, ct_carry, ct_float_consts):
      def f(outer):
        carry, consts = pre(outer, batch)
        return carry, floats(consts)
      _, vjp = jax.vjp(f, outer)
      return vjp((ct_carry, ct_float_consts))[0]

    self.pre = jax.jit(pre)
    self.layer_forward = jax.jit(run_layer)
    self.post_grad = jax.jit(jax.value_and_grad(post, argnums=(0, 2), has_aux=scales_loss),
                             out_shardings=(None, (outer_sh, None)))
    self.layer_backward = jax.jit(layer_backward, out_shardings=(layer_sh, None, None))
    self.pre_backward = jax.jit(pre_backward, out_shardings=outer_sh)

  def float_consts(self, consts: list) -> list:
    return [c for f, c in zip(self._const_is_float, consts) if f]

  @staticmethod
  def add(a: Any, b: Any) -> Any:
    return b if a is None else jax.tree.map(jnp.add, a, b)
