"""One rank of scripts/compare.py's PyTorch runs: DeepSpeed or FSDP2 on the saved windows.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N scripts/compare_torch.py
        --framework deepspeed|fsdp2 --ds-config ds.json --hf DIR --batches batches.npy --out OUT

Every rank starts from the Hugging Face checkpoint in DIR and reads its rows of each step's
batch from batches.npy ([steps, grad_accum, global micro-batch, seq_len + 1] tokens; rank r
takes rows r*m to (r+1)*m of each micro-step, m the micro-batch per rank). The loss of a
micro-step is the mean next-token cross-entropy of its rows, computed from the logits in
float32 (inputs tokens[:, :-1], targets tokens[:, 1:]); a step's loss is the mean over its
micro-steps and the ranks, as jaxzero reports it. Rank 0 writes the losses, each step's wall
time and every rank's peak RSS (ru_maxrss) to OUT as JSON.

DeepSpeed runs the ds_config as written (gloo, DS_ACCELERATOR=cpu). FSDP2 runs its
equivalent: fully_shard on each decoder layer and on the root (resharding after forward at
stage 3 only), MixedPrecisionPolicy(bfloat16 params, float32 reduction) under bf16,
CPUOffloadPolicy when the file offloads, torch.optim.AdamW with the file's hyperparameters
(DeepSpeed's defaults for those it leaves out), the file's scheduler (DeepSpeed's own class,
stepped after each update as DeepSpeed's engine steps it) and its gradient clipping. Both
give norm gains (parameters whose name contains "norm") no weight decay, as jaxzero does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--framework", choices=("deepspeed", "fsdp2"), required=True)
  parser.add_argument("--ds-config", required=True, help="the ds_config, batch sizes resolved")
  parser.add_argument("--hf", required=True, help="the Hugging Face checkpoint to start from")
  parser.add_argument("--batches", required=True, help="the token windows (.npy)")
  parser.add_argument("--out", required=True, help="where rank 0 writes its JSON")
  return parser.parse_args(argv)


def param_groups(model: torch.nn.Module, weight_decay: float | None = None) -> list[dict]:
  """Two groups: decayed weights, and norm gains without decay (jaxzero's mask)."""
  named = list(model.named_parameters())
  no_decay = {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}
  decay = {"params": [p for n, p in named if "norm" not in n]}
  if weight_decay is not None:
    decay["weight_decay"] = weight_decay
  return [decay, no_decay]


def adamw_settings(ds: dict) -> dict:
  """torch.optim.AdamW's arguments for the file's optimizer block, with DeepSpeed's
  defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01 with torch_adam (torch's
  AdamW) and 0 otherwise (DeepSpeed's CPU Adam and FusedAdam)."""
  block = ds.get("optimizer", {})
  kind = str(block.get("type", "adamw")).lower()
  params = block.get("params", {})
  if kind not in ("adam", "adamw") or params.get("adam_w_mode", True) is False:
    raise SystemExit(f"compare_torch: optimizer {block.get('type')!r} with adam_w_mode="
                     f"{params.get('adam_w_mode', True)}: only AdamW is compared")
  return {"lr": params.get("lr", 1e-3), "betas": tuple(params.get("betas", (0.9, 0.999))),
          "eps": params.get("eps", 1e-8),
          "weight_decay": params.get("weight_decay", 0.01 if params.get("torch_adam") else 0.0)}


def make_scheduler(ds: dict, optimizer):
  """The file's scheduler as DeepSpeed builds it, or None (a constant learning rate)."""
  if "scheduler" not in ds:
    return None
  from deepspeed.runtime import lr_schedules  # pylint: disable=import-outside-toplevel
  block = ds["scheduler"]
  return getattr(lr_schedules, block["type"])(optimizer, **block.get("params", {}))


def rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def token_loss(model, tokens: torch.Tensor) -> torch.Tensor:
  """Mean next-token cross-entropy of `tokens` [b, T+1], from float32 logits."""
  logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
  return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                         tokens[:, 1:].reshape(-1))


