"""`python launch/serve.py` with no model flags serves the shipped QA model (issue #10 item 5)
and answers held-out questions over registered documents, over a real socket.

The world, its documents and its questions come from the test split (names never seen in
training). The documents are registered as text, cited in a shuffled order, and its questions
are asked through the completions endpoint (RedKnot arm and `arm: recompute`), and the first
question also through chat (the checkpoint's chat template appends `answer :`). Expected: the
server's Recomputed answer equals the in-process greedy answer of the same weights (serving
changes nothing), and the model answers at least 3 of the 4 lookup questions right (in process,
CPU, 2026-12-03, session 24's model: 4 of 4 at this seed and at seeds 3 and 5,
docs/results/qa_s23/server_world_seeds.py, output in docs/results/qa_s24/; session 26's model
answered every lookup of 128 held-out worlds of this size, and so does session 27's, trained
in 4096-token rows; a guess among the world's values of the asked kind gets about two thirds
of one).
The world is the size the evaluation of both arms uses (3 documents of 4 people, about 300
tokens): most of its facts lie beyond the model's 32-row sliding window, so the answers come
through compressed (CSA / HCA) entries. One two-hop question is asked (served the same as in
process) but not counted: the model answers about a third of them (its model card).
"""

from __future__ import annotations

import numpy as np
import pytest

from redknot_jax.config import ModelConfig
from redknot_jax.quality import SHIPPED_MODEL
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import profile_of, qa_profile
from redknot_jax.quality.train import load_model
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.runtime import ReuseRuntime
from tests.server.sockets import start_server, stop_server

SEED = 4  # the test world (test split)
# a request's wait: the first request of each arm compiles the 12-layer model's programs in the
# server (one CPU device), which took over 120 s on the 2-core CI machine under load
COMPILE_WAIT_S = 600


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve-default"), ["--log-level", "warning", "--compilation-cache", ""],
                       wait_s=400)
    yield srv
    stop_server(srv)


def test_the_shipped_profile_is_the_validated_choice():
    """The shipped model ships (and `serve.py --profile auto` serves) 5F-4R-3F with three
    quarters of the candidate rows protected, ranked by latent deviation, their latents
    recomputed: chosen on the validation split by issue 10's target as half of every document's
    rows, the same rows in 3-document worlds once the exact prefix is no candidate
    (docs/quality.md, "Target 4 at the shipped profile"); the unprotected
    rows' FFN output restored from the artifacts (the answers of running it on every split,
    "Speed-quality frontier"); the reference 3F-6R-3F stays `qa_profile`'s default."""
    cfg = ModelConfig.from_json(SHIPPED_MODEL / "config.json")
    assert profile_of(SHIPPED_MODEL) == qa_profile(
        cfg.num_layers, cfg.sliding_window, fence_first=5, budget_override=0.75, itop_rank="deviation",
        latent_refresh="protected", ffn_rows="restore", name="qa-5F-4R-3F-b75-dev-refresh-restore")
    assert qa_profile().name == "qa-3F-6R-3F"


def _greedy_recompute(rt, docs, question, max_new=4):
    req = Request([Segment(np.asarray(d, np.int32)) for d in docs] + [Segment(np.asarray(question, np.int32))])
    first = rt.prefill(req, "recompute")
    toks = [int(np.argmax(first.logits[-1]))]
    while toks[-1] != D.EOS and len(toks) < max_new:
        toks.append(int(np.argmax(rt.next_logits(req, first, toks))))
    return D.decode([t for t in toks if t != D.EOS])


