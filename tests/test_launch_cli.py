"""Every launch/ entry point's command line (issue #48 item 6), in-process, nothing computed:
`--help` exits 0 showing the script's example command (the one README.md / docs/*.md give,
where the script appears there); a missing input file or directory is refused while the
command line is parsed, naming its flag and its path, before any model is built; progress bars
go to stderr, only on a terminal, and leave stdout's lines as print() writes them. Plus
`_cli.load_model` == the library's loader, and build_artifacts.py end to end (resumed)."""

import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import chex
import pytest

from launch import _cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "launch").glob("*.py")
                 if p.stem not in ("_cli", "plot_benchmarks"))  # plot_benchmarks: tests/test_plot_benchmarks.py
# README.md and docs/*.md, whitespace collapsed (commands there wrap across lines, or continue with "\")
DOCS = " ".join("\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
                .replace("\\\n", " ").split())
NOTEBOOK = "reuse_notebook"  # runs at module level (a notebook): its command line is read on import


def _load(name: str):
    """launch/NAME.py as a fresh module (its main not run)."""
    spec = importlib.util.spec_from_file_location(f"launch_cli_{name}", ROOT / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name: str, argv: list[str], monkeypatch):
    """The script with this command line: main(argv), or the notebook executed with sys.argv."""
    if name == NOTEBOOK:
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        return _load(name)
    return _load(name).main(argv)


