"""python -m jaxzero.plan --config PATH [--devices N] [--hbm-gb G] [--json] [--comm] [--set KEY=VALUE ...]

Per-device memory of every ZeRO stage, from the real train step compiled ahead
of time on N virtual CPU devices; nothing is allocated. jaxzero.planning.planner
measures; this module parses the command line and prints the plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys

from jaxzero import cli
from jaxzero import config as config_lib
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.planning import comm_report as comm_lib
from jaxzero.runtime import xla_log as xla_log_lib
from jaxzero.utils.formatting import bytes_unit, format_count

DEFAULT_DEVICES = mesh_lib.DEFAULT_DEVICES  # one GPU node, for a mesh of -1


def main(argv=None) -> int:
  parser = cli.Parser(prog="jaxzero.plan", description="Per-device memory of each ZeRO stage.")
  cli.add_config_args(parser)
  parser.add_argument("--devices", type=int, help="devices to plan for (default: the config's "
                      f"mesh; for -1, JAX_NUM_CPU_DEVICES or {DEFAULT_DEVICES}, as jaxzero.train "
                      "resolves it on a CPU)")
  parser.add_argument("--devices-per-process", type=int, metavar="K",
                      help="the devices of one process, for its host memory (default: 8, a "
                      "GPU host's, or all if fewer)")
  parser.add_argument("--hbm-gb", type=float, default=80.0,
                      help="device memory budget in GB (1e9 bytes); default 80 (H100)")
  parser.add_argument("--sweep", choices=("stages", "remat", "offload"), default="stages",
                      help="rows: every ZeRO stage (default), or every remat policy or offload "
                      "setting at the config's stage")
  parser.add_argument("--no-search", action="store_true",
                      help="skip the search for the largest micro-batch that fits")
  parser.add_argument("--json", action="store_true", help="print JSON: a list, one object per "
                      "row (offload.params=nvme: one object, the run's programs)")
  parser.add_argument("--tflops", type=float, default=400.0,
                      help="the device's achieved TFLOP/s for the predicted step time "
                      "(default 400: dense bf16 at ~40%% of an H100's peak)")
  parser.add_argument("--pcie-gbps", type=float, default=25.0,
                      help="host<->device GB/s each way, for the predicted step (default 25)")
  parser.add_argument("--host-gbps", type=float, default=20.0,
                      help="offload.optimizer=pinned_host: GB/s the host's update reads and "
                      "writes (default 20; scripts/offload_bench.py measures a machine's)")
  parser.add_argument("--disk-gbps", type=float, default=6.0,
                      help="offload.params=nvme: the NVMe drive's GB/s (default 6)")
  parser.add_argument("--xla-log", metavar="PATH",
                      help="where XLA's own warnings while planning go (default: "
                      "runs/<config name>/plan.log, the workdir jaxzero.train would use); "
                      "one line after the plan counts them")
  parser.add_argument("--comm", action="store_true",
                      help="also list every collective of each compiled step (op, dtype, bytes, "
                      "runs per step, mesh axes) and the total per device beside the ZeRO paper's")
  args = parser.parse_args(argv)

  def body():
    xla_log = pathlib.Path(args.xla_log or pathlib.Path("runs") / pathlib.Path(args.config).stem
                           / "plan.log")
    with xla_log_lib.xla_lines_to(xla_log) as counts:
      make_plan()
    said = xla_log_lib.summary(counts, xla_log)
    if said:
      print(said, file=sys.stderr)

  def plan_infinity(cfg, n_devices: int):
    from jaxzero.planning import infinity_plan  # pylint: disable=import-outside-toplevel
    from jaxzero.planning import variants  # pylint: disable=import-outside-toplevel
    given = [flag for flag, dest in (("--sweep", "sweep"), ("--comm", "comm"),
                                     ("--no-search", "no_search"), ("--host-gbps", "host_gbps"),
                                     ("--devices-per-process", "devices_per_process"))
             if getattr(args, dest) != parser.get_default(dest)]
    if given:
      parser.error(f"{', '.join(given)}: not for offload.params=nvme, whose run is planned "
                   "program by program (its flags: --devices, --hbm-gb, --json, --tflops, "
                   "--pcie-gbps, --disk-gbps)")
    replica, fsdp, _ = mesh_lib.resolve_shape(cfg.mesh, n_devices)
    cfg, notes = variants.fit_batch_arithmetic(cfg, replica * fsdp)
    found = infinity_plan.plan(cfg, n_devices, args.tflops, args.pcie_gbps, args.disk_gbps)
    fits = found.device_bytes <= args.hbm_gb * 1e9
    if args.json:
      print(json.dumps({**infinity_plan.as_json(found), "fits": fits, "notes": notes}, indent=2))
      return
    print(infinity_plan.format_text(found, f"jaxzero.plan --config {args.config}"))
    print(f"fits {args.hbm_gb:g} GB a device (--hbm-gb): {'yes' if fits else 'no'}")
    for note in notes:
      print(f"note: {note}")

  def make_plan():
    if args.devices is not None and args.devices < 1:
      parser.error(f"--devices={args.devices} must be at least 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
      parser.error(f"--devices-per-process={args.devices_per_process} must be at least 1")
    if not 0 < args.hbm_gb < math.inf:  # (nan and inf compare false and true)
      parser.error(f"--hbm-gb={args.hbm_gb:g} must be a positive number")
    cfg = config_lib.load(args.config, args.set)
    if cfg.model_factory:
      raise config_lib.ConfigError(
          f"model_factory={cfg.model_factory!r}: jaxzero.plan plans the Llama family's presets; "
          "for your own model, jaxzero.Engine(...).plan(batch) gives the bytes per device")
    # The count jaxzero.train uses on a CPU for the same mesh (jaxzero.planning.memory_check).
    n_devices = args.devices or mesh_lib.devices_for(cfg.mesh)
    mesh_lib.resolve_shape(cfg.mesh, n_devices)  # a mesh that does not fit fails before JAX starts
    mesh_lib.use_virtual_cpu_devices(n_devices)
    if not all(0 < rate < math.inf for rate in (args.tflops, args.pcie_gbps, args.disk_gbps,
                                                 args.host_gbps)):
      parser.error("--tflops, --pcie-gbps, --disk-gbps and --host-gbps must be positive "
                   "numbers")
    if cfg.offload.params == "nvme":  # a run of per-layer programs: planned program by program
      plan_infinity(cfg, n_devices)
      return
    from jaxzero.planning import planner  # pylint: disable=import-outside-toplevel
    rates = {"tflops": args.tflops, "pcie_gbps": args.pcie_gbps, "host_gbps": args.host_gbps}
    plan = planner.plan(cfg, n_devices, int(args.hbm_gb * 1e9), args.sweep,
                        search=not args.no_search, comm=args.comm, rates=rates,
                        devices_per_process=args.devices_per_process)
    if args.json:
      print(json.dumps(as_json(plan), indent=2))
      return
    print(format_table(plan, f"jaxzero.plan --config {args.config}"))
    for row in plan.rows if args.comm else ():
      print(f"\ncommunication of stage {row.stage} {row.strategy}, remat {row.remat}, "
            f"grad_accum {row.grad_accum}, per device:")
      print(comm_lib.format_table(row.comm_report))

  return cli.run_main("jaxzero.plan", body)


def as_json(plan_) -> list[dict]:
  rows = []
  for r in plan_.rows:
    row = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "comm_report"}
    comm = comm_lib.as_json(r.comm_report) if r.comm_report is not None else None
    rows.append(dict(row, mesh=list(r.mesh), comm=comm))
  return rows


def format_table(plan_, title: str) -> str:
  """A plain aligned table, sizes per device in one unit chosen for the largest."""
  rows = plan_.rows
  scale, unit = bytes_unit(max(max(r.total_bytes, r.theory_state_bytes) for r in rows))
  size = lambda b: f"{b / scale:.1f}"
  header = ["stage", "remat", "offload", "params", "grads", "optimizer", "state",
            "ZeRO formula", "activations", "host", "nvme", "host<->device/step", "XLA total",
            "fits", "max micro", "host/process", "step s (bound)"]
  body = []
  for r in rows:
    body.append([
        f"{r.stage} {r.strategy}", r.remat, _offload_label(r), size(r.params_bytes),
        size(r.grads_bytes), size(r.optimizer_bytes), size(r.state_bytes),
        f"{r.theory_formula} = {size(r.theory_state_bytes)}", size(r.activation_bytes),
        size(r.host_bytes), size(r.nvme_bytes), size(r.transfer_bytes), size(r.total_bytes),
        "yes" if r.fits else "no", "-" if r.max_micro_batch is None else str(r.max_micro_batch),
        size(r.host_process_bytes), f"{r.step_s:.2f} ({r.bound})"])
  widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
  text_columns = 3  # left-aligned; the numbers are right-aligned
  fmt = lambda line: "  ".join(c.ljust(w) if i < text_columns else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths)))
  r0 = rows[0]
  lines = [
      title,
      (f"Φ = {format_count(plan_.n_trained)} trained (LoRA adapters) + Φf = "
       f"{format_count(plan_.n_params)} frozen parameters" if plan_.n_trained else
       f"Φ = {format_count(plan_.n_params)} parameters")
      + f" on {r0.devices} virtual CPU devices "
      f"(mesh replica {r0.mesh[0]} x fsdp {r0.mesh[1]}"
      f"{f' x tensor {r0.tensor}' if r0.tensor > 1 else ''}"
      f"{f' x pipeline {r0.pipeline}' if r0.pipeline > 1 else ''}"
      f"{f' x context {r0.context}' if r0.context > 1 else ''}); micro-batch {r0.micro_batch} x "
      f"{r0.seq_len} tokens"
      f"{f' (split {r0.context} ways)' if r0.context > 1 else ''}, grad_accum {r0.grad_accum}; "
      f"budget {plan_.hbm_bytes / 1e9:g} GB",
      f"per device, in {unit}; state = params + grads + optimizer (fp32 master + Adam m, v), "
      f"N = sharding devices; activations = XLA temporaries less the gradient buffers "
      f"(activations, gathered weights, workspace); XLA total = state + activations; "
      f"host/process = the host memory of one process of {r0.devices_per_process} devices "
      f"(offloaded state, its update's workspace, XLA's pinned pool, a save's copy; "
      f"--devices-per-process); step s = predicted at {plan_.rates['tflops']:g} TFLOP/s, PCIe "
      f"{plan_.rates['pcie_gbps']:g} GB/s, host update {plan_.rates['host_gbps']:g} GB/s "
      "(--tflops, --pcie-gbps, --host-gbps)",
      "", fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body), ""]
  lines += [f"note: {n}" for n in plan_.notes]
  lines.append(f"{plan_.compiles} compiles in {plan_.seconds:.1f} s")
  return "\n".join(lines)


def _offload_label(r) -> str:
  placed = [name + ("(nvme)" if kind == "nvme" else "")
            for name, kind in (("optimizer", r.offload_optimizer), ("params", r.offload_params))
            if kind != "device"]
  return "+".join(placed) if placed else "-"


if __name__ == "__main__":
  sys.exit(main())
