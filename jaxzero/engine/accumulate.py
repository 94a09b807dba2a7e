"""Gradient accumulation inside the backward pass: one gradient-sized buffer, not two.

A plain ``jax.grad`` of a scanned layer stack returns the whole stack's gradient
[L, ...] at once, and only then can it be added to the running sum over the
micro-steps: with gradient accumulation the step holds two gradient-sized buffers.
PyTorch FSDP and DeepSpeed add each layer's gradient into its accumulator as the
backward pass produces it. :class:`AccumulatingScan` does the same for a model that
runs its layers through ``Hooks.scan`` (``Model.layers_key``): the sum is carried
through the layer scan, and its cotangent is the sum itself plus each layer's
gradient, added in place (a dynamic-update-slice of the carried buffer) one layer
at a time. The caller differentiates with respect to the sum, not the stacked
weights: the gradient it gets back is the new sum. (XLA:CPU moves bfloat16 data as
float32, and there copies a bf16 sum whole after each layer's row update; a float32
sum is updated in place.)

Two ``custom_vjp``s, because no sharding or scan annotation expresses "this
cotangent starts from a given buffer": ``_seed`` makes the sum's cotangent start as
the sum, and a tap (``_tap_for``) routes each layer's weight gradient into it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxzero.models.interface import merge, split_like


def _tap_for(place):
  """A custom_vjp (weights, acc, i) -> (weights, acc); backward: the weights' gradient,
  moved by `place` where given, added into acc[i]."""
  @jax.custom_vjp
  def tap(weights, acc, i):
    return weights, acc

  def tap_fwd(weights, acc, i):
    return (weights, acc), i

  def tap_bwd(i, cotangents):
    ct_weights, ct_acc = cotangents
    if place is not None:
      ct_weights = place(ct_weights)
    def add(ct_sum, g):
      row = jax.lax.dynamic_index_in_dim(ct_sum, i, keepdims=False) + g.astype(ct_sum.dtype)
      return jax.lax.dynamic_update_index_in_dim(ct_sum, row, i, 0)
    # The weights are not differentiated here: their gradient lives in acc. (Any other
    # use of them in the loss gets no gradient: hence Model.layers_key's contract.)
    return None, jax.tree.map(add, ct_acc, ct_weights), None

  tap.defvjp(tap_fwd, tap_bwd)
  return tap


@jax.custom_vjp
def _seed(carry, acc):
  """`carry` unchanged; backward: `acc`'s cotangent starts as `acc` itself."""
  return carry


def _seed_fwd(carry, acc):
  return carry, acc


def _seed_bwd(acc, ct_carry):
  # The sum's cotangent is the sum itself, whatever the incoming one: right for the one
  # reverse pass from the loss (cotangent 1, or the float16 loss scale applied inside
  # the loss) that the engine runs, not for other transformations of the loss.
  return ct_carry, acc


_seed.defvjp(_seed_fwd, _seed_bwd)


class AccumulatingScan:
  """A ``Hooks.scan`` that adds each layer's gradient into `acc` (the running sum,
  stacked like the layers' weights) in the backward pass. Differentiated with
  respect to `acc`, the loss gives ``acc + this micro-step's layer gradients``.

  `place(gradients) -> gradients`, where given, moves a layer's gradient to where the
  sum lives before it is added (offloaded weights' gradients leave their layer in
  pinned_host). With `frozen`, `stacked` may also hold frozen leaves
  (Model.frozen_specs), which ride along untapped. `calls` counts its uses: the engine
  checks that the model ran it exactly once (unused, the gradient would be lost; run
  twice, the sum counted twice).
  """

  def __init__(self, acc, place=None, frozen: bool = False):
    self.acc = acc
    self.tap = _tap_for(place)
    self.calls = 0
    self.frozen = frozen  # the model has frozen leaves, which `stacked` may hold

  def __call__(self, layer, carry, stacked):
    self.calls += 1
    # Frozen leaves (Model.frozen_specs) ride along in `stacked`, untapped.
    trained, frozen = (split_like(stacked, self.acc)
                       if self.frozen and isinstance(stacked, dict) else (stacked, {}))
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
    if (jax.tree.structure(trained) != jax.tree.structure(self.acc)
        or shapes(trained) != shapes(self.acc)):
      raise ValueError("Hooks.scan must run over params[Model.layers_key], whole: got "
                       f"{shapes(stacked)}, expected {shapes(self.acc)}")
    n_layers = jax.tree.leaves(stacked)[0].shape[0]

    def body(state, xs):
      carry, acc = state
      weights, frozen_weights, i = xs
      weights, acc = self.tap(weights, acc, i)
      carry, _ = layer(carry, merge(weights, frozen_weights or None))
      return (carry, acc), None

    (carry, acc), _ = jax.lax.scan(body, (carry, self.acc),
                                   (trained, frozen, jnp.arange(n_layers)))
    return _seed(carry, acc)
