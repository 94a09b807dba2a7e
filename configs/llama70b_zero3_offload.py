"""Llama-3.1-70B (the Llama-3-70B dims) with ZeRO-3, the optimizer state in host memory.

The fp32 master weights and Adam moments (12 bytes per parameter) live in
pinned host memory, the bf16 compute copy and gradients on the GPUs, sharded.
"""

import dataclasses

from jaxzero import config
from jaxzero.models.llama import LLAMA31_70B


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LLAMA31_70B,
      zero=config.ZeroConfig(stage=3, grad_dtype="bfloat16"),
      mesh=config.MeshConfig(replica=1, fsdp=-1),
      train=dataclasses.replace(c.train, steps=10_000, global_batch=64, grad_accum=8,
                                seq_len=4096, lr=1.5e-4, warmup_steps=500, log_every=10),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="full"),
      offload=config.OffloadConfig(optimizer="pinned_host"),
      checkpoint=config.CheckpointConfig(every=250, keep=2),
  )
