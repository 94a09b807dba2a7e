"""Llama-3 in flax NNX (and Mistral, Qwen2), with every weight declared once with logical axes.

The decoder layers are stacked (leading ``layers`` axis) and run with ``jax.lax.scan``. This
module knows nothing about meshes: the caller steers parallelism and memory through three
hooks, all no-ops by default: ``shard(x, logical_axes)`` on activations, ``gather(w,
logical_axes)`` on each weight where it is used, ``remat(fn)`` on the per-layer function.
Training takes the loss from ``Llama.hidden`` and ``Llama.head_DxV`` (jaxzero.models.loss),
never from all the logits. Mistral is Llama with sliding-window attention, Qwen2 with q/k/v
biases (and optionally the window): ``LlamaConfig.family`` names the Hugging Face architecture.
Shapes are in names: B batch, T sequence, D embed, H query heads, K key/value heads, E head
dim, F mlp hidden, V vocab, L layers. Invariant: what is per row (a packed row's segment ids
and positions, LoRA dropout's keys) rides through the layer scan in its carry, never closed
over, so that a scan over some rows or a layer program reused across batches sees its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxzero.models.attention import Implementation, attention, check_implementation
from jaxzero.models.interface import Hooks

Array = jax.Array
ShardFn = Callable[[Array, tuple], Array]  # also the type of `gather`
RematFn = Callable[[Callable], Callable]
Family = Literal["llama", "mistral", "qwen2"]
FAMILIES: tuple[str, ...] = typing.get_args(Family)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int = 256
  dim: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  mlp_dim: int = 256
  norm_eps: float = 1e-5
  rope_theta: float = 500_000.0
  # Llama-3 frequency scaling; rope_scaling_factor <= 1 disables it.
  rope_scaling_factor: float = 0.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  tie_embeddings: bool = False
  init_std: float = 0.02
  # Attention kernel (jaxzero.models.attention): "auto" is cuDNN flash attention on a
  # GPU that takes the shapes, else "blockwise"; "xla" builds T×T scores.
  attention: Implementation = "auto"
  # The Hugging Face architecture (LlamaForCausalLM, MistralForCausalLM,
  # Qwen2ForCausalLM) that import expects and export writes.
  family: Family = "llama"
  # Biases on the q, k and v projections (not o): Qwen2's, so only with family "qwen2".
  qkv_bias: bool = False
  # Query i sees keys j with i - sliding_window < j <= i; 0 is full causal attention.
  sliding_window: int = 0

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads

  def validate(self) -> None:
    if self.dim % self.n_heads:
      raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"model.dim={self.dim} / model.n_heads={self.n_heads} is a head dimension "
                       f"of {self.head_dim}; rotary embeddings need it even")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}")
    check_implementation(self.attention, "model.attention")
    if self.family not in FAMILIES:
      raise ValueError(f"model.family={self.family!r} is unknown; choose one of: "
                       + ", ".join(FAMILIES))
    if self.qkv_bias != (self.family == "qwen2"):
      raise ValueError(f"model.qkv_bias={self.qkv_bias} with model.family={self.family!r}: "
                       "q/k/v biases are Qwen2's, and every Qwen2 has them (set both or neither)")
    if self.sliding_window < 0:
      raise ValueError(f"model.sliding_window={self.sliding_window} must not be negative "
                       "(0 = full causal attention)")
    if self.sliding_window and self.family == "llama":
      raise ValueError(f"model.sliding_window={self.sliding_window} with model.family='llama': "
                       "Llama has no sliding window; use model.family=mistral or qwen2")


# Published shapes (the values of Meta's Hugging Face config.json files).
LLAMA31_8B = LlamaConfig(
    vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, mlp_dim=14_336,
    norm_eps=1e-5, rope_theta=500_000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0, rope_original_max_len=8192, tie_embeddings=False)
LLAMA31_70B = dataclasses.replace(LLAMA31_8B, dim=8192, n_layers=80, n_heads=64,
                                  mlp_dim=28_672)
LLAMA32_1B = dataclasses.replace(LLAMA31_8B, dim=2048, n_layers=16, mlp_dim=8192,
                                 rope_scaling_factor=32.0, tie_embeddings=True)


class ParamSpec(NamedTuple):
  shape: tuple[int, ...]
  logical_axes: tuple[str, ...]
  init: str  # "normal" (std = init_std), "ones" or "zeros"


def is_param_spec(x) -> bool:
  """`is_leaf` for trees of ParamSpec (a NamedTuple, which jax would flatten)."""
  return isinstance(x, ParamSpec)


def param_specs(cfg: LlamaConfig) -> dict[str, dict[str, ParamSpec] | ParamSpec]:
  """The one declaration of every weight: shape, logical axes, initialiser."""
  L, D, H, K, E, F, V = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                         cfg.mlp_dim, cfg.vocab_size)
  layers = {
      "attn_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
      "wq_LxDxHxE": ParamSpec((L, D, H, E), ("layers", "embed", "heads", "head_dim"), "normal"),
      "wk_LxDxKxE": ParamSpec((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "wv_LxDxKxE": ParamSpec((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "wo_LxHxExD": ParamSpec((L, H, E, D), ("layers", "heads", "head_dim", "embed"), "normal"),
      "mlp_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
      "w_gate_LxDxF": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
      "w_up_LxDxF": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
      "w_down_LxFxD": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
  }
  if cfg.qkv_bias:
    layers["bq_LxHxE"] = ParamSpec((L, H, E), ("layers", "heads", "head_dim"), "zeros")
    layers["bk_LxKxE"] = ParamSpec((L, K, E), ("layers", "kv_heads", "head_dim"), "zeros")
    layers["bv_LxKxE"] = ParamSpec((L, K, E), ("layers", "kv_heads", "head_dim"), "zeros")
  specs: dict = {
      "embed_VxD": ParamSpec((V, D), ("vocab", "embed"), "normal"),
      "layers": layers,
      "final_norm": ParamSpec((D,), ("embed",), "ones"),
  }
  if not cfg.tie_embeddings:
    specs["lm_head_DxV"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
  return specs


def _new_param(spec: ParamSpec, key: Array, std: float) -> nnx.Param:
  if spec.init in ("ones", "zeros"):
    value = (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, jnp.float32)
  else:
    value = std * jax.random.normal(key, spec.shape, jnp.float32)
  return nnx.Param(value)


class DecoderLayers(nnx.Module):
  """All decoder layers' weights, stacked along a leading ``layers`` axis."""

  def __init__(self, specs: dict[str, ParamSpec], cfg: LlamaConfig, rngs: nnx.Rngs):
    for name, spec in specs.items():
      setattr(self, name, _new_param(spec, rngs.params(), cfg.init_std))

  def stacked(self) -> dict[str, Array]:
    names = [n for n in vars(self) if isinstance(getattr(self, n), nnx.Param)]
    return {n: getattr(self, n)[...] for n in names}


