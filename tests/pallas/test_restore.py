"""Fused restoration: the one-pass XLA path against the runtime's formulation (CPU)."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax.pallas import restore as rs
from tests.tolerances import rel_err


def _problem(seed, t=24, g=4, hpg=8, k=32, o=48):
    ks = jax.random.split(jax.random.key(seed), 4)
    h = g * hpg
    out = jax.random.normal(ks[0], (t, h, k), jnp.float32)
    z_art = jax.random.normal(ks[1], (t, g, o), jnp.float32)
    keep = jax.random.bernoulli(ks[2], 0.6, (t,))
    wo_a = jax.random.normal(ks[3], (g * o, hpg * k), jnp.float32) * 0.1
    local = np.array([(i % hpg) != 0 for i in range(h)])  # head 0 of each group is Global
    return out, z_art, keep, wo_a, local


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_restore_xla_matches_runtime_formulation(seed):
    args = _problem(seed)
    assert rel_err(rs.restore(*args), rs.restore_reference(*args)) < 1e-5


def test_rows_replaced_not_added():
    """Identity: with keep everywhere, z = W_G o_G + z_art exactly; no keep = native wo_a."""
    out, z_art, keep, wo_a, local = _problem(3)
    allk = jnp.ones_like(keep)
    z_g = rs.restore_xla(out, jnp.zeros_like(z_art), allk, wo_a, local)
    assert rel_err(rs.restore_xla(out, z_art, allk, wo_a, local), z_g + z_art) < 1e-6
    g = z_art.shape[1]
    native = jnp.einsum("tgi,goi->tgo", out.reshape(out.shape[0], g, -1), wo_a.reshape(g, -1, wo_a.shape[1]),
                        precision=jax.lax.Precision.HIGHEST)
    assert rel_err(rs.restore_xla(out, z_art * 1e3, jnp.zeros_like(keep), wo_a, local), native) < 1e-5


def test_bad_shapes_raise():
    out, z_art, keep, wo_a, local = _problem(4)
    with pytest.raises(ValueError, match="z_art"):
        rs.restore(out, z_art[:, :2], keep, wo_a, local)