def test_every_script_is_covered():
    assert len(SCRIPTS) >= 21 and "generate" in SCRIPTS and "serve" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_shows_the_documented_example(name, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _run(name, ["--help"], monkeypatch)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python launch/{name}.py"), out[:200]
    _, sep, tail = out.rpartition("\nexample")  # the epilog, after the options
    assert sep, f"{name}: no example in --help"
    examples = [line.strip() for line in tail.split("\n")[1:] if line.strip()]
    assert examples and all(f"python launch/{name}.py" in x for x in examples), examples
    # where README.md / docs/*.md show the script's command, --help shows one of theirs
    if re.search(rf"python launch/{name}\.py", DOCS):
        assert any(" ".join(x.split()) in DOCS for x in examples), f"{name}: none of {examples} is in the docs"


def _no_model(monkeypatch):
    """Building any model fails the test: a refusal must come before one."""
    from redknot_jax import model

    def built(*a, **k):
        raise AssertionError("a model was built before the bad flag was refused")

    monkeypatch.setattr(model.Model, "__init__", built)


MISSING = "/nonexistent/redknot"
MISSING_INPUTS = [  # (script, command line, the flag that names the missing path)
    ("generate", ["--checkpoint", MISSING], "--checkpoint"),
    ("serve", ["--checkpoint", MISSING], "--checkpoint"),
    ("serve", ["--api-keys-file", MISSING + "/keys.txt"], "--api-keys-file"),
    ("serve", ["--break-even", MISSING + "/t.json"], "--break-even"),
    (NOTEBOOK, ["--checkpoint", MISSING], "--checkpoint"),
    ("bench_break_even", ["--checkpoint", MISSING], "--checkpoint"),
    ("bench_break_even", ["--profile", MISSING + "/p.json"], "--profile"),
    ("build_artifacts", ["--store", "/tmp/unused", "--corpus", MISSING + "/docs.jsonl"], "--corpus"),
    ("build_artifacts", ["--store", "/tmp/unused", "--demo", "1", "--checkpoint", MISSING], "--checkpoint"),
    ("eval_quality", ["--checkpoint", MISSING], "--checkpoint"),
    ("qa_diagnose", ["--checkpoint", MISSING], "--checkpoint"),
    ("train_quality_model", ["--init-from", MISSING], "--init-from"),
    ("artifact_bytes", ["--quality", MISSING + "/q.json", "--headline", "/tmp/unused.json"], "--quality"),
    ("artifact_bytes", ["--quality-omit", MISSING + "/q.json"], "--quality-omit"),
    ("bench_tp", ["--tp", "2", "--ref", MISSING + "/tp1.npz"], "--ref"),
]


@pytest.mark.parametrize("name,argv,flag", MISSING_INPUTS, ids=[f"{n}{f}" for n, _, f in MISSING_INPUTS])
def test_a_missing_input_is_refused_naming_flag_and_path(name, argv, flag, monkeypatch, refused):
    _no_model(monkeypatch)
    path = argv[argv.index(flag) + 1]
    kind = "directory" if flag in ("--checkpoint", "--init-from") else "file"
    refused(lambda a: _run(name, a, monkeypatch), argv,
            rf"error: argument {flag}: {re.escape(path)}: no such {kind}")


def test_a_directory_without_config_json_is_not_a_checkpoint(tmp_path, monkeypatch, refused):
    _no_model(monkeypatch)
    refused(_load("generate").main, ["--checkpoint", str(tmp_path)],
            rf"argument --checkpoint: {re.escape(str(tmp_path))} has no config.json \(not a checkpoint directory\)")
    refused(_load("bench_tp").main, ["--ref", str(tmp_path)],
            rf"argument --ref: {re.escape(str(tmp_path))}: a directory, not a file")


def test_serve_refuses_a_missing_profile_file_but_not_a_profile_name(monkeypatch, refused):
    _no_model(monkeypatch)
    serve = _load("serve")
    refused(serve.main, ["--profile", MISSING + "/p.json"], rf"argument --profile: {MISSING}/p.json: no such file")
    # a name is the server's to resolve (after the flags): not taken for a file
    refused(serve.main, ["--profile", "tiny-exact", "--no-warmup", "--warmup-buckets", "8"],
            "--warmup-buckets and --no-warmup: give one of them")


def test_eval_quality_refuses_a_bad_variant_before_any_model(monkeypatch, refused):
    _no_model(monkeypatch)
    ev = _load("eval_quality")
    refused(ev.main, ["--variants", "b0-tau"], r"--variants: unknown \['b0-tau'\]")
    refused(ev.main, ["--variants", "default", "--paired-with", "b10-k3"],
            r"--paired-with: 'b10-k3' is not one of --variants \['default'\]")


BAD_FLAGS = [  # (script, command line, the error line's text): checks added with the shared parser
    ("serve", ["--warmup-documents", "4x8"], r"argument --warmup-documents: warmup documents '4x8': expected "
                                             r"comma-separated DOCSxTOKENS\+PROMPT"),
    ("serve", ["--no-warmup", "--warmup-documents", "1x8+2"], "--warmup-documents and --no-warmup: give one of them"),
    ("bench_moe", ["--experts", "16,x"], r"--experts / --chunks: expected comma-separated integers, got '16,x'"),
    ("bench_model", ["--lengths", "8k"], "--lengths: expected comma-separated integers, got '8k'"),
    ("bench_host", ["--doc-lengths", "8k"], "--doc-lengths: expected comma-separated integers, got '8k'"),
    ("bench_host", ["--budget", "0"], r"--budget: expected a fraction in \(0, 1\], got 0.0"),
    ("profile_layers", ["--contexts", "a"], "--contexts: expected comma-separated integers, got 'a'"),
    ("profile_layers", ["--chunk", "8192", "--contexts", "8448,8000"],
     r"--contexts \[8000\]: each must hold the --chunk \(8192\) rows and 256 more"),
    ("bench_gmm_probe", ["--rows", "100", "--experts", "16"], r"--rows: expected a multiple of --experts \(16\), got 100"),
    ("serve", ["--compile-threads", "-1"], r"--compile-threads: expected an int >= 0 \(0: compile in turn\), got -1"),
    ("bench_compile", ["--parts", "layer,mhc"], r"--parts: \['mhc'\]: expected a comma list of layer, mhc_pre"),
    ("bench_compile", ["--slots", "0"], "--slots: expected a positive integer, got 0"),
    ("bench_compile", ["--preset", "tiny3"], "--preset: unknown 'tiny3'"),
    ("trace_tp_bf16", ["--preset", "tiny3"], "argument --preset: invalid choice: 'tiny3'"),
    ("qa_diagnose", ["--checkpoint", str(ROOT / "redknot_jax" / "assets" / "qa_model"), "--sizes", "2x1x3"],
     "--sizes: expected DOCSxPEOPLE_PER_DOC pairs of positive integers, e.g. 2x1,9x8, got '2x1x3'"),
    ("qa_diagnose", ["--checkpoint", str(ROOT / "redknot_jax" / "assets" / "qa_model"), "--sizes", "0x4"],
     "--sizes: expected DOCSxPEOPLE_PER_DOC pairs .*got '0x4'"),
]


@pytest.mark.parametrize("name,argv,named", BAD_FLAGS, ids=[f"{n}{a[-2]}" for n, a, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_by_its_own_check(name, argv, named, monkeypatch, refused):
    _no_model(monkeypatch)
    refused(_load(name).main, argv, "error: " + named)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_goes_to_stderr_on_a_terminal_only_and_stdout_lines_stay_whole(monkeypatch):
    out, err = io.StringIO(), _Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert list(_cli.progress(range(3), desc="steps")) == [0, 1, 2]
    bar = _cli.progress(range(2), desc="lines")
    for i in bar:
        _cli.echo("line", i, {"k": 1})
    bar.close()
    assert out.getvalue() == "line 0 {'k': 1}\nline 1 {'k': 1}\n"  # exactly print()'s text
    assert "steps: 100%" in err.getvalue() and "lines" in err.getvalue()
    # off: asked for (--no-progress), or stderr not a terminal (logs, CI, pytest's capture)
    for off, stream in ((True, _Terminal()), (False, io.StringIO())):
        monkeypatch.setattr(sys, "stderr", stream)
        assert list(_cli.progress(range(3), desc="quiet", off=off)) == [0, 1, 2]
        assert stream.getvalue() == ""


def test_parser_needs_an_example():
    with pytest.raises(ValueError, match="at least one example"):
        _cli.parser("doc", "launch/x.py")


def test_load_model_is_the_library_loader(tmp_path):
    """_cli.load_model (a bar over the stored tensors) gives exactly what quality.train.load_model
    (weights.load_checkpoint) gives, and the saved weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from redknot_jax.init import random_model
    from redknot_jax.quality.model_config import qa_test_config
    from redknot_jax.quality.train import load_model, save_checkpoint

    model = random_model(qa_test_config(), seed=0, dtype=jnp.float32)
    save_checkpoint(model, tmp_path)
    got, want = _cli.load_model(tmp_path, jnp.float32), load_model(tmp_path)
    assert got.cfg == want.cfg == model.cfg
    got, want, saved = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (got, want, model))
    chex.assert_trees_all_equal(got, want, strict=True)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, saved)
    assert sum(x.size for x in jax.tree.leaves(got)) > 0


def test_build_artifacts_demo_resumes_and_prints_its_summary(tmp_path, capsys):
    """build_artifacts.py on the tiny preset: stdout is the JSON summary alone; a second run with
    the same manifest builds nothing (every document skipped)."""
    build = _load("build_artifacts")
    argv = ["--store", str(tmp_path / "store"), "--demo", "2", "--demo-lengths", "24,24", "--no-fsync"]
    first = build.main(argv)
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(first))
    assert (first["built"], first["skipped_in_manifest"]) == (2, 0) and first["tokens_built"] == 48
    again = build.main(argv)
    assert json.loads(capsys.readouterr().out)["built"] == 0
    assert (again["built"], again["skipped_in_manifest"]) == (0, 2) and again["model_load_s"] == 0
    lines = [json.loads(x) for x in (tmp_path / "store" / "demo.manifest.jsonl").read_text().splitlines()]
    assert [x["name"] for x in lines] == ["demo-0", "demo-1"] and all(x["built"] for x in lines)
    assert all(x["tokens"] == 24 for x in lines)


def test_bench_compile_times_each_part_in_a_child_and_cuts_a_straggler(tmp_path, capsys):
    """bench_compile.py on the tiny preset: a line and a JSON row per part, compiled in child
    processes; a part still compiling at --timeout is cut and reported, not waited for."""
    bench = _load("bench_compile")
    out = tmp_path / "c.json"
    rows = bench.main(["--preset", "tiny", "--layer", "2", "--slots", "2", "--capacity", "256",
                       "--parts", "sinkhorn,mhc_pre", "--sinkhorn", "reduce", "--out", str(out)])
    assert [r["part"] for r in rows] == ["sinkhorn", "mhc_pre"] and all(r["compile_s"] > 0 for r in rows)
    saved = json.loads(out.read_text())
    assert saved["parts"] == rows and saved["device"] and "--sinkhorn reduce" in saved["command"]
    assert re.search(r"^sinkhorn  lowered [0-9.]+s, compiled [0-9.]+s$", capsys.readouterr().out, re.M)
    cut = bench.main(["--preset", "tiny", "--parts", "layer", "--capacity", "256", "--timeout", "1"])
    assert cut == [{"part": "layer", "compile_s": None, "note": "> 1 s (cut)"}]
