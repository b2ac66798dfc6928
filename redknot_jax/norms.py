"""RMSNorm and the unweighted RMSNorm (spec §2): statistics in fp32, one cast back."""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Weighted RMSNorm; the weight is kept in fp32 as the reference does."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
