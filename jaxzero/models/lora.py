"""LoRA for the Llama family: frozen base weights, trained low-rank adapters.

Each targeted projection W (q, k, v, o, gate, up, down, and the head) gains ``x @ A @ B
* alpha / rank``, PEFT's LoRA: A [in, r] drawn as PEFT draws it (uniform within
±1/sqrt(in)), B [r, out] zeros, so that step 0's model is the base model. The embedding
gains ``A[token] @ B``, PEFT's LoRA Embedding: A [V, r] zeros, B [r, D] standard normal.
The adapters are the Model's trained parameters (``specs``); the base is its
``frozen_specs``, which the engine keeps in the compute dtype with no gradient or
optimizer state. The projections' adapters are stacked per layer beside the base's
layers (``lora_{target}_a``, ``lora_{target}_b`` under ``layers``), so that the engine's
per-layer gradient accumulation and the pipeline's stages take them as they take the
layers' weights; the embedding's and the head's are top-level (``lora_embed_a``, ...).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.models import fp8, quantize, trainable
from jaxzero.models.interface import Hooks, KeyedBatch, Model, split_like
from jaxzero.models.llama import LlamaConfig, ParamSpec, decoder_forward, is_param_spec, param_specs
from jaxzero.models.loss import cross_entropy

# Target -> (the base weight under `layers`, how many of its leading dimensions
# after `layers` are inputs). PEFT's module names in the same order.
TARGETS: dict[str, tuple[str, int]] = {
    "q": ("wq_LxDxHxE", 1), "k": ("wk_LxDxKxE", 1), "v": ("wv_LxDxKxE", 1),
    "o": ("wo_LxHxExD", 2), "gate": ("w_gate_LxDxF", 1), "up": ("w_up_LxDxF", 1),
    "down": ("w_down_LxFxD", 1),
}
PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                "down": "mlp.down_proj"}
ALL_LINEAR = "all-linear"
# The adapted weights outside the layers: target -> (the base weight, PEFT's module).
# As PEFT's "all-linear", the default leaves them out.
TOP_TARGETS: dict[str, tuple[str, str]] = {"embed": ("embed_VxD", "model.embed_tokens"),
                                           "head": ("lm_head_DxV", "lm_head")}
ALL_TARGETS = (*TARGETS, *TOP_TARGETS)
# Each adapter's logical axes where it is split, (A's, B's): the embedding's A is
# looked up by token, its B adds to the residual stream; the head's as any projection's.
TOP_AXES = {"embed": (("vocab", "none"), ("none", "embed")),
            "head": (("embed", "none"), ("none", "vocab"))}


def peft_name(target: str) -> str:
  """PEFT's short name of a target's module (q_proj, ..., embed_tokens, lm_head)."""
  module = PEFT_MODULES[target] if target in TARGETS else TOP_TARGETS[target][1]
  return module.split(".")[-1]


def resolve_targets(targets: str) -> tuple[str, ...]:
  """The targets a ``lora.targets`` value names: "all-linear" (the seven projections),
  comma-separated names (q, k, v, o, gate, up, down, embed, head, or PEFT's q_proj, ...,
  down_proj, embed_tokens, lm_head), or a regex matched against those names. ValueError
  names the valid choices."""
  valid = ", ".join(ALL_TARGETS)
  text = targets.strip()
  if text == ALL_LINEAR:
    return tuple(TARGETS)
  names = [n.strip() for n in text.split(",") if n.strip()]
  by_peft = {peft_name(t): t for t in ALL_TARGETS}
  if names and all(n in ALL_TARGETS or n in by_peft for n in names):
    chosen = {by_peft.get(n, n) for n in names}
    return tuple(t for t in ALL_TARGETS if t in chosen)
  try:
    pattern = re.compile(text)
  except re.error as e:
    raise ValueError(f"lora.targets={targets!r} is neither names nor a valid regex ({e}); "
                     f"choose from {valid} or {ALL_LINEAR}") from None
  matched = tuple(t for t in ALL_TARGETS if pattern.fullmatch(t)
                  or pattern.fullmatch(peft_name(t)))
  if not matched:
    raise ValueError(f"lora.targets={targets!r} matches no projection; choose from {valid} "
                     f"(or their PEFT names q_proj ... down_proj, embed_tokens, lm_head), "
                     f"or {ALL_LINEAR}")
  return matched


def adapter_key(target: str, which: str) -> str:
  return f"lora_{target}_{which}"


def adapter_specs(cfg: LlamaConfig, rank: int, targets: tuple[str, ...],
                  min_shard_size: int = 0) -> dict:
  """{"layers": {lora_{t}_a: [L, in..., r], lora_{t}_b: [L, r, out...]}} for the
  projections, and for the embedding and the head top-level lora_embed_a [V, r],
  lora_embed_b [r, D], lora_head_a [D, r], lora_head_b [r, V]. An adapter with fewer
  than `min_shard_size` elements is declared unsplittable ("none"): ZeRO keeps it
  whole, as it keeps any small parameter."""
  base = param_specs(cfg)["layers"]
  layers, top = {}, {}
  for t in targets:
    if t in TOP_TARGETS:
      in_dim, out_dim = ((cfg.vocab_size, cfg.dim) if t == "embed"
                         else (cfg.dim, cfg.vocab_size))
      inits = ("zeros", "normal_1") if t == "embed" else ("lora_a", "zeros")
      for which, shape, logical, init in zip("ab", ((in_dim, rank), (rank, out_dim)),
                                             TOP_AXES[t], inits):
        if math.prod(shape) < min_shard_size:
          logical = ("none", "none")
        top[adapter_key(t, which)] = ParamSpec(shape, logical, init)
      continue
    spec = base[TARGETS[t][0]]
    n_in = TARGETS[t][1]
    (L, *dims), (_, *axes) = spec.shape, spec.logical_axes
    a_shape, a_axes = (L, *dims[:n_in], rank), ("layers", *axes[:n_in], "none")
    b_shape, b_axes = (L, rank, *dims[n_in:]), ("layers", "none", *axes[n_in:])
    for which, shape, logical in (("a", a_shape, a_axes), ("b", b_shape, b_axes)):
      if math.prod(shape) < min_shard_size:
        logical = ("layers", *["none"] * (len(shape) - 1))
      layers[adapter_key(t, which)] = ParamSpec(shape, logical, "lora_a" if which == "a"
                                                else "zeros")
  return {"layers": layers, **top}


def init_adapters(specs: dict, key: jax.Array) -> dict:
  """As PEFT draws them: a projection's A kaiming-uniform with a=√5 (uniform within
  ±1/√fan_in), its B zeros; the embedding's A zeros, its B standard normal."""
  flat = {("layers", n): s for n, s in specs["layers"].items()}
  flat.update({(n,): s for n, s in specs.items() if n != "layers"})
  keys = dict(zip(flat, jax.random.split(key, len(flat))))
  out = {"layers": {}}
  for path, spec in flat.items():
    if spec.init == "zeros":
      value = jnp.zeros(spec.shape, jnp.float32)
    elif spec.init == "normal_1":
      value = jax.random.normal(keys[path], spec.shape, jnp.float32)
    else:
      fan_in = math.prod(spec.shape[len(path) - 1:-1])  # past the layers' axis, if any
      bound = 1.0 / math.sqrt(fan_in)
      value = jax.random.uniform(keys[path], spec.shape, jnp.float32, -bound, bound)
    (out["layers"] if len(path) == 2 else out)[path[-1]] = value
  return out


