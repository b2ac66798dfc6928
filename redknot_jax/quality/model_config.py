"""The QA model's configuration and its RedKnot profile (issue 10).

`qa_config()`: a 12-layer DeepSeek-V4 backbone in the Flash pattern (2 sliding-window layers,
then CSA / HCA alternating), 3 hash-routed MoE layers then learned top-6 routing over 16
experts, 16 heads in 2 output groups (8 heads per group, as Flash and Pro), 4 mHC streams.
Scaled to the synthetic task: Flash's 128-row sliding window, so that in a request of ~2K
tokens every fact further back than about five people's sentences is reachable only through
compressed entries (CSA rate 4 with a 64-entry Lightning Indexer top-k; HCA rate 32); the
first curriculum stage (short episodes) fits inside the window, where retrieval is learnt
first (2048-token training rows). A 32-row window learnt no retrieval in 535 H200 steps
then; the shipped model has one all the same (`--set sliding_window=32`, sessions 22-23: after
an associative-recall warm-up it retrieves through compressed entries; its model card).
No YaRN (contexts stay far below the table's length).

`qa_profile()`: the reference profile, 3F-6R-3F (fences as Flash / Pro: 3 + 3), 1 Global + 7
Local heads per group, protection scaled to the task: boundary rows = half the sliding window,
tail = one window. A checkpoint ships its own (`redknot_profile.json`, read by `profile_of`):
the shipped model's is 5F-4R-3F with half the candidate rows protected, ranked by latent
deviation, their latents recomputed, chosen on the validation split (docs/quality.md, session 26).
"""

from __future__ import annotations

import pathlib

from redknot_jax.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig
from redknot_jax.quality.data import BOS, EOS, VOCAB_SIZE
from redknot_jax.reuse.profile import RedKnotProfile

PROFILE_FILE = "redknot_profile.json"  # a checkpoint's own RedKnot profile (RedKnotProfile.to_dict)


def qa_config(**overrides) -> ModelConfig:
    n = overrides.pop("num_layers", 12)
    if n < 4:
        raise ValueError(f"qa_config: at least 4 layers (2 sliding + CSA + HCA), got {n}")
    types = (SLIDING, SLIDING) + tuple((CSA, HCA)[i % 2] for i in range(n - 2))
    base = dict(
        vocab_size=VOCAB_SIZE, hidden_size=192, num_layers=n, num_heads=16, head_dim=64, rope_dim=16,
        q_lora_rank=96, o_groups=2, o_lora_rank=64, n_routed_experts=16, experts_per_tok=6,
        moe_inter_dim=48, routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=128,
        layer_types=types, mlp_layer_types=(HASH_MOE,) * min(3, n) + (MOE,) * max(0, n - 3),
        csa_rate=4, hca_rate=32, index_n_heads=8, index_head_dim=32, index_topk=64,
        rope_theta=10000.0, compress_rope_theta=160000.0, yarn=None, hc_mult=4, hc_sinkhorn_iters=20,
        max_position_embeddings=8192, bos_token_id=BOS, eos_token_id=EOS)
    base.update(overrides)
    return ModelConfig(**base)


def qa_test_config(**overrides) -> ModelConfig:
    """A very small variant for CPU tests (same schedule shape, 6 layers by default)."""
    base = dict(num_layers=6, hidden_size=32, num_heads=8, head_dim=16, rope_dim=8, q_lora_rank=16,
                o_groups=1, o_lora_rank=16, n_routed_experts=8, moe_inter_dim=16, sliding_window=8,
                hca_rate=16, index_n_heads=4, index_head_dim=16, index_topk=8, hc_mult=2,
                hc_sinkhorn_iters=4)
    base.update(overrides)
    return qa_config(**base)


def qa_cpu_config(**overrides) -> ModelConfig:
    """A narrower variant for ~0.5K-token contexts (--config qa-cpu): the same 12-layer
    schedule, hash + learned MoE and 8 heads per output group; hidden 96, head_dim 32, 8
    experts top-4, 2 mHC streams, a 16-row window and HCA rate 16. Still far too slow to train
    on a 2-core CPU (one step of batch 8 x 512 took ~37 s there, 2026-11-29)."""
    base = dict(hidden_size=96, num_heads=16, head_dim=32, rope_dim=8, q_lora_rank=48, o_groups=2,
                o_lora_rank=32, n_routed_experts=8, experts_per_tok=4, moe_inter_dim=32, sliding_window=16,
                hca_rate=16, index_n_heads=4, index_head_dim=16, index_topk=16, hc_mult=2)
    base.update(overrides)
    return qa_config(**base)


def qa_profile(n_layers: int = 12, sliding_window: int = 128, **overrides) -> RedKnotProfile:
    """The QA model's reference RedKnot profile: fences 3 / 3 (1 / 1 below 8 layers), boundary
    rows = half the sliding window, tail = one window; `overrides` replace fields, and the name
    follows the fences (`qa_profile(12, 32, fence_first=5).name == "qa-5F-4R-3F"`)."""
    fence = 3 if n_layers >= 8 else 1
    base = dict(fence_first=fence, fence_last=fence, boundary_rows=max(1, sliding_window // 2),
                tail_rows=sliding_window)
    base.update(overrides)
    ff, fl = base["fence_first"], base["fence_last"]
    base.setdefault("name", f"qa-{ff}F-{n_layers - ff - fl}R-{fl}F")
    return RedKnotProfile(**base)


def profile_of(checkpoint) -> RedKnotProfile:
    """The RedKnot profile a QA checkpoint ships (its `redknot_profile.json`: what `serve.py
    --profile auto` serves and `eval_quality.py` calls "default"), else `qa_profile` for its
    shape."""
    d = pathlib.Path(checkpoint)
    if (d / PROFILE_FILE).is_file():
        return RedKnotProfile.read(d / PROFILE_FILE)
    cfg = ModelConfig.from_json(d / "config.json")
    return qa_profile(cfg.num_layers, cfg.sliding_window)
