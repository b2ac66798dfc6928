"""Relocated segment latent attention: the jnp reference against relocation's identity (CPU),
the kernel's Mosaic GPU lowering (CPU, no GPU needed), and kernel vs reference (GPU)."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax.attention import sink_softmax_attend
from redknot_jax.pallas import seg_attention as sa
from redknot_jax.relocation import rotate
from redknot_jax.rope import apply_rope
from tests.tolerances import TOL, rel_err

# bf16 operands both sides (q, keys, P in PV), fp32 statistics; the kernel differs from the
# reference in summation order, exp2 with approx math, and rotations through hi+lo bf16
# matrices. Measured on H200: 3.3e-3 and 2e-5 (docs/results/kernels_seg_attention_h200.json).
KERNEL_TOL_O = TOL["kernel_bf16_o"][0]
KERNEL_TOL_LSE = TOL["kernel_bf16_lse_abs"][0]


def _absolute_frame_attention(args, kw):
    """The same attention written natively: keys turned into the absolute frame (R(D) per
    segment), query unrotated, one softmax over all visible keys plus the sink
    (attention.sink_softmax_attend). Relocation's identity says the reference equals this."""
    q, keys, segs, offs, lo, hi, sink, freqs = args
    gk = kw["gkeys"]
    t = q.shape[0]
    sets = []
    for j, sg in enumerate(segs):
        if sg.src == 0:
            kj = keys[sg.start:sg.end].astype(jnp.float32)
            kabs = apply_rope(kj, jnp.full((kj.shape[0],), offs[j]), freqs)
            idx = sg.start + jnp.arange(sg.end - sg.start)
            mask = (idx[None] >= lo[:, j:j + 1]) & (idx[None] < hi[:, j:j + 1])
            sets.append((kabs[None], mask[None, :, None, :], "bthk,bsk->bths"))
        else:
            g = gk.shape[0] // t
            kg = gk.reshape(t, g, -1).astype(jnp.float32)
            idx = jnp.arange(t)[:, None] * g + jnp.arange(g)[None]
            mask = (idx >= lo[:, j:j + 1]) & (idx < hi[:, j:j + 1])
            sets.append((kg[None], mask[None, :, None, :], "bthk,btwk->bthw"))
    o, lse = sink_softmax_attend(q.astype(jnp.float32)[None], sets, sink, kw["scale"])
    return o[0], lse[0]


@pytest.mark.parametrize("seed,kw", [
    (0, dict(t=3, doc_len=256, n_docs=2, gathered=16, query_pos="decode")),
    (1, dict(t=40, doc_len=384, n_docs=3, gathered=0, query_pos="prefill")),
])
def test_reference_is_relocated_native_attention(seed, kw):
    """Identity: rotating q by -D per segment, attending canonical keys and turning the partial
    output by +D, merged with the sink once, equals one softmax over absolute-frame keys."""
    args, kwargs = sa.make_problem(jax.random.key(seed), dtype=jnp.float32, **kw)
    o, lse = sa.seg_attention_reference(*args, **kwargs)
    o2, lse2 = _absolute_frame_attention(args, kwargs)
    assert rel_err(o, o2) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2), atol=1e-4)
    # a wrong offset must break it (negative control)
    bad = args[:3] + (args[3] + 1,) + args[4:]
    assert rel_err(sa.seg_attention_reference(*bad, **kwargs)[0], o2) > 1e-3


def test_rotation_tables_match_rotate():
    """q_rope @ (hi + lo) is rotate(q, -D) to ~bf16^2; the transition chain ends at R(D_last)."""
    freqs = jnp.asarray(1.0 / (160000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64)))
    d = jnp.asarray([5, 70000, 1234], jnp.int32)
    m = sa.rotation_tables(d, freqs).astype(jnp.float32)
    x = jax.random.normal(jax.random.key(3), (7, 64), jnp.float32)
    for j in range(3):
        want = rotate(x, -int(d[j]), freqs)
        assert rel_err(x @ (m[j, 0] + m[j, 1]), want) < 1e-5
    # x in frame D_0, moved through every transition and finally into the absolute frame
    y = x
    for j in range(1, 4):
        y = y @ (m[j, 2] + m[j, 3])
    assert rel_err(y, rotate(x, int(d[0]), freqs)) < 1e-5


