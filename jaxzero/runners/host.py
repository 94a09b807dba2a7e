"""The host runner, ZeRO-Offload (``offload.optimizer=pinned_host``): the fp32 master
weights and the optimizer's moments in host memory, updated there in place, chunk by chunk.

The device runs the gradient step (TrainProgram.grad_step). Then, in the forward pass's
order (the weights outside the layer stack, then layer by layer), each chunk's gradient box
is cut on the device and comes down, XLA:CPU updates the chunk (a box of the master weight
and its moments, [K, *box]) in the buffer it donates, and the new compute-dtype box goes up
into its weight in place. Dispatch is asynchronous, so a chunk's transfers overlap the
updates of its neighbours; the host holds the state once, plus the chunks in flight.

``offload.delayed_update`` is the ZeRO-Offload paper's one-step delayed parameter update
(DPU): step n's update runs on a thread while the device computes step n + 1's gradient on
the weights from before step n's update, after ``offload.delayed_update_after`` exact
steps. ``offload.optimizer_fraction`` f keeps the state of the first int((1 - f) x layers)
layers on the device, updated there (Twin-Flow). Checkpoints hold the store as the NVMe
runner's do (its ``nvme`` item): every runner resumes every other's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero import engine as engine_lib
from jaxzero.engine import state_bytes as state_bytes_lib
from jaxzero.offload import host_store, nvme_chunks, nvme_store, targets
from jaxzero.parallel.zero import on_device
from jaxzero.runners import nvme
from jaxzero.runners.nvme import NvmeState

log = logging.getLogger(__name__)

GRADIENTS_AHEAD = 4  # chunks whose gradient boxes are on their way down ahead of the update
UPDATES_IN_FLIGHT = 8  # chunks the host updates at once (at most one per CPU device)


class HostRunner(nvme.NvmeRunner):
  """ZeRO-Offload of one run: the host store, its initialisation and its update."""

  holds = "the optimizer state"
  updated_by = "offload.optimizer=pinned_host"
  # Chunks in memory need not be the disk's I/O size: larger ones cost fewer dispatches
  # and transfers a step (each a synchronising round trip), while a step's chunks still
  # outnumber the host's devices many times over (one layer of a stacked weight each,
  # cut where larger).
  chunk_bytes = 256 << 20

  def __init__(self, program: engine_lib.TrainProgram):
    super().__init__(program, directory=None)
    offload = program.cfg.offload
    self.delayed = offload.delayed_update
    self.delayed_after = offload.delayed_update_after
    self.fraction = offload.optimizer_fraction
    stacked = [leaf for leaf in self.leaves if leaf.stacked]
    self.n_layers = stacked[0].shape[0] if stacked else 0
    self.device_layers = int((1 - self.fraction) * self.n_layers)  # DeepSpeed's (stage3.py)
    self._host_units: dict[str, Any] = {}
    self._first_units: dict[str, Any] = {}
    self._device_fns: dict[str, Any] = {}
    self._pending: concurrent.futures.Future | None = None  # DPU: the update in flight
    # DPU's copy of the weights (the next gradient step reads them), where they live.
    self._copy_weights = jax.jit(lambda params: jax.tree.map(jnp.copy, params),
                                 out_shardings=program.shardings.params)
    self._thread = concurrent.futures.ThreadPoolExecutor(1, "jaxzero-host-update")

  # -- structure and the runner protocol ---------------------------------------------

  def keeps_on_device(self, leaf: nvme_store.Leaf, starts: tuple[int, ...]) -> bool:
    """Twin-Flow: whether this chunk's state stays on the device (all of it at f = 0)."""
    if self.fraction == 0:
      return True
    return leaf.stacked and leaf.layer(starts) < self.device_layers

  def bytes_needed(self) -> int:
    return 0  # nothing on disk

  def host_bytes(self) -> int:
    """Bytes this process's host store holds (a replicated shard once)."""
    return int(sum(len(leaf.kinds) * 4 * np.prod([b - a for a, b in leaf.chunk_box(r, starts)])
                   for leaf in self.leaves for r in leaf.regions for starts in leaf.starts()
                   if not self.keeps_on_device(leaf, starts)))

  def host_bytes_per_device(self) -> int:
    """Of a device's optimizer state (master and per-weight leaves), the bytes that live
    on the host instead: what the device does not hold (a replicated shard counts on
    each device here, once in the process's store)."""
    total = 0
    for leaf in self.leaves:
      starts = leaf.starts()
      on_host = sum(not self.keeps_on_device(leaf, s) for s in starts) / len(starts)
      total += on_host * len(leaf.kinds) * 4 * np.prod(leaf.sharding.shard_shape(leaf.shape))
    return int(total)

  def workspace_bytes(self) -> int:
    """Host bytes of the update beside the store, at the largest chunk: one chunk in and
    out, the gradient and compute-dtype boxes of the chunks in flight, and the gradient
    boxes on their way down ahead of them (each chunk's own buffers are reused)."""
    largest = max(np.prod(leaf.chunk) for leaf in self.leaves)
    grad = state_bytes_lib.grad_bytes_per_param(self.program)
    compute = np.dtype(engine_lib.dtype_of(self.cfg.precision.compute)).itemsize
    in_flight = min(len(host_store.host_devices()), UPDATES_IN_FLIGHT) + 1
    return int((4 * len(self.leaves[0].kinds) + (grad + compute) * in_flight
                + grad * GRADIENTS_AHEAD) * largest)

  def check(self) -> None:
    targets.check_offload(self.cfg, list(self.program.layout.mesh.devices.flat))
    if self.program.schedule is None:  # the user's optimizer (the config's is AdamW)
      nvme_chunks.check_updates_by_box(
          self._inner, {leaf.name: leaf.shape for leaf in self.leaves}, self.updated_by)

  def plan(self) -> dict[str, int]:
    """The program's bytes (weights in pinned_host counted in `host` and `pinned_pool`)
    with the host store's share: per device, and this process's (`host_process`: the
    store and the update's workspace, outside XLA's pinned pool, which the memory check
    adds). `transfer` adds each host chunk's gradient down and its new compute-dtype box
    up; `host_update` is the bytes the host's update reads and writes a step (the gradient
    read; K copies read and written; the compute copy written)."""
    planned = self.program.state_bytes()
    devices, kinds = len(self.program.layout.mesh.local_devices), len(self.leaves[0].kinds)
    on_host = self.host_bytes()
    params = on_host // (4 * kinds)  # parameters updated on the host, this process
    compute = np.dtype(engine_lib.dtype_of(self.cfg.precision.compute)).itemsize
    grad = state_bytes_lib.grad_bytes_per_param(self.program)
    workspace, copy = self.workspace_bytes(), planned["params"]
    pinned = self.cfg.offload.params == "pinned_host"
    planned.update(
        nvme=0, host=planned["host"] + self.host_bytes_per_device(), pinned_pool=planned["host"],
        # (DPU: a step's gradients wait on the host for the update in flight.)
        host_process=on_host + workspace + self.delayed * params * grad,
        host_store=on_host, host_workspace=workspace,
        # DPU: the weights' copy its update writes (where they live), the gradients it
        # updates on the device (Twin-Flow's).
        delayed_device=self.delayed * (copy * (not pinned) + int(sum(
            grad * np.prod(leaf.sharding.shard_shape(leaf.shape)) for leaf in self.leaves
            if any(self.keeps_on_device(leaf, s) for s in leaf.starts())))),
        delayed_pinned=self.delayed * copy * pinned,
        transfer=planned["transfer"] + params * (grad + compute) // devices,
        host_update=params * (grad + 2 * 4 * kinds + compute))
    return planned

  def open_store(self) -> host_store.HostStore:
    # DPU: the update in flight is the replaced state's; it ends with its store, and the
    # new state's first step starts from its own weights.
    self.finish_update()
    self._pending = None
    if self.store is not None:
      self.store.close()
    self.store = host_store.HostStore(self.leaves, on_device=self.keeps_on_device)
    return self.store

  def close(self) -> None:
    self.finish_update()
    self._thread.shutdown()
    if self.store is not None:
      self.store.close()
      self.store = None

  # -- step 0 --------------------------------------------------------------------------

  def _write_first(self, store, leaf: nvme_store.Leaf, weight: jax.Array) -> None:
    """Step 0's chunks of one weight: each box comes down once to its CPU device, where
    XLA:CPU makes the optimizer's initial leaves beside it (the cores at once, one device
    each). Built in numpy, every chunk's K copies were stacked, cast and copied twice on
    one core: minutes at 8B."""
    shards = {s.device: s.data for s in weight.addressable_shards}
    for region in leaf.regions:
      data = shards[region.devices[0]]
      for starts in leaf.starts():
        box = leaf.chunk_box(region, starts)
        w = data[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region.box))]
        if self.keeps_on_device(leaf, starts):
          store.write(leaf, region, starts, self._first_copies(leaf, np.asarray(w)))
        else:
          w = jax.device_put(w, store.device_of(leaf, region, starts))
          store.write(leaf, region, starts, self._first_unit(leaf)(w))

  def _first_unit(self, leaf: nvme_store.Leaf):
    """Jitted on the host: a master box (donated: it stays the chunk's first copy) -> the
    chunk's K copies (the box, then the optimizer's initial per-weight leaves)."""
    if leaf.name not in self._first_units:
      inner = self._inner

      def first(w):
        state = inner.init(nvme_chunks.nest(leaf.name, w))
        flags = nvme_chunks.weight_flags(inner, state)
        return (w, *(x.astype(jnp.float32)
                     for x, is_weight in zip(jax.tree.leaves(state), flags) if is_weight))

      self._first_units[leaf.name] = jax.jit(first, donate_argnums=0)
    return self._first_units[leaf.name]

  def _compute_copy(self, store) -> Any:
    """The compute-dtype weights: each chunk's master box cast on its CPU device (the
    cores at once) and sent up into its weight, as the update sends its new boxes."""
    compute = engine_lib.dtype_of(self.cfg.precision.compute)
    cast = jax.jit(lambda w: w.astype(compute))
    sh = self.program.shardings
    params = [jax.jit(functools.partial(jnp.zeros, leaf.shape, compute), out_shardings=s)()
              for leaf, s in zip(self.leaves, jax.tree.leaves(on_device(sh.params)))]
    uploads = self._uploads(params)
    for i, leaf in enumerate(self.leaves):
      for starts in leaf.starts():
        if self.keeps_on_device(leaf, starts):
          masters = [np.asarray(store.read(leaf, r, starts, copies=1).result()[0])
                     for r in leaf.regions]
        else:
          masters = [store.get(leaf, r, starts)[0] for r in leaf.regions]
        uploads.add(i, starts, [cast(m) for m in masters])
    uploads.flush()
    return jax.device_put(jax.tree.unflatten(self._master_def, params), sh.params)

  def _uploads(self, params: list) -> "_Uploads":
    """New compute-dtype boxes on the host, written into `params` (by leaf index) late."""
    def write(i, starts, boxes):
      params[i] = self._write_box(self.leaves[i], starts, boxes, params[i])
    return _Uploads(write, min(len(host_store.host_devices()), UPDATES_IN_FLIGHT))

  def _write_box(self, leaf: nvme_store.Leaf, starts, boxes: list,
                 weight: jax.Array) -> jax.Array:
    """`weight` (donated) with its chunk at `starts` replaced by `boxes` (one per region,
    on the host): each goes up to its region's devices."""
    up = [jax.device_put(box, d) for region, box in zip(leaf.regions, boxes)
          for d in region.devices]
    new = jax.make_array_from_single_device_arrays(leaf.chunk, leaf.sharding, up)
    return self._device_fns_of(leaf)["write"](weight, new, starts)

  # -- the step ------------------------------------------------------------------------

  def step(self, state: NvmeState, batch: jax.Array, grad_step=None):
    self.check_current(state)  # (DPU after its warm-up: the first steps exact)
    if not self.delayed or int(jax.device_get(state.step)) < self.delayed_after:
      return super().step(state, batch, grad_step)
    return self._delayed_step(state, batch, grad_step)

  def save(self, checkpoints, step: int, state: NvmeState, wait: bool = False):
    """Saves the state after the update in flight (DPU), whose result the next step uses."""
    return super().save(checkpoints, step, self.current(state), wait)

  def current(self, state: NvmeState) -> NvmeState:
    self.check_current(state)
    return self.finish_update(state)

  def finish_update(self, state: NvmeState | None = None) -> NvmeState | None:
    """`state` with the delayed update in flight applied (it stays the next step's)."""
    if self._pending is None:
      return state
    params, opt_state = self._pending.result()
    return None if state is None else state._replace(params=params, opt_state=opt_state)

  def _delayed_step(self, state: NvmeState, batch, grad_step):
    """DPU: the gradient of `state`'s weights (those before the last update), while the
    last update finishes; then this step's update starts on a thread."""
    grads, loss, grad_norm = self._gradients(state, batch, None, grad_step)
    latest = self.finish_update(state)  # the weights and scalars after the last update
    finite = bool(np.isfinite(float(loss)) and np.isfinite(float(grad_norm)))
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": jnp.int32(not finite)}
    if self._lr is not None:
      metrics["lr"] = self._lr(state.step)
    if finite:  # its weights: a copy (the next step's gradient reads these), where they live
      working = latest._replace(params=self._copy_weights(latest.params))
      # The gradients go down now, ahead of the next step's program on the device's
      # queue; the update's own work on the device (the new weights) may wait behind it.
      sent = self._gradients_down(state.store, grads)
      # The update keeps only the gradients of chunks updated on the device (Twin-Flow):
      # the others are on their way down, and the device is free of them meanwhile.
      kept = [g if any(self.keeps_on_device(leaf, s) for s in leaf.starts()) else None
              for leaf, g in zip(self.leaves, jax.tree.leaves(grads))]
      del grads
      self._pending = self._thread.submit(self._update, working, kept, grad_norm, None, sent)
    else:
      self._pending = None
    return latest._replace(step=self._next_step(state.step)), metrics

  def update_order(self) -> list[tuple[int, nvme_store.Leaf, tuple[int, ...]]]:
    """(leaf index, leaf, chunk start) in the forward pass's order: the weights outside
    the layer stack, then layer by layer."""
    units = [(i, leaf, starts) for i, leaf in enumerate(self.leaves) for starts in leaf.starts()]
    return sorted(units, key=lambda unit: host_store.layer_of(unit[1], unit[2]))

  def _gradients_down(self, store, grads: Any) -> dict:
    """Every host chunk's gradient box, on its host device: {(leaf, starts): [per region]}."""
    grads = jax.tree.leaves(grads)
    return {(leaf.name, starts): self._gradient_down(store, leaf, starts, grads[i])
            for i, leaf, starts in self.update_order()
            if not self.keeps_on_device(leaf, starts)}

  def _gradient_down(self, store, leaf, starts, grad) -> list[jax.Array]:
    """One chunk's gradient box, cut on the device, on each region's host device."""
    return self._down(store, leaf, starts, self._cut(leaf, starts, grad))

  def _cut(self, leaf, starts, grad) -> list[jax.Array]:
    """One chunk's gradient box, cut on the device (per region), already on its way to
    the host: the copy runs while earlier chunks are brought down and updated."""
    box = self._device_fns_of(leaf)["grad_box"](grad, starts)
    shards = {s.device: s.data for s in box.addressable_shards}
    cut = [shards[region.devices[0]] for region in leaf.regions]
    for shard in cut:
      shard.copy_to_host_async()
    return cut

  @staticmethod
  def _down(store, leaf, starts, cut: list[jax.Array]) -> list[jax.Array]:
    return [jax.device_put(shard, store.device_of(leaf, region, starts))
            for region, shard in zip(leaf.regions, cut)]

  def _update(self, state: NvmeState, grads: Any, grad_norm: jax.Array, scale=None,
              sent: dict | None = None):
    """The update, chunk by chunk: (new compute copy, new optimizer scalars). `sent`: the
    gradient boxes already on the host (else each goes down as its chunk comes); `grads`
    then needs only the leaves of chunks kept on the device (a list, None elsewhere)."""
    sh, store = self.program.shardings, state.store
    params = jax.tree.leaves(jax.device_put(state.params, on_device(sh.params)))
    scalars = jax.tree.leaves(state.opt_state)
    # (DPU's: None where no chunk of the leaf is updated on the device.)
    grads = jax.tree.leaves(grads, is_leaf=lambda x: x is None)
    scale = jnp.float32(1.0) if scale is None else scale
    # Each host device's copy of the replicated values (this process's, across processes).
    local = [_local(x) for x in (*scalars, grad_norm, scale)]
    host_args = {d: (lambda v: (v[:-2], v[-2], v[-1]))(jax.device_put(local, d))
                 for d in host_store.host_devices()}
    new_scalars = None
    # The next chunks' gradient boxes are cut and on their way down while one is updated.
    ahead = iter([] if sent is not None else [
        u for u in self.update_order() if not self.keeps_on_device(u[1], u[2])])
    cut = {}

    def cut_next():
      for i, leaf, starts in itertools.islice(ahead, 1):
        cut[leaf.name, starts] = self._cut(leaf, starts, grads[i])

    for _ in range(GRADIENTS_AHEAD):
      cut_next()
    uploads = self._uploads(params)
    for i, leaf, starts in self.update_order():
      if self.keeps_on_device(leaf, starts):
        params[i], chunk, out = self._unit(leaf)(params[i], grads[i],
                                                 store.take_device_chunk(leaf, starts), starts,
                                                 scalars, grad_norm, scale)
        store.put_device_chunk(leaf, starts, chunk)
      else:
        down = (sent.pop((leaf.name, starts)) if sent is not None
                else self._down(store, leaf, starts, cut.pop((leaf.name, starts))))
        cut_next()
        boxes, out = self._host_update(store, leaf, starts, down, host_args)
        uploads.add(i, starts, boxes)
      new_scalars = new_scalars or out
    uploads.flush()
    params = jax.device_put(jax.tree.unflatten(jax.tree.structure(state.params), params),
                            sh.params)
    scalar_sh = jax.tree.leaves(self._scalar_sh)
    new_scalars = [_replicated(x, s) for x, s in zip(new_scalars, scalar_sh)]
    return params, self._scalar_def.unflatten(new_scalars)

  def _host_update(self, store, leaf, starts, down: list, host_args: dict):
    """One chunk on the host, dispatched, from its gradient boxes there (`down`, per
    region): the update in the chunk's buffers; (its new compute-dtype boxes, per region,
    on the host; the new scalars)."""
    boxes, out = [], None
    for region, g in zip(leaf.regions, down):
      host = store.device_of(leaf, region, starts)
      chunk, new_box, out = self.host_unit(leaf)(g, store.take(leaf, region, starts),
                                                 *host_args[host])
      store.write(leaf, region, starts, chunk)
      boxes.append(new_box)
    return boxes, out

  def host_unit(self, leaf: nvme_store.Leaf):
    """Jitted on the host: (gradient box, the chunk's K copies (donated), scalars, norm,
    scale) -> (its K new copies, the new compute-dtype box, new scalars)."""
    if leaf.name not in self._host_units:
      cfg, inner = self.cfg, self._inner
      compute = engine_lib.dtype_of(cfg.precision.compute)

      def unit(grad_box, copies, scalars, grad_norm, scale):
        # Stacked and taken apart again: XLA fuses it all into one pass per copy.
        new_chunk, new_scalars = nvme_chunks.update_chunk(
            cfg, inner, leaf.name, grad_box, jnp.stack(copies), scalars, grad_norm, scale)
        return tuple(new_chunk), new_chunk[0].astype(compute), new_scalars

      self._host_units[leaf.name] = jax.jit(unit, donate_argnums=1)
    return self._host_units[leaf.name]

  def _device_fns_of(self, leaf: nvme_store.Leaf) -> dict:
    """On the device: `grad_box` (the gradient's box at a chunk start, in the optimizer's
    layout) and `write` (a new compute-dtype box into its weight, which it donates)."""
    if leaf.name not in self._device_fns:
      i = [l.name for l in self.leaves].index(leaf.name)
      params_sh = jax.tree.leaves(on_device(self.program.shardings.params))[i]
      replicated = self.program.layout.replicated()

      def write(weight, box, starts):
        if not leaf.cut:
          return box.astype(weight.dtype)
        bits = nvme_chunks.bits
        return nvme_chunks.as_dtype(weight.dtype, jax.lax.dynamic_update_slice(
            bits(weight), bits(box.astype(weight.dtype)), nvme_chunks.corner(leaf, starts)))

      self._device_fns[leaf.name] = {
          "grad_box": jax.jit(lambda g, starts: nvme_chunks.box_of(leaf, g, starts),
                              out_shardings=leaf.sharding),
          "write": jax.jit(write, donate_argnums=0 if leaf.cut else (),
                           in_shardings=(params_sh, leaf.sharding, replicated),
                           out_shardings=params_sh)}
    return self._device_fns[leaf.name]


