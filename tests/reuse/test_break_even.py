"""The break-even table (reuse/break_even.py): validation naming the bad field, interpolation
between measured lengths, proportional extrapolation, the choice of arm, a request's tier."""

import dataclasses

import pytest

from redknot_jax.reuse.break_even import BreakEven, BreakEvenError, request_tier
from redknot_jax.reuse.profile import tiny_profile

SRC = {"device": "cpu", "date": "2026-12-05", "command": "python launch/bench_break_even.py", "profile": "p",
       "profile_digest": "0" * 64}


def table(points):
    return BreakEven.from_dict({**SRC, "points": points})


def test_estimates_and_choice():
    t = table([{"tier": "device", "tokens": 1000, "recompute_s": 1.0, "redknot_s": 2.0},
               {"tier": "device", "tokens": 3000, "recompute_s": 3.0, "redknot_s": 2.0},
               {"tier": "disk", "tokens": 1000, "recompute_s": 1.0, "redknot_s": 4.0}])
    assert t.estimate("device", 2000) == pytest.approx((2.0, 2.0))  # linear between the points
    assert t.estimate("device", 500) == pytest.approx((0.5, 1.0))  # below: in proportion to the length
    assert t.estimate("device", 6000) == pytest.approx((6.0, 4.0))  # above: likewise
    assert t.choose("device", 1500).arm == "recompute" and t.choose("device", 2500).arm == "redknot"
    assert t.choose("device", 2000).arm == "redknot"  # a tie: RedKnot
    assert t.estimate("host", 1000) == (1.0, 4.0)  # no host point: the next slower tier measured (disk)
    c = t.choose("disk", 2000).to_dict()
    assert c == {"arm": "recompute", "tier": "disk", "tokens": 2000,
                 "estimate_s": {"recompute": 2.0, "redknot": 8.0}, "table": "break-even"}
    assert request_tier(["device", "disk", "host"]) == "disk" and request_tier(["device", "host"]) == "host"
    assert request_tier([]) == "device"


@pytest.mark.parametrize("d,match", [
    ({"points": []}, "at least one point"),
    ({"device": "", "points": [{"tier": "host", "tokens": 5, "recompute_s": 1, "redknot_s": 1}]},
     "'device' must say where"),
    ({"profile_digest": None, "points": [{"tier": "host", "tokens": 5, "recompute_s": 1, "redknot_s": 1}]},
     "'profile_digest' must say the RedKnot profile measured"),
    ({"points": [{"tier": "ram", "tokens": 1, "recompute_s": 1, "redknot_s": 1}]}, r"points\[0\].tier.*'ram'"),
    ({"points": [{"tier": "host", "tokens": 0, "recompute_s": 1, "redknot_s": 1}]}, r"points\[0\].tokens.*0"),
    ({"points": [{"tier": "host", "tokens": 5, "recompute_s": -1, "redknot_s": 1}]}, r"points\[0\].recompute_s"),
    ({"points": [{"tier": "host", "tokens": 5, "recompute_s": 1, "redknot_s": float("nan")}]}, r"redknot_s"),
    ({"points": [{"tier": "host", "tokens": 5, "recompute_s": 1, "redknot_s": 1}] * 2}, "two points at one length"),
])
def test_bad_tables_are_refused_naming_the_field(d, match):
    with pytest.raises(BreakEvenError, match=match):
        BreakEven.from_dict({**SRC, **d})


def test_committed_tables_serve_their_profiles():
    """docs/benchmarks.md: `serve.py --break-even docs/results/break_even_cpu.json` serves the
    shipped QA model, and the H100 table serves `--profile launch/profiles/flash_tail0_b10.json`:
    each table names that profile."""
    import pathlib

    from redknot_jax.quality import SHIPPED_MODEL
    from redknot_jax.quality.model_config import profile_of
    from redknot_jax.reuse.profile import RedKnotProfile

    root = pathlib.Path(__file__).resolve().parents[2]
    BreakEven.read(root / "docs/results/break_even_cpu.json").check_profile(profile_of(SHIPPED_MODEL))
    BreakEven.read(root / "docs/results/break_even_tail0_b10_h100_s58.json").check_profile(
        RedKnotProfile.read(root / "launch/profiles/flash_tail0_b10.json"))


def test_read_errors(tmp_path):
    with pytest.raises(BreakEvenError, match="No such file"):
        BreakEven.read(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(BreakEvenError, match="bad.json"):
        BreakEven.read(tmp_path / "bad.json")
    with pytest.raises(BreakEvenError, match="tier: expected one of"):
        table([{"tier": "host", "tokens": 5, "recompute_s": 1, "redknot_s": 1}]).estimate("ssd", 5)


def test_bench_break_even_writes_a_table_the_server_reads(tmp_path, refused):
    """launch/bench_break_even.py end to end on the tiny preset: every tier timed at every length,
    and the file it writes is a valid table."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "bench_break_even", pathlib.Path(__file__).resolve().parents[2] / "launch" / "bench_break_even.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "t.json"
    res = bench.main(["--preset", "tiny", "--profile", "tiny", "--lengths", "48", "--docs", "2", "--question", "8",
                      "--repeats", "1", "--artifact-codec", "fp8", "--out", str(out)])
    assert [(p["tier"], p["tokens"]) for p in res["points"]] == [("device", 48), ("host", 48), ("disk", 48)]
    assert {r["arm"] for r in res["raw"]} == {"recompute", "device", "host", "disk"}
    table = BreakEven.read(out)
    assert table.choose("disk", 64).arm in ("recompute", "redknot") and table.source["device"] == res["device"]
    # it serves its own profile only (the codec is part of it)
    table.check_profile(dataclasses.replace(tiny_profile(6), artifact_codec="fp8"))
    with pytest.raises(BreakEvenError, match="measured with RedKnot profile 'tiny-1F-4R-1F'.*but the server serves "
                                             "'tiny-1F-4R-1F'"):
        table.check_profile(tiny_profile(6))
    refused(bench.main, ["--preset", "tiny", "--lengths", "4", "--docs", "2", "--question", "8"],
            r"--lengths \[4\]: a request needs at least")
    refused(bench.main, ["--preset", "tiny", "--profile", "tinyy"], r"--profile: profile: expected auto, tiny, .*'tinyy'")
