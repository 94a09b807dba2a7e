"""ZeRO for any JAX model: ``jaxzero.Engine(model, optimizer=..., loss_fn=..., zero=...)``.

The library face of the engine the trainer uses (jaxzero.engine.Engine over a
jaxzero.models.interface.Model): the state is born sharded, the user's optax
optimizer runs on fp32 master weights in the stage's layout, gradients are
accumulated over `grad_accum` micro-batches and clipped by their global norm,
and checkpoints restore onto any mesh and stage.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Literal

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import config as config_lib
from jaxzero import engine as engine_lib
from jaxzero.api import adapters
from jaxzero.checkpoint import checkpointer
from jaxzero.errors import ConfigError
from jaxzero.offload import nvme_checkpoint, nvme_tier
from jaxzero.planning import planner, state_bytes
from jaxzero.sharding import mesh as mesh_lib
from jaxzero.sharding import rules as rules_lib
from jaxzero.sharding.zero import Layout


@dataclasses.dataclass(frozen=True)
class Zero:
  """A ZeRO stage (0 = DDP, 1 = optimizer state sharded, 2 = + gradients, 3 = + weights);
  `hybrid` shards over the mesh's ``fsdp`` axis only (HYBRID_SHARD)."""
  stage: Literal[0, 1, 2, 3] = 3
  hybrid: bool = False
  grad_dtype: str = "float32"
  reduce_dtype: str = ""


@dataclasses.dataclass(frozen=True)
class Remat:
  """Activation checkpointing: a policy (jaxzero.engine.remat), applied to every call
  of `block`, an NNX module class (FSDP's transformer_layer_cls)."""
  policy: str = "full"
  block: type | None = None


@dataclasses.dataclass(frozen=True)
class Offload:
  """Where the optimizer state lives: ``device``, ``pinned_host`` (ZeRO-Offload) or
  ``nvme`` (files in `nvme_dir`)."""
  optimizer: Literal["device", "pinned_host", "nvme"] = "pinned_host"
  nvme_dir: str = ""


