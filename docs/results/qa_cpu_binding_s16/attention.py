"""Session 16 scratch diagnosis (as run): where the attention of the row that predicts an
attribute answer goes. 2 x 2 validation worlds (seed 2000, 16 worlds, 4 questions per type);
for every city / colour / job lookup and every layer: the mass each head puts on the answer's
own row ("right") and on each other row holding a value of that relation ("other"), the head
with the largest right-minus-other, that head's median logit for the answer row against its
cap |q| |k| / sqrt(d), and the sink's mass. Window keys only (compressed entries are left out:
the facts sit inside the 128-row window in these worlds). One example's top rows for three heads.
    python docs/results/qa_cpu_binding_s16/attention.py CHECKPOINT"""
import sys, numpy as np, jax, jax.numpy as jnp
from redknot_jax.quality import data as D
from redknot_jax.quality.train import load_model
from redknot_jax.mhc import HyperConnection
from redknot_jax.norms import rms_norm
ck = sys.argv[1]
model = load_model(ck)
cfg = model.cfg
import dataclasses
eps = D.eval_episodes("val", 16, seed=2000, n_docs=2, per_doc=2, questions_per_type=4)
stats = {}
kvw = []
for i, blk in enumerate(model.layers):
    w = np.asarray(blk.attn.kv_norm.weight[...] if hasattr(blk.attn.kv_norm,'weight') else 0)
    kvw.append(float(np.sqrt((w**2).mean())) if w.size else None)
print("kv_norm weight rms per layer", [round(x,2) for x in kvw])
for ep in eps:
    row, qas, spans = D.teacher_forced_rows(ep, 1024)
    n = max(s[-1] for s in spans) + 2
    ids = jnp.asarray(row[None, :n])
    toks = [int(t) for t in row[:n]]
    x = model.embed_streams(ids)
    pos = jnp.arange(n)[None]
    for li, blk in enumerate(model.layers):
        freqs = model.freqs(li)
        u, post, comb = blk.hc_attn.pre(x)
        xa = blk.attn_norm(u)
        q, _ = blk.attn.query(xa, pos, freqs)
        kv = blk.attn.latent(xa, pos, freqs)
        lg = jnp.einsum("bthk,bsk->bths", q.astype(jnp.float32), kv.astype(jnp.float32)) * blk.attn.k ** -0.5
        tt = jnp.arange(n)
        mask = (tt[None, :] <= tt[:, None]) & (tt[None, :] > tt[:, None] - cfg.sliding_window)
        lg = jnp.where(mask[None, :, None, :], lg, -1e30)
        sink = blk.attn.attn_sink[...].astype(jnp.float32)
        mx = jnp.maximum(lg.max(-1), sink[None, None])
        p = jnp.exp(lg - mx[..., None]); den = p.sum(-1) + jnp.exp(sink[None, None] - mx)
        p = np.asarray(p / den[..., None])[0]  # [t, h, s]
        lgn = np.asarray(lg)[0]
        for qa, span in zip(qas, spans):
            if qa.qtype != "lookup" or qa.relation == "boss": continue
            at = span[0]  # the row predicting the answer's first token
            fact = list(qa.facts[0]); L = len(fact)
            st = next(j for j in range(n - L) if toks[j:j + L] == fact)
            ans_row = st + L - 2  # the answer token (before ".")
            vals = set(D.encode(D.ATTRS[qa.relation]))
            other = [j for j in range(at) if toks[j] in vals and j != ans_row and at - j < cfg.sliding_window]
            name_rows = [st, st + 1]
            d = stats.setdefault(li, {"right": [], "other_each": [], "name": [], "maxlg": [], "gap": []})
            d["right"].append(p[at, :, ans_row]); d["name"].append(p[at, :, name_rows].sum(0))
            d["other_each"].append(p[at][:, other].mean(-1) if other else np.zeros(p.shape[1]))
            d["maxlg"].append(lgn[at].max(-1))
            d.setdefault("sinkm", []).append(1 - p[at].sum(-1))
            if len(d["right"]) == 1 and li in (5, 9, 11):
                hh = {5: 5, 9: 9, 11: 15}[li]
                top = np.argsort(-p[at, hh])[:6]
                print("layer", li, "head", hh, "Q:", D.decode(qa.question), "->", D.decode(qa.answer),
                      [(D.VOCAB[toks[j]], at - j, round(float(p[at, hh, j]), 3)) for j in top])
            qn = np.asarray(q[0, at], np.float32); kr = np.asarray(kv[0, ans_row], np.float32)
            cap = np.linalg.norm(qn, axis=-1) * np.linalg.norm(kr) * blk.attn.k ** -0.5
            d.setdefault("cap", []).append(cap); d.setdefault("lr", []).append(lgn[at, :, ans_row])
            if other: d["gap"].append(lgn[at, :, ans_row] - lgn[at][:, other].max(-1))
        a, c = blk.attn(xa, jnp.zeros((1,), jnp.int32), jnp.full((1,), n, jnp.int32),
                        model.init_cache(1, -(-n // 32) * 32)["layers"][li], freqs, min(512, n) if n % min(512,n)==0 else n)
        x = HyperConnection.post(x, a, post, comb)
        u, post, comb = blk.hc_ffn.pre(x)
        y = blk.ffn(blk.ffn_norm(u), ids)
        x = HyperConnection.post(x, y, post, comb)
np.set_printoptions(precision=2, suppress=True, linewidth=200)
for li, d in stats.items():
    r = np.mean(d["right"], 0); o = np.mean(d["other_each"], 0); nm = np.mean(d["name"], 0)
    h = int(np.argmax(r - o))
    print(f"layer {li}: n={len(d['right'])} best head {h}: right {r[h]:.3f} other(each) {o[h]:.3f} | "
          f"right/other max over heads {np.max(r/(o+1e-9)):.2f} | max logit mean {np.mean(d['maxlg']):.2f} | "
          f"right key logit {np.median(d['lr'],0)[h]:.2f} of cap {np.mean(d['cap'],0)[h]:.2f} (head {h}) | sink {float(model.layers[li].attn.attn_sink[...][h]):.2f} | name mass max {nm.max():.3f} | sink mass mean {np.mean(d['sinkm']):.2f} max-head {np.mean(d['sinkm'],0).max():.2f}")
