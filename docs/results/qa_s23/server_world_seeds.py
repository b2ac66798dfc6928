"""Session 23 check (as run): the shipped model's greedy answers (Recomputed arm, in process,
tests/server/test_shipped_model.py's helper) on the 3 x 6 test worlds of seeds 3, 4 and 5, the
lookups right of 4 first on each line; the server test uses seed 4. Output: server_world_seeds.txt.
    PYTHONPATH=$PWD python docs/results/qa_s23/server_world_seeds.py   # CPU, ~3 min"""
import numpy as np

from redknot_jax.quality import SHIPPED_MODEL, data as D
from redknot_jax.quality.model_config import qa_profile
from redknot_jax.quality.train import load_model
from redknot_jax.reuse.runtime import ReuseRuntime
from tests.server.test_shipped_model import _greedy_recompute

model = load_model(SHIPPED_MODEL)
rt = ReuseRuntime(model, qa_profile(model.cfg.num_layers, model.cfg.sliding_window), "in-process")
for seed in (3, 4, 5):
    (ep,) = D.eval_episodes("test", 1, seed=seed, n_docs=3, per_doc=6, questions_per_type=4)
    order = np.random.default_rng(seed).permutation(len(ep.docs))
    res = [(qa.qtype, qa.relation, _greedy_recompute(rt, [ep.docs[j] for j in order], qa.question),
            D.decode(qa.answer)) for qa in ep.qas]
    print(seed, sum(q == "lookup" and a == g for q, _, a, g in res), res)
