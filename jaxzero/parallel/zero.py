"""ZeRO stages as sharding layouts. The only module that decides where state lives.

A stage is data, not control flow: for each role a train-state leaf can play (the compute copy
of the weights at rest, the gradients, the optimizer state with its fp32 master weights) the
table below says whether that role is sharded across the data-parallel devices. XLA inserts
the collectives:

  stage  params  grads  optimizer   FSDP name        per-device model state
  0      -       -      -           NO_SHARD (DDP)   2Φ + 2Φ + 12Φ
  1      -       -      sharded     -                2Φ + 2Φ + 12Φ/N
  2      -       sharded sharded    SHARD_GRAD_OP    2Φ + 14Φ/N
  3      sharded sharded sharded    FULL_SHARD       16Φ/N

Frozen weights (``frozen``: a LoRA base) are sharded like stage 3's compute copy at
every stage, and rest in its memory (pinned_host with offload.params).

Hybrid (HYBRID_SHARD, HYBRID_SHARD_ZERO2) shards over ``fsdp`` only and replicates over
``replica``; the batch is always split over both. The ``tensor`` axis adds Megatron's splits
(``TENSOR_DIMS``) on top of every stage, and ``pipeline`` splits the stacked ``layers``
dimension into pipeline stages in every role. Inside a layer the weights use the *compute* layout
and their gradients leave in the *reduce* layout (the engine's hooks apply both:
jaxzero.engine.hooks).
:meth:`Layout.from_config` reads the ``zero`` and ``offload`` sections, and is the only way
the rest of jaxzero builds a Layout.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.errors import ConfigError
from jaxzero.parallel.mesh import AXES, CONTEXT, PIPELINE, TENSOR, divisors

log = logging.getLogger(__name__)

SHARDED_ROLES: dict[int, frozenset[str]] = {
    0: frozenset(),
    1: frozenset({"optimizer"}),
    2: frozenset({"optimizer", "grads"}),
    3: frozenset({"optimizer", "grads", "params"}),
}

# Which dimension of a weight to split across the sharding axes, best first.
# `embed` appears in every Llama weight, so in practice it is always chosen
# (Levanter's and nanodo's FSDP choice); the others are fallbacks for a leaf
# whose `embed` dimension does not divide the axis. `layers` is never split:
# the scan slices it, one layer per step.
# `flat`: a quantized weight's flattened elements (jaxzero.models.quantize).
FSDP_DIM_PREFERENCE = ("embed", "mlp", "vocab", "heads", "kv_heads", "head_dim", "flat")
# "none": a dimension never split (jaxzero.parallel.rules names it for any model).
KNOWN_LOGICAL_AXES = frozenset(FSDP_DIM_PREFERENCE) | {"layers", "none"}
# Megatron's tensor-parallel dimensions, best first: a weight or activation is
# split over `tensor` along the first it has. Only `kv_heads` may fall back
# (KV heads replicated across the tensor group); the others must divide.
TENSOR_DIMS = ("heads", "kv_heads", "mlp", "vocab")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each role of the train state lives, for one stage on one mesh."""
  mesh: Mesh
  stage: int
  hybrid: bool = False
  params_memory: str = "device"  # the compute copy at rest: device or pinned_host (stage 3)
  # The dtype gradients are reduced in across devices (FSDP's reduce_dtype).
  reduce_dtype: str = "float32"
  # With a ``context`` axis: how attention reaches the other devices' keys and values
  # ("all_gather" or "ring"), and whether the sequence is laid out load balanced
  # (jaxzero.engine.context).
  context_strategy: str = "all_gather"
  context_balance: bool = True

  def __post_init__(self):
    if self.stage not in SHARDED_ROLES:
      raise ValueError(f"ZeRO stage {self.stage} does not exist; valid stages: 0, 1, 2, 3")

  @classmethod
  def from_config(cls, cfg, mesh: Mesh) -> "Layout":
    """The layout a config's ``zero`` and ``offload`` sections ask for on `mesh`."""
    stage, hybrid = cfg.zero.resolved
    if hybrid and mesh.shape["replica"] == 1:
      log.warning("hybrid sharding with mesh.replica=1 is plain stage %d", stage)
    tensor = mesh.shape.get(TENSOR, 1)
    if cfg.model.n_kv_heads % tensor:
      log.info("replicating the %d KV heads across each tensor group of %d (mesh.tensor does "
               "not divide them), as Megatron does", cfg.model.n_kv_heads, tensor)
    # An offloaded optimizer state is its runner's (jaxzero.runners: in host memory or in
    # files), outside the jitted step: what of it the step sees (step counts, chunks being
    # updated) is on the device. Likewise the parameter tier (offload.params=nvme): a
    # layer's weights are on the device while its program runs.
    params = "device" if cfg.offload.params == "nvme" else cfg.offload.params
    return cls(mesh, stage, hybrid, params_memory=params,
               reduce_dtype=cfg.zero.reduce_dtype or cfg.zero.grad_dtype,
               context_strategy=cfg.context.strategy,
               context_balance=cfg.context.load_balance)

  @property
  def shard_axes(self) -> tuple[str, ...]:
    """The axes ZeRO shards the state over: the data axes (``fsdp`` alone when hybrid)
    and ``context``, whose devices would otherwise hold the same state (as torchtitan
    shards over dp_shard x cp)."""
    data = ("fsdp",) if self.hybrid else AXES
    return (*data, CONTEXT) if CONTEXT in self.mesh.shape else data

  @property
  def context_size(self) -> int:
    """Devices the sequence of every activation is split over."""
    return self.mesh.shape.get(CONTEXT, 1)

  @property
  def pipeline_size(self) -> int:
    """Pipeline stages: each device of the ``pipeline`` axis holds its stage's layers."""
    return self.mesh.shape.get(PIPELINE, 1)

  @property
  def shard_size(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.shard_axes)

  @property
  def tensor_size(self) -> int:
    return self.mesh.shape.get(TENSOR, 1)

  @property
  def data_parallel_size(self) -> int:
    return math.prod(self.mesh.shape[a] for a in AXES)

  def is_sharded(self, role: str) -> bool:
    # Frozen weights (a LoRA base: never updated, so never gathered for an update)
    # are placed as stage 3 places the compute copy, whatever the stage.
    return role == "frozen" or role in SHARDED_ROLES[self.stage]

  @property
  def reduce_role(self) -> str:
    """The role whose layout a gradient is reduced into: its own shards from
    stage 2; the optimizer's at stage 1 (ZeRO-1 reduce-scatters into the
    optimizer shards, then all-gathers the updated weights); replicated at 0."""
    return "grads" if self.is_sharded("grads") else "optimizer"

  def memory_kind(self, role: str) -> str:
    # Frozen weights (a LoRA base) rest where the compute copy does.
    return self.params_memory if role in ("params", "frozen") else "device"

  def spec(self, shape: tuple[int, ...], logical_axes: tuple[str, ...], role: str,
           name: str = "?") -> P:
    """PartitionSpec of one leaf in `role`."""
    unknown = set(logical_axes) - KNOWN_LOGICAL_AXES
    if unknown or len(logical_axes) != len(shape):
      raise ValueError(f"weight {name!r} has logical axes {logical_axes} for shape {shape}; "
                       f"each dimension needs one of {sorted(KNOWN_LOGICAL_AXES)}")
    axes: list = [None] * len(shape)
    if self.pipeline_size > 1 and "layers" in logical_axes:  # each stage its own layers
      axes[logical_axes.index("layers")] = PIPELINE
    tensor_dim = self.tensor_dim(shape, logical_axes, name)
    if tensor_dim is not None:
      axes[tensor_dim] = TENSOR
    if self.is_sharded(role):
      # A leaf that `tensor` leaves whole (norm gains, replicated KV heads) is
      # sharded over it as well: its gradient, a partial sum over the sequence
      # shards, is then reduce-scattered over the whole group.
      choices = [self.shard_axes]
      if tensor_dim is None and self.tensor_size > 1:
        choices.insert(0, (*self.shard_axes, TENSOR))
      for mesh_axes in choices:
        size = math.prod(self.mesh.shape[a] for a in mesh_axes)
        dim = shard_dim(shape, logical_axes, size, skip=tensor_dim) if size > 1 else None
        if dim is not None:
          axes[dim] = mesh_axes
          break
      else:  # (a leaf with no dimension ZeRO may split is whole by choice: rules said why)
        if self.shard_size > 1 and set(logical_axes) & set(FSDP_DIM_PREFERENCE):
          say_once(f"replicating {name} {shape} over the data axes: none of its dimensions "
                   f"{logical_axes} divides the {self.shard_size} sharding devices, and it "
                   f"is not stored padded (jaxzero.parallel.padding)")
    return P(*axes) if any(axes) else P()

  def tensor_dim(self, shape: tuple[int, ...], logical_axes: tuple[str, ...],
                 name: str = "?") -> int | None:
    """The dimension `tensor` splits (Megatron's), or None (replicated over it)."""
    t = self.tensor_size
    for axis in TENSOR_DIMS if t > 1 else ():
      if axis in logical_axes:
        i = logical_axes.index(axis)
        if shape[i] % t == 0:
          return i
        if axis == "kv_heads":
          return None  # replicated across the tensor group (logged by from_config)
        raise ConfigError(f"mesh.tensor={t} does not divide {name}'s {axis} dimension "
                          f"({shape[i]}); valid values: {', '.join(map(str, divisors(shape[i])))}")
    return None

  def sharding(self, spec: P, role: str) -> NamedSharding:
    return NamedSharding(self.mesh, spec, memory_kind=self.memory_kind(role))

  def tree_shardings(self, specs: Any, role: str) -> Any:
    """NamedShardings for a tree of leaves that carry `.shape` and `.logical_axes`."""
    def one(path, leaf):
      name = jax.tree_util.keystr(path)
      return self.sharding(self.spec(tuple(leaf.shape), leaf.logical_axes, role, name), role)
    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=_has_logical_axes)

  def replicated(self, role: str = "grads") -> NamedSharding:
    return self.sharding(P(), role)

  def batch_sharding(self, leading_dims: int = 0) -> NamedSharding:
    """Sharding of a batch [..., B, ...] of any rank (with `leading_dims` unsplit
    axes before the rows), e.g. tokens [A, B, T+1]: rows over the data axes."""
    return NamedSharding(self.mesh, P(*([None] * leading_dims), AXES))

  def activation_spec(self, shape: tuple[int, ...], logical_axes: tuple[str, ...],
                      batch_axes: tuple[str, ...] = AXES) -> P:
    """Where an activation lives: its batch over `batch_axes` (the data axes); its
    sequence over ``context``; over `tensor`, its Megatron dimension if it has one
    (e.g. q by heads, logits by vocabulary), else its sequence (the residual stream:
    sequence parallelism). ``kv_seq`` (keys and values as attention reads them) is
    never split: attention gathers it over ``context``. ``lookup_batch`` is the batch of
    an embedding lookup's result, split as ``batch`` except under context parallelism:
    there the lookup first moves its model dimension's split to the sequence alone, as
    XLA cannot move two mesh axes at once (it would replicate the whole result)."""
    c, t = self.context_size, self.tensor_size
    batch = ("batch",) if c > 1 else ("batch", "lookup_batch")
    axes: list = [(batch_axes or None) if a in batch else None for a in logical_axes]
    seq = logical_axes.index("seq") if "seq" in logical_axes else None
    if c > 1 and seq is not None and shape[seq] % c == 0:
      axes[seq] = CONTEXT
    megatron = [a for a in TENSOR_DIMS if a in logical_axes]
    split = megatron[0] if megatron else "seq"
    # (With context parallelism the residual stream is not split over `tensor` too:
    # XLA then reshards it between the layers' halves through the whole batch.)
    if t > 1 and split in logical_axes:
      i = logical_axes.index(split)
      if axes[i] is None and shape[i] % t == 0:
        axes[i] = TENSOR
    return P(*axes)


