"""The Llama family (jaxzero.models.llama) under the engine's contract
(jaxzero.models.interface.Model).

The Llama family's loss is next-token cross-entropy over a batch of token
windows [B, T+1], taken over vocabulary chunks (jaxzero.models.loss) so that no
[B, T, V] float32 logits exist.
"""

from __future__ import annotations

import re

import jax
from flax import nnx

from jaxzero.models.interface import Hooks, Model
from jaxzero.models.llama import Llama, LlamaConfig, param_specs
from jaxzero.models.loss import cross_entropy

# Vocabulary entries per chunk of the loss: V = 128256 gives 16 chunks of 8016,
# whose float32 logits are B x T x 8016 x 4 bytes (263 MB for seq 8192, B 1).
LOSS_CHUNK = 8192


def llama(cfg: LlamaConfig) -> Model:
  """A Llama-family decoder (Llama, Mistral, Qwen2) trained on token windows [B, T+1]."""
  graphdef = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]

  def init(key: jax.Array):
    model = Llama(cfg, rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])

  def loss(params, tokens_BxT1: jax.Array, hooks: Hooks) -> jax.Array:
    model = nnx.merge(graphdef, params)
    x_BxTxD, head_DxV = model.forward(tokens_BxT1[:, :-1], shard=hooks.shard,
                                      gather=hooks.gather, remat=hooks.remat,
                                      scan=hooks.scan)
    return cross_entropy(x_BxTxD, head_DxV, tokens_BxT1[:, 1:], chunk=LOSS_CHUNK,
                         shard=hooks.shard)

  # No weight decay on norm gains or on Qwen2's q/k/v biases (as transformers' Trainer).
  decay = lambda path: "norm" not in path and not re.search(r"\['b[qkv]_", path)
  return Model(specs=param_specs(cfg), init=init, loss=loss, decay=decay, layers_key="layers")
