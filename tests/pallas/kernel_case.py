"""The small bf16 model and request the consumer-level kernel tests share: head dims and output
rank widened to the kernels' tiles (64; optionally the MoE's to 128), two documents and a
question, 20 % budget."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from redknot_jax import config
from redknot_jax.init import random_model
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.profile import tiny_profile


def kernel_case(moe_tiles: bool = False):
    """(cfg, model, profile, artifacts, request); the vocabulary (96) divides tp = 2.
    moe_tiles: hidden size and expert width 128 too (the grouped-matmul kernel's tiles), and no
    discrete choice that a last-bit difference can flip: every MoE layer hash-routed and the
    indexer's top-k wider than the entries (all selected). With learned routing and top-3 of
    ~20 entries, bf16 rounding alone moved a query row's logits by up to 10 % between two GPU
    runs of the same comparison (H200, 2026-12-01): a test of the kernel must not see that."""
    wide = dict(hidden_size=128, moe_inter_dim=128, index_topk=64,
                mlp_layer_types=("hash_moe",) * config.tiny("csa").num_layers) if moe_tiles else {}
    cfg = dataclasses.replace(config.tiny("csa"), head_dim=64, o_lora_rank=64, index_head_dim=64, vocab_size=96,
                              **wide)
    model = random_model(cfg, seed=5, dtype=jnp.bfloat16)
    prof = dataclasses.replace(tiny_profile(cfg.num_layers), budget_override=0.2, tail_rows=8)
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, cfg.vocab_size, n) for n in (40, 33)]
    arts = [build_artifact(model, prof, d, checkpoint_fingerprint="fp") for d in docs]
    req = Request([Segment(docs[0], arts[0]), Segment(docs[1], arts[1]),
                   Segment(rng.integers(2, cfg.vocab_size, 9))], query_rows=(60, 81))
    return cfg, model, prof, arts, req
