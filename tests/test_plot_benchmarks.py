"""launch/plot_benchmarks.py renders the committed TTFT results and a bench_qps result into
PNGs, and names a wrong input file."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_benchmarks", ROOT / "launch" / "plot_benchmarks.py")
pb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pb)


def test_plots_from_committed_results(tmp_path):
    qps = {"date": "2026-11-30", "server": {"device": {"backend": "cpu"}},
           "results": {arm: {"1": {"requests_per_s": r, "requests_per_s_ci95": [r * 0.9, r * 1.1]},
                             "2": {"requests_per_s": 1.5 * r, "requests_per_s_ci95": None}}
                       for arm, r in (("redknot", 10.0), ("recompute", 20.0))}}
    (tmp_path / "qps.json").write_text(json.dumps(qps))
    files = pb.main(["--qps", str(tmp_path / "qps.json"), "--out", str(tmp_path / "plots")])
    names = sorted(f.name for f in files)
    assert names == ["layer_times_128K.png", "layer_times_64K.png", "ledgers_per_length.png", "qps_vs_concurrency.png",
                     "speedup_vs_length.png", "ttft_vs_length.png"]
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000


@pytest.mark.parametrize("length, runs, layers_file", [(65536, 2, "ttft_64k_ops_moe_kernel_h200.json"),
                                                       (131072, 2, "ttft_128k_host_layers_h200.json")])
def test_runs_of_the_same_requests_are_pooled(length, runs, layers_file):
    """The committed runs of one length on the same records, profile, main kernel set and top-k
    staging become one row with every repeat, not the earlier runs with fewer kernels (128K: two
    runs of one repeat). 64K: session 30's last run (top-k over 4 entry prefixes, pass A's kernel,
    2 repeats) replaces its run with fewer kernels and the session-24 run with every entry
    scored, and keeps the per-layer profile of earlier runs, which names the one file it came
    from."""
    rows, _ = pb.load_ttft(sorted((ROOT / "docs" / "results").glob("ttft_*_h200.json")))
    row = {r["length"]: r for r in rows}[length]
    if length == 65536:
        assert row["topk_stages"] == 4 and row["recompute_s"] == pytest.approx([7.500, 7.480], abs=1e-3)
        assert "sparse_global" in row["kernel_set"]
    assert len(row["recompute_s"]) == len(row["redknot_s"]) == len(row["ratio_per_repeat"]) == runs
    assert row["layer_times"] and min(row["ratio_per_repeat"]) <= row["speedup_median"] <= max(row["ratio_per_repeat"])
    assert row["layer_times_src"].startswith(layers_file + ":")


def test_a_profile_variant_does_not_replace_the_default_profile():
    """32K: the default-profile run with the most kernels (indexer + ragged_dot, session 13)
    is the row; the --tail-rows 4096 variant, which also ran kernels, does not replace it."""
    paths = sorted((ROOT / "docs" / "results").glob("ttft_*_h200.json"))
    assert any("tail4k" in p.name for p in paths)
    row = {r["length"]: r for r in pb.load_ttft(paths)[0]}[32768]
    assert row["profile_name"] == "flash-3F-37R-3F" and row["kernel_set"] == "indexer,ragged_dot"
    assert len(row["recompute_s"]) == 1  # ttft_32k_64k_sparse_rows_h200.json, one repeat


def test_wrong_inputs_are_named(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(SystemExit, match="--ttft .*x.json"):
        pb.main(["--ttft", str(tmp_path / "x.json"), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--qps .*x.json"):
        pb.main(["--qps", str(tmp_path / "x.json"), "--out", str(tmp_path)])


def test_axis_labels_name_host_residency_and_kernels():
    """128K ran with host-resident artifacts and the indexer kernel, 64K with the indexer, MoE
    and gathered-key attention kernels, the last in pass A too: their labels say so (one kernel
    per line); a
    --build-only result (no timed rows) is not named as a source."""
    paths = sorted((ROOT / "docs" / "results").glob("ttft_*_h200.json"))
    rows, prov = pb.load_ttft(paths)
    labels = {r["length"]: pb._tick(r) for r in rows}
    assert labels[131072] == "128K\nhost\nindexer" and labels[65536] == "64K\nindexer,\nragged_dot,\nsparse_attention,\nsparse_global"
    assert any("build" in p.name for p in paths) and not any("build" in line for line in prov)