class DeepSpeedRun:
  """deepspeed.initialize on the ds_config; the engine accumulates, clips and steps."""

  def __init__(self, ds: dict, model):
    import deepspeed  # pylint: disable=import-outside-toplevel
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
    if offload == "cpu" and dist.get_rank() == 0:
      # DeepSpeedCPUAdam compiles a C++ op on first use: one rank builds it, the others
      # then load it from the cache.
      from deepspeed.ops.op_builder import CPUAdamBuilder  # pylint: disable=import-outside-toplevel
      CPUAdamBuilder().load()
    dist.barrier()
    self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                                config=ds)
    self.accum = self.engine.gradient_accumulation_steps()
    # The update DeepSpeed chose (torch.optim.AdamW, DeepSpeedCPUAdam, FusedAdam), inside ZeRO's.
    self.optimizer = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)

  def micro_step(self, tokens: torch.Tensor) -> float:
    loss = token_loss(self.engine, tokens)
    self.engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps
    self.engine.step()  # updates (and steps the scheduler) at the accumulation boundary
    return loss.item()


class FSDP2Run:
  """fully_shard per decoder layer and the root; AdamW, clipping and the schedule by hand."""

  def __init__(self, ds: dict, model, accum: int):
    # pylint: disable=import-outside-toplevel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    # pylint: enable=import-outside-toplevel
    zero = ds.get("zero_optimization", {})
    offload = "cpu" in (zero.get("offload_optimizer", {}).get("device"),
                        zero.get("offload_param", {}).get("device"))
    bf16 = ds.get("bf16", ds.get("bfloat16", {})).get("enabled", False) is True
    options = dict(
        mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
        reshard_after_forward=zero.get("stage", 0) == 3,  # ZeRO-3; else SHARD_GRAD_OP
        mp_policy=(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                   if bf16 else MixedPrecisionPolicy()),
        offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy())
    for layer in model.model.layers:
      fully_shard(layer, **options)
    fully_shard(model, **options)
    self.model, self.accum = model, accum
    self.optimizer = torch.optim.AdamW(param_groups(model), **adamw_settings(ds))
    self.scheduler = make_scheduler(ds, self.optimizer)
    self.clip = float(ds.get("gradient_clipping", 0.0))
    self.micro = 0

  def micro_step(self, tokens: torch.Tensor) -> float:
    loss = token_loss(self.model, tokens)
    (loss / self.accum).backward()  # FSDP2 averages the reduce-scatter over the ranks
    self.micro += 1
    if self.micro % self.accum == 0:
      if self.clip > 0:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
      self.optimizer.step()
      if self.scheduler is not None:
        self.scheduler.step()  # after the update, as DeepSpeed's engine does
      self.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main(argv=None) -> int:
  args = parse_args(argv)
  import transformers  # pylint: disable=import-outside-toplevel
  if args.framework == "deepspeed":
    import deepspeed  # pylint: disable=import-outside-toplevel

    # Its shared-memory all-reduce serves inference only and would be compiled first.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
  else:
    dist.init_process_group("gloo")
  rank, world = dist.get_rank(), dist.get_world_size()
  ds = json.loads(open(args.ds_config, encoding="utf-8").read())
  batches = np.load(args.batches, mmap_mode="r")  # [steps, accum, global micro, T + 1]
  steps, accum, rows = batches.shape[:3]
  micro = rows // world
  model = transformers.LlamaForCausalLM.from_pretrained(args.hf).float()
  model.config.use_cache = False
  model.train()
  run = DeepSpeedRun(ds, model) if args.framework == "deepspeed" else FSDP2Run(ds, model, accum)
  losses, times = [], []
  for step in range(steps):
    start = time.perf_counter()
    total = 0.0
    for a in range(accum):
      window = np.asarray(batches[step, a, rank * micro:(rank + 1) * micro], np.int64)
      total += run.micro_step(torch.from_numpy(window))
    summed = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(summed)
    times.append(time.perf_counter() - start)
    losses.append(summed.item() / (accum * world))
    if rank == 0:
      print(f"{args.framework} step {step + 1}/{steps} loss {losses[-1]:.6f} "
            f"{times[-1]:.2f} s", flush=True)
  peaks = [None] * world
  update = type(run.optimizer)
  dist.all_gather_object(peaks, rss_bytes())
  if rank == 0:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"framework": args.framework, "losses": losses, "step_time_s": times,
                 "peak_rss_bytes": peaks, "world": world, "torch": torch.__version__,
                 "optimizer": f"{update.__module__}.{update.__qualname__}",
                 "threads": torch.get_num_threads()}, f)
  dist.barrier()  # the results are written
  return 0


if __name__ == "__main__":
  os.environ.setdefault("DS_ACCELERATOR", "cpu")
  code = main()
  # gloo's teardown (destroy_process_group, or the interpreter's exit) aborts now and then
  # ("terminate called without an active exception") when the ranks leave at different
  # moments; every rank has passed the barrier after the results, so each leaves at once.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access
