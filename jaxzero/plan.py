"""python -m jaxzero.plan --config PATH [--devices N] [--hbm-gb G] [--json] [--set KEY=VALUE ...]

Per-device memory of every ZeRO stage, from the real train step compiled ahead
of time on N virtual CPU devices; nothing is allocated.
"""

from __future__ import annotations

import json
import sys

from jaxzero import cli
from jaxzero import config as config_lib
from jaxzero.mesh import devices_needed, ensure_virtual_devices

DEFAULT_DEVICES = 8  # one GPU node, when the config's mesh takes "all remaining"


def main(argv=None) -> int:
  parser = cli.Parser(prog="jaxzero.plan", description="Per-device memory of each ZeRO stage.")
  cli.add_config_args(parser)
  parser.add_argument("--devices", type=int, help="devices to plan for (default: the config's "
                      f"mesh, or {DEFAULT_DEVICES} when it says -1)")
  parser.add_argument("--hbm-gb", type=float, default=80.0,
                      help="device memory budget in GB (1e9 bytes); default 80 (H100)")
  parser.add_argument("--sweep", choices=("stages", "remat", "offload"), default="stages",
                      help="rows: every ZeRO stage (default), or every remat policy or offload "
                      "setting at the config's stage")
  parser.add_argument("--no-search", action="store_true",
                      help="skip the search for the largest micro-batch that fits")
  parser.add_argument("--json", action="store_true", help="print a JSON list, one object per row")
  args = parser.parse_args(argv)

  def body():
    if args.devices is not None and args.devices < 1:
      parser.error(f"--devices={args.devices} must be at least 1")
    if args.hbm_gb <= 0:
      parser.error(f"--hbm-gb={args.hbm_gb:g} must be positive")
    cfg = config_lib.load(args.config, args.set)
    n_devices = args.devices or devices_needed(cfg.mesh.replica, cfg.mesh.fsdp) or DEFAULT_DEVICES
    config_lib.mesh_shape(cfg, n_devices)  # a mesh that does not fit fails before JAX starts
    ensure_virtual_devices(n_devices)
    from jaxzero import planner  # pylint: disable=import-outside-toplevel
    plan = planner.plan(cfg, n_devices, int(args.hbm_gb * 1e9), args.sweep,
                        search=not args.no_search)
    if args.json:
      print(json.dumps(planner.as_json(plan), indent=2))
    else:
      print(planner.format_table(plan, f"jaxzero.plan --config {args.config}"))

  return cli.run_main("jaxzero.plan", body)


if __name__ == "__main__":
  sys.exit(main())
