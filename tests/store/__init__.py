"""Shared fixtures of the store tests: synthetic artifacts (the store is content-agnostic, so
most tests need no model), and the builder subprocess used by the fault tests.

`synthetic(seed, n)` has exactly the structure `build_artifact` gives the tiny "mixed"
config (CSA layers 1, 3 with indexer state; HCA layers 2, 4) and a valid certificate for
(tokens, tiny profile, tiny config, FP), so `document_id` / `lookup_for_request` find it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np

from redknot_jax import config
from redknot_jax.reuse.certificate import FORMAT_VERSION, Certificate, TPGeometry, payload_digest, token_digest
from redknot_jax.reuse.profile import tiny_profile

CFG = config.tiny("mixed")
PROFILE = tiny_profile(CFG.num_layers)
FP = "random-seed-7"
REPO = Path(__file__).resolve().parents[2]


def synthetic_layers(rng, n: int, zl_dtype=np.float32) -> dict[int, dict]:
    f = lambda *s: rng.normal(size=s).astype(np.float32)
    layers = {}
    for layer in (1, 2, 3, 4):
        csa = layer in (1, 3)
        m = 4 if csa else 16
        c = 2 * m if csa else m
        d = {"kv": f(n, 32), "zl": f(n, 2, 16).astype(zl_dtype), "far": f(n), "entries": f(n // m, 32),
             "cmp": {"gate": f(c, 64 if csa else 32), "kv": f(c, 64 if csa else 32)}}
        if csa:
            d["idx_entries"] = f(n // 4, 16)
            d["idx"] = {"gate": f(8, 32), "kv": f(8, 32)}
            d["topk"] = rng.integers(-1, n // 4, (n, 4)).astype(np.int32)
        layers[layer] = d
    return layers


def payload_of(layers) -> dict:
    from redknot_jax.store.store import flatten_layers

    return {k: a for k, (_, _, a) in flatten_layers(layers).items()}


def synthetic(seed: int, n: int = 40, tp: TPGeometry | None = None, zl_dtype=np.float32, tokens=None,
              artifact_codec: str = "dense"):
    """An Artifact with random contents and a certificate that matches them (its reusable layers
    in `artifact_codec`, certified for PROFILE with that codec)."""
    from redknot_jax.reuse import codec
    from redknot_jax.reuse.artifact import Artifact, single_rank

    rng = np.random.default_rng(seed)
    toks = np.asarray(tokens if tokens is not None else rng.integers(2, CFG.vocab_size, n), np.int32)
    layers = synthetic_layers(rng, len(toks), zl_dtype)
    if artifact_codec != "dense":
        import jax

        layers = {i: jax.tree.map(np.asarray, codec.encode_layer(d, artifact_codec, CFG.rope_dim))
                  for i, d in layers.items()}
    profile = dataclasses.replace(PROFILE, artifact_codec=artifact_codec)
    cert = Certificate(checkpoint_fingerprint=FP, token_digest=token_digest(toks), profile_digest=profile.digest(),
                       model_digest=CFG.fingerprint(), tp=tp or single_rank(), generation=1,
                       format_version=FORMAT_VERSION, layers=tuple(sorted(layers)), codec=artifact_codec,
                       payload_digest=payload_digest(payload_of(layers)))
    return Artifact(tokens=toks, layers=layers, certificate=cert)


def to_plain(art) -> dict:
    """Picklable without jax/flax (what the builder subprocesses receive)."""
    return {"tokens": np.asarray(art.tokens), "layers": art.layers, "certificate": art.certificate.to_dict()}


# A builder process: imports only numpy + the store, publishes the pickled artifact
# forever (a rebuild each time, so a kill lands in a random phase of a publish), printing
# each generation it made. argv: root, pickle path, on_conflict, loops (0 = forever),
# start_at (wall-clock time to begin, for races).
BUILDER = r"""
import os, pickle, sys, time, types
from redknot_jax.reuse.certificate import Certificate
from redknot_jax.store.store import ArtifactStore
root, path, on_conflict, loops, start_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
d = pickle.load(open(path, "rb"))
art = types.SimpleNamespace(tokens=d["tokens"], layers=d["layers"], certificate=Certificate.from_dict(d["certificate"]))
store = ArtifactStore(root, layer_group_size=2)
print("ready", flush=True)
time.sleep(max(0.0, start_at - time.time() - 0.02))
while time.time() < start_at:  # the last 20 ms spinning, so both builders start together
    pass
i = 0
while loops == 0 or i < loops:
    p = store.publish(art, on_conflict=on_conflict)
    print("published", p.generation, int(p.created), flush=True)
    i += 1
"""


def spawn_builder(root, plain_path, on_conflict="retry", loops=0, start_at=0.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(root), str(plain_path), on_conflict, str(loops),
                             repr(start_at)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(REPO))


def write_plain(art, path) -> Path:
    path = Path(path)
    with open(path, "wb") as f:
        pickle.dump(to_plain(art), f)
    return path
