"""Model FLOPs per token, the PaLM convention: 6 * parameters (all of them, embeddings
included) + 12 * layers * dim * seq_len (attention scores and values, not halved for
causality). The training log's MFU and the ZeRO-Infinity plan's predicted step use it.
"""

from __future__ import annotations


def model_flops_per_token(cfg, n_params: int, n_frozen: int = 0) -> float:
  """6Φ, and for the Llama family its attention's 12 x layers x dim x seq_len. Frozen
  weights (a LoRA base) cost 4 a token: forward and the activations' gradient, no
  weight gradient."""
  if cfg.model_factory:  # a user's model: its attention, if any, is its own
    return 6 * n_params + 4 * n_frozen
  m = cfg.model
  return 6 * n_params + 4 * n_frozen + 12 * m.n_layers * m.dim * cfg.train.seq_len
