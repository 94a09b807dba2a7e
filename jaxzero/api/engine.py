"""ZeRO for any JAX model: ``jaxzero.Engine(model, optimizer=..., loss_fn=..., zero=...)``.

The library face of what the trainer runs: the user's model as a
jaxzero.models.interface.Model, its jaxzero.engine.TrainProgram, and the runner the
config's ``offload`` section chooses (jaxzero.runners.choose, as for jaxzero.train).
The state is born sharded, the user's optax optimizer runs on fp32 master weights in
the stage's layout, gradients are accumulated over `grad_accum` micro-batches and
clipped by their global norm, and checkpoints restore onto any mesh and stage.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import config as config_lib
from jaxzero import engine as engine_lib
from jaxzero.api import adapters
from jaxzero.checkpoint import checkpointer
from jaxzero.engine import remat as remat_lib
from jaxzero.engine import state_bytes
from jaxzero.errors import CheckpointError, ConfigError, UserError
from jaxzero.models.interface import is_spec
from jaxzero.parallel import mesh as mesh_lib
from jaxzero.parallel.zero import Layout
from jaxzero.planning import memory_check, planner, zero_formula
from jaxzero.runners import base as runners_base
from jaxzero.runners import resume
from jaxzero.runners.choose import make_runner
from jaxzero.runtime import pinned_pool
from jaxzero.utils.formatting import format_bytes

log = logging.getLogger(__name__)
ROLES = ("params", "grads", "optimizer")  # the state's per-device bytes, by role

# The config's own sections, as jaxzero.Zero, Remat, Offload, Precision, Pipeline, Context.
Zero = config_lib.ZeroConfig
Remat = config_lib.RematConfig
Offload = config_lib.OffloadConfig
Precision = config_lib.PrecisionConfig
Pipeline = config_lib.PipelineConfig
Context = config_lib.ContextConfig


def mesh(fsdp: int = -1, replica: int = 1, tensor: int = 1, pipeline: int = 1,
         devices=None, context: int = 1):
  """A (replica, [pipeline,] fsdp, [context,] tensor) device mesh; -1 takes the devices the
  others leave."""
  if devices is None:  # before JAX starts its backend, where this starts it
    pinned_pool.size_for_host()
    pinned_pool.use_host_cores()
    devices = jax.devices()
  devices = list(devices)
  shape = mesh_lib.resolve_shape(
      config_lib.MeshConfig(replica, fsdp, tensor, pipeline, context=context), len(devices))
  return mesh_lib.make_mesh(*shape[:2], devices, shape[2], pipeline, context)


class Engine:
  """A model trained with ZeRO on a device mesh.

  Args:
    model: a Flax NNX module or a function returning one (taking `rngs`, or
      nothing), a Linen module (with `init_args`), an (init_fn, apply_fn) pair, or a
      jaxzero.models.interface.Model (the engine's own contract: its loss takes the
      engine's hooks; one that declares `layers_key` can also stream its layers from
      NVMe, offload.params=nvme).
    optimizer: an optax optimizer; it runs on the fp32 master weights.
    loss_fn: (model, batch) -> scalar mean loss, `model` bound to the parameters
      (none for a Model, which carries its loss).
    zero, mesh, precision, remat, offload, pipeline, context: where the state lives and
      how; all but `mesh` are the config's sections (jaxzero.config), `precision`,
      `remat` and `offload` also given by name ("bfloat16"; "full"; "pinned_host" for
      the optimizer); `pipeline` (the schedule) applies to a mesh with pipeline > 1,
      `context` (the strategy) to one with context > 1.
    grad_accum: micro-batches a batch is split into; clip_norm: global-norm
      clipping (0 = off).
    rules: the model's dimension names -> jaxzero's (jaxzero.parallel.rules);
      min_shard_size: parameters with fewer elements stay whole (default
      ``zero.min_shard_size``).
    workdir: names the NVMe store's directory (offload to nvme), as a run's does.
    force: construct even when the state does not fit the devices' or the host's memory
      (jaxzero.train's --force); otherwise that is one line, DoesNotFitError.
  """

  def __init__(self, model: Any, *, optimizer: optax.GradientTransformation,
               loss_fn: Callable | None = None, zero: Zero = Zero(), mesh=None,
               precision: str | Precision = "float32", remat: str | Remat = "none",
               offload: str | Offload | None = None, pipeline: Pipeline = Pipeline(),
               context: Context = Context(), grad_accum: int = 1,
               clip_norm: float = 0.0, rules: dict | None = None,
               min_shard_size: int | None = None, init_args: tuple = (), seed: int = 0,
               workdir: str | pathlib.Path | None = None, force: bool = False):
    mesh = mesh if mesh is not None else globals()["mesh"]()
    _check_kinds(optimizer, zero, mesh)
    remat = remat if isinstance(remat, Remat) else Remat(remat)
    precision = precision if isinstance(precision, Precision) else Precision(compute=precision)
    offload = Offload(offload) if isinstance(offload, str) else offload or Offload()
    if remat.block is not None and not isinstance(remat.block, type):
      raise ConfigError(f"Remat(block={remat.block!r}) must be a Flax NNX module class")
    if remat.block is not None:
      try:
        remat_lib.block_policy(remat.policy)
      except ValueError as e:
        raise ConfigError(str(e)) from None
    if min_shard_size is not None:  # the config's, so that what reports it names it
      zero = dataclasses.replace(zero, min_shard_size=min_shard_size)
    base = config_lib.base()
    # Under a block, the block's policy wraps the block; the engine's own hook is unused.
    cfg = dataclasses.replace(
        base, seed=seed, zero=zero, offload=offload,
        mesh=config_lib.MeshConfig(*(mesh.shape.get(a, 1) for a in
                                     ("replica", "fsdp", "tensor", "pipeline", "context"))),
        precision=precision, pipeline=pipeline, context=context,
        remat=Remat("none") if remat.block else remat,
        train=dataclasses.replace(base.train, grad_accum=grad_accum, clip_norm=clip_norm))
    config_lib.check_types(cfg)  # the checks jaxzero.train's config runs, for these arguments
    config_lib.check_literals(cfg)
    for name, value, least in (("grad_accum", grad_accum, 1), ("clip_norm", clip_norm, 0),
                               ("min_shard_size", zero.min_shard_size, 0)):
      if value < least:
        raise ConfigError(f"{name}={value} must be at least {least}")
    config_lib.validate_precision(precision)
    if precision.matmul != "default":  # as the config refuses it for a model_factory model
      raise ConfigError(f"Precision(matmul={precision.matmul!r}) sets the built-in models' "
                        "projections (jaxzero.train); a model of one's own chooses its matmuls")
    if precision.compute != "float16" and precision != Precision(compute=precision.compute):
      raise ConfigError(f"Precision(compute={precision.compute!r}) with loss-scaler settings: "
                        "they apply to compute='float16' only")
    config_lib.validate_offload(cfg)
    self.cfg, self.mesh = cfg, mesh
    self.layout = Layout.from_config(cfg, mesh)
    self.model = adapters.build(
        model, loss_fn, shard_size=self.layout.shard_size, init_args=init_args, rules=rules,
        min_size=zero.min_shard_size,
        remat_block=remat.block, remat_policy=remat.policy)
    if remat.policy != "none" and remat.block is None and self.model.layers_key is None:
      # The policy applies where the engine scans a model's layers; this one has none.
      raise ConfigError(f"remat={remat.policy!r} checkpoints the layers of a model that "
                        "declares them (a jaxzero Model's layers_key); for this model name its "
                        f"block: remat=jaxzero.Remat({remat.policy!r}, block=MyBlock) (an NNX "
                        "class), or wrap the block in nn.remat / jax.checkpoint yourself")
    if cfg.mesh.pipeline > 1 and self.model.layers_key is None:  # as the config refuses it
      raise ConfigError(f"a mesh with pipeline={cfg.mesh.pipeline} runs a model's stacked "
                        "layers in stages: it needs a jaxzero Model that declares layers_key "
                        "and runs them through hooks.scan; use pipeline=1 for this model")
    if cfg.mesh.context > 1 and self.model.layers_key is None:  # as the config refuses it
      raise ConfigError(f"a mesh with context={cfg.mesh.context} splits the sequence of a "
                        "model that shards its activations through the engine's hooks: it "
                        "needs a jaxzero Model that declares layers_key; use context=1 for "
                        "this model")
    if self.model.layers_key is not None:  # stages and micro-batches, as the config checks
      stacked = jax.tree.leaves(self.model.specs[self.model.layers_key], is_leaf=is_spec)
      config_lib.validate_pipeline(cfg, stacked[0].shape[0])
    if self.model.frozen_specs is not None:  # the check jaxzero.train's config runs
      config_lib.validate_frozen_offload(cfg, "a model with frozen parameters (jaxzero.lora)")
    program = engine_lib.TrainProgram(cfg, self.layout, self.model, optimizer=optimizer)
    if (optimizer is not None and program.padding.any
        and engine_lib.padding_changes_updates(optimizer)):
      log.warning("this optimizer's update of a weight reads its shape or norms, and some "
                  "weights are stored padded with zeros (no dimension divides the %d sharding "
                  "devices): it updates them a little otherwise than on one device; mesh "
                  "sizes that divide them, or an elementwise optimizer (optax.adamw, ...), "
                  "train as one device", self.layout.shard_size)
    self._warned_dtypes = False
    self.runner = make_runner(program, workdir)  # as jaxzero.train chooses it
    # The NVMe tier's files are deleted when the engine is closed, collected, or at exit.
    self._release = weakref.finalize(self, self.runner.close)
    # The state's bytes against the devices' memory and this process's host memory (the
    # offloaded state, XLA's pinned pool), as jaxzero.train checks them: exact from the
    # shardings, nothing allocated. A model of one's own has no activation estimate, and
    # a save (only when asked) no copy counted; no collective (processes_on_this_host).
    memory_check.check(self.runner, list(mesh.devices.flat), force, estimate_activations=False,
                       whole_run=False, force_hint="force=True constructs it anyway")
    whole, state = state_bytes.kept_whole(program), sum(self.runner.plan()[r] for r in ROLES)
    if whole["bytes"] > 0.1 * state:
      log.warning("%d of the model's parameters stay whole on every device (%s): %.0f%% of "
                  "the state's %s a device", whole["leaves"], whole["why"],
                  100 * whole["bytes"] / state, format_bytes(state))

  @property
  def program(self) -> engine_lib.TrainProgram:
    """The in-memory program every runner trains with (jaxzero.engine.TrainProgram)."""
    return self.runner.program

  @property
  def shardings(self):
    """Where each leaf of the train state lives (a TrainState of NamedShardings)."""
    return self.program.shardings

  def init(self, rng: jax.Array | None = None):
    """Step 0, drawn straight into its shards (`rng`: a jax.random key)."""
    self._check_open()
    if rng is not None and not _is_key(rng):
      raise UserError(f"init(rng={rng!r}): give a jax.random.key(seed), or nothing for the "
                      "engine's seed")
    return self.runner.init(key=rng)

  def _micro_batches(self, batch: Any) -> Any:
    """`batch` (leading axis: rows) as [grad_accum, rows / grad_accum, ...], placed."""
    a = self.cfg.train.grad_accum

    def split(x):
      if jnp.ndim(x) == 0:
        raise ConfigError(f"a batch leaf is a scalar ({x!r}): every leaf of a batch has its "
                          "rows on its leading axis (a list or tuple is a pytree of its "
                          "items: give an array)")
      if x.shape[0] % (a * self.layout.data_parallel_size):
        raise ConfigError(f"a batch of {x.shape[0]} rows does not split into grad_accum={a} "
                          f"micro-batches over {self.layout.data_parallel_size} devices")
      x = x.reshape(a, x.shape[0] // a, *x.shape[1:])
      return jax.device_put(x, NamedSharding(self.mesh, P(None, mesh_lib.AXES)))

    self._check_batch_dtypes(batch)
    rows = {jnp.shape(x)[0] for x in jax.tree.leaves(batch) if jnp.ndim(x)}
    if len(rows) > 1:
      raise ConfigError(f"the batch's leaves have {sorted(rows)} rows: every leaf of a batch "
                        "has the same rows on its leading axis")
    return jax.tree.map(split, batch)

  def _check_batch_dtypes(self, batch: Any) -> None:
    """Warns, once, where every floating leaf of the batch is wider than the compute
    dtype: against such inputs JAX promotes the weights' compute copy, and the model's
    matmuls run in the wider dtype (torch would refuse the mix; FSDP2 casts a module's
    inputs). A batch with some leaf in the compute dtype has been cast where it matters
    (its float32 targets, say, meet no weight)."""
    compute = engine_lib.dtype_of(self.cfg.precision.compute)
    floating = [(path, jnp.result_type(x)) for path, x in
                jax.tree_util.tree_leaves_with_path(batch)
                if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    wide = [f"{jax.tree_util.keystr(path) or 'the batch'} ({dtype.name})"
            for path, dtype in floating if jnp.finfo(dtype).bits > jnp.finfo(compute).bits]
    if wide and len(wide) == len(floating) and not self._warned_dtypes:
      self._warned_dtypes = True
      name = self.cfg.precision.compute
      log.warning("the batch's leaves %s are wider than precision=%s: a weight that meets one "
                  "is promoted, and that matmul runs in the wider dtype (unless the model "
                  "casts its inputs); give the model's inputs in %s (as FSDP2's "
                  "cast_forward_inputs does) to compute in it", ", ".join(wide), name, name)

  def step(self, state, batch) -> tuple[Any, dict]:
    """One optimizer step on `batch` (any pytree whose leading axis is the batch). `state`
    is consumed (its buffers are reused): train on with the state returned."""
    self._check_open()
    if state is None:
      raise UserError("step(state=None, ...): pass the state init() or restore() returned, "
                      "then each step's")
    # A state passed twice: its buffers were donated to the step that consumed it, and
    # running on them again crashes the process on several devices (no Python error).
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
      raise UserError("step(state, ...): this state was consumed by an earlier step (its "
                      "buffers are reused); pass the state that step returned")
    return self.runner.step(state, self._micro_batches(batch))

  def save(self, state, path: str | pathlib.Path) -> pathlib.Path:
    """Saves `state` under `path` (orbax, sharded; checksummed); returns its directory.

    Every save is kept (as DeepSpeed's save_checkpoint, nothing is pruned), and a step
    already saved under `path` is not overwritten: that raises CheckpointError.
    """
    self._check_open()
    step = int(state.step)
    with self._checkpointer(path) as saver:
      # Decided by process 0 for all: a process that saw otherwise would wait in the save.
      exists = step in saver.all_steps()
      if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
        exists = bool(multihost_utils.broadcast_one_to_all(np.asarray(exists)))
      if exists:
        raise CheckpointError(f"{path} already holds a checkpoint at step {step} "
                              f"({saver.step_dir(step)}); save to another path, or move it away")
      return self.runner.save(saver, step, state, wait=True)

  def restore(self, path: str | pathlib.Path, step: int | None = None):
    """The latest (or `step`'s) state saved under `path`, read into this engine's layout;
    `path` is only read."""
    self._check_open()
    if not (pathlib.Path(path) / "checkpoints").is_dir():
      raise ConfigError(f"no checkpoint under {path}")
    with self._checkpointer(path) as reader:
      steps = reader.all_steps()
      if not steps:
        raise ConfigError(f"no checkpoint under {path}")
      if step is not None and step not in steps:
        raise CheckpointError(f"no checkpoint at step {step} under {path}; available steps: "
                              f"{', '.join(map(str, steps))}")
      return resume.restore(self.runner, reader, steps[-1] if step is None else step)

  def close(self) -> None:
    """Releases what the runner keeps outside memory (the NVMe tier's files; a checkpoint
    holds the state) and ends the engine: init, step, save and restore are refused after.
    Done at exit, at the end of ``with jaxzero.Engine(...) as engine:``, or when the engine
    is collected, if not before."""
    self._release()

  def _check_open(self) -> None:
    if not self._release.alive:
      raise UserError("this jaxzero.Engine was closed (close(), or the end of its with "
                      "block); make another to train on")

  def __enter__(self) -> "Engine":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _checkpointer(self, path) -> checkpointer.Checkpointer:
    if pathlib.Path(path).exists() and not pathlib.Path(path).is_dir():
      raise UserError(f"{path} is a file: checkpoints are saved under a directory; give one")
    info = {"model": {"parameters": self.program.n_params},
            "compute_dtype": self.cfg.precision.compute, "seed": self.cfg.seed}
    if self.model.lora is not None:  # a restore under another alpha is refused, as the
      info["lora"] = self.model.lora  # command's
    (pathlib.Path(path) / "checkpoints").mkdir(parents=True, exist_ok=True)
    return runners_base.checkpointer(path, None, info)  # keep every save

  def plan(self, batch: Any = None) -> dict[str, int]:
    """Per-device bytes: the state by role (from its shardings), the ZeRO paper's
    figure, what of the state stays whole on every device (``whole_bytes``, of
    ``whole_leaves`` parameters, ``whole_why``), the trained parameters (``n_params``)
    and the frozen ones (``n_frozen``, ``frozen_bytes``: jaxzero.lora), and with an
    example `batch` XLA's own total for the compiled step."""
    got = self.runner.plan()
    n_params = self.program.n_params
    theory, formula = zero_formula.theory_state_bytes(self.cfg, self.layout, n_params,
                                                      self.program.n_frozen,
                                                      self.program.frozen_bytes)
    plan = {"params_bytes": got["params"], "grads_bytes": got["grads"],
            "optimizer_bytes": got["optimizer"], "host_bytes": got["host"],
            "nvme_bytes": got["nvme"],
            "state_bytes": sum(got[r] for r in ROLES),
            "theory_state_bytes": theory, "theory_formula": formula, "n_params": n_params,
            # A LoRA model's frozen parameters (counted in params_bytes too).
            "frozen_bytes": got.get("frozen", 0), "n_frozen": self.program.n_frozen}
    whole = state_bytes.kept_whole(self.program)  # included in the roles' bytes above
    plan.update(whole_bytes=whole["bytes"], whole_leaves=whole["leaves"], whole_why=whole["why"])
    if batch is not None:
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            self._micro_batches(batch))
      compiled = self.runner.lower(self.program.abstract_state(), shapes).compile()
      plan["total_bytes"] = planner.xla_total_bytes(compiled.memory_analysis())
    return plan


def _check_kinds(optimizer, zero, mesh) -> None:
  """One line for an argument of the wrong kind, before anything is built."""
  if not (callable(getattr(optimizer, "init", None)) and
          callable(getattr(optimizer, "update", None))):
    raise ConfigError(f"optimizer={optimizer!r} is not an optax optimizer: give one made, e.g. "
                      "optax.adamw(3e-4), not the function optax.adamw")
  if not isinstance(zero, Zero):
    raise ConfigError(f"zero={zero!r}: give jaxzero.Zero(stage=...)")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ConfigError(f"mesh={mesh!r}: give jaxzero.mesh(fsdp=..., ...) or a jax.sharding.Mesh")


def _is_key(rng) -> bool:
  """A typed jax.random.key, or a raw jax.random.PRNGKey (uint32 [2])."""
  dtype = getattr(rng, "dtype", None)
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return dtype == jnp.uint32 and tuple(jnp.shape(rng)) == (2,)
