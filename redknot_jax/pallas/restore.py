"""Fused restoration (DESIGN §4, §7): Global-head outputs, the artifact's z_L, the protected-row
mask and the Global / Local column slices of wo_a -> the contiguous projected state z [t, g, o]
ready for the single wo_b. Local rows of unprotected document rows are *replaced* by the
artifact's z_L, never added.

    z[t, g] = W_oa,G[g] . o_G[t, g]  +  (keep[t] ? z_L_art[t, g] : W_oa,L[g] . o_L[t, g])

Status: the jnp reference (the runtime's formulation: project_heads twice, then row
replacement) and `restore_xla`, one pass in XLA over column slices (each head's columns are
multiplied once, not once per role with the other role zeroed). The Mosaic GPU kernel of
issue #7 item 2 is NOT written yet; `restore` is therefore the XLA path and says so.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _check(o, z_art, keep, wo_a, local):
    t, h, k = o.shape
    gk = wo_a.shape[1]
    if gk % k or h % (gk // k):
        raise ValueError(f"restore: wo_a [g*o, (h/g)*k] does not match o [t, h, k]: {wo_a.shape} vs {o.shape}")
    g = h // (gk // k)
    if z_art.shape[:2] != (t, g) or z_art.shape[2] * g != wo_a.shape[0]:
        raise ValueError(f"restore: expected z_art [{t}, {g}, {wo_a.shape[0] // g}], got {z_art.shape}")
    if keep.shape != (t,) or np.shape(local) != (h,):
        raise ValueError(f"restore: expected keep [{t}] and local [{h}], got {keep.shape}, {np.shape(local)}")
    return g


def restore_reference(o, z_art, keep, wo_a, local):
    """The runtime's formulation (reuse/runtime.py: project_heads for ~local and local, then
    _restore_local's row replacement). o [t, h, k] head outputs after inverse output RoPE;
    z_art [t, g, o] artifact z_L aligned to the request rows (ignored where keep is False);
    keep [t] True for unprotected document rows; wo_a [g*o, (h/g)*k]; local [h] (numpy bool).
    Returns z [t, g, o] fp32."""
    g = _check(o, z_art, keep, wo_a, local)
    t = o.shape[0]
    wa = wo_a.reshape(g, -1, wo_a.shape[1])

    def project(heads):
        oh = (o * jnp.asarray(heads, o.dtype)[None, :, None]).reshape(t, g, -1)
        return jnp.einsum("tgi,goi->tgo", oh, wa, preferred_element_type=jnp.float32, precision=HIGHEST)

    z_g = project(~np.asarray(local))
    z_l = jnp.where(keep[:, None, None], z_art.astype(jnp.float32), project(np.asarray(local)))
    return z_g + z_l


def restore_xla(o, z_art, keep, wo_a, local):
    """Same result, one pass: each group's Global and Local column slices of wo_a applied to
    their own heads only (static slices from the profile's head roles)."""
    g = _check(o, z_art, keep, wo_a, local)
    t, h, k = o.shape
    hpg = h // g
    loc = np.asarray(local).reshape(g, hpg)
    if not (loc == loc[:1]).all():
        raise ValueError("restore_xla: every group must have the same Local heads (profile roles)")
    li, gi = np.flatnonzero(loc[0]), np.flatnonzero(~loc[0])
    og = o.reshape(t, g, hpg, k)
    wa = wo_a.reshape(g, -1, hpg, k)
    z_g = jnp.einsum("tgjk,gojk->tgo", og[:, :, gi], wa[:, :, gi], preferred_element_type=jnp.float32,
                     precision=HIGHEST)
    z_l = jnp.einsum("tgjk,gojk->tgo", og[:, :, li], wa[:, :, li], preferred_element_type=jnp.float32,
                     precision=HIGHEST)
    return z_g + jnp.where(keep[:, None, None], z_art.astype(jnp.float32), z_l)


def restore(o, z_art, keep, wo_a, local):
    """Fused restoration entry point; today the XLA path (`restore_xla`), no Mosaic kernel yet."""
    return restore_xla(o, z_art, keep, wo_a, local)