class Llama(nnx.Module):
  """Llama-3 decoder: tokens int32 [B, T] -> logits float32 [B, T, V].

  Training reads `forward`'s hidden states and head separately
  (jaxzero.models.loss.cross_entropy then never builds all the logits at once);
  `__call__` is their product.
  """

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    specs = param_specs(cfg)
    self.embed_VxD = _new_param(specs["embed_VxD"], rngs.params(), cfg.init_std)
    self.layers = DecoderLayers(specs["layers"], cfg, rngs)
    self.final_norm = _new_param(specs["final_norm"], rngs.params(), cfg.init_std)
    if not cfg.tie_embeddings:
      self.lm_head_DxV = _new_param(specs["lm_head_DxV"], rngs.params(), cfg.init_std)

  def __call__(self, tokens_BxT: Array, *, shard: ShardFn | None = None,
               gather: ShardFn | None = None, remat: RematFn | None = None) -> Array:
    shard = shard or _no_shard
    x_BxTxD, head_DxV = self.forward(tokens_BxT, shard=shard, gather=gather, remat=remat)
    logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV,
                              preferred_element_type=jnp.float32)
    return shard(logits_BxTxV, ("batch", "seq", "vocab"))

  def forward(self, tokens_BxT: Array, *, shard: ShardFn | None = None,
              gather: ShardFn | None = None, remat: RematFn | None = None,
              scan: Callable | None = None) -> tuple[Array, Array]:
    """(final-normed hidden states [B, T, D], head [D, V]): the logits' factors.

    `scan(layer, x, stacked) -> x` runs the layers (default: ``jax.lax.scan``)."""
    params = {"embed_VxD": self.embed_VxD[...], "layers": self.layers.stacked(),
              "final_norm": self.final_norm[...]}
    if not self.cfg.tie_embeddings:
      params["lm_head_DxV"] = self.lm_head_DxV[...]
    return decoder_forward(self.cfg, params, tokens_BxT, shard=shard, gather=gather,
                           remat=remat, scan=scan)


