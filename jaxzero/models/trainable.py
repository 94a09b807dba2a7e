"""The Llama family (jaxzero.models.llama) under the engine's contract
(jaxzero.models.interface.Model).

The Llama family's loss is next-token cross-entropy over a batch of token
windows [B, T+1], taken over vocabulary chunks (jaxzero.models.loss) so that no
[B, T, V] float32 logits exist; or over a batch of packed examples with a loss mask
(:func:`unpack_batch`): supervised fine-tuning's.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxzero.models.interface import Hooks, KeyedBatch, Model
from jaxzero.models import fp8
from jaxzero.models.llama import (Llama, LlamaConfig, decoder_forward, param_specs,
                                  segment_positions)
from jaxzero.models.loss import cross_entropy

# Vocabulary entries per chunk of the loss: V = 128256 gives 16 chunks of 8016,
# whose float32 logits are B x T x 8016 x 4 bytes (263 MB for seq 8192, B 1).
LOSS_CHUNK = 8192


BATCH_KEYS = ("tokens", "segment_ids", "loss_mask")


def unpack_batch(batch) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """(token windows [B, T+1], the inputs' segment ids [B, T] or None, each target's loss
  weight [B, T] or None) of a batch: token windows alone, or a dict of ``tokens`` with
  optional ``segment_ids`` (packed examples, each a run of equal ids) and ``loss_mask``
  (1 where a token is to be predicted, e.g. an assistant's), all [B, T+1]. A token is
  never predicted from another segment's."""
  if not isinstance(batch, dict):
    return batch, None, None
  unknown = set(batch) - set(BATCH_KEYS)
  if unknown or "tokens" not in batch:
    raise ValueError(f"a batch dict holds {', '.join(BATCH_KEYS)} (tokens required); got "
                     f"{sorted(batch)}")
  segment_ids, mask = batch.get("segment_ids"), batch.get("loss_mask")
  weights = None if mask is None else mask[:, 1:]
  if segment_ids is not None:
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    weights = same if weights is None else weights * same
    segment_ids = segment_ids[:, :-1]
  return batch["tokens"], segment_ids, weights


def target_count(batch) -> jax.Array:
  """The targets a batch's mean loss is over (Model.batch_weight): its weighted
  positions, or all of them without a loss mask or segments."""
  if isinstance(batch, KeyedBatch):
    batch = batch.batch
  tokens, _, weights = unpack_batch(batch)
  if weights is None:
    return jnp.float32(tokens.shape[0] * (tokens.shape[1] - 1))
  return jnp.sum(weights.astype(jnp.float32))


class Sequences(NamedTuple):
  """A batch as the model reads it, in the engine's sequence order (Hooks.sequence_order):
  inputs and targets [B, T], and where they apply segment ids, loss weights and
  positions (None: 0..T-1, or restarting at each segment)."""
  inputs: jax.Array
  targets: jax.Array
  segment_ids: jax.Array | None
  weights: jax.Array | None
  positions: jax.Array | None


def sequences(batch, hooks: Hooks) -> Sequences:
  """`batch` (see :func:`unpack_batch`) laid out in `hooks`' sequence order: every
  per-position array permuted alike, so that a mean loss over them is unchanged."""
  tokens_BxT1, segment_ids_BxT, weights_BxT = unpack_batch(batch)
  order = hooks.sequence_order(tokens_BxT1.shape[1] - 1)
  plain = Sequences(tokens_BxT1[:, :-1], tokens_BxT1[:, 1:], segment_ids_BxT, weights_BxT,
                    None)
  if order is None:
    return plain
  positions = (jnp.arange(len(order), dtype=jnp.int32) if segment_ids_BxT is None
               else segment_positions(segment_ids_BxT))
  return Sequences(*(None if x is None else x[..., order]
                     for x in (*plain[:4], positions)))


def llama(cfg: LlamaConfig, matmul: str = "default") -> Model:
  """A Llama-family decoder (Llama, Mistral, Qwen2) trained on token windows [B, T+1];
  `matmul` "fp8" runs its seven projections in FP8 (jaxzero.models.fp8)."""
  def init(key: jax.Array):
    model = Llama(cfg, rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])

  def loss(params, batch, hooks: Hooks) -> jax.Array:
    seqs = sequences(batch, hooks)
    x_BxTxD, head_DxV = decoder_forward(cfg, params, seqs.inputs, shard=hooks.shard,
                                        gather=hooks.gather, remat=hooks.remat,
                                        scan=hooks.scan, segment_ids_BxT=seqs.segment_ids,
                                        einsum=fp8.EINSUMS[matmul], context=hooks.context,
                                        positions=seqs.positions)
    return cross_entropy(x_BxTxD, head_DxV, seqs.targets, chunk=LOSS_CHUNK,
                         shard=hooks.shard, weights_BxT=seqs.weights)

  # No weight decay on norm gains or on Qwen2's q/k/v biases (as transformers' Trainer).
  decay = lambda path: "norm" not in path and not re.search(r"\['b[qkv]_", path)
  return Model(specs=param_specs(cfg), init=init, loss=loss, decay=decay, layers_key="layers",
               batch_weight=target_count)
