"""python -m jaxzero.export --workdir DIR --out OUT [--dtype bfloat16|float16|float32] [--step N]
[--peft | --merged]

Writes a training checkpoint as a Hugging Face Llama model directory
(config.json + sharded safetensors + index, with the run's tokenizer), loadable by
transformers' ``LlamaForCausalLM.from_pretrained(OUT)``. A LoRA run's checkpoint exports as
a PEFT adapter (--peft) or as the model with its adapters folded in (--merged). Bad input
is one line and exit code 2; a write the system refuses (a full disk) one line and exit
code 1, with nothing left in OUT.
"""

from __future__ import annotations

import math
import os
import sys

from jaxzero import cli


def main(argv=None) -> int:
  parser = cli.Parser(prog="jaxzero.export",
                      description="Export a jaxzero checkpoint as Hugging Face safetensors.")
  parser.add_argument("--workdir", required=True, help="the jaxzero.train workdir to export from")
  parser.add_argument("--out", required=True, help="a new directory for the Hugging Face files")
  parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                      help="dtype of the exported weights (default: the run's precision.compute)")
  parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  parser.add_argument("--max-shard-gb", type=float, default=5.0,
                      help="size of one safetensors file (default: 5)")
  lora = parser.add_mutually_exclusive_group()
  lora.add_argument("--peft", action="store_true",
                    help="a LoRA run: its adapters as a PEFT adapter directory "
                    "(adapter_config.json, adapter_model.safetensors)")
  lora.add_argument("--merged", action="store_true",
                    help="a LoRA run: the whole model with its adapters folded in")
  args = parser.parse_args(argv)
  if not 0 < args.max_shard_gb < math.inf:  # (nan compares false)
    parser.error(f"--max-shard-gb={args.max_shard_gb:g} must be a positive number")
  for flag, value in (("--workdir", args.workdir), ("--out", args.out)):
    if not value:
      parser.error(f"{flag} is empty; name a directory")
  # Export works on the host; leave any accelerators to the jobs using them.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  def body():
    # pylint: disable-next=import-outside-toplevel
    from jaxzero.hf import export as hf_export
    from jaxzero.training import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
    from jaxzero.hf import peft  # pylint: disable=import-outside-toplevel
    workdir_lib.check_export_paths(args.workdir, args.out)  # one line, before anything is read
    try:
      if args.peft:
        done = peft.export_peft(args.workdir, args.out, step=args.step, dtype=args.dtype)
        print(f"exported the LoRA adapters of step {done.step} ({done.dtype}) as a PEFT adapter"
              + (f" with tokenizer files {', '.join(done.tokenizer)}" if done.tokenizer else "")
              + f" to {done.out}")
        return 0
      done = hf_export.export_hf(args.workdir, args.out, step=args.step, dtype=args.dtype,
                                 max_shard_bytes=int(args.max_shard_gb * 2**30),
                                 merged=args.merged)
    except OSError as e:
      if isinstance(e, cli.USER_ERRORS):
        raise
      print(f"jaxzero.export: error: {failed_write(e)}; --out {args.out} is left as it was",
            file=sys.stderr)
      return 1
    print(f"exported step {done.step} ({done.dtype}, {len(done.files)} safetensors files"
          + (f", tokenizer files {', '.join(done.tokenizer)}" if done.tokenizer else "")
          + f") to {done.out}")
    return 0

  return cli.run_main("jaxzero.export", body)


def failed_write(error: OSError) -> str:
  """An OSError met while exporting, in words: "the export failed: no space left on device
  (PATH)". Exit code 1: not bad input (2), but a write the system refused."""
  why = os.strerror(error.errno).lower() if error.errno else str(error)
  return f"the export failed: {why}" + (f" ({error.filename})" if error.filename else "")


if __name__ == "__main__":
  sys.exit(main())
