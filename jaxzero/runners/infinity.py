"""The ZeRO-Infinity runner (``offload.params=nvme``): a model bigger than the machine,
trained one layer at a time.

With ``offload.optimizer=nvme`` the store on local disk already holds each weight's fp32
master and optimizer moments (jaxzero.runners.nvme). Here nothing else is kept whole
either. The forward pass reads each layer's master weights from the store (only the master
copy of each chunk), and the layer's program casts them to the compute dtype; the backward
pass reads them again. Each layer's gradient leaves the device as its backward program
ends (reduce-scattered by the program's output sharding at stage 3) and is added, on the
host, into a gradient file on the same disk, where the micro-steps accumulate. The update
then streams gradient, master and moments chunk by chunk. Memory holds the embedding and
head while they run, a layer's weights and gradient (and the next layer's, read ahead),
and one activation checkpoint per layer.

Mechanism: a driver of jitted per-layer programs (jaxzero.offload.layer_programs). XLA:CPU
has no memory kinds, so a single scanned program cannot place a layer's weights off the
device on this backend; an ``io_callback`` inside the scan would put each read on the
program's critical path. Separate programs let the store's threads read the next layer
while the current one computes (JAX dispatches asynchronously), and write a layer's
gradient while the next one computes. The whole-program step stays the default; this mode
is what ``offload.params=nvme`` selects.

The compute copy is never stored: it is the master weight cast, as the in-memory step
makes it after every update. So a checkpoint's ``params`` are derived from its masters
(jaxzero.offload.nvme_checkpoint), and runs resume across modes, meshes and stages.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pathlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxzero import engine as engine_lib
from jaxzero.checkpoint import integrity
from jaxzero.offload import nvme_chunks, nvme_store
from jaxzero.offload.layer_programs import LayerPrograms
from jaxzero.runners import nvme as nvme_runner

GRADS = "grads"  # the store subdirectory of the gradient sums


class InfinityRunner(nvme_runner.NvmeRunner):
  """The NVMe tier with the parameters and gradients off the device too.

  The state's ``params`` are None at every leaf; :attr:`names` lists them among the
  leaves the tier keeps (a checkpoint derives them from the masters).
  """

  def __init__(self, program: engine_lib.TrainProgram, directory: pathlib.Path):
    super().__init__(program, directory)
    self.programs = LayerPrograms(program)
    self.key = self.programs.key
    self.names |= {f"params/{leaf.name}" for leaf in self.leaves}
    # The gradient sums: one fp32 copy per weight, chunked as the optimizer's state.
    self.grad_leaves = [dataclasses.replace(leaf, kinds=("grad",)) for leaf in self.leaves]
    self.grad_store: nvme_store.Store | None = None
    self._assembler = concurrent.futures.ThreadPoolExecutor(1, "jaxzero-infinity")
    self.io_bytes = self._io_bytes()

  holds = "the optimizer state, the master weights and the gradients"
  updated_by = "offload.params=nvme"

  # -- structure ---------------------------------------------------------------------

  def bytes_needed(self) -> int:
    return super().bytes_needed() + nvme_store.bytes_needed(self.grad_leaves)

  def layer_leaves(self, leaves):
    return [leaf for leaf in leaves if leaf.name.startswith(self.key + "/")]

  def outer_leaves(self, leaves):
    return [leaf for leaf in leaves if not leaf.name.startswith(self.key + "/")]

  def nest(self, arrays: dict[str, Any]) -> Any:
    """{weight name: array} of one layer's weights, nested as ``params[layers_key]``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: arrays[integrity.leaf_name((self.key, *path))],
        self.program.abstract.master[self.key])

  def named(self, tree: Any) -> dict[str, Any]:
    """`nest`'s inverse."""
    return {integrity.leaf_name((self.key, *path)): x
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

  @property
  def n_layers(self) -> int:
    return self.layer_leaves(self.leaves)[0].shape[0]

  def open_store(self) -> nvme_store.Store:
    if self.grad_store is not None:  # before the directory holding it is made anew
      self.grad_store.close()
      self.grad_store = None
    store = super().open_store()
    store.derived = self.cfg.precision.compute  # checkpoints derive the compute copy
    self.grad_store = nvme_store.Store(self.directory / GRADS, self.grad_leaves)
    return store

  def close(self) -> None:
    if self.grad_store is not None:
      self.grad_store.close()
      self.grad_store = None
    super().close()

  def _compute_copy(self, store) -> Any:
    """No compute copy is kept: None at every leaf (see the module's docstring)."""
    return jax.tree.map(lambda _: None, self.program.abstract.params)

  def state(self, restored) -> nvme_runner.NvmeState:
    return super().state(restored._replace(params=self._compute_copy(None)))

  def _io_bytes(self) -> dict[str, int]:
    """This process's bytes read and written per step, at the config's grad_accum."""
    accum = self.cfg.train.grad_accum
    master = sum(leaf.local_bytes // len(leaf.kinds) for leaf in self.leaves)
    layers = sum(leaf.local_bytes // len(leaf.kinds) for leaf in self.layer_leaves(self.leaves))
    state = sum(leaf.local_bytes for leaf in self.leaves)
    # Per micro-step: the outer masters once, the layers' twice (forward, backward), the
    # gradients written (and, after the first micro-step, read back to be added to).
    read = accum * (master + layers) + (accum - 1) * master + master + state
    written = accum * master + state
    return {"read": read, "written": written}

  # -- the step ------------------------------------------------------------------------

  def lower(self, state_shapes, batch_shapes):
    raise TypeError("ZeRO-Infinity runs one program per layer: jaxzero.planning.infinity_plan "
                    "compiles them one by one")

  def compile(self, state: nvme_runner.NvmeState, batch: jax.Array):
    """The step (its programs compile on first use, one per kind of program)."""
    return self.step

  def _gradients(self, state, batch_Ax: jax.Array, scale, grad_step=None):
    """The step's gradients, summed into the gradient store: (None, loss, norm)."""
    del grad_step
    p, accum = self.programs, jax.tree.leaves(batch_Ax)[0].shape[0]
    self.store.writes.wait()  # the last update's writes, before their masters are read
    # The weights outside the layer stack (embedding, head, final norm) stay in host
    # memory through the step; each program gets, on the device, those it reads.
    outer = self.read_weights(self.outer_leaves(self.leaves), None).host()
    first_batch = jax.tree.map(lambda x: x[0], batch_Ax)
    pre_names, post_names = (p.outer_names(side, first_batch) for side in ("pre", "post"))
    loss_sum, squares = 0.0, 0.0
    for a in range(accum):
      batch = jax.tree.map(lambda x, a=a: x[a], batch_Ax)
      first, last = a == 0, a == accum - 1
      carry, consts = p.pre(self._on_device(outer, pre_names), batch)
      checkpoints = []
      for _, weights in self._layers(range(self.n_layers)):
        checkpoints.append(carry)
        carry = p.layer_forward(weights, carry, consts)
        # Dispatch is asynchronous: without waiting for the previous layer, this loop
        # would put every layer's weights on the device before the first had run.
        jax.block_until_ready(checkpoints[-1])
      value, (post_grads, ct_carry) = p.post_grad(self._on_device(outer, post_names), batch,
                                                  carry, scale)
      loss_sum += value if scale is None else value[1]
      ct_consts = [0.0 * c for c in p.float_consts(consts)]
      self.grad_store.writes.wait()  # the last micro-step's sums, before they are added to
      pending = None
      for i, weights in self._layers(reversed(range(self.n_layers))):
        layer_grads, ct_carry, ct = p.layer_backward(weights, checkpoints.pop(), consts, ct_carry)
        ct_consts = p.add(ct_consts, ct)
        if pending is not None:  # the previous layer's, while this one computes
          squares += self._add_grads(*pending, first=first, last=last)
        pending = (self.layer_leaves(self.grad_leaves), i, layer_grads)
      squares += self._add_grads(*pending, first=first, last=last)
      pre_grads = p.pre_backward(self._on_device(outer, pre_names), batch, ct_carry, ct_consts)
      outer_grads = {leaf.name: _sum(post_grads.get(leaf.name), pre_grads.get(leaf.name), leaf)
                     for leaf in self.outer_leaves(self.leaves)}
      del post_grads, pre_grads  # (a tied embedding's two parts: only their sum is kept)
      squares += self._add_grads(self.outer_leaves(self.grad_leaves), None, outer_grads,
                                 first=first, last=last)
    self.grad_store.writes.wait()
    if jax.process_count() > 1:
      squares = float(np.sum(multihost_utils.process_allgather(np.float64(squares))))
    grad_norm = np.float32(np.sqrt(squares) / accum)
    if scale is not None:
      grad_norm = grad_norm / np.float32(scale)
    return None, np.float32(loss_sum / accum), grad_norm

  @staticmethod
  def _on_device(host: dict, names: list[str]) -> dict[str, jax.Array]:
    """{name: global array} of the weights `names` of `host` (_Weights.host)."""
    return {name: _to_device(*host[name]) for name in names}

  def _layers(self, order):
    """(layer, its master weights) in `order`, the next layer's chunks read meanwhile."""
    leaves = self.layer_leaves(self.leaves)
    yield from nvme_store.prefetched(order, lambda i: self.read_weights(leaves, i), depth=1)

  def read_weights(self, leaves, layer: int | None) -> "_Weights":
    """The weights `leaves` (of one layer [1, ...] where `layer` is given) in the compute
    dtype: their master copies read now, and cast on the host as they arrive (numpy's
    rounding to bf16 is XLA's, to nearest even), on a thread of their own. The device
    then receives, and holds, 2 bytes a weight in bf16, not the master's 4."""
    reads = []
    for leaf in leaves:
      chunks = [s for s in leaf.starts() if layer is None or leaf.layer(s) == layer]
      reads.append([(region, [(s, self.store.read(leaf, region, s, copies=1)) for s in chunks])
                    for region in leaf.regions])
    compute = engine_lib.dtype_of(self.cfg.precision.compute)
    return _Weights(self, layer, self._assembler.submit(_assemble, leaves, layer, reads, compute))

  def _add_grads(self, leaves, layer: int | None, grads: dict, first: bool, last: bool) -> float:
    """Adds `grads` (of one layer where given) into the gradient store; returns the sum
    of squares of the new sums of the boxes this process owns, on the last micro-step."""
    store, squares = self.grad_store, 0.0
    grads = self.named(grads) if layer is not None else grads
    for leaf in leaves:
      grad = grads[leaf.name]
      shards = {s.device: s.data for s in grad.addressable_shards}
      for region in leaf.regions:
        box = _layer_box(region.box, layer)
        data = np.asarray(shards[region.devices[0]])  # widened a chunk at a time, below
        for s in leaf.starts():
          if layer is not None and leaf.layer(s) != layer:
            continue
          chunk = data[_local(leaf.chunk_box(region, s), box)][None].astype(np.float32)
          if not first:
            chunk = chunk + store.read(leaf, region, s).result()
          if last and region.owner:
            squares += float(np.sum(np.square(chunk, dtype=np.float64)))
          store.write(leaf, region, s, chunk)
    return squares

  def _update(self, state, grads, grad_norm, scale=None):
    """The streamed update from the gradient store: (None params, new optimizer scalars)."""
    del grads
    store, grad_store = state.store, self.grad_store
    store.writes.wait()
    scalars = jax.tree.leaves(state.opt_state)
    new_scalars, written = None, None
    units = [(leaf, g, starts) for leaf, g in zip(self.leaves, self.grad_leaves)
             for starts in leaf.starts()]

    def read(unit):
      leaf, g, starts = unit
      return nvme_chunks.All([store.read(leaf, region, starts) for region in leaf.regions]
                            + [grad_store.read(g, region, starts) for region in g.regions])

    replicated = self.program.layout.replicated()
    norm = jax.device_put(np.float32(grad_norm), replicated)
    scale = jax.device_put(np.float32(1.0 if scale is None else scale), replicated)
    for (leaf, g, starts), chunks in nvme_store.prefetched(units, read):
      n = len(leaf.regions)
      new_chunk, out_scalars = self._chunk_unit(leaf)(
          self._global_chunk(g, chunks[n:]), self._global_chunk(leaf, chunks[:n]), scalars,
          norm, scale)
      new_scalars = new_scalars or out_scalars
      if written is not None:  # the previous chunk's, while this one computes
        self._write_chunk(store, *written)
      written = (leaf, starts, new_chunk)
    self._write_chunk(store, *written)
    return state.params, self._scalar_def.unflatten(new_scalars)

  def _chunk_unit(self, leaf: nvme_store.Leaf):
    """Jitted (gradient chunk [1, ...], chunk [K, ...], scalars, norm, scale) -> (new
    chunk, new scalars)."""
    name = "chunk:" + leaf.name
    if name not in self._units:
      inner, cfg = self._inner, self.cfg
      scalar_sh = jax.tree.leaves(self._scalar_sh)
      replicated = self.program.layout.replicated()
      grad_sh = dataclasses.replace(leaf, kinds=("grad",)).chunk_sharding
      self._units[name] = jax.jit(
          lambda g, chunk, scalars, norm, scale: nvme_chunks.update_chunk(
              cfg, inner, leaf.name, g[0], chunk, scalars, norm, scale),
          in_shardings=(grad_sh, leaf.chunk_sharding, scalar_sh, replicated, replicated),
          out_shardings=(leaf.chunk_sharding, scalar_sh))
    return self._units[name]


def _assemble(leaves, layer: int | None, reads, dtype) -> dict[str, tuple]:
  """{name: (leaf, global shape, [(region, its box in `dtype`)])} once `reads` are done."""
  out = {}
  for leaf, regions in zip(leaves, reads):
    data = []
    for region, chunks in regions:
      box = _layer_box(region.box, layer)
      array = np.empty([b - a for a, b in box], dtype)
      for starts, future in chunks:
        array[_local(leaf.chunk_box(region, starts), box)] = future.result()[0]
      data.append((region, array))
    out[leaf.name] = (leaf, leaf.shape if layer is None else (1, *leaf.shape[1:]), data)
  return out


class _Weights:
  """Weights being read (InfinityRunner.read_weights): `host()` waits for them, `result()`
  also puts them on the devices (on the caller's thread, which orders the transfers)."""

  def __init__(self, tier: InfinityRunner, layer: int | None, assembled):
    self._tier, self._layer, self._assembled = tier, layer, assembled

  def host(self) -> dict[str, tuple]:
    return self._assembled.result()

  def result(self) -> Any:
    arrays = {name: _to_device(*value) for name, value in self.host().items()}
    return self._tier.nest(arrays) if self._layer is not None else arrays


def _to_device(leaf: nvme_store.Leaf, shape: tuple[int, ...], data: list) -> jax.Array:
  shards = [jax.device_put(array, d) for region, array in data for d in region.devices]
  return jax.make_array_from_single_device_arrays(shape, leaf.sharding, shards)


def _sum(a, b, leaf: nvme_store.Leaf):
  """The sum of a weight's gradients from both sides of the cut (None where a side does
  not read the weight; zeros where neither does)."""
  if a is None and b is None:
    return jax.device_put(np.zeros(leaf.shape, np.float32), leaf.sharding)
  return b if a is None else a if b is None else a + b


def _layer_box(box, layer):
  return box if layer is None else ((layer, layer + 1), *box[1:])


def _local(box, within) -> tuple[slice, ...]:
  """Where `box` lies in an array holding `within`."""
  return tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, within))


