"""Llama-3.1-405B on 1024 GPUs (128 nodes of 8) in 3D: tensor 8 x pipeline 2 x fsdp 64.

- tensor 8: Megatron's splits and sequence parallelism inside each node (NVLink); the
  128 heads, 8 KV heads, MLP 53248 and vocabulary 128256 all divide by 8.
- pipeline 2: 63 layers a stage. 126 layers split into equal stages only by divisors of
  126 (2, 3, 6, 7, 9, ...), and of those only 2 divides 1024 devices; more stages need
  an uneven split, which jaxzero does not have yet.
- fsdp 64: ZeRO-3 over the 64 devices of a stage's data-parallel group, so each device
  keeps 16 bytes x 405 B / (8 x 2 x 64) = 6.3 GB of model state.

Micro-batch 1 x 8192 tokens per data-parallel device, 8 micro-batches a step (4M tokens),
full remat, bf16, and the 1F1B schedule (as DeepSpeed's pipeline engine): a stage keeps
at most 2 micro-batches' stage inputs (and one's residuals between slots), so it plans
at 21.1 GB a device, against 15.8 GB without the pipeline (fsdp 128); its bubble is
(S-1)/(M+S-1) = 1/9 of its slots. GPipe plans at 83.3 GB here: it holds every
micro-batch's activations, and XLA:CPU replicates its merged batch's embedding output
(docs/stages-and-meshes.md, "Pipeline stages").
`python -m jaxzero.plan --config configs/llama405b_3d.py`.
"""

import dataclasses

from jaxzero import config
from jaxzero.models.llama import LLAMA31_8B

LLAMA31_405B = dataclasses.replace(LLAMA31_8B, dim=16_384, n_layers=126, n_heads=128,
                                   n_kv_heads=8, mlp_dim=53_248)


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LLAMA31_405B,
      zero=config.ZeroConfig(stage=3, grad_dtype="bfloat16"),
      mesh=config.MeshConfig(replica=1, fsdp=64, tensor=8, pipeline=2),
      pipeline=config.PipelineConfig(schedule="1f1b"),
      train=dataclasses.replace(c.train, steps=10_000, global_batch=512, grad_accum=8,
                                seq_len=8192, lr=8e-5, warmup_steps=2000, log_every=10),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="full"),
      checkpoint=config.CheckpointConfig(every=500, keep=2),
  )
