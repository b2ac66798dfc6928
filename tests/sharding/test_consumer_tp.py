"""Both arms tensor-parallel: the consumer's layers under shard_map on tp = 2 and 8 give the
single-device consumer's logits (fp32; summation order only), for a request with a prefix
document, relocated documents and new rows, with the fan-out rule trimming experts."""

import dataclasses

import numpy as np
import pytest

from redknot_jax import config
from redknot_jax.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.consumer import Consumer
from redknot_jax.reuse.planner import Request, Segment, plan_request
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.sharding.consumer_tp import TPConsumer
from redknot_jax.sharding.table import make_mesh
from tests.pallas.kernel_case import kernel_case
from tests.sharding.helpers import tiny_model
from tests.tolerances import TOL, rel_err

# every count divides 8: heads 16 / groups 8 / indexer heads 16 / experts 16 / vocab 128
CFG = config.tiny("mixed", num_layers=4, layer_types=(SLIDING, CSA, HCA, CSA),
                  mlp_layer_types=(HASH_MOE, MOE, MOE, MOE), num_heads=16, o_groups=8, index_n_heads=16,
                  n_routed_experts=16, experts_per_tok=3, vocab_size=128)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(CFG, seed=3)
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), budget_override=0.25, tail_rows=6, tau=0.6,
                               fanout_min=2, artifact_codec="fp4")  # z_L's NVFP4 codes and scales split by group
    rng = np.random.default_rng(4)
    docs = [rng.integers(2, CFG.vocab_size, n) for n in (36, 27)]
    arts = [build_artifact(model, prof, d, checkpoint_fingerprint="fp") for d in docs]
    req = Request([Segment(docs[0], arts[0]), Segment(docs[1], arts[1]), Segment(rng.integers(2, 128, 9))])
    single = Consumer(model, prof)
    plan = plan_request(req, prof)
    ref, hist = single.redknot(plan, req.tokens, single.pool(arts))
    rec = single.recompute(req.tokens, plan.query_rows)
    return model, prof, arts, req, plan, np.asarray(ref), np.asarray(hist), np.asarray(rec)


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_consumer_equals_single_device(setup, tp):
    model, prof, arts, req, plan1, ref, hist1, rec1 = setup
    assert 0 < plan1.fraction_protected() < 1 and hist1[2] > 0  # rows restored, experts trimmed
    con = TPConsumer(model, prof, make_mesh(tp))
    plan = plan_request(req, prof)
    logits, hist = con.redknot(plan, req.tokens, con.pool(arts))
    assert (plan.protected == plan1.protected).all()
    assert rel_err(np.asarray(logits), ref) < TOL["resharded_fp32"][0]
    np.testing.assert_array_equal(np.asarray(hist), hist1)
    assert rel_err(np.asarray(con.recompute(req.tokens, plan.query_rows)), rec1) < TOL["resharded_fp32"][0]


def test_tp_controller_ranks_by_deviation(setup):
    """itop_rank="deviation" under TP: the controller reads the first reusable layer of the
    mesh-replicated pool from one device and picks the single-device consumer's rows."""
    import jax

    model, prof, arts, req = setup[:4]
    dev = dataclasses.replace(prof, itop_rank="deviation")
    con, single = TPConsumer(model, dev, make_mesh(2)), Consumer(model, dev)
    pool_tp, pool_1 = con.pool(arts), single.pool(arts)
    first = single.reusable[0]
    assert all(len(a.sharding.device_set) == 2 for a in jax.tree.leaves(pool_tp.layers[first]))
    x = single._embed(single._pad(req.tokens)[0])  # a first-layer input of the right shape
    plans = plan_request(req, dev), plan_request(req, dev)
    con.base.controller(plans[0], jax.device_put(x, jax.devices()[0]), pool_tp, pool_tp.layers[first])
    single.controller(plans[1], x, pool_1, pool_1.layers[first])
    np.testing.assert_allclose(plans[0].deviation, plans[1].deviation, rtol=1e-6)
    assert plans[0].deviation.max() > 0 and (plans[0].protected == plans[1].protected).all()


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.gpu)])
def test_tp_consumer_runs_the_kernels(monkeypatch, tp):
    """kernels="indexer,restore" (indexer-score and restoration kernels inside shard_map) gives the logits
    of the XLA references, and both kinds of rank program (native: the fences, which are the
    Recomputed arm's programs; reusable: pass B) really call the indexer kernel.
    On CPU the kernels run in Mosaic GPU interpret mode, whose simulated shared memory is one
    state for all devices: two devices interpreting kernels at once trip its barrier check
    ("Barrier remains allocated", jax 0.11.2), so CPU CI runs tp = 1 (the shard_map programs
    with their kernels) and tp = 2 runs on two GPUs (`-m gpu`)."""
    import jax

    if tp > 1 and (jax.default_backend() != "gpu" or jax.device_count() < tp):
        pytest.skip(f"needs {tp} GPUs")
    from redknot_jax.pallas import indexer_scores as ix

    _, model, prof, arts, req = kernel_case()
    traced, kinds = [], []  # indexer kernel calls; the kernel sets the two kinds of rank program got
    kernel = ix.indexer_scores
    monkeypatch.setattr(ix, "indexer_scores", lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    from redknot_jax.sharding import consumer_tp, tp as tpmod

    for mod, name in ((tpmod, "_block"), (consumer_tp, "reusable_layer")):
        f = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=f, _n=name, **k: kinds.append((_n, k["kernels"])) or _f(*a, **k))
    mesh = make_mesh(tp)
    xla, mosaic = TPConsumer(model, prof, mesh, kernels="xla"), TPConsumer(model, prof, mesh, kernels="indexer,restore")
    assert xla.kernels == "" and mosaic.kernels == "indexer,restore"
    plan = plan_request(req, prof)
    assert 0 < plan.fraction_protected() < 1
    a, _ = xla.redknot(plan, req.tokens, xla.pool(arts))
    b, _ = mosaic.redknot(plan_request(req, prof), req.tokens, mosaic.pool(arts))
    assert rel_err(np.asarray(b), np.asarray(a)) < TOL["kernel_bf16_o"][0]
    # the fences run the Recomputed arm's native programs: both kinds of program got the kernels
    assert prof.fence_first and traced
    assert ("_block", "indexer,restore") in kinds and ("reusable_layer", "indexer,restore") in kinds
    assert ("_block", "") in kinds and ("reusable_layer", "") in kinds