def test_unsupported_shapes_raise():
    args, kwargs = sa.make_problem(jax.random.key(0), t=1, doc_len=256, n_docs=1, gathered=0, query_pos="decode")
    q = args[0][:, :32]
    with pytest.raises(ValueError, match="heads"):
        sa.seg_attention(q, *args[1:6], args[6][:32], args[7], **kwargs)
    with pytest.raises(ValueError, match="bf16"):
        sa.seg_attention(args[0].astype(jnp.float32), *args[1:], **kwargs)
    with pytest.raises(ValueError, match="block_kv"):
        sa.SegAttentionConfig(block_kv=32)
    with pytest.raises(ValueError, match="slots"):
        sa.SegAttentionConfig(slots=3)
    with pytest.raises(ValueError, match="num_splits"):
        sa.SegAttentionConfig(num_splits=0)


def test_the_runtime_refuses_the_kernel_where_it_cannot_run():
    """`resolve_kernels("seg_attention")` names why: heads / dims / RoPE dims other than the
    kernel's, another dtype, no HCA layer, no GPU (no interpret mode); "auto" never picks it
    (slower than XLA at decode)."""
    import dataclasses

    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.pallas import FASTER, resolve_kernels

    assert "seg_attention" not in FASTER
    base = config.tiny("mixed")
    wide = dataclasses.replace(base, num_heads=64, head_dim=512, rope_dim=64, index_head_dim=64, o_groups=8,
                               o_lora_rank=32)
    cases = [(random_model(base, seed=0, dtype=jnp.bfloat16), r"\(64, 512, 64\), got \(8, 32, 8\)"),
             (random_model(wide, seed=0, dtype=jnp.float32), "bf16 q / keys expected"),
             (random_model(dataclasses.replace(config.tiny("csa"), num_heads=64, head_dim=512, rope_dim=64,
                                               index_head_dim=64, o_groups=8, o_lora_rank=32),
                           seed=0, dtype=jnp.bfloat16), "no HCA layer")]
    if jax.default_backend() != "gpu":
        cases.append((random_model(wide, seed=0, dtype=jnp.bfloat16), "runs on a GPU only"))
    for model, why in cases:
        with pytest.raises(ValueError, match=r"seg_attention kernel cannot run this model: .*" + why):
            resolve_kernels("seg_attention", model, 1)


@pytest.mark.parametrize("cfg", [sa.DECODE_CONFIG, sa.PREFILL_CONFIG])
def test_kernel_lowers_for_cuda(cfg):
    """Mosaic GPU lowering (layout inference, shared-memory budget, TMA shapes) runs on CPU."""
    args, kwargs = sa.make_problem(jax.random.key(0), t=2, doc_len=256, n_docs=2, gathered=64, query_pos="decode")
    segs = args[2]
    rest = args[:2] + args[3:]
    f = jax.jit(lambda *r, g: sa.seg_attention(*r[:2], segs, *r[2:], scale=kwargs["scale"], gkeys=g, config=cfg))
    text = f.trace(*rest, g=kwargs["gkeys"]).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _poisoned_run(f, *a, **k):
    """Best effort poisoning: free a NaN buffer of the output's size right before the call, so
    the allocator hands the kernel memory full of NaN (an unwritten element then shows)."""
    out = jax.eval_shape(lambda: f(*a, **k))
    for s in jax.tree.leaves(out):
        jnp.full(s.shape, jnp.nan, s.dtype).block_until_ready().delete()
    return jax.block_until_ready(f(*a, **k))


@pytest.mark.gpu
@pytest.mark.parametrize("seed,kw,cfg", [
    (0, dict(t=1, doc_len=1024, n_docs=3, gathered=512, query_pos="decode"), sa.DECODE_CONFIG),
    (1, dict(t=4, doc_len=700, n_docs=2, gathered=40, query_pos="decode"), sa.SegAttentionConfig(num_splits=5)),
    (2, dict(t=200, doc_len=1000, n_docs=2, gathered=512, query_pos="prefill"), sa.PREFILL_CONFIG),
    # cases 0-2 passed on an H200 (2026-11-29); all five on 2026-12-04 (kernels_seg_attention_gpu_tests_h200_s31.txt)
    (3, dict(t=96, doc_len=384, n_docs=1, gathered=0, query_pos="prefill"), sa.SegAttentionConfig(num_splits=2)),
    (4, dict(t=33, doc_len=520, n_docs=4, gathered=24, query_pos="prefill"), sa.PREFILL_CONFIG),
])
def test_kernel_matches_reference(seed, kw, cfg):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args, kwargs = sa.make_problem(jax.random.key(seed), **kw)
    o, lse = _poisoned_run(sa.seg_attention, *args, **kwargs, config=cfg)
    ro, rl = sa.seg_attention_reference(*args, **kwargs)
    assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(lse)))
    assert rel_err(o.astype(jnp.float32), ro.astype(jnp.float32)) < KERNEL_TOL_O
    assert float(jnp.max(jnp.abs(lse - rl))) < KERNEL_TOL_LSE