def lora_llama(cfg: LlamaConfig, rank: int, alpha: float, targets: tuple[str, ...],
               min_shard_size: int = 0, base_dtype: str = "", matmul: str = "default",
               dropout: float = 0.0) -> Model:
  """The Llama-family Model (jaxzero.models.trainable.llama) with its weights frozen and
  rank-`rank` adapters on `targets` trained, scaled by alpha / rank. `base_dtype` "nf4"
  or "int8" stores the seven projections of the base quantized (jaxzero.models.quantize),
  each dequantized into the compute dtype where its layer uses it. `matmul` as
  trainable.llama's (the adapters' own small matmuls stay in the compute dtype).
  `dropout` > 0 drops each adapter's input elements with that probability in training
  (PEFT's lora_dropout), from keys the engine gives each row (Model.keyed_rows)."""
  base_model = trainable.llama(cfg, matmul)
  specs = adapter_specs(cfg, rank, targets, min_shard_size)
  layer_axes = {n: s.logical_axes[1:] for n, s in specs["layers"].items()}
  top_axes = {n: s.logical_axes for n, s in specs.items() if n != "layers"}
  kind = base_dtype if base_dtype in quantize.KINDS else None
  frozen_specs = param_specs(cfg)
  if kind:
    for name in QUANTIZED:
      spec = frozen_specs["layers"][name]
      parts = quantize.stored_specs(spec.shape, kind)
      frozen_specs["layers"][name] = parts
      layer_axes[name] = _Quantized({k: s.logical_axes[1:] for k, s in parts.items()},
                                    spec.shape[1:], spec.logical_axes[1:])

  def loss(params, batch, hooks: Hooks) -> jax.Array:
    row_keys_Bx2 = None
    if isinstance(batch, KeyedBatch):
      batch, row_keys_Bx2 = batch
    seqs = trainable.sequences(batch, hooks)
    T = seqs.inputs.shape[1]
    drop = adapter_dropout(dropout, hooks.sequence_order(T), T)
    compute = jax.tree.leaves(split_like(params, specs)[0])[0].dtype  # the adapters'

    def gather(w, axes):
      if not isinstance(axes, _Quantized):
        return hooks.gather(w, axes)
      # One layer's stored parts come together, then become its weight, used and
      # dropped (recomputed in the backward pass under remat, like any activation).
      parts = {k: hooks.gather(v, axes.parts[k]) for k, v in w.items()}
      return hooks.gather(quantize.dequantize(parts, axes.shape, compute), axes.axes)

    x_BxTxD, head_DxV = decoder_forward(
        cfg, params, seqs.inputs, shard=hooks.shard, gather=gather,
        remat=hooks.remat, scan=hooks.scan, layer_axes=layer_axes, lora_scale=alpha / rank,
        segment_ids_BxT=seqs.segment_ids, einsum=fp8.EINSUMS[matmul], context=hooks.context,
        positions=seqs.positions, row_keys_Bx2=row_keys_Bx2,
        adapter_dropout=None if row_keys_Bx2 is None else drop, top_axes=top_axes)
    head_input = (None if row_keys_Bx2 is None or "lora_head_a" not in params
                  else drop(row_keys_Bx2, "head", x_BxTxD))
    return cross_entropy(x_BxTxD, head_DxV, seqs.targets, chunk=trainable.LOSS_CHUNK,
                         shard=hooks.shard, weights_BxT=seqs.weights,
                         low_rank=head_low_rank(params, x_BxTxD, gather, alpha / rank,
                                                top_axes, head_input))

  def frozen_init(key):
    return store_base(base_model.init(key), kind)

  return Model(specs=specs, init=lambda key: init_adapters(specs, key), loss=loss,
               decay=lambda path: True, layers_key="layers",
               frozen_specs=frozen_specs, frozen_init=frozen_init, keyed_rows=dropout > 0,
               batch_weight=trainable.target_count)


