"""Mosaic GPU kernels of the reuse runtime's hot spots, each beside its jnp reference:
`seg_attention` (relocated segment latent attention), `restore` (fused restoration),
`indexer_scores` (Lightning Indexer scores) and `ragged_dot` (the MoE experts' grouped matmul,
JAX's Hopper kernel). `KERNELS` names those the runtime chooses among
(`redknot_jax.reuse.consumer.resolve_kernels`); a resolved set is a comma list of them."""

import jax

KERNELS = ("indexer", "restore", "ragged_dot")


def kernel_mode(kernels: str, name: str) -> str:
    """"mosaic" if the resolved kernel set `kernels` runs kernel `name`, else "xla"."""
    if name not in KERNELS:
        raise ValueError(f"kernel_mode: unknown kernel {name!r}; known: {KERNELS}")
    return "mosaic" if name in kernels.split(",") else "xla"


def interpret_params(interpret: bool | None):
    """The `interpret=` of a `plgpu.kernel`: Mosaic GPU interpret mode when asked, None = off a
    GPU only (so CPU CI runs the kernels themselves)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
