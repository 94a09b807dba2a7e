"""Noticing a lost or a stuck process in a multi-process run, at any phase.

Every process keeps one TCP connection to process 0 for as long as it lives. A process that
dies closes it (TCP keep-alive notices a vanished host); process 0 tells the others which one
was lost, and each survivor prints one line naming it and exits with code 1 from a watcher
thread, whatever its main thread is blocked in. A process leaving normally says "bye" first,
one stopping on an error it reported says "failed". Over the same connection each process
reports its phase (compile, step k, save k, eval k) and a heartbeat every second; process 0
names the processes that stay in one phase too long (:class:`_Stalls`), and sends its own
heartbeat, so that the others name it when it stops (:meth:`_Watch.watch_process_0`).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time

log = logging.getLogger(__name__)

BYE, FAILED, LOST, PHASE, BEAT = "bye", "failed", "lost", "phase", "beat"
_BEAT_S = 1.0  # a process whose heartbeat is this many times late is reported silent
_SILENT_BEATS = 3
# A peer that stopped on an error it reported: time for this process to stop
# on its own (the same error, where all processes agree on it) before saying so.
_FAILED_GRACE_S = 5
# An error on this process that may come from a lost peer: time for the watch,
# which sees the peer's connection close at once, to report it first.
_SETTLE_S = 5
_ADDRESS_BYTES = 256
# Keep-alive: a peer whose host vanished without closing the connection is
# noticed after about IDLE + INTERVAL x COUNT seconds.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_COUNT = 10, 5, 4


_watch: "_Watch | None" = None


def start(coordinator: str | None, prog: str, stall_s: float = 0.0,
          stall_exit_s: float = 0.0) -> None:
  """Connects this process to the watch; call right after jax.distributed joined.

  Process 0 listens on a free port and sends its host and port to the others
  through one broadcast (a JAX collective, so every process must call this).
  `coordinator` is the run's coordinator address when known (its host is
  process 0's); else process 0 sends its own host name.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  global _watch  # pylint: disable=global-statement
  process_id, num_processes = jax.process_index(), jax.process_count()
  server = None
  message = np.zeros(_ADDRESS_BYTES + 1, np.int32)
  if process_id == 0:
    server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True) \
        if socket.has_dualstack_ipv6() else socket.create_server(("", 0))
    host = (coordinator.rpartition(":")[0].strip("[]") if coordinator else socket.getfqdn())
    encoded = host.encode()[:_ADDRESS_BYTES]
    message[:len(encoded)] = list(encoded)
    message[-1] = server.getsockname()[1]
  message = np.asarray(multihost_utils.broadcast_one_to_all(message))
  host = bytes(int(b) for b in message[:-1] if b).decode()
  port = int(message[-1])
  watch = _watch = _Watch(process_id, prog)
  if process_id == 0:
    threading.Thread(target=watch.serve, args=(server, num_processes - 1), daemon=True,
                     name="jaxzero-peerwatch").start()
    watch.stalls = _Stalls(watch, num_processes, stall_s, stall_exit_s)
    threading.Thread(target=watch.stalls.run, daemon=True, name="jaxzero-stallwatch").start()
  else:
    connection = socket.create_connection((host, port), timeout=60)
    connection.settimeout(None)
    _keepalive(connection)
    connection.sendall(f"{process_id}\n".encode())
    watch.add(0, connection)
    threading.Thread(target=watch.watch_process_0, args=(stall_s, stall_exit_s), daemon=True,
                     name="jaxzero-watch-0").start()
  threading.Thread(target=watch.beat, daemon=True, name="jaxzero-heartbeat").start()
  atexit.register(leaving)


def phase(name: str) -> None:
  """Says what this process does now (e.g. "compile", "step 7", "save 8"); process 0
  keeps every process's latest phase and when it began. A no-op in one process."""
  if _watch is not None:
    _watch.phase(name)


def settle() -> None:
  """Waits a few seconds for the watch to notice a lost peer (it then exits the
  process); returns if none was lost. For an error that may be a loss's echo."""
  if _watch is not None:
    time.sleep(_SETTLE_S)


def leaving(failed: bool = False) -> None:
  """Tells the other processes that this one exits: normally, or (`failed`) on
  an error it has reported itself."""
  if _watch is not None:
    _watch.leaving(FAILED if failed else BYE)


