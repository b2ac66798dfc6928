"""The MoE grouped-matmul kernel (redknot_jax/pallas/ragged_dot.py): in CPU CI the reference's
contract against numpy, the configuration's validation, bad inputs and the CUDA lowering at
Flash shapes (JAX's kernel has no interpret mode); on the H200 (-m gpu) the kernel against the
reference and the consumer's logits with the kernel against those without it."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax.pallas import ragged_dot as rd
from tests.tolerances import TOL, rel_err


def _numpy_grouped(x, w, sizes):
    """out[r] = x[r] @ w[group of r], rows past sum(sizes) zero, in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, s in enumerate(np.asarray(sizes)):
        out[start:start + s] = x[start:start + s] @ w[g]
        start += s
    return out


@pytest.mark.parametrize("sizes", [(5, 0, 7, 3), (0, 0, 15, 0), (2, 2, 2, 2)])
def test_reference_contract(sizes):
    """Per group a dense matmul; empty groups and rows past the last group (dropped
    assignments) give zero rows; a wider preferred_element_type is honoured."""
    x = jax.random.normal(jax.random.key(0), (17, 8), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (4, 8, 6), jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)
    got = rd.ragged_dot_reference(x, w, s)
    np.testing.assert_allclose(np.asarray(got), _numpy_grouped(x, w, s), rtol=1e-5, atol=1e-5)
    wide = rd.ragged_dot_reference(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), s,
                                   preferred_element_type=jnp.float32)
    assert wide.dtype == jnp.float32 and not np.asarray(wide[sum(sizes):]).any()


def test_config_validation():
    assert rd.RaggedDotConfig().smem_bytes() <= rd.SMEM_LIMIT
    for bad, match in ((dict(block_m=32), "block_m"), (dict(block_n=96), "block_n"),
                       (dict(block_m=128, block_n=256), "registers"), (dict(block_k=128), "block_k"),
                       (dict(steps=1), "steps"), (dict(grid_block_n=3), "grid_block_n"),
                       (dict(block_n=256, block_m=64, steps=6), "shared memory")):
        with pytest.raises(ValueError, match=match):
            rd.RaggedDotConfig(**bad)
    assert rd.ragged_dot_unsupported(4096, 2048, jnp.bfloat16) is None
    assert "bf16" in rd.ragged_dot_unsupported(4096, 2048, jnp.float32)
    assert "n=96" in rd.ragged_dot_unsupported(4096, 96, jnp.bfloat16)


def test_bad_inputs_raise():
    x = jnp.zeros((64, 128), jnp.bfloat16)
    w = jnp.zeros((4, 128, 128), jnp.bfloat16)
    s = jnp.full((4,), 16, jnp.int32)
    with pytest.raises(ValueError, match=r"x \[m, k\] and w \[e, k, n\]"):
        rd.ragged_dot(x, w[:, :64], s)
    with pytest.raises(ValueError, match=r"integer sizes \[4\]"):
        rd.ragged_dot(x, w, s[:3])
    with pytest.raises(ValueError, match=r"integer sizes"):
        rd.ragged_dot_reference(x, w, s.astype(jnp.float32))
    with pytest.raises(ValueError, match="bf16 operands"):
        rd.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), s)
    with pytest.raises(ValueError, match="mixed dtypes"):
        rd.ragged_dot(x, w.astype(jnp.float32), s)
    with pytest.raises(ValueError, match="n=96"):
        rd.ragged_dot(x, jnp.zeros((4, 128, 96), jnp.bfloat16), s)


@pytest.mark.parametrize("m", [24576, 246])
def test_kernel_lowers_for_cuda(m):
    """Flash's expert matmuls (24576 assignment rows of a 4096-token chunk, 16 experts): the
    Mosaic GPU lowering (layout inference, TMA descriptors, shared memory) runs on CPU. 246
    rows (82 tokens x top-3): the kernel's TMA descriptors need rows in multiples of 8, which
    the wrapper pads to (unpadded, lowering failed on the H200, 2026-12-01)."""
    x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((16, 4096, 2048), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((16,), jnp.int32)
    text = jax.jit(rd.ragged_dot).trace(x, w, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_loading_the_kernel_leaves_sigterm_to_the_process():
    """jax's kernel module imports jax's test utilities, which install absl's failure signal
    handler at import; loaded through `_mgpu_ragged_dot`, a SIGTERM (a server's ordinary stop)
    reaches the process's own handler and prints no stack trace."""
    import os
    import pathlib
    import subprocess
    import sys

    script = """import os, signal, time
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(1))
from redknot_jax.pallas.ragged_dot import _mgpu_ragged_dot
_mgpu_ragged_dot()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.1)
print("handled", got)
"""
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root)))
    assert r.returncode == 0 and r.stdout.strip() == "handled [1]", (r.stdout, r.stderr[-2000:])
    assert "SIGTERM received" not in r.stderr


