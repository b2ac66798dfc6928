"""Mosaic GPU kernels of the reuse runtime's hot spots, each beside its jnp reference:
`seg_attention` (relocated segment latent attention), `restore` (fused restoration),
`indexer_scores` (Lightning Indexer scores), `ragged_dot` (the MoE experts' grouped matmul,
JAX's Hopper kernel) and `sparse_attention` (gathered-key latent attention: the CSA layers'
window + top-k keys, natively and in the consumer's pass B). `KERNELS` names those the runtime chooses among (`resolve_kernels`, used by
the consumer and `generate.Engine`); a resolved set is a comma list of them. "sparse_global" is
the same gathered-key kernel at another call site, the consumer's pass A (the Global heads of
every row, padded to the kernel's 64), so the two can be chosen and timed apart. "seg_attention"
runs in the RedKnot arm's decode steps, in HCA layers: the documents' entries read canonical
from the pool, the queries turned per document.

Kernel files are leaves: each holds its kernel, its reference, its config and its benchmark, and
imports only `mosaic` (what the kernels share), `timing` and modules that import no kernel;
nothing here imports `redknot_jax.reuse` (tests/test_imports.py)."""

import jax

KERNELS = ("indexer", "restore", "ragged_dot", "sparse_attention", "sparse_global", "seg_attention")
DECODE_ONLY = ("seg_attention",)  # run by decode steps only: prefill programs are compiled without them
FASTER = ("indexer", "restore", "ragged_dot", "sparse_attention", "sparse_global")  # measured faster than their XLA references on the H200 (docs/kernels.md)


def resolve_kernels(kernels: str, model, n_global: int | None = None) -> str:
    """The Mosaic GPU kernels to run, as a canonical comma list of KERNELS ("" = none).

    "xla" or "": none (the references). "mosaic": all. A comma list of KERNELS: those (so a
    resolved set resolves to itself). "auto" (the
    default): on a GPU, those measured faster than XLA (`FASTER`) that this model can run; off a
    GPU none (interpret mode is for tests). A kernel named explicitly that the model cannot run
    (dtype, tiles, Global heads per group, no GPU) raises ValueError. n_global: the profile's
    Global heads per output group, for the restoration kernel; None outside the RedKnot consumer
    (`generate.Engine`, `build_artifact`), where that kernel, "sparse_global" (pass A) and
    "seg_attention" (RedKnot decode) have
    nothing to run and are left out of the set, so one `--kernels` value serves the consumer, the
    engine and the builds."""
    from redknot_jax.config import CSA, HCA
    from redknot_jax.pallas.indexer_scores import scores_unsupported
    from redknot_jax.pallas.ragged_dot import ragged_dot_unsupported
    from redknot_jax.pallas.restore import restore_unsupported
    from redknot_jax.pallas.seg_attention import seg_attention_unsupported
    from redknot_jax.pallas.sparse_attention import HEADS, sparse_attention_unsupported

    cfg, gpu = model.cfg, jax.default_backend() == "gpu"
    why = {"restore": None if n_global is None
           else restore_unsupported(cfg.head_dim, cfg.o_lora_rank, n_global, model.dtype),
           "indexer": scores_unsupported(cfg.index_n_heads, cfg.index_head_dim, model.dtype)
           if CSA in cfg.layer_types else None,
           "ragged_dot": "JAX's kernel has no interpret mode: it runs on a GPU only" if not gpu else
           ragged_dot_unsupported(cfg.hidden_size, cfg.moe_inter_dim, model.dtype)
           or ragged_dot_unsupported(cfg.moe_inter_dim, cfg.hidden_size, model.dtype),
           "sparse_attention": sparse_attention_unsupported(cfg.num_heads, cfg.head_dim, model.dtype)
           if CSA in cfg.layer_types else "no CSA layer"}
    # pass A pads its Global heads to the kernel's 64: the head dim and dtype decide
    why["sparse_global"] = (sparse_attention_unsupported(HEADS, cfg.head_dim, model.dtype)
                            if CSA in cfg.layer_types else "no CSA layer")
    # the RedKnot arm's decode steps, HCA layers
    why["seg_attention"] = (seg_attention_unsupported(cfg.num_heads, cfg.head_dim, cfg.rope_dim, model.dtype, gpu)
                            if HCA in cfg.layer_types else "no HCA layer")
    if kernels == "auto":
        names = [k for k in FASTER if why[k] is None] if gpu else []
    else:
        names = {"xla": [], "": [], "mosaic": list(KERNELS)}.get(kernels, kernels.split(","))
    bad = [k for k in names if k not in KERNELS]
    if bad:
        raise ValueError(f"kernels: expected 'auto', 'xla', 'mosaic' or a comma list of {KERNELS}, got {kernels!r}")
    for k in names:
        if why[k]:
            raise ValueError(f"kernels={kernels!r}: the {k} kernel cannot run this model: {why[k]}")
    consumer_only = ("restore", "sparse_global", "seg_attention")
    return ",".join(k for k in KERNELS if k in names and (k not in consumer_only or n_global is not None))


def kernel_mode(kernels: str, name: str) -> str:
    """"mosaic" if the resolved kernel set `kernels` runs kernel `name`, else "xla"."""
    if name not in KERNELS:
        raise ValueError(f"kernel_mode: unknown kernel {name!r}; known: {KERNELS}")
    return "mosaic" if name in kernels.split(",") else "xla"
