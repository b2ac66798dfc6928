"""launch/bench_tp.py (issue #6 item 6) end to end on 2 CPU devices: both arms at tp = 1 and 2
on the same frozen request, certified on every rank, fp32 logits equal to tp = 1's
(summation order only)."""

import dataclasses
import json

import pytest

from launch import bench_tp
from redknot_jax import config
from redknot_jax.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from redknot_jax.reuse.profile import tiny_profile
from tests.tolerances import TOL


@pytest.fixture
def tp_preset(monkeypatch):
    # a small tail so that rows are restored (the tiny profile's default protects most of 96 rows)
    monkeypatch.setattr(bench_tp, "tiny_profile",
                        lambda n: dataclasses.replace(tiny_profile(n), tail_rows=4, budget_override=0.25))
    # tiny-tp2 cut to 4 layers (the test is compile-bound: one program per distinct layer): a
    # sliding fence, reusable CSA and HCA layers, a CSA fence; hash-routed and learned MoE
    monkeypatch.setitem(config.PRESETS, "tiny-tp2", lambda: config.tiny(
        "mixed", vocab_size=96, num_layers=4, layer_types=(SLIDING, CSA, HCA, CSA),
        mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE)))
    return "tiny-tp2"


def test_bench_tp_cpu(tp_preset, tmp_path):
    """tp = 1 and tp = 2 in two runs joined by --save-ref / --ref (the form a GPU call too short for
    both uses); the second run's JSON holds both degrees as one run's would."""
    out, ref = tmp_path / "tp.json", tmp_path / "tp1.npz"
    common = ["--preset", tp_preset, "--lengths", "96", "--docs", "2", "--question", "8", "--dtype", "float32"]
    bench_tp.main(common + ["--fp32-floor", "--tp", "1", "--save-ref", str(ref), "--out", str(tmp_path / "tp1.json")])
    res = bench_tp.main(common + ["--tp", "2", "--ref", str(ref), "--out", str(out)])  # the floor travels in the ref
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    row = res["lengths"][0]
    one, two = row["tp"]["1"], row["tp"]["2"]
    assert 0 < two["protected_fraction"] < 1 and two["protected_fraction"] == one["protected_fraction"]
    for arm in ("recompute", "redknot"):
        agree = two["agree_with_tp1"][arm]
        assert agree["rel_l2"] < TOL["resharded_fp32"][0] and agree["first_token_agree"], (arm, agree)
        assert two["scaling_efficiency"][arm] > 0
    for res in (one, two):  # fp32 run vs the fp32 floor: the same weights, so summation order only
        for arm in ("recompute", "redknot"):
            assert res[f"{arm}_vs_fp32_tp1"]["rel_l2"] < TOL["resharded_fp32"][0], arm
    assert row["fp32_floor_from"] == str(ref)
    assert two["agree_with_tp1"]["redknot"]["protected_rows_differ"] == 0
    assert row["cert"]["validated"] == 2 and not any(row["cert"]["fallback"].values())  # warm-up + 1 repeat at tp = 2
    with pytest.raises(SystemExit, match="other request records"):  # a reference of other requests is refused
        bench_tp.main(common[:7] + ["9"] + common[8:] + ["--tp", "2", "--ref", str(ref), "--out", str(out)])
    with pytest.raises(SystemExit, match="written for dtype"):
        bench_tp.main(common[:9] + ["bfloat16"] + common[10:] + ["--tp", "2", "--ref", str(ref), "--out", str(out)])
    with pytest.raises(SystemExit, match="already holds the fp32 floor"):
        bench_tp.main(common + ["--fp32-floor", "--tp", "2", "--ref", str(ref), "--out", str(out)])


def test_bench_tp_rejects_bad_tp(tp_preset, tmp_path, refused):
    refused(bench_tp.main, ["--preset", tp_preset, "--tp", "3", "--out", str(tmp_path / "x.json")], "--tp 3: ")
    refused(bench_tp.main, ["--preset", tp_preset, "--tp", "two", "--out", str(tmp_path / "x.json")],
            "--tp: expected comma-separated integers, got 'two'")
