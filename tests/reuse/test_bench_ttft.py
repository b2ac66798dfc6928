"""launch/bench_ttft.py end to end on CPU (tiny preset): a build-only call publishes the
documents' artifacts to a store (--store), the timed call reads them back and runs both arms with
host-resident artifacts streamed per layer, the per-layer and op-level profiles of the three arms
and the cold (construction
included) RedKnot run, two kernel sets x two entry-prefix stagings timed side by side under one
--profiles variant; every RedKnot run certified, none fell back; the medians and the headline
written before the optional profiling stages."""

import dataclasses
import json

import jax
import pytest

from launch import bench_ttft
from redknot_jax.reuse.profile import tiny_profile


def test_bench_ttft_store_host_resident_cold_layers(monkeypatch, tmp_path):
    # a small tail so that rows are restored (the tiny profile's default protects most of 96 rows)
    monkeypatch.setattr(bench_ttft, "tiny_profile", lambda n: dataclasses.replace(tiny_profile(n), tail_rows=4))
    common = ["--preset", "tiny", "--lengths", "96", "--docs", "2", "--question", "8", "--repeats", "1",
              "--budget", "0.25", "--profiles", "tail4-k3", "--store", str(tmp_path / "store")]
    built = bench_ttft.main(common + ["--build-only", "--out", str(tmp_path / "b.json")])["lengths"][0]
    assert built["artifacts"] == "built" and built["build_s"] > 0 and "recompute_s" not in built
    out = tmp_path / "ttft.json"
    saved = []  # what the files held when the op-level profile started: a run cut there keeps its medians
    summarize = bench_ttft.op_profile.summarize
    monkeypatch.setattr(bench_ttft.op_profile, "summarize", lambda *a, **k: saved.append(
        ("redknot_median_s" in json.loads(out.read_text())["lengths"][0],
         json.loads((tmp_path / "headline.json").read_text())["best_measured"] != [])) or summarize(*a, **k))
    res = bench_ttft.main(common + ["--resident", "host", "--host-kind", "pinned", "--cold", "--layer-times",
                                    "--kernels", "xla,auto", "--topk-stages", "4,1", "--query-block", "16",
                                    "--op-profile", "0,2", "--decode-steps", "3", "--decode-batch", "2",
                                    "--out", str(out), "--headline", str(tmp_path / "headline.json")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res)) and res["resident"] == "host"
    assert saved and all(all(x) for x in saved)
    head = json.loads((tmp_path / "headline.json").read_text())  # tail4-k3 is not the preset's own profile
    assert head["rows"] == [] and head["best_measured"][0]["redknot_s"] == min(
        v["redknot_median_s"] for v in res["lengths"][0]["by_kernels"].values())
    row = res["lengths"][0]
    # the same records, their artifacts read back from the store (content ids), not rebuilt
    assert row["records_sha256"] == built["records_sha256"]
    assert row["artifacts"] == "store" and row["load_s"] > 0 and "build_s" not in row
    assert 0 < row["protected_fraction"] < 1 and row["pool_gb"] > 0 and row["pool"] == "HostPool"
    assert row["host_kind"] == "pinned"
    assert len(row["cold_redknot_s"]) == 1 and row["cold_redknot_median_s"] > 0
    # warm-up + 1 hot repeat + the RedKnot decode prefill + its 2 decode-batch copies + 1 cold run, each
    # certified (the cold one on freshly built artifacts)
    assert row["cert"]["validated"] == 6 and not any(row["cert"]["fallback"].values())
    # both kernel sets (off a GPU "auto" resolves to none) x both stagings, each timed per repeat, each
    # certified; the first named fills the row's main fields
    names = {"xla/stages4", "xla/stages1", "auto/stages4", "auto/stages1"}
    assert res["kernels_resolved"] == dict.fromkeys(names, "") and res["shape_buckets"] == 8
    assert res["query_block"] == 16  # every arm's (the tiny consumer's default is 32)
    # one --profiles variant: the profile of every kernel set
    assert set(res["profiles"]) == names and {p["fanout_mode"] for p in res["profiles"].values()} == {"k3"}
    assert res["topk_stages"] == [4, 1]
    by = row["by_kernels"]
    assert set(by) == names and by["xla/stages4"]["recompute_s"] == row["recompute_s"]
    assert all(len(v["redknot_s"]) == 1 and v["speedup_median"] > 0 for v in by.values())
    assert by["auto/stages1"]["cert"]["validated"] == 2 and not any(by["auto/stages1"]["cert"]["fallback"].values())
    # every variant answers with the same first tokens
    assert len({tuple(v["tokens"][-1]) for v in by.values()}) == 1
    lt = row["layer_times"]  # the per-layer profile: every layer of every arm, fences named
    assert len(lt["recompute_s"]) == len(lt["prefix_s"]) == len(lt["redknot_s"]) == len(lt["role"]) == len(lt["kind"])
    assert min(lt["recompute_s"] + lt["prefix_s"] + lt["redknot_s"]) > 0 and {"fence", "reusable"} == set(lt["role"])
    assert 0 < lt["redknot_controller_s"] <= lt["redknot_plan_s"]  # the host's share of the first reusable layer
    ops = row["op_profile"]  # a fence and a reusable layer traced on their own, every arm
    assert ops["layers"] == {"0": {"kind": "sliding_attention", "role": "fence"},
                             "2": {"kind": "heavily_compressed_attention", "role": "reusable"}}
    for arm in ("recompute", "prefix", "redknot"):
        for layer in ("0", "2"):
            s = ops[arm][layer]
            assert s["ops"] > 0 and s["ops_ms"] > 0 and s["top"], (arm, layer)
            assert sum(s["by_category"].values()) == pytest.approx(s["ops_ms"])
            assert "matmul" in s["by_category"]
    assert sorted(p.name for p in (tmp_path / "ttft.json.traces" / "96" / "redknot").iterdir()) == ["layer_00",
                                                                                                      "layer_02"]
    dec = row["decode"]  # three tokens per arm over decode states; RedKnot's reusable layers hold compact rows
    for arm in ("redknot", "recompute"):
        d = dec[arm]
        assert d["rows_after"] == dec["request_rows"] + 3 and len(d["step_s"]) == 2 and d["step_median_s"] > 0
        assert len(d["tokens"]) == 4 and d["state_gb"] > 0
    assert dec["recompute_over_redknot_step"] > 0
    for arm in ("redknot", "recompute"):  # two copies as rows of one DecodeBatch: the single run's tokens
        b = dec["batch"][arm]
        assert dec["batch"]["size"] == 2 and b["tokens_equal_alone"] and b["per_token_s"] == b["step_median_s"] / 2
    red = dec["redknot"]
    assert red["compact_rows"] < dec["request_rows"] // 2 and red["compact_capacity"] >= red["compact_rows"] + 3
    assert 0 < red["compact_gb"] < red["per_row_copy_gb"] and red["fence_cache_gb"] > 0 and red["entries_gb"] > 0
    assert red["state_gb"] == pytest.approx(red["compact_gb"] + red["entries_gb"] + red["fence_cache_gb"]
                                            + red["layout_gb"])
    # the RedKnot decode again under every further variant, the same greedy tokens
    assert set(dec["by_kernels"]) == names - {"xla/stages4"}
    for v in dec["by_kernels"].values():
        assert v["redknot"]["tokens"] == red["tokens"] and len(v["redknot"]["step_s"]) == 2
        assert v["redknot"]["decode_kernels"] == ""


