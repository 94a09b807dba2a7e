"""A Llama-3.2-1B-shaped model for the single-GPU throughput benchmark (scripts/bench.py).

Sequence length 4096, bf16 compute, on every device there is (one GPU: the
benchmark's; 8 virtual CPU devices where there is none). The ZeRO stage does not
matter on one device; stage 3 keeps the code path the one pods use.
"""

import dataclasses

from jaxzero import config
from jaxzero.models.llama import LLAMA32_1B


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LLAMA32_1B,
      zero=config.ZeroConfig(stage=3, grad_dtype="bfloat16"),
      mesh=config.MeshConfig(replica=1, fsdp=-1),
      train=dataclasses.replace(c.train, global_batch=8, grad_accum=1, seq_len=4096),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="save_matmuls"),
  )
