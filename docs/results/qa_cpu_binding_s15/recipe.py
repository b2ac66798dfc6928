"""Session 15 scratch CPU probe (as run): the real in-window curriculum (2 people a document,
1-2 documents, 30 % two-hop) on a 4-layer, hidden-64 model of the project's modules, with one
recipe knob changed at a time; teacher-forced validation EM beside in-context chance.
    python docs/results/qa_cpu_binding_s15/recipe.py NAME STEPS [other_weight=0.02] [lr=3e-3]"""
import sys, time, numpy as np, jax.numpy as jnp
from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer, teacher_forced_scores
name, steps = sys.argv[1], int(sys.argv[2])
kw = dict(a.split("=") for a in sys.argv[3:])
ow, lr0 = float(kw.get("other_weight", 0.02)), float(kw.get("lr", 3e-3))
cfg = qa_test_config(num_layers=4, hidden_size=64, head_dim=32, rope_dim=8, q_lora_rank=32, sliding_window=256,
                     o_lora_rank=32, index_topk=64)
tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), TrainConfig(lr=lr0, block=128))
rng = np.random.default_rng(0)
names = D.split_names()["train"]
cur = D.Curriculum(1, 2, 2, 6, two_hop=0.3)
B, T = 8, 256
eps = D.eval_episodes("val", 48, seed=5, n_docs=2, per_doc=2, questions_per_type=2)
t0, hist = time.time(), []
for s in range(steps):
    toks, w = D.training_batch(rng, names, B, T, cur, ow)
    st = tr.step(toks, w, lr0 * min(1, (s + 1) / 30))
    hist.append(float(st["answer_acc"]))
    if s % 200 == 0 or s == steps - 1:
        res = teacher_forced_scores(tr, eps, T, 8)
        print(name, s, f"{time.time() - t0:.0f}s", "answer_acc %.3f" % np.mean(hist[-100:]),
              {k: (round(v["em"], 3), round(v["chance"], 3)) for k, v in res.items()}, flush=True)