def decoder_forward(cfg: LlamaConfig, params: dict, tokens_BxT: Array, *,
                    shard: ShardFn | None = None, gather: ShardFn | None = None,
                    remat: RematFn | None = None, scan: Callable | None = None,
                    layer_axes: dict | None = None, lora_scale: float = 1.0,
                    segment_ids_BxT: Array | None = None,
                    einsum: Callable = jnp.einsum,
                    context: Callable = Hooks.context,
                    positions: Array | None = None, row_keys_Bx2: Array | None = None,
                    adapter_dropout: Callable | None = None,
                    top_axes: dict | None = None) -> tuple[Array, Array]:
  """:meth:`Llama.forward` on a pure params dict, whose ``layers`` may hold more than
  the layers' weights: LoRA adapters (``lora_{target}_a``/``_b``, jaxzero.models.lora),
  each adding ``lora_scale * x @ A @ B`` to its projection, or weights stored
  quantized (jaxzero.models.quantize) that `gather` turns into arrays. `layer_axes`
  gives the per-layer logical axes of those extra leaves (what `gather` is told).
  `segment_ids_BxT`: packed sequences, each a run of equal ids: attention stays within
  one, and positions (RoPE) start from 0 at each. `einsum` computes the seven
  projections (jaxzero.models.fp8's for FP8 matmuls); `context` is the Hooks.context
  hook attention runs under. `positions` ([T] or [B, T]) are the tokens' positions for
  RoPE where they are not 0..T-1 (nor restart with each segment): a sequence laid out in
  another order (Hooks.sequence_order). `row_keys_Bx2` (raw PRNG key data, a key per
  row) ride through the layers beside the residual stream, each layer's from the one
  before; ``adapter_dropout(layer_keys_Bx2, target, h)`` is then applied to each
  adapter's input (LoRA dropout). An embedding adapter (``lora_embed_a`` [V, r],
  ``lora_embed_b`` [r, D], PEFT's LoRA Embedding) adds ``lora_scale * A[token] @ B`` to
  the looked-up rows; `top_axes` gives its leaves' logical axes."""
  shard, gather = shard or _no_shard, gather or _no_shard
  T = tokens_BxT.shape[1]
  if (row_keys_Bx2 is None) != (adapter_dropout is None):
    raise ValueError("row_keys_Bx2 and adapter_dropout are given together, or neither")

  # An untied embedding is looked up where it lies; a tied one is gathered
  # once for the lookup and the head.
  embed_VxD = params["embed_VxD"]
  if cfg.tie_embeddings:
    embed_VxD = gather(embed_VxD, EMBED_AXES)
  x_BxTxD = shard(shard(jnp.take(embed_VxD, tokens_BxT, axis=0), LOOKUP_AXES), RESIDUAL_AXES)
  if "lora_embed_a" in params:
    top_axes = top_axes or {}
    a_VxR, b_RxD = (gather(params[n], top_axes.get(n, axes))
                    for n, axes in (("lora_embed_a", EMBED_AXES[:1] + ("none",)),
                                    ("lora_embed_b", ("none",) + EMBED_AXES[1:])))
    low_BxTxR = jnp.take(a_VxR, tokens_BxT, axis=0)
    x_BxTxD = x_BxTxD + shard(lora_scale * jnp.einsum(
        "btr,rd->btd", low_BxTxR, b_RxD.astype(low_BxTxR.dtype)).astype(x_BxTxD.dtype),
        RESIDUAL_AXES)
  # What each row carries through the layers beside its residual stream, where it has
  # any: a packed row's segment ids and positions (each layer makes its RoPE tables from
  # them), and LoRA dropout's keys. They travel with their rows, never closed over: a
  # pipeline stage runs its layers on one micro-batch's rows, and ZeRO-Infinity's driver
  # reuses one layer program for every batch.
  per_row = {}
  if segment_ids_BxT is not None:  # positions restart at each of a row's segments
    per_row["segment_ids"] = segment_ids_BxT
    per_row["positions"] = (segment_positions(segment_ids_BxT) if positions is None
                            else jnp.broadcast_to(positions, segment_ids_BxT.shape))
  else:  # [T, E], the same for every row
    cos_TxE, sin_TxE = rope_tables(cfg, T, positions)
  if row_keys_Bx2 is not None:
    per_row["keys"] = row_keys_Bx2

  axes = {n: spec.logical_axes[1:] for n, spec in param_specs(cfg)["layers"].items()}
  axes.update(layer_axes or {})

  def layer(carry, weights):
    x_BxTxD, rows = (carry["x"], carry) if per_row else (carry, {})
    weights = {n: gather(w, axes[n]) for n, w in weights.items()}
    cos, sin = (rope_tables(cfg, T, rows["positions"]) if "positions" in rows
                else (cos_TxE, sin_TxE))
    adapter_input = (functools.partial(adapter_dropout, rows["keys"]) if "keys" in rows
                     else None)
    x_BxTxD = shard(decoder_layer(cfg, weights, x_BxTxD, cos, sin, shard, lora_scale,
                                  rows.get("segment_ids"), einsum, context, adapter_input),
                    RESIDUAL_AXES)
    if not per_row:
      return x_BxTxD, None
    out = {**rows, "x": x_BxTxD}
    if "keys" in rows:  # the next layer's (the carry, not a layer index, gives them)
      out["keys"] = next_keys(rows["keys"])
    return out, None

  if remat is not None:
    layer = remat(layer)
  carry = {"x": x_BxTxD, **per_row} if per_row else x_BxTxD
  if scan is None:
    carry, _ = jax.lax.scan(layer, carry, params["layers"])
  else:
    carry = scan(layer, carry, params["layers"])
  x_BxTxD = carry["x"] if per_row else carry
  x_BxTxD = rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps)
  head_DxV = embed_VxD.T if cfg.tie_embeddings else gather(params["lm_head_DxV"], HEAD_AXES)
  return x_BxTxD, head_DxV


