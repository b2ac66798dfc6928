import sys, time, numpy as np, jax, jax.numpy as jnp
from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer
mode, steps, npeople = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = qa_test_config(num_layers=4, hidden_size=64, head_dim=32, rope_dim=8, q_lora_rank=32, sliding_window=256,
                     o_lora_rank=32, index_topk=64)
tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), TrainConfig(lr=3e-3, block=128))
rng = np.random.default_rng(0)
names = D.split_names()["train"]
def episode():
    sub = [names[i] for i in rng.choice(len(names), npeople, replace=False)]
    w = D.make_world(rng, sub, 1, npeople)
    if mode.startswith("grouped"):
        d = ["document", ":"]
        for k in rng.permutation(npeople):
            p = w.people[k]
            d += list(p.name) + ["lives", "in", p.city, ",", "likes", p.color, ",", "works", "as", p.job, ",", "reports", "to", *w.people[p.boss].name, "."]
        toks = D.encode([x if x != "," else "." for x in d])
    else:
        toks = list(w.docs[0])
    wt = [0.02] * len(toks); ch = []
    rels = ["city"] if mode.endswith("city") else list(D.RELATIONS)
    for k in rng.permutation(npeople):
        rel = rels[rng.integers(len(rels))]
        p = w.people[k]
        ans = list(w.people[p.boss].name) if rel == "boss" else [getattr(p, rel)]
        q = D.encode(D._LOOKUP_Q[rel].format(" ".join(p.name)).split() + [])
        q = D.encode("question :") + q + D.encode("answer :")
        a = D.encode(ans)
        toks += q + a + [D.EOS]; wt += [0.02] * len(q) + [1.0] * (len(a) + 1)
        vals = [list(w.people[o.boss].name) if rel == "boss" else [getattr(o, rel)] for o in w.people]
        ch.append(sum(v == ans for v in vals) / len(vals))
    return toks, wt, ch
B, T = 8, 256
t0 = time.time(); hist = []; chs = []
for s in range(steps):
    rows, ws = [], []
    for _ in range(B):
        t, w = [], []
        while True:
            e, ew, c = episode()
            if len(t) + len(e) > T + 1: break
            t += e; w += ew; chs += c
        n = len(t); t += [D.PAD] * (T + 1 - n); w = (w + [0.0] * (T + 1 - n))[1:]
        rows.append(t); ws.append(w)
    lr = 3e-3 * min(1, (s + 1) / 30)
    st = tr.step(np.asarray(rows, np.int32), np.asarray(ws, np.float32), lr)
    hist.append(float(st["answer_acc"]))
    if s % 50 == 0 or s == steps - 1:
        a = np.mean(hist[-50:])
        print(mode, npeople, s, f"{time.time()-t0:.0f}s", "ce %.3f tokacc %.3f chance %.3f" % (float(st["answer_ce"]), a, np.mean(chs[-2000:])), flush=True)
