"""Lightning Indexer scores: the Mosaic GPU kernel against `index_scores` in interpret mode (CPU)
and on a GPU, the top-k it leads to, its CUDA lowering (CPU), and bad inputs."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax.indexer import select_topk
from redknot_jax.pallas import indexer_scores as ix
from redknot_jax.pallas.indexer_scores import index_scores

SCORE_TOL = 1e-5  # fp32 sums in another order: max |error| relative to the largest |score|


def _check(q, w, keys, got, k):
    want = index_scores(q, w, keys)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < SCORE_TOL
    # the picks equal the reference's except where its k-th and (k+1)-th scores are closer than
    # the rounding that separates the two sums
    vis = jnp.ones(got.shape, bool)
    a = np.sort(np.asarray(select_topk(want, vis, k)[0]), -1)
    b = np.sort(np.asarray(select_topk(got, vis, k)[0]), -1)
    differ = (a != b).any(-1)
    ranked = -np.sort(-np.asarray(want), -1)
    gap = (ranked[..., k - 1] - ranked[..., k]) / np.abs(np.asarray(want)).max()
    assert (gap[differ] < SCORE_TOL).all(), f"{int(differ.sum())} rows pick differently without a near-tie"


@pytest.mark.parametrize("b,t,s,heads,dim,block_s,steps", [(2, 70, 200, 4, 128, 64, 2), (1, 64, 128, 8, 64, 128, 3)])
def test_kernel_matches_reference_interpret(b, t, s, heads, dim, block_s, steps):
    """The kernel itself in Mosaic GPU interpret mode (CPU; natively on a GPU): rows and entries
    not multiples of the tile, several requests, negative head weights."""
    q, w, keys = ix.make_problem(jax.random.key(t + s), t=t, s=s, b=b, heads=heads, dim=dim)
    got = ix.indexer_scores(q, w, keys, config=ix.ScoresConfig(block_s=block_s, steps=steps))
    assert bool((w < 0).any()) and bool((w > 0).any())
    _check(q, w, keys, got, k=min(16, s - 1))


def test_kernel_lowers_for_cuda():
    """Flash indexer shapes (64 heads of 128): the Mosaic GPU lowering runs on CPU."""
    q, w, keys = ix.make_problem(jax.random.key(0), t=256, s=1024)
    for bs in (64, 128):
        f = jax.jit(lambda *a: ix.indexer_scores(*a, config=ix.ScoresConfig(block_s=bs), interpret=False))
        assert "mosaic_gpu" in f.trace(q, w, keys).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_raise():
    q, w, keys = ix.make_problem(jax.random.key(1), t=8, s=64, heads=2, dim=64)
    with pytest.raises(ValueError, match="bf16"):
        ix.indexer_scores(q.astype(jnp.float32), w, keys)
    with pytest.raises(ValueError, match="fp32 head weights"):
        ix.indexer_scores(q, w.astype(jnp.bfloat16), keys)
    with pytest.raises(ValueError, match="multiple of 64"):
        ix.indexer_scores(q[..., :32], w, keys[..., :32])
    with pytest.raises(ValueError, match=r"keys \[b, s, j\]"):
        ix.indexer_scores(q, w, keys[..., :32])
    with pytest.raises(ValueError, match="block_s"):
        ix.ScoresConfig(block_s=256)
    with pytest.raises(ValueError, match="steps"):
        ix.ScoresConfig(steps=0)
    assert ix.scores_unsupported(64, 128, jnp.bfloat16) is None
    assert "shared memory" in ix.scores_unsupported(4096, 128, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("seed,t,s,block_s", [(0, 256, 16384, 128), (1, 1000, 5000, 64), (2, 64, 512, 128)])
def test_kernel_matches_reference_gpu(seed, t, s, block_s):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, w, keys = ix.make_problem(jax.random.key(seed), t=t, s=s)
    f = lambda: ix.indexer_scores(q, w, keys, config=ix.ScoresConfig(block_s=block_s))
    jnp.full((t + 64, s + 128), jnp.nan, jnp.float32).block_until_ready().delete()  # poison freed memory
    got = jax.block_until_ready(f())
    assert bool(jnp.all(jnp.isfinite(got)))
    _check(q, w, keys, got, k=min(512, s - 1))


def test_consumer_kernel_sets(monkeypatch):
    """Consumer(kernels=): 'auto' runs no kernel off a GPU (interpret mode is for tests), names
    resolve to a canonical set, unknown names and kernels the model cannot run are refused."""
    import dataclasses

    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.pallas import resolve_kernels

    cfg = dataclasses.replace(config.tiny("csa"), head_dim=64, o_lora_rank=64, index_head_dim=64)
    model = random_model(cfg, seed=0, dtype=jnp.bfloat16)
    assert resolve_kernels("auto", model, 1) == ("indexer,restore" if jax.default_backend() == "gpu" else "")
    assert resolve_kernels("xla", model, 1) == resolve_kernels("", model, 1) == ""  # a resolved set resolves to itself
    assert resolve_kernels("restore,indexer", model, 1) == "indexer,restore"
    with pytest.raises(ValueError, match="ragged_dot kernel cannot run"):  # "mosaic" is all four; the
        resolve_kernels("mosaic", model, 1)  # MoE kernel: a GPU and tile-sized expert matmuls
    with pytest.raises(ValueError, match="triton"):
        resolve_kernels("indexer,triton", model, 1)
    with pytest.raises(ValueError, match="restore kernel cannot run.*Global head"):
        resolve_kernels("restore", model, 2)
    # outside the consumer (Engine, build_artifact) the restoration kernel has nothing to run
    assert resolve_kernels("restore,indexer", model) == "indexer" and resolve_kernels("restore", model) == ""
    fp32 = random_model(cfg, seed=0, dtype=jnp.float32)
    assert resolve_kernels("auto", fp32, 1) == ""  # auto picks only what the model can run
    with monkeypatch.context() as m:  # on a GPU: the faster kernels this tiny model's shapes allow,
        m.setattr(jax, "default_backend", lambda: "gpu")
        assert resolve_kernels("auto", model, 1) == "indexer,restore"  # the restoration in the consumer only
        assert resolve_kernels("auto", model) == "indexer"
    with pytest.raises(ValueError, match="indexer kernel cannot run.*bf16"):
        resolve_kernels("indexer", fp32, 1)


def test_engine_and_builder_run_the_kernel_in_prefill(monkeypatch):
    """generate.Engine(kernels="indexer") (the notebook API) runs the indexer kernel in its
    prefill chunks, interpret mode on CPU, and gives the prefill logits and decode tokens of
    kernels="xla"; decode steps run XLA. build_artifact(kernels="indexer") keeps the same
    artifact payload as "xla" up to the kernel's fp32 rounding."""
    from redknot_jax.generate import Engine, SamplingParams
    from redknot_jax.reuse.artifact import build_artifact
    from tests.pallas.kernel_case import kernel_case
    from tests.tolerances import TOL, rel_err

    cfg, model, prof, _, req = kernel_case()
    traced = []
    kernel = ix.indexer_scores
    monkeypatch.setattr(ix, "indexer_scores", lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    prompts = [list(map(int, req.tokens[:50])), list(map(int, req.tokens[10:41]))]
    xla, ker = Engine(model, capacity=128, kernels="xla"), Engine(model, capacity=128, kernels="indexer")
    assert (xla.kernels, ker.kernels) == ("", "indexer")
    params = SamplingParams(max_new_tokens=4)
    a, b = xla.generate(prompts, params), ker.generate(prompts, params)
    assert traced and all(shape[1] > 1 for shape in traced)  # prefill chunks only
    assert rel_err(b.first_logits, a.first_logits) < TOL["kernel_bf16_o"][0]
    assert a.tokens == b.tokens
    doc = req.tokens[:40]
    pa = build_artifact(model, prof, doc, checkpoint_fingerprint="fp", kernels="xla").payload()
    n = len(traced)
    pb = build_artifact(model, prof, doc, checkpoint_fingerprint="fp", kernels="indexer").payload()
    assert len(traced) > n and pa.keys() == pb.keys()
    for k in pa:
        if jnp.issubdtype(pa[k].dtype, jnp.floating):
            assert rel_err(np.asarray(pb[k], np.float32), np.asarray(pa[k], np.float32)) < TOL["kernel_bf16_o"][0], k
