"""Tensor-parallel forward (shard_map over "tp") equals the unsharded model.

Identity checked: tp = 1 is bit-identical to `Model.forward` on one device; for tp in {2, 8},
`TPForward.forward` (prefill of a right-padded batch in two query blocks, then 3 decode steps
of one row) gives the logits and caches of tp = 1 up to fp32 summation order (the psums split
the wo_b / expert / embedding sums by rank). Replicated outputs are identical on every rank.
The communication ledger matches the collectives in the lowered program. A perturbed slice on
one rank is detected.
"""

import dataclasses
import re

import chex
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.sharding import make_mesh
from redknot_jax.sharding.table import check_tp
from redknot_jax.sharding.tp import TPForward, comm_ledger
from tests.sharding.helpers import (BATCH, BLOCK, CAPACITY, CFG, COMPILER_OPTIONS, PROMPT, assert_trees_close,
                                    inputs, reference_run, run_steps, single_rank_engine, tiny_model,
                                    unsharded_prefill)
from tests.tolerances import TOL, rel_err

TIGHT = TOL["resharded_fp32"][0]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engines(model):
    return {1: single_rank_engine(),
            **{tp: TPForward(model, make_mesh(tp), block=BLOCK, compiler_options=COMPILER_OPTIONS) for tp in (2, 8)}}


@pytest.fixture(scope="module")
def runs(engines):
    """Every tp's run and the unsharded prefill, one after the other (tracing and compiling
    from several Python threads at once -- Flax NNX graph utilities included -- was a suspect of
    a segfault in XLA's CPU compiler seen once late in a full CI run)."""
    ids, n_new, rows, decode = inputs()
    out = {"unsharded": unsharded_prefill(), 1: reference_run()}
    for tp, f in engines.items():
        if tp != 1:
            out[tp] = run_steps(f.forward, f.init_cache(BATCH, CAPACITY), ids, n_new, rows, decode)
    return out


def test_tp1_is_the_unsharded_model(runs):
    """One rank, no collective: exactly `Model.forward`'s prefill logits (the reference the
    other tps and the multi-host run are held to, with its decode steps)."""
    np.testing.assert_array_equal(runs[1][0][0], runs["unsharded"])


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_logits_equal_single_device(runs, tp):
    ref, _ = runs[1]
    got, _ = runs[tp]
    assert len(got) == len(ref) == 4  # the prefill, then 3 decode steps
    chex.assert_tree_all_finite(got)
    assert_trees_close(got, ref)  # step by step: shapes, then rel err <= TIGHT
    assert rel_err(got[0], runs["unsharded"]) <= TIGHT


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_caches_equal_and_replicated(runs, tp):
    """The cache (one K=V head, compressor states, entries) is whole and identical on every
    rank, and equals the unsharded cache."""
    _, ref_cache = runs[1]
    _, cache = runs[tp]
    chex.assert_trees_all_equal(cache["length"], ref_cache["length"])
    layers = cache["layers"]
    assert {len(leaf.addressable_shards) for leaf in jax.tree.leaves(layers)} == {tp}
    ranks = [jax.tree.map(lambda leaf, r=r: np.asarray(leaf.addressable_shards[r].data), layers) for r in range(tp)]
    chex.assert_trees_all_equal_shapes(layers, *ranks)  # every rank holds each leaf whole
    chex.assert_trees_all_equal(*ranks, strict=True)  # ... and the same values on every rank
    assert_trees_close(ranks[0], ref_cache["layers"])  # == the unsharded cache, leaf by leaf


def test_perturbed_rank_slice_is_detected(engines, runs):
    """Negative control: 1 % on one rank's slice of one wo_b moves the logits far past TIGHT."""
    f = engines[8]
    path = "layers.1.attn.wo_b"
    params = list(nnx.to_flat_state(f.params))
    i = [".".join(map(str, p)) for p, _ in params].index(path)
    arr = params[i][1]
    host = np.asarray(arr).copy()
    cols = host.shape[1] // 8
    host[:, 5 * cols:6 * cols] *= 1.01  # rank 5's columns only
    saved = arr
    try:
        params[i] = (params[i][0], jax.device_put(host, arr.sharding))
        f.params = nnx.from_flat_state(params)
        ids, n_new, rows, _ = inputs()
        logits, _ = f.forward(ids, np.zeros(BATCH, np.int32), n_new, f.init_cache(BATCH, CAPACITY), rows)
    finally:
        params[i] = (params[i][0], saved)
        f.params = nnx.from_flat_state(params)
    assert rel_err(logits, runs[8][0][0]) > TOL["negative_control_min"][0]


def _collectives(hlo: str):
    """(op, element count, bytes per element) of each all_reduce / all_gather, program order."""
    out = []
    for m in re.finditer(r'"?stablehlo\.(all_reduce|all_gather)"?.*?->\s*tensor<([0-9x]+)x(f32|bf16|i32)>',
                         hlo, re.S):
        n = int(np.prod([int(x) for x in m.group(2).split("x")]))
        out.append(("psum" if m.group(1) == "all_reduce" else "all_gather", n, {"f32": 4, "bf16": 2, "i32": 4}[m.group(3)]))
    return out


@pytest.mark.parametrize("t", [PROMPT, 1])
def test_comm_ledger_matches_lowered_program(engines, t):
    """Every collective the ledger lists is in the lowered tp=8 program (and nothing else),
    with the same size; prefill and decode shapes."""
    f = engines[8]
    ids = np.zeros((BATCH, t), np.int32)
    vec = np.zeros(BATCH, np.int32)
    rows = np.zeros((BATCH, 2 if t > 1 else 1), np.int32)
    hlo = f.lower(ids, vec, vec, f.cache_shapes(BATCH, CAPACITY), rows).as_text()
    ledger = comm_ledger(CFG, BATCH * t, rows.size, 8, act_dtype=jnp.float32)
    want = [ledger["ends"][0]] + [c for layer in ledger["per_layer"] for c in layer["collectives"]] + [ledger["ends"][1]]
    got = _collectives(hlo)
    assert [(c["op"], c["call_bytes"]) for c in want] == [(op, n * s) for op, n, s in got]
    assert ledger["total"]["count"] == len(got) == 2 + 2 * CFG.num_layers + 2  # one CSA layer: +2 gathers
    assert all(layer["wire_bytes_per_rank"] > 0 for layer in ledger["per_layer"])
    assert comm_ledger(CFG, BATCH * t, rows.size, 1)["total"]["count"] == 0


def test_check_tp_refuses_partial_heads():
    with pytest.raises(ValueError, match="o_groups"):
        check_tp(CFG, 16)
    with pytest.raises(ValueError, match="vocab_size"):
        check_tp(dataclasses.replace(CFG, vocab_size=97), 2)