@functools.lru_cache(maxsize=None)
def say_once(line: str) -> None:
  """Logs `line` once per process (placement runs for every role, and every program)."""
  log.info("%s", line)


def on_device(shardings: Any) -> Any:
  """The same placements in device memory: where offloaded state is used."""
  return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def outside_layers_on_device(tree: dict, shardings: dict, layers_key: str | None) -> dict:
  """`tree`'s leaves outside ``tree[layers_key]`` moved to device memory (placed as
  `shardings` place them); the stacked layers left where they are, for the layer scan to
  bring each layer's shard in turn (all of `tree` moves where `layers_key` is None)."""
  return {k: v if k == layers_key else jax.device_put(v, on_device(shardings[k]))
          for k, v in tree.items()}


def weights_for_compute(layout: "Layout", tree: dict | None, shardings: dict | None,
                        layers_key: str | None) -> dict | None:
  """Trained or frozen weights (`tree`, at rest as `shardings` place them) where a step
  computes with them: in device memory, except that weights kept in pinned_host stream,
  only the leaves outside the stacked layers moving now (outside_layers_on_device)."""
  if tree is None:
    return None
  if layout.params_memory == "pinned_host":
    return outside_layers_on_device(tree, shardings, layers_key)
  return jax.device_put(tree, on_device(shardings))


def _has_logical_axes(x: Any) -> bool:
  return hasattr(x, "logical_axes")


def shard_dim(shape: tuple[int, ...], logical_axes: tuple[str, ...], size: int,
              skip: int | None = None) -> int | None:
  """Index of the dimension to split `size` ways (never `skip`), or None to replicate."""
  for name in FSDP_DIM_PREFERENCE:
    for i, axis in enumerate(logical_axes):
      if axis == name and i != skip and shape[i] % size == 0:
        return i
  return None


def bytes_per_device(abstract_tree: Any, shardings: Any) -> int:
  """Bytes one device holds for a tree of (abstract) arrays placed by `shardings`."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
    shard_shape = sharding.shard_shape(tuple(leaf.shape))
    total += math.prod(shard_shape) * jax.numpy.dtype(leaf.dtype).itemsize
  return total
