"""python -m jaxzero.train --config PATH [--workdir DIR] [--steps N] [--set KEY=VALUE ...]
                          [--deepspeed ds_config.json] [--accelerate-config fsdp.yaml]
                          [--resume] [--resume-step N] [--force] [--no-progress]
                          [--print-config]"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading

# Only the standard library before main(): a Ctrl-C while JAX is imported is
# caught there too.

INTERRUPTED = 130  # exit code after Ctrl-C (128 + SIGINT), as shells report it


INTERRUPTED_LINE = ("jaxzero.train: interrupted; the next run resumes from the last complete "
                    "checkpoint, if any")


def main(argv=None) -> int:
  """Runs the command; Ctrl-C at any moment ends it with one line (exit code 130).

  Ctrl-C during training stops at the next step boundary and saves that step
  (jaxzero.training.preemption installs its own handler for the loop). Before the loop,
  and for a second Ctrl-C, there is nothing to save: the process leaves at once.
  A KeyboardInterrupt would not do: raised inside a garbage-collector callback
  (JAX has one) Python ignores it, and start-up goes on.
  """
  in_main_thread = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGINT, _leave_at_once) if in_main_thread else None
  try:
    return _main(argv)
  except KeyboardInterrupt:  # raised before the handler was in place
    print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
    return INTERRUPTED
  finally:
    if in_main_thread:
      signal.signal(signal.SIGINT, previous)


def _leave_at_once(_signum, _frame) -> None:
  print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
  sys.stdout.flush()
  # No `finally` needs to run: no save is in flight outside the loop, and the
  # kernel releases the workdir lock. Other processes of the run get the same
  # signal from the launcher or the scheduler.
  os._exit(INTERRUPTED)  # pylint: disable=protected-access


def _parse(argv):
  """(parser, args), with the checks that need no config."""
  from jaxzero import cli  # pylint: disable=import-outside-toplevel
  parser = cli.Parser(prog="jaxzero.train", description="Train a Llama model with ZeRO/FSDP.")
  cli.add_config_args(parser)
  parser.add_argument("--deepspeed", metavar="ds_config.json",
                      help="a DeepSpeed config applied over --config (then --set over that)")
  parser.add_argument("--accelerate-config", metavar="fsdp.yaml",
                      help="an Accelerate FSDP config (`accelerate config`'s YAML) applied "
                      "over --config (then --set over that)")
  parser.add_argument("--workdir", help="where metrics and checkpoints go "
                      "(default: runs/<config name>)")
  parser.add_argument("--steps", type=int, help="stop after this step (at most train.steps); "
                      "the learning-rate schedule still spans train.steps, so a later run can "
                      "continue it")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar: one plain line per logged step (the default when "
                      "stdout is not a terminal)")
  parser.add_argument("--resume", action="store_true", help="fail unless --workdir has a "
                      "checkpoint (resuming from the latest one is automatic either way)")
  parser.add_argument("--resume-step", type=int, metavar="N",
                      help="resume from checkpoint N instead of the latest; later checkpoints "
                      "are moved to checkpoints.damaged/ (nothing is deleted)")
  parser.add_argument("--force", action="store_true",
                      help="start even when the memory check says the run does not fit")
  parser.add_argument("--print-config", action="store_true", help="print the resolved config, "
                      "one KEY=VALUE per line (each usable as --set) with where it came from: "
                      "base, the file, auto or --set; and exit")
  args = parser.parse_args(argv)
  if args.workdir == "":
    parser.error("--workdir is empty; name a directory, or leave --workdir out for "
                 f"runs/{pathlib.Path(args.config).stem}")
  if args.steps is not None and args.steps < 1:
    parser.error(f"--steps={args.steps} must be at least 1")
  if args.resume_step is not None and args.resume_step < 0:
    parser.error(f"--resume-step={args.resume_step} must be a checkpoint's step (>= 0)")
  return parser, args


def _check_steps(parser, args, cfg) -> None:
  if args.steps is not None and args.steps > cfg.train.steps:
    parser.error(f"--steps={args.steps} is past train.steps={cfg.train.steps}, where the "
                 "learning-rate schedule ends; raise train.steps (--set train.steps="
                 f"{args.steps}) to train that far")
  end = args.steps if args.steps is not None else cfg.train.steps
  if args.resume_step is not None and end < args.resume_step:
    # (It would set the later checkpoints aside, then train nothing.)
    said = f"--steps={end}" if args.steps is not None else f"train.steps={end}"
    parser.error(f"{said} is before --resume-step={args.resume_step}: nothing would be "
                 "trained; train to a step at or past the one resumed from")


def check_arguments(argv: list[str], n_devices, also=None) -> int | None:
  """None when a run of `argv` may start: it parses, its config loads (resolved for
  `n_devices(cfg)` devices in all) and `also(cfg)`, a launcher's own checks,
  raises no ConfigError. Else the exit code: 2 with the error said in one line, or 0 where
  `argv` asks only for the help or the config (said here, once).

  For a launcher, before it starts processes that would each say the same.
  """
  from jaxzero import cli  # pylint: disable=import-outside-toplevel
  try:
    parser, args = _parse(argv)
  except SystemExit as e:  # argparse's error or --help, already printed
    return e.code or 0

  def body():
    loaded = cli.load_config(args)
    n = n_devices(loaded.cfg)
    cfg = loaded.resolve(n)
    _check_steps(parser, args, cfg)
    if also is not None:
      also(cfg)
    if args.print_config:
      print(loaded.describe(n))
  try:
    code = cli.run_main(parser.prog, body)
  except SystemExit as e:
    code = e.code or 0
  return code if code or args.print_config else None


def _main(argv) -> int:
  from jaxzero import cli  # pylint: disable=import-outside-toplevel
  from jaxzero.runtime import distributed  # pylint: disable=import-outside-toplevel
  parser, args = _parse(argv)

  def body():
    loaded = cli.load_config(args)  # before JAX starts: creates virtual CPU devices
    if args.print_config:
      from jaxzero.parallel import mesh  # pylint: disable=import-outside-toplevel
      devices = mesh.devices_needed(loaded.cfg.mesh)
      if not devices and loaded.file and loaded.file.batch:  # a batch from the device count:
        import jax  # pylint: disable=import-outside-toplevel
        devices = jax.device_count()  # this machine's, as training finds them (one host's)
      print(loaded.describe(devices or mesh.devices_for(loaded.cfg.mesh)))
      return
    distributed.initialize(loaded.cfg, prog=parser.prog)  # joins the other processes, if any
    import jax  # pylint: disable=import-outside-toplevel
    cfg = loaded.resolve(jax.device_count())  # "auto" batch sizes, on every process's devices
    _check_steps(parser, args, cfg)
    from jaxzero import config as config_lib  # pylint: disable=import-outside-toplevel
    own = ("distributed.", "offload.nvme_dir")  # a process's coordinates, its host's disk
    distributed.check_started_alike({
        **{k: v for k, v in config_lib.as_dotted(cfg).items() if not k.startswith(own)},
        "--steps": args.steps, "--resume-step": args.resume_step, "--resume": args.resume,
        "--force": args.force})
    workdir = pathlib.Path(args.workdir or pathlib.Path("runs") / pathlib.Path(args.config).stem)
    from jaxzero.training import loop  # pylint: disable=import-outside-toplevel
    sys.stdout = outliving = _OutlivesItsReader(sys.stdout, workdir)
    try:
      outcome = loop.run_training(cfg, workdir, steps=args.steps, progress=not args.no_progress,
                                  require_checkpoint=args.resume, resume_step=args.resume_step,
                                  force=args.force)
      target = args.steps if args.steps is not None else cfg.train.steps
      # Stopped early by a signal, saved: not a finished run (a scheduler retries it, a
      # `train && export` chain stops), the status a shell gives a process the signal ended.
      code = (128 + int(signal.Signals[outcome.stopped_by])
              if outcome.stopped_by and outcome.step < target else 0)
      if jax.process_index() == 0:
        print(summary(outcome, workdir, args.steps, cfg.train.steps))
      return code
    finally:
      if sys.stdout is outliving:
        sys.stdout = outliving.stream

  return cli.run_main("jaxzero.train", body)


class _OutlivesItsReader:
  """Stdout while a run trains: a reader that leaves (`| head`, a `tee` or a log shipper
  that dies) does not end the run. Its lines go to devnull from then on, said once on
  stderr; the run saves and ends as it would (its metrics are in metrics.jsonl). Ending
  it instead lost the steps since the last checkpoint, and under several processes
  process 0 stopped while the others waited for it in a collective."""

  def __init__(self, stream, workdir: pathlib.Path):
    self.stream, self.workdir, self.gone = stream, workdir, False

  def write(self, text: str) -> int:
    try:
      return self.stream.write(text)
    except BrokenPipeError:
      self._reader_left()
      return len(text)

  def flush(self) -> None:
    try:
      self.stream.flush()
    except BrokenPipeError:
      self._reader_left()

  def _reader_left(self) -> None:
    if self.gone:
      return
    self.gone = True
    os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
    try:
      print(f"jaxzero.train: stdout's reader has gone; training goes on (metrics in "
            f"{self.workdir / 'metrics.jsonl'})", file=sys.stderr, flush=True)
    except OSError:  # (stderr went with it)
      pass

  def __getattr__(self, name):
    return getattr(self.stream, name)


def summary(outcome, workdir: pathlib.Path, steps: int | None, train_steps: int) -> str:
  """The last lines of a run: what it reached, where it is saved, how to go on."""
  if outcome.finished:
    asked = f"--steps {steps}" if steps is not None else f"train.steps={train_steps}"
    return (f"nothing to do: {workdir} is already at step {outcome.step} ({asked}); checkpoint "
            f"in {outcome.checkpoint}. To train further, run again with a higher "
            f"--set train.steps=N (the learning-rate schedule then spans N steps) or --steps N "
            f"(up to train.steps), or choose a new --workdir to start over")
  lines = []
  history = outcome.history
  if history:
    first, last = history[0], history[-1]
    lines.append(f"trained to step {last['step']}: loss {first['loss']:.4f} -> "
                 f"{last['loss']:.4f}; metrics in {workdir / 'metrics.jsonl'}, TensorBoard: "
                 f"tensorboard --logdir {workdir} (pip install 'jaxzero[tensorboard]')")
  target = steps if steps is not None else train_steps
  stopped = ("" if not outcome.stopped_by else
             f"stopped by {outcome.stopped_by} at step {outcome.step}; " if outcome.step < target
             else f"{outcome.stopped_by} came during the last save, which finished; ")
  if outcome.checkpoint is None:
    lines.append(f"{stopped}step {outcome.step} not saved (checkpoint.at_end=false)")
  else:
    lines.append(f"{stopped}checkpoint of step {outcome.step} in {outcome.checkpoint}")
  return "\n".join(lines)


if __name__ == "__main__":
  _code = main()
  if _code == INTERRUPTED:
    # Leave at once, the `finally` blocks (checkpoint saves, the workdir lock)
    # having run: threads cut off mid-import or mid-compile can hang or crash
    # the interpreter's shutdown, and other processes would wait at JAX's exit
    # barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)  # pylint: disable=protected-access
  sys.exit(_code)
