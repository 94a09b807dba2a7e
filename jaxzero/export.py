"""python -m jaxzero.export --workdir DIR --out OUT [--dtype bfloat16|float16|float32] [--step N]
[--peft | --merged]

Writes a training checkpoint as a Hugging Face Llama model directory
(config.json + sharded safetensors + index), loadable by transformers'
``LlamaForCausalLM.from_pretrained(OUT)``. A LoRA run's checkpoint exports as a PEFT
adapter (--peft) or as the model with its adapters folded in (--merged).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import sys

from jaxzero import cli
from jaxzero.errors import CheckpointError

log = logging.getLogger(__name__)


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
  if args.max_shard_gb <= 0:
    parser.error(f"--max-shard-gb={args.max_shard_gb} must be positive")
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
    if args.peft:
      done = peft.export_peft(args.workdir, args.out, step=args.step, dtype=args.dtype)
      print(f"exported the LoRA adapters of step {done.step} ({done.dtype}) as a PEFT adapter "
            f"to {done.out}")
      return
    name = recorded_tokenizer(args.workdir)  # a damaged config.json stops us before writing
    done = hf_export.export_hf(args.workdir, args.out, step=args.step, dtype=args.dtype,
                               max_shard_bytes=int(args.max_shard_gb * 2**30),
                               merged=args.merged)
    tokenizer = copy_tokenizer(args.workdir, done.out, name)
    print(f"exported step {done.step} ({done.dtype}, {len(done.files)} safetensors files"
          + (f", tokenizer files {', '.join(tokenizer)}" if tokenizer else "")
          + f") to {done.out}")

  return cli.run_main("jaxzero.export", body)


# The Hugging Face tokenizer files AutoTokenizer reads, beside tokenizer.json.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(workdir, out, name: str | None = None) -> list[str]:
  """Copies the run's Hugging Face tokenizer (data.tokenizer, as recorded in
  WORKDIR/config.json, or `name` where the caller has read it) into the export, so
  AutoTokenizer.from_pretrained(out) works; returns the files copied. A byte-level run has
  none to copy (token id = byte value); so has a workdir from before config.json was written.
  """
  name = recorded_tokenizer(workdir) if name is None else name
  if name is None:
    log.warning("%s has no config.json (a run from before it was written): the tokenizer is "
                "not exported", workdir)
    return []
  if name == "byte":
    log.info("the run used the byte-level tokenizer (token id = byte value): no tokenizer files")
    return []
  path = pathlib.Path(name).expanduser()
  source = path / "tokenizer.json" if path.is_dir() else path
  if not source.is_file():
    log.warning("the run's data.tokenizer=%s no longer exists: the tokenizer is not exported",
                name)
    return []
  out = pathlib.Path(out)
  shutil.copyfile(source, out / "tokenizer.json")
  copied = ["tokenizer.json"]
  for side in TOKENIZER_SIDE_FILES:
    if (source.parent / side).is_file():
      shutil.copyfile(source.parent / side, out / side)
      copied.append(side)
  if "tokenizer_config.json" not in copied:
    # AutoTokenizer needs a class; the fast tokenizer reads tokenizer.json as is.
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    copied.append("tokenizer_config.json")
  return copied


def recorded_tokenizer(workdir) -> str | None:
  """data.tokenizer as WORKDIR/config.json records it; None where the workdir has no
  config.json. One that cannot say it is a CheckpointError naming the file and why."""
  recorded = pathlib.Path(workdir) / "config.json"
  if not recorded.is_file():
    return None
  try:
    run = json.loads(recorded.read_text(encoding="utf-8"))
  except OSError as e:
    raise CheckpointError(f"{recorded} cannot be read: {e.strerror}") from None
  except json.JSONDecodeError as e:
    raise _damaged(recorded, f"not valid JSON at line {e.lineno} column {e.colno}") from None
  except ValueError:
    raise _damaged(recorded, "not UTF-8 text") from None
  data = run.get("data") if isinstance(run, dict) else None
  name = data.get("tokenizer") if isinstance(data, dict) else None
  if not isinstance(name, str):
    raise _damaged(recorded, "no data.tokenizer in it")
  return name


def _damaged(recorded: pathlib.Path, why: str) -> CheckpointError:
  return CheckpointError(f"{recorded} is damaged ({why}); export copies the tokenizer the run "
                         "records there: restore it, or move it aside to export without the "
                         "tokenizer files")


if __name__ == "__main__":
  sys.exit(main())
