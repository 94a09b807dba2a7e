"""Throughput, MFU and peak memory of the jaxzero train step, beside PyTorch.

    python scripts/bench.py --config configs/llama1b_bench.py [--steps 20] [--warmup 5]
        [--torch] [--json OUT] [--set KEY=VALUE ...]

Measures the real train step (the one `jaxzero.train` runs) after warm-up and
reports the median step time, tokens/s, model TFLOP/s, MFU against the
device's bf16 dense peak, and peak device memory. With `--torch` it also runs
the same model (dims, batch, sequence length, bf16, AdamW) as Hugging Face
`LlamaForCausalLM` under `torch.compile` on the same GPU, and prints the
ratio. On a CPU-only machine it runs the same code on virtual CPU devices
(no MFU: there is no meaningful peak), which keeps the script tested.

Model FLOPs per token: 6 * parameters (all of them, embeddings included) +
12 * layers * dim * seq_len (attention scores and values, not halved for
causality), the PaLM convention.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jaxzero import cli  # noqa: E402  (before JAX: virtual devices)
from jaxzero.errors import ConfigError  # noqa: E402
from jaxzero.planning.flops import model_flops_per_token  # noqa: E402
from jaxzero.runtime import xla_flags  # noqa: E402  (before JAX: virtual devices)
from jaxzero.training.throughput import device_peak_tflops  # noqa: E402


def median_step_time(run_step, steps: int, warmup: int) -> float:
  for _ in range(warmup):
    run_step()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    run_step()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bench_jaxzero(cfg, steps: int, warmup: int) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from jaxzero.training import loop  # pylint: disable=import-outside-toplevel

  run = loop.build(cfg)  # the runner the config chooses, as jaxzero.train runs it
  holder = {"state": run.runner.init()}
  batch = run.batch(0)
  compiled = run.runner.compile(holder["state"], batch)

  def one_step():
    holder["state"], metrics = compiled(holder["state"], batch)
    jax.block_until_ready((holder["state"].params, metrics["loss"]))

  step_time = median_step_time(one_step, steps, warmup)
  run.runner.close()
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  return {"framework": "jaxzero", "device": device.device_kind, "devices": jax.device_count(),
          "step_time_s": step_time, "peak_memory_bytes": stats.get("peak_bytes_in_use"),
          # The training log's counts: a model_factory model's own, LoRA's adapters trained.
          "parameters": run.program.n_params, "frozen_parameters": run.program.n_frozen}


def bench_torch(cfg, steps: int, warmup: int) -> dict:
  """The same model and batch in PyTorch: transformers Llama, torch.compile, AdamW."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from jaxzero.hf import config_json  # pylint: disable=import-outside-toplevel

  on_gpu = torch.cuda.is_available()
  device = "cuda" if on_gpu else "cpu"
  dtype = torch.bfloat16 if cfg.precision.compute == "bfloat16" else torch.float32
  hf_config = transformers.LlamaConfig(**config_json.hf_config_from_llama(cfg.model))
  hf_config._attn_implementation = "sdpa"  # pylint: disable=protected-access
  model = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=dtype)
  optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, fused=on_gpu)
  step_model = torch.compile(model) if on_gpu else model
  t = cfg.train
  tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch // t.grad_accum, t.seq_len + 1),
                         device=device)

  def one_step():
    for _ in range(t.grad_accum):
      # Hugging Face shifts the labels itself: same next-token loss as jaxzero's.
      out = step_model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
      (out.loss / t.grad_accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if on_gpu:
      torch.cuda.synchronize()

  if on_gpu:
    torch.cuda.reset_peak_memory_stats()
  step_time = median_step_time(one_step, steps, warmup)
  peak = torch.cuda.max_memory_allocated() if on_gpu else None
  return {"framework": "pytorch", "device": torch.cuda.get_device_name() if on_gpu else "cpu",
          "devices": 1, "step_time_s": step_time,
          "peak_memory_bytes": peak, "parameters": sum(p.numel() for p in model.parameters()),
          "frozen_parameters": 0}


def release_torch_memory() -> None:
  """Hands the GPU memory PyTorch still caches back, once its model is garbage."""
  import gc  # pylint: disable=import-outside-toplevel

  import torch  # pylint: disable=import-outside-toplevel
  torch.compiler.reset()  # compiled graphs may hold the model
  gc.collect()
  if torch.cuda.is_available():
    torch.cuda.empty_cache()


def add_rates(result: dict, cfg) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  t = cfg.train
  tokens = t.global_batch * t.seq_len
  flops_per_token = model_flops_per_token(cfg, result["parameters"],
                                          result["frozen_parameters"])
  tflops = flops_per_token * tokens / result["step_time_s"] / 1e12
  peak = device_peak_tflops(jax.devices()[0])
  devices = result["devices"]
  result.update(tokens_per_sec=tokens / result["step_time_s"], model_tflops=tflops,
                mfu=tflops / (peak * devices) if peak else None)
  return result


def print_table(results: list[dict]) -> None:
  print(f"{'framework':<10} {'device':<26} {'step s':>8} {'tokens/s':>12} {'TFLOP/s':>9} "
        f"{'MFU':>6} {'peak GiB':>9}")
  for r in results:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    peak = f"{r['peak_memory_bytes'] / 2**30:.1f}" if r["peak_memory_bytes"] else "n/a"
    print(f"{r['framework']:<10} {r['device'][:26]:<26} {r['step_time_s']:>8.3f} "
          f"{r['tokens_per_sec']:>12,.0f} {r['model_tflops']:>9.1f} {mfu:>6} {peak:>9}")
  if len(results) == 2:  # per device: PyTorch runs on one
    mine, theirs = (r["tokens_per_sec"] / r["devices"] for r in results)
    print(f"jaxzero / pytorch tokens/s per device: {mine / theirs:.2f}x")


def main(argv=None) -> int:
  parser = cli.Parser(prog="bench.py", description=__doc__.split("\n")[0])
  cli.add_config_args(parser)
  parser.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
  parser.add_argument("--warmup", type=int, default=5, help="untimed steps after compiling")
  parser.add_argument("--torch", action="store_true", help="also run the PyTorch reference")
  parser.add_argument("--json", help="write the results here as JSON")
  args = parser.parse_args(argv)

  def body():
    if args.steps < 1 or args.warmup < 0:
      parser.error("--steps must be >= 1 and --warmup >= 0")
    xla_flags.apply_gpu_defaults()  # the flags jaxzero.train sets on GPU, before JAX starts
    if args.torch:
      # Both share the GPU: JAX must not take 75% of it when it starts, and PyTorch
      # runs first and hands its cached memory back before JAX allocates.
      os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    loaded = cli.load_config(args)  # before JAX starts: creates virtual CPU devices
    if args.torch and (loaded.cfg.model_factory or loaded.cfg.lora.rank):
      raise ConfigError("--torch runs the config's Llama as a full fine-tune in PyTorch: it has "
                        "no reference for a model_factory model or a LoRA run (lora.rank); "
                        "leave --torch out")
    import jax  # pylint: disable=import-outside-toplevel
    cfg = loaded.resolve(jax.device_count())
    reference = None
    if args.torch:
      reference = add_rates(bench_torch(cfg, args.steps, args.warmup), cfg)
      release_torch_memory()
    results = [add_rates(bench_jaxzero(cfg, args.steps, args.warmup), cfg)]
    if reference:
      results.append(reference)
    print_table(results)
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")

  return cli.run_main("bench.py", body)


if __name__ == "__main__":
  sys.exit(main())
