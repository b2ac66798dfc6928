"""Issue 10 pieces on CPU: the QA generator (seeded, disjoint splits, answers in the right
documents), the tokenizer.json round trip, the training forward (equals `Model.forward`),
a few optimizer steps that lower the loss, the checkpoint round trip, and an eval smoke run."""

import dataclasses
import json

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
import pytest

from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_config, qa_profile, qa_test_config
from redknot_jax.quality.train import (Trainer, TrainConfig, forward_train, load_model, lr_at, save_checkpoint,
                                       teacher_forced_scores)
from redknot_jax.reuse.profile import RedKnotProfile, head_row_ceiling


def test_splits_disjoint_and_seeded():
    sp = D.split_names()
    sets = {k: set(v) for k, v in sp.items()}
    assert not (sets["train"] & sets["val"]) and not (sets["train"] & sets["test"]) and not (sets["val"] & sets["test"])
    assert sp == D.split_names()
    a = D.eval_episodes("test", 2, seed=3)
    b = D.eval_episodes("test", 2, seed=3)
    assert [e.docs for e in a] == [e.docs for e in b]
    c = D.eval_episodes("test", 2, seed=4)
    assert [e.docs for e in a] != [e.docs for e in c]
    test_names = {w for ep in a for d in ep.docs for w in D.decode(d).split() if w in D.SYLLABLES}
    assert test_names  # names are syllables of the shared vocabulary; the pairs are disjoint


def test_questions_answerable_from_the_named_documents():
    rng = np.random.default_rng(0)
    names = D.split_names()["val"]
    for _ in range(20):
        w = D.make_world(rng, names, 4, 3)
        for qt in D.QTYPES:
            qa = D.make_question(rng, w, qt)
            subj = D.decode(qa.question).split("of ")[-1] if qt == "two_hop" else None
            ans = D.decode(qa.answer)
            text = [D.decode(d) for d in w.docs]
            if qt == "lookup":
                assert len(qa.docs) == 1 and ans in text[qa.docs[0]]
            else:
                d0, d1 = qa.docs
                assert d0 != d1, "two-hop facts must sit in two documents"
                name = " ".join(subj.split()[:2])
                assert f"{name} reports to" in text[d0]
                assert ans in text[d1]


def test_fact_distance_points_at_the_facts_a_question_needs():
    """`fact_distance`: from the answer back to the start of the farthest needed fact; the
    lookup fact ends in the answer, the two-hop facts are the subject's boss sentence and the
    boss's attribute sentence, which ends in the answer."""
    for ep in D.eval_episodes("val", 4, seed=5, n_docs=3, per_doc=2, questions_per_type=2):
        row, qas, spans = D.teacher_forced_rows(ep, 1024)
        row = [int(t) for t in row]
        for qa, span in zip(qas, spans):
            at = span[0] + 1  # the first answer token
            start = at - D.fact_distance(row, qa, at)
            found = [next(i for i in range(len(row)) if row[i:i + len(f)] == list(f)) for f in qa.facts]
            assert start == min(found) and 0 < start < at
            assert list(qa.facts[-1][-1 - len(qa.answer):-1]) == qa.answer  # "... <answer> ."
            assert len(qa.facts) == (1 if qa.qtype == "lookup" else 2)
            with pytest.raises(ValueError, match="not in the tokens"):
                D.fact_distance(row[:5], qa, at)
            # the answer is one of the world's values of its relation, one value per person
            assert 1 / 6 <= qa.chance <= 1


def test_training_rows_weights_and_packing():
    rng = np.random.default_rng(1)
    toks, w = D.training_sequence(rng, D.split_names()["train"], 512, D.Curriculum(2, 3, 4, 8))
    assert toks.shape == (513,) and w.shape == (512,)
    targets = toks[1:]
    assert np.isin(w, np.float32([0.0, 0.02, 1.0])).all()
    assert (targets[w == 1.0] != D.PAD).all() and (w[targets == D.PAD] == 0).all()
    assert (targets[w == 1.0] == D.EOS).sum() >= 2  # several question/answer pairs, each ending in <eos>


def test_long_rows_hold_large_worlds_and_little_padding():
    """Worlds of up to 20 documents of 8 people in 4096-token rows (long-context training):
    the episode size is drawn among those that fit, so a row is mostly real tokens and holds
    worlds of thousands of tokens, not one small world and padding."""
    names = D.split_names()["train"]
    rng = np.random.default_rng(0)
    fills, longest = [], 0
    for _ in range(12):
        toks, _ = D.training_sequence(rng, names, 4096, D.Curriculum(2, 20, 8, 16))
        real = toks != D.PAD
        fills.append(real.mean())
        starts = np.flatnonzero(toks == D.ID["document"])
        # the longest run of documents without a question between them: one world's documents
        q = np.flatnonzero(toks == D.ID["question"])
        for a, b in zip(np.r_[0, q], np.r_[q, len(toks)]):
            inside = starts[(starts >= a) & (starts < b)]
            if len(inside):
                longest = max(longest, b - inside[0])
    assert np.mean(fills) > 0.85, fills
    assert longest > 2000
    # a row shorter than the estimate of its smallest episode still gets that episode if it fits
    toks, w = D.training_sequence(rng, names, 96, D.Curriculum(1, 2, 2, 4))
    assert (w == 1.0).any(), D.decode(toks)


