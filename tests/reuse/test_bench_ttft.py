"""launch/bench_ttft.py end to end on CPU (tiny preset): both arms on the frozen records, with
host-resident artifacts streamed per layer and the cold (construction included) RedKnot run;
every RedKnot run certified, none fell back."""

import dataclasses
import json

import pytest

from launch import bench_ttft
from redknot_jax.reuse.profile import tiny_profile


def test_bench_ttft_host_resident_and_cold(monkeypatch, tmp_path):
    # a small tail so that rows are restored (the tiny profile's default protects most of 96 rows)
    monkeypatch.setattr(bench_ttft, "tiny_profile", lambda n: dataclasses.replace(tiny_profile(n), tail_rows=4))
    out = tmp_path / "ttft.json"
    res = bench_ttft.main(["--preset", "tiny", "--lengths", "96", "--docs", "2", "--question", "8", "--repeats", "1",
                           "--resident", "host", "--cold", "--budget", "0.25", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res)) and res["resident"] == "host"
    row = res["lengths"][0]
    assert 0 < row["protected_fraction"] < 1 and row["pool_gb"] > 0 and row["pool"] == "HostPool"
    assert len(row["cold_redknot_s"]) == 1 and row["cold_redknot_median_s"] > 0
    # warm-up + 1 hot repeat + 1 cold run, each certified (the cold one on freshly built artifacts)
    assert row["cert"]["validated"] == 3 and not any(row["cert"]["fallback"].values())


def test_bench_ttft_rejects_unknown_residency(tmp_path):
    with pytest.raises(SystemExit):
        bench_ttft.main(["--preset", "tiny", "--resident", "disk", "--out", str(tmp_path / "x.json")])


def test_bench_ttft_store_split_build_then_timed(tmp_path):
    """--store: a build-only call publishes the artifacts; the timed call reads them back (content
    ids), certifies them and times both arms; its first token equals a run that built its own."""
    common = ["--preset", "tiny", "--lengths", "96", "--docs", "2", "--question", "8", "--repeats", "1",
              "--budget", "0.25"]
    store = str(tmp_path / "store")
    built = bench_ttft.main(common + ["--store", store, "--build-only", "--out", str(tmp_path / "b.json")])
    assert built["lengths"][0]["artifacts"] == "built" and "recompute_s" not in built["lengths"][0]
    timed = bench_ttft.main(common + ["--store", store, "--layer-times", "--out", str(tmp_path / "t.json")])["lengths"][0]
    lt = timed["layer_times"]  # the per-layer profile: every layer of both arms, fences named
    assert len(lt["recompute_s"]) == len(lt["redknot_s"]) == len(lt["role"]) == len(lt["kind"])
    assert min(lt["recompute_s"] + lt["redknot_s"]) > 0 and {"fence", "reusable"} == set(lt["role"])
    assert timed["artifacts"] == "store" and timed["load_s"] > 0 and "build_s" not in timed
    assert timed["cert"]["validated"] == 2 and not any(timed["cert"]["fallback"].values())
    fresh = bench_ttft.main(common + ["--out", str(tmp_path / "f.json")])["lengths"][0]
    assert timed["records_sha256"] == fresh["records_sha256"]
    assert timed["first_token_agree"] == fresh["first_token_agree"]
    assert timed["protected_rows"] == fresh["protected_rows"]


def test_bench_ttft_build_only_needs_store(tmp_path):
    with pytest.raises(SystemExit):
        bench_ttft.main(["--preset", "tiny", "--build-only", "--out", str(tmp_path / "x.json")])