def head_low_rank(params: dict, x_BxTxD, gather, scale: float, top_axes: dict,
                  head_input=None):
  """A head adapter's term as cross_entropy's `low_rank`: (scale · h @ A [B, T, r], B
  [r, V]), h the final hidden states (or `head_input`, them with dropout); None
  without one."""
  if "lora_head_a" not in params:
    return None
  a_DxR, b_RxV = (gather(params[n], top_axes[n]) for n in ("lora_head_a", "lora_head_b"))
  h_BxTxD = x_BxTxD if head_input is None else head_input
  return scale * jnp.einsum("btd,dr->btr", h_BxTxD, a_DxR.astype(h_BxTxD.dtype)), b_RxV


def adapter_dropout(rate: float, order, T: int):
  """``(layer_keys_Bx2, target, h [B, T, in...]) -> h`` with each element dropped with
  probability `rate` and the rest scaled by 1 / (1 - rate) (PEFT's nn.Dropout on the
  adapter's input). Element (b, t, i) is decided by row b's key, the target and the
  position's index in the sequence (`order[t]` where the engine lays the sequence out
  in another order): the same wherever the row and position are computed."""
  positions_T = jnp.arange(T, dtype=jnp.int32) if order is None else jnp.asarray(order)
  target_index = {t: i for i, t in enumerate(ALL_TARGETS)}

  def drop(keys_Bx2, target, h):
    def keep_row(key_data):
      key = jax.random.fold_in(jax.random.wrap_key_data(key_data), target_index[target])
      return jax.vmap(lambda p: jax.random.bernoulli(jax.random.fold_in(key, p), 1 - rate,
                                                     h.shape[2:]))(positions_T)
    keep = jax.vmap(keep_row)(keys_Bx2)
    return jnp.where(keep, h / (1 - rate), 0).astype(h.dtype)
  return drop