def test_recall_episodes_bind_each_name_to_its_stated_value():
    """`Curriculum(recall=True)`: each episode states one relation as "name value ." and then
    queries names, each followed directly by that value; only the values are weighted 1, every
    query names a person of its episode with the value stated there, no name is queried twice
    in an episode, and the row holds several whole episodes."""
    names = D.split_names()["train"]
    for asks in (("city",), ("boss",), D.RELATIONS):
        toks, w = D.training_sequence(np.random.default_rng(4), names, 256,
                                      D.Curriculum(1, 2, 4, 6, asks=asks, recall=True))
        words = [D.VOCAB[t] for t in toks]
        assert "question" not in words and "<eos>" not in words
        facts, queried, value_at = {}, set(), []
        i, episodes, n_queries = 0, 0, 0
        while i < len(words) and words[i] != "<pad>":
            if words[i:i + 2] == ["document", ":"]:
                episodes += bool(queried)  # after queries: a new episode
                queried.clear()
                i += 2
                continue
            name = tuple(words[i:i + 2])
            if "." in words[i + 3:i + 5] and not queried:  # a fact: "name value ."
                end = words.index(".", i + 3)
                facts[name] = words[i + 2:end]
                i = end + 1
                continue
            val = facts[name]  # a query: a name stated in this episode, then its value
            assert words[i + 2:i + 2 + len(val)] == val and name not in queried, (name, words[i:i + 6])
            assert asks != ("boss",) or len(val) == 2
            queried.add(name)
            value_at += range(i + 2, i + 2 + len(val))
            n_queries += 1
            i += 2 + len(val)
        assert n_queries >= 4 and episodes + bool(queried) >= 2
        # weight 1 exactly on the targets that are recalled values (target j predicts token j + 1)
        assert sorted(np.flatnonzero(w == 1.0) + 1) == value_at
        assert np.isin(w, np.float32([0.0, 0.02, 1.0])).all()


def test_recall_probe_marks_each_query_with_its_distance_and_chance():
    """`recall_probe`: one recall episode per row, every person queried once; each query's
    target indices predict exactly its value, the value stated `distance` tokens earlier
    (after the same name), and its chance is the share of the world with that value. Rows of
    2 x 16 people reach past a 128-row window. An episode that cannot fit is refused."""
    seq = 400
    toks, meta = D.recall_probe("val", 6, 1, D.Curriculum(2, 2, 16, 4, asks=("city",)), seq)
    assert toks.shape == (6, seq + 1) and [len(m) for m in meta] == [32] * 6
    val_names = {D.ID[a] for n in D.split_names()["val"] for a in n}
    for row, queries in zip(toks, meta):
        assert set(row[row != D.PAD].tolist()) - {D.ID[w] for w in ("document", ":", ".", *D.CITIES)} <= val_names
        for span, dist, chance in queries:
            at = span[0] + 1  # the value's first token
            assert dist > 0 and row[at - dist] == row[at] and (row[at - dist - 2:at - dist] == row[at - 2:at]).all()
            assert row[at - dist + 1] == D.ID["."]  # the stated fact "name value ." (one-token city)
            assert 0 < chance <= 1
        assert max(q[1] for q in queries) > 128
    with pytest.raises(ValueError, match="does not fit"):
        D.recall_probe("val", 1, 1, D.Curriculum(2, 2, 16, 4), 64)


def test_fewer_kinds_of_facts_and_questions():
    """`Curriculum(facts=, asks=)`: documents state only the chosen relations and only the
    asked ones are questioned (two-hop needs the boss facts); every person's values are drawn
    as in a full world, so a subset only leaves sentences out. Unknown, empty, or unstated
    relations are refused by name."""
    names = D.split_names()["train"]
    with pytest.raises(ValueError, match="asks"):
        D.Curriculum(facts=("city",))  # asks defaults to all four, three of them unstated
    assert D.Curriculum(facts=("city",), asks=("city",)).two_hop_attrs == ()
    for facts, asks in ((("city",), ("city",)), (D.RELATIONS, ("city",))):
        toks, w = D.training_sequence(np.random.default_rng(0), names, 512, D.Curriculum(1, 2, 2, 6, 0.5, facts, asks))
        text = D.decode(toks[toks != D.PAD])
        qs = [q.split(" answer :")[0] for q in text.split("question : ")[1:]]
        docs = " ".join(d.split("question :")[0] for d in text.split("document :")[1:]).split()
        assert len(qs) >= 4 and all(q.startswith("where does") and q.endswith("live ?") for q in qs), qs
        two_hop = [q for q in qs if "boss of" in q]
        if facts == ("city",):  # no boss facts: no two-hop questions, and only city sentences
            assert not two_hop and "lives" in docs and not {"likes", "works", "reports"} & set(docs)
        else:
            assert two_hop and {"lives", "likes", "works", "reports"} <= set(docs)
    full = D.make_world(np.random.default_rng(3), names, 2, 2)
    part = D.make_world(np.random.default_rng(3), names, 2, 2, facts=("city", "boss"))
    assert full.people == part.people and part.written == ("city", "boss")
    assert sum(map(len, part.docs)) < sum(map(len, full.docs))
    with pytest.raises(ValueError, match="no 'color' facts"):
        D.make_question(np.random.default_rng(0), part, "lookup", "color")
    ep = D.eval_episodes("val", 3, seed=1, n_docs=2, per_doc=2, questions_per_type=2, facts=("city", "job"))
    assert {qa.relation for e in ep for qa in e.qas} == {"city", "job"} and {qa.qtype for e in ep for qa in e.qas} == {"lookup"}
    # worlds of 2 x 2 whose bosses all sit in their own document are drawn again (seed 5 has one), never refused
    assert all(len([q for q in e.qas if q.qtype == "two_hop"]) == 4
               for e in D.eval_episodes("val", 32, seed=5, n_docs=2, per_doc=2, questions_per_type=4))
    with pytest.raises(ValueError, match="at least 2 documents"):
        D.eval_episodes("val", 1, seed=0, n_docs=1, per_doc=4)
    assert [e.docs for e in D.eval_episodes("val", 2, seed=1)] == [
        e.docs for e in D.eval_episodes("val", 2, seed=1, facts=D.RELATIONS, asks=D.RELATIONS)]
    for bad in (dict(facts=()), dict(facts=("town",)), dict(facts=("city", "city")), dict(facts=("city",), asks=("job",)),
                dict(two_hop=1.5)):
        with pytest.raises(ValueError, match="Curriculum"):
            D.Curriculum(**bad)
    two = D.make_world(np.random.default_rng(0), names, 2, 2, facts=("city",))
    with pytest.raises(ValueError, match="two-hop question needs the 'boss' facts"):
        D.make_question(np.random.default_rng(0), two, "two_hop")