def test_moe_refuses_unknown_kernel_mode():
    from redknot_jax import config
    from redknot_jax.init import random_model

    model = random_model(config.tiny("csa"), seed=0, dtype=jnp.float32)
    moe = model.layers[-1].ffn
    x = jnp.zeros((1, 4, model.cfg.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="kernels must be 'xla' or 'mosaic', got 'triton'"):
        moe(x, jnp.zeros((1, 4), jnp.int32), kernels="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,e,used,cfg", [
    (24576, 4096, 2048, 16, 0.95, rd.RaggedDotConfig()),  # Flash w1 / w3, dropped rows at the end
    (24576, 2048, 4096, 16, 1.0, rd.RaggedDotConfig(block_m=64, block_n=128)),  # Flash w2
    (1000, 256, 128, 8, 0.7, rd.RaggedDotConfig(block_m=64, block_n=64, steps=2)),  # ragged everything
    (6, 4096, 2048, 16, 1.0, rd.RaggedDotConfig()),  # one decode token's six assignments
])
def test_kernel_matches_reference_gpu(m, k, n, e, used, cfg):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    x, w, sizes = rd.make_problem(jax.random.key(m + n), m=m, e=e, k=k, n=n, used=used)
    sizes = sizes.at[1].set(0).at[0].add(sizes[1]) if e > 2 else sizes  # an empty group
    got = jax.jit(rd.ragged_dot, static_argnames="config")(x, w, sizes, config=cfg).astype(jnp.float32)
    want = rd.ragged_dot_reference(x, w, sizes, preferred_element_type=jnp.float32)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert rel_err(got, want) < TOL["kernel_bf16_o"][0]
    assert not np.asarray(got[int(jnp.sum(sizes)):]).any()  # rows past the last group: zero


def test_moe_kernel_path_calls_it_as_ragged_dot(monkeypatch):
    """MoE(kernels="mosaic") hands the kernel ragged_dot's arguments (rows sorted by expert,
    the weights, the group sizes): with the reference in the kernel's place, the layer's output
    and keep mask equal the XLA path's, dropped assignments (fan-out) included."""
    from redknot_jax import config, moe
    from redknot_jax.init import random_model

    calls = []
    monkeypatch.setattr(moe, "ragged_dot_kernel",
                        lambda x, w, s, **kw: calls.append(x.shape) or rd.ragged_dot_reference(x, w, s, **kw))
    model = random_model(config.tiny("csa"), seed=0, dtype=jnp.float32)
    layer = model.layers[-1].ffn
    x = jax.random.normal(jax.random.key(2), (1, 24, model.cfg.hidden_size), jnp.float32)
    ids = jax.random.randint(jax.random.key(3), (1, 24), 0, model.cfg.vocab_size)
    keep_fn = lambda sel, wts, scores: wts > jnp.median(wts)  # drops about half the assignments
    for fn in (None, keep_fn):
        want = layer(x, ids, keep_fn=fn, chunk=16, kernels="xla")
        got = layer(x, ids, keep_fn=fn, chunk=16, kernels="mosaic")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3 * 2  # three matmuls in the chunk body (traced once by lax.map), two keep rules


def _rounded_reference(x, w, sizes, preferred_element_type=None, config=None):
    """The reference with the kernel's output rounding: fp32 accumulation, written in the
    operands' dtype, then widened to preferred_element_type (rd.ragged_dot's contract)."""
    out = rd.ragged_dot_reference(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    return out.astype(preferred_element_type or x.dtype)


@pytest.mark.parametrize("real", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_every_prefill_path_hands_the_moe_to_the_kernel(monkeypatch, real):
    """With "ragged_dot" in the resolved set the kernel is called, and the logits are the
    reference path's, in both arms single and batched (`prefill_batch`), at tp = 2
    (`TPConsumer`: the rank's expert range), in `generate.Engine`'s prefill and in
    `build_artifact`.

    On CPU (real=False) the set is given by hand (the kernel needs a GPU), the reference stands
    in the kernel's place and the other side is the XLA path (kernels=""). On two GPUs
    (real=True, `-m gpu`) the Hopper kernel itself runs, on a model whose expert matmuls are
    widened to its tiles, against the same programs with the reference rounded as the kernel
    rounds (bf16 expert outputs): against the XLA path's fp32 expert outputs the routing and
    indexer top-k of this random bf16 model flip on that rounding alone (logits 6 % apart,
    measured on the H200, 2026-12-01), which says nothing about the kernel."""
    from redknot_jax import moe
    from redknot_jax.generate import Engine
    from redknot_jax.reuse import artifact
    from redknot_jax.reuse.planner import plan_request
    from redknot_jax.reuse.runtime import ReuseRuntime
    from redknot_jax.sharding.consumer_tp import TPConsumer
    from redknot_jax.sharding.table import make_mesh
    from tests.pallas.kernel_case import kernel_case

    if real and (jax.default_backend() != "gpu" or jax.device_count() < 2):
        pytest.skip("needs two GPUs")
    calls, side = [], {"kernel": False}  # kernel calls traced; which side is being traced
    kernel = moe.ragged_dot_kernel

    def patched(x, w, s, **kw):
        calls.append(x.shape)
        if real and side["kernel"]:
            return kernel(x, w, s, **kw)
        return _rounded_reference(x, w, s, **kw) if real else rd.ragged_dot_reference(x, w, s, **kw)

    monkeypatch.setattr(moe, "ragged_dot_kernel", patched)
    cfg, model, prof, arts, req = kernel_case(moe_tiles=real)
    ref_set = "ragged_dot" if real else ""
    xla, ker = ReuseRuntime(model, prof, "fp", kernels="xla"), ReuseRuntime(model, prof, "fp", kernels="xla")
    if real:  # the GPU resolves the set itself
        ker = ReuseRuntime(model, prof, "fp", kernels="ragged_dot")
    xla.consumer.kernels = ref_set
    ker.consumer.kernels = "ragged_dot"

    def same(f, what):
        n = len(calls)
        out = []
        for rt in (xla, ker):  # the two sides trace the same programs when real: no cached ones
            side["kernel"] = rt is ker
            if real:
                jax.clear_caches()
            out.append(f(rt))
        assert len(calls) > n, what
        tol = TOL["kernel_bf16_o"][0]
        for u, v in zip(*out):
            u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
            if not real:
                assert rel_err(v, u) < tol, what
                continue
            rows = [rel_err(v[i], u[i]) for i in range(len(u))] if u.ndim > 1 else [rel_err(v, u)]
            print("ROWERR", what, u.shape, " ".join(f"{r:.1e}" for r in rows))
            assert np.median(rows) < tol and np.mean(np.asarray(rows) >= tol) <= 0.25, (what, rows)

    same(lambda rt: [rt.prefill(req, "redknot", require_reuse=True).logits], "redknot")
    same(lambda rt: [rt.prefill(req, "recompute").logits], "recompute")
    for arm in ("redknot", "recompute"):
        same(lambda rt: [r.logits for r in rt.prefill_batch([req, req], arm)], f"{arm} batch")
    mesh = make_mesh(2)
    tps = {k: TPConsumer(model, prof, mesh, kernels="xla") for k in ("xla", "ker")}
    tps["xla"].kernels, tps["ker"].kernels = ref_set, "ragged_dot"
    same(lambda rt: [tps["xla" if rt is xla else "ker"].redknot(plan_request(req, prof), req.tokens,
                                                               tps["xla" if rt is xla else "ker"].pool(arts))[0]],
         "redknot tp=2")
    engines = {"xla": Engine(model, capacity=128, kernels="xla"), "ker": Engine(model, capacity=128, kernels="xla")}
    engines["xla"].kernels, engines["ker"].kernels = ref_set, "ragged_dot"
    prompts = [list(map(int, req.tokens[:50]))]
    same(lambda rt: [engines["xla" if rt is xla else "ker"].prefill(prompts)[0]], "engine prefill")
    monkeypatch.setattr(artifact, "resolve_kernels", lambda kernels, model: kernels)
    def payload(rt):
        p = artifact.build_artifact(model, prof, req.tokens[:40], checkpoint_fingerprint="fp",
                                    kernels=ref_set if rt is xla else "ragged_dot").payload()
        return [p[k].astype(np.float32) for k in sorted(p) if jnp.issubdtype(p[k].dtype, jnp.floating)]

    same(payload, "build_artifact")
