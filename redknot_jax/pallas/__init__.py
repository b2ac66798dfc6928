"""Mosaic GPU kernels of the reuse runtime's hot spots, each beside its jnp reference:
`seg_attention` (relocated segment latent attention), `restore` (fused restoration) and
`indexer_scores` (Lightning Indexer scores)."""

import jax


def interpret_params(interpret: bool | None):
    """The `interpret=` of a `plgpu.kernel`: Mosaic GPU interpret mode when asked, None = off a
    GPU only (so CPU CI runs the kernels themselves)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
