"""Mosaic GPU kernels of the reuse runtime's hot spots, each beside its jnp reference:
`seg_attention` (relocated segment latent attention) and `restore` (fused restoration)."""
