"""Session 14's copy check, on the textbook transformer of mqar1.py (`arch=vanilla`): random
tokens, a copy of them at a fixed offset, the copy's tokens scored. Learnt in ~100 steps (2-core
CPU, 2026-12-02), because a head can copy from "24 tokens back" by position alone; binding needs a
match by content, which is what sits on a plateau (docs/quality.md, "Session 18").

    python docs/results/qa_s18/copy_by_position.py
"""
import pathlib
import runpy
import sys

import numpy as np

sys.argv = ["mqar1.py", "zoo", "0", "2", "arch=vanilla"]  # 0 steps: only the definitions
Vanilla = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "qa_s17" / "mqar1.py"))["Vanilla"]
tr = Vanilla()
rng = np.random.default_rng(1)
for s in range(300):
    x = rng.integers(10, 120, (32, 24))
    rows = np.concatenate([x, x, x[:, :1]], 1).astype(np.int32)
    w = np.zeros((32, 48), np.float32)
    w[:, 24:] = 1.0
    st = tr.step(rows, w, 3e-3 * min(1, (s + 1) / 30))
    if s % 50 == 0 or s == 299:
        print(s, "copy ce %.3f accuracy %.3f" % (float(st["answer_ce"]), float(st["span_acc"])), flush=True)
