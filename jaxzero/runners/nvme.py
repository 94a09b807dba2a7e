"""The NVMe runner, ZeRO-Infinity's NVMe tier (``offload.optimizer=nvme``): the
optimizer's state on local disk, streamed through memory one chunk at a time.

Memory holds the compute copy of the weights, one step's gradients and a few chunks; the fp32
master weights and the optimizer's per-weight leaves live in jaxzero.offload.nvme_store. A step
is ``TrainProgram.grad_step``, then, unless the loss or the norm is not finite, the in-memory path's
optax math chunk by chunk (read ahead and written behind asynchronously), writing the new
compute-dtype weights in place. A run never reads its store after a restart: it is rebuilt
from the last checkpoint, so a run with the tier resumes in memory and the other way round.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import socket
import time
import uuid
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero import engine as engine_lib
from jaxzero.checkpoint import integrity
from jaxzero.engine import TrainState, loss_scale
from jaxzero.errors import UserError
from jaxzero.offload import nvme_checkpoint, nvme_chunks, nvme_store, targets
from jaxzero.parallel.zero import bytes_per_device, on_device
from jaxzero.runners import base

log = logging.getLogger(__name__)

INIT_BATCH_BYTES = 256 << 20  # random weights drawn at a time (of each copy), at least one weight


class NvmeState(NamedTuple):
  """The train state of an NVMe run: TrainState's fields, the weights' copies on disk."""
  step: jax.Array
  params: Any
  master: Any  # None at every leaf: the master weights are in `store`
  opt_state: Any  # the optimizer's scalars (step counts); None at its per-weight leaves
  loss_scale: Any  # as TrainState's (float16 only)
  store: nvme_store.Store  # a static pytree node: no leaves

  def in_memory(self) -> TrainState:
    """What memory holds, as a TrainState with None where the store holds the leaf."""
    return TrainState(self.step, self.params, self.master, self.opt_state, self.loss_scale)

  @property
  def frozen(self) -> None:
    """None: a model with frozen weights keeps its optimizer state on the device."""
    return None


def store_directory(nvme_dir: str, workdir) -> pathlib.Path:
  """This process's store: one directory per run (by workdir) and process; without a
  workdir (a jaxzero.Engine's), one per runner, so that two engines never share one (and
  the stores of this host's engines whose process is gone are deleted)."""
  root = pathlib.Path(nvme_dir).expanduser().absolute()
  if workdir is None:
    nvme_store.remove_dead_engine_stores(root)
    run = f"{nvme_store.ENGINE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  else:
    run = hashlib.sha1(str(pathlib.Path(workdir).absolute()).encode()).hexdigest()[:12]
  return root / f"jaxzero-{run}" / f"process_{jax.process_index()}"


def nvme_bytes(program: engine_lib.TrainProgram) -> int:
  """Per-device bytes in the NVMe store's files: the fp32 master weights and the
  optimizer's per-weight leaves (a process stores a replicated shard once)."""
  abstract, sh = program.abstract, program.shardings
  per_weight = lambda tree: optax.tree_map_params(program.tx, lambda x: x, tree,
                                                  transform_non_params=lambda _: None)
  return (bytes_per_device(abstract.master, sh.master)
          + bytes_per_device(per_weight(abstract.opt_state), per_weight(sh.opt_state)))


class NvmeRunner:
  """The NVMe tier of one run: its store, initialisation and streamed update.

  Built from the run's Engine (nothing is allocated, nothing is written); the
  store is made by :meth:`init` or by a restore (jaxzero.checkpoint.checkpointer).
  """

  def __init__(self, program: engine_lib.TrainProgram, directory: pathlib.Path):
    self.program, self.cfg, self.directory = program, program.cfg, directory
    sh, abstract = program.shardings, program.abstract
    self._inner = program.inner
    copies = nvme_chunks.weight_copies(program.tx, abstract.opt_state, abstract.master)
    flat, self._master_def = jax.tree_util.tree_flatten_with_path(abstract.master)
    master_sh = jax.tree.leaves(on_device(sh.master))
    true_shapes = [tuple(t.shape) for t in jax.tree.leaves(program.true_abstract.master)]
    layers = program.model.layers_key
    stacked = lambda name: bool(layers) and name.startswith(layers + "/")
    self.leaves = [
        nvme_store.plan_leaf(integrity.leaf_name(path), tuple(a.shape),
                             copies[integrity.leaf_name(path)], s,
                             stacked=stacked(integrity.leaf_name(path)),
                             chunk_bytes=self.chunk_bytes, true_shape=true)
        for (path, a), s, true in zip(flat, master_sh, true_shapes)]
    self.names = {kind for leaf in self.leaves for kind in leaf.kinds}
    # The optimizer state with None at its per-weight leaves: what memory keeps.
    keep = lambda tree: optax.tree_map_params(program.tx, lambda _: None, tree,
                                              transform_non_params=lambda v: v)
    self._scalar_sh = keep(sh.opt_state)
    self._scalar_def = jax.tree.structure(keep(abstract.opt_state))
    self._scalar_abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(
        jax.tree.leaves(keep(abstract.opt_state)), jax.tree.leaves(self._scalar_sh))]
    self._units: dict[str, Any] = {}
    replicated = program.layout.replicated()
    # The `lr` metric where the learning rate is known (not a user's optax optimizer's).
    self._lr = (None if program.schedule is None else
                jax.jit(program.schedule, out_shardings=replicated))
    self._next_step = jax.jit(lambda s: s + 1, out_shardings=sh.step)
    self._after_step = jax.jit(
        lambda scaler, loss, norm: loss_scale.after_step(scaler, loss, norm, program.cfg.precision),
        out_shardings=(sh.loss_scale, replicated))
    self.store: nvme_store.Store | None = None
    # The last step's: seconds computing gradients and updating (the update's
    # last writes may still be in flight), and bytes each way.
    self.stats: dict[str, float] = {}
    self.step_bytes = sum(leaf.local_bytes for leaf in self.leaves)  # read, and written

  holds = "the optimizer state"  # what the store holds, as bad input names it
  updated_by = "offload.optimizer=nvme"  # the setting whose update streams box by box
  device_program = "gradients"  # the update streams outside it
  chunk_bytes = nvme_store.CHUNK_BYTES  # the most bytes of a chunk (all K copies), where cut

  # -- structure ---------------------------------------------------------------------

  def bytes_needed(self) -> int:
    """Bytes this process's store takes on disk."""
    return nvme_store.bytes_needed(self.leaves)

  # -- the runner protocol (jaxzero.runners.base.Runner) -------------------------------

  def check(self) -> None:
    cfg = self.cfg
    targets.check_offload(cfg, list(self.program.layout.mesh.devices.flat))
    if self.program.schedule is None:  # the user's optimizer (the config's is AdamW)
      nvme_chunks.check_updates_by_box(
          self._inner, {leaf.name: leaf.shape for leaf in self.leaves}, self.updated_by)
    replaced = (nvme_store.directory_bytes(self.directory) if self.directory.exists() else 0)
    targets.check_nvme_room(cfg, self.bytes_needed(), self.holds, replaced)

  def lower(self, state_shapes, batch_shapes):
    """The gradient step (the update streams outside it)."""
    scale = None if state_shapes.loss_scale is None else state_shapes.loss_scale.scale
    return self.program.grad_step.lower(state_shapes.params, batch_shapes, scale)

  def save(self, checkpoints, step: int, state, wait: bool = False) -> pathlib.Path:
    self.check_current(state)
    # the store's files: the nvme item
    return checkpoints.save(step, state, wait=wait, true_shapes=base.padded_leaves(self.program))

  def restore(self, checkpoints, step: int, target) -> NvmeState:
    return checkpoints.restore(step, target, into=self, optional=base.OPTIONAL_LEAVES,
                               true_shapes=base.padded_leaves(self.program))

  def current(self, state: NvmeState) -> NvmeState:
    return state

  def compute_copy(self, state: NvmeState) -> Any:
    return self._compute_copy(state.store)

  def plan(self) -> dict[str, int]:
    """The program's bytes, the store's per device (a process stores a replicated
    shard once), read from disk and written back each step."""
    planned = self.program.state_bytes()
    planned["nvme"] = nvme_bytes(self.program)
    planned["transfer"] += 2 * planned["nvme"]
    return planned

  def open_store(self) -> nvme_store.Store:
    """An empty store (a killed run's is deleted first)."""
    if self.store is not None:
      self.store.close()
    self.store = nvme_store.Store(self.directory, self.leaves)
    log.info("NVMe tier: %.1f GB of optimizer state in %s",
             nvme_store.bytes_needed(self.leaves) / 1e9, self.directory)
    return self.store

  def fill(self, recorded: dict, saved, open_saved) -> tuple[list[str], list[str]]:
    """A new store filled from a checkpoint being restored: from its ``nvme``
    item `saved`, else from its `state` arrays (opened by leaf name); returns
    the leaves whose checksums differ from `recorded`, and those not finite
    (jaxzero.checkpoint.external_leaves.SideTarget)."""
    return nvme_checkpoint.fill(self.open_store(), recorded, saved, open_saved)

  def state(self, restored: TrainState) -> NvmeState:
    """The NVMe state of a TrainState restored with None at the leaves the store
    holds (`names`), once the store is filled."""
    if restored.frozen is not None:  # (refused earlier, by jaxzero.config.loading)
      raise ValueError("the NVMe runner keeps no frozen weights (LoRA)")
    return NvmeState(*restored[:-1], self.store)

  def close(self) -> None:
    """Deletes the store's files (a checkpoint holds the state)."""
    if self.store is not None:
      self.store.close()
      self.store = None

  def abstract_scalars(self) -> list[jax.ShapeDtypeStruct]:
    return list(self._scalar_abstract)  # the optimizer's scalars (memory keeps them), as shapes

  # -- step 0 --------------------------------------------------------------------------

  def init(self, master: Any = None, key: jax.Array | None = None, frozen: Any = None,
           boxes=None) -> NvmeState:
    """Step 0 as TrainProgram.init makes it (same random weights from `key`, default
    cfg.seed's, or `master` placed by ``shardings.master``), its weights' copies written
    to disk.

    `boxes(name, box) -> float32 array`, where given, draws the master weights a chunk
    at a time instead (TrainProgram.init draws each weight whole: 4x its size in memory)."""
    if frozen is not None or self.program.model.frozen_specs is not None:
      raise ValueError("the NVMe runner keeps no frozen weights (LoRA): offload must be device")
    sh = self.program.shardings
    started = time.perf_counter()
    store = self.open_store()
    master_sh = jax.tree.leaves(on_device(sh.master))
    random = master is None
    if boxes is not None:
      for leaf in self.leaves:
        for region in leaf.regions:
          for starts in leaf.starts():
            w = np.asarray(boxes(leaf.name, leaf.chunk_box(region, starts)), np.float32)
            store.write(leaf, region, starts, self._first_copies(leaf, w))
      batches = []
    elif random:
      batches = self._init_batches()
    else:
      weights = jax.tree.leaves(jax.device_put(master, on_device(sh.master)))
      del master
      batches = [[i] for i in range(len(self.leaves))]
    for batch in batches:
      if random:  # drawn a batch of weights at a time
        weights = dict(zip(batch, self._random_weights(batch, [master_sh[i] for i in batch], key)))
      for i in batch:  # each fp32 weight dropped once written
        self._write_first(store, self.leaves[i], weights[i])
        weights[i] = None
    written = time.perf_counter()
    log.info("step 0 of the store (%s) written in %.1f s",
             self.holds, written - started)
    # The compute copy is read back, so that it never sits beside a weight
    # being drawn (whose random bits take three times its size).
    params = self._compute_copy(store)
    log.info("the compute copy read back in %.1f s", time.perf_counter() - written)
    # The optimizer's scalars do not depend on the weights' shapes: initialised
    # over one-element stand-ins.
    stand_ins = jax.tree.map(lambda _: jnp.zeros((1,), jnp.float32), self.program.abstract.master)
    full = jax.jit(self.program.tx.init)(stand_ins)
    flags = nvme_chunks.weight_flags(self.program.tx, full)
    scalars = [x for x, is_weight in zip(jax.tree.leaves(full), flags) if not is_weight]
    opt_state = jax.device_put(self._scalar_def.unflatten(scalars), self._scalar_sh)
    step = jax.device_put(jnp.zeros((), jnp.int32), sh.step)
    scaler = jax.device_put(loss_scale.init(self.cfg.precision), sh.loss_scale)
    store.writes.wait()
    return NvmeState(step, params, jax.tree.map(lambda _: None, self.program.abstract.master),
                     opt_state, scaler, store)

  def _init_batches(self) -> list[list[int]]:
    """Weights drawn together, largest first, each batch at most the largest
    weight or INIT_BATCH_BYTES (of this process's shards)."""
    order = sorted(range(len(self.leaves)), key=lambda i: -self.leaves[i].local_bytes)
    budget = max(self.leaves[order[0]].local_bytes, INIT_BATCH_BYTES * len(self.leaves[0].kinds))
    batches, size = [[]], 0
    for i in order:
      if batches[-1] and size + self.leaves[i].local_bytes > budget:
        batches.append([])
        size = 0
      batches[-1].append(i)
      size += self.leaves[i].local_bytes
    return batches

  def _random_weights(self, batch: list[int], shardings: list, key=None) -> list[jax.Array]:
    """Weights `batch` of TrainProgram.init's random master weights (the same values:
    the model is built whole and XLA computes only what is returned)."""
    cfg = self.cfg

    def draw():
      weights = jax.tree.leaves(self.program.model.init(
          jax.random.key(cfg.seed) if key is None else key))
      return [weights[i] for i in batch]

    return jax.jit(draw, out_shardings=shardings)()

  def _write_first(self, store, leaf: nvme_store.Leaf, weight: jax.Array) -> None:
    """Writes step 0's chunks of one weight."""
    shards = {s.device: s.data for s in weight.addressable_shards}
    for region in leaf.regions:
      data = np.asarray(shards[region.devices[0]])
      for starts in leaf.starts():
        box = leaf.chunk_box(region, starts)
        w = data[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region.box))]
        store.write(leaf, region, starts, self._first_copies(leaf, w))

  def _compute_copy(self, store) -> Any:
    """The compute-dtype weights, cast on the host from the master weights in
    `store` (numpy's bf16 rounding is XLA's: round to nearest even)."""
    store.writes.wait()
    compute = engine_lib.dtype_of(self.cfg.precision.compute)
    params = []
    for leaf, params_sh in zip(self.leaves, jax.tree.leaves(self.program.shardings.params)):
      arrays = []
      for region in leaf.regions:
        weight = np.empty([b - a for a, b in region.box], compute)
        for starts in leaf.starts():
          box = leaf.chunk_box(region, starts)
          chunk = store.read(leaf, region, starts).result()
          weight[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region.box))] = (
              chunk[0].astype(compute))
        arrays += [jax.device_put(weight, d) for d in region.devices]
      weight = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)
      params.append(jax.device_put(weight, params_sh))
    return jax.tree.unflatten(self._master_def, params)

  def _first_copies(self, leaf: nvme_store.Leaf, w: np.ndarray) -> np.ndarray:
    """A chunk [K, ...] of step 0: a box of the master weight, and the optimizer's
    initial per-weight leaves for it (Adam's zeros)."""
    state = self._inner.init(nvme_chunks.nest(leaf.name, w))
    flags = nvme_chunks.weight_flags(self._inner, state)
    copies = [x for x, is_weight in zip(jax.tree.leaves(state), flags) if is_weight]
    return np.stack([w, *map(np.asarray, copies)]).astype(np.float32)

  @staticmethod
  def _write_chunk(store, leaf: nvme_store.Leaf, starts, chunk: jax.Array) -> None:
    shards = {s.device: s.data for s in chunk.addressable_shards}
    for region in leaf.regions:
      store.write(leaf, region, starts, np.asarray(shards[region.devices[0]]))

  # -- the step ------------------------------------------------------------------------

  def compile(self, state: NvmeState, batch: jax.Array):
    """The step as the training loop runs it: (state, tokens [A, B, T+1]) -> (state,
    metrics), with the gradient step compiled now (the updates on first use)."""
    scale = None if state.loss_scale is None else state.loss_scale.scale
    grad_step = self.program.grad_step.lower(state.params, batch, scale).compile()
    return lambda state, batch: self.step(state, batch, grad_step)

  def check_current(self, state: NvmeState) -> None:
    """Refuses a state whose store this runner has since replaced (a later init or
    restore): its weights' copies are gone, and the new store's are another state's."""
    if state.store is not self.store:
      raise UserError("this state's optimizer state was in files a later init or restore of "
                      f"the same engine replaced ({self.holds} of one state at a time "
                      "lives there): step or save the latest state, or use another engine")

  def step(self, state: NvmeState, batch: jax.Array, grad_step=None):
    """One optimizer step; `state` is consumed (its compute copy is updated in place)."""
    self.check_current(state)
    start = time.perf_counter()
    scaler = state.loss_scale
    scale = None if scaler is None else scaler.scale  # float16: the loss scale
    grads, loss, grad_norm = self._gradients(state, batch, scale, grad_step)
    finite = bool(np.isfinite(float(loss)) and np.isfinite(float(grad_norm)))
    self.stats = {"grad_s": time.perf_counter() - start, "update_s": 0.0}
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": jnp.int32(not finite)}
    if self._lr is not None:
      metrics["lr"] = self._lr(loss_scale.applied_updates(state.step, scaler))
    if scaler is not None:
      scaler, scale_metrics = self._after_step(scaler, loss, grad_norm)
      metrics.update(scale_metrics)
    params, opt_state = state.params, state.opt_state
    if finite:  # a non-finite step never reaches the state (jaxzero.engine.step), here nor on disk
      start = time.perf_counter()
      params, opt_state = self._update(state, grads, grad_norm, scale)
      self.stats["update_s"] = time.perf_counter() - start  # its last writes may be in flight
    del grads
    return NvmeState(self._next_step(state.step), params, state.master, opt_state, scaler,
                     state.store), metrics

  def _gradients(self, state: NvmeState, batch: jax.Array, scale, grad_step=None):
    """(gradient sum, loss, gradient norm) of a step, from the whole-program gradient step."""
    return (grad_step or self.program.grad_step)(state.params, batch, scale)

  def _update(self, state: NvmeState, grads: Any, grad_norm: jax.Array, scale=None):
    """The streamed optimizer update: (new compute copy, new optimizer scalars)."""
    store, sh = state.store, self.program.shardings
    store.writes.wait()  # the last step's writes, before their chunks are read again
    params = jax.tree.leaves(jax.device_put(state.params, on_device(sh.params)))
    grads = jax.tree.leaves(grads)
    scalars = jax.tree.leaves(state.opt_state)
    new_scalars, written = None, None
    index = {leaf.name: i for i, leaf in enumerate(self.leaves)}
    units = [(leaf, starts) for leaf in self.leaves for starts in leaf.starts()]

    def read(unit):
      leaf, starts = unit
      return nvme_chunks.All([store.read(leaf, region, starts) for region in leaf.regions])

    for (leaf, starts), chunks in nvme_store.prefetched(units, read):
      i = index[leaf.name]
      params[i], new_chunk, out_scalars = self._unit(leaf)(
          params[i], grads[i], self._global_chunk(leaf, chunks), starts, scalars, grad_norm,
          jnp.float32(1.0) if scale is None else scale)
      new_scalars = new_scalars or out_scalars
      if written is not None:  # the previous chunk's, while this one computes
        self._write_chunk(store, *written)
      written = (leaf, starts, new_chunk)
    self._write_chunk(store, *written)
    params = jax.device_put(jax.tree.unflatten(jax.tree.structure(state.params), params),
                            sh.params)
    return params, self._scalar_def.unflatten(new_scalars)

  @staticmethod
  def _global_chunk(leaf: nvme_store.Leaf, chunks: list[np.ndarray]) -> jax.Array:
    """One global array [K, ...] of a chunk's boxes, each on the devices holding it."""
    arrays = [jax.device_put(data, d) for region, data in zip(leaf.regions, chunks)
              for d in region.devices]
    shape = (len(leaf.kinds), *leaf.chunk)
    return jax.make_array_from_single_device_arrays(shape, leaf.chunk_sharding, arrays)

  def _unit(self, leaf: nvme_store.Leaf):
    """Jitted (compute weight, gradient sum, chunk, start, scalars, norm) ->
    (compute weight, new chunk, new scalars) for one chunk of `leaf`."""
    if leaf.name in self._units:
      return self._units[leaf.name]
    sh, inner = self.program.shardings, self._inner
    compute = engine_lib.dtype_of(self.cfg.precision.compute)
    i = [l.name for l in self.leaves].index(leaf.name)
    params_sh = jax.tree.leaves(on_device(sh.params))[i]
    replicated = self.program.layout.replicated()
    scalar_sh = jax.tree.leaves(self._scalar_sh)

    def unit(weight, grad_sum, chunk, starts, scalars, grad_norm, scale):
      new_chunk, new_scalars = nvme_chunks.update_chunk(
          self.cfg, inner, leaf.name, nvme_chunks.box_of(leaf, grad_sum, starts), chunk, scalars,
          grad_norm, scale)
      new_weight = new_chunk[0].astype(compute)
      if leaf.cut:  # in place (the weight is donated)
        bits = nvme_chunks.bits
        new_weight = nvme_chunks.as_dtype(weight.dtype, jax.lax.dynamic_update_slice(
            bits(weight), bits(new_weight), nvme_chunks.corner(leaf, starts)))
      return new_weight, new_chunk, new_scalars

    fn = jax.jit(unit, donate_argnums=0 if leaf.cut else (),
                 in_shardings=(params_sh, jax.tree.leaves(on_device(sh.master))[i],
                               leaf.chunk_sharding, replicated, scalar_sh, replicated,
                               replicated),
                 out_shardings=(params_sh, leaf.chunk_sharding, scalar_sh))
    self._units[leaf.name] = fn
    return fn