# ----------------------------------------------------------------------------- the runtime's use
def test_pool_runs_are_the_segments_of_canonical_entries():
    """`layout.pool_runs`: maximal stretches of consecutive pool entries with one offset and
    consecutive windows; online entries (src -1), a jump in the pool or a new offset start a new
    run; padded with empty runs to a power of two when bucketing."""
    from redknot_jax.reuse.layout import pool_runs
    from redknot_jax.reuse.pool import Buckets

    src = np.array([10, 11, 12, -1, 14, 15, 16, 40, 41, -1, 50], np.int32)
    d = np.array([5, 5, 5, 5, 5, 5, 90, 90, 90, 0, 0], np.int32)  # a new frame at entry 6
    w = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1], np.int32)
    r = pool_runs(src, d, w, Buckets(8))
    assert r["run_src"].tolist() == [10, 14, 16, 40, 50, 0, 0, 0]
    assert r["run_n"].tolist() == [3, 2, 1, 2, 1, 0, 0, 0]
    assert r["run_d"].tolist()[:4] == [5, 5, 90, 90] and r["run_w"].tolist()[:4] == [0, 4, 0, 1]
    e = pool_runs(np.full(3, -1, np.int32), d[:3], w[:3])  # no pool entry: one empty run
    assert e["run_n"].tolist() == [0]


def _patch_seg_reference(monkeypatch):
    """The reference in the kernel's place (any heads, dims, dtype), the segment count of each
    call recorded."""
    from redknot_jax.reuse import decode

    calls = []

    def ref(q, keys, segments, *a, **kw):
        calls.append(len(segments))
        return sa.seg_attention_reference(q, keys, segments, *a, **kw)

    monkeypatch.setattr(decode, "seg_attention", ref)
    monkeypatch.setattr(sa, "seg_attention", ref)
    return calls


@pytest.mark.parametrize("kind,refresh", [("mixed", "none"), ("hca2", "protected")])
def test_redknot_decode_hands_hca_layers_to_the_kernel(kind, refresh, monkeypatch):
    """With "seg_attention" in the kernel set and the reference in the kernel's place (fp32), a
    RedKnot decode step's HCA layers read the documents' entries canonical from the pool, one
    segment per run at its frame's offset, and give the XLA path's logits (which turns every
    entry into the absolute frame) over steps that close HCA windows, with and without latent
    refresh (refreshed windows' entries are online entries, left out of the runs). Negative
    control: runs placed at offset 0 (no query turn) change the logits."""
    import dataclasses

    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.reuse import layout as layout_mod
    from redknot_jax.reuse.planner import Request
    from redknot_jax.reuse.profile import tiny_profile
    from redknot_jax.reuse.runtime import ReuseRuntime
    from tests.reuse.test_consumer import _request

    calls = _patch_seg_reference(monkeypatch)
    cfg = config.tiny(kind)
    model = random_model(cfg, seed=7, dtype=jnp.float32)
    prof = dataclasses.replace(tiny_profile(cfg.num_layers), budget_override=0.2, tail_rows=8, latent_refresh=refresh)
    req, arts = _request(cfg, prof, model, 3)
    req = Request(req.segments)  # the last row is the query
    xla, ker = ReuseRuntime(model, prof, "fp", kernels="xla"), ReuseRuntime(model, prof, "fp", kernels="xla")
    ker.consumer.kernels = "seg_attention"  # the tiny model's 8 heads: the kernel itself would refuse
    pool = xla.consumer.pool(arts)
    steps = cfg.hca_rate + 3  # the new rows close an HCA window

    def decode(rt):
        res = rt.prefill(req, "redknot", require_reuse=True, pool=pool, decode_rows=steps)
        gen, out = [], []
        for s in range(steps):
            gen.append(int(3 + 5 * s) % cfg.vocab_size)
            out.append(rt.next_logits(req, res, gen))
        return jnp.stack(out), res.decode

    want, _ = decode(xla)
    assert not calls
    got, st = decode(ker)
    assert calls  # traced once per step program
    hca = st.layout.tables["rates"]["hca"]
    assert int(jnp.sum(hca["run_n"])) == int(jnp.sum(hca["src"] >= 0))  # the runs cover the pool entries
    assert rel_err(got, want) < 1e-5
    if refresh == "protected":  # the relocated documents' few windows are all refreshed here
        return
    assert int(jnp.sum(hca["run_n"] > 0)) >= 3  # three documents at three offsets, a run each

    real = layout_mod.pool_runs
    monkeypatch.setattr(layout_mod, "pool_runs", lambda *a: {**real(*a), "run_d": 0 * real(*a)["run_d"]})
    wrong, _ = decode(ker)
    assert rel_err(wrong, want) > 1e-3


