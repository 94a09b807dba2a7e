"""Noticing a lost process in a multi-process run, at any phase, within seconds.

Every process keeps one TCP connection to process 0 for as long as it lives. A process that
dies closes it (TCP keep-alive notices a vanished host); process 0 tells the others which one
was lost, and each survivor prints one line naming it and exits with code 1 from a watcher
thread, whatever its main thread is blocked in. A process leaving normally says "bye" first,
one stopping on an error it reported says "failed"; the connection carries nothing else.
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

BYE, FAILED, LOST = "bye", "failed", "lost"
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


def start(coordinator: str | None, prog: str) -> None:
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
  else:
    connection = socket.create_connection((host, port), timeout=60)
    connection.settimeout(None)
    _keepalive(connection)
    connection.sendall(f"{process_id}\n".encode())
    watch.add(0, connection)
  atexit.register(leaving)


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
      for line in lines:
        word, _, value = line.decode(errors="replace").partition(" ")
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
    line = (f"{self.prog}: error: process {peer} of the run stopped answering ({how}); "
            f"process {self.process_id} stops too\n")
    sys.stderr.flush()
    # One write of the whole line: JAX's C++ client may report the same loss from
    # another thread at this moment, and print() writes the text and its newline
    # apart, so that report could land between them, on our line.
    os.write(sys.stderr.fileno(), line.encode())
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
  data = b""
  while not data.endswith(b"\n"):
    chunk = connection.recv(64)
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
