"""FP8 matmuls with current (per-tensor, dynamic) scaling: ``precision.matmul=fp8``.

:func:`einsum` is ``jnp.einsum(spec, x, w)`` with both operands scaled into
float8_e4m3fn in the forward pass and the incoming gradient into float8_e5m2 in
the backward pass, the recipe of Transformer Engine and torchtitan's tensorwise
Float8. Each tensor's scale is ``fp8 max / amax`` of that tensor in this step
("current" scaling: no amax history, so no state to checkpoint). The result and
the gradients are in the operands' compute dtype; masters stay fp32. The amax is of
the array the step sees: the whole micro-batch at stages 2-3; at stages 0-1 and
under HYBRID each data-parallel group's (the step runs per group there), as
per-rank scaling is in PyTorch.

The operands are quantized then dequantized (``convert(f8) * 1/scale``, in the
compute dtype) right before an ordinary einsum: XLA:GPU's GEMM rewriter turns that pattern into an
FP8 cuBLASLt GEMM on Hopper and later; XLA:CPU runs it as written, which
emulates the rounding exactly but not the speed. A ``custom_vjp`` is needed
because the backward pass quantizes what autodiff would not: the cotangent, to
e5m2. The residuals are the fp8 operands and their scales (half of bf16's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands: more precision
E5M2 = jnp.float8_e5m2  # gradients: more range


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """(x scaled by ``fp8 max / amax(x)`` and rounded to `dtype`, that scale as fp32)."""
  top = float(jnp.finfo(dtype).max)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.where(amax > 0, top / jnp.maximum(amax, 1e-30), 1.0)
  return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  # convert(f8) * scale straight in the compute dtype: the pattern XLA:GPU's GEMM
  # rewriter folds into an FP8 GEMM (a convert after the multiply would stop it).
  return q.astype(dtype) * (1.0 / scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """``jnp.einsum(spec, x, w)`` through FP8 (e4m3 operands), in x's dtype."""
  return _forward(spec, x, w)[0]


def _forward(spec, x, w):
  (xq, xs), (wq, ws) = quantize(x, E4M3), quantize(w, E4M3)
  y = jnp.einsum(spec, dequantize(xq, xs, x.dtype), dequantize(wq, ws, x.dtype))
  # Empty arrays carry the operands' dtypes to the backward pass (residuals are arrays).
  dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
  return y, (xq, xs, wq, ws, dtypes)


def _backward(spec, residuals, g):
  xq, xs, wq, ws, (x_dtype, w_dtype) = residuals
  gq, gs = quantize(g, E5M2)
  x, w = dequantize(xq, xs, g.dtype), dequantize(wq, ws, g.dtype)
  _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), x, w)
  dx, dw = vjp(dequantize(gq, gs, g.dtype))
  return dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype)


einsum.defvjp(_forward, _backward)

# precision.matmul -> the einsum the decoder's seven projections use.
EINSUMS = {"default": jnp.einsum, "fp8": einsum}
