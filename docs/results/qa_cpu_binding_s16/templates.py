"""Session 16 scratch CPU probe (as run): do questions that end in the word that precedes the
answer in its fact sentence ("who does X report to ?" <- "X reports to Y .") bind faster?
The boss relation is the only one whose question has that form today, and the only one the
H200 runs bound. `echo` rewrites the attribute templates that way (new words go into unused
vocabulary slots; nothing in the library changes); `base` keeps them.
Worlds: 2 documents x 2 people, every relation asked, lookups only; a 4-layer, hidden-64 model
of the project's modules, rows of 256 tokens, constant lr 3e-3.
    python docs/results/qa_cpu_binding_s16/templates.py base|echo STEPS [city]
`city`: one document of 4 people (all four facts), city questions only, as session 14's
full.py city setup (where plain city binding showed at CPU steps ~450-800); validation on
2 x 2 worlds, city questions."""
import sys, time, numpy as np, jax.numpy as jnp
from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer, teacher_forced_scores
mode, steps = sys.argv[1], int(sys.argv[2])
city = sys.argv[3:] == ["city"]
if mode == "echo":
    for i, w in enumerate(["which", "city", "is", "fond", "work"]):
        old = f"<unused_{i}>"
        D.VOCAB[D.ID.pop(old)] = w
        D.ID[w] = D.VOCAB.index(w)
    D._LOOKUP_Q.update(city="which city does {} live in ?", color="which color is {} fond of ?",
                       job="which job does {} work as ?")
    D._TWOHOP_Q.update(city="which city does the boss of {} live in ?", color="which color is the boss of {} fond of ?",
                       job="which job does the boss of {} work as ?")
    def facts(self, p):
        n = list(p.name)
        return [n + ["lives", "in", p.city, "."], n + ["is", "fond", "of", p.color, "."],
                n + ["works", "as", p.job, "."], n + ["reports", "to", *self.people[p.boss].name, "."]]
    D.World.facts = facts
elif mode != "base":
    raise SystemExit(f"mode: base or echo, got {mode!r}")
cfg = qa_test_config(num_layers=4, hidden_size=64, head_dim=32, rope_dim=8, q_lora_rank=32, sliding_window=256,
                     o_lora_rank=32, index_topk=64)
tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), TrainConfig(lr=3e-3, block=128))
rng = np.random.default_rng(0)
names = D.split_names()["train"]
cur = D.Curriculum(1, 1, 4, 4, two_hop=0.0, asks=("city",)) if city else D.Curriculum(2, 2, 2, 8, two_hop=0.0)
B, T, lr0 = 8, 256, 3e-3
eps = D.eval_episodes("val", 32, seed=5, n_docs=2, per_doc=2, questions_per_type=4, asks=("city",) if city else None)
print(mode, "example:", D.decode(D.training_sequence(np.random.default_rng(1), names, T, cur)[0])[:400], flush=True)
t0, hist = time.time(), []
for s in range(steps):
    toks, w = D.training_batch(rng, names, B, T, cur)
    st = tr.step(toks, w, lr0 * min(1, (s + 1) / 30))
    hist.append(float(st["answer_acc"]))
    if s % 100 == 0 or s == steps - 1:
        res = teacher_forced_scores(tr, eps, T, 8, by_relation=True)
        print(mode, s, f"{time.time() - t0:.0f}s", "answer_acc %.3f" % np.mean(hist[-100:]),
              {k: (round(v["em"], 3), round(v["chance"], 3)) for k, v in res.items() if k.startswith("lookup")},
              flush=True)
