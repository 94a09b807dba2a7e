"""Llama-3.1-8B (the Llama-3-8B dims) with ZeRO-3 (FULL_SHARD) in bf16, for H100 pods.

Every device takes part in sharding (mesh.fsdp=-1). With 8 GPUs per node and
micro-batch 1 x 8192 tokens, global_batch=64 means grad_accum * devices = 64:
8 GPUs use grad_accum=8, 64 GPUs grad_accum=1 (--set train.grad_accum=1).

Fine-tune Llama-3.1-8B from a local Hugging Face checkpoint on your JSON-lines data:
    python -m jaxzero.train --config configs/llama8b_zero3.py --workdir runs/llama8b-ft \\
      --set init.hf_checkpoint=/models/Meta-Llama-3.1-8B \\
      --set data.tokenizer=/models/Meta-Llama-3.1-8B \\
      --set "data.source=/data/chat/*.jsonl" --set data.cache_dir=/data/token_cache \\
      --set train.lr=2e-5 --set train.warmup_steps=50 --set train.steps=2000
The original Llama-3-8B (no RoPE scaling) needs --set model.rope_scaling_factor=0.
"""

import dataclasses

from jaxzero import config
from jaxzero.models.llama import LLAMA31_8B


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LLAMA31_8B,
      zero=config.ZeroConfig(stage=3, grad_dtype="bfloat16"),
      mesh=config.MeshConfig(replica=1, fsdp=-1),
      train=dataclasses.replace(c.train, steps=10_000, global_batch=64, grad_accum=8,
                                seq_len=8192, lr=3e-4, warmup_steps=500, log_every=10),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="save_attention"),
      checkpoint=config.CheckpointConfig(every=500, keep=3),
  )
