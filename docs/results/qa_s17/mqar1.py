"""Associative recall with nothing to eliminate (session 17): can the small model of session 14's
CPU probes bind at all? One document of N people ("ka lo lives in oslo ."), then ONE question
per episode, so no earlier answer narrows the choice (session 14's mqar.py asked every person
once: an eliminator scores 0.52 there without binding). Prints the answer span's accuracy
(`span_acc`, no <eos>) against in-context chance.

    python docs/results/qa_s17/mqar1.py single|pair STEPS N [FIELD=VALUE ...]

FIELD=VALUE: numeric overrides of the model config (e.g. rope_dim=32: RoPE on every dimension).
"""
import sys
import time

import jax.numpy as jnp
import numpy as np

from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer

mode, steps, npeople = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
over = {k: float(v) if "." in v else int(v) for k, v in (a.split("=") for a in sys.argv[4:])}
cfg = qa_test_config(**{**dict(num_layers=4, hidden_size=64, head_dim=32, rope_dim=8, q_lora_rank=32, sliding_window=256,
                               o_lora_rank=32, index_topk=64), **over})
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
    k = int(rng.integers(npeople))
    q = ["question", ":", "where", "does"] + names[k] + ["live", "?", "answer", ":"]
    toks += q + [cities[k], "<eos>"]
    w += [0.02] * len(q) + [1.0, 1.0]
    return D.encode(toks), w, sum(c == cities[k] for c in cities) / npeople


B, T = 8, 256
t0, hist, ch = time.time(), [], []
for s in range(steps):
    rows, ws = [], []
    for _ in range(B):
        t, w = [], []
        while True:
            e, ew, c = episode()
            if len(t) + len(e) > T + 1:
                break
            t += e
            w += ew
            ch.append(c)
        n = len(t)
        t += [D.PAD] * (T + 1 - n)
        w = (w + [0.0] * (T + 1 - n))[1:]
        rows.append(t)
        ws.append(w)
    st = tr.step(np.asarray(rows, np.int32), np.asarray(ws, np.float32), 3e-3 * min(1, (s + 1) / 30))
    hist.append(float(st["span_acc"]))
    if s % 50 == 0 or s == steps - 1:
        print(mode, npeople, *sys.argv[4:], s, f"{time.time() - t0:.0f}s", "answer_ce %.3f span_acc %.3f (last 50) chance %.3f"
              % (float(st["answer_ce"]), np.mean(hist[-50:]), np.mean(ch[-2000:])), flush=True)