class _Watch:
  """This process's end of the watch: one connection per peer it watches."""

  def __init__(self, process_id: int, prog: str):
    self.process_id, self.prog = process_id, prog
    self._lock = threading.Lock()
    self._connections: dict[int, socket.socket] = {}
    self._said: dict[int, str] = {}
    self.stalls: _Stalls | None = None  # process 0's
    self._heard_0 = time.time()  # when a non-zero process last heard from process 0

  def phase(self, name: str) -> None:
    now = time.time()
    if self.stalls is not None:
      self.stalls.update(self.process_id, name, now)
    else:
      self._send(0, f"{PHASE} {now:.3f} {name}")

  def beat(self) -> None:
    """This process's heartbeat to those it is connected to, every second while it runs:
    process 0's to every other process, theirs to process 0."""
    while True:
      with self._lock:
        peers = list(self._connections)
      if self.process_id != 0 and not any(self._send(p, BEAT) for p in peers):
        return  # (process 0's connections arrive as the others join)
      for peer in peers if self.process_id == 0 else ():
        self._send(peer, BEAT)
      time.sleep(_BEAT_S)

  def watch_process_0(self, stall_s: float, exit_s: float) -> None:
    """A non-zero process's watch of process 0, which watches every other one: where its
    heartbeat stops (SIGSTOP, a frozen host) for distributed.stall_s (else 60 s), says
    so, once per that time while it lasts; past distributed.stall_exit_s, stops."""
    limit, reported = stall_s or 60.0, None
    while True:
      time.sleep(_BEAT_S)
      with self._lock:
        if 0 in self._said:  # it left (normally, or on an error it said): not silent
          return
      silent = time.time() - self._heard_0
      if silent <= limit and not (exit_s and silent > exit_s):
        reported = None
        continue
      if exit_s and silent > exit_s:
        _say_line(f"{self.prog}: error: process 0 has been silent for {silent:.0f} s (its "
                  f"heartbeat stopped), past distributed.stall_exit_s={exit_s:g}; process "
                  f"{self.process_id} stops")
        self.leaving(FAILED)
        os._exit(1)  # pylint: disable=protected-access
      if reported is None or time.time() - reported >= limit:
        reported = time.time()
        _say_line(f"{self.prog}: process 0 has been silent for {silent:.0f} s (its heartbeat "
                  "stopped: a stopped process or a frozen host); process "
                  f"{self.process_id} waits for it")

  def _send(self, peer: int, line: str) -> bool:
    with self._lock:
      connection = self._connections.get(peer)
    if connection is None:
      return False
    try:
      connection.sendall(f"{line}\n".encode())
      return True
    except OSError:
      return False

  def serve(self, server: socket.socket, expected: int) -> None:
    """Process 0: accepts every other process's connection and watches each."""
    with server:
      for _ in range(expected):
        connection, _ = server.accept()
        _keepalive(connection)
        peer = int(_read_line(connection) or -1)
        if peer < 0:
          connection.close()
          continue
        self.add(peer, connection)

  def add(self, peer: int, connection: socket.socket) -> None:
    with self._lock:
      self._connections[peer] = connection
    threading.Thread(target=self._listen, args=(peer, connection), daemon=True,
                     name=f"jaxzero-peerwatch-{peer}").start()

  def _listen(self, peer: int, connection: socket.socket) -> None:
    buffer = b""
    while True:
      try:
        chunk = connection.recv(4096)
      except OSError:
        chunk = b""
      if not chunk:
        break
      buffer += chunk
      *lines, buffer = buffer.split(b"\n")
      if peer == 0:
        self._heard_0 = time.time()
      for line in lines:
        word, _, value = line.decode(errors="replace").partition(" ")
        if self.stalls is not None:
          self.stalls.heard(peer)
          if word == PHASE:
            # Timed by process 0's clock when it arrives: hosts' clocks may disagree
            # by more than the stall limit (the sender's time is on the line, unused).
            _, _, name = value.partition(" ")
            self.stalls.update(peer, name, time.time())
            continue
        if word in (BYE, FAILED):
          with self._lock:
            self._said[peer] = word
          if word == FAILED:
            timer = threading.Timer(_FAILED_GRACE_S, self._lost, args=(peer,),
                                    kwargs={"how": "it stopped on an error"})
            timer.daemon = True
            timer.start()
        elif word == LOST and value.isdigit():
          self._lost(int(value), how="process 0 reported it lost")
    with self._lock:
      said = self._said.get(peer)
    if said is None:
      self._lost(peer, how="its connection to process 0 closed" if self.process_id == 0
                 else "the connection to it closed")

  def _lost(self, peer: int, how: str) -> None:
    """Reports `peer` lost, tells the others (process 0), and exits."""
    with self._lock:
      others = [c for p, c in self._connections.items() if p != peer]
    for connection in others:
      try:
        connection.sendall(f"{LOST} {peer}\n".encode())
      except OSError:
        pass
    # One write of the whole line: JAX's C++ client may report the same loss from
    # another thread at this moment, and print() writes the text and its newline
    # apart, so that report could land between them, on our line.
    _say_line(f"{self.prog}: error: process {peer} of the run stopped answering ({how}); "
              f"process {self.process_id} stops too")
    sys.stdout.flush()
    os._exit(1)  # pylint: disable=protected-access

  def leaving(self, word: str) -> None:
    """Tells the peers why this process exits, so that closing is not taken for a loss."""
    with self._lock:
      connections = list(self._connections.values())
    for connection in connections:
      try:
        connection.sendall(f"{word}\n".encode())
      except OSError:
        pass


def _read_line(connection: socket.socket) -> str:
  """The first line, read a byte at a time: what follows it (phases, heartbeats)
  is the listener's to read."""
  data = b""
  while not data.endswith(b"\n"):
    chunk = connection.recv(1)
    if not chunk:
      break
    data += chunk
  return data.decode(errors="replace").strip()


