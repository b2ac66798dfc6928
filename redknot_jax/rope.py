"""Interleaved partial RoPE on the trailing `r` dims, and DeepSeek-V4's two tables (spec §2).

Pair i of the rope slice is (v[n+2i], v[n+2i+1]) rotated by angle p * inv_freq[i]. The
`main` table (theta 10000, unscaled) serves sliding-only layers; the `compress` table
(theta 160000, YaRN on the frequencies, no mscale) serves every CSA/HCA layer.
"""

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.config import ModelConfig, yarn_lo_hi


def inv_freq(cfg: ModelConfig, compressed: bool) -> np.ndarray:
    """Per-pair angular frequency [r/2] (fp32) of the layer's table."""
    r = cfg.rope_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    base = 1.0 / (theta ** (np.arange(0, r, 2, dtype=np.float32) / np.float32(r)))
    if not compressed or cfg.yarn is None:
        return base.astype(np.float32)
    lo, hi = yarn_lo_hi(cfg)
    if lo == hi:
        hi += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(r // 2, dtype=np.float32) - lo) / (hi - lo), 0.0, 1.0)
    return (base / cfg.yarn.factor * ramp + base * (1.0 - ramp)).astype(np.float32)


def apply_rope(x: jax.Array, pos: jax.Array, freqs, inverse: bool = False) -> jax.Array:
    """Rotate the trailing 2*len(freqs) dims of x [..., t, (h,) k] at positions pos [..., t].

    `pos` broadcasts against x's leading dims; if x has one more axis than pos+1 (a heads
    axis), the angle is shared across it. Rotation in fp32, result in x's dtype.
    """
    freqs = jnp.asarray(freqs, jnp.float32)
    r = 2 * freqs.shape[0]
    ang = pos.astype(jnp.float32)[..., None] * freqs  # [..., t, r/2]
    while ang.ndim < x.ndim:  # heads axis between t and k
        ang = ang[..., None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    rot = x[..., -r:].astype(jnp.float32)
    a, b = rot[..., 0::2], rot[..., 1::2]  # the interleaved pairs
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    return jnp.concatenate([x[..., :-r], out.astype(x.dtype)], axis=-1)