class _Uploads:
  """Boxes on the host sent up (`write(leaf index, start, boxes)`) only once `behind` later
  ones are dispatched: taking a host array to the device waits for it, so sending each at
  once would have the host's devices compute one chunk at a time; this way they compute
  `behind` at once while the uploads run."""

  def __init__(self, write: Callable, behind: int):
    self._write, self._behind = write, behind
    self._pending: collections.deque = collections.deque()  # oldest first

  def add(self, i: int, starts, boxes: list) -> None:
    self._pending.append((i, starts, boxes))
    while len(self._pending) > self._behind:
      self._write(*self._pending.popleft())

  def flush(self) -> None:
    while self._pending:
      self._write(*self._pending.popleft())


def _local(x) -> jax.Array:
  """A replicated value as this process holds it (one of its own devices' copies)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x.addressable_data(0)
  return x


def _replicated(x, sharding) -> jax.Array:
  """`x` (one device's value, on the device or the host) as a global array replicated by
  `sharding` over this process's devices (every process gives the same value)."""
  if x.devices() <= set(sharding.device_set) and x.sharding == sharding:
    return x
  local = [d for d in sharding.device_set if d.process_index == jax.process_index()]
  value = np.asarray(x)
  return jax.make_array_from_single_device_arrays(
      value.shape, sharding, [jax.device_put(value, d) for d in local])
