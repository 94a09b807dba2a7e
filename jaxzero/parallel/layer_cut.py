"""A model's loss cut at its layer scan (``Hooks.scan``, ``Model.layers_key``), for the
drivers that schedule the layers themselves: the 1F1B pipeline (jaxzero.parallel.pipeline)
and the NVMe tier's layer programs (jaxzero.offload.layer_programs).

`loss(params, batch, scan) -> mean loss` is the model's loss with the engine's hooks and
`scan` as its ``Hooks.scan``. What runs before the scan (e.g. the embedding) gives the
stack's input; one scan step is the layer function, whose closed-over floating values
(e.g. RoPE tables) are hoisted into arguments with ``jax.closure_convert``; what runs
after the scan (final norm, head, loss) gives the loss from the stack's output.

Invariant: ``closure_convert`` leaves integer values inside the function, so a driver
that reuses one cut's layer function for other batches needs the layer's integer
closures (if any) not to depend on the batch.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class Cut(NamedTuple):
  """The layer stack's input `carry`, the values its layer function closes over
  (`consts`), and that function: ``layer(carry, one_layer_weights, *consts) -> (carry,
  ys)``."""
  carry: Any
  consts: list
  layer: Callable


class _Reached(Exception):
  def __init__(self, cut: Cut):
    super().__init__("layer scan reached")
    self.cut = cut


def before_layers(loss: Callable, params, batch) -> Cut:
  """Runs `loss` up to its layer scan (nothing after it is traced)."""
  def capture(layer, carry, stacked):
    one = jax.tree.map(lambda x: x[0], stacked)
    converted, consts = jax.closure_convert(layer, carry, one)
    raise _Reached(Cut(carry, list(consts), converted))

  try:
    loss(params, batch, capture)
  except _Reached as reached:
    return reached.cut
  raise ValueError("the model declares Model.layers_key but its loss never ran Hooks.scan")


def after_layers(loss: Callable, params, batch, carry) -> jax.Array:
  """The loss from the layer stack's output `carry` (the layers are not run)."""
  return loss(params, batch, lambda layer, _, stacked: carry)


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def floats_of(consts: list) -> list:
  """The floating values of a cut's `consts`, in order: those a gradient reaches."""
  return [c for c in consts if _is_float(c)]


def with_floats(consts: list, floats: list) -> list:
  """`consts` with its floating values replaced by `floats`, in order."""
  replacements = iter(floats)
  return [next(replacements) if _is_float(c) else c for c in consts]
