"""Relocation without rewriting caches (DESIGN §4): rotated queries, per-segment partial
attention with log-sum-exp, output-phase restore, and the merge with the sink entering once.

For a query at absolute t and a key of a segment placed at offset D (canonical position p,
absolute p + D), <R(t) q, R(p + D) k> = <R(t - D) q, R(p) k>: rotate the query's RoPE slice by
-D and attend the canonical latents as stored. Because V = K, the segment's partial output
carries R(p) in its RoPE slice; turning it by R(D) puts it in the absolute frame, after which
the layer's native inverse output RoPE at t applies unchanged.

Below both the runtime and the kernels (it imports only `rope`): the eager reference runtime
(`reuse/runtime.py`) and the attention kernels' references (`pallas/seg_attention.py`,
`pallas/sparse_attention.py`) are built from these identities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from redknot_jax.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST


def rotate(x: jax.Array, offset, freqs) -> jax.Array:
    """Turn the RoPE slice of x [t, (h,) k] by angle offset * freq (offset may be negative)."""
    pos = jnp.full((x.shape[0],), offset, jnp.int32)
    return apply_rope(x, pos, freqs)


def partial_attention(q: jax.Array, keys: jax.Array, mask: jax.Array, scale: float):
    """One segment's attention, K = V = keys [s, k]; q [t, h, k]; mask broadcasts to [t, h, s].

    Returns (o [t, h, k] normalised within the segment, lse [t, h]); a row with no visible key
    has o = 0 and lse = -inf, so it drops out of the merge.
    """
    lg = jnp.einsum("thk,sk->ths", q, keys, preferred_element_type=jnp.float32, precision=HIGHEST) * scale
    lg = jnp.where(mask, lg, -jnp.inf)
    mx = jnp.max(lg, axis=-1)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(lg - safe[..., None])
    den = jnp.sum(p, axis=-1)
    o = jnp.einsum("ths,sk->thk", p.astype(keys.dtype), keys, preferred_element_type=jnp.float32,
                   precision=HIGHEST) / jnp.where(den > 0, den, 1.0)[..., None]
    return o, jnp.where(den > 0, safe + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)


def merge_partials(parts, sink: jax.Array):
    """Combine per-segment (o, lse) with the per-head sink logit counted once.

    o = sum_i exp(lse_i - L) o_i with L = logsumexp(lse_1..n, sink): exactly one softmax over
    the union of all segments' keys plus the sink."""
    lses = jnp.stack([lse for _, lse in parts], 0)  # [n, t, h]
    total = jnp.logaddexp(jax.nn.logsumexp(lses, axis=0), sink.astype(jnp.float32)[None, :])
    o = sum(jnp.exp(lse - total)[..., None] * o for o, lse in parts)
    return o, total
