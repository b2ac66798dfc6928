"""launch/plot_benchmarks.py renders the committed TTFT results and a bench_qps result into
PNGs whose titles are one line, and names a wrong input file."""

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
                     "speedup_vs_length.png", "ttft_by_profile_64K.png", "ttft_vs_length.png"]
    # the committed headline file (rows of several runs) plots too
    import matplotlib.pyplot as plt

    files.append(pb.plot_qps(ROOT / "docs" / "results" / "qps_headline_docs4_h100.json", tmp_path, plt))
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000
    points, srcs, model = pb.qps_points(ROOT / "docs" / "results" / "qps_headline_docs4_h100.json")
    assert sorted(points["redknot"]) == [1, 4, 16] and model == "flash-shaped"
    assert {s["device"] for s in srcs} == {"NVIDIA H100 80GB HBM3"}


def test_titles_are_one_line_naming_device_and_date(monkeypatch, tmp_path):
    """Every title is one line (no file names): what was measured, the device, the dates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = []
    real = plt.Axes.set_title

    def spy(self, label, *a, **k):
        titles.append(label)
        return real(self, label, *a, **k)

    monkeypatch.setattr(plt.Axes, "set_title", spy)
    paths = sorted((ROOT / "docs" / "results").glob("ttft_*_h200.json"))
    rows, _ = pb.load_ttft(paths)
    pb.plot_ttft(rows, tmp_path, plt)
    pb.plot_profiles(pb.load_profiles(paths), tmp_path, plt)
    assert len(titles) == 4
    for t in titles:
        assert "\n" not in t and ".json" not in t and "NVIDIA H200, 2026-1" in t, t
    assert titles[0].endswith("2026-11-30 to 2026-12-04") and titles[-1].startswith("TTFT at 64K by arm")


@pytest.mark.parametrize("length, repeats, layers_file", [(65536, 2, "ttft_64k_ops_moe_kernel_h200.json"),
                                                       (131072, 2, "ttft_128k_host_layers_h200.json")])
def test_runs_of_the_same_requests_are_pooled(length, repeats, layers_file):
    """The committed runs of one length on the same records, profile, main kernel set and top-k
    staging become one row with every repeat (128K: two runs of one repeat), not the earlier runs
    with fewer kernels. 64K: the `default` variant of session 33's --profiles run (its first
    variant is tail0-b10-omit) is the row: it ran today's `auto` kernels, the restoration kernel
    included, so it replaces session 30's run without it; it keeps the per-layer profile of the
    best-ranked run that has one, which names the one file it came from."""
    rows, _ = pb.load_ttft(sorted((ROOT / "docs" / "results").glob("ttft_*_h200.json")))
    row = {r["length"]: r for r in rows}[length]
    if length == 65536:
        sweep = json.loads((ROOT / "docs" / "results" / "ttft_64k_ffn_rows_sweep_a_h200.json").read_text())
        want = sweep["lengths"][0]
        assert row["profile_name"] == "flash-3F-37R-3F" and row["topk_stages"] == 4
        assert row["recompute_s"] == want["recompute_s"] and row["redknot_s"] == want["by_profile"]["default"]["redknot_s"]
        assert row["kernel_set"].split(",") == ["indexer", "restore", "ragged_dot", "sparse_attention", "sparse_global"]
        assert row["speedup_median"] == pytest.approx(1.062, abs=1e-3) and row["ledgers"]["head_row"] is None
        assert [s["file"] for s in row["sources"]] == ["ttft_64k_ffn_rows_sweep_a_h200.json"]
    assert len(row["recompute_s"]) == len(row["redknot_s"]) == len(row["ratio_per_repeat"]) == repeats
    assert row["layer_times"] and min(row["ratio_per_repeat"]) <= row["speedup_median"] <= max(row["ratio_per_repeat"])
    assert row["layer_times_src"]["file"] == layers_file


def test_the_newest_profile_sweep_is_plotted():
    """ttft_by_profile_64K.png: the Recomputed and prefix arms and each RedKnot variant of the
    newest --profiles run, in the run's order."""
    (run,) = pb.load_profiles(sorted((ROOT / "docs" / "results").glob("ttft_*_h200.json")))
    assert run["length"] == 65536 and run["source"]["date"] == "2026-12-04"
    names = [b[0] for b in run["bars"]]
    assert names[:2] == ["Recomputed", "prefix arm"] and names[2].startswith("RedKnot tail0-b10-omit (omit, 10% protected")
    assert run["recompute_s"] / run["bars"][2][1] == pytest.approx(2.19, abs=0.01)


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


def test_axis_labels_name_date_and_host_residency():
    """128K ran with host-resident artifacts: its label says so; each label names the day its
    runs were measured (the kernel sets are named on the page); a --build-only result (no timed
    rows) is not named as a source."""
    paths = sorted((ROOT / "docs" / "results").glob("ttft_*_h200.json"))
    rows, prov = pb.load_ttft(paths)
    labels = {r["length"]: pb._tick(r) for r in rows}
    assert labels[131072] == "128K\n11-30\nhost" and labels[65536] == "64K\n12-04"
    assert any("build" in p.name for p in paths) and not any("build" in line for line in prov)
    assert {s["length"]: s["kernels"] for s in pb.sources(rows)}[131072] == "indexer"
