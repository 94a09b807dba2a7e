"""LoRA on any model under the engine's contract (jaxzero.models.interface.Model) whose
parameters are nested dicts (Flax NNX and Linen modules, most pytree models).

Every 2-D parameter whose path ("/"-joined keys, e.g. ``blocks/0/attn/q/kernel``) matches
a regex, a kernel [in, out] as Flax's Linear and Dense hold it, gains adapters A [in, r]
(PEFT's draw: uniform within ±1/√in) and B [r, out] (zeros), kept under the trained
key ``lora`` with the kernel's path. The model's own parameters are all frozen
(``Model.frozen_specs``). The loss runs the model with each kernel replaced by
``W + alpha / r · A B``: exact for any use of the kernel, at the price of forming that
sum each step and, in the backward pass, its kernel-sized gradient (from which A's and
B's follow): about the compute and temporary memory of training the kernel itself. The
built-in Llama family's LoRA (jaxzero.models.lora) adds x A B instead.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxzero.models.interface import Leaf, Model

KEY = "lora"


_flat, _nest = traverse_util.flatten_dict, traverse_util.unflatten_dict


def _name(path: tuple) -> str:
  return "/".join(map(str, path))


def targets_of(specs: Any, pattern: str) -> dict[tuple, Any]:
  """{path: spec} of the 2-D parameters whose "/"-joined path fully matches `pattern`.
  ValueError (one line) where the parameters are not nested dicts, the pattern is not
  a regex, or it matches nothing 2-D."""
  if not isinstance(specs, dict):
    raise ValueError("LoRA needs the model's parameters as nested dicts (Flax NNX or Linen "
                     f"modules); got {type(specs).__name__}")
  if KEY in specs:
    raise ValueError(f"the model already has a parameter named {KEY!r}, where LoRA keeps "
                     "its adapters")
  try:
    regex = re.compile(pattern)
  except re.error as e:
    raise ValueError(f"targets={pattern!r} is not a valid regex ({e})") from None
  flat = _flat(specs)
  matched = {p: s for p, s in flat.items() if regex.fullmatch(_name(p))}
  kernels = {p: s for p, s in matched.items() if len(s.shape) == 2}
  if not kernels:
    some = ", ".join(_name(p) for p in list(flat)[:6])
    raise ValueError(f"targets={pattern!r} matches no 2-D parameter"
                     + (f" (it matches {', '.join(_name(p) for p in matched)}, not 2-D)"
                        if matched else "")
                     + f"; the parameters are named like: {some}")
  return kernels


def with_lora(model: Model, rank: int, alpha: float, pattern: str) -> Model:
  """`model` with its parameters frozen and rank-`rank` adapters on the 2-D parameters
  `pattern` matches. An adapter's dimensions carry its kernel's logical names (the
  rank's: "none"); the caller may place them otherwise."""
  if rank <= 0:
    raise ValueError(f"rank={rank} must be positive")
  if model.frozen_specs is not None:
    raise ValueError("the model already has frozen parameters: LoRA wraps a model once")
  if model.layers_key is not None:
    raise ValueError("LoRA on a model with stacked layers (layers_key) is the built-in "
                     "Llama family's (lora.rank); this wrapper adapts 2-D kernels")
  kernels = targets_of(model.specs, pattern)
  scale = alpha / rank

  def adapter(spec, which):
    (n_in, n_out), (ax_in, ax_out) = spec.shape, spec.logical_axes
    shape, axes = ((n_in, rank), (ax_in, "none")) if which == "a" else (
        (rank, n_out), ("none", ax_out))
    return Leaf(shape, axes)

  specs = {KEY: _nest({(*p, w): adapter(s, w) for p, s in kernels.items() for w in "ab"})}

  def init(key):
    keys = jax.random.split(key, len(kernels))
    out = {}
    for k, (path, spec) in zip(keys, kernels.items()):
      bound = 1 / math.sqrt(spec.shape[0])
      out[(*path, "a")] = jax.random.uniform(k, (spec.shape[0], rank), jnp.float32, -bound,
                                             bound)
      out[(*path, "b")] = jnp.zeros((rank, spec.shape[1]), jnp.float32)
    return {KEY: _nest(out)}

  def loss(params, batch, hooks):
    adapters = _flat(params[KEY])
    flat = _flat({k: v for k, v in params.items() if k != KEY})
    for path in kernels:
      w = flat[path]
      delta = adapters[(*path, "a")] @ adapters[(*path, "b")]
      flat[path] = w + (scale * delta).astype(w.dtype)
    return model.loss(_nest(flat), batch, hooks)

  return dataclasses.replace(model, specs=specs, init=init, loss=loss,
                             decay=lambda path: True, frozen_specs=model.specs,
                             frozen_init=model.init,
                             lora={"rank": rank, "alpha": alpha, "targets": pattern})