def test_headline_rows_are_the_presets_own_profile():
    """`headline`: per length the variant with no override but the codec as the row, the fastest
    as best_measured; a length cut off before its medians is left out."""
    name = lambda *o: "-".join(("flash-3F-37R-3F",) + o)
    out = {"device": "d", "date": "2026-12-06", "jax": "0.11.2", "command": "c",
           "profiles": {"tail0-omit-fp4": {"name": name("tail_rows=0", "ffn_rows=omit", "artifact_codec=fp4"),
                                           "ffn_rows": "omit"},
                        "fp4": {"name": name("artifact_codec=fp4"), "ffn_rows": "restore"}},
           "lengths": [{"length": 65536, "recompute_s": [8.0, 8.0], "prefix_median_s": 7.0, "redknot_median_s": 3.0,
                        "by_profile": {v: {"recompute_median_s": 8.0, "redknot_median_s": t, "protected_fraction": f,
                                           "operator_bound": b}
                                       for v, t, f, b in (("tail0-omit-fp4", 2.0, 0.1, 3.8), ("fp4", 7.5, 0.5, 1.1))}},
                       {"length": 131072, "recompute_s": [16.0]}]}
    head = bench_ttft.headline(out)
    assert [r["variant"] for r in head["rows"]] == ["fp4"] and head["rows"][0]["redknot_s"] == 7.5
    assert head["rows"][0]["prefix_s"] == 7.0 and head["rows"][0]["repeats"] == 2
    assert [(r["variant"], r["ffn_rows"]) for r in head["best_measured"]] == [("tail0-omit-fp4", "omit")]


