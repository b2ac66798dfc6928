"""Where the QA model (issue 10) answers and where it does not: teacher-forced greedy EM on the
held-out split (`--split val`: the validation split, for choosing between checkpoints) by world
size, by question type and relation, and by the distance from the answer back to the farthest
fact it needs, in buckets of the model's sliding window (beyond it, only compressed entries
reach a fact). Beside each EM, the in-context chance (`data.QA.chance`): what a model scores that emits the asked type's
value of a random person of the world, i.e. knows the format and the vocabulary but not which
fact belongs to whom.

    python launch/qa_diagnose.py --checkpoint redknot_jax/assets/qa_model          # CPU, ~3 min
    python launch/qa_diagnose.py --checkpoint DIR --sizes 2x1,2x4 --episodes 8 --json out.json
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

import numpy as np

from redknot_jax.quality import data as D
from redknot_jax.quality.train import TrainConfig, Trainer, load_model, teacher_forced_scores

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402

WINDOWS = (0, 1, 2, 4, 8)  # bucket edges in sliding windows: inside, 1-2 windows back, 2-4, 4-8, beyond


def bucket(d: int, window: int) -> str:
    """The distance bucket of d tokens back, in rows, edges at multiples of the model's window."""
    if d < 0:
        raise ValueError(f"distance {d} < 0")
    edges = [w * window for w in WINDOWS]
    for a, b in zip(edges, edges[1:]):
        if a <= d < b:
            return f"[{a},{b})"
    return f">={edges[-1]}"


def _order(group: str, name: str):
    """Sort key of a result row: distance buckets by their lower edge, the rest by name."""
    if group == "distance":
        qtype, span = name.split(" ", 1)
        return group, qtype, int(span.strip("[>=").split(",")[0])
    return group, name, 0


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/qa_diagnose.py --checkpoint redknot_jax/assets/qa_model "
                                        "--split val --sizes 3x4,12x8,32x4 --json /tmp/diag.json")  # docs/quality.md
    ap.add_argument("--checkpoint", required=True, type=_cli.checkpoint_dir)
    ap.add_argument("--sizes", default="2x1,2x2,2x4,3x8,9x8", help="worlds as DOCSxPEOPLE_PER_DOC")
    ap.add_argument("--episodes", type=int, default=32, help="test worlds per size (4 questions per type each)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--split", default="test", choices=D.SPLITS,
                    help="test: the held-out figures to report; val: for choosing between checkpoints")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        ap.error(f"--sizes: expected DOCSxPEOPLE_PER_DOC pairs of positive integers, e.g. 2x1,9x8, got {a.sizes!r}")
    tr = Trainer(load_model(a.checkpoint), TrainConfig(block=512))
    window = tr.cfg.sliding_window
    templates = D.templates_of(a.checkpoint)  # the wording the model was trained on
    out = {"checkpoint": a.checkpoint, "split": a.split, "templates": templates, "episodes": a.episodes, "sizes": {}}
    for n_docs, per_doc in _cli.progress(sizes, desc="world sizes", unit="size"):
        recs = []
        eps = D.eval_episodes(a.split, a.episodes, seed=1000, n_docs=n_docs, per_doc=per_doc, questions_per_type=4,
                              templates=templates)
        teacher_forced_scores(tr, eps, a.seq_len, 8, records=recs)
        groups = collections.defaultdict(list)
        for r in recs:
            hit = (r["em"], r["chance"])
            groups[("relation", f"{r['qtype']}/{r['relation']}")].append(hit)
            groups[("distance", f"{r['qtype']} {bucket(r['distance'], window)}")].append(hit)
            groups[("type", r["qtype"])].append(hit)
        res = {f"{k[0]}: {k[1]}": {"n": len(v), "em": round(float(np.mean([h[0] for h in v])), 3),
                                   "chance": round(float(np.mean([h[1] for h in v])), 3)}
               for k, v in sorted(groups.items(), key=lambda kv: _order(*kv[0]))}
        out["sizes"][f"{n_docs}x{per_doc}"] = {"people": n_docs * per_doc, "em": res}
        _cli.echo(f"{n_docs}x{per_doc} ({n_docs * per_doc} people)")
        for k, v in res.items():
            _cli.echo(f"  {k:32s} n={v['n']:4d} EM {v['em']:.3f} (in-context chance {v['chance']:.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
