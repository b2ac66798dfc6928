"""What the Mosaic GPU kernels share: interpret mode off a GPU, the warp specialisation of a
3-warpgroup CTA and the finish of an online softmax. A leaf: it imports no kernel, so every
kernel file imports from here (and `timing.py`) only."""

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)  # the kernels' exp2 works in log2 units
LN2 = math.log(2.0)


def interpret_params(interpret: bool | None):
    """The `interpret=` of a `plgpu.kernel`: Mosaic GPU interpret mode when asked, None = off a
    GPU only (so CPU CI runs the kernels themselves)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def softmax_finish(m_i, l_i):
    """A consumer's online-softmax statistics (running max m_i in log2 units, sum l_i) ->
    (1 / l_i, lse in natural log); rows that saw no key: 0 and -inf (seg_attention's and
    sparse_attention's kernels)."""
    ok = l_i > 0
    inv = jnp.where(ok, 1.0 / jnp.where(ok, l_i, 1.0), 0.0)
    return inv, jnp.where(ok, (m_i + jnp.log2(jnp.where(ok, l_i, 1.0))) * LN2, -jnp.inf)


def specialise(wg, consumer, producer):
    """Warp specialisation of a 3-warpgroup CTA: warpgroups 0 and 1 run consumer(0) and
    consumer(1), warpgroup 2 the producer (seg_attention's, sparse_attention's and restore's
    kernels)."""
    import jax.experimental.pallas as pl

    for w in (0, 1):
        pl.when(wg == w)(lambda w=w: consumer(w))
    pl.when(wg == 2)(producer)
