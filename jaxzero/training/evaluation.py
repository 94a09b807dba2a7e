"""Evaluation on held-out text: the split, its fixed batches, and the loss step.

The held-out split is ``data.eval_fraction`` of the token stream, cut from its
end (training keeps the rest), or the separate ``data.eval_source``, tokenized
like the training data. Every ``eval.every`` steps the loop computes the mean
next-token loss of the current weights (the compute copy, as the train step
sees them) over ``eval.batches`` fixed batches of ``train.global_batch /
train.grad_accum`` sequences: consecutive windows from the start of the split,
the same whatever the stage, mesh or process count. Each process supplies the
rows its devices hold, as for training (jaxzero.data.batches.global_batch).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero import engine as engine_lib
from jaxzero.data import batches as batches_lib
from jaxzero.data import tokens as tokens_lib
from jaxzero.engine import hooks as hooks_lib
from jaxzero.engine.remat import remat_wrapper
from jaxzero.errors import DataError
from jaxzero.models.interface import merge
from jaxzero.parallel.zero import on_device


def split(tokens: np.ndarray, data) -> tuple[np.ndarray, np.ndarray | None]:
  """(training tokens, held-out tokens) of a stream, by data.eval_fraction."""
  if not data.eval_fraction:
    return tokens, None
  held_out = int(tokens.size * data.eval_fraction)
  return tokens[:tokens.size - held_out], tokens[tokens.size - held_out:]


def open_eval_source(data, workdir, *, model_vocab_size: int, progress: bool) -> np.ndarray:
  """The tokens of data.eval_source, with the training data's tokenizer and cache."""
  source = tokens_lib.open_tokens(dataclasses.replace(data, source=data.eval_source), workdir,
                                  model_vocab_size=model_vocab_size, progress=progress)
  return source.tokens


class EvalBatches:
  """``eval.batches`` batches of ``rows`` windows of ``seq_len + 1`` tokens, [N, rows, T+1].

  Window i starts at token ``i * seq_len`` (consecutive windows share one token,
  so every token but the first is a target once); a split shorter than the
  batches need is visited again from its start.
  """

  def __init__(self, tokens: np.ndarray, n_batches: int, rows: int, seq_len: int, what: str):
    if tokens.size < seq_len + 2:
      raise DataError(f"{what} leaves {tokens.size} tokens for evaluation, fewer than "
                      f"train.seq_len+2={seq_len + 2}; hold out more")
    self.tokens = tokens
    self.shape = (n_batches, rows, seq_len + 1)
    self.n_windows = (tokens.size - 1) // seq_len

  @property
  def n_tokens(self) -> int:
    return self.tokens.size

  def __call__(self, _step: int = 0, rows: slice = slice(None)) -> np.ndarray:
    n, batch, window = self.shape
    index = (np.arange(n)[:, None] * batch + np.arange(batch)[rows]) % self.n_windows
    starts = index * (window - 1)
    return np.asarray(self.tokens[starts[..., None] + np.arange(window)], np.int32)


def make_eval_batches(cfg, tokens: np.ndarray) -> EvalBatches:
  what = (f"data.eval_fraction={cfg.data.eval_fraction}" if cfg.data.eval_fraction
          else f"data.eval_source={cfg.data.eval_source!r}")
  rows = cfg.train.global_batch // cfg.train.grad_accum
  return EvalBatches(tokens, cfg.eval.batches, rows, cfg.train.seq_len, what)


def make_eval_step(program: engine_lib.TrainProgram):
  """The jitted evaluation: (compute params, frozen weights or None, tokens [N, B, T+1])
  -> mean loss (fp32 scalar)."""
  layout = program.layout
  loss = functools.partial(hooks_lib.loss_with_hooks, program.model, layout=layout,
                           remat=remat_wrapper("full"))
  params_on_device = on_device(program.shardings.params)

  def eval_loss(params, frozen, tokens_NxBxT1):
    params = merge(jax.device_put(params, params_on_device), frozen)
    total, _ = jax.lax.scan(lambda acc, tokens: (acc + loss(params, tokens), None),
                            jnp.zeros((), jnp.float32), tokens_NxBxT1)
    return total / tokens_NxBxT1.shape[0]

  return jax.jit(eval_loss, in_shardings=(program.shardings.params, program.shardings.frozen,
                                          program.batch_sharding),
                 out_shardings=layout.replicated())


class Evaluator:
  """Held-out loss of a train state: its batch is placed and its step compiled
  once, ahead of the first evaluation (with the train step, so that processes
  that compile at different speeds meet before either runs)."""

  def __init__(self, program: engine_lib.TrainProgram, batches: EvalBatches,
               state: engine_lib.TrainState):
    self._tokens = batches_lib.global_batch(batches, program.batch_sharding, 0)
    self._compiled = make_eval_step(program).lower(state.params, state.frozen,
                                                   self._tokens).compile()

  def __call__(self, state: engine_lib.TrainState) -> dict[str, float]:
    loss = float(jax.device_get(self._compiled(state.params, state.frozen, self._tokens)))
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
