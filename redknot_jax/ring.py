"""Position-keyed ring buffers: the sliding K=V window and open compressor windows.

A ring of R slots holds the R most recent positions; position p lives in slot p % R. Reading
returns them in position order so they can be concatenated in front of a chunk ("ext"
sequences whose index i is position start + i).
"""

import jax
import jax.numpy as jnp


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Per-batch row gather: x [b, l, ...], idx [b, ...] -> x[b, idx[b]]."""
    return jax.vmap(lambda xb, ib: xb[ib])(x, idx)


def ring_read(ring: jax.Array, pos0: jax.Array) -> jax.Array:
    """Slots of ring [b, R, ...] ordered as positions pos0-R .. pos0-1 (pos0 [b])."""
    r = ring.shape[1]
    idx = jnp.mod(pos0[:, None] - r + jnp.arange(r), r)
    return gather_rows(ring, idx)


def ring_write(ext: jax.Array, ext_pos0: jax.Array, end: jax.Array, r: int) -> jax.Array:
    """The ring of the R positions ending at end-1, taken from ext [b, l, ...] whose index i is
    position ext_pos0 + i. Requires ext_pos0 <= end - R (true when ext starts with a ring)."""
    slot = jnp.arange(r)
    first = end[:, None] - r
    p = first + jnp.mod(slot - first, r)  # the position that lands in each slot
    return gather_rows(ext, p - ext_pos0[:, None])


def scatter_rows(buf: jax.Array, idx: jax.Array, vals: jax.Array) -> jax.Array:
    """buf [b, n, ...] with rows idx [b, j] set to vals [b, j, ...]; idx >= n is dropped."""
    return jax.vmap(lambda bb, ib, vb: bb.at[ib].set(vb.astype(bb.dtype), mode="drop"))(buf, idx, vals)