@pytest.mark.gpu
def test_redknot_decode_runs_the_kernel_gpu(monkeypatch):
    """The kernel itself in a RedKnot decode: a bf16 model with the kernel's 64 heads x 512
    dims x 64 RoPE dims, three documents at three offsets, 19 steps closing an HCA window.
    `resolve_kernels` accepts it for this model. No discrete choice can flip on a last bit
    (hash-routed experts, an indexer top-k wider than the entries), so the logits' distance to
    the XLA decode is the attention's: within twice the bf16 floor measured here with the
    reference in the kernel's place."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    import dataclasses

    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.pallas import resolve_kernels
    from redknot_jax.reuse.planner import Request
    from redknot_jax.reuse.profile import tiny_profile
    from redknot_jax.reuse.runtime import ReuseRuntime
    from tests.reuse.test_consumer import _request

    base = config.tiny("mixed")
    cfg = dataclasses.replace(base, num_heads=64, head_dim=512, rope_dim=64, index_head_dim=64, o_groups=8,
                              o_lora_rank=32, index_topk=64, mlp_layer_types=("hash_moe",) * base.num_layers)
    model = random_model(cfg, seed=4, dtype=jnp.bfloat16)
    prof = dataclasses.replace(tiny_profile(cfg.num_layers), budget_override=0.2, tail_rows=8)
    req, arts = _request(cfg, prof, model, 3)
    req = Request(req.segments)
    xla = ReuseRuntime(model, prof, "fp", kernels="xla")
    ker = ReuseRuntime(model, prof, "fp", kernels="seg_attention")
    assert ker.consumer.kernels == "seg_attention" == ker.consumer.decode_kernels
    assert ker.consumer.prefill_kernels == ""
    pool = xla.consumer.pool(arts)
    steps = cfg.hca_rate + 3

    def decode(rt):
        res = rt.prefill(req, "redknot", require_reuse=True, pool=pool, decode_rows=steps)
        gen, out = [], []
        for s in range(steps):
            gen.append(int(3 + 5 * s) % cfg.vocab_size)
            out.append(rt.next_logits(req, res, gen).astype(jnp.float32))
        return jnp.stack(out)

    want, got = decode(xla), decode(ker)
    assert bool(jnp.all(jnp.isfinite(got)))
    from redknot_jax.reuse import programs

    calls = _patch_seg_reference(monkeypatch)
    programs.reusable_step_jit.clear_cache()  # the step programs traced with the kernel would be reused otherwise
    floor = rel_err(decode(ReuseRuntime(model, prof, "fp", kernels="seg_attention")), want)
    assert calls
    assert 0 < floor < 0.05
    assert rel_err(got, want) < 2 * floor, (rel_err(got, want), floor)
    with pytest.raises(ValueError, match=r"seg_attention kernel cannot run.*\(64, 512, 64\)"):
        resolve_kernels("seg_attention", random_model(base, seed=0, dtype=jnp.bfloat16), 1)


def test_decode_layer_benchmark_compares_the_consumers_two_forms(monkeypatch):
    """`reuse.decode.main`'s two forms of a decode step's HCA attention at serving-like shapes
    (4 documents, their entries in a pool, 512 own rows): with the reference in the kernel's place
    the segment form equals the XLA form (which turns every entry) to bf16 rounding; runs at the
    wrong offset do not."""
    from redknot_jax.reuse import decode

    _patch_seg_reference(monkeypatch)
    problem = decode.decode_layer_problem(jax.random.key(0), doc_len=512, n_docs=4, own=512)
    kernel, xla, args = decode.decode_layer_forms(problem)
    assert rel_err(kernel(*args), xla(*args)) < 1e-2
    alone, alone_args = decode.decode_layer_kernel_alone(problem)  # the form's kernel call on its prepared arguments
    np.testing.assert_allclose(np.asarray(alone(*alone_args)), np.asarray(kernel(*args)), rtol=1e-6, atol=1e-6)
    rt = {**problem[4], "run_d": 0 * problem[4]["run_d"]}
    kernel, xla, args = decode.decode_layer_forms(problem[:4] + (rt,) + problem[5:])
    assert rel_err(kernel(*args), xla(*args)) > 5e-2
