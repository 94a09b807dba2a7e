"""Llama-3-70B with ZeRO-3 and the optimizer state offloaded to host memory.

The fp32 master weights and Adam moments (12 bytes per parameter) live in
pinned host memory, the bf16 compute copy and gradients on the GPUs, sharded.
"""

import dataclasses

from jaxzero import config
from models.llama import LlamaConfig

LLAMA3_70B = LlamaConfig(
    vocab_size=128_256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, mlp_dim=28_672,
    norm_eps=1e-5, rope_theta=500_000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0, rope_original_max_len=8192, tie_embeddings=False)


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LLAMA3_70B,
      zero=config.ZeroConfig(stage=3, grad_dtype="bfloat16"),
      mesh=config.MeshConfig(replica=1, fsdp=-1),
      train=dataclasses.replace(c.train, steps=10_000, global_batch=64, grad_accum=8,
                                seq_len=4096, lr=1.5e-4, warmup_steps=500, log_every=10),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="full"),
      offload=config.OffloadConfig(optimizer="pinned_host"),
      checkpoint=config.CheckpointConfig(every=250, keep=2),
  )
