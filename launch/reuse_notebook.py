# %% [markdown]
# # RedKnot-JAX from a notebook: artifacts, then both arms
# Runs as a script (`python launch/reuse_notebook.py`) or cell by cell (`# %%` cells). On the
# embedded tiny random-weight model by default; pass `--checkpoint DIR` for a real one.

# %%
import argparse
import dataclasses
import time

import numpy as np
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.generate import Engine
from redknot_jax.init import random_model
from redknot_jax.model import Model
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.reuse.runtime import ReuseRuntime
from redknot_jax.weights import load_checkpoint

ap = argparse.ArgumentParser()
ap.add_argument("--checkpoint", default=None)
ap.add_argument("--requests", type=int, default=3)
args, _ = ap.parse_known_args()

# %% load a model (random tiny by default) and a profile
if args.checkpoint:
    cfg = config.ModelConfig.from_json(f"{args.checkpoint}/config.json")
    model = Model(cfg, jnp.float32)
    load_checkpoint(model, cfg, args.checkpoint)
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
artifacts = [build_artifact(model, profile, d, checkpoint_fingerprint=fingerprint) for d in documents]
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

# %% jitted batch prefill of the requests' full token lists (Recomputed arm, bucketed, batched)
engine = Engine(model, capacity=256)
batch = [np.concatenate(documents[:2]).tolist(), documents[2].tolist()]
engine.prefill(batch)  # compile
t0 = time.perf_counter()
logits, _ = engine.prefill(batch)
np.asarray(logits)
print(f"jitted batch prefill of {len(batch)} prompts: {(time.perf_counter() - t0) * 1e3:.1f} ms")
