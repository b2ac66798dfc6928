"""Session 24 check: where the arms' answers differ, by where the needed facts sit in the
request. Regenerates the worlds of an `eval_quality.py` result (split, worlds, sizes, wording and
seed from its JSON and command line), and per variant splits the requests by the position of
the documents holding the needed facts: all in the prefix (offset 0, its artifact exact), or
at least one relocated. Output: where_flips.txt beside this file.
    PYTHONPATH=$PWD python docs/results/qa_s24/where_flips.py RESULT.json [VARIANT ...]   # seconds"""
import json
import re
import sys

from redknot_jax.quality import data as D

res = json.load(open(sys.argv[1]))
arg = lambda name, default: int(m[1]) if (m := re.search(rf"--{name} (\d+)", res["command"])) else default  # noqa: E731
eps = D.eval_episodes(res["split"], res["n_worlds"], seed=arg("seed", 0), n_docs=res["docs_per_request"],
                      per_doc=arg("per-doc", 8), templates=res["templates"])
for variant in sys.argv[2:] or sorted(res["summary"]):
    rows = {}
    for r in (r for r in res["records"] if r["variant"] == variant):
        qa = next(q for q in eps[r["episode"]].qas if q.qtype == r["qtype"])
        where = "prefix only" if all(r["order"].index(d) == 0 for d in qa.docs) else "relocated"
        rows.setdefault((r["qtype"], where), []).append(r)
    print(variant)
    for (qtype, where), rs in sorted(rows.items()):
        n = len(rs)
        print(f"  {qtype:8s} facts in {where:12s} n={n:3d} EM recompute {sum(r['recompute_em'] for r in rs) / n:.3f} "
              f"redknot {sum(r['redknot_em'] for r in rs) / n:.3f} first-token agree {sum(r['first_agree'] for r in rs) / n:.2f}")
