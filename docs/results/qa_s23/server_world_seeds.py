"""Sessions 23-24 check: the shipped model's greedy answers (Recomputed arm, in process,
tests/server/test_shipped_model.py's helper) on the test worlds of seeds 3, 4 and 5, the
lookups right of 4 first on each line, then the two-hop questions right of 4.
Session 23 (3 x 6 worlds, that session's model): server_world_seeds.txt; session 24 (the new
model, 3 x 6 and 3 x 4 worlds): ../qa_s24/server_world_seeds.txt.
    PYTHONPATH=$PWD python docs/results/qa_s23/server_world_seeds.py [DOCS PER_DOC]   # CPU, ~2 min"""
import sys

import numpy as np

from redknot_jax.quality import SHIPPED_MODEL, data as D
from redknot_jax.quality.model_config import qa_profile
from redknot_jax.quality.train import load_model
from redknot_jax.reuse.runtime import ReuseRuntime
from tests.server.test_shipped_model import _greedy_recompute

n_docs, per_doc = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (3, 6)
model = load_model(SHIPPED_MODEL)
rt = ReuseRuntime(model, qa_profile(model.cfg.num_layers, model.cfg.sliding_window), "in-process")
print(f"{n_docs} x {per_doc} worlds")
for seed in (3, 4, 5):
    (ep,) = D.eval_episodes("test", 1, seed=seed, n_docs=n_docs, per_doc=per_doc, questions_per_type=4)
    order = np.random.default_rng(seed).permutation(len(ep.docs))
    res = [(qa.qtype, qa.relation, _greedy_recompute(rt, [ep.docs[j] for j in order], qa.question),
            D.decode(qa.answer)) for qa in ep.qas]
    print(seed, sum(q == "lookup" and a == g for q, _, a, g in res),
          sum(q == "two_hop" and a == g for q, _, a, g in res), res)
