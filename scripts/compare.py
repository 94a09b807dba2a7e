"""One training job run three ways, DeepSpeed, PyTorch FSDP2 and jaxzero, loss by loss.

    python scripts/compare.py --deepspeed ds_config.json [--ds-set KEY=VALUE ...]
        [--dim D --layers L --heads H --kv-heads K --mlp F --vocab V --seq T]
        [--steps N] [--nproc P] [--workdir DIR] [--json OUT] [--rtol R] [--init-bf16]
        [--frameworks deepspeed,fsdp2,jaxzero]

Runs the job of a ds_config on a small Llama with P ranks on this machine's CPU:

- DeepSpeed with the file (torchrun, gloo, DS_ACCELERATOR=cpu);
- PyTorch FSDP2 with the equivalent settings (scripts/compare_torch.py says which);
- ``python -m jaxzero.launch --nproc P -- --config BASE --deepspeed FILE``, BASE being
  jaxzero's defaults with the model shape and data replaced (DIR/base_config.py).

All three start from one Hugging Face checkpoint (``LlamaForCausalLM`` with a fixed seed;
jaxzero reads it with ``init.hf_checkpoint``) and train on the same token windows in the
same order and split over the ranks: jaxzero's own data pipeline (jaxzero.data) cuts each
step's batch, [grad_accum, global micro-batch, seq_len + 1] tokens, into DIR/batches.npy,
and rank r of the PyTorch runs takes rows r*m to (r+1)*m of each micro-step, as jaxzero's
devices do. Every loss is the mean next-token cross-entropy over the step's rows and
positions. Prints a table of the losses, their largest relative difference (between any two
of the three), each step's time and each rank's peak RSS; ``--json`` writes it as one
object. ``--ds-set bf16.enabled=false`` changes the file (a dotted key, a JSON value) for
all three. ``--rtol R`` exits 1 when a step's difference exceeds R. ``--init-bf16`` starts
all three from weights rounded to bfloat16, the master weights DeepSpeed's bf16 mode makes.

Needs DeepSpeed, PyTorch and transformers: ``pip install 'jaxzero[compare]'``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORKER = pathlib.Path(__file__).resolve().parent / "compare_torch.py"
FRAMEWORKS = ("deepspeed", "fsdp2", "jaxzero")
EXTRAS = ("deepspeed", "torch", "transformers")
INSTALL = "pip install 'jaxzero[compare]'"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps")

BASE_CONFIG = '''\
"""Written by scripts/compare.py: jaxzero's defaults with the model and data compared."""

import dataclasses

from jaxzero import config


def get_config() -> config.Config:
  c = config.base()
  return dataclasses.replace(
      c,
      model=dataclasses.replace(c.model, vocab_size={vocab}, dim={dim}, n_layers={layers},
                                n_heads={heads}, n_kv_heads={kv_heads}, mlp_dim={mlp}),
      train=dataclasses.replace(c.train, steps={steps}, seq_len={seq}, log_every=1{schedule}),
      data=dataclasses.replace(c.data, max_bytes={max_bytes}),
      seed={seed},
  )
