"""Llama-3.1-8B at 131,072 tokens a sequence on one 8-GPU node: context parallelism.

Each sequence is split 8 ways (mesh.context=8): a device holds 16,384 of its tokens'
activations, and attention gathers the keys and values of the other 7 parts every layer.
ZeRO-3 shards the state over the same 8 devices; each layer's weights are gathered
where they are used and recomputed activations (remat full) keep the rest small.

    python -m jaxzero.train --config configs/llama8b_128k.py --workdir runs/llama8b-128k \\
      --set init.hf_checkpoint=/models/Meta-Llama-3.1-8B \\
      --set data.tokenizer=/models/Meta-Llama-3.1-8B --set "data.source=/data/long/*.jsonl"

The plan: python -m jaxzero.plan --config configs/llama8b_128k.py (docs/stages-and-meshes.md,
context parallelism). On 16 devices: --set mesh.fsdp=2 --set train.global_batch=16 doubles
the sequences a step.
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
      mesh=config.MeshConfig(replica=1, fsdp=-1, context=8),
      train=dataclasses.replace(c.train, steps=2_000, global_batch=8, grad_accum=8,
                                seq_len=131_072, lr=2e-5, warmup_steps=50, log_every=1),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="full"),
      checkpoint=config.CheckpointConfig(every=100, keep=3),
  )
