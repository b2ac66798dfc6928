"""Associative recall with nothing to eliminate (session 17): can the small model of session 14's
CPU probes bind at all? One document of N people ("ka lo lives in oslo ."), then ONE question
per episode, so no earlier answer narrows the choice (session 14's mqar.py asked every person
once: an eliminator scores 0.52 there without binding). Prints the answer span's accuracy
(`span_acc`, no <eos>) against in-context chance.

    python docs/results/qa_s17/mqar1.py single|pair|kv|ind|zoo STEPS N [FIELD=VALUE ...]

kv (session 18): single-syllable names, the fact with no words between ("ka oslo ."), the
question with none either ("question : ka ? answer : oslo"); the others as single.
ind: kv facts, the question only the name ("question : ka oslo"): textbook induction.
zoo: kv facts, then the asked names each followed by its city, nothing else ("ka oslo . me rome
. | me rome ka oslo"): the multi-query associative recall of the Zoology paper; no <eos> trained.

FIELD=VALUE: numeric overrides of the model config (e.g. rope_dim=32: RoPE on every dimension).
arch=vanilla (session 18): the same data and optimizer on a textbook pre-norm transformer instead of
the project's modules (multi-head attention with separate K and V, RoPE on every dimension, GELU
MLP; `layers`, `d`, `heads` override its size): does the task itself need more steps, or do the
modules stand in the way? kv=mqa: one K and one V head shared by all query heads; kv=shared: one
head whose K is also its V (DeepSeek-V4's shared latent; RoPE on the logits only).
warm=MODE:STEPS: the first STEPS steps use that mode's episodes (a curriculum), then the named mode.
sliding_only=1 (redknot): every layer sliding-window attention (no compressed entries).
Data options (session 18): B=rows per step (8), T=row length (256), pack=most episodes per row
(0: as many as fit; 1: one episode per row, so no earlier episode reuses a name), every=print
cadence (50), lr=peak learning rate (3e-3), ask=questions per episode (1), distinct people: every
answer is trained (more signal per episode), but only the FIRST question's answer has weight 1.0
and so enters span_acc (later ones 0.999): no earlier answer exists to eliminate.
seed=N (session 19): the model's initialisation and the data stream (0).
mix=P (session 19): after the warm-up, a share P of the rows stays in the warm-up's mode (not scored:
span_acc is the final mode's alone).
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer, answer_stats

mode, steps, npeople = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
over = dict(a.split("=") for a in sys.argv[4:])
arch = over.pop("arch", "redknot")
warm_mode, warm_steps = over.pop("warm", f"{mode}:0").split(":")
final_mode, warm_steps = mode, int(warm_steps)
B, T, PACK, EVERY, ASK = (int(over.pop(k, d)) for k, d in (("B", 8), ("T", 256), ("pack", 0), ("every", 50), ("ask", 1)))
LR = float(over.pop("lr", 3e-3))
SEED = int(over.pop("seed", 0))
MIX = float(over.pop("mix", 0))
over = {k: v if k == "kv" else float(v) if "." in v else int(v) for k, v in over.items()}
if over.pop("sliding_only", 0):
    over["layer_types"] = ("sliding_attention",) * over.get("num_layers", 4)


class Vanilla:
    """A textbook decoder: pre-RMSNorm blocks of causal multi-head attention (RoPE on every
    dimension) and a GELU MLP, untied output head; Adam as the project's Trainer configures it
    (clip 1.0, b2 0.95), decoupled weight decay 0.05 on matrices."""

    def __init__(self, layers=4, d=64, heads=4, vocab=128, seed=0, kv="mha"):
        self.h, self.kv = heads, kv
        dkv = {"mha": d, "mqa": d // heads, "shared": d // heads}[kv]
        ks = iter(jax.random.split(jax.random.key(seed), 6 * layers + 2))
        w = lambda *sh: jax.random.normal(next(ks), sh) * sh[0] ** -0.5
        self.params = {"emb": jax.random.normal(next(ks), (vocab, d)), "out": w(d, vocab), "norm": jnp.ones(d),
                       "blocks": [{"n1": jnp.ones(d), "q": w(d, d), "k": w(d, dkv), "v": w(d, dkv), "o": w(d, d) / layers,
                                   "n2": jnp.ones(d), "w1": w(d, 4 * d), "w2": w(4 * d, d) / layers}
                                  for _ in range(layers)]}
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95))
        self.opt = self.tx.init(self.params)
        self._step = jax.jit(self._train_step)

    def forward(self, p, ids):
        rms = lambda x, g: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g
        b, t = ids.shape
        dh = p["out"].shape[0] // self.h
        inv = 10000.0 ** (-jnp.arange(0, dh, 2) / dh)
        ang = jnp.arange(t)[:, None] * inv[None]
        cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]

        def rope(x):
            x1, x2 = x[..., ::2], x[..., 1::2]
            return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)

        causal = jnp.tril(jnp.ones((t, t), bool))
        x = p["emb"][ids]
        for blk in p["blocks"]:
            u = rms(x, blk["n1"])
            q = jnp.reshape(u @ blk["q"], (b, t, self.h, dh))
            k, v = (jnp.reshape(u @ blk[n], (b, t, -1, dh)) for n in "kv")
            if self.kv == "shared":
                v = k
            k, v = jnp.broadcast_to(k, q.shape), jnp.broadcast_to(v, q.shape)
            lg = jnp.einsum("bqhd,bkhd->bhqk", rope(q), rope(k)) * dh ** -0.5
            a = jax.nn.softmax(jnp.where(causal, lg, -1e30), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, -1) @ blk["o"]
            x = x + jax.nn.gelu(rms(x, blk["n2"]) @ blk["w1"]) @ blk["w2"]
        return rms(x, p["norm"]) @ p["out"]

    def _train_step(self, params, opt, tokens, w, lr):
        def loss(p):
            lm, ans_ce, _, span_acc = answer_stats(self.forward(p, tokens[:, :-1]), tokens[:, 1:], w, D.EOS)
            return lm, (ans_ce, span_acc)

        (_, (ce, acc)), g = jax.value_and_grad(loss, has_aux=True)(params)
        u, opt = self.tx.update(g, opt, params)
        params = jax.tree.map(lambda p, u: p - lr * (u + 0.05 * (p.ndim >= 2) * p), params, u)
        return params, opt, {"answer_ce": ce, "span_acc": acc}

    def step(self, tokens, w, lr):
        self.params, self.opt, st = self._step(self.params, self.opt, jnp.asarray(tokens), jnp.asarray(w), lr)
        return st


if arch == "vanilla":
    tr = Vanilla(seed=SEED, **over)
else:
    cfg = qa_test_config(**{**dict(num_layers=4, hidden_size=64, head_dim=32, rope_dim=8, q_lora_rank=32,
                                   sliding_window=256, o_lora_rank=32, index_topk=64), **over})
    tr = Trainer(random_model(cfg, seed=SEED, dtype=jnp.float32), TrainConfig(lr=LR, block=128))
rng = np.random.default_rng(SEED)
S = D.SYLLABLES


def episode(mode, scored=True):
    first = 1.0 if scored else 0.999
    if mode in ("single", "kv", "ind", "zoo"):
        names = [[S[i]] for i in rng.choice(len(S), npeople, replace=False)]
    else:
        pairs = rng.choice(len(S) * len(S), 3 * npeople, replace=False)
        names = [[S[p // len(S)], S[p % len(S)]] for p in pairs if p // len(S) != p % len(S)][:npeople]
    cities = [D.CITIES[i] for i in rng.integers(0, len(D.CITIES), npeople)]
    toks = ["document", ":"]
    for k in rng.permutation(npeople):
        toks += names[k] + ([cities[k], "."] if mode in ("kv", "ind", "zoo") else ["lives", "in", cities[k], "."])
    w = [0.02] * len(toks)
    asked = rng.choice(npeople, ASK, replace=False)
    for i, k in enumerate(asked):
        if mode == "zoo":
            toks += names[k] + [cities[k]]
            w += [0.02, first if i == 0 else 0.999]
            continue
        q = (["question", ":"] + names[k] + ["?", "answer", ":"] if mode == "kv"
             else ["question", ":"] + names[k] if mode == "ind"
             else ["question", ":", "where", "does"] + names[k] + ["live", "?", "answer", ":"])
        toks += q + [cities[k], "<eos>"]
        w += [0.02] * len(q) + [first if i == 0 else 0.999] * 2
    return D.encode(toks), w, sum(c == cities[asked[0]] for c in cities) / npeople


t0, hist, ch = time.time(), [], []
for s in range(steps):
    mode = warm_mode if s < warm_steps else final_mode
    rows, ws = [], []
    for _ in range(B):
        t, w, k = [], [], 0
        mixed = s >= warm_steps and rng.random() < MIX  # a warm-up row after the warm-up: not scored
        while not (PACK and k == PACK):
            e, ew, c = episode(warm_mode, False) if mixed else episode(mode)
            if len(t) + len(e) > T + 1:
                break
            k += 1
            t += e
            w += ew
            if not mixed:
                ch.append(c)
        n = len(t)
        t += [D.PAD] * (T + 1 - n)
        w = (w + [0.0] * (T + 1 - n))[1:]
        rows.append(t)
        ws.append(w)
    st = tr.step(np.asarray(rows, np.int32), np.asarray(ws, np.float32), LR * min(1, (s + 1) / 30))
    hist.append(float(st["span_acc"]))
    if s % EVERY == 0 or s == steps - 1:
        print(mode, npeople, *sys.argv[4:], s, f"{time.time() - t0:.0f}s", "answer_ce %.3f span_acc %.3f (last %d) chance %.3f"
              % (float(st["answer_ce"]), np.mean(hist[-EVERY:]), EVERY, np.mean(ch[-2000:])), flush=True)
