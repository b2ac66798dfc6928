"""CSA / HCA compressor (spec §4.4) and its chunk-incremental form.

Tokens are projected to k_j = W_kv x_j and z_j = W_gate x_j + ape[j mod m] (fp32). Window w
covers positions [w*m, (w+1)*m), aligned to absolute positions. HCA pools its own window;
CSA (overlap) pools 2m slots: the A halves ([:dk]) of window w-1 and the B halves ([dk:]) of
window w. Per-channel softmax over the slots, RMSNorm, RoPE at position w*m. An entry exists
once its window's last token has been seen.

State between chunks: a ring of the last c*m projected tokens (c = 2 for CSA), which is the
open window plus, for CSA, the previous window whose A halves the next entry needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.norms import RMSNorm
from redknot_jax.rope import apply_rope
from redknot_jax.ring import gather_rows, ring_read, ring_write

HIGHEST = jax.lax.Precision.HIGHEST


class Compressor(nnx.Module):
    def __init__(self, d: int, dk: int, m: int, overlap: bool, eps: float, dtype):
        c = 2 if overlap else 1
        self.wkv = nnx.Param(jnp.zeros((c * dk, d), dtype))
        self.wgate = nnx.Param(jnp.zeros((c * dk, d), dtype))
        self.ape = nnx.Param(jnp.zeros((m, c * dk), jnp.float32))
        self.norm = RMSNorm(dk, eps)
        self.m, self.dk, self.overlap = m, dk, overlap

    @property
    def ring_size(self) -> int:
        return (2 if self.overlap else 1) * self.m

    def init_state(self, b: int) -> dict:
        shape = (b, self.ring_size, self.wkv.shape[0])
        return {"kv": jnp.zeros(shape, jnp.float32), "gate": jnp.zeros(shape, jnp.float32)}

    def project(self, x: jax.Array, pos: jax.Array):
        """x [b, t, d] -> (k, z) [b, t, c*dk] in fp32 (reference keeps the compressor in fp32)."""
        kv = jnp.einsum("btd,cd->btc", x, self.wkv[...], preferred_element_type=jnp.float32, precision=HIGHEST)
        gate = jnp.einsum("btd,cd->btc", x, self.wgate[...], preferred_element_type=jnp.float32,
                          precision=HIGHEST)
        return kv, gate + self.ape[...][jnp.mod(pos, self.m)]

    def pool(self, kv: jax.Array, gate: jax.Array, w: jax.Array, freqs) -> jax.Array:
        """Slots kv, gate [b, j, c, dk] of windows w [b, j] -> entries [b, j, dk] (fp32)."""
        alpha = jax.nn.softmax(gate, axis=2)
        pooled = jnp.sum(alpha * kv, axis=2)
        pooled = self.norm(pooled)
        return apply_rope(pooled, w * self.m, freqs)

    def __call__(self, x: jax.Array, pos0: jax.Array, n_new: jax.Array, state: dict, freqs):
        """Compress a chunk x [b, t, d] at positions pos0 + [0, t), of which n_new are real.

        Returns (entries [b, j, dk] fp32, entry ids [b, j] with n_max-safe -1 for windows not
        closed in this chunk, new state). j = t // m + 1 candidate windows.
        """
        b, t, _ = x.shape
        m, dk, r = self.m, self.dk, self.ring_size
        pos = pos0[:, None] + jnp.arange(t)
        kv_new, gate_new = self.project(x, pos)
        ext_kv = jnp.concatenate([ring_read(state["kv"], pos0), kv_new], axis=1)  # [b, r+t, c*dk]
        ext_gate = jnp.concatenate([ring_read(state["gate"], pos0), gate_new], axis=1)
        ext_pos = pos0[:, None] - r + jnp.arange(r + t)
        ext_gate = jnp.where((ext_pos >= 0)[..., None], ext_gate, -jnp.inf)  # before position 0: no slot

        nj = t // m + 1
        w = pos0[:, None] // m + jnp.arange(nj)  # candidate windows [b, j]
        closed = (w + 1) * m <= (pos0 + n_new)[:, None]
        start = w * m - (pos0[:, None] - r)  # ext index of the window's first token
        slots = jnp.arange(m)

        def take(idx, lo, hi):
            idx = jnp.clip(idx, 0, r + t - 1)
            return gather_rows(ext_kv[..., lo:hi], idx), gather_rows(ext_gate[..., lo:hi], idx)

        if self.overlap:
            ka, za = take(start[..., None] - m + slots, 0, dk)  # window w-1, A halves
            kb, zb = take(start[..., None] + slots, dk, 2 * dk)  # window w, B halves
            kv, gate = jnp.concatenate([ka, kb], axis=2), jnp.concatenate([za, zb], axis=2)
        else:
            kv, gate = take(start[..., None] + slots, 0, dk)
        entries = self.pool(kv, gate, w, freqs)
        entries = jnp.where(closed[..., None], entries, 0.0)
        ids = jnp.where(closed, w, -1)
        new_state = {"kv": ring_write(ext_kv, pos0 - r, pos0 + n_new, r),
                     "gate": ring_write(ext_gate, pos0 - r, pos0 + n_new, r)}
        return entries, ids, new_state