EMBED_AXES = ("vocab", "embed")
HEAD_AXES = ("embed", "vocab")


def _no_shard(x: Array, _logical_axes: tuple) -> Array:
  return x


HEADS_AXES = ("batch", "seq", "heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
MLP_AXES = ("batch", "seq", "mlp")
RESIDUAL_AXES = ("batch", "seq", "embed")
# The embedding lookup's result on its way to the residual stream (see the engine's
# activation_spec): one mesh axis moves at a time.
LOOKUP_AXES = ("lookup_batch", "seq", "embed")


def decoder_layer(cfg: LlamaConfig, w: dict[str, Array], x_BxTxD: Array, cos_TxE: Array,
                  sin_TxE: Array, shard: ShardFn = _no_shard, lora_scale: float = 1.0,
                  segment_ids_BxT: Array | None = None,
                  einsum: Callable = jnp.einsum,
                  context: Callable = Hooks.context,
                  adapter_input: Callable | None = None) -> Array:
  """One pre-norm transformer block: attention then SwiGLU MLP, both residual. A
  projection with LoRA adapters in `w` (``lora_{target}_a``/``_b``) adds theirs, on
  ``adapter_input(target, h)`` where given (dropout), else on its input h."""
  def proj(spec, h, weight, axes, name, bias=None):
    y = einsum(spec, h, weight)
    target = LORA_TARGET_OF.get(name)
    if f"lora_{target}_a" in w:
      h_in = h if adapter_input is None else adapter_input(target, h)
      y = y + lora_scale * lora_delta(spec, h_in, w[f"lora_{target}_a"],
                                      w[f"lora_{target}_b"])
    return checkpoint_name(shard(y if bias is None else y + bias, axes), name)

  h_BxTxD = shard(rms_norm(x_BxTxD, w["attn_norm"], cfg.norm_eps), RESIDUAL_AXES)
  q_BxTxHxE = proj("btd,dhe->bthe", h_BxTxD, w["wq_LxDxHxE"], HEADS_AXES, "q_proj",
                   w.get("bq_LxHxE"))
  k_BxTxKxE = proj("btd,dke->btke", h_BxTxD, w["wk_LxDxKxE"], KV_AXES, "k_proj",
                   w.get("bk_LxKxE"))
  v_BxTxKxE = proj("btd,dke->btke", h_BxTxD, w["wv_LxDxKxE"], KV_AXES, "v_proj",
                   w.get("bv_LxKxE"))
  q_BxTxHxE = apply_rope(q_BxTxHxE, cos_TxE, sin_TxE)
  k_BxTxKxE = apply_rope(k_BxTxKxE, cos_TxE, sin_TxE)
  # Grouped-query attention is native here: K may divide H.
  attend = functools.partial(attention, implementation=cfg.attention, window=cfg.sliding_window)
  ctx_BxTxHxE = context(attend)(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, segment_ids_BxT)
  ctx_BxTxHxE = checkpoint_name(shard(ctx_BxTxHxE, HEADS_AXES), "attention")
  attn_BxTxD = proj("bthe,hed->btd", ctx_BxTxHxE, w["wo_LxHxExD"], RESIDUAL_AXES, "o_proj")
  x_BxTxD = x_BxTxD + attn_BxTxD

  h_BxTxD = shard(rms_norm(x_BxTxD, w["mlp_norm"], cfg.norm_eps), RESIDUAL_AXES)
  gate_BxTxF = proj("btd,df->btf", h_BxTxD, w["w_gate_LxDxF"], MLP_AXES, "mlp_gate")
  up_BxTxF = proj("btd,df->btf", h_BxTxD, w["w_up_LxDxF"], MLP_AXES, "mlp_up")
  down_BxTxD = proj("btf,fd->btd", jax.nn.silu(gate_BxTxF) * up_BxTxF, w["w_down_LxFxD"],
                    RESIDUAL_AXES, "mlp_down")
  return x_BxTxD + down_BxTxD


# A projection's checkpoint name -> its LoRA target (jaxzero.models.lora).
LORA_TARGET_OF = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                  "mlp_gate": "gate", "mlp_up": "up", "mlp_down": "down"}


