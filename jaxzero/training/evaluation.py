"""Evaluation on held-out data: the loss step and its compiled evaluator.

Every ``eval.every`` steps the loop computes the mean loss of the current weights
(the compute copy, as the train step sees them) over the fixed held-out batches of
jaxzero.data.pipeline (text windows or fine-tuning rows, whose loss is on their
targets only). Each process supplies the rows its devices hold, as for training
(jaxzero.data.batches.global_batch).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxzero import engine as engine_lib
from jaxzero.data import batches as batches_lib
from jaxzero.engine import hooks as hooks_lib
from jaxzero.engine.remat import remat_wrapper
from jaxzero.models.interface import merge
from jaxzero.parallel.zero import weights_for_compute


def make_eval_step(program: engine_lib.TrainProgram):
  """The jitted evaluation: (compute params, frozen weights or None, batches [N, B, ...])
  -> mean loss (fp32 scalar)."""
  layout = program.layout
  loss = functools.partial(hooks_lib.loss_with_hooks, program.model, layout=layout,
                           remat=remat_wrapper("full"))
  shardings, key = program.shardings, program.model.layers_key

  def eval_loss(params, frozen, batch_Nx):
    # Weights in pinned_host (trained or a frozen base) stream as in the train step: the
    # embedding, head and final norm come over now, each layer's shards in the scan.
    params = weights_for_compute(layout, params, shardings.params, key)
    frozen = weights_for_compute(layout, frozen, shardings.frozen, key)
    params = merge(params, frozen)
    total, _ = jax.lax.scan(lambda acc, batch: (acc + loss(params, batch), None),
                            jnp.zeros((), jnp.float32), batch_Nx)
    return total / jax.tree.leaves(batch_Nx)[0].shape[0]

  return jax.jit(eval_loss, in_shardings=(program.shardings.params, program.shardings.frozen,
                                          program.batch_sharding),
                 out_shardings=layout.replicated())


class Evaluator:
  """Held-out loss of a train state: its batch is placed and its step compiled
  once, ahead of the first evaluation (with the train step, so that processes
  that compile at different speeds meet before either runs)."""

  def __init__(self, program: engine_lib.TrainProgram, batches,
               state: engine_lib.TrainState):
    self._batches = batches_lib.global_batch(batches, program.batch_sharding, 0)
    self._compiled = make_eval_step(program).lower(state.params, state.frozen,
                                                   self._batches).compile()

  def __call__(self, state: engine_lib.TrainState) -> dict[str, float]:
    loss = float(jax.device_get(self._compiled(state.params, state.frozen, self._batches)))
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
