"""redknot_jax.op_profile: a real jax.profiler trace of a jitted program summarised into its
executed ops (CPU here: the thunk executor's events; on a GPU the "XLA Ops" line)."""

import jax
import jax.numpy as jnp
import pytest

from redknot_jax import op_profile


def test_summary_of_a_real_trace(tmp_path):
    @jax.jit
    def f(a, b):
        return jnp.sort(jnp.tanh(a @ b), axis=-1)

    a = jnp.ones((256, 256), jnp.float32)
    f(a, a).block_until_ready()  # compiled outside the trace
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            f(a, a).block_until_ready()
    s = op_profile.summarize(tmp_path)
    assert s["ops"] >= 3 and s["ops_ms"] > 0
    assert sum(s["by_category"].values()) == pytest.approx(s["ops_ms"])
    assert s["by_category"].get("matmul", 0) > 0 and s["by_category"].get("sort / top-k", 0) > 0
    assert s["top"][0]["ms"] >= s["top"][-1]["ms"] and all(t["module"] == "jit_f" for t in s["top"])


@pytest.mark.parametrize("text, cat", [
    ("custom-call.3 __cublas$gemm", "matmul"), ("gemm_fusion_dot.2", "matmul"), ("sort.1", "sort / top-k"),
    ("loop_convert_fusion.4", "elementwise fusion"), ("input_reduce_fusion", "reduction"),
    ("custom-call.7 mosaic_gpu", "custom kernel"), ("all-reduce.1", "collective"), ("gather.2", "gather / scatter"),
    ("weird", "other")])
def test_categories(text, cat):
    assert op_profile.category(text) == cat


@pytest.mark.parametrize("op, text, cat", [
    ("custom-call.3", '%custom-call.3 = bf16[8,8] custom-call(%a, %b), custom_call_target="__cublas$gemm"', "matmul"),
    ("custom-call.9", "sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),  # a stream kernel's name
    ("fusion.4", "%fusion.4 = bf16[8] fusion(%dot.2), kind=kLoop", "elementwise fusion"),  # not its operand's kind
    ("custom-call.5", '%custom-call.5 = f32[8] custom-call(%x), custom_call_target="mosaic_gpu"', "custom kernel"),
    ("thing.1", "%thing.1 = f32[8] thing(%dot.1)", "other")])
def test_op_category_reads_names_not_operands(op, text, cat):
    assert op_profile.op_category(op, text) == cat


def test_control_flow_is_not_counted_twice(tmp_path):
    """A while loop's event spans its body's ops, which are counted on their own."""
    @jax.jit
    def g(a):
        return jax.lax.fori_loop(0, 4, lambda i, x: jnp.tanh(x @ a), a)

    a = jnp.ones((128, 128), jnp.float32) / 128
    g(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        g(a).block_until_ready()
    s = op_profile.summarize(tmp_path, top=100)
    assert not any(t["op"].startswith(("while", "conditional", "call")) for t in s["top"])
    assert any(t["category"] == "matmul" and t["count"] >= 4 for t in s["top"])


def test_no_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.xplane.pb under"):
        op_profile.summarize(tmp_path)
