"""Seeded synthetic multi-document QA (issue 10), word-level.

A *world* is a set of made-up people. Each person has a two-syllable name ("ka lo"), three
attributes (city, colour, job) and one relation (boss: another person of the world). Every
person's four facts are short sentences in exactly one *document*:

    document : ka lo lives in oslo . ka lo likes teal . mi ru works as pilot .
               ka lo reports to mi ru . ...

Questions (new rows after the documents) and their short-span answers:

* lookup (one document): "question : where does ka lo live ? answer :" -> "oslo"; colour,
  job, and the relation itself ("who does ka lo report to ?" -> "mi ru", a two-token span);
* two-hop (two documents, as in 2WikiMQA / HotpotQA): "where does the boss of ka lo live ?":
  the relation is in ka lo's document, the attribute of its target in another one.

Every answer is followed by `<eos>`. The other documents of the world are distractors (they
mention the same attribute words about other people).

Splits: the names (ordered pairs of distinct syllables) are shuffled with a fixed seed and cut
into train / validation / test pools, so the three splits have disjoint entities. Attribute
values and the sentence templates are shared (they are the closed vocabulary). The held-out
test split is only read by the final evaluation.

The vocabulary is closed (`VOCAB`, 128 ids: `<bos>`=0, `<eos>`=1 as in the model config), and
`tokenizer_json()` writes it as a `tokenizers` WordLevel tokenizer.json (whitespace split), so
the server's `HFTokenizer` encodes the same ids as this module.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Iterable, Sequence

import numpy as np

SPECIALS = ["<bos>", "<eos>", "<pad>", "<unk>"]
WORDS = ["document", ":", ".", "?", "question", "answer", "lives", "in", "likes", "works", "as",
         "reports", "to", "where", "does", "live", "what", "color", "like", "job", "do", "who",
         "report", "the", "boss", "of"]
_CONS, _VOWELS = "bdgklmnprstvz", "aeiou"
SYLLABLES = [c + v for c in _CONS for v in _VOWELS if c + v not in WORDS][:40]
CITIES = ["oslo", "lima", "rome", "cairo", "delhi", "tokyo", "quito", "sofia", "perth", "dakar",
          "hanoi", "kyoto", "minsk", "accra", "porto", "baku"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "black", "white",
          "gray", "teal"]
JOBS = ["baker", "pilot", "doctor", "farmer", "lawyer", "artist", "nurse", "chef", "miner", "judge",
        "tailor", "sailor"]
# the "echo" templates' words, after the others so that every earlier id stays as it was
ECHO_WORDS = ["which", "city", "is", "fond", "work"]
VOCAB_SIZE = 128
_USED = SPECIALS + WORDS + SYLLABLES + CITIES + COLORS + JOBS + ECHO_WORDS
VOCAB = _USED + [f"<unused_{i}>" for i in range(VOCAB_SIZE - len(_USED))]
ID = {w: i for i, w in enumerate(VOCAB)}
BOS, EOS, PAD = ID["<bos>"], ID["<eos>"], ID["<pad>"]
assert len(VOCAB) == VOCAB_SIZE and len(ID) == VOCAB_SIZE, "vocabulary words must be distinct"

ATTRS = {"city": CITIES, "color": COLORS, "job": JOBS}
RELATIONS = ("city", "color", "job", "boss")
# The wording of facts and questions. "plain" (every checkpoint so far): "where does X live ?" for
# "X lives in oslo .". "echo": each question ends in the word that precedes the answer in its fact
# ("which city does X live in ?", "which color is X fond of ?" for "X is fond of teal .", "which job
# does X work as ?"), as the boss question always did ("who does X report to ?" for "X reports to Y .").
TEMPLATES = ("plain", "echo")
_FACT_WORDS = {"plain": {"city": ["lives", "in"], "color": ["likes"], "job": ["works", "as"], "boss": ["reports", "to"]},
               "echo": {"city": ["lives", "in"], "color": ["is", "fond", "of"], "job": ["works", "as"],
                        "boss": ["reports", "to"]}}
QTYPES = ("lookup", "two_hop")
SPLITS = ("train", "val", "test")


def words(text: str) -> list[str]:
    return text.split()


def encode(text: str | Sequence[str]) -> list[int]:
    """Whitespace-separated words -> ids (every word must be in the vocabulary)."""
    ws = words(text) if isinstance(text, str) else list(text)
    bad = [w for w in ws if w not in ID]
    if bad:
        raise ValueError(f"encode: words outside the vocabulary: {bad[:5]}")
    return [ID[w] for w in ws]


def decode(ids: Iterable[int], skip_special: bool = True) -> str:
    out = []
    for i in ids:
        w = VOCAB[int(i)]
        if skip_special and w.startswith("<"):
            continue
        out.append(w)
    return " ".join(out)


def tokenizer_json() -> str:
    """The vocabulary as a `tokenizers` WordLevel tokenizer.json (whitespace pre-tokenizer;
    decode joins words with spaces). Specials are marked special so decode can skip them."""
    added = [{"id": ID[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for s in SPECIALS]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
           "decoder": None, "model": {"type": "WordLevel", "vocab": ID, "unk_token": "<unk>"}}
    return json.dumps(tok, indent=1)


# ----------------------------------------------------------------------------- splits
def split_names(seed: int = 0) -> dict[str, list[tuple[str, str]]]:
    """Disjoint name pools: 70 % train, 15 % validation, 15 % test of the 1560 names."""
    names = [(a, b) for a in SYLLABLES for b in SYLLABLES if a != b]
    order = np.random.default_rng(seed).permutation(len(names))
    names = [names[i] for i in order]
    n_tr, n_va = int(0.7 * len(names)), int(0.15 * len(names))
    return {"train": names[:n_tr], "val": names[n_tr:n_tr + n_va], "test": names[n_tr + n_va:]}


# ----------------------------------------------------------------------------- worlds
@dataclasses.dataclass
class Person:
    name: tuple[str, str]
    city: str
    color: str
    job: str
    boss: int  # index of another person of the world
    doc: int  # document holding this person's facts


@dataclasses.dataclass
class QA:
    qtype: str  # lookup | two_hop
    relation: str  # city | color | job | boss (two_hop: the attribute asked of the boss)
    question: list[int]  # "question : ... answer :" ids (new rows of a request)
    answer: list[int]  # answer span ids (without <eos>)
    docs: tuple[int, ...]  # documents holding the needed facts
    facts: tuple[tuple[int, ...], ...] = ()  # the needed fact sentences' ids, as in the documents
    # in-context chance: the EM of a guesser that knows the asked kind but not the binding, i.e.
    # the share of the world's people whose value of that relation is the answer
    chance: float = 0.0

    @property
    def answer_text(self) -> str:
        return decode(self.answer)


@dataclasses.dataclass
class World:
    people: list[Person]
    docs: list[list[int]]  # token ids per document
    written: tuple[str, ...] = RELATIONS  # the relations whose fact sentences the documents hold
    templates: str = "plain"  # the wording (TEMPLATES)

    def facts(self, p: Person) -> list[list[str]]:
        """p's four fact sentences (words), in RELATIONS order."""
        vals = {"city": [p.city], "color": [p.color], "job": [p.job], "boss": list(self.people[p.boss].name)}
        verbs = _FACT_WORDS[self.templates]
        return [list(p.name) + verbs[r] + vals[r] + ["."] for r in RELATIONS]


