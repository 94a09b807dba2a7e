"""python -m jaxzero.migrate ds_config.json [--base PATH]

Prints a jaxzero config file equivalent to a DeepSpeed ds_config (or an
Accelerate FSDP YAML) over a base config: ``dataclasses.replace`` over the
base's ``get_config()``, one comment per translated key naming where it came
from. ``python -m jaxzero.train --config`` on it resolves to the same config as
``--config BASE --deepspeed ds_config.json``.
"""

from __future__ import annotations

import json
import sys

from jaxzero import cli
from jaxzero import config as config_lib
from jaxzero.frameworks.translated_file import Translation


def render(tr: Translation, base: config_lib.Config, base_path: str | None,
           command: str) -> str:
  """The text of a config file that is `base` with `tr` applied."""
  migrated = tr.apply(base)
  sections: dict[str, list[str]] = {}
  for key, (_, origin) in tr.settings.items():
    section, field = key.split(".")
    value = getattr(getattr(migrated, section), field)  # parsed to the field's type
    literal = json.dumps(value) if isinstance(value, str) else repr(value)  # "..." quotes
    sections.setdefault(section, []).append(f"          {field}={literal},  # {origin}")
  lines = [f'"""Migrated from {tr.source} by `{command}`.', "",
           "Each field set below names the key it comes from; the rest is the base config's."]
  if tr.unneeded:
    lines += ["", "Accepted from the file and not needed under XLA (what jaxzero does instead):"]
    lines += [f"  {key}: {reason}" for key, reason in tr.unneeded.items()]
  lines += ['"""', "", "import dataclasses", "", "from jaxzero import config", "", "",
            "def get_config() -> config.Config:"]
  if base_path:
    # The base path as given: relative to where you run, like --config.
    lines.append(f"  c = config.load({json.dumps(base_path)})")
  else:
    lines.append("  c = config.base()")
  lines.append("  return dataclasses.replace(")
  lines.append("      c,")
  for section, fields in sections.items():
    lines.append(f"      {section}=dataclasses.replace(")
    lines.append(f"          c.{section},")
    lines += fields
    lines.append("      ),")
  lines.append("  )")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = cli.Parser(prog="jaxzero.migrate",
                      description="Print a jaxzero config equivalent to a DeepSpeed ds_config "
                      "(.json) or an Accelerate FSDP config (.yaml).")
  parser.add_argument("file", help="ds_config.json, or an Accelerate FSDP .yaml")
  parser.add_argument("--base", help="the config file it applies over (default: jaxzero's "
                      "built-in defaults, config.base())")
  parser.add_argument("--devices", type=int, metavar="N",
                      help="the devices the run will use, for a batch size the file leaves to "
                      "the device count (\"auto\", or micro-batch x accumulation); default: "
                      "the mesh's size, else 8")
  args = parser.parse_args(argv)
  if args.devices is not None and args.devices < 1:
    parser.error(f"--devices={args.devices} must be at least 1")

  def body():
    # pylint: disable-next=import-outside-toplevel
    from jaxzero.frameworks import accelerate, deepspeed
    base = config_lib.load(args.base) if args.base else config_lib.base()
    reader = accelerate if args.file.lower().endswith((".yaml", ".yml")) else deepspeed
    tr = reader.read(args.file, base)
    if tr.batch is not None:  # "auto" batch sizes, for the devices jaxzero.train would use
      from jaxzero.parallel import mesh  # pylint: disable=import-outside-toplevel
      applied = tr.apply(base)
      devices = args.devices or mesh.devices_for(applied.mesh)
      resolved, how = deepspeed.resolve_batch(applied, tr, devices)
      # A size found from the device count holds for that count only: the file written says
      # which it assumed when the mesh named none and --devices was not given.
      assumed = ("" if args.devices or mesh.devices_needed(applied.mesh)
                 else f" (for {devices} devices: jaxzero.migrate --devices N for yours)")
      for key in ("train.global_batch", "train.grad_accum"):
        origin = how.get(key, " / ".join(k for k, v in tr.batch.items() if v is not None))
        tr.set(key, getattr(resolved.train, key.split(".")[1]),
               origin + (assumed if how.get(key, "").startswith("auto") else ""))
    config_lib.validate(tr.apply(base))  # refuse here what train would refuse
    command = "python -m jaxzero.migrate " + " ".join(argv if argv is not None else sys.argv[1:])
    sys.stdout.write(render(tr, base, args.base, command))

  return cli.run_main("jaxzero.migrate", body)


if __name__ == "__main__":
  sys.exit(main())
