"""python -m jaxzero.launch --nproc N [--devices-per-proc K] -- <jaxzero.train arguments>

Rehearses a multi-host run on one machine: N ``jaxzero.train`` processes, each
with K virtual CPU devices, joined by ``jax.distributed`` over loopback and
talking through gloo. Bad training arguments are refused in one line before any
process starts. Output lines carry the process rank. When one process
fails the launcher stops the others and exits with that process's error, so
nothing waits on a dead peer; Ctrl-C and SIGTERM are forwarded to every process, and a
hangup (unless ignored, as under nohup) reaches them as SIGTERM: they agree to stop at
their next logged step, save it and exit, and are waited for (up to 10 minutes; a second
signal kills them). A
launcher killed outright (SIGKILL, the OOM killer) leaves none running: on Linux the
kernel sends each of them SIGTERM (jaxzero.runtime.distributed.stop_with_launcher).
"""

from __future__ import annotations

import collections
import math
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxzero import cli, train
from jaxzero.errors import ConfigError
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.runtime import distributed

_ROOT = pathlib.Path(__file__).resolve().parent.parent
# After a failure the others get SIGTERM, then SIGKILL: a survivor may be stuck
# in a collective with the dead process and never reach a step boundary.
_STOP_GRACE_S = 5
# After Ctrl-C, SIGTERM or a hangup they stop at their next logged step and save it: they
# are waited for, up to this long (a hangup leaves no one to send a second signal, and a
# process stuck in a collective would never stop).
_INTERRUPT_GRACE_S = 600
_TAIL_LINES = 15


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  own, train_args = _split_at_dashes(argv)
  parser = cli.Parser(prog="jaxzero.launch",
                      description="Runs jaxzero.train as N processes joined like hosts.",
                      usage="python -m jaxzero.launch --nproc N [--devices-per-proc K] "
                            "-- <jaxzero.train arguments>")
  parser.add_argument("--nproc", type=int, required=True, help="processes to start")
  parser.add_argument("--devices-per-proc", type=int, default=1,
                      help="virtual CPU devices per process, for meshes sized -1; a mesh that "
                           "names its size is shared evenly by the processes")
  hint = "put the jaxzero.train arguments after --, e.g. -- --config configs/tiny_zero3.py"
  args, unknown = parser.parse_known_args(own)
  if unknown:  # jaxzero.train's arguments without the --
    parser.error(f"{' '.join(unknown)} is not a jaxzero.launch argument; {hint}")
  if args.nproc < 1 or args.devices_per_proc < 1:
    parser.error("--nproc and --devices-per-proc must be at least 1")
  if train_args is None:
    parser.error(hint)
  # Bad training arguments are said once, before any process starts (each would say it).
  # A mesh that names its size takes it; else every device of every process.
  n_devices = lambda cfg: mesh_lib.devices_needed(cfg.mesh) or args.nproc * args.devices_per_proc
  done = train.check_arguments(train_args, n_devices, also=_fits_the_launch(args.nproc, n_devices))
  if done is not None:  # an error said once, or only --help or --print-config asked for
    return done
  return Launch(args.nproc, args.devices_per_proc, train_args).run()


def _fits_the_launch(nproc: int, n_devices):
  """The launcher's checks of the training config: it says where each process joins, a
  mesh that names its size is shared evenly by the processes, and the mesh and batch fit
  the launch's devices (`n_devices(cfg)`, all processes')."""
  def check(cfg) -> None:
    d = cfg.distributed
    set_here = [f"distributed.{name}={value}" for name, value, unset in (
        ("coordinator_address", d.coordinator_address, ""), ("num_processes", d.num_processes, 0),
        ("process_id", d.process_id, -1)) if value != unset]
    if set_here:
      raise ConfigError(f"{', '.join(set_here)}: jaxzero.launch says where each of its "
                        "processes joins; leave distributed.coordinator_address, "
                        "num_processes and process_id out of the training arguments")
    needed = mesh_lib.devices_needed(cfg.mesh)
    if needed and needed % nproc:
      raise ConfigError(f"the mesh names {needed} devices, which --nproc {nproc} processes "
                        f"cannot share evenly; use --nproc among "
                        f"{', '.join(map(str, mesh_lib.divisors(needed)))}")
    replica, fsdp, _ = mesh_lib.resolve_shape(cfg.mesh, n_devices(cfg))
    mesh_lib.micro_batch(cfg.train, replica * fsdp)
  return check