def check_relations(what: str, rels: Sequence[str], within: Sequence[str] = RELATIONS) -> tuple[str, ...]:
    """`rels` as a tuple, refused if empty, repeated, or not all in `within`."""
    rels = tuple(rels)
    if not rels or len(set(rels)) != len(rels) or any(r not in within for r in rels):
        raise ValueError(f"{what}: expected distinct relations of {tuple(within)}, got {rels}")
    return rels


def check_templates(templates: str) -> str:
    if templates not in TEMPLATES:
        raise ValueError(f"templates: expected one of {TEMPLATES}, got {templates!r}")
    return templates


def make_world(rng: np.random.Generator, names: Sequence[tuple[str, str]], n_docs: int,
               per_doc: int, facts: Sequence[str] = RELATIONS, templates: str = "plain") -> World:
    """n_docs documents of per_doc people each (names drawn without replacement from `names`).
    `facts`: the relations whose sentences the documents hold (every person still has all
    four values, drawn the same way: a subset only leaves sentences out). `templates`: the
    wording (TEMPLATES); the draws do not depend on it."""
    facts = check_relations("make_world facts", facts)
    check_templates(templates)
    n = n_docs * per_doc
    if n > len(names):
        raise ValueError(f"make_world: {n} people need more than the {len(names)} names of the pool")
    if n < 2:
        raise ValueError("make_world: a world needs at least 2 people (every boss is someone else)")
    pick = rng.choice(len(names), n, replace=False)
    people = []
    for i, j in enumerate(pick):
        boss = int(rng.integers(n - 1))
        boss += boss >= i
        people.append(Person(names[j], CITIES[rng.integers(len(CITIES))], COLORS[rng.integers(len(COLORS))],
                             JOBS[rng.integers(len(JOBS))], boss, i // per_doc))
    w = World(people, [], tuple(r for r in RELATIONS if r in facts), templates)
    for d in range(n_docs):
        sents = [s for p in people if p.doc == d for r, s in zip(RELATIONS, w.facts(p)) if r in facts]
        order = rng.permutation(len(sents))
        w.docs.append(encode(["document", ":"] + [x for k in order for x in sents[k]]))
    return w


_LOOKUP_Q = {"city": "where does {} live ?", "color": "what color does {} like ?",
             "job": "what job does {} do ?", "boss": "who does {} report to ?"}
_TWOHOP_Q = {"city": "where does the boss of {} live ?", "color": "what color does the boss of {} like ?",
             "job": "what job does the boss of {} do ?"}
_QUESTIONS = {"plain": (_LOOKUP_Q, _TWOHOP_Q),
              "echo": ({"city": "which city does {} live in ?", "color": "which color is {} fond of ?",
                        "job": "which job does {} work as ?", "boss": "who does {} report to ?"},
                       {"city": "which city does the boss of {} live in ?",
                        "color": "which color is the boss of {} fond of ?",
                        "job": "which job does the boss of {} work as ?"})}


def make_question(rng: np.random.Generator, world: World, qtype: str, relation: str | None = None) -> QA:
    """One question of `qtype`; two-hop questions pick a person whose boss lives in another
    document (relation in one document, the target's attribute in another)."""
    people = world.people
    if relation is not None and relation not in world.written:
        raise ValueError(f"make_question: the documents hold no {relation!r} facts (they hold {world.written})")
    if qtype == "two_hop" and "boss" not in world.written:
        raise ValueError(f"make_question: a two-hop question needs the 'boss' facts (the documents hold {world.written})")
    if qtype == "lookup":
        rel = relation or RELATIONS[rng.integers(len(RELATIONS))]
        p = people[rng.integers(len(people))]
        ans = list(people[p.boss].name) if rel == "boss" else [getattr(p, rel)]
        q = _QUESTIONS[world.templates][0][rel].format(" ".join(p.name))
        docs = (p.doc,)
        facts = (world.facts(p)[RELATIONS.index(rel)],)
    elif qtype == "two_hop":
        rel = relation or ("city", "color", "job")[rng.integers(3)]
        cands = [p for p in people if people[p.boss].doc != p.doc]
        if not cands:
            raise ValueError("make_question: no person has a boss in another document (one document?)")
        p = cands[rng.integers(len(cands))]
        ans = [getattr(people[p.boss], rel)]
        q = _QUESTIONS[world.templates][1][rel].format(" ".join(p.name))
        docs = (p.doc, people[p.boss].doc)
        facts = (world.facts(p)[RELATIONS.index("boss")], world.facts(people[p.boss])[RELATIONS.index(rel)])
    else:
        raise ValueError(f"qtype: expected one of {QTYPES}, got {qtype!r}")
    values = [list(people[o.boss].name) if rel == "boss" else [getattr(o, rel)] for o in people]
    return QA(qtype, rel, encode(f"question : {q} answer :"), encode(ans), docs,
              tuple(tuple(encode(f)) for f in facts), sum(v == ans for v in values) / len(values))


def fact_distance(tokens: Sequence[int], qa: QA, at: int) -> int:
    """How far back from position `at` the farthest fact the question needs starts in
    `tokens` (each fact sentence appears once in a world's documents)."""
    toks = list(tokens)
    starts = []
    for f in qa.facts:
        n = len(f)
        hit = next((i for i in range(len(toks) - n + 1) if toks[i:i + n] == list(f)), None)
        if hit is None:
            raise ValueError(f"fact_distance: fact {decode(f)!r} is not in the tokens")
        starts.append(hit)
    return at - min(starts)


def qa_tokens(qa: QA) -> tuple[list[int], list[float]]:
    """Question + answer + <eos> ids and the weight of each token as a *target* (1 for the
    answer span and its <eos>, 0 for the question words)."""
    toks = qa.question + qa.answer + [EOS]
    w = [0.0] * len(qa.question) + [1.0] * (len(qa.answer) + 1)
    return toks, w


# ----------------------------------------------------------------------------- training data
@dataclasses.dataclass(frozen=True)
class Curriculum:
    """Episode sizes: documents per episode drawn from [min_docs, max_docs]; per_doc people
    per document; questions per episode; share of two-hop questions."""

    min_docs: int = 2
    max_docs: int = 10
    per_doc: int = 8
    questions: int = 16
    two_hop: float = 0.5
    facts: tuple[str, ...] = RELATIONS  # the relations the documents state
    asks: tuple[str, ...] = RELATIONS  # the relations asked (lookups; two-hop: its attributes)
    templates: str = "plain"  # the wording of facts and questions (TEMPLATES)
    # associative-recall warm-up (Zoology's multi-query associative recall in this vocabulary):
    # per episode one asked relation; documents state it as "ka lo oslo ."; then asked names are
    # each followed directly by the value ("me ru rome"), no question words; no two-hop
    recall: bool = False

    def __post_init__(self):
        check_templates(self.templates)
        check_relations("Curriculum facts", self.facts)
        check_relations("Curriculum asks", self.asks, self.facts)
        if not 0.0 <= self.two_hop <= 1.0:
            raise ValueError(f"Curriculum two_hop: expected a share in [0, 1], got {self.two_hop}")

    @property
    def two_hop_attrs(self) -> tuple[str, ...]:
        """The attributes a two-hop question may ask (none without the boss facts)."""
        return tuple(a for a in ATTRS if a in self.asks) if "boss" in self.facts else ()


def training_sequence(rng: np.random.Generator, names: Sequence[tuple[str, str]], seq_len: int,
                      cur: Curriculum, other_weight: float = 0.02):
    """One packed training row: episodes (documents, then question/answer pairs) until
    seq_len + 1 tokens are filled, then <pad>. Names are disjoint across the row's episodes.

    Returns (tokens [seq_len + 1] int32, target weights [seq_len] float32): weight 1 for answer
    tokens and their <eos>, `other_weight` for every other real target, 0 for padding. With
    `cur.recall` the episodes are `recall_episode`s (weight 1 on the recalled values).
    """
    total = seq_len + 1
    toks: list[int] = []
    wts: list[float] = []
    pool = list(names)
    order = rng.permutation(len(pool))
    used = 0
    while True:
        left = total - len(toks)
        # ~ tokens per document: "document :" and 5-7 words per fact sentence (a recall episode
        # states one relation per person, as 4-5 words)
        doc_len = 2 + cur.per_doc * (5 if cur.recall else 6 * len(cur.facts))
        max_fit = (left - 4 * 14) // doc_len  # leave room for a few questions
        if used + 2 * cur.per_doc > len(pool):
            break
        if max_fit < max(1, cur.min_docs):
            if toks:  # the row holds episodes already: pad the rest
                break
            max_fit = max(1, cur.min_docs)  # a short row: its smallest episode, if it fits
        hi = min(cur.max_docs, max_fit, (len(pool) - used) // cur.per_doc)
        n_docs = int(rng.integers(min(cur.min_docs, hi), hi + 1))
        sub = [pool[i] for i in order[used:used + n_docs * cur.per_doc]]
        used += n_docs * cur.per_doc
        world = make_world(rng, sub, n_docs, cur.per_doc, cur.facts, cur.templates)
        if cur.recall:
            ep, ew = recall_episode(rng, world, cur, left, other_weight)
            if not ep:
                break
            toks += ep
            wts += ew
            continue
        ep = [t for d in world.docs for t in d]
        ew = [other_weight] * len(ep)
        if len(ep) > left:
            break
        asked = set()
        for _ in range(cur.questions):  # whole question/answer pairs only, while they fit
            qt = "two_hop" if rng.random() < cur.two_hop else "lookup"
            if qt == "two_hop" and (not cur.two_hop_attrs or all(world.people[p.boss].doc == p.doc
                                                                 for p in world.people)):
                qt = "lookup"  # (small worlds) no relation crosses documents, or no boss facts
            pool_rel = cur.asks if qt == "lookup" else cur.two_hop_attrs
            everything = pool_rel == (RELATIONS if qt == "lookup" else tuple(ATTRS))
            for _ in range(8):  # a repeated question could be answered by copying the earlier answer
                rel = None if everything else pool_rel[rng.integers(len(pool_rel))]
                qa = make_question(rng, world, qt, rel)
                if tuple(qa.question) not in asked:
                    break
            else:
                break
            asked.add(tuple(qa.question))
            qt_toks, qt_w = qa_tokens(qa)
            if len(ep) + len(qt_toks) > left:
                break
            ep += qt_toks
            ew += [w if w > 0 else other_weight for w in qt_w]
        toks += ep
        wts += ew
    n_real = len(toks)
    toks += [PAD] * (total - n_real)
    wts += [0.0] * (total - n_real)
    # weights are per target: target j is toks[j + 1]; a row never predicts its first token
    w = np.asarray(wts[1:], np.float32)
    w[n_real - 1:] = 0.0
    return np.asarray(toks, np.int32), w


def recall_episode(rng: np.random.Generator, world: World, cur: Curriculum, room: int,
                   other_weight: float = 0.02, queries: list | None = None) -> tuple[list[int], list[float]]:
    """The world as one associative-recall episode (`Curriculum.recall`): one relation drawn from
    `cur.asks`; each document states every person's value of it as "name value ."; then up to
    `cur.questions` distinct people, each as "name value" with the value weighted 1 (the name
    `other_weight`). Queries are added while the episode fits in `room` tokens; ([], []) when not
    even one does. `queries`: a list to which each query's (target indices predicting its value,
    distance in tokens from its value back to the stated value, in-context chance: the share of
    the world's people with that value) is appended, indices relative to the episode's start."""
    rel = cur.asks[rng.integers(len(cur.asks))]
    people = world.people

    def value(p: Person) -> list[str]:
        return list(people[p.boss].name) if rel == "boss" else [getattr(p, rel)]

    ep, stated = [], {}
    for d in range(len(world.docs)):
        ep += ["document", ":"]
        for k in rng.permutation([i for i, p in enumerate(people) if p.doc == d]):
            stated[int(k)] = len(ep) + len(people[k].name)
            ep += [*people[k].name, *value(people[k]), "."]
    ew = [other_weight] * len(ep)
    for k in rng.choice(len(people), min(cur.questions, len(people)), replace=False):
        name, val = list(people[k].name), value(people[k])
        if len(ep) + len(name) + len(val) > room:
            break
        ep += name
        if queries is not None:
            queries.append((list(range(len(ep) - 1, len(ep) - 1 + len(val))), len(ep) - stated[int(k)],
                            sum(value(o) == val for o in people) / len(people)))
        ep += val
        ew += [other_weight] * len(name) + [1.0] * len(val)
    if 1.0 not in ew:
        return [], []
    return encode(ep), ew


def recall_probe(split: str, n: int, seed: int, cur: Curriculum, seq_len: int):
    """n associative-recall episodes of the split at `cur`'s sizes (documents drawn from
    [cur.min_docs, cur.max_docs], `cur.per_doc` people each), one per row, every person asked
    once: the probe of whether recall reaches facts beyond the sliding window. Returns (tokens
    [n, seq_len + 1] int32, per row the `recall_episode` queries)."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    pool = split_names()[split]
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    cur = dataclasses.replace(cur, recall=True)
    rows, meta = [], []
    for _ in range(n):
        n_docs = int(rng.integers(cur.min_docs, cur.max_docs + 1))
        world = make_world(rng, pool, n_docs, cur.per_doc, cur.facts, cur.templates)
        queries = []
        ep, _ = recall_episode(rng, world, dataclasses.replace(cur, questions=len(world.people)), seq_len + 1,
                               queries=queries)
        if not ep:
            raise ValueError(f"recall_probe: an episode of {n_docs} x {cur.per_doc} does not fit {seq_len} tokens")
        rows.append(np.asarray(ep + [PAD] * (seq_len + 1 - len(ep)), np.int32))
        meta.append(queries)
    return np.stack(rows), meta


def training_batch(rng: np.random.Generator, names, batch: int, seq_len: int, cur: Curriculum,
                   other_weight: float = 0.02):
    rows = [training_sequence(rng, names, seq_len, cur, other_weight) for _ in range(batch)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


# ----------------------------------------------------------------------------- evaluation
@dataclasses.dataclass
class Episode:
    """One evaluation world: its documents and questions (one request per question)."""

    docs: list[list[int]]
    qas: list[QA]


def eval_episodes(split: str, n: int, seed: int, n_docs: int = 10, per_doc: int = 8,
                  questions_per_type: int = 1, facts: Sequence[str] = RELATIONS,
                  asks: Sequence[str] | None = None, templates: str = "plain") -> list[Episode]:
    """n worlds of the split (seeded), each with `questions_per_type` questions of every type
    (relations round-robin). `facts` / `asks` as in `Curriculum` (asks defaults to facts):
    worlds of fewer fact kinds for probing a curriculum stage that has fewer; two-hop
    questions need the boss facts and an asked attribute."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    cur = Curriculum(facts=tuple(facts), asks=tuple(facts if asks is None else asks), templates=templates)
    if cur.two_hop_attrs and n_docs < 2:
        raise ValueError(f"eval_episodes: two-hop questions need at least 2 documents, got n_docs={n_docs} "
                         "(or leave the boss facts out)")
    pool = split_names()[split]
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    out = []
    for e in range(n):
        while True:  # a small world may keep every boss in its own document: no two-hop question; draw again
            world = make_world(rng, pool, n_docs, per_doc, cur.facts, cur.templates)
            if not cur.two_hop_attrs or any(world.people[p.boss].doc != p.doc for p in world.people):
                break
        qas = []
        for k in range(questions_per_type):
            qas.append(make_question(rng, world, "lookup", cur.asks[(e + k) % len(cur.asks)]))
            if cur.two_hop_attrs:
                qas.append(make_question(rng, world, "two_hop", cur.two_hop_attrs[(e + k) % len(cur.two_hop_attrs)]))
        out.append(Episode(world.docs, qas))
    return out


def templates_of(checkpoint) -> str:
    """The wording a checkpoint written by launch/train_quality_model.py was trained on (its
    train_log.json's --templates; "plain" for checkpoints from before the option)."""
    log = pathlib.Path(checkpoint) / "train_log.json"
    t = json.loads(log.read_text()).get("args", {}).get("templates", "plain") if log.is_file() else "plain"
    return check_templates(t)


def teacher_forced_rows(ep: Episode, seq_len: int):
    """An episode laid out as one row for teacher-forced scoring: documents, then each
    question + gold answer + <eos> while they fit. Returns (tokens [seq_len + 1], the questions
    laid out, per question the target indices predicting its answer span and <eos>), or None if
    not even one question fits."""
    toks = [t for d in ep.docs for t in d]
    spans, qas = [], []
    for qa in ep.qas:
        if len(toks) + len(qa.question) + len(qa.answer) + 1 > seq_len + 1:
            break
        toks += qa.question
        start = len(toks) - 1  # target index predicting the first answer token
        toks += qa.answer + [EOS]
        spans.append(list(range(start, start + len(qa.answer) + 1)))
        qas.append(qa)
    if not qas:
        return None
    return np.asarray(toks + [PAD] * (seq_len + 1 - len(toks)), np.int32), qas, spans


# ----------------------------------------------------------------------------- scoring
def normalize(text: str) -> list[str]:
    return text.lower().split()


def exact_match(pred: str, gold: str) -> float:
    return float(normalize(pred) == normalize(gold))


def f1(pred: str, gold: str) -> float:
    """SQuAD-style token F1 over whitespace words."""
    p, g = normalize(pred), normalize(gold)
    if not p or not g:
        return float(p == g)
    common = 0
    rest = list(g)
    for w in p:
        if w in rest:
            rest.remove(w)
            common += 1
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)
