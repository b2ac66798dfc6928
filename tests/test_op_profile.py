"""redknot_jax.op_profile: a real jax.profiler trace of a jitted program summarised into its
executed ops (CPU here: the thunk executor's events; on a GPU the "XLA Ops" line)."""

import json
import os
import subprocess
import sys
import textwrap

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
    assert s["idle_ms"] >= 0 and "by_source" not in s and "source" not in s["top"][0]


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


def test_idle_time_is_named_by_the_ops_around_it():
    ev = lambda name, start_ms, ms: (name, "jit_f", "", ms, int(start_ms * 1e6), "")
    idle, gaps = op_profile._idle([ev("a", 0, 1), ev("c", 3.2, 0.5), ev("b", 3, 1), ev("a", 6, 1), ev("b", 7.5, 1)], 5)
    assert idle == pytest.approx(4.5)  # 1-3 (a, b), 4-6 (b, a; c lies inside b), 7-7.5 (a, b)
    assert gaps == [{"after": "a", "before": "b", "ms": pytest.approx(2.5), "count": 2},
                    {"after": "b", "before": "a", "ms": pytest.approx(2.0), "count": 1}]


def test_no_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.xplane.pb under"):
        op_profile.summarize(tmp_path)


def test_ops_named_by_their_source_lines(tmp_path):
    """With the program's XLA dump (a fresh process: XLA reads its flags when JAX starts), each top
    op names the JAX op and the source lines it came from, and `by_source` sums the ops by them."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""\
        import json, sys
        import jax, jax.numpy as jnp
        from redknot_jax import op_profile

        def inner(a, b):
            return jnp.tanh(a @ b)

        @jax.jit
        def f(a, b):
            return jnp.sort(inner(a, b), axis=-1)

        a = jnp.ones((256, 256), jnp.float32)
        f(a, a).block_until_ready()
        with jax.profiler.trace(sys.argv[1]):
            f(a, a).block_until_ready()
        print(json.dumps(op_profile.summarize(sys.argv[1], top=50, hlo_dump=sys.argv[2])))
        """))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": op_profile.dump_flags(tmp_path / "hlo"),
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "trace"), str(tmp_path / "hlo")], env=env,
                         capture_output=True, text=True, check=True).stdout
    s = json.loads(out.splitlines()[-1])
    src = {t["category"]: t["source"] for t in s["top"]}
    # the frames of the call that traced f (line 13), not of the traced run
    assert src["sort / top-k"] == "prog.py:10 (f) < prog.py:13 (<module>)"
    assert src["matmul"] == "prog.py:6 (inner) < prog.py:10 (f) < prog.py:13 (<module>)"
    assert any(t["op_name"].endswith("dot_general") for t in s["top"])
    assert sum(x["ms"] for x in s["by_source"]) == pytest.approx(s["ops_ms"])
    assert sum(x["ops"] for x in s["by_source"]) == s["ops"]


def test_an_op_is_found_in_its_module_by_program_id_else_by_text(tmp_path):
    """Two compiled modules of one name: the event's program id picks the file; without one, the
    op's text does."""
    head = 'HloModule jit_g\n\nFileNames\n1 "/x/redknot_jax/a.py"\n\nFunctionNames\n1 "g"\n\n' \
           "FileLocations\n1 {file_name_id=1 function_name_id=1 line=%d end_line=1 column=0 end_column=1}\n\n" \
           "StackFrames\n1 {file_location_id=1 parent_frame_id=0}\n\n"
    for pid, (line, shape) in {7: (11, "f32[8]"), 9: (22, "f32[16]")}.items():
        (tmp_path / f"module_{pid:04d}.jit_g.sm_9.0_gpu_after_optimizations.txt").write_text(
            head % line + f"ENTRY %main {{\n  ROOT %fusion.1 = {shape}{{0}} fusion(%p), kind=kLoop, "
                          f'metadata={{op_name="jit(g)/tanh" stack_frame_id=1}}\n}}\n')
    files = op_profile._dump_files(tmp_path)
    assert op_profile.op_source(files, "fusion.1", "jit_g", "", "9") == ("jit(g)/tanh", "redknot_jax/a.py:22 (g)")
    text = "%fusion.1 = f32[16]{0} fusion(%p), kind=kLoop"
    assert op_profile.op_source(files, "fusion.1", "jit_g", text, "") == ("jit(g)/tanh", "redknot_jax/a.py:22 (g)")
    assert op_profile.op_source(files, "fusion.2", "jit_g", text, "") == ("", "")
