"""Llama-3.1-70B (the Llama-3-70B dims) on one GPU with ZeRO-Infinity: parameters,
gradients and optimizer state on local NVMe (offload.params=nvme, offload.optimizer=nvme).

The device holds one layer at a time (the driver of jaxzero.runners.infinity), the
embedding or head while they run, and one activation checkpoint per layer; micro-batch
1 x 4096 tokens and no gradient accumulation: every micro-step reads the weights twice and,
after the first, reads and rewrites the gradient sums, so a larger batch is cheaper as a
larger micro-batch (the device then holds larger checkpoints) than as more micro-steps. Plan it with `python -m jaxzero.plan --config configs/llama70b_infinity.py`;
train it with `--set offload.nvme_dir=/local/nvme` (about 1.2 TB free: 16 bytes a parameter).
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
      mesh=config.MeshConfig(replica=1, fsdp=1),
      train=dataclasses.replace(c.train, steps=1000, global_batch=1, grad_accum=1,
                                seq_len=4096, lr=1.5e-5, warmup_steps=50, log_every=1),
      precision=config.PrecisionConfig(compute="bfloat16"),
      remat=config.RematConfig(policy="full"),
      offload=config.OffloadConfig(optimizer="nvme", params="nvme"),
      checkpoint=config.CheckpointConfig(every=100, keep=2),
  )