# The base weights stored quantized under lora.base_dtype=nf4|int8: every projection
# (QLoRA's Linear4bit layers); the embedding, head and norm gains stay in the compute
# dtype.
QUANTIZED = tuple(weight for weight, _ in TARGETS.values())


class _Quantized(NamedTuple):
  """What `gather` is told of a quantized weight: its parts' per-layer logical axes,
  and the per-layer shape and logical axes of the weight they make."""
  parts: dict
  shape: tuple
  axes: tuple


def store_base(base: dict, kind: str | None) -> dict:
  """The base weights as the frozen state holds them: the projections quantized as
  `kind` (nf4, int8), or all as they are (None)."""
  if kind is None:
    return base
  layers = dict(base["layers"])
  for name in QUANTIZED:
    layers[name] = quantize.quantize(layers[name], kind)
  return {**base, "layers": layers}


def store_leaf(path: tuple[str, ...], leaf, kind: str | None):
  """One base leaf as the frozen state holds it (see store_base)."""
  if kind is None or tuple(path[:1]) != ("layers",) or path[-1] not in QUANTIZED:
    return leaf
  return quantize.quantize(leaf, kind)


def stored_quantized(record: dict | None) -> tuple[str, ...]:
  """The base weights a checkpoint's LoRA record says are stored quantized."""
  return QUANTIZED if record and record.get("base_dtype") in quantize.KINDS else ()


def read_base_leaf(path: tuple[str, ...], shape: tuple[int, ...], read, record: dict):
  """A checkpoint's frozen base weight at `path` (true `shape`), in float32 on the host:
  read by ``read(name, shape)``, dequantized where it is stored quantized."""
  if path[-1] not in stored_quantized(record):
    return np.asarray(read(("frozen", *path), shape), np.float32)
  layer = _base_layers(path, shape, read, record)
  return np.stack([layer(i) for i in range(shape[0])])


def _base_layers(path: tuple[str, ...], shape: tuple[int, ...], read, record: dict):
  """i -> layer i of a stacked frozen base weight, in float32, dequantized where it is
  stored quantized; each part is read by ``read(name, shape)`` and indexed by layer."""
  if path[-1] not in stored_quantized(record):
    whole = read(("frozen", *path), shape)
    return lambda i: np.asarray(whole[i], np.float32)
  dtypes = {"uint8": np.uint8, "int8": np.int8, "float32": np.float32}
  parts = {k: (read(("frozen", *path, k), s.shape), dtypes[s.dtype])
           for k, s in quantize.stored_specs(shape, record["base_dtype"]).items()}
  return lambda i: np.asarray(quantize.dequantize(
      {k: np.asarray(v[i]).astype(dtype) for k, (v, dtype) in parts.items()}, shape[1:],
      np.float32))