# What a row's key is folded with for the next layer's (no target index is this large).
NEXT_LAYER = 0x4C4159


def next_keys(keys_Bx2: Array) -> Array:
  """Each row's key for the next layer (raw key data in, raw key data out)."""
  step = lambda k: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k),
                                                          NEXT_LAYER))
  return jax.vmap(step)(keys_Bx2)


def lora_delta(spec: str, h: Array, a: Array, b: Array) -> Array:
  """``h @ A @ B`` for the projection ``einsum(spec, h, W)``: A takes W's input
  dimensions to rank r, B takes r to W's output dimensions."""
  inputs, out = spec.split("->")
  lhs, weight = inputs.split(",")
  w_in = "".join(c for c in weight if c in lhs)
  w_out = "".join(c for c in weight if c not in lhs)
  low = jnp.einsum(f"{lhs},{w_in}r->btr", h, a.astype(h.dtype))
  return jnp.einsum(f"btr,r{w_out}->{out}", low, b.astype(h.dtype))


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
  """RMSNorm computed in float32 and cast back, as Hugging Face's Llama does."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * normed.astype(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> Array:
  """Inverse RoPE frequencies [E/2], with Llama-3 scaling when configured."""
  E = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
  factor = cfg.rope_scaling_factor
  if factor <= 1.0:
    return inv_freq
  low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
  high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
            / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(is_medium, smoothed, scaled)


def rope_tables(cfg: LlamaConfig, T: int, positions: Array | None = None
                ) -> tuple[Array, Array]:
  """(cos, sin) [T, E] of positions 0..T-1, or [..., E] of `positions` where given."""
  positions = jnp.arange(T) if positions is None else positions
  freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
  angles = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def segment_positions(segment_ids_BxT: Array) -> Array:
  """Each token's position within its segment (a run of equal ids): [B, T] int32."""
  T = segment_ids_BxT.shape[1]
  index_T = jnp.arange(T, dtype=jnp.int32)
  starts_BxT = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], bool),
                                segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
  start_BxT = jax.lax.cummax(jnp.where(starts_BxT, index_T, 0), axis=1)
  return index_T - start_BxT


def apply_rope(x_BxTxNxE: Array, cos_TxE: Array, sin_TxE: Array) -> Array:
  """Rotate-half RoPE (the Hugging Face weight layout), computed in float32; the tables
  [T, E], or [B, T, E] for per-row positions."""
  x32 = x_BxTxNxE.astype(jnp.float32)
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  cos, sin = (t[None, :, None, :] if t.ndim == 2 else t[:, :, None, :]
              for t in (cos_TxE, sin_TxE))
  out = x32 * cos + rotated * sin
  return out.astype(x_BxTxNxE.dtype)


def count_params(cfg: LlamaConfig) -> int:
  specs = jax.tree.leaves(param_specs(cfg), is_leaf=is_param_spec)
  return sum(math.prod(s.shape) for s in specs)
