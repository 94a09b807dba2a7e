"""A user's model adapted to the engine's contract (jaxzero.models.interface.Model): a Flax
NNX module or a function making one, a Linen module with its init inputs, or an
``(init_fn, apply_fn)`` pair over a params pytree. :func:`model_for` is the model a run
trains: the Llama family's, or what the config's ``model_factory`` returns.

The loss is the user's ``loss_fn(model, batch)``, called with the model bound to
the current parameters (an NNX module, or a callable applying the Linen module or
``apply_fn``). Names the model gives its dimensions become ZeRO's placement through
jaxzero.parallel.rules. NNX state that is not a Param (e.g. RNG counters) is kept as
it was created and never trained; a model that changes it in training (dropout drawing,
BatchNorm's statistics) is refused in one line, as are integer or boolean parameters and
a loss_fn that returns anything but a scalar.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
import numbers
from typing import Any, Callable

import flax
import jax
from flax import nnx

from jaxzero.config import Config
from jaxzero.engine import remat
from jaxzero.config.builtin_model import builtin_model
from jaxzero.errors import ConfigError
from jaxzero.models import lora_any
from jaxzero.models.interface import Hooks, Model, is_spec
from jaxzero.parallel import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class Lora:
  """A model to fine-tune with LoRA (made by :func:`lora`; jaxzero.models.lora_any)."""
  model: Any
  rank: int
  alpha: float
  targets: str


def lora(model: Any, *, rank: int, alpha: float = 16.0, targets: str = r".*kernel") -> Lora:
  """`model` (anything jaxzero.Engine takes) with its parameters frozen and rank-`rank`
  LoRA adapters, scaled by alpha / rank, on each 2-D parameter whose "/"-joined path
  fully matches the regex `targets` (default: every Linear and Dense kernel)."""
  # The checks jaxzero.train's config runs on lora.rank and lora.alpha (alpha 0 would scale
  # the adapters' gradients to zero: nothing would train).
  if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
    raise ConfigError(f"jaxzero.lora(rank={rank!r}) must be a positive integer")
  if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0
      or not math.isfinite(alpha)):
    raise ConfigError(f"jaxzero.lora(alpha={alpha!r}) must be a positive number (PEFT's "
                      "lora_alpha: the adapters are scaled by alpha / rank)")
  if not isinstance(targets, str):
    raise ConfigError(f"jaxzero.lora(targets={targets!r}) must be a regular expression "
                      "(a str) over the parameters' '/'-joined paths")
  return Lora(model, int(rank), float(alpha), targets)


def build(model: Any, loss_fn: Callable | None, *, shard_size: int, init_args: tuple = (),
          rules: dict | None = None, min_size: int = rules_lib.DEFAULT_MIN_SIZE,
          remat_block: type | None = None, remat_policy: str = "full") -> Model:
  """The Model for any of the kinds of `model` (see the module's docstring; a Model as it is);
  `remat_block`, an NNX class whose every call is checkpointed with `remat_policy`."""
  if isinstance(model, Lora):
    inner = build(model.model, loss_fn, shard_size=shard_size, init_args=init_args,
                  rules=rules, min_size=min_size, remat_block=remat_block,
                  remat_policy=remat_policy)
    try:
      adapted = lora_any.with_lora(inner, model.rank, model.alpha, model.targets)
    except ValueError as e:
      raise ConfigError(f"jaxzero.lora: {e}") from None
    # The adapters placed by the rules, as any parameter: a kernel's own names carried
    # over, and where those leave nothing ZeRO may split, the rules' choice.
    names = jax.tree.map(lambda s: tuple(a if a != rules_lib.NONE else None
                                         for a in s.logical_axes), adapted.specs, is_leaf=is_spec)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, "float32"), adapted.specs,
                          is_leaf=is_spec)
    return dataclasses.replace(adapted, specs=rules_lib.specs(shapes, names, rules, shard_size,
                                                              min_size))
  if isinstance(model, Model):  # already the engine's contract: its loss takes the hooks
    if loss_fn is not None:
      raise ConfigError("a jaxzero.models.interface.Model carries its own loss: pass "
                        "loss_fn=None")
    return model
  if loss_fn is None or not callable(loss_fn):
    raise ConfigError(f"model {type(model).__name__} needs loss_fn=(model, batch) -> mean loss"
                      + ("" if loss_fn is None else f", a function (not {loss_fn!r})"))
  remat_block = (remat_block, remat_policy) if remat_block is not None else None
  if isinstance(model, tuple) and len(model) == 2 and all(map(callable, model)):
    return _functions(*model, loss_fn, shard_size, rules, min_size, remat_block)
  if _is_linen(model):
    return _linen(model, init_args, loss_fn, shard_size, rules, min_size, remat_block)
  if isinstance(model, nnx.Module) or callable(model):
    return _nnx(model, loss_fn, shard_size, rules, min_size, remat_block)
  raise ConfigError(f"model {type(model).__name__} is not one jaxzero can train: give a Flax "
                    "NNX module (or a function returning one), a Linen module with init_args, "
                    "or an (init_fn, apply_fn) pair")


def _is_linen(model) -> bool:
  try:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  return isinstance(model, nn.Module)


def _checked_loss(value):
  """The user's loss_fn result, which must be one scalar (the engine differentiates it)."""
  if isinstance(value, (tuple, list, dict)):
    raise ConfigError(f"loss_fn returned a {type(value).__name__}; it returns the scalar "
                      "mean loss alone (compute auxiliary outputs outside it)")
  if jax.numpy.shape(value) != ():
    raise ConfigError(f"loss_fn returned an array of shape {jax.numpy.shape(value)}; it "
                      "returns the scalar mean loss (e.g. jnp.mean of the per-example losses)")
  return value


def _specs(shapes, names, rules, shard_size, min_size):
  """rules_lib.specs of a model's parameters, all of which must be floating point."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
      raise ConfigError(f"parameter {jax.tree_util.keystr(path)} is {leaf.dtype}: jaxzero "
                        "trains floating-point parameters (fp32 masters); keep integer and "
                        "boolean values out of the parameters")
  return rules_lib.specs(shapes, names, rules, shard_size, min_size)


# ----------------------------------------------------------------------------- Flax NNX


def _nnx(model, loss_fn, shard_size, rules, min_size, remat_block) -> Model:
  instance = model if isinstance(model, nnx.Module) else None
  takes_rngs = instance is None and len(inspect.signature(model).parameters) > 0

  def make(key):
    if instance is not None:
      return instance
    with nnx.use_eager_sharding(False):  # placement is jaxzero's, not the module's
      return model(nnx.Rngs(key)) if takes_rngs else model()

  abstract = instance if instance is not None else nnx.eval_shape(lambda: make(jax.random.key(0)))
  graphdef, abstract_params, _ = nnx.split(abstract, nnx.Param, ...)
  variables = jax.tree.leaves(abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  names = jax.tree.unflatten(jax.tree.structure(nnx.to_pure_dict(abstract_params)),
                             [_nnx_names(v) for v in variables])
  shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                        nnx.to_pure_dict(abstract_params))
  rest = (nnx.split(instance, nnx.Param, ...)[2] if instance is not None else
          jax.jit(lambda: nnx.split(make(jax.random.key(0)), nnx.Param, ...)[2])())

  def init(key):
    return nnx.to_pure_dict(nnx.split(make(key), nnx.Param, ...)[1])

  def loss(params, batch, hooks: Hooks):
    with _remat(remat_block, hooks):
      try:
        return _checked_loss(loss_fn(nnx.merge(graphdef, params, rest), batch))
      except flax.errors.TraceContextError as e:  # its RNG counter or statistics changed
        raise ConfigError(
            f"model {type(abstract).__name__} changes its own state in training (a Dropout "
            "or other nnx.Rngs draw, or BatchNorm's running statistics): jaxzero trains the "
            "parameters of a model of one's own, so build it with dropout off "
            "(deterministic=True or rate 0) and its statistics frozen "
            "(use_running_average=True) or LayerNorm; a model that needs dropout is a "
            "jaxzero Model with keyed_rows") from e

  return Model(_specs(shapes, names, rules, shard_size, min_size), init, loss)


def _nnx_names(variable) -> tuple | None:
  metadata = variable.get_metadata()
  names = metadata.get("out_sharding") or metadata.get("sharding_names") or metadata.get(
      "sharding")
  return tuple(names) if names else None


@contextlib.contextmanager
def _remat(block: tuple | None, hooks: Hooks):
  """Checkpoints every call of the block class (FSDP's transformer_layer_cls) with
  its policy, while the loss is traced."""
  del hooks
  if block is None:
    yield
    return
  block, policy = block
  checkpoint_policy = remat.block_policy(policy)
  if checkpoint_policy is None:  # remat "none": the block as it is
    yield
    return
  original = block.__call__
  block.__call__ = nnx.remat(original, policy=checkpoint_policy)
  try:
    yield
  finally:
    block.__call__ = original


# ----------------------------------------------------------------------------- Linen


def _linen(module, init_args, loss_fn, shard_size, rules, min_size, remat_block) -> Model:
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  if remat_block is not None:
    raise ConfigError("remat by block class applies to Flax NNX modules; for Linen, wrap the "
                      "block in nn.remat (nn.checkpoint) inside the model")
  if not init_args:
    raise ConfigError(f"Linen module {type(module).__name__} needs init_args: the inputs its "
                      "init takes (e.g. a batch of the right shape)")
  boxed = jax.eval_shape(module.init, jax.random.key(0), *init_args)
  if set(boxed) != {"params"}:
    raise ConfigError(f"Linen module {type(module).__name__} has collections "
                      f"{sorted(set(boxed) - {'params'})} besides params; jaxzero trains params "
                      "only (e.g. use LayerNorm, not BatchNorm)")
  specs = nn.get_partition_spec(boxed)["params"]
  names = jax.tree.map(lambda p: tuple(p) if len(p) else None, specs,
                       is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  shapes = nn.meta.unbox(boxed)["params"]

  def init(key):
    return nn.meta.unbox(module.init(key, *init_args))["params"]

  def loss(params, batch, hooks: Hooks):
    del hooks
    return _checked_loss(loss_fn(lambda *a, **k: module.apply({"params": params}, *a, **k),
                                 batch))

  return Model(_specs(shapes, names, rules, shard_size, min_size), init, loss)


# ----------------------------------------------------------------------------- functions


def _functions(init_fn, apply_fn, loss_fn, shard_size, rules, min_size, remat_block) -> Model:
  if remat_block is not None:
    raise ConfigError("remat by block class applies to Flax NNX modules; for an apply "
                      "function, wrap its layer in jax.checkpoint")
  shapes = jax.eval_shape(init_fn, jax.random.key(0))

  def loss(params, batch, hooks: Hooks):
    del hooks
    return _checked_loss(loss_fn(lambda *a, **k: apply_fn(params, *a, **k), batch))

  return Model(_specs(shapes, None, rules, shard_size, min_size), init_fn, loss)


def model_for(cfg: Config, shard_size: int) -> Model:
  """The run's model: cfg.model_factory's, else the Llama family's of cfg.model. A
  factory "module:function" returns ``(model, loss_fn)`` or a dict of jaxzero.Engine's
  model arguments, adapted by :func:`build`, trained on the run's token batches."""
  if not cfg.model_factory:
    return builtin_model(cfg)
  module_name, _, function = cfg.model_factory.partition(":")
  try:
    made = getattr(importlib.import_module(module_name), function)()
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"model_factory={cfg.model_factory!r}: {e}; put the module on PYTHONPATH "
                      "or beside the config file") from None
  spec = made if isinstance(made, dict) else dict(zip(("model", "loss_fn"), made))
  if {"model", "loss_fn"} - set(spec):
    raise ConfigError(f"model_factory={cfg.model_factory!r} must return (model, loss_fn) or a "
                      "dict with model and loss_fn")
  model, loss_fn = spec.pop("model"), spec.pop("loss_fn")
  options = {"min_size": cfg.zero.min_shard_size}  # the factory's own min_shard_size wins
  options.update({{"min_shard_size": "min_size"}.get(k, k): v for k, v in spec.items()})
  return build(model, loss_fn, shard_size=shard_size, **options)
