"""One line per variant of a ladder log (docs/results/qa_s18/ladder.sh): steps run, the first
step whose span accuracy (last `every` steps) passes 0.6, and the last one.

    python docs/results/qa_s18/summarize.py docs/results/qa_s18/ladder2_h200.log
"""
import collections
import re
import sys

runs, name = collections.defaultdict(list), None
for line in open(sys.argv[1]):
    if line.startswith("== "):
        name = line.split()[1]
        continue
    m = re.search(r" (\d+) (\d+)s answer_ce ([\d.]+) span_acc ([\d.]+) \(last \d+\) chance ([\d.]+)", line)
    if m:
        runs[name].append((int(m[1]), float(m[4]), float(m[5])))
for name, v in runs.items():
    first = next((s for s, acc, _ in v if acc > 0.6), None)
    print(f"{name:22s} steps {v[-1][0]:6d}  chance {v[-1][2]:.2f}  span_acc > 0.6 from step {first}  "
          f"last {v[-1][1]:.2f}")
