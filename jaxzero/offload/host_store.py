"""One process's optimizer state in host memory (ZeRO-Offload), chunk by chunk.

The same chunks as the NVMe store (jaxzero.offload.nvme_store: a box of one shard holding
all K copies of a weight, [K, *box]) and the same interface (read, write, chunks, close), so
that the streamed runner, its initialisation and its checkpoint item serve both. In memory a
chunk is its K copies apart, [*box] each (an update over stacked copies runs several times
slower on XLA:CPU than over separate ones), on one of the host's CPU devices, taken in
turn so that the updates of successive
chunks run on the host's cores at once (XLA:CPU runs one program at a time per device); the
update (jaxzero.runners.host) donates it and gets back its result in the same buffer, so
the host holds the state once, plus the chunks in flight.
Chunks that `on_device` names (Twin-Flow: the layers whose state stays on the device) are
kept as one global array [K, *chunk] over the devices instead, each device its own box.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Iterator

import jax
import numpy as np

from jaxzero.offload import nvme_store


def host_devices() -> list:
  """The CPU devices the host's update runs on (on a GPU machine, JAX's CPU backend: one
  per core where jaxzero started JAX, jaxzero.runtime.xla_flags.use_host_cores)."""
  return jax.local_devices(backend="cpu")


def layer_of(leaf: nvme_store.Leaf, starts: tuple[int, ...]) -> int:
  """The layer a chunk belongs to (-1: a weight outside the layer stack), by which the
  update orders its chunks: the forward pass's order."""
  return leaf.layer(starts)


_owned = jax.jit(lambda x: x.copy())


@jax.tree_util.register_static
class HostStore:
  """The chunks of `leaves` this process keeps, as K float32 arrays each on a CPU device.

  A static pytree node, as the NVMe store: a state holding it flattens to its in-memory
  leaves. `derived`, as there: the compute dtype a checkpoint derives ``params`` in.
  """

  def __init__(self, leaves: list[nvme_store.Leaf], derived: str | None = None,
               on_device: Callable[[nvme_store.Leaf, tuple[int, ...]], bool] = lambda *_: False):
    self.leaves, self.derived, self.on_device = leaves, derived, on_device
    self.writes = nvme_store.Writes()  # nothing is written behind: every write is done at once
    devices = host_devices()
    # Taken in turn in the order the update visits the chunks (the forward pass's, layer
    # by layer), so that the chunks it has in flight at once are on different devices.
    in_order = sorted(self.chunks(), key=lambda chunk: layer_of(chunk[0], chunk[2]))
    self._devices = {(leaf.name, region.box, starts): devices[i % len(devices)]
                     for i, (leaf, region, starts) in enumerate(in_order)}
    self._chunks: dict[tuple, tuple[jax.Array, ...]] = {}
    self._on_devices: dict[tuple, jax.Array] = {}
    self._parts: dict[tuple, dict] = {}  # a device-resident chunk's boxes, until all are written

  def read(self, leaf: nvme_store.Leaf, region: nvme_store.Region, starts: tuple[int, ...],
           copies: int | None = None) -> concurrent.futures.Future:
    """A done future of a copy of the chunk [K, ...] (or of its first `copies` copies), as
    numpy: a copy, because a host buffer that numpy still views cannot be donated, and the
    update would then write its result into a second one."""
    if self.on_device(leaf, starts):
      shards = {s.device: s.data for s in self._on_devices[leaf.name, starts].addressable_shards}
      chunk = np.array(shards[region.devices[0]][:copies])
    else:
      chunk = np.stack([np.asarray(c) for c in self.get(leaf, region, starts)[:copies]])
    done = concurrent.futures.Future()
    done.set_result(chunk)
    return done

  def write(self, leaf: nvme_store.Leaf, region: nvme_store.Region, starts: tuple[int, ...],
            chunk) -> None:
    """Keeps `chunk`: numpy [K, ...], or the K arrays an update returned (kept as they
    are: the buffers it was given)."""
    if self.on_device(leaf, starts):
      parts = self._parts.setdefault((leaf.name, starts), {})
      parts[region.box] = np.asarray(chunk, np.float32)
      if len(parts) == len(leaf.regions):
        arrays = [jax.device_put(parts[r.box], d) for r in leaf.regions for d in r.devices]
        self._on_devices[leaf.name, starts] = jax.make_array_from_single_device_arrays(
            (len(leaf.kinds), *leaf.chunk), leaf.chunk_sharding, arrays)
        del self._parts[leaf.name, starts]
      return
    if not isinstance(chunk, tuple):
      # Copied by XLA into buffers of its own allocation: the update can then donate them
      # (a buffer made from numpy's memory, or misaligned for XLA:CPU, would be copied).
      device = self.device_of(leaf, region, starts)
      chunk = tuple(_owned(jax.device_put(np.asarray(c, np.float32), device)) for c in chunk)
    self._chunks[leaf.name, region.box, starts] = chunk

  def device_of(self, leaf: nvme_store.Leaf, region: nvme_store.Region,
                starts: tuple[int, ...]):
    """The host (CPU) device that keeps and updates this chunk."""
    return self._devices[leaf.name, region.box, starts]

  def take_device_chunk(self, leaf: nvme_store.Leaf, starts: tuple[int, ...]) -> jax.Array:
    """A device-resident chunk, given up to the update (which donates it)."""
    return self._on_devices.pop((leaf.name, starts))

  def put_device_chunk(self, leaf: nvme_store.Leaf, starts: tuple[int, ...],
                       chunk: jax.Array) -> None:
    self._on_devices[leaf.name, starts] = chunk

  def get(self, leaf: nvme_store.Leaf, region: nvme_store.Region,
          starts: tuple[int, ...]) -> tuple[jax.Array, ...]:
    return self._chunks[leaf.name, region.box, starts]

  def take(self, leaf: nvme_store.Leaf, region: nvme_store.Region,
           starts: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """The chunk, given up: the caller donates it to the update and writes back the result."""
    return self._chunks.pop((leaf.name, region.box, starts))

  def chunks(self) -> Iterator[tuple[nvme_store.Leaf, nvme_store.Region, tuple[int, ...]]]:
    return nvme_store.chunks_of(self.leaves)

  def close(self) -> None:
    self._chunks.clear()
    self._on_devices.clear()

  def buffer_pointers(self) -> dict[tuple, int]:
    """Where each host chunk's buffer is: an update in place leaves these unchanged."""
    return {k: tuple(c.unsafe_buffer_pointer() for c in chunk)
            for k, chunk in self._chunks.items()}

  @property
  def host_bytes(self) -> int:
    """Bytes the host holds: the chunks not on the devices."""
    return sum(c.nbytes for chunk in self._chunks.values() for c in chunk)

