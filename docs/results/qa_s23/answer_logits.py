"""Session 23 scratch probe (as run): for lookups on 2 x 2 validation worlds, the softmax of the
answer row over the asked relation's whole vocabulary (cities / colors / jobs). Session 22's call 2
model spread it almost evenly over every city and every color (not only the world's own values):
its city / color questions did not reach the facts. Output: answer_logits_s22_call2.txt.
    python docs/results/qa_s23/answer_logits.py out/qa_s22_w32_call2   # CPU, ~1 min"""
import sys

import numpy as np

from redknot_jax.quality import data as D
from redknot_jax.quality.data import Episode, teacher_forced_rows
from redknot_jax.quality.train import TrainConfig, Trainer, load_model

tr = Trainer(load_model(sys.argv[1]), TrainConfig(block=512))
vocab = {r: [D.ID[w] for w in D.ATTRS[r]] for r in D.ATTRS}
for ep in D.eval_episodes("val", 4, seed=1000, n_docs=2, per_doc=2, questions_per_type=4):
    for qa in ep.qas:
        if qa.qtype != "lookup" or qa.relation not in vocab:
            continue
        toks, _, spans = teacher_forced_rows(Episode(ep.docs, [qa]), 1024)
        sub = np.asarray(tr.logits(toks[None, :-1]))[0, spans[0][0], vocab[qa.relation]]
        p = np.exp(sub - sub.max())
        p /= p.sum()
        top = np.argsort(-sub)[:4]
        print(qa.relation, "gold", qa.answer_text, "top",
              [(D.decode([vocab[qa.relation][i]]), round(float(p[i]), 3)) for i in top])
