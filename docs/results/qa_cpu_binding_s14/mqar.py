import sys, time, numpy as np, jax, jax.numpy as jnp
from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer
mode, steps, npeople = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hd = int(sys.argv[4]) if len(sys.argv) > 4 else 32
cfg = qa_test_config(num_layers=4, hidden_size=64, head_dim=hd, rope_dim=8, q_lora_rank=32, sliding_window=256,
                     o_lora_rank=32, index_topk=64)
tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), TrainConfig(lr=3e-3, block=128))
rng = np.random.default_rng(0)
S = D.SYLLABLES
def episode():
    if mode == "single":
        names = [[S[i]] for i in rng.choice(len(S), npeople, replace=False)]
    else:
        pairs = rng.choice(len(S) * len(S), 3 * npeople, replace=False)
        names = [[S[p // len(S)], S[p % len(S)]] for p in pairs if p // len(S) != p % len(S)][:npeople]
    cities = [D.CITIES[i] for i in rng.integers(0, len(D.CITIES), npeople)]
    toks = ["document", ":"]
    for k in rng.permutation(npeople):
        toks += names[k] + ["lives", "in", cities[k], "."]
    w = [0.02] * len(toks)
    chance = 0
    for k in rng.permutation(npeople):
        q = ["question", ":", "where", "does"] + names[k] + ["live", "?", "answer", ":"]
        toks += q + [cities[k], "<eos>"]
        w += [0.02] * len(q) + [1.0, 1.0]
        chance += sum(c == cities[k] for c in cities) / npeople
    return D.encode(toks), w, chance / npeople
B, T = 8, 256
t0 = time.time(); hist = []
for s in range(steps):
    rows, ws, ch = [], [], []
    for _ in range(B):
        t, w = [], []
        while True:
            e, ew, c = episode()
            if len(t) + len(e) > T + 1: break
            t += e; w += ew; ch.append(c)
        n = len(t); t += [D.PAD] * (T + 1 - n); w = (w + [0.0] * (T + 1 - n))[1:]
        rows.append(t); ws.append(w)
    lr = 3e-3 * min(1, (s + 1) / 30)
    st = tr.step(np.asarray(rows, np.int32), np.asarray(ws, np.float32), lr)
    hist.append(float(st["answer_acc"]))
    if s % 50 == 0 or s == steps - 1:
        # answer_acc counts answers and <eos>: city accuracy = 2 * acc - 1 (eos ~ always right)
        a = np.mean(hist[-50:])
        print(mode, npeople, s, f"{time.time()-t0:.0f}s", "ce %.3f acc %.3f city~%.3f chance %.3f" % (float(st["answer_ce"]), a, 2 * a - 1, np.mean(ch)), flush=True)
