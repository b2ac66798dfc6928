"""Session 16 scratch diagnosis (as run): at the row that predicts a lookup answer, which
heads attend to the needed fact sentence, and to which of its rows (name0, name1, the word
before the answer, the answer's first row, the closing "."): per layer, the head with the most
mass on the sentence, mean over the 2 x 2 validation worlds (seed 2000) whose fact sits in the
window; boss questions and attribute questions apart; beside it, that head's mean mass on each
other person's row of the same kind (the rows after the same verb words). Window keys only.
    python docs/results/qa_cpu_binding_s16/boss_attention.py CHECKPOINT"""
import sys, numpy as np, jax, jax.numpy as jnp
from redknot_jax.quality import data as D
from redknot_jax.quality.train import load_model
from redknot_jax.mhc import HyperConnection
model = load_model(sys.argv[1]); cfg = model.cfg
eps = D.eval_episodes("val", 16, seed=2000, n_docs=2, per_doc=2, questions_per_type=4)
agg = {}
for ep in eps:
    row, qas, spans = D.teacher_forced_rows(ep, 1024)
    n = max(s[-1] for s in spans) + 2
    ids = jnp.asarray(row[None, :n]); toks = [int(t) for t in row[:n]]
    x = model.embed_streams(ids); pos = jnp.arange(n)[None]
    cache = model.init_cache(1, -(-n // 32) * 32)
    for li, blk in enumerate(model.layers):
        freqs = model.freqs(li)
        u, post, comb = blk.hc_attn.pre(x); xa = blk.attn_norm(u)
        q, _ = blk.attn.query(xa, pos, freqs); kv = blk.attn.latent(xa, pos, freqs)
        lg = jnp.einsum("bthk,bsk->bths", q.astype(jnp.float32), kv.astype(jnp.float32)) * blk.attn.k ** -0.5
        tt = jnp.arange(n); mask = (tt[None, :] <= tt[:, None]) & (tt[None, :] > tt[:, None] - cfg.sliding_window)
        lg = jnp.where(mask[None, :, None, :], lg, -1e30); sink = blk.attn.attn_sink[...].astype(jnp.float32)
        mx = jnp.maximum(lg.max(-1), sink[None, None]); p = jnp.exp(lg - mx[..., None])
        p = np.asarray(p / (p.sum(-1) + jnp.exp(sink[None, None] - mx))[..., None])[0]
        for qa, span in zip(qas, spans):
            if qa.qtype != "lookup": continue
            at = span[0]; fact = list(qa.facts[0]); L = len(fact)
            st = next(j for j in range(n - L) if toks[j:j + L] == fact)
            if at - st >= cfg.sliding_window: continue
            # fact rows by offset from the sentence start: name0 name1 verb.. value.. "."
            key = "boss" if qa.relation == "boss" else "attr"
            va = st + L - 1 - len(qa.answer)  # the answer's first row
            roles = [st, st + 1, va - 1, va, st + L - 1]  # name0 name1 pre-word value "."
            d = agg.setdefault((key, li), np.zeros((5, p.shape[1])))
            d += p[at][:, roles].T
            # the same relation's value rows of the other people in the window (rows after their verb words)
            verb = fact[2:L - 1 - len(qa.answer)]
            others = [j + len(verb) for j in range(max(0, at - cfg.sliding_window + 1), at - len(verb))
                      if toks[j:j + len(verb)] == verb and j + len(verb) != va and j + len(verb) < at]
            o = agg.setdefault((key, li, "other"), np.zeros(p.shape[1]))
            o += p[at][:, others].mean(-1) if others else 0
            agg.setdefault((key, "n"), [0])[0] += (li == 0)
        a, c = blk.attn(xa, jnp.zeros((1,), jnp.int32), jnp.full((1,), n, jnp.int32), cache["layers"][li], freqs, n)
        x = HyperConnection.post(x, a, post, comb)
        u, post, comb = blk.hc_ffn.pre(x); x = HyperConnection.post(x, blk.ffn(blk.ffn_norm(u), ids), post, comb)
np.set_printoptions(precision=2, suppress=True, linewidth=220)
for key in ("boss", "attr"):
    nq = agg[(key, "n")][0]
    print(f'== {key} questions ({nq}): per layer, the head with the most mass on its fact sentence; mass on name0 name1 pre-word value-row dot')
    for li in range(cfg.num_layers):
        m = agg[(key, li)] / nq
        h = int(np.argmax(m.sum(0)))
        o = agg[(key, li, "other")] / nq
        print(f"layer {li:2d} head {h:2d} sentence mass {m[:, h].sum():.2f}: {m[:, h]}  | each other person's value row {o[h]:.3f}")
