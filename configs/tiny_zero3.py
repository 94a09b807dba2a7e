"""The embedded default: a small Llama under ZeRO-3 on every device there is.

Trains on the Python standard library's own source as bytes, so it runs on
any machine with Python: on a machine without a GPU, on 8 virtual CPU devices
(JAX_NUM_CPU_DEVICES=N for N), in about two minutes on a 2-core laptop; on 1, 2, 4
or 8 GPUs, on all of them (mesh.fsdp=-1; global batch 32 = micro-batch x devices x 2).
"""

import dataclasses

from jaxzero import config
from jaxzero.models.llama import LlamaConfig


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                        mlp_dim=384, rope_theta=10_000.0),
      zero=config.ZeroConfig(stage=3),
      mesh=config.MeshConfig(replica=1, fsdp=-1),
      train=dataclasses.replace(c.train, steps=80, global_batch=32, grad_accum=2, seq_len=128,
                                lr=3e-3, warmup_steps=10, weight_decay=0.01, log_every=5),
      precision=config.PrecisionConfig(compute="float32"),
      checkpoint=config.CheckpointConfig(every=40),
  )
