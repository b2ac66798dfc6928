"""Gathered-key latent attention (redknot_jax/pallas/sparse_attention.py): the reference against
the model's own attention (CPU), the kernel itself against the reference in Mosaic GPU
interpret mode (CPU) and natively (-m gpu), its CUDA lowering at consumer shapes (CPU), and
bad inputs."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax.attention import sink_softmax_attend
from redknot_jax.pallas import sparse_attention as sp
from tests.tolerances import TOL, rel_err


def test_reference_is_the_models_attention_over_the_selected_keys():
    """fp32: the reference equals `attention.sink_softmax_attend` over each row's gathered keys
    (the model's CSA formulation), rows without keys included (the sink alone: o = 0)."""
    ks = jax.random.split(jax.random.key(0), 5)
    t, s, kk, h, k = 6, 40, 12, 4, 16
    q = jax.random.normal(ks[0], (t, h, k))
    kv = jax.random.normal(ks[1], (s, k))
    idx = jax.random.randint(ks[2], (t, kk), 0, s)
    count = jnp.array([12, 5, 0, 1, 12, 7])
    sink = jax.random.normal(ks[3], (h,))
    o, lse = sp.sparse_attention_reference(q, kv, idx, count, sink, scale=0.3)
    mask = (jnp.arange(kk)[None, :] < count[:, None])[None, :, None, :]
    o2, lse2 = sink_softmax_attend(q[None], [(kv[idx][None], mask, "bthk,btwk->bthw")], sink, 0.3)
    assert rel_err(o, o2[0]) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2[0]), rtol=1e-5, atol=1e-5)
    assert not np.asarray(o[2]).any() and np.allclose(lse[2], sink)
    # ids past count are ignored; ids within it are clamped into the table, as the kernel reads them
    short = jnp.minimum(count, 10)
    wild = idx.at[:, 10:].set(-7).at[0, 0].set(s + 3)
    o3, _ = sp.sparse_attention_reference(q, kv, wild, short, sink, scale=0.3)
    o4, _ = sp.sparse_attention_reference(q, kv, idx.at[0, 0].set(s - 1), short, sink, scale=0.3)
    assert rel_err(o3, o4) == 0.0


CONFIGS = {"twice": dict(p_operand="smem", logits="twice"), "registers": dict(logits="twice"),
           "halves": dict()}  # "halves": the default


@pytest.mark.parametrize("seed,t,s,topk,indices,variant", [(0, 4, 300, 100, "smem", "twice"),
                                                           (1, 2, 1000, 64, "gmem", "twice"),
                                                           (0, 4, 300, 100, "smem", "halves")])
def test_kernel_matches_reference_interpret(seed, t, s, topk, indices, variant):
    """The kernel itself in Mosaic GPU interpret mode (natively on a GPU): rows of no key, one
    key, exactly one block and a ragged last block (228 keys: padded to 4 blocks of 64), ids
    past count garbage; bf16 tolerance of the O output, LSE in absolute terms. "halves": each
    consumer's 32 logit keys, the maxima and sums exchanged (a row of 1 key leaves the second
    half of its block empty); interpret mode reads each half's P from shared memory."""
    args, kw = sp.make_problem(jax.random.key(seed), t=t, s=s, topk=topk, window=128)
    q, kv, idx, count, sink = args
    idx = jnp.where(jnp.arange(idx.shape[1])[None, :] < count[:, None], idx, -5)  # never read as keys
    cfg = sp.SparseAttentionConfig(indices=indices, **CONFIGS[variant])
    o, lse = jax.jit(lambda *a: sp.sparse_attention(*a, **kw, config=cfg))(q, kv, idx, count, sink)
    o2, lse2 = sp.sparse_attention_reference(q, kv, idx, count, sink, **kw)
    assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))
    assert rel_err(o.astype(jnp.float32), o2.astype(jnp.float32)) < TOL["kernel_bf16_o"][0]
    assert float(jnp.max(jnp.abs(lse - lse2))) < TOL["kernel_bf16_lse_abs"][0]
    if t >= 4:  # the row without keys: the sink alone
        assert not np.asarray(o[0]).any() and np.allclose(lse[0], sink)