'''
# DeepSpeed trains at the optimizer's constant lr when the file has no scheduler; jaxzero
# keeps the base's schedule then, so the base says the same.
CONSTANT_LR = ', schedule="warmup_constant", warmup_min_ratio=1.0'


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="compare.py", description="One job as DeepSpeed, PyTorch FSDP2 and jaxzero runs it.")
  parser.add_argument("--deepspeed", required=True, metavar="ds_config.json")
  parser.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE",
                      help="change the file for all three runs, e.g. bf16.enabled=false or "
                           "zero_optimization.stage=2 (the value is JSON)")
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--mlp", type=int, default=384)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) per framework")
  parser.add_argument("--seed", type=int, default=0, help="of the initial weights and the data")
  parser.add_argument("--init-bf16", action="store_true",
                      help="round the initial weights to bfloat16 (saved in float32): the fp32 "
                           "master weights DeepSpeed's bf16 mode starts from, for all three")
  parser.add_argument("--max-bytes", type=int, default=4_000_000,
                      help="bytes of the standard library's source to train on")
  parser.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                      help="which to run, comma-separated")
  parser.add_argument("--workdir", default="runs/compare")
  parser.add_argument("--json", metavar="OUT", help="write the results as one JSON object")
  parser.add_argument("--rtol", type=float,
                      help="exit 1 when two losses of a step differ by more than this")
  return parser.parse_args(argv)


def missing_extras() -> list[str]:
  return [name for name in EXTRAS if importlib.util.find_spec(name) is None]


def apply_ds_sets(ds: dict, assignments: list[str]) -> dict:
  """`ds` with each dotted KEY=VALUE (VALUE as JSON, else a string) set."""
  if not isinstance(ds, dict):
    raise ValueError("not a JSON object")
  ds = copy.deepcopy(ds)
  for assignment in assignments:
    key, sep, text = assignment.partition("=")
    if not sep:
      raise ValueError(f"--ds-set {assignment!r}: expected KEY=VALUE")
    try:
      value = json.loads(text)
    except json.JSONDecodeError:
      value = text
    *parents, leaf = key.split(".")
    block = ds
    for depth, name in enumerate(parents):
      block = block.setdefault(name, {})
      if not isinstance(block, dict):
        raise ValueError(f"--ds-set {assignment!r}: {'.'.join(parents[:depth + 1])} is "
                         f"{json.dumps(block)}, not a block of keys")
    block[leaf] = value
  return ds


def resolved_ds(ds: dict, cfg, world: int) -> dict:
  """The file as DeepSpeed must see it: the batch sizes ("auto" or absent) filled from
  the run (DeepSpeed's rule, as jaxzero resolved it); any other "auto" is an error. An
  absent gradient_clipping is DeepSpeed's default written out (1.0: DeepSpeed and jaxzero
  clip there), so that FSDP2, which reads this file, clips as they do."""
  ds = copy.deepcopy(ds)
  ds.setdefault("gradient_clipping", 1.0)
  t = cfg.train
  sizes = dict(zip(BATCH_KEYS, (t.global_batch, t.global_batch // (t.grad_accum * world),
                                t.grad_accum)))
  ds.update(sizes)

  def check(block, where):
    for key, value in block.items():
      if isinstance(value, dict):
        check(value, f"{where}{key}.")
      elif value == "auto":
        raise ValueError(f"{where}{key}=\"auto\": only the batch sizes may be \"auto\" here; "
                         "write the value (--ds-set KEY=VALUE)")
  check(ds, "")
  return ds


def write_base_config(args, ds: dict, path: pathlib.Path) -> None:
  path.write_text(BASE_CONFIG.format(
      vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
      kv_heads=args.kv_heads, mlp=args.mlp, steps=args.steps, seq=args.seq,
      max_bytes=args.max_bytes, seed=args.seed,
      schedule="" if "scheduler" in ds else CONSTANT_LR))


def jaxzero_train_args(base: pathlib.Path, ds_file: pathlib.Path, workdir: pathlib.Path,
                       hf_dir: pathlib.Path, steps: int) -> list[str]:
  return ["--config", str(base), "--deepspeed", str(ds_file), "--workdir", str(workdir),
          "--steps", str(steps), "--no-progress", "--set", f"init.hf_checkpoint={hf_dir}",
          "--set", "train.log_every=1"]


def load_jaxzero_config(train_args: list[str], n_devices: int):
  """The config jaxzero.train resolves from these arguments on `n_devices` devices."""
  from jaxzero import cli  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(config=train_args[1], deepspeed=train_args[3],
                            accelerate_config=None,
                            set=[train_args[i + 1] for i, a in enumerate(train_args)
                                 if a == "--set"])
  return cli.load_config(args).resolve(n_devices)


def save_batches(cfg, n_data_parallel: int, steps: int, path: pathlib.Path,
                 workdir: pathlib.Path):
  """Each step's batch as jaxzero.training.loop.build makes it: [steps, A, B, T + 1]."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxzero.data import batches as batches_lib  # pylint: disable=import-outside-toplevel
  from jaxzero.data import tokens as tokens_lib  # pylint: disable=import-outside-toplevel
  from jaxzero.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from jaxzero.data import pipeline  # pylint: disable=import-outside-toplevel

  micro = mesh_lib.micro_batch(cfg.train, n_data_parallel)
  source = tokens_lib.open_tokens(cfg.data, workdir, model_vocab_size=cfg.model.vocab_size,
                                  progress=False)
  tokens, _ = pipeline.split(source.tokens, cfg.data)
  batches = batches_lib.Batches(tokens, cfg.train.seq_len, cfg.train.grad_accum,
                                micro * n_data_parallel, cfg.seed, order=source.order)
  array = np.stack([batches(step) for step in range(steps)])
  np.save(path, array)
  return array.shape


def save_hf_checkpoint(cfg, seed: int, path: pathlib.Path, init_bf16: bool = False) -> int:
  """A LlamaForCausalLM of `cfg.model`'s shape, seeded, in float32 (`init_bf16`: each
  weight rounded to bfloat16 first); returns its parameter count."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from jaxzero.hf import config_json  # pylint: disable=import-outside-toplevel
  transformers.utils.logging.disable_progress_bar()
  hf_config = transformers.LlamaConfig(**config_json.hf_config_from_llama(cfg.model))
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(hf_config).to(torch.float32)
  if init_bf16:
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
  model.save_pretrained(path)
  return sum(p.numel() for p in model.parameters())


def run_logged(command: list[str], log: pathlib.Path, env: dict, name: str) -> float:
  """Runs `command` with its output in `log`; returns the wall time, or exits on failure."""
  print(f"compare: {name}: {' '.join(command)}", flush=True)
  start = time.perf_counter()
  with open(log, "w", encoding="utf-8") as out:
    code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
  wall = time.perf_counter() - start
  if code:
    tail = "".join(f"\n  {line}" for line in log.read_text(errors="replace").splitlines()[-25:])
    raise RunFailed(f"{name} exited with code {code} after {wall:.0f} s; see {log}:{tail}")
  print(f"compare: {name} finished in {wall:.1f} s", flush=True)
  return wall


class RunFailed(Exception):
  pass


def run_torch(framework: str, args, ds_file: pathlib.Path, hf_dir: pathlib.Path,
              batches: pathlib.Path, workdir: pathlib.Path) -> dict:
  out = workdir / f"{framework}.json"
  env = dict(os.environ, DS_ACCELERATOR="cpu")
  env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
  command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node", str(args.nproc), str(WORKER), "--framework", framework,
             "--ds-config", str(ds_file), "--hf", str(hf_dir), "--batches", str(batches),
             "--out", str(out)]
  wall = run_logged(command, workdir / f"{framework}.log", env, framework)
  result = json.loads(out.read_text())
  result["wall_s"] = wall
  return result


def run_jaxzero(args, train_args: list[str], workdir: pathlib.Path) -> dict:
  run_dir = pathlib.Path(train_args[train_args.index("--workdir") + 1])
  shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
  command = [sys.executable, "-m", "jaxzero.launch", "--nproc", str(args.nproc),
             "--devices-per-proc", "1", "--", *train_args]
  wall = run_logged(command, workdir / "jaxzero.log", dict(os.environ), "jaxzero")
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
  records = sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])
  rss = [r["host_rss_bytes"] for r in records if r.get("host_rss_bytes") is not None]
  return {"framework": "jaxzero", "losses": [r["loss"] for r in records],
          "step_time_s": [r["step_time_s"] for r in records],
          # jaxzero logs process 0's resident memory on logged steps.
          "peak_rss_bytes": [max(rss)] if rss else [], "wall_s": wall,
          "optimizer": "optax.adamw (jaxzero.engine.optimizer)"}


def rel_diff(values: list[float]) -> float:
  """The largest relative difference between two of `values`: (max - min) / min |v|."""
  return (max(values) - min(values)) / min(abs(v) for v in values)


def summarize(results: dict[str, dict], steps: int) -> dict:
  names = list(results)
  rows = []
  for i in range(steps):
    row = {"step": i + 1, **{n: results[n]["losses"][i] for n in names}}
    row["max_rel_diff"] = rel_diff([row[n] for n in names]) if len(names) > 1 else 0.0
    row["step_time_s"] = {n: results[n]["step_time_s"][i] for n in names}
    rows.append(row)
  pairs = {}
  for a in range(len(names)):
    for b in range(a + 1, len(names)):
      x, y = names[a], names[b]
      pairs[f"{y}_vs_{x}"] = max(rel_diff([r[x], r[y]]) for r in rows)
  return {
      "steps": rows,
      "max_rel_diff": max(r["max_rel_diff"] for r in rows),
      "max_rel_diff_pairs": pairs,
      # Step 1 of jaxzero follows its compile; the median leaves such outliers out.
      "median_step_time_s": {n: statistics.median(results[n]["step_time_s"]) for n in names},
      "peak_rss_bytes": {n: results[n]["peak_rss_bytes"] for n in names},
      "wall_s": {n: results[n]["wall_s"] for n in names},
      "optimizer": {n: results[n].get("optimizer") for n in names},
  }


def table(summary: dict, names: list[str]) -> str:
  head = (["step"] + names + ["max rel diff"] + [f"{n} s/step" for n in names])
  lines = [" | ".join(head), " | ".join("---" for _ in head)]
  for r in summary["steps"]:
    cells = ([str(r["step"])] + [f"{r[n]:.6f}" for n in names] + [f"{r['max_rel_diff']:.2e}"]
             + [f"{r['step_time_s'][n]:.2f}" for n in names])
    lines.append(" | ".join(cells))
  lines.append("")
  lines.append(f"max relative difference: {summary['max_rel_diff']:.2e} ("
               + ", ".join(f"{k.replace('_vs_', ' vs ')} {v:.2e}"
                           for k, v in summary["max_rel_diff_pairs"].items()) + ")")
  lines.append("median step time: " + ", ".join(
      f"{n} {summary['median_step_time_s'][n]:.2f} s" for n in names))
  lines.append("peak RSS per rank: " + "; ".join(
      f"{n} " + ", ".join(f"{b / 2**30:.2f} GiB" for b in summary["peak_rss_bytes"][n])
      + (" (rank 0, host_rss_bytes)" if n == "jaxzero" else " (ru_maxrss)") for n in names))
  lines.append("wall time: " + ", ".join(f"{n} {summary['wall_s'][n]:.0f} s" for n in names))
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  missing = missing_extras()
  if missing:
    print(f"compare.py: error: needs {', '.join(missing)}: {INSTALL}", file=sys.stderr)
    return 2
  names = [n.strip() for n in args.frameworks.split(",") if n.strip()]
  if not names or any(n not in FRAMEWORKS for n in names):
    print(f"compare.py: error: --frameworks={args.frameworks}: choose from "
          f"{', '.join(FRAMEWORKS)}", file=sys.stderr)
    return 2
  workdir = pathlib.Path(args.workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  try:
    ds = apply_ds_sets(json.loads(pathlib.Path(args.deepspeed).read_text()), args.ds_set)
  except (OSError, ValueError) as e:
    print(f"compare.py: error: {args.deepspeed}: {e}", file=sys.stderr)
    return 2
  if any(not isinstance(ds.get(k, {}), dict) for k in ("fp16", "bf16", "zero_optimization")):
    print(f"compare.py: error: {args.deepspeed}: its fp16, bf16 and zero_optimization "
          "entries must be JSON objects", file=sys.stderr)
    return 2
  if ds.get("fp16", {}).get("enabled") is True:
    print("compare.py: error: fp16.enabled: compare.py compares fp32 and bf16 runs",
          file=sys.stderr)
    return 2
  started = datetime.datetime.now().astimezone()
  ds_file, base = workdir / "ds_config.json", workdir / "base_config.py"
  hf_dir, batches_file = workdir / "hf_init", workdir / "batches.npy"
  ds_file.write_text(json.dumps(ds, indent=2) + "\n")  # the file with --ds-set applied
  write_base_config(args, ds, base)
  train_args = jaxzero_train_args(base, ds_file, workdir / "jaxzero", hf_dir, args.steps)
  try:
    cfg = load_jaxzero_config(train_args, args.nproc)
    torch_ds_file = workdir / "ds_config_resolved.json"
    torch_ds_file.write_text(json.dumps(resolved_ds(ds, cfg, args.nproc), indent=2) + "\n")
  except (ValueError, OSError) as e:  # jaxzero's UserError is a ValueError
    print(f"compare.py: error: {e}", file=sys.stderr)
    return 2
  shape = save_batches(cfg, args.nproc, args.steps, batches_file, workdir / "data_cache")
  n_params = save_hf_checkpoint(cfg, args.seed, hf_dir, args.init_bf16)
  print(f"compare: {n_params:,} parameters; batches {list(shape)} (steps, grad_accum, rows, "
        f"seq_len + 1); {args.nproc} ranks; {workdir}", flush=True)
  results = {}
  try:
    for name in names:
      if name == "jaxzero":
        results[name] = run_jaxzero(args, train_args, workdir)
      else:
        results[name] = run_torch(name, args, torch_ds_file, hf_dir, batches_file, workdir)
  except RunFailed as e:
    print(f"compare.py: error: {e}", file=sys.stderr)
    return 1
  summary = summarize(results, args.steps)
  print(table(summary, names))
  summary.update({
      "command": " ".join([pathlib.Path(sys.executable).name, "scripts/compare.py",
                           *(argv if argv is not None else sys.argv[1:])]),
      "date": started.isoformat(timespec="seconds"),
      "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                  "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
      "model": {"dim": args.dim, "layers": args.layers, "heads": args.heads,
                "kv_heads": args.kv_heads, "mlp": args.mlp, "vocab": args.vocab,
                "seq": args.seq, "parameters": n_params, "init_bf16": args.init_bf16},
      "batches_shape": list(shape), "nproc": args.nproc, "ds_config": ds,
  })
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
  if args.rtol is not None and summary["max_rel_diff"] > args.rtol:
    print(f"compare.py: losses differ by {summary['max_rel_diff']:.2e} > --rtol {args.rtol:g}",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
