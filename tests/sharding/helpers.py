"""Shared pieces of the sharding tests: the tiny model every TP test runs, its inputs, and the
single-process reference run (computed once per pytest process, reused by the multi-host test).

The model is drawn with numpy by the scale rules random models use (`redknot_jax.init.rule`):
`init.random_model` jit-compiles one kernel per parameter shape (about 20 s for this 2-layer model on the shared
2-core CI box), a numpy draw takes milliseconds, and the multi-host worker processes rebuild
the identical model from the seed.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax import config, init
from redknot_jax.config import CSA, HASH_MOE, HCA, MOE
from redknot_jax.model import Model

# Heads 16 / groups 8 / indexer heads 16 / experts 16 / vocab 128: tp = 1, 2, 4, 8 all divide.
# One CSA layer (indexer, overlap compressor) and one HCA layer; one hash-routed and one
# learned-router MoE.
CFG = config.tiny("mixed", num_layers=2, layer_types=(CSA, HCA), mlp_layer_types=(HASH_MOE, MOE),
                  num_heads=16, o_groups=8, index_n_heads=16, n_routed_experts=16, vocab_size=128)
SEED = 5
BATCH, PROMPT, CAPACITY, BLOCK = 2, 32, 64, 16
DECODE_STEPS = 3
# Lower XLA's CPU backend effort: halves compile time (the tests are compile-bound); the
# program's semantics (fp32, highest precision) are unchanged.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def _draw(rng, name: str, shape, n_experts: int) -> np.ndarray:
    kind, a, b = init.rule(name, shape)
    if kind == "experts":
        return np.argsort(rng.random((shape[0], n_experts)), axis=-1)[:, : shape[1]]
    if kind == "uniform":
        return a + b * rng.random(shape)
    return rng.normal(b, a, shape)


def tiny_model(cfg=CFG, seed: int = SEED, dtype=jnp.float32) -> Model:
    """A random `Model` of cfg on the default device, identical in every process for a seed."""
    abstract = nnx.eval_shape(lambda: Model(cfg, dtype))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    rng = np.random.default_rng(seed)
    for path, var in flat:
        val = _draw(rng, str(path[-1]), tuple(var.shape), cfg.n_routed_experts)
        var.set_value(jnp.asarray(val, var.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def inputs():
    """Prompt batch (second row right-padded), logits rows, decode tokens."""
    rng = np.random.default_rng(11)
    ids = rng.integers(2, CFG.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    n_new = np.array([PROMPT, PROMPT - 5], np.int32)
    ids[1, n_new[1]:] = 0
    rows = np.array([[PROMPT - 1, 4], [n_new[1] - 1, 0]], np.int32)
    decode = rng.integers(2, CFG.vocab_size, (DECODE_STEPS, BATCH)).astype(np.int32)
    return ids, n_new, rows, decode


def run_steps(forward, cache, ids, n_new, rows, decode):
    """Prefill then decode steps through `forward(ids, pos0, n_new, cache, rows)`: returns
    ([prefill logits, step logits...] as numpy, final cache)."""
    b = ids.shape[0]
    logits, cache = forward(ids, np.zeros(b, np.int32), n_new, cache, rows)
    out = [np.asarray(logits)]
    length = n_new.copy()
    for tok in decode:
        logits, cache = forward(tok[:, None], length, np.ones(b, np.int32), cache, np.zeros((b, 1), np.int32))
        out.append(np.asarray(logits))
        length = length + 1
    return out, cache


@functools.lru_cache(maxsize=None)
def single_rank_engine():
    """`TPForward` at tp = 1: one device, no collective (the tp = 1 test shows its prefill is
    bit-identical to the unsharded `Model.forward`)."""
    from redknot_jax.sharding import make_mesh
    from redknot_jax.sharding.tp import TPForward
    return TPForward(tiny_model(), make_mesh(1), block=BLOCK, compiler_options=COMPILER_OPTIONS)


@functools.lru_cache(maxsize=None)
def reference_run():
    """The single-process run on `inputs()` (prefill + decode steps at tp = 1): (logits list,
    cache). Computed once per pytest process; the multi-host test compares against it."""
    f = single_rank_engine()
    ids, n_new, rows, decode = inputs()
    return run_steps(f.forward, f.init_cache(BATCH, CAPACITY), ids, n_new, rows, decode)


def unsharded_prefill():
    """`Model.forward` itself (jitted, one device) on the prompt batch: logits."""
    model = tiny_model()
    graphdef, state = nnx.split(model)

    def fwd(state, ids, pos0, n_new, rows):
        m = nnx.merge(graphdef, state)
        return m.forward(ids, pos0, n_new, m.init_cache(BATCH, CAPACITY), rows, block=BLOCK)[0]

    ids, n_new, rows, _ = inputs()
    return np.asarray(jax.jit(fwd, compiler_options=COMPILER_OPTIONS)(state, ids, np.zeros(BATCH, np.int32),
                                                                        n_new, rows))


# ---------------------------------------------------------------------------- artifacts
FINGERPRINT = "tiny-tp-seed-5"
PROFILE_DIGEST = "ab" * 32  # any profile: the agreement only compares digests
REQUIRED_LAYERS = (0, 1)


def expectation(min_generation: int = 1):
    from redknot_jax.sharding.agree import Expectation
    return Expectation(PROFILE_DIGEST, CFG.fingerprint(), FINGERPRINT, min_generation, REQUIRED_LAYERS)


def whole_artifact(tokens, generation: int = 1, seed: int = 0):
    """A whole (tp = 1) artifact laid out as `reuse.artifact.build_artifact` lays one out
    (per reusable layer: K=V rows, z_L [L, g, o], the `far` row statistic, compressed entries,
    top-k ids), with random
    contents: certification reads the certificate and the bytes, not their meaning."""
    from redknot_jax.reuse.artifact import Artifact
    from redknot_jax.reuse.certificate import FORMAT_VERSION, Certificate, payload_digest, token_digest
    from redknot_jax.sharding.agree import tp_geometry

    rng = np.random.default_rng(seed)
    tokens = np.asarray(tokens, np.int32)
    n = tokens.size
    layers = {i: {"kv": rng.normal(size=(n, CFG.head_dim)).astype(np.float32),
                  "zl": rng.normal(size=(n, CFG.o_groups, CFG.o_lora_rank)).astype(np.float32),
                  "far": rng.uniform(size=n).astype(np.float32),
                  "entries": rng.normal(size=(n // CFG.csa_rate, CFG.head_dim)).astype(np.float32),
                  "topk": rng.integers(-1, n // CFG.csa_rate, (n, CFG.index_topk)).astype(np.int32)}
              for i in REQUIRED_LAYERS}
    art = Artifact(tokens=tokens, layers=layers, certificate=None)
    art.certificate = Certificate(
        checkpoint_fingerprint=FINGERPRINT, token_digest=token_digest(tokens), profile_digest=PROFILE_DIGEST,
        model_digest=CFG.fingerprint(), tp=tp_geometry(CFG, 1, 0), generation=generation,
        format_version=FORMAT_VERSION, layers=REQUIRED_LAYERS, payload_digest=payload_digest(art.payload()))
    return art


def rank_segments(tokens, slices, rank: int, new_rows=(5, 6, 7)):
    """A request as rank `rank` sees it: one document (its slice) then new rows."""
    from redknot_jax.reuse.planner import Segment
    return [Segment(np.asarray(tokens, np.int32), slices[rank]), Segment(np.asarray(new_rows, np.int32))]


def assert_trees_close(got, want, key: str = "resharded_fp32") -> None:
    """Every leaf of `got` within the tolerance table's bound `key` of `want`'s, by the table's
    measure (`rel_err`: relative L2 over the whole leaf); the same tree structure and leaf shapes.
    chex names the first leaf that is not (its path in the tree)."""
    import chex

    from tests.tolerances import TOL, rel_err

    bound = TOL[key][0]
    chex.assert_trees_all_equal_shapes(got, want)
    chex.assert_trees_all_equal_comparator(
        lambda a, b: rel_err(a, b) <= bound, lambda a, b: f"rel err {rel_err(a, b):.2e} > {bound} ({key})", got, want)