def mesh(fsdp: int = -1, replica: int = 1, tensor: int = 1, devices=None):
  """A (replica, fsdp, tensor) device mesh; -1 takes the devices the others leave."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_lib.resolve_shape(config_lib.MeshConfig(replica, fsdp, tensor), len(devices))
  return mesh_lib.make_mesh(*shape[:2], devices, shape[2])


class Engine:
  """A model trained with ZeRO on a device mesh.

  Args:
    model: a Flax NNX module or a function returning one (taking `rngs`, or
      nothing), a Linen module (with `init_args`), or an (init_fn, apply_fn) pair.
    optimizer: an optax optimizer; it runs on the fp32 master weights.
    loss_fn: (model, batch) -> scalar mean loss, `model` bound to the parameters.
    zero, mesh, precision, remat, offload: where the state lives and how.
    grad_accum: micro-batches a batch is split into; clip_norm: global-norm
      clipping (0 = off).
    rules: the model's dimension names -> jaxzero's (jaxzero.sharding.rules);
      min_shard_size: parameters with fewer elements stay whole.
  """

  def __init__(self, model: Any, *, optimizer: optax.GradientTransformation,
               loss_fn: Callable, zero: Zero = Zero(), mesh=None,
               precision: str = "float32", remat: str | Remat = "none",
               offload: str | Offload | None = None, grad_accum: int = 1,
               clip_norm: float = 0.0, rules: dict | None = None,
               min_shard_size: int = rules_lib.DEFAULT_MIN_SIZE, init_args: tuple = (),
               seed: int = 0):
    mesh = mesh if mesh is not None else globals()["mesh"]()
    remat = remat if isinstance(remat, Remat) else Remat(remat)
    offload = Offload(offload) if isinstance(offload, str) else offload or Offload("device")
    base = config_lib.base()
    # Under a block, the block's policy wraps the block; the engine's own hook is unused.
    cfg = dataclasses.replace(
        base, seed=seed,
        zero=config_lib.ZeroConfig(stage=zero.stage, hybrid=zero.hybrid,
                                   grad_dtype=zero.grad_dtype, reduce_dtype=zero.reduce_dtype),
        precision=config_lib.PrecisionConfig(compute=precision),
        remat=config_lib.RematConfig("none" if remat.block else remat.policy),
        offload=config_lib.OffloadConfig(optimizer=offload.optimizer, nvme_dir=offload.nvme_dir),
        train=dataclasses.replace(base.train, grad_accum=grad_accum, clip_norm=clip_norm))
    config_lib.check_literals(cfg)
    self.cfg, self.mesh = cfg, mesh
    self.layout = Layout.from_config(cfg, mesh)
    self.model = adapters.build(model, loss_fn, shard_size=self.layout.shard_size,
                                init_args=init_args, rules=rules, min_size=min_shard_size,
                                remat_block=remat.block, remat_policy=remat.policy)
    self.core = engine_lib.Engine(cfg, self.layout, self.model, optimizer=optimizer)
    self.tier = None
    if offload.optimizer == "nvme":
      if not offload.nvme_dir:
        raise ConfigError("Offload('nvme') needs nvme_dir, a directory on local disk")
      self.tier = nvme_tier.Tier(self.core, nvme_tier.store_directory(offload.nvme_dir, None))

  @property
  def shardings(self):
    """Where each leaf of the train state lives (a TrainState of NamedShardings)."""
    return self.core.shardings

  def init(self, rng: jax.Array | None = None):
    """Step 0, drawn straight into its shards (`rng`: a jax.random key)."""
    return self.tier.init() if self.tier else self.core.init(key=rng)

  def _micro_batches(self, batch: Any) -> Any:
    """`batch` (leading axis: rows) as [grad_accum, rows / grad_accum, ...], placed."""
    a = self.cfg.train.grad_accum

    def split(x):
      if x.shape[0] % (a * self.layout.data_parallel_size):
        raise ConfigError(f"a batch of {x.shape[0]} rows does not split into grad_accum={a} "
                          f"micro-batches over {self.layout.data_parallel_size} devices")
      x = x.reshape(a, x.shape[0] // a, *x.shape[1:])
      return jax.device_put(x, NamedSharding(self.mesh, P(None, mesh_lib.AXES)))

    return jax.tree.map(split, batch)

  def step(self, state, batch) -> tuple[Any, dict]:
    """One optimizer step on `batch` (any pytree whose leading axis is the batch)."""
    batch = self._micro_batches(batch)
    return self.tier.step(state, batch) if self.tier else self.core.train_step(state, batch)

  def save(self, state, path: str | pathlib.Path) -> pathlib.Path:
    """Saves `state` under `path` (orbax, sharded; checksummed); returns its directory."""
    with self._checkpointer(path) as saver:
      return saver.save(int(state.step), state, wait=True)

  def restore(self, path: str | pathlib.Path, step: int | None = None):
    """The latest (or `step`'s) state saved under `path`, read into this engine's layout."""
    with self._checkpointer(path) as reader:
      step = reader.latest_step() if step is None else step
      if step is None:
        raise ConfigError(f"no checkpoint under {path}")
      return reader.restore(step, self.core.abstract_state(), into=self.tier,
                            optional=("loss_scale",))

  def _checkpointer(self, path) -> checkpointer.Checkpointer:
    n_params = sum(leaf.size for leaf in jax.tree.leaves(self.core.abstract.master))
    info = {"model": {"parameters": n_params}, "compute_dtype": self.cfg.precision.compute,
            "seed": self.cfg.seed}
    (pathlib.Path(path) / "checkpoints").mkdir(parents=True, exist_ok=True)
    return checkpointer.Checkpointer(path, 3, info, side=nvme_checkpoint.SIDE_ITEM)

  def plan(self, batch: Any = None) -> dict[str, int]:
    """Per-device bytes: the state by role (from its shardings), the ZeRO paper's
    figure, and with an example `batch` XLA's own total for the compiled step."""
    got = state_bytes.state_bytes(self.core)
    n_params = sum(leaf.size for leaf in jax.tree.leaves(self.core.abstract.master))
    theory, formula = state_bytes.theory_state_bytes(self.cfg, self.layout, n_params)
    plan = {"params_bytes": got["params"], "grads_bytes": got["grads"],
            "optimizer_bytes": got["optimizer"], "host_bytes": got["host"],
            "state_bytes": got["params"] + got["grads"] + got["optimizer"],
            "theory_state_bytes": theory, "theory_formula": formula, "n_params": n_params}
    if batch is not None:
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self._micro_batches(batch))
      compiled = self.core.train_step.lower(self.core.abstract_state(), shapes).compile()
      plan["total_bytes"] = planner.xla_total_bytes(compiled.memory_analysis())
    return plan
