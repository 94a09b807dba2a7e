"""A tiny model's config, and a checkpoint's weights read back, for tests that train it."""

import dataclasses

from jaxzero import config
from jaxzero.checkpoint import checkpointer
from jaxzero.models.llama import LlamaConfig


def tiny_config(stage: int, nonfinite: str) -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c, model=LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           mlp_dim=64, rope_theta=10_000.0),
      zero=config.ZeroConfig(stage=stage), mesh=config.MeshConfig(replica=1, fsdp=8),
      train=dataclasses.replace(c.train, steps=5, global_batch=16, grad_accum=1, seq_len=16,
                                lr=3e-3, warmup_steps=1, nonfinite=nonfinite, max_nonfinite=2),
      precision=config.PrecisionConfig(compute="float32"),
      checkpoint=config.CheckpointConfig(every=1, keep=10),
      data=config.DataConfig(max_bytes=200_000))


def master_at(workdir, step_no):
  with checkpointer.CheckpointReader(workdir) as reader:
    shapes = reader.leaf_shapes(step_no)
    name = "master/layers/w_up_LxDxF"
    return reader.read(step_no, tuple(name.split("/")), shapes[name])


# The tiny preset, smaller, in float32: 10 steps, saved at 5 and 10 (ZeRO-Infinity's tests).
INFINITY_SETS = ["model.dim=64", "model.n_layers=2", "model.mlp_dim=128", "train.global_batch=16",
                 "train.seq_len=16", "precision.compute=float32", "train.steps=10",
                 "train.warmup_steps=1", "train.lr=3e-3", "train.log_every=1",
                 "data.max_bytes=200000", "checkpoint.every=5"]


def infinity_sets(nvme_dir, params="nvme"):
  """offload.params=nvme (or `params`) with the optimizer state on NVMe in `nvme_dir`."""
  return ["offload.optimizer=nvme", f"offload.params={params}", f"offload.nvme_dir={nvme_dir}"]