class MergedLayers:
  """A stacked base weight with its adapters folded in (W + alpha / r · A B, in float32),
  made one layer at a time when indexed: merging never holds more than a layer of it.
  ``read(name, shape)`` reads the adapters whole (rank-sized) and must return, for the
  base, an array-like that reads one layer when indexed (CheckpointReader.read_by_layer)."""

  def __init__(self, path: tuple[str, ...], shape: tuple[int, ...], read, record: dict):
    self.shape = tuple(shape)
    self._base = _base_layers(path, shape, read, record)
    target = target_of(path)
    self._adapters = None
    if target is not None and target in record["targets"]:
      rank, n_in = record["rank"], TARGETS[target][1]
      a = read(("master", "layers", adapter_key(target, "a")), (*shape[:1 + n_in], rank))
      b = read(("master", "layers", adapter_key(target, "b")), (shape[0], rank,
                                                                 *shape[1 + n_in:]))
      self._adapters = (np.asarray(a, np.float32), np.asarray(b, np.float32),
                        record["alpha"] / rank)

  def __getitem__(self, i: int) -> np.ndarray:
    weight = self._base(i)
    if self._adapters is None:
      return weight
    a, b, scale = self._adapters
    return weight + scale * low_rank_product(a[i:i + 1], b[i:i + 1])[0]


def check_base_dtype(cfg: LlamaConfig, base_dtype: str) -> None:
  """ValueError (one line) where `base_dtype` cannot store `cfg`'s projections."""
  if base_dtype in quantize.KINDS:
    layers = param_specs(cfg)["layers"]
    for name in QUANTIZED:
      quantize.check_quantizable(name, layers[name].shape, base_dtype)


def n_adapter_params(specs: dict) -> int:
  return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_param_spec))


def run_record(rank: int, alpha: float, targets: str, base_model: str = "",
               base_dtype: str = "", dropout: float = 0.0) -> dict | None:
  """What a checkpoint records of a run's LoRA (None without): rank, alpha, targets,
  the base model's directory (init.hf_checkpoint) where known, how the base is stored
  (lora.base_dtype), and the training's adapter dropout."""
  if not rank:
    return None
  return {"rank": rank, "alpha": alpha, "targets": list(resolve_targets(targets)),
          "base_model": base_model, "base_dtype": base_dtype, "dropout": dropout}


def target_of(path: tuple[str, ...]) -> str | None:
  """The LoRA target of a base weight's path (("layers", "wq_LxDxHxE") -> "q",
  ("lm_head_DxV",) -> "head"), or None."""
  if path[0] != "layers":
    return {weight: t for t, (weight, _) in TOP_TARGETS.items()}.get(path[0])
  by_weight = {weight: t for t, (weight, _) in TARGETS.items()}
  return by_weight.get(path[-1])


def low_rank_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """A [L, in..., r] times B [L, r, out...] -> [L, in..., out...], in float32."""
  L, r = a.shape[0], a.shape[-1]
  a2 = np.asarray(a, np.float32).reshape(L, -1, r)
  b2 = np.asarray(b, np.float32).reshape(L, r, -1)
  return np.matmul(a2, b2).reshape(*a.shape[:-1], *b.shape[2:])


def fold_adapters(path: tuple[str, ...], weight: np.ndarray, read, record: dict) -> np.ndarray:
  """The base weight at `path` outside the layer stack (the embedding [V, D] or the head
  [D, V]) with its adapters (read by ``read(name, shape)`` from a checkpoint's ``master``)
  folded in, in float32: W + alpha / r · A B; W as it is where none. (Stacked weights:
  MergedLayers, a layer at a time.)"""
  target = target_of(path)
  if target is None or target not in record["targets"]:
    return weight
  rank = record["rank"]
  a = read(("master", adapter_key(target, "a")), (weight.shape[0], rank))
  b = read(("master", adapter_key(target, "b")), (rank, weight.shape[1]))
  # In float32: the export casts once, to the dtype it writes.
  return np.asarray(weight, np.float32) + record["alpha"] / rank * (
      np.asarray(a, np.float32) @ np.asarray(b, np.float32))
