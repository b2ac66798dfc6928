"""What a model that binds nothing scores on the training data (session 17).

The "eliminator" knows each relation's vocabulary and the in-context history, not who has which
value: for a question it picks uniformly among the world's values of the asked relation that no
earlier question of the same relation in this episode had as its answer (all of them once every
value was used). With questions that never repeat within an episode (training_sequence's rule),
that beats in-context chance without any binding. Printed: its expected answer-span accuracy and
the `answer_acc` the trainer would log for it (answer tokens plus <eos>, the <eos> always right,
a name's second syllable right exactly when its first is).

    python docs/results/qa_s17/eliminator.py
"""
import collections

import numpy as np

from redknot_jax.quality import data as D


def run(cur: D.Curriculum, n_rows: int, seq_len: int = 1024, seed: int = 0):
    rng = np.random.default_rng(seed)
    names = D.split_names()["train"]
    em, chance, tok_hits, tok_n = [], [], 0.0, 0
    orig = D.make_question
    episodes = []  # (world, [qa, ...]) as training_sequence lays them out

    def spy(rng_, world, qtype, relation=None):
        qa = orig(rng_, world, qtype, relation)
        if not episodes or episodes[-1][0] is not world:
            episodes.append((world, []))
        if all(q.question != qa.question for q in episodes[-1][1]):  # a repeat is redrawn, not asked
            episodes[-1][1].append(qa)
        return qa

    D.make_question = spy
    try:
        for _ in range(n_rows):
            D.training_sequence(rng, names, seq_len, cur)
    finally:
        D.make_question = orig
    pick = np.random.default_rng(seed + 1)
    for world, qas in episodes:
        given = collections.defaultdict(list)  # relation -> answers already given in this episode
        for qa in qas:
            if qa.qtype != "lookup":
                continue
            rel = qa.relation
            vals = [tuple(world.people[o.boss].name) if rel == "boss" else (getattr(o, rel),) for o in world.people]
            left = [v for v in vals if v not in given[rel]] or vals
            guess = left[pick.integers(len(left))]
            hit = guess == tuple(D.decode(qa.answer).split())
            em.append(hit)
            chance.append(qa.chance)
            tok_hits += len(qa.answer) * hit + 1
            tok_n += len(qa.answer) + 1
            given[rel].append(tuple(D.decode(qa.answer).split()))
    return float(np.mean(em)), float(np.mean(chance)), tok_hits / tok_n, len(em)


if __name__ == "__main__":
    for name, cur in [
        ("1 document x 4 people, city only, 4 questions (session 14 mqar / s17 small_probedata)",
         D.Curriculum(1, 1, 4, 4, two_hop=0.0, facts=("city",), asks=("city",))),
        ("1 document x 4 people, city only, 1 question (s17 p1)", D.Curriculum(1, 1, 4, 1, two_hop=0.0, facts=("city",), asks=("city",))),
        ("in-window stage, city only (run 16's first half)", D.Curriculum(1, 2, 2, 6, two_hop=0.0, facts=("city",), asks=("city",))),
        ("in-window stage, all relations, lookups only", D.Curriculum(1, 2, 2, 6, two_hop=0.0)),
    ]:
        em, ch, acc, n = run(cur, 64)
        print(f"{name}: {n} lookups, eliminator span accuracy {em:.3f} (in-context chance {ch:.3f}), "
              f"its answer_acc {acc:.3f}")
