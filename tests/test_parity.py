"""Parity with the PyTorch reference (transformers' DeepseekV4ForCausalLM), fp32.

The reference's random weights reach the project only through hub-layout safetensors read
by the project's loader. Three tiny configs together cover sliding, CSA and HCA layers,
hash and learned MoE layers, mHC with 4 and 2 streams, YaRN on and off, prompts longer
than 4 x index_topk and than several HCA windows, batches of unequal lengths.
"""

import functools
import json

import numpy as np
import pytest
import jax.numpy as jnp
from safetensors.numpy import load_file, save_file

from redknot_jax import config, generate
from redknot_jax.config import ModelConfig
from redknot_jax.generate import Engine, SamplingParams
from redknot_jax.model import Model
from redknot_jax.weights import load_checkpoint
from tests.hf_reference import build_hf, export_hub, hf_generate_logits, hf_logits
from tests.tolerances import TOL, rel_err

KINDS = ["mixed", "hca2", "csa"]
LENS = (100, 77)  # > 4 * index_topk, > several HCA windows (16), unequal (right padding)


@functools.lru_cache(maxsize=None)
def fixture(kind: str, tmp_root: str):
    cfg = config.tiny(kind)
    hf = build_hf(cfg, seed=KINDS.index(kind))
    d = export_hub(hf, cfg, f"{tmp_root}/{kind}")
    if kind == "mixed":  # DeepSeek's own config.json form, whose compress_ratios give an HCA rate of 16, not 128
        with open(f"{d}/config.json", "w") as f:
            json.dump(cfg.to_hub_dict(), f)
    read = ModelConfig.from_json(f"{d}/config.json")  # what a user's checkpoint directory says
    assert read == cfg, kind
    model = Model(read, jnp.float32)
    load_checkpoint(model, cfg, d)
    return cfg, hf, model, d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hub"))


def prompts(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, cfg.vocab_size, n).tolist() for n in LENS]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_all_rows(kind, root):
    cfg, hf, model, _ = fixture(kind, root)
    ps = prompts(cfg)
    eng = Engine(model, capacity=256, block=32)
    rows = np.stack([np.minimum(np.arange(max(LENS)), n - 1) for n in LENS])
    ours, _ = eng.prefill(ps, rows=rows)
    ours = np.asarray(ours)
    tol = TOL["parity_fp32"][0]
    for i, p in enumerate(ps):
        ref = hf_logits(hf, np.array([p]))[0]
        errs = [rel_err(ours[i, t], ref[t]) for t in range(len(p))]
        assert max(errs) <= tol, f"{kind} prompt {i}: worst row {int(np.argmax(errs))} rel err {max(errs):.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps(kind, root):
    """Prefill then 8 greedy decode steps, each step's logits against transformers' cache."""
    cfg, hf, model, _ = fixture(kind, root)
    ps = prompts(cfg, seed=1)
    eng = Engine(model, capacity=256, block=32)
    gen = eng.generate(ps, SamplingParams(max_new_tokens=9))
    tol = TOL["parity_fp32"][0]
    for i, p in enumerate(ps):
        ref_logits, ref_toks = hf_generate_logits(hf, np.array([p]), steps=8)
        assert gen.tokens[i][:8] == ref_toks[0].tolist(), f"{kind} prompt {i}: greedy tokens differ"
        assert rel_err(gen.first_logits[i], ref_logits[0, 0]) <= tol
    # step-by-step logits through the engine's decode, against the reference
    logits, cache = eng.prefill(ps)
    refs = [hf_generate_logits(hf, np.array([p]), steps=8) for p in ps]
    for step in range(8):
        toks = np.array([refs[i][1][0, step] for i in range(len(ps))])
        logits, cache = eng.decode(toks, cache)
        for i in range(len(ps)):
            err = rel_err(np.asarray(logits[i]), refs[i][0][0, step + 1])
            assert err <= tol, f"{kind} prompt {i} decode step {step}: rel err {err:.2e}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_prefill_equals_one_shot(kind, chunk, root, monkeypatch):
    cfg, hf, model, _ = fixture(kind, root)
    ps = prompts(cfg, seed=2)
    eng = Engine(model, capacity=256, block=16)
    one, c1 = eng.prefill(ps)
    chk, c2 = eng.prefill(ps, chunk=chunk)
    assert rel_err(chk, one) <= TOL["chunked_vs_oneshot"][0]
    # and the caches continue identically
    nxt = np.asarray(jnp.argmax(one, -1))
    d1, _ = eng.decode(nxt, c1)
    d2, _ = eng.decode(nxt, c2)
    assert rel_err(d2, d1) <= TOL["chunked_vs_oneshot"][0]
    ref = np.stack([hf_logits(hf, np.array([p]))[0, -1] for p in ps])
    assert rel_err(chk, ref) <= TOL["parity_fp32"][0]
    # one prompt alone: its last layer computes the outputs of its last row's query block only
    # (model.output_block); the same logits, and a cache that decodes the same
    outs = []
    block_jit = generate.block_jit
    monkeypatch.setattr(generate, "block_jit", lambda *a, **k: outs.append(k["rows"]) or block_jit(*a, **k))
    solo, c3 = eng.prefill(ps[:1], chunk=None if chunk == 16 else 64)
    assert outs[cfg.num_layers - 1::cfg.num_layers] == [16] * (len(outs) // cfg.num_layers) and not any(
        outs[k] for k in range(len(outs)) if k % cfg.num_layers != cfg.num_layers - 1)
    assert rel_err(solo[0], ref[0]) <= TOL["parity_fp32"][0]
    d3, _ = eng.decode(nxt[:1], c3)
    assert rel_err(d3[0], d1[0]) <= TOL["chunked_vs_oneshot"][0]


def test_negative_control_perturbed_weight(root, tmp_path):
    """A 1% change of one weight matrix must break parity: the comparison can fail."""
    cfg, hf, _, d = fixture("mixed", root)
    import json, os, shutil

    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    idx = json.load(open(bad / "model.safetensors.index.json"))["weight_map"]
    key = "layers.3.attn.wo_a.weight"
    f = bad / idx[key]
    tensors = load_file(str(f))
    tensors[key] = tensors[key] * np.float32(1.01)
    os.remove(f)
    save_file(tensors, str(f))
    model = Model(cfg, jnp.float32)
    load_checkpoint(model, cfg, str(bad))
    ps = prompts(cfg)
    logits, _ = Engine(model, capacity=256, block=32).prefill(ps)
    ref = np.stack([hf_logits(hf, np.array([p]))[0, -1] for p in ps])
    assert rel_err(np.asarray(logits), ref) > TOL["negative_control_min"][0]