def test_echo_templates_end_each_question_in_the_words_before_its_answer(tmp_path):
    """templates="echo": every lookup question ends in the word that precedes the answer in its
    fact sentence (the plain wording does that for the boss only: "report to ?" / "reports to Y"); the world's draws are the
    wording's only difference; earlier ids are unchanged (the new words take unused slots);
    a checkpoint's train_log.json names its wording."""
    names = D.split_names()["val"]
    for tpl, echoed in (("plain", {"boss"}), ("echo", set(D.RELATIONS))):
        w = D.make_world(np.random.default_rng(4), names, 3, 3, templates=tpl)
        rng = np.random.default_rng(0)
        for rel in D.RELATIONS:
            qa = D.make_question(rng, w, "lookup", rel)
            q = D.decode(qa.question).split()[:-3]  # "... ?", "answer", ":" dropped
            fact = list(qa.facts[0])
            before = D.decode(fact[:len(fact) - len(qa.answer) - 1]).split()[2:]  # the words between name and answer
            assert (q[-1] == before[-1]) == (rel in echoed), (tpl, rel, q, before)
            assert D.decode(qa.answer) in D.decode(w.docs[qa.docs[0]])
    a, b = (D.make_world(np.random.default_rng(4), names, 3, 3, templates=t) for t in D.TEMPLATES)
    assert a.people == b.people and D.decode(a.docs[0]) != D.decode(b.docs[0])
    before = D.SPECIALS + D.WORDS + D.SYLLABLES + D.CITIES + D.COLORS + D.JOBS  # the vocabulary until now
    assert D.VOCAB[:len(before)] == before and D.VOCAB[len(before):len(before) + 5] == D.ECHO_WORDS
    for bad in (lambda: D.Curriculum(templates="fancy"), lambda: D.make_world(np.random.default_rng(0), names, 2, 2, templates="x"),
                lambda: D.eval_episodes("val", 1, seed=0, templates="x")):
        with pytest.raises(ValueError, match="templates"):
            bad()
    assert D.templates_of(tmp_path) == "plain"  # no train_log.json: a checkpoint from before the option
    (tmp_path / "train_log.json").write_text(json.dumps({"args": {"templates": "echo"}}))
    assert D.templates_of(tmp_path) == "echo"


def test_tokenizer_json_matches_vocab(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    p = tmp_path / "tokenizer.json"
    p.write_text(D.tokenizer_json())
    tok = tokenizers.Tokenizer.from_file(str(p))
    text = D.decode(D.eval_episodes("val", 1, seed=0)[0].docs[0])
    assert tok.encode(text, add_special_tokens=False).ids == D.encode(text)
    assert tok.decode(D.encode(text) + [D.EOS], skip_special_tokens=True) == text


def test_qa_config_shape():
    cfg = qa_config()
    prof = qa_profile(cfg.num_layers)
    assert cfg.num_layers >= 12 and cfg.heads_per_group == 8
    assert prof.name == "qa-3F-6R-3F" and list(prof.reusable_layers(12)) == list(range(3, 9))
    kinds = {cfg.layer_types[i] for i in prof.reusable_layers(12)}
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= kinds
    assert cfg.is_hash(0) and not cfg.is_hash(cfg.num_layers - 1)
    assert 0 < head_row_ceiling(cfg, prof) < 1
    five = qa_profile(12, 32, fence_first=5)  # the name follows the fences
    assert five.name == "qa-5F-4R-3F" and list(five.reusable_layers(12)) == list(range(5, 9))
    assert five.boundary_rows == 16 and qa_profile(12, 32, name="x").name == "x"


def test_training_forward_equals_model_forward():
    cfg = qa_test_config()
    model = random_model(cfg, seed=1, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(4, 110, (2, 64)), jnp.int32)
    dense, kls, loads = forward_train(model, ids, block=32)
    ref, _ = model.forward(ids, jnp.zeros(2, jnp.int32), jnp.full(2, 64, jnp.int32), model.init_cache(2, 64),
                           jnp.broadcast_to(jnp.arange(64), (2, 64)), block=32)
    np.testing.assert_allclose(np.asarray(dense), np.asarray(ref), atol=2e-4, rtol=1e-4)
    assert set(kls) == {i for i in range(cfg.num_layers) if cfg.layer_types[i] == "compressed_sparse_attention"}
    assert all(np.isfinite(float(v)) and float(v) >= 0 for v in kls.values())
    assert all(float(v.sum()) == 2 * 64 * cfg.experts_per_tok for v in loads.values())


def test_csa_top_k_covering_every_entry_attends_them_densely():
    """A CSA layer whose top-k covers every entry (short contexts; training's dense warm-up)
    attends every visible entry without scoring or selecting, and gives what the selecting
    path gives (the trace path still selects)."""
    cfg = qa_test_config(index_topk=16)  # 64 rows / rate 4 = 16 entries
    model = random_model(cfg, seed=3, dtype=jnp.float32)
    attn = model.layers[2].attn
    assert attn.kind == "compressed_sparse_attention"
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 64, cfg.hidden_size)), jnp.float32)
    pos0, n_new = jnp.zeros(2, jnp.int32), jnp.full(2, 64, jnp.int32)
    cache = model.init_cache(2, 64)["layers"][2]
    run = lambda trace: attn(x, pos0, n_new, cache, model.freqs(2), 32, trace=trace)[0]
    np.testing.assert_allclose(np.asarray(run(False)), np.asarray(run(True)), atol=1e-5, rtol=1e-5)
    assert "top_k" not in str(jax.make_jaxpr(lambda: run(False))())
    assert "top_k" in str(jax.make_jaxpr(lambda: run(True))())