@pytest.mark.parametrize("indices,variant", [("smem", "twice"), ("gmem", "twice"), ("smem", "registers"),
                                             ("smem", "halves"), ("gmem", "halves")])
def test_kernel_lowers_for_cuda(indices, variant):
    """A consumer query block at 64K (256 rows, 128 window + 512 top-k ids into 16384 entries
    plus a 4096-row chunk of latents; a table of rows not a multiple of 8): layout inference,
    TMA descriptors and the shared-memory budget of the native (non-interpret) kernel, on CPU."""
    shapes = (jax.ShapeDtypeStruct((256, 64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((20483, 512), jnp.bfloat16),
              jax.ShapeDtypeStruct((256, 640), jnp.int32), jax.ShapeDtypeStruct((256,), jnp.int32),
              jax.ShapeDtypeStruct((64,), jnp.float32))
    cfg = sp.SparseAttentionConfig(indices=indices, **CONFIGS[variant])
    assert cfg.smem_bytes(640) <= sp.SMEM_LIMIT
    f = jax.jit(lambda *a: sp.sparse_attention(*a, scale=512 ** -0.5, config=cfg, interpret=False))
    assert "mosaic_gpu" in f.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_and_config_raise():
    q = jnp.zeros((2, 64, 512), jnp.bfloat16)
    kv = jnp.zeros((10, 512), jnp.bfloat16)
    idx, count, sink = jnp.zeros((2, 8), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((64,))
    with pytest.raises(ValueError, match=r"q \[t, h, k\] and kv \[s, k\]"):
        sp.sparse_attention(q, kv[:, :64], idx, count, sink, scale=1.0)
    with pytest.raises(ValueError, match=r"integer idx \[2, K\]"):
        sp.sparse_attention(q, kv, idx.astype(jnp.float32), count, sink, scale=1.0)
    with pytest.raises(ValueError, match=r"integer count \[2\]"):
        sp.sparse_attention_reference(q, kv, idx, count[:1], sink, scale=1.0)
    with pytest.raises(ValueError, match=r"sink \[64\]"):
        sp.sparse_attention(q, kv, idx, count, sink[:8], scale=1.0)
    with pytest.raises(ValueError, match="empty kv"):
        sp.sparse_attention(q, kv[:0], idx, count, sink, scale=1.0)
    with pytest.raises(ValueError, match=r"\(heads, head dim\) = \(64, 512\)"):
        sp.sparse_attention(q[:, :8], kv, idx, count, sink[:8], scale=1.0)
    with pytest.raises(ValueError, match="bf16"):
        sp.sparse_attention(q.astype(jnp.float32), kv.astype(jnp.float32), idx, count, sink, scale=1.0)
    with pytest.raises(ValueError, match="block_kv"):
        sp.SparseAttentionConfig(block_kv=128)
    with pytest.raises(ValueError, match="indices"):
        sp.SparseAttentionConfig(indices="registers")
    with pytest.raises(ValueError, match="p_operand"):
        sp.SparseAttentionConfig(p_operand="gmem")
    with pytest.raises(ValueError, match="logits"):
        sp.SparseAttentionConfig(logits="thirds")
    with pytest.raises(ValueError, match="halves.*needs p_operand='registers'"):
        sp.SparseAttentionConfig(p_operand="smem")
    with pytest.raises(ValueError, match="key ids per row need .* use indices='gmem'"):
        sp.sparse_attention(q, kv, jnp.zeros((2, 8192), jnp.int32), count, sink, scale=1.0)
    assert sp.SparseAttentionConfig().smem_bytes() <= sp.SMEM_LIMIT


@pytest.mark.gpu
@pytest.mark.parametrize("indices,variant", [("smem", "twice"), ("gmem", "twice"), ("smem", "registers"),
                                             ("smem", "halves"), ("gmem", "halves")])
@pytest.mark.parametrize("t,s,topk,full", [(256, 20480, 512, True), (1000, 20480, 512, False), (1, 4096, 512, True)])
def test_kernel_matches_reference_gpu(t, s, topk, full, indices, variant):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args, kw = sp.make_problem(jax.random.key(t), t=t, s=s, topk=topk, full=full)
    cfg = sp.SparseAttentionConfig(indices=indices, **CONFIGS[variant])
    o, lse = jax.jit(lambda *a: sp.sparse_attention(*a, **kw, config=cfg))(*args)
    o2, lse2 = sp.sparse_attention_reference(*args, **kw)
    assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))
    assert rel_err(o.astype(jnp.float32), o2.astype(jnp.float32)) < TOL["kernel_bf16_o"][0]
    assert float(jnp.max(jnp.abs(lse - lse2))) < TOL["kernel_bf16_lse_abs"][0]


def _gather_then_load(kv, ids):
    """One TMA per key ([1, 512]) into a (1, 64)-tiled, 128-swizzled buffer; then (a) the buffer
    back to memory by TMA and (b) each 64-column slice loaded into registers and stored to a
    (8, 64)-tiled buffer, also written back: the kernel's gather, without `unit_xor`."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    n, k = ids.shape[0], kv.shape[1]
    swz = plgpu.SwizzleTransform(128)

    def body(kv_ref, ids_ref, trip_ref, sliced_ref):
        def inner(rows, tile, bar):
            for i in range(n):
                plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(ids_ref[i], 1)], rows.at[pl.ds(i, 1)], bar)
            plgpu.barrier_wait(bar)
            plgpu.copy_smem_to_gmem(rows, trip_ref)
            for c in range(k // 64):
                v = plgpu.load(rows.at[:, pl.ds(c * 64, 64)], layout=plgpu.Layout.WGMMA, optimized=False)
                tile.at[:, pl.ds(c * 64, 64)][...] = v
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, sliced_ref)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(inner, plgpu.SMEM((n, k), kv.dtype, transforms=(plgpu.TilingTransform((1, 64)), swz)),
                      plgpu.SMEM((n, k), kv.dtype, transforms=(plgpu.TilingTransform((8, 64)), swz)),
                      plgpu.Barrier(num_arrivals=n))

    out = jax.ShapeDtypeStruct((n, k), kv.dtype)
    return plgpu.kernel(body, out_type=(out, out))(kv, ids)


def test_unit_xor_undoes_the_sliced_load_permutation():
    """The kernel puts a slice's units back with `unit_xor`: applied to the permutation the
    GPU test below pins (unit u of the loaded slice c is unit u ^ c), it gives the slice."""
    x = np.arange(4 * 512).reshape(4, 512)
    col = np.arange(512)
    c, u, e = col // 64, (col % 64) // 8, col % 8
    loaded = x[:, c * 64 + 8 * (u ^ c) + e]
    for k in range(8):
        back = np.asarray(sp.unit_xor(jnp.asarray(loaded[:, 64 * k: 64 * k + 64]), k))
        assert np.array_equal(back, x[:, 64 * k: 64 * k + 64])
    assert not np.array_equal(np.asarray(sp.unit_xor(jnp.asarray(x[:, :64]), 3)), x[:, :64])


@pytest.mark.gpu
def test_mosaic_loads_a_column_slice_of_a_swizzled_buffer_xor_permuted_gpu():
    """Why the kernel applies `unit_xor` after each sliced load (module doc, docs/kernels.md),
    pinned so that a JAX upgrade that fixes the load is noticed (the kernel would then be wrong
    on a GPU, and its GPU test would fail too). With jax 0.11.2 on the H200 (2026-12-01, passed):
    the TMA lands each key right in the swizzled rows (the round trip is exact), but a load of
    the 64-column slice c takes the swizzle's XOR from the slice's base, c x 128 B into a 1024 B
    swizzle block, so it reads the 16-byte units of the slice XOR-permuted by c."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kv = jax.random.normal(jax.random.key(0), (4096, 512), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.permutation(jax.random.key(1), 4096)[:64].astype(jnp.int32)
    trip, sliced = jax.jit(_gather_then_load)(kv, ids)
    want = np.asarray(kv[ids])
    assert np.array_equal(np.asarray(trip), want)
    col = np.arange(512)
    c, u, e = col // 64, (col % 64) // 8, col % 8
    permuted = want[:, c * 64 + 8 * (u ^ c) + e]
    assert not np.array_equal(np.asarray(sliced), want), "fixed upstream: drop unit_xor from _sliced_load"
    assert np.array_equal(np.asarray(sliced), permuted)


def _patch_reference(monkeypatch):
    """The reference in the kernel's place (any heads, dims, dtype), each call recorded."""
    from redknot_jax.reuse import layer

    calls = []

    def ref(q, kv, idx, count, sink, **kw):
        calls.append(q.shape)
        return sp.sparse_attention_reference(q, kv, idx, count, sink, **kw)

    monkeypatch.setattr(sp, "sparse_attention", ref)
    monkeypatch.setattr(layer, "sparse_attention", ref)
    return calls


def test_every_csa_path_hands_its_keys_to_the_kernel(monkeypatch):
    """With "sparse_attention" in the kernel set and the reference in the kernel's place (fp32,
    the tiny CSA model: real top-k selection), the logits are the XLA path's: chunked native
    prefill in two chunks of two query blocks on two sequences (window ids across the ring
    cache, batch-flattened table), both arms of the consumer (Recomputed: native layers;
    RedKnot: pass B over the protected rows), and the kernel is called in each."""
    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.reuse.runtime import ReuseRuntime
    from tests.pallas.kernel_case import kernel_case

    calls = _patch_reference(monkeypatch)
    cfg = config.tiny("csa")
    model = random_model(cfg, seed=2, dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(3), (2, 32), 2, cfg.vocab_size)
    rows = jnp.tile(jnp.arange(16)[None], (2, 1))

    def prefill(kernels):
        cache = model.init_cache(2, 64)
        out = []
        for c in range(2):
            lg, cache = model.forward(ids[:, 16 * c:16 * (c + 1)], jnp.full((2,), 16 * c), jnp.full((2,), 16), cache,
                                      rows, block=8, kernels=kernels)
            out.append(lg)
        return jnp.concatenate(out, 1)

    want = prefill("")
    assert not calls
    got = prefill("sparse_attention")
    assert len(calls) > 0 and calls[0] == (16, cfg.num_heads, cfg.head_dim)  # 2 sequences x 8 rows
    assert rel_err(got, want) < 1e-5

    _, kmodel, prof, arts, req = kernel_case()
    kmodel = random_model(kmodel.cfg, seed=5, dtype=jnp.float32)
    from redknot_jax.reuse.artifact import build_artifact

    arts = [build_artifact(kmodel, prof, s.tokens, checkpoint_fingerprint="fp") for s in req.segments[:2]]
    from redknot_jax.reuse.planner import Request, Segment

    req = Request([Segment(req.segments[0].tokens, arts[0]), Segment(req.segments[1].tokens, arts[1]),
                   req.segments[2]], query_rows=req.query_rows)
    xla, ker = ReuseRuntime(kmodel, prof, "fp", kernels="xla"), ReuseRuntime(kmodel, prof, "fp", kernels="xla")
    ker.consumer.kernels = "sparse_attention"  # the tiny model's 8 heads: the kernel itself would refuse
    for arm in ("recompute", "redknot"):
        n = len(calls)
        a = xla.prefill(req, arm, require_reuse=arm == "redknot").logits
        b = ker.prefill(req, arm, require_reuse=arm == "redknot").logits
        assert len(calls) > n, arm
        assert rel_err(b, a) < 1e-5, arm


def test_native_csa_layers_run_the_kernel_interpret(monkeypatch):
    """The kernel itself (Mosaic GPU interpret mode on CPU) inside the model: a bf16 model with
    the kernel's 64 heads x 512 dims, chunked prefill in two chunks. No discrete choice can flip
    on a last bit here (hash-routed experts, an indexer top-k wider than the visible entries,
    narrower than the cache's, so the layers still select), so the
    comparison is about the attention alone. Its logits must be as close to the XLA path's as
    bf16 lets two formulations be: this model carries bf16 rounding to ~1 % of its logits,
    evenly over the rows (the reference in the kernel's place: 1.0 %; the kernel: 1.3 %), so
    the bound is twice that floor, measured in the test. `resolve_kernels` accepts the kernel
    for this model and refuses it for 8 heads."""
    import dataclasses

    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.pallas import resolve_kernels

    base = config.tiny("csa")
    cfg = dataclasses.replace(base, num_heads=64, head_dim=512, rope_dim=64, index_head_dim=64, o_groups=8, o_lora_rank=32,
                              index_topk=64, mlp_layer_types=("hash_moe",) * base.num_layers)
    model = random_model(cfg, seed=4, dtype=jnp.bfloat16)
    assert resolve_kernels("sparse_attention", model) == "sparse_attention"
    with pytest.raises(ValueError, match=r"sparse_attention kernel cannot run.*\(64, 512\)"):
        resolve_kernels("sparse_attention", random_model(base, seed=0, dtype=jnp.bfloat16))
    ids = jax.random.randint(jax.random.key(1), (1, 32), 2, cfg.vocab_size)

    def prefill(kernels):
        cache, out = model.init_cache(1, 512), []  # 512 / rate 4 = 128 entries > top-64 > 8 visible
        for c in range(2):
            lg, cache = model.forward(ids[:, 16 * c:16 * (c + 1)], jnp.full((1,), 16 * c), jnp.full((1,), 16), cache,
                                      jnp.arange(16)[None], block=16, kernels=kernels)
            out.append(lg)
        return jnp.concatenate(out, 1)

    xla, kernel = prefill(""), prefill("sparse_attention")
    calls = _patch_reference(monkeypatch)
    jax.clear_caches()  # traced again, with the reference in the kernel's place
    floor = rel_err(prefill("sparse_attention"), xla)
    assert calls, "the reference never ran in the kernel's place: the floor would be the kernel's own error"
    assert 0 < floor < 0.05
    assert rel_err(kernel, xla) < 2 * floor


def _pass_a_problem(*, t, nh, k, n_ent, topk, window, block, frames, dtype=jnp.float32, seed=7, first=0,
                    local=False):
    """`layer.pass_a`'s arguments for a CSA layer: rows in frames of the given lengths, entry
    e ending at row m e + m - 1 (m = t / n_ent), each row's picks valid first and only among
    entries that ended before it, with `local` only among its own frame's (as artifacts store
    them). `first`: the queries are rows first.. only (the rows after an exact prefix), the keys
    every row."""
    from redknot_jax.config import CSA

    rng = np.random.default_rng(seed)
    m = t // n_ent
    frame = np.repeat(np.arange(len(frames)), frames).astype(np.int32)
    end = np.arange(n_ent, dtype=np.int32) * m + m - 1
    ids = np.full((t, topk), -1, np.int32)
    starts, pick_rng = np.r_[0, np.cumsum(frames)], np.random.default_rng(seed + 1)  # the arrays: rng's alone
    for r in range(t):
        seen = np.flatnonzero((end <= r) & (~local | (end - m + 1 >= starts[frame[r]])))
        pick = pick_rng.permutation(seen)[: pick_rng.integers(0, topk + 1)]
        ids[r, : pick.size] = pick
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
    tab = {"frame": jnp.asarray(frame[first:]), "key_frame": jnp.asarray(frame),
           "pos": jnp.arange(first, t, dtype=jnp.int32)}
    return (f(t, nh, k)[first:], tab, f(t, k), (f(n_ent, k), jnp.asarray(end)),
            f(nh).astype(jnp.float32), k ** -0.5, CSA, block, window, jnp.asarray(ids[first:]))


def test_pass_a_xla_equals_dense_attention(monkeypatch):
    """Pass A's XLA form (banded windows, loop steps of whole bands, the last padded) equals
    one dense masked attention over every key row and entry, for an HCA layer (entries shared
    by every row) in one step and in three, and for a CSA layer (its steps of `block` rows, or
    the span form's steps of one slice of entries each, scored at once or in chunks)."""
    from redknot_jax.attention import sink_softmax_attend
    from redknot_jax.config import HCA
    from redknot_jax.reuse import layer

    args = _pass_a_problem(t=64, nh=2, k=32, n_ent=16, topk=4, window=8, block=16, frames=(20, 24, 20), first=13)
    q, tab, kv, (e, end), sink, scale, _, _, w, ids = args
    p, f, kp = tab["pos"][:, None], tab["frame"][:, None], jnp.arange(kv.shape[0])[None]
    win = ((kp <= p) & (kp > p - w) & (tab["key_frame"][None] == f))[None, :, None, :]
    dense = lambda ent_keys, ent_mask, eq: sink_softmax_attend(
        q[None], [(kv[None], win, "bthk,bsk->bths"), (ent_keys, ent_mask, eq)], sink, scale)[0][0]
    want = dense(e[None], (end[None] <= p)[None, :, None, :], "bthk,bwk->bthw")
    hca = args[:6] + (HCA,) + args[7:]
    assert rel_err(layer.pass_a(*hca), want) < 1e-6
    assert rel_err(layer.pass_a(*hca, call_rows=20), want) < 1e-6  # 51 rows: 3 steps of 24 (bands of 8), padded
    assert rel_err(layer.pass_a(*hca, call_rows=3), want) < 1e-6  # a cap under one band: 7 steps of 8
    picked = lambda ids: dense(e[jnp.maximum(ids, 0)][None], ((ids >= 0) & (end[jnp.maximum(ids, 0)] <= p))[
        None, :, None, :], "bthk,btwk->bthw")
    assert rel_err(layer.pass_a(*args), picked(ids)) < 1e-6
    # the span form over document-local picks: per step of 16 rows one slice of entries, 12 of
    # the 16 (the 24-row document's 6, the step's 4, two more); a slice too short drops picks
    loc = _pass_a_problem(t=64, nh=2, k=32, n_ent=16, topk=4, window=8, block=16, frames=(20, 24, 20), first=13,
                          local=True)
    want, span = picked(loc[-1]), layer.csa_span_bound(24, 4, 8, 16)
    assert span == 12 and rel_err(layer.pass_a(*loc, call_rows=16, csa_span=span), want) < 1e-6
    assert rel_err(layer.pass_a(*loc, call_rows=16, csa_span=4), want) > 1e-2
    # scored in chunks up to each step's last pick (online softmax): chunks dividing the slice,
    # not dividing it, one entry each, and longer than it; a loop one chunk short (the last pick's) drops picks
    for chunk in (4, 5, 1, 64):
        assert rel_err(layer.pass_a(*loc, call_rows=16, csa_span=span, span_chunk=chunk), want) < 1e-6, chunk
    real = layer._span_chunks
    monkeypatch.setattr(layer, "_span_chunks", lambda qb, keys, mask, hi, *a: real(qb, keys, mask, hi - 1, *a))
    assert rel_err(layer.pass_a(*loc, call_rows=16, csa_span=span, span_chunk=1), want) > 1e-2


@pytest.mark.gpu
def test_pass_a_kernel_matches_xla_gpu():
    """Pass A with the kernel itself (8 Global heads padded to 64, head dim 512, bf16, 640 keys
    per row at most) against pass A in XLA: every row of four frames, to bf16 rounding."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from redknot_jax.reuse import layer

    args = _pass_a_problem(t=2048, nh=8, k=512, n_ent=512, topk=512, window=128, block=256,
                           frames=(700, 500, 600, 248), dtype=jnp.bfloat16)
    run = lambda sparse: jax.jit(lambda q, tab, kv, ents, sink, ids: layer.pass_a(
        q, tab, kv, ents, sink, *args[5:9], ids, sparse=sparse))(*args[:5], args[9])
    got, want = run(True), run(False)
    assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))
    assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < TOL["kernel_bf16_o"][0]


def test_pass_a_hands_the_global_heads_to_the_kernel(monkeypatch):
    """"sparse_global": the RedKnot arm's pass A (the Global heads of every row over their own
    frame's window and the artifact's document-local top-k) through the gathered-key kernel, the
    heads padded to its 64, with the reference in the kernel's place (fp32, real selection):
    * pass A itself, every row of three frames, equals the XLA form, and a window that ignores
      the frame start (keys reaching into the previous document) does not;
    * in the consumer, the RedKnot arm's logits are the XLA path's, every call with 64 heads
      where documents are longer than `span_doc_rows` (else pass A's span form: no call);
      in a batch (`prefill_batch`) too, beside the native fences' and pass B's calls;
    * `resolve_kernels` takes the name in the consumer and leaves it out where pass A does not
      exist (Engine, builds)."""
    import dataclasses

    from redknot_jax.init import random_model
    from redknot_jax.pallas import resolve_kernels
    from redknot_jax.reuse import layer
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.reuse.planner import Request, Segment
    from redknot_jax.reuse.runtime import ReuseRuntime
    from tests.pallas.kernel_case import kernel_case

    calls = _patch_reference(monkeypatch)
    block, k = 16, 32
    args = _pass_a_problem(t=64, nh=2, k=k, n_ent=16, topk=4, window=8, block=block, frames=(20, 24, 20))
    want = layer.pass_a(*args)
    assert rel_err(layer.pass_a(*args, sparse=True), want) < 1e-5
    assert calls == [(64, sp.HEADS, k)]  # every row in one call
    del calls[:]  # in calls of at most 24 rows: 3 of 22, the last padded
    assert rel_err(layer.pass_a(*args, sparse=True, call_rows=24), want) < 1e-5
    assert calls == [(22, sp.HEADS, k)]  # traced once: a loop of 3 steps
    # the rows after a 16-row exact prefix: the same outputs as those rows of the full pass, both forms
    after = _pass_a_problem(t=64, nh=2, k=k, n_ent=16, topk=4, window=8, block=block, frames=(20, 24, 20),
                            first=16)
    for sparse in (False, True):
        assert rel_err(layer.pass_a(*after, sparse=sparse), want[16:]) < 1e-5, sparse
    # windows crossing into earlier frames: a negative control
    monkeypatch.setattr(layer, "_frame_first", lambda key_frame, frame: jnp.zeros_like(frame))
    assert rel_err(layer.pass_a(*args, sparse=True), want) > 1e-2
    monkeypatch.undo()

    calls = _patch_reference(monkeypatch)
    _, kmodel, prof, _, req = kernel_case()
    kmodel = random_model(kmodel.cfg, seed=5, dtype=jnp.float32)
    prof = dataclasses.replace(prof, tail_rows=4, budget_override=0.1)  # most rows restored: pass A matters
    arts = [build_artifact(kmodel, prof, s.tokens, checkpoint_fingerprint="fp") for s in req.segments[:2]]
    req = Request([Segment(req.segments[0].tokens, arts[0]), Segment(req.segments[1].tokens, arts[1]),
                   req.segments[2]], query_rows=req.query_rows)
    xla, ker = ReuseRuntime(kmodel, prof, "fp", kernels="xla"), ReuseRuntime(kmodel, prof, "fp", kernels="xla")
    ker.consumer.kernels = "sparse_global"  # the tiny model's head dim: the kernel itself would refuse
    want = xla.prefill(req, "redknot", require_reuse=True).logits
    # documents up to `span_doc_rows` rows: the span form, not the kernel
    assert rel_err(ker.prefill(req, "redknot", require_reuse=True).logits, want) < 1e-5 and not calls
    ker.consumer.span_doc_rows = 0
    got = ker.prefill(req, "redknot", require_reuse=True).logits
    assert calls and all(c[1] == sp.HEADS for c in calls)  # every pass-A call: 64 (padded) heads
    assert rel_err(got, want) < 1e-5
    # a batch (`prefill_batch`): each request's attention as alone, both kernels (native fences, passes A and B)
    ker.consumer.kernels = "sparse_global,sparse_attention"
    del calls[:]
    for r in ker.prefill_batch([req, req], "redknot", require_reuse=True):
        assert rel_err(r.logits, want) < 1e-5
    assert {c[1] for c in calls} == {sp.HEADS, kmodel.cfg.num_heads}
    big = dataclasses.replace(kmodel.cfg, num_heads=16, head_dim=512, rope_dim=64, o_groups=8, o_lora_rank=32)
    bmodel = random_model(big, seed=0, dtype=jnp.bfloat16)
    assert resolve_kernels("sparse_global", bmodel, 1) == "sparse_global"  # 16 heads: padded, accepted
    assert resolve_kernels("sparse_global", bmodel) == ""  # outside the consumer: nothing to run