def test_default_server_answers_held_out_questions(default_server):
    srv = default_server
    status, models = srv.request("GET", "/v1/models", key=None)
    assert status == 200 and models["data"][0]["id"] == SHIPPED_MODEL.name
    (ep,) = D.eval_episodes("test", 1, seed=SEED, n_docs=3, per_doc=4, questions_per_type=4)
    order = np.random.default_rng(SEED).permutation(len(ep.docs))
    ids = []
    for j in order:
        status, doc = srv.request("POST", "/v1/documents", {"text": D.decode(ep.docs[j])}, key=None)
        assert status == 201, doc
        assert doc["tokens"] == len(ep.docs[j])  # the shipped tokenizer gives the task's ids
        ids.append(doc["id"])

    model = load_model(SHIPPED_MODEL)
    rt = ReuseRuntime(model, profile_of(SHIPPED_MODEL), "in-process")
    right = 0
    # the 4 lookups and one two-hop question (served as in process; a second adds only CI time)
    asked = [qa for qa in ep.qas if qa.qtype == "lookup"] + [next(qa for qa in ep.qas if qa.qtype == "two_hop")]
    for qa in asked:
        gold = D.decode(qa.answer)
        expected = _greedy_recompute(rt, [ep.docs[j] for j in order], qa.question)
        body = {"model": SHIPPED_MODEL.name, "prompt": D.decode(qa.question), "max_tokens": 4,
                "temperature": 0, "documents": ids}
        status, rec = srv.request("POST", "/v1/completions", {**body, "arm": "recompute"}, key=None, timeout=COMPILE_WAIT_S)
        assert status == 200, rec
        assert rec["choices"][0]["text"].strip() == expected, (qa.qtype, gold)
        status, red = srv.request("POST", "/v1/completions", body, key=None, timeout=COMPILE_WAIT_S)
        assert status == 200, red
        assert red["redknot"]["arm"] == "redknot" and red["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        right += qa.qtype == "lookup" and expected == gold
        if qa is not asked[0]:  # the chat template's path is the same for every question: checked once
            continue
        chat_q = D.decode(qa.question[:-2])  # without "answer :": the chat template adds it
        status, chat = srv.request("POST", "/v1/chat/completions",
                                   {"model": SHIPPED_MODEL.name, "max_tokens": 4, "temperature": 0,
                                    "documents": ids, "arm": "recompute",
                                    "messages": [{"role": "user", "content": chat_q}]}, key=None)
        assert status == 200, chat
        assert chat["choices"][0]["message"]["content"].strip() == expected
    assert len(asked) == 5 and right >= 3, f"the shipped model answered {right} of 4 held-out lookup questions"


def test_ignore_eos_and_tokenize(default_server):
    """`ignore_eos` (vLLM's extension) generates past the answer's <eos> up to max_tokens in both
    arms; `/tokenize` gives the ids the completion endpoints see."""
    srv = default_server
    (ep,) = D.eval_episodes("test", 1, seed=SEED, n_docs=2, per_doc=4, questions_per_type=1)
    text = D.decode(ep.docs[0])
    status, tok = srv.request("POST", "/tokenize", {"model": SHIPPED_MODEL.name, "prompt": text}, key=None)
    assert status == 200 and tok["tokens"] == [int(t) for t in ep.docs[0]] and tok["count"] == len(ep.docs[0])
    assert tok["max_model_len"] >= tok["count"]
    ids = [srv.request("POST", "/v1/documents", {"text": D.decode(d)}, key=None)[1]["id"] for d in ep.docs]
    body = {"model": SHIPPED_MODEL.name, "prompt": D.decode(ep.qas[0].question), "max_tokens": 6,
            "temperature": 0, "documents": ids}
    for arm in ("recompute", "redknot"):
        status, plain = srv.request("POST", "/v1/completions", {**body, "arm": arm}, key=None, timeout=COMPILE_WAIT_S)
        assert status == 200 and plain["choices"][0]["finish_reason"] == "stop", plain  # a short answer, then <eos>
        assert plain["usage"]["completion_tokens"] < 6
        status, full = srv.request("POST", "/v1/completions", {**body, "arm": arm, "ignore_eos": True}, key=None, timeout=COMPILE_WAIT_S)
        assert status == 200 and full["choices"][0]["finish_reason"] == "length", full
        assert full["usage"]["completion_tokens"] == 6
        assert full["redknot"]["token_ids"][:len(plain["redknot"]["token_ids"])] == plain["redknot"]["token_ids"]
