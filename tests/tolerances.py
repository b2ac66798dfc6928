"""The one tolerance table. Each entry: (relative error bound, why). Never loosen silently."""

TOL = {
    # fp32 both sides, highest matmul precision; differences are summation order only
    # (reference §13.5 measured ~1e-6 between cached decode and recomputation).
    "parity_fp32": (1e-4, "fp32 vs PyTorch fp32: summation order only"),
    # Same JAX program, different chunking: only the order of fp32 sums differs.
    "chunked_vs_oneshot": (1e-5, "fp32, identical math, different chunk boundaries"),
    # The same fp32 weights restored onto another tensor-parallel mesh: GSPMD may split a
    # contraction across devices, which changes only the fp32 summation order.
    "resharded_fp32": (1e-5, "fp32, same weights, different mesh (summation order only)"),
    # The jitted consumer vs the eager reference runtime: same math in fp32, keys turned by R(D)
    # instead of queries by R(-D) (an orthogonal rotation) and a different summation order.
    "consumer_vs_reference": (1e-5, "fp32, rotation on the other side of the dot product"),
    # Mosaic GPU kernels vs their jnp references: bf16 operands and output (bf16 output
    # rounding alone is ~3e-3 relative); lse is an absolute bound in natural-log units.
    "kernel_bf16_o": (1e-2, "bf16 kernel output vs fp32-accumulated reference"),
    "kernel_bf16_lse_abs": (2e-2, "bf16 score rounding, absolute in log units"),
    # A perturbed weight must move logits far beyond the parity bound.
    "negative_control_min": (1e-3, "a 1% perturbation of one weight must be visible"),
}


def rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
