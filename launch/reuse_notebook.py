# %% [markdown]
# # RedKnot-JAX from a notebook: artifacts, then both arms
# Runs as a script (`python launch/reuse_notebook.py`) or cell by cell (`# %%` cells). On the
# embedded tiny random-weight model by default; pass `--checkpoint DIR` for a real one.

# %%
import dataclasses
import time

import numpy as np
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.generate import Engine
from redknot_jax.init import random_model
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.reuse.runtime import ReuseRuntime

try:
    from launch import _cli
except ImportError:  # run as `python launch/reuse_notebook.py`, or a notebook opened in launch/
    import _cli

ap = _cli.parser("RedKnot-JAX from a notebook: artifacts, then both arms (cell by cell: the `# %%` cells).",
                 "reuse_notebook.py", "python launch/reuse_notebook.py")  # README
ap.add_argument("--checkpoint", type=_cli.checkpoint_dir, default=None,
                help="safetensors directory with config.json (default: the tiny random-weight model)")
ap.add_argument("--requests", type=int, default=3, help="requests through both arms, one at a time")
args, _ = ap.parse_known_args()  # known only: a notebook kernel adds its own arguments

# %% load a model (random tiny by default) and a profile
if args.checkpoint:
    model = _cli.load_model(args.checkpoint, jnp.float32)
    cfg = model.cfg
    fingerprint = args.checkpoint
else:
    cfg = config.tiny("mixed")
    model = random_model(cfg, seed=0, dtype=jnp.float32)
    fingerprint = "tiny-random-seed-0"
profile = dataclasses.replace(tiny_profile(cfg.num_layers), budget_override=0.25)
runtime = ReuseRuntime(model, profile, checkpoint_fingerprint=fingerprint)

# %% build artifacts: each document alone at position 0, certified
rng = np.random.default_rng(0)
documents = [rng.integers(2, cfg.vocab_size, n) for n in (48, 40, 36, 44)]
t0 = time.perf_counter()
artifacts = [build_artifact(model, profile, d, checkpoint_fingerprint=fingerprint)
             for d in _cli.progress(documents, desc="build artifacts", unit="doc", leave=False)]
print(f"built {len(artifacts)} artifacts in {time.perf_counter() - t0:.2f}s")

# %% several requests citing the documents in different orders, plus a question: both arms
# through the consumer (each layer one jitted program; hot artifacts packed in a device pool once)
pool = runtime.consumer.pool(artifacts)
for r in range(args.requests):
    order = rng.permutation(len(documents))[:3]
    question = rng.integers(2, cfg.vocab_size, 9)
    req = Request([Segment(documents[j], artifacts[j]) for j in order] + [Segment(question)])
    red = runtime.prefill(req, "redknot", require_reuse=True, pool=pool)
    rec = runtime.prefill(req, "recompute")
    led = red.ledgers.to_dict()
    top_same = int(np.argmax(red.logits[-1]) == np.argmax(rec.logits[-1]))
    print(f"request {r}: order {order.tolist()}, {req.tokens.size} rows, protected "
          f"{red.plan.fraction_protected():.0%} of candidates (budget {red.plan.budget:.0%}), "
          f"top-1 agree {top_same}, head-row saving {led['head_row']['saving']:.1%}, token-row saving "
          f"{led['token_row']['saving']:.1%}, operator saving {led['operator']['total']['saving']:.1%}, "
          f"time redknot {red.seconds:.2f}s / recompute {rec.seconds:.2f}s (jitted per layer; the first "
          f"request compiles)")
print("certification:", runtime.counters.snapshot())

# %% several requests in one jitted call per layer, both arms (`prefill_batch`: requests padded
# to common shapes; the RedKnot arm's attention half vmapped over requests, its MoE over all
# rows of the batch), checked against the one-at-a-time results above
reqs = []
for r in range(max(2, args.requests)):
    order = rng.permutation(len(documents))[:2 + r % 2]
    reqs.append(Request([Segment(documents[j], artifacts[j]) for j in order]
                        + [Segment(rng.integers(2, cfg.vocab_size, 5 + r))]))
for arm in ("redknot", "recompute"):
    runtime.prefill_batch(reqs, arm, pool=pool)  # compile
    t0 = time.perf_counter()
    batch = runtime.prefill_batch(reqs, arm, require_reuse=(arm == "redknot"), pool=pool)
    dt = time.perf_counter() - t0
    one = [runtime.prefill(q, arm, pool=pool) for q in reqs]
    diff = max(float(np.max(np.abs(b.logits - o.logits))) for b, o in zip(batch, one))
    print(f"jitted batch prefill, {arm}: {len(reqs)} requests ({[q.tokens.size for q in reqs]} rows) in "
          f"{dt * 1e3:.1f} ms; max |logit difference| to one at a time {diff:.2e}")

# %% batched generation (`generate_batch`): one batched prefill, then every request decodes as a
# row of one DecodeBatch (a jitted call per layer for all of them per token): greedy tokens equal
# to each request's `generate`
toks, _ = runtime.generate_batch(reqs, 4, pool=pool)
alone = [runtime.generate(q, 4, pool=pool)[0] for q in reqs]
print(f"batched generation of {len(reqs)} requests, 4 tokens each: {toks}; equal to one at a time: {toks == alone}")

# %% the plain engine: batch prefill of raw prompts (no documents), bucketed
engine = Engine(model, capacity=256)
prompts = [np.concatenate(documents[:2]).tolist(), documents[2].tolist()]
engine.prefill(prompts)  # compile
t0 = time.perf_counter()
logits, _ = engine.prefill(prompts)
np.asarray(logits)
print(f"engine batch prefill of {len(prompts)} prompts: {(time.perf_counter() - t0) * 1e3:.1f} ms")
