"""QLoRA: Llama-3.1-8B on one 40 GB GPU with the frozen base in NF4 (double-quantized
block scales), rank-16 adapters on all seven projections, 4096-token sequences.

    python -m jaxzero.train --config configs/llama8b_qlora.py --workdir runs/llama8b-qlora \\
      --set init.hf_checkpoint=/models/Meta-Llama-3.1-8B \\
      --set data.tokenizer=/models/Meta-Llama-3.1-8B --set "data.source=/data/*.jsonl"
    python -m jaxzero.export --workdir runs/llama8b-qlora --out runs/llama8b-qlora/adapter --peft

The Hugging Face weights are quantized leaf by leaf as they are read. On N GPUs:
--set train.grad_accum=16/N. The plan: python -m jaxzero.plan --config
configs/llama8b_qlora.py --hbm-gb 40 (docs/lora.md).
"""

import dataclasses

from jaxzero import config
from jaxzero.models.llama import LLAMA31_8B


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LLAMA31_8B,
      lora=config.LoraConfig(rank=16, alpha=32.0, targets="all-linear", base_dtype="nf4"),
      zero=config.ZeroConfig(stage=3),
      mesh=config.MeshConfig(replica=1, fsdp=-1),
      train=dataclasses.replace(c.train, steps=1000, global_batch=16, grad_accum=16,
                                seq_len=4096, lr=2e-4, warmup_steps=30, weight_decay=0.0,
                                log_every=10),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="full"),
      checkpoint=config.CheckpointConfig(every=200, keep=3),
  )