@pytest.mark.parametrize("flags,named", [
    (["--resident", "disk"], "argument --resident: invalid choice: 'disk'"),
    (["--build-only"], "--build-only needs --store"),
    (["--build-only", "--store", "/tmp/s", "--cold"], "--build-only times nothing; drop --cold"),
    (["--host-kind", "gpu"], "argument --host-kind: invalid choice: 'gpu'"),
    (["--preset", "tiny2"], "argument --preset: invalid choice: 'tiny2'"),
    (["--kernels", "triton"], "--kernels: expected one or several distinct sets.*got 'triton'"),
    (["--kernels", "xla,xla"], "--kernels: expected one or several distinct sets.*got 'xla,xla'"),
    (["--kernels", "indexer+triton"], r"--kernels: .*joined by '\+', got 'indexer\+triton'"),
    (["--docs", "0"], "--docs: expected >= 1, got 0"), (["--repeats", "0"], "--repeats: expected >= 1, got 0"),
    (["--lengths", "abc"], "--lengths: expected comma-separated integers"),
    (["--lengths", "1000", "--question", "2000"], r"--lengths \[1000\]: a request needs"),
    (["--op-profile", "99"], r"--op-profile: layer indices must lie in \[0, 6\)"),
    (["--op-profile", "a"], "--op-profile: expected comma-separated layer indices"),
    (["--decode-steps", "-1"], "--decode-steps: expected >= 0, got -1"),
    (["--stacks-every", "-1"], "--stacks-every: expected seconds >= 0, got -1.0"),
    (["--decode-batch", "2"], "--decode-batch: expected >= 0, with --decode-steps, got 2"),
    (["--query-block", "96"], "--query-block: expected 0 or a power of two, got 96"),
    (["--shape-buckets", "3"], "--shape-buckets: Buckets: per_octave must be 0 or a power of two, got 3"),
    (["--topk-stages", "0"], "--topk-stages: expected distinct ints >= 1"),
    (["--topk-stages", "2,2"], "--topk-stages: expected distinct ints >= 1"),
    (["--topk-stages", "a"], "--topk-stages: expected distinct ints >= 1, comma-separated, got 'a'"),
    (["--profiles", "tail0-fp8,tail0-fp4"], "--profiles: the variants must share fences, Global head and artifact codec"),
    (["--profiles", "tail0-fp16"], "--profiles: profile variant 'tail0-fp16': cannot read 'fp16'"),
    (["--profiles", "tail0,tail4", "--kernels", "xla,auto"], "--profiles: time profile variants under one kernel set")])
def test_bench_ttft_rejects_bad_flags(tmp_path, refused, flags, named):
    """Each bad flag is refused before any work, by the message of its own check (the usage line
    names every flag, so the error line itself is matched)."""
    refused(bench_ttft.main, ["--preset", "tiny", *flags, "--out", str(tmp_path / "x.json")], "error: " + named)


def test_running_out_of_device_memory_is_named():
    def arm(msg):
        raise jax.errors.JaxRuntimeError(msg)

    row = {"length": 65536, "pool_gb": 64.9}
    with pytest.raises(SystemExit, match=r"the recompute arm at 65536 tokens ran out of device memory beside 49\.2 GB "
                                         r"of weights and a 64\.9 GB dense artifact pool: use a compact codec"):
        bench_ttft.out_of_memory_named(arm, "the recompute arm", row, 49.2, "dense")("RESOURCE_EXHAUSTED: 8.11GiB")
    with pytest.raises(SystemExit, match=r"and fp4 artifacts: use --resident host"):  # before admission; compact
        bench_ttft.out_of_memory_named(arm, "admitting", {"length": 8}, 49.2, "fp4")("RESOURCE_EXHAUSTED: 1GiB")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # any other runtime error as it was
        bench_ttft.out_of_memory_named(arm, "the recompute arm", row, 49.2, "dense")("INTERNAL: x")
    assert bench_ttft.parse_profile(tiny_profile(4), "dense").artifact_codec == "dense"