def test_dense_warm_up_step_attends_every_entry_and_keeps_the_model_top_k():
    """`Trainer.step_fn(index_topk)`: a step whose CSA top-k covers every entry trains the same
    parameters on a different (dense) attention; the trainer's model keeps its own top-k."""
    cfg = qa_test_config()  # top-8 of the 32 entries of a 128-row sequence
    tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), TrainConfig(block=64, warmup_frac=0.0))
    batch = D.training_batch(np.random.default_rng(0), D.split_names()["train"], 2, 128,
                             D.Curriculum(2, 2, per_doc=2, questions=6))
    args = (tr.params, tr.rest, tr.opt_state, jnp.asarray(batch[0]), jnp.asarray(batch[1]), jnp.float32(0), tr.decay)
    copy = lambda: jax.tree.map(jnp.copy, args)  # steps donate params and optimizer state
    dense = tr.step_fn(128 // cfg.csa_rate)(*copy())[2]["lm"]
    topk = tr.step_fn()(*copy())[2]["lm"]
    assert abs(float(dense) - float(topk)) > 1e-4
    assert all(b.attn.indexer.topk == cfg.index_topk for b in tr.model().layers if b.attn.indexer is not None)


def test_a_few_steps_lower_the_loss_and_train_the_indexer(tmp_path):
    cfg = qa_test_config()
    model = random_model(cfg, seed=0, dtype=jnp.float32)
    tc = TrainConfig(lr=3e-3, block=64, warmup_frac=0.0)
    tr = Trainer(model, tc)
    idx0 = np.asarray(tr.model().layers[2].attn.indexer.wq_b[...]).copy()
    bias0 = np.asarray(tr.model().layers[3].ffn.bias[...]).copy()
    rng = np.random.default_rng(0)
    names = D.split_names()["train"]
    cur = D.Curriculum(2, 2, per_doc=2, questions=6)
    batch = D.training_batch(rng, names, 2, 128, cur)  # one fixed batch: the loss must fall on it
    losses = [float(tr.step(*batch, lr_at(tc, 0.5))["loss"]) for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5, losses
    # the step's accuracies are those of its logits: answer_acc over the answer tokens and their
    # <eos>, span_acc over the answer tokens alone (the figure to compare with chance). The batch's
    # answers and <eos> are learnt by now; a few wrongly predicted document tokens are weighted as
    # answers too, so the two figures differ and a span_acc that counted the <eos> fails here
    tokens, targets = batch[0], batch[0][:, 1:]
    hit = np.argmax(np.asarray(tr.logits(tokens[:, :-1])), -1) == targets
    w = batch[1].copy()
    w[(w > 0) & ~hit & (targets != D.EOS)] = 1.0
    ans = w >= 1.0
    span = ans & (targets != D.EOS)
    st = tr.step(tokens, w, 0.0)
    want_answer, want_span = np.mean(hit[ans]), np.mean(hit[span])
    assert want_answer != want_span
    assert np.isclose(float(st["answer_acc"]), want_answer, atol=1e-6)
    assert np.isclose(float(st["span_acc"]), want_span, atol=1e-6)
    after = tr.model()
    assert not np.allclose(np.asarray(after.layers[2].attn.indexer.wq_b[...]), idx0), "indexer got no update"
    assert not np.allclose(np.asarray(after.layers[3].ffn.bias[...]), bias0), "router bias not balanced"

    recs = []
    eps = D.eval_episodes("val", 2, seed=0, n_docs=2, per_doc=2, questions_per_type=1)
    seen, logits = [], tr.logits
    tr.logits = lambda x: seen.append(np.asarray(x)) or logits(x)
    scores = teacher_forced_scores(tr, eps, 128, 2, records=recs)
    del tr.logits
    # every question scored, each in a row of its own: no earlier question or answer in view
    assert len(recs) == sum(v["n"] for v in scores.values()) == sum(len(ep.qas) for ep in eps) > 0
    rows = np.concatenate(seen)[:len(recs)]
    assert [int(np.sum(r == D.ID["question"])) for r in rows] == [1] * len(recs)
    assert all(r["distance"] > 0 and r["em"] in (0.0, 1.0) for r in recs)

    tr.round_to_bf16()
    files = save_checkpoint(tr.model(), tmp_path / "ckpt", shard_bytes=100_000)
    assert len(files) >= 2
    loaded = load_model(tmp_path / "ckpt")
    ids = jnp.asarray(batch[0][:, :-1])
    a = forward_train(tr.model(), ids, block=64)[0]
    b = forward_train(loaded, ids, block=64)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["num_hidden_layers"] == cfg.num_layers


def test_mixed_precision_steps_run_the_served_bf16_model():
    """compute_dtype="bfloat16": parameters and optimizer state stay fp32, the loss still falls,
    and the forward is exactly the served model's (a bf16 `Model` holding the shipped casts of
    the weights); the fp32 forward is not (the test can tell the two apart)."""
    cfg = qa_test_config()
    tc = TrainConfig(lr=3e-3, block=64, warmup_frac=0.0, compute_dtype="bfloat16")
    tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), tc)
    batch = D.training_batch(np.random.default_rng(0), D.split_names()["train"], 2, 128,
                             D.Curriculum(2, 2, per_doc=2, questions=6))
    losses = [float(tr.step(*batch, lr_at(tc, 0.5))["loss"]) for _ in range(5)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert {v.dtype for v in jax.tree.leaves(tr.params)} == {jnp.dtype(jnp.float32)}
    ids = jnp.asarray(batch[0][:, :-1])
    served = random_model(cfg, seed=1, dtype=jnp.bfloat16)  # a bf16 model, then the trained weights in it
    gd, p_bf16, _ = nnx.split(served, nnx.Param, ...)
    dtypes = {v.dtype for v in jax.tree.leaves(p_bf16)}
    assert jnp.dtype(jnp.bfloat16) in dtypes and jnp.dtype(jnp.float32) in dtypes  # mHC & co stay fp32
    cast = jax.tree.map(lambda a, b: a.astype(b.dtype), tr.params, p_bf16)
    ref = jax.jit(lambda p, r, x: forward_train(nnx.merge(tr._compute_graphdef(), p, r), x, 64)[0])(cast, tr.rest, ids)
    want = jax.jit(lambda p, r, x: forward_train(nnx.merge(gd, p, r), x, 64)[0])(cast, tr.rest, ids)
    got = tr.logits(ids)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-6 and float(jnp.max(jnp.abs(ref - want))) < 1e-6
    fp32 = jax.jit(lambda x: forward_train(tr.model(), x, 64)[0])(ids)
    assert float(jnp.max(jnp.abs(fp32 - want))) > 1e-3
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainConfig(compute_dtype="float16")


def _eval_quality():
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "eval_quality", pathlib.Path(__file__).resolve().parents[2] / "launch" / "eval_quality.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    return ev


def test_eval_quality_variant_names():
    """Beyond the grid: any budget with a fan-out mode, any variant with its budget ranked by
    latent deviation and any with the protected rows' latents recomputed; anything else is
    refused, naming it."""
    ev = _eval_quality()
    got = dict(ev.variants(["b50-native", "b100-native-refresh", "reuse-5-8-refresh", "b25-k3",
                            "b25-native-dev-refresh"], range(3, 9), 12))
    assert got["b50-native"] == {"budget_override": 0.5, "fanout_mode": "native", "itop_rank": "indexer",
                                 "latent_refresh": "none", "_label": "fan-out off"}
    assert {k: got["b100-native-refresh"][k] for k in ("budget_override", "fanout_mode", "latent_refresh")} == \
        {"budget_override": 1.0, "fanout_mode": "native", "latent_refresh": "protected"}
    assert {k: got["reuse-5-8-refresh"][k] for k in ("fence_first", "fence_last", "latent_refresh")} == \
        {"fence_first": 5, "fence_last": 3, "latent_refresh": "protected"}
    assert {k: got["b25-native-dev-refresh"][k] for k in ("budget_override", "itop_rank", "latent_refresh")} == \
        {"budget_override": 0.25, "itop_rank": "deviation", "latent_refresh": "protected"}
    assert got["b25-k3"] == dict(ev.variants(["all"], range(3, 9), 12))["b25-k3"]  # a grid name: the grid's entry
    (_, omit), (_, restore) = ev.variants(["b10-k3-omit", "default-restore"], range(3, 9), 12)
    assert (omit["budget_override"], omit["fanout_mode"], omit["ffn_rows"]) == (0.1, "k3", "omit")
    assert restore["ffn_rows"] == "restore" and "budget_override" not in restore
    (_, fp4), (_, fp8) = ev.variants(["default-restore-fp4", "b10-k3-fp8-omit"], range(3, 9), 12)
    assert (fp4["artifact_codec"], fp4["ffn_rows"]) == ("fp4", "restore")
    assert (fp8["artifact_codec"], fp8["ffn_rows"], fp8["budget_override"]) == ("fp8", "omit", 0.1)
    # bands anywhere in the model, e.g. the reference 3F-6R-3F beside a shipped 5F-4R-3F
    (_, band), = ev.variants(["reuse-3-8"], range(5, 9), 12)
    assert (band["fence_first"], band["fence_last"]) == (3, 3)
    # every name but `default` states its whole protection rule, so it means the same beside a
    # shipped profile with a fixed budget, deviation-ranked rows and refreshed latents
    shipped = RedKnotProfile("shipped", fence_first=5, fence_last=3, budget_override=0.5, itop_rank="deviation",
                             latent_refresh="protected")
    for name, want in (("reuse-5-8", (None, "indexer", "none")), ("b25-tau", (0.25, "indexer", "none")),
                       ("thin", (None, "indexer", "none")), ("b25-tau-dev", (0.25, "deviation", "none")),
                       ("reuse-3-8-refresh", (None, "indexer", "protected"))):
        (_, ov), = ev.variants([name], range(5, 9), 12)
        p = dataclasses.replace(shipped, **{k: v for k, v in ov.items() if not k.startswith("_")})
        assert (p.budget_override, p.itop_rank, p.latent_refresh) == want, name
    for bad in ("b0-tau", "b101-native", "b50-x", "x-refresh", "reuse-2-12-refresh", "reuse-5-4", "refresh", "x-dev", "dev", "omit",
                "x-omit", "fp4", "default-fp16"):
        with pytest.raises(SystemExit, match=f"unknown \\['{bad}'\\]"):
            ev.variants([bad], range(3, 9), 12)


def test_eval_quality_plot_takes_the_budget_grid_only():
    """The quality-vs-budget plot draws the b<budget>-<fan-out> grid and passes over any other
    variant (deviation-ranked, refreshed, bands), which once made it fail after the tables."""
    ev = _eval_quality()
    em = lambda red: {"all": {"redknot_em": red, "recompute_em": 60.0}}
    svg = ev.plot_svg({"b10-tau": em(50.0), "b25-tau": em(55.0), "b50-tau-dev-refresh": em(99.0),
                       "reuse-5-8": em(1.0), "default": em(2.0)})
    assert svg.startswith("<svg") and svg.count("<circle") == 2
    assert ev.plot_svg({"b50-tau-dev-refresh": em(1.0), "reuse-5-8": em(1.0)}) is None


@pytest.mark.slow
def test_eval_quality_smoke(tmp_path):
    ev = _eval_quality()
    cfg = qa_test_config()
    model = random_model(cfg, seed=0, dtype=jnp.float32)
    save_checkpoint(model, tmp_path / "ckpt")
    writes, write = [], ev.write
    ev.write = lambda *a, final: writes.append(final) or write(*a, final=final)
    res = ev.main(["--checkpoint", str(tmp_path / "ckpt"), "--n", "1", "--docs", "3", "--per-doc", "2",
                   "--variants", "reuse-3-4,reuse-2-4,thin-fp4", "--max-new", "1", "--bootstrap", "50",
                   "--paired-with", "thin-fp4", "--out", str(tmp_path / "q")])
    assert set(res["summary"]) == {"reuse-3-4", "reuse-2-4", "thin-fp4"}
    # thin-fp4 against itself, question by question: no difference; the others differ from it
    self_pair = res["summary"]["thin-fp4"]["all"]["vs_paired"]
    assert self_pair["diff_em"] == 0 and self_pair["mean_kl"] == 0
    assert res["summary"]["reuse-3-4"]["all"]["vs_paired"]["mean_kl"] > 0
    # written after the world (a run cut short keeps it) and at the end
    assert writes == [False, True] and res["complete"] and res["worlds_done"] == 1
    assert json.loads((tmp_path / "q.json").read_text())["complete"]
    for cert in res["certification"].values():
        assert cert["validated"] == 2 and not any(cert["fallback"].values())  # no silent recomputation
    # the band variants ran on artifacts built for their own fences (layers 3-4 only, a band of the
    # grid; 2-4, any other range of the model's layers; the shipped profile of this model reuses 1-4)
    assert res["artifact_layers"] == {"reuse-3-4": [3, 4], "reuse-2-4": [2, 3, 4], "thin-fp4": [1, 2, 3, 4]}
    assert res["certification"]["thin-fp4"]["validated"] == 2  # compact artifacts, certified as such
    for bad in ("reuse-3-2", "reuse-2-6", "reuse-x"):  # not a range, outside the model's layers 0-5, not numbers
        with pytest.raises(SystemExit, match=bad):
            ev.variants([bad], range(1, 5), 6)
    for r in res["records"]:
        assert 0 <= r["kl"] and r["protected"] > 0
    # thin: fixed protection cut to 1/16 and 1/8 of this model's 8-row window, below the shipped
    # profile's (half a window, one window); at this size the controller's budget decides the
    # protected share of both variants
    thin, base = res["variants"]["thin-fp4"], res["profile"]
    assert (thin["boundary_rows"], thin["tail_rows"]) == (1, 1) and (base["boundary_rows"], base["tail_rows"]) == (4, 8)
    assert (tmp_path / "q.md").read_text().startswith("| variant")


def test_train_script_writes_a_servable_checkpoint_and_continues_from_it(tmp_path, refused):
    """launch/train_quality_model.py end to end (qa-test size): the checkpoint holds what a
    server needs, and --init-from continues from exactly those weights with the run recorded."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "train_quality_model", pathlib.Path(__file__).resolve().parents[2] / "launch" / "train_quality_model.py")
    tq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tq)
    common = ["--seq-len", "128", "--batch", "2", "--eval-docs", "2", "--per-doc", "2", "--eval-episodes", "2"]
    weights_asked = []
    real_sequence = tq.D.training_sequence

    stages = []

    def spy(*a_, **kw):
        weights_asked.append(a_[4])
        stages.append(a_[3])
        return real_sequence(*a_, **kw)

    tq.D.training_sequence = spy
    try:
        tq.main(["--config", "qa-test", "--max-steps", "3", "--dense-csa-until", "0.5", "--set", "head_dim=24",
                 "--other-weight", "0.5", "--min-lr-frac", "1", "--out", str(tmp_path / "a")] + common)
    finally:
        tq.D.training_sequence = real_sequence
    a = tmp_path / "a"
    assert {c.facts for c in stages} == {D.RELATIONS}
    assert load_model(a).cfg.head_dim == 24  # --set reached the config
    assert weights_asked and set(weights_asked) == {0.5}  # --other-weight reached the data
    hist = json.loads((a / "train_log.json").read_text())["history"]
    assert [r["lr"] for r in hist[1:]] == [2e-3, 2e-3]  # --min-lr-frac 1: constant after the warm-up step
    assert json.loads((a / "train_log.json").read_text())["dense_csa_until_step"] == 2  # steps 0, 1 dense
    for f in ("config.json", "tokenizer.json", "chat_template.jinja", "redknot_profile.json", "train_log.json"):
        assert (a / f).is_file(), f
    tq.main(["--init-from", str(a), "--curriculum-from", "0.6", "--max-steps", "3", "--lr", "0", "--eval-every", "1",
             "--op-profile", "1", "--out", str(tmp_path / "b")] + common)
    log = json.loads((tmp_path / "b" / "train_log.json").read_text())
    assert [c["step"] for c in log["val_curve"]] == [1, 2, 3]  # the validation curve, EM beside chance
    prof = log["op_profile"]  # step 3 traced: its executed ops (CPU: the thunk events), by category
    assert prof["steps"] == 1 and prof["ops_per_step"] > 100 and 0 < prof["device_ops_ms_per_step"]
    assert "matmul" in prof["by_category"] and prof["top"] and prof["wall_ms_per_step"] > 0
    assert not (tmp_path / "b" / "op_trace").exists()  # the trace is scratch, not checkpoint content
    tq.main(["--init-from", str(a), "--max-steps", "3", "--op-profile", "5", "--eval-episodes", "1",
             "--out", str(tmp_path / "e")] + common[:-2])
    assert "before the 5 traced steps" in json.loads((tmp_path / "e" / "train_log.json").read_text())["op_profile"]["skipped"]
    assert all(0 < c[q]["chance"] <= 1 and 0 <= c[q]["em"] <= 1 for c in log["val_curve"] for q in D.QTYPES)
    assert log["init_from"] == str(a) and [r["steps"] for r in log["prior_runs"]] == [3]
    # lr 0: every weight came back unchanged except the learned routers' balancing bias, which
    # moves by bias_rate per step whatever the learning rate
    wa, wb = (dict(nnx.to_flat_state(nnx.state(load_model(d), nnx.Param))) for d in (a, tmp_path / "b"))
    assert wa.keys() == wb.keys()
    moved = [k for k in wa if not np.array_equal(np.asarray(wa[k].get_value()), np.asarray(wb[k].get_value()))]
    assert moved and all(k[-2:] == ("ffn", "bias") or k[-1] == "bias" and "ffn" in k for k in moved), moved
    # --simple-*: the in-window stage states and asks cities only until stage 0.15 (the first half of this
    # run: stages 0, 0.085 | 0.17, 0.255), then everything; the validation
    # curve is on such worlds, per relation, and says so
    stages.clear()
    tq.D.training_sequence = spy
    try:
        tq.main(["--init-from", str(a), "--max-steps", "4", "--curriculum-until", "0.34", "--simple-until", "0.15",
                 "--recall-until", "0.1", "--recall-shape", "1,1,6,2", "--simple-facts", "city",
                 "--simple-two-hop", "0", "--eval-every", "2", "--templates", "echo", "--inwindow", "1,1,4,1",
                 "--recall-rows", "1", "--out", str(tmp_path / "s")] + common)
    finally:
        tq.D.training_sequence = real_sequence
    per_step = [stages[i:i + 2] for i in range(0, len(stages), 2)]
    assert [[(c.facts, c.asks, c.two_hop) for c in st] for st in per_step] == [
        [(("city",), ("city",), 0.0)] * 2] * 2 + [[(D.RELATIONS, D.RELATIONS, 0.3), (D.RELATIONS, D.RELATIONS, 0.5)]] * 2
    # --recall-until 0.1: associative-recall episodes at stages 0 and 0.085, then question/answer ones,
    # except the last row of each batch (--recall-rows 1), which stays on recall
    assert [[c.recall for c in st] for st in per_step] == [[True, True]] * 2 + [[False, True]] * 2
    log = json.loads((tmp_path / "s" / "train_log.json").read_text())
    assert log["val_curve_worlds"] == {"facts": ["city"], "asks": ["city"]}
    assert {c.templates for c in stages} == {"echo"} and D.templates_of(tmp_path / "s") == "echo"
    # --inwindow: the in-window stage's episode shape (one document of four people, one question);
    # --recall-shape: the recall episodes' (one document of six people, two queries)
    assert [[(c.min_docs, c.max_docs, c.per_doc, c.questions) for c in st] for st in per_step] == [
        [(1, 1, 6, 2)] * 2] * 2 + [[(1, 1, 4, 1), (1, 1, 6, 2)]] * 2
    assert all(0 <= r["span_acc"] <= 1 for r in log["history"])  # the answer span's accuracy, without <eos>
    assert {k for c in log["val_curve"] for k in c if k != "step"} == {"lookup", "lookup:city"}
    # with --recall-until the curve also follows recall by distance from the stated value: 32 episodes of
    # 1 x 6 (--recall-shape, about 26 tokens) against qa-test's 8-row window reach all three buckets
    assert [c["step"] for c in log["recall_curve"]] == [2, 4]
    for c in log["recall_curve"]:
        assert set(c) == {"step", "inside", "1-2 windows", "beyond 2 windows"}
        assert sum(c[k]["n"] for k in c if k != "step") == 6 * 32 and all(0 < c[k]["chance"] <= 1 for k in c if k != "step")
    assert "lookup" in log["teacher_forced_val"]  # the end of the run: full worlds (2 x 2 fit one or two questions)
    # ... and by distance from the farthest fact, against qa-test's 8-row window
    dist = log["teacher_forced_val_by_distance"]
    assert dist and {k.split(" ", 1)[1] for k in dist} <= {"inside", "1-2 windows", "beyond 2 windows"}
    assert sum(v["n"] for k, v in dist.items() if k.startswith("lookup")) == log["teacher_forced_val"]["lookup"]["n"]
    refused(tq.main, ["--init-from", str(tmp_path / "nothing"), "--out", str(tmp_path / "c")],
            "argument --init-from: .*nothing: no such directory")
    for bad, named in (
            (["--curriculum-from", "0.5", "--curriculum-until", "0.4"], r"--curriculum-until: .*got 0.4"),
            (["--dense-csa-until", "1.5"], "--dense-csa-until: .*got 1.5"),
            (["--set", "sliding_window"], "--set: expected NUMERIC_FIELD=VALUE.*'sliding_window'"),
            (["--set", "layer_types=4"], "--set: expected NUMERIC_FIELD=VALUE.*'layer_types=4'"),
            (["--set", "head_dim=wide"], "--set: head_dim: 'wide'"),
            (["--set", "no_such_field=1"], "--set: expected NUMERIC_FIELD=VALUE.*'no_such_field=1'"),
            (["--other-weight", "2"], "--other-weight: .*got 2"), (["--min-lr-frac", "-0.1"], "--min-lr-frac: .*-0.1"),
            (["--op-profile", "-1"], "--op-profile: .*-1"),
            (["--init-from", str(a), "--set", "sliding_window=64"], "config overrides need a new model"),
            (["--simple-facts", "town"], "Curriculum facts: .*town"),
            (["--simple-facts", "city", "--simple-asks", "boss"], r"Curriculum asks: .*\('boss',\)"),
            (["--simple-until", "2"], "--simple-until: .*got 2"), (["--recall-until", "-1"], "--recall-until: .*-1"),
            (["--recall-rows", "2", "--batch", "2"], r"--recall-rows: .*\(2\), got 2"),
            (["--recall-rows", "-1"], "--recall-rows: .*got -1"),
            (["--simple-two-hop", "1.5"], "Curriculum two_hop: .*1.5"), (["--templates", "fancy"], "'fancy'"),
            (["--inwindow", "1,2,2"], r"--inwindow: .*\(1, 2, 2\)"), (["--inwindow", "2,1,2,6"], r"--inwindow: .*\(2, 1, 2, 6\)"),
            (["--inwindow", "1,2,1,6"], r"--inwindow: .*\(1, 2, 1, 6\)"), (["--inwindow", "one,2,2,6"], "--inwindow: .*'one,2,2,6'"),
            (["--recall-shape", "1,2,2"], r"--recall-shape: .*\(1, 2, 2\)")):
        refused(tq.main, bad + ["--out", str(tmp_path / "d")], named)


def test_qa_diagnose_script_splits_em_by_relation_and_distance(tmp_path, refused):
    """launch/qa_diagnose.py on a tiny random checkpoint: every question lands in one relation
    group and one distance bucket, and a bad --sizes is refused."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "qa_diagnose", pathlib.Path(__file__).resolve().parents[2] / "launch" / "qa_diagnose.py")
    qd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qd)
    save_checkpoint(random_model(qa_test_config(), seed=0, dtype=jnp.float32), tmp_path / "ckpt")
    out = qd.main(["--checkpoint", str(tmp_path / "ckpt"), "--sizes", "2x2", "--episodes", "1", "--seq-len", "256",
                   "--json", str(tmp_path / "d.json")])
    em = out["sizes"]["2x2"]["em"]
    n = sum(v["n"] for k, v in em.items() if k.startswith("type: "))
    assert n == 8  # 4 questions per type
    assert sum(v["n"] for k, v in em.items() if k.startswith("relation: ")) == n
    assert sum(v["n"] for k, v in em.items() if k.startswith("distance: ")) == n
    assert json.loads((tmp_path / "d.json").read_text())["sizes"]["2x2"]["people"] == 4
    assert all(0 < v["chance"] <= 1 for v in em.values())
    assert qd.bucket(0, 128) == "[0,128)" and qd.bucket(5000, 128) == ">=1024" and qd.bucket(40, 32) == "[32,64)"
    window = qa_test_config().sliding_window  # the buckets follow the model's window
    assert {k.split(" ", 2)[2] for k in em if k.startswith("distance: ")} <= {
        qd.bucket(w * window, window) for w in (0, 1, 2, 4, 8)}
    edges = [int(k.split(" ", 2)[2].strip("[>=").split(",")[0]) for k in em if k.startswith("distance: lookup")]
    assert edges == sorted(edges)  # nearest first
    refused(qd.main, ["--checkpoint", str(tmp_path / "ckpt"), "--sizes", "two"], "--sizes: .*'two'")
    refused(qd.main, ["--checkpoint", str(tmp_path / "ckpt"), "--split", "heldout"], "--split: .*'heldout'")
    asked = []  # the split each world set is drawn from
    draw = qd.D.eval_episodes
    qd.D.eval_episodes = lambda split, *a, **k: asked.append(split) or draw(split, *a, **k)
    try:
        val = qd.main(["--checkpoint", str(tmp_path / "ckpt"), "--split", "val", "--sizes", "2x2", "--episodes", "1",
                       "--seq-len", "256"])
    finally:
        qd.D.eval_episodes = draw
    assert asked == ["val"] and val["split"] == "val" and out["split"] == "test"
    assert sum(v["n"] for k, v in val["sizes"]["2x2"]["em"].items() if k.startswith("type: ")) == 8
