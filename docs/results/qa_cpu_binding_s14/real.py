import sys, time, numpy as np, jax, jax.numpy as jnp
from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer, teacher_forced_scores
mode, steps = sys.argv[1], int(sys.argv[2])
cfg = qa_test_config(num_layers=4, hidden_size=64, head_dim=32, rope_dim=8, q_lora_rank=32, sliding_window=256,
                     o_lora_rank=32, index_topk=64)
tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), TrainConfig(lr=3e-3, block=128))
rng = np.random.default_rng(0)
names = D.split_names()["train"]
cur = {"2p": D.Curriculum(1, 2, 2, 6, two_hop=0.3), "4p": D.Curriculum(1, 1, 4, 4, two_hop=0.0)}[mode]
B, T = 8, 256
t0 = time.time(); hist = []
eps = D.eval_episodes("val", 48, seed=5, n_docs=2, per_doc=2, questions_per_type=2)
for s in range(steps):
    toks, w = D.training_batch(rng, names, B, T, cur)
    lr = 3e-3 * min(1, (s + 1) / 30)
    st = tr.step(toks, w, lr)
    hist.append(float(st["answer_acc"]))
    if s % 100 == 0 or s == steps - 1:
        res = teacher_forced_scores(tr, eps, T, 8) if s % 200 == 0 or s == steps - 1 else {}
        print(mode, s, f"{time.time()-t0:.0f}s", "ce %.3f tokacc %.3f" % (float(st["answer_ce"]), np.mean(hist[-50:])),
              {k: (round(v["em"], 3), round(v["chance"], 3)) for k, v in res.items()}, flush=True)