def _keepalive(connection: socket.socket) -> None:
  connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
  for name, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
                      ("TCP_KEEPCNT", _KEEPALIVE_COUNT)):
    if hasattr(socket, name):  # Linux; macOS lacks some
      connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Stalls:
  """Process 0's view of every process's phase; names those that stay in one too long.

  The limit is distributed.stall_s, else 5 x the median of process 0's step times
  (at least 60 s), else 300 s until there are steps to time. A stall is reported
  once per limit while it lasts, in one line: each process's phase and how long it
  has been there, the processes whose heartbeat stopped (SIGSTOP, a frozen host),
  and whether the processes are in different phases, the divergence that turns
  into a silent collective hang. Past distributed.stall_exit_s the run stops.
  """

  def __init__(self, watch: _Watch, num_processes: int, stall_s: float, exit_s: float):
    self.watch, self.stall_s, self.exit_s = watch, stall_s, exit_s
    self._lock = threading.Lock()
    now = time.time()
    self._phases = {p: ("start-up", now) for p in range(num_processes)}
    self._heard = {p: now for p in range(num_processes)}
    self._step_times: list[float] = []
    self._last_step: float | None = None

  def heard(self, process: int) -> None:
    with self._lock:
      self._heard[process] = time.time()

  def update(self, process: int, name: str, when: float) -> None:
    with self._lock:
      self._phases[process] = (name, when)
      if process == 0 and name.startswith("step "):
        if self._last_step is not None:
          self._step_times.append(when - self._last_step)
        self._last_step = when

  def limit(self) -> float:
    if self.stall_s:
      return self.stall_s
    times = sorted(self._step_times[-100:])
    return max(60.0, 5 * times[len(times) // 2]) if len(times) >= 3 else 300.0

  def run(self) -> None:
    reported, reported_silent = None, set()
    while True:
      time.sleep(1.0)
      now = time.time()
      with self._lock:
        phases, heard, limit = dict(self._phases), dict(self._heard), self.limit()
      stalled = now - min(when for _, when in phases.values())
      # (stall_exit_s below the report's limit stops the run at its own time.)
      exiting = bool(self.exit_s) and stalled > self.exit_s
      if stalled <= limit and not exiting:
        reported = None
        continue
      silent = _silent(heard, now)
      # Once per limit while it lasts, and at once when another process falls silent.
      if stalled > limit and (reported is None or now - reported >= limit
                              or silent - reported_silent):
        reported, reported_silent = now, silent
        _say_line(f"{self.watch.prog}: stalled for {stalled:.0f} s (limit {limit:.0f} s): "
                  f"{describe(phases, heard, now)}")
      if exiting:
        _say_line(f"{self.watch.prog}: error: stalled for {stalled:.0f} s, past "
                  f"distributed.stall_exit_s={self.exit_s:g}: {describe(phases, heard, now)}; "
                  "the run stops")
        self.watch.leaving(FAILED)
        os._exit(1)  # pylint: disable=protected-access


def describe(phases: dict[int, tuple[str, float]], heard: dict[int, float], now: float) -> str:
  """Where every process is: e.g. "process 1 is silent in step 4 (no heartbeat for 11 s:
  stopped, or its host froze); process 0 is in step 5 (for 12 s); the processes are in
  different phases"."""
  silent = _silent(heard, now)
  parts = [f"process {p} is silent in {phases[p][0]} (no heartbeat for {now - heard[p]:.0f} s: "
           "stopped, or its host froze)" for p in sorted(silent)]
  groups: dict[str, list[int]] = {}
  for p, (name, _) in sorted(phases.items()):
    if p not in silent:
      groups.setdefault(name, []).append(p)
  for name, members in sorted(groups.items(), key=lambda g: min(phases[p][1] for p in g[1])):
    since = now - min(phases[p][1] for p in members)
    who = (f"process {members[0]} is" if len(members) == 1 else f"processes {_ranges(members)} are")
    parts.append(f"{who} in {name} (for {since:.0f} s)")
  if len({name for name, _ in phases.values()}) > 1:
    parts.append("the processes are in different phases")
  elif not silent:
    parts.append("every process waits in the same phase (a collective or a device is stuck)")
  return "; ".join(parts)


def _silent(heard: dict[int, float], now: float) -> set[int]:
  return {p for p, t in heard.items() if p != 0 and now - t > _SILENT_BEATS * _BEAT_S}


def _ranges(processes: list[int]) -> str:
  """"0, 2-5" for [0, 2, 3, 4, 5]."""
  runs, start = [], processes[0]
  for a, b in zip(processes, processes[1:] + [None]):
    if b != a + 1:
      runs.append(str(start) if start == a else f"{start}-{a}")
      start = b
  return ", ".join(runs)


def _say_line(text: str) -> None:
  """One write of the whole line (another thread may be writing to stderr too)."""
  sys.stderr.flush()
  os.write(sys.stderr.fileno(), (text + "\n").encode())
