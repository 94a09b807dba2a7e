"""QLoRA: Llama-3.1-8B on one 40 GB GPU with the frozen base in NF4 (double-quantized
block scales), rank-16 adapters on all seven projections, 4096-token sequences.

    python -m jaxzero.train --config configs/llama8b_qlora.py --workdir runs/llama8b-qlora \\
      --set init.hf_checkpoint=/models/Meta-Llama-3.1-8B \\
      --set data.tokenizer=/models/Meta-Llama-3.1-8B --set "data.source=/data/*.jsonl"
    python -m jaxzero.export --workdir runs/llama8b-qlora --out runs/llama8b-qlora/adapter --peft

configs/llama8b_lora.py with the base in NF4. The Hugging Face weights are quantized
leaf by leaf as they are read. On N GPUs:
--set train.grad_accum=16/N. The plan: python -m jaxzero.plan --config
configs/llama8b_qlora.py --hbm-gb 40 (docs/lora.md).
"""

import dataclasses
import pathlib

from jaxzero import config


def get_config() -> config.Config:
  lora = config.load(str(pathlib.Path(__file__).with_name("llama8b_lora.py")))
  return dataclasses.replace(lora, lora=dataclasses.replace(lora.lora, base_dtype="nf4"))