def _split_at_dashes(argv: list[str]) -> tuple[list[str], list[str] | None]:
  if "--" not in argv:
    return argv, None
  cut = argv.index("--")
  return argv[:cut], argv[cut + 1:]


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(rank: int, nproc: int, devices: int, coordinator: str, base=os.environ) -> dict:
  """The environment of process `rank`: where to join, and its own CPU devices."""
  env = dict(base)
  env.update({
      distributed.ENV_COORDINATOR: coordinator,
      distributed.ENV_NUM_PROCESSES: str(nproc),
      distributed.ENV_PROCESS_ID: str(rank),
      distributed.ENV_LAUNCHER_PID: str(os.getpid()),  # SIGTERM when the launcher dies
      # JAX's jax_num_cpu_devices option, the one way jaxzero makes virtual
      # devices (jaxzero.parallel.mesh); a mesh that names its size re-divides them.
      "JAX_NUM_CPU_DEVICES": str(devices),
      "JAX_PLATFORMS": "cpu",  # a rehearsal: N processes must not share the same GPUs
      "PYTHONUNBUFFERED": "1",  # lines arrive as they are written, not at exit
      "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")])),
  })
  return env


class Launch:
  """N child processes, their output streams, and how they are stopped."""

  def __init__(self, nproc: int, devices: int, train_args: list[str]):
    self.nproc, self.devices, self.train_args = nproc, devices, train_args
    self.procs: list[subprocess.Popen] = []
    self.tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(nproc)]
    self.readers: list[threading.Thread] = []
    self.exited_at: list[float | None] = [None] * nproc  # (time.monotonic())
    self.interrupted: int | None = None
    self.killed = False  # after an interrupt, before they had saved

  def run(self) -> int:
    coordinator = f"127.0.0.1:{free_port()}"
    # SIGHUP too: a closed terminal or a dropped ssh would leave the processes (each in
    # its own session) running on without the launcher; unless it is ignored (nohup).
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    previous = {sig: signal.signal(sig, self._forward)
                for sig in (signal.SIGINT, signal.SIGTERM, *hangup)}
    try:
      try:
        for rank in range(self.nproc):
          if self.interrupted is not None:  # Ctrl-C while starting: start no more
            break
          self._start(rank, coordinator)
      except BaseException:  # those already started must not run on alone
        self._signal_all(signal.SIGKILL)
        raise
      _say("started " + ", ".join(f"process {r} (pid {p.pid})" for r, p in enumerate(self.procs))
           + f"; coordinator {coordinator}")
      failed = self._wait_for_first_failure()
      self._stop_all()
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
    return self._report(failed)

  def _start(self, rank: int, coordinator: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxzero.train", *self.train_args],
        env=child_env(rank, self.nproc, self.devices, coordinator), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
        start_new_session=True)  # its own process group: signals reach its children too
    self.procs.append(proc)
    # When each process ended, to the millisecond: a peer that stops because another
    # failed (the peer watch) ends a few milliseconds after it, within one poll.
    threading.Thread(target=self._note_exit, args=(rank, proc), daemon=True).start()
    for stream, sink, tail in ((proc.stdout, sys.stdout, None),
                               (proc.stderr, sys.stderr, self.tails[rank])):
      reader = threading.Thread(target=_pump, args=(stream, sink, f"[{rank}] ", tail), daemon=True)
      reader.start()
      self.readers.append(reader)

  def _note_exit(self, rank: int, proc: subprocess.Popen) -> None:
    proc.wait()
    self.exited_at[rank] = time.monotonic()

  def _wait_for_first_failure(self) -> int | None:
    """Rank of the first process to fail, or None when all succeed or on Ctrl-C."""
    while self.interrupted is None:
      codes = [p.poll() for p in self.procs]
      failures = [r for r, code in enumerate(codes) if code not in (None, 0)]
      if failures:
        time.sleep(0.05)  # the exit times of those that ended together
        codes = [p.poll() for p in self.procs]
        failures = [r for r, code in enumerate(codes) if code not in (None, 0)]
        # A process killed by a signal is the likelier cause of its peers' errors; else
        # the first to end.
        return min(failures, key=lambda r: (codes[r] >= 0, self.exited_at[r] or math.inf, r))
      if all(code == 0 for code in codes):
        return None
      time.sleep(0.1)
    return None

  def _forward(self, signum, _frame) -> None:
    if self.interrupted is not None:
      self.killed = any(p.poll() is None for p in self.procs)
      self._signal_all(signal.SIGKILL)
      return
    self.interrupted = signum
    # The processes agree on the step to stop at where they next log (train.log_every),
    # then save it: they are waited for as long as that takes.
    _say(f"{signal.Signals(signum).name}: the processes stop and save at their next logged "
         "step (train.log_every); send it again to stop them at once, unsaved")
    # A hangup reaches them as SIGTERM, which they answer as a preemption: a checkpoint of
    # the step they are at, then exit.
    self._signal_all(signal.SIGTERM if signum == signal.SIGHUP else signum)

  def _signal_all(self, signum) -> None:
    for proc in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, signum)
        except ProcessLookupError:
          pass

  def _stop_all(self) -> None:
    """Stops whatever still runs: SIGTERM (or the forwarded Ctrl-C), then SIGKILL."""
    if self.interrupted is None:
      self._signal_all(signal.SIGTERM)
    # After an interrupt, until they have saved (a second signal kills them).
    deadline = time.monotonic() + (
        _STOP_GRACE_S if self.interrupted is None else _INTERRUPT_GRACE_S)
    while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
      time.sleep(0.1)
    if self.interrupted is not None and any(p.poll() is None for p in self.procs):
      self.killed = True
    self._signal_all(signal.SIGKILL)
    for proc in self.procs:
      proc.wait()
    for reader in self.readers:
      reader.join(timeout=5)

  def _report(self, failed: int | None) -> int:
    if self.interrupted is not None:
      _say(f"interrupted by {signal.Signals(self.interrupted).name}; "
           + (f"killed the processes (a second signal, or {_INTERRUPT_GRACE_S} s without "
              "stopping) before they saved" if self.killed else "every process stopped"))
      return 128 + self.interrupted
    if failed is None:
      return 0
    code = self.procs[failed].returncode
    how = (f"was killed by {signal.Signals(-code).name}" if code < 0
           else f"exited with code {code}")
    tail = "".join(f"\n  {line}" for line in self.tails[failed]) or " (nothing on stderr)"
    _say(f"error: process {failed} (pid {self.procs[failed].pid}) {how}; stopped the other "
         f"processes. Its last lines on stderr:{tail}")
    return code if code > 0 else 128 - code


# gloo (C++) prints this on stdout for every communicator it connects, several
# times per process; it says nothing a user can act on.
_GLOO_CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                           r"Expected number of connected peer ranks is : \d+")


def _pump(stream, sink, prefix: str, tail) -> None:
  """Copies a child's stream line by line with its rank, keeping the last lines;
  gloo's connection chatter is dropped (it can land in the middle of a line)."""
  for line in stream:
    line = line.rstrip("\n")
    if "[Gloo]" in line:
      line = _GLOO_CHATTER.sub("", line)
      if not line.strip():
        continue
    if tail is not None:
      tail.append(line)
    if sink is not None:
      try:
        sink.write(f"{prefix}{line}\n")
        sink.flush()
      except (BrokenPipeError, ValueError):  # (ValueError: a closed sink)
        # The reader went away (`| head`): the lines are dropped, but still read, or the
        # child would block writing into a full pipe and stall the run.
        sink = None
  stream.close()


def _say(message: str) -> None:
  print(f"jaxzero.launch: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
  sys.exit(main())
