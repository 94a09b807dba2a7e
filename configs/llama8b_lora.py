"""Llama-3.1-8B LoRA fine-tuning on one 40 GB GPU: the base frozen in bf16, rank-16
adapters on all seven projections (PEFT's all-linear), 4096-token sequences.

    python -m jaxzero.train --config configs/llama8b_lora.py --workdir runs/llama8b-lora \\
      --set init.hf_checkpoint=/models/Meta-Llama-3.1-8B \\
      --set data.tokenizer=/models/Meta-Llama-3.1-8B --set "data.source=/data/*.jsonl"
    python -m jaxzero.export --workdir runs/llama8b-lora --out runs/llama8b-lora/adapter --peft

For chat records ({"messages": [...]}), the loss on the assistant's tokens, add
--set data.format=chat --set data.packing=true (the Instruct model's chat template is
read from data.tokenizer's directory; docs/training.md, fine-tuning records).

On N GPUs: --set train.grad_accum=16/N. The plan: python -m jaxzero.plan --config
configs/llama8b_lora.py --hbm-gb 40 (docs/lora.md).
"""

import dataclasses

from jaxzero import config
from jaxzero.models.llama import LLAMA31_8B


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LLAMA31_8B,
      lora=config.LoraConfig(rank=16, alpha=32.0, targets="all-linear"),
      zero=config.ZeroConfig(stage=3),
      mesh=config.MeshConfig(replica=1, fsdp=-1),
      train=dataclasses.replace(c.train, steps=1000, global_batch=16, grad_accum=16,
                                seq_len=4096, lr=2e-4, warmup_steps=30, weight_decay=0.0,
                                log_every=10),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="full"),
      checkpoint=config.CheckpointConfig(every=200, keep=3),
  )
