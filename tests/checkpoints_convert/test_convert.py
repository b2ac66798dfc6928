"""checkpoints_convert end to end: hub FP8/FP4 safetensors -> Orbax -> sharded restore.

The fixture is a real hub-layout checkpoint: a transformers reference model's random weights,
FP8 e4m3 with 128 x 128 e8m0 scales where the hub uses FP8, int8-packed FP4 routed experts
with 1 x 32 e8m0 scales, BF16 / F32 / I64 elsewhere, several shards and an index file. The
reference logits come from transformers loading those same files with its own FP8/FP4
dequantisation. Every quantised dim is a multiple of 128 (transformers mis-dequantises ragged
blocks, spec §13.1), and the indexer has 16 heads: with 2, exact-zero ReLU ties make top-k
choices differ between implementations (spec §13.6).
"""

import functools
import hashlib
import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from checkpoints_convert import convert as convert_mod
from checkpoints_convert.convert import ConversionError, convert, main, save_model
from checkpoints_convert.restore import RestoreError, restore
from checkpoints_convert.safetensors_io import INDEX_FILE, ShardedCheckpoint, write_safetensors
from launch.make_random_checkpoint import write_hub_checkpoint
from redknot_jax import config
from redknot_jax.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from redknot_jax.model import Model
from redknot_jax.sharding import make_mesh, param_spec
from redknot_jax.weights import iter_hub_tensors, param_leaves
from tests.hf_reference import build_hf, export_hub, hf_logits
from tests.tolerances import TOL, rel_err

CFG = config.tiny(
    "mixed", hidden_size=128, q_lora_rank=128, moe_inter_dim=128, head_dim=128, rope_dim=16, num_heads=8,
    o_groups=2, o_lora_rank=128, index_head_dim=128, index_n_heads=16, num_layers=3,
    layer_types=(SLIDING, CSA, HCA), mlp_layer_types=(HASH_MOE, MOE, MOE))
LENS = (40, 29)  # > 4 * index_topk and > 2 HCA windows; unequal (right padding)
WIDTH, CAPACITY = 48, 64


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, n).tolist() for n in LENS]


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, ids, lens):
    model = nnx.merge(graphdef, state)
    logits, _ = model.forward(ids, jnp.zeros_like(lens), lens, model.init_cache(ids.shape[0], CAPACITY),
                              (lens - 1)[:, None], block=16)
    return logits[:, 0]


def last_logits(model, ps):
    """Each prompt's last-row logits. One jit for every restored model, so models on the same
    mesh share a compilation (the generate Engine compiles per instance)."""
    ids = np.zeros((len(ps), WIDTH), np.int32)
    for i, p in enumerate(ps):
        ids[i, : len(p)] = p
    graphdef, state = nnx.split(model)
    return np.asarray(_prefill(graphdef, state, jnp.asarray(ids), jnp.asarray([len(p) for p in ps], jnp.int32)))


def reference_logits(hf, ps):
    return np.stack([hf_logits(hf, np.array([p]))[0, -1] for p in ps])


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def hub(root):
    """Hub-format FP8/FP4 checkpoint of a random transformers model, plus side files."""
    hf = build_hf(CFG, seed=0)
    plain = export_hub(hf, CFG, str(root / "plain"))  # fp32 hub keys, read back below
    d = write_hub_checkpoint(iter_hub_tensors(ShardedCheckpoint(plain)), CFG.to_hf_dict(), root / "hub",
                             shard_bytes=400_000)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (d / "generation_config.json").write_text('{"do_sample": true, "temperature": 1.0}')
    assert len(list(d.glob("*.safetensors"))) >= 4
    return d


@pytest.fixture(scope="module")
def reference(hub):
    """transformers' own FP8/FP4 loading of the hub files, and its logits."""
    import torch
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    hf, info = DeepseekV4ForCausalLM.from_pretrained(
        str(hub), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32,
        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # transformers 5.17 (the GPU image's) keeps the unquantised bf16 tensors in bf16 despite
    # dtype=float32 and then fails on mixed dtypes; 5.24 casts them. bf16 -> fp32 is exact.
    return reference_logits(hf.float().eval(), prompts())


@pytest.fixture(scope="module")
def converted(hub, root):
    return convert(hub, root / "out32", dtype="float32", progress=False), root / "out32"


@pytest.fixture(scope="module")
def tp1_logits(converted):
    return last_logits(restore(converted[1], mesh=make_mesh(1)), prompts())


# ---------------------------------------------------------------------------- parity and meshes
def test_fp8_fp4_parity_with_transformers(converted, reference, tp1_logits):
    model = restore(converted[1], mesh=make_mesh(1))
    assert model.layers[1].attn.wq_b[...].dtype == jnp.float32
    err = rel_err(tp1_logits, reference)
    assert err <= TOL["parity_fp32"][0], f"converted FP8/FP4 checkpoint vs transformers: rel err {err:.2e}"


def test_restore_into_other_meshes(converted, reference, tp1_logits, root):
    out = converted[1]
    by_tp = {}
    for tp in (2, 8):
        model = restore(out, nnx.eval_shape(lambda: Model(CFG, jnp.float32)), mesh=make_mesh(tp))
        leaves = param_leaves(model)
        want = {"layers.1.attn.wq_b": P("tp"), "layers.1.attn.wo_a": P("tp"), "layers.1.attn.attn_sink": P("tp"),
                "layers.1.attn.indexer.wq_b": P("tp"), "layers.1.attn.wo_b": P(None, "tp"),
                "layers.2.ffn.w1": P("tp"), "layers.2.ffn.w2": P("tp"),
                "embed": P(),  # vocab 97: not divisible, replicated
                "layers.1.attn.wkv": P(), "layers.0.hc_attn.fn": P()}
        for path, spec in want.items():
            arr = leaves[path].get_value()
            assert arr.sharding.spec == spec and arr.sharding.mesh.shape["tp"] == tp, (tp, path, arr.sharding)
            split = [d for d, s in enumerate(spec) if s is not None]
            local = tuple(arr.shape[d] // tp if d in split else arr.shape[d] for d in range(arr.ndim))
            assert {s.data.shape for s in arr.addressable_shards} == {local}, (tp, path)
            assert len(arr.addressable_shards) == tp
        by_tp[tp] = last_logits(model, prompts())
        assert rel_err(by_tp[tp], tp1_logits) <= TOL["resharded_fp32"][0], tp
        assert rel_err(by_tp[tp], reference) <= TOL["parity_fp32"][0], tp
        if tp == 2:  # save from the tp=2 mesh, restore below on tp=8
            save_model(model, root / "from_tp2")
    again = restore(root / "from_tp2", mesh=make_mesh(8))
    assert param_leaves(again)["layers.1.attn.wq_b"].get_value().sharding.spec == P("tp")
    np.testing.assert_array_equal(last_logits(again, prompts()), by_tp[8])


def test_param_spec_table():
    assert param_spec("layers.4.attn.wq_b", (4096, 128), 8) == P("tp")
    assert param_spec("layers.4.attn.indexer.weights_proj", (64, 128), 8) == P("tp")
    assert param_spec("layers.4.attn.wo_b", (128, 1024), 8) == P(None, "tp")
    assert param_spec("layers.4.ffn.w2", (256, 2048, 4096), 8) == P("tp")
    assert param_spec("head", (129280, 4096), 8) == P("tp")
    assert param_spec("layers.4.attn.attn_sink", (12,), 8) == P()  # 12 heads do not split 8 ways
    assert param_spec("layers.4.attn.wkv", (512, 4096), 8) == P()  # the shared K=V latent: replicated
    assert param_spec("layers.4.ffn.s1", (2048, 4096), 8) == P()  # shared expert: replicated
    assert param_spec("layers.4.attn.wq_b", (4096, 128), 1) == P()


def test_bf16_default_is_the_fp32_conversion_rounded(hub, converted, root):
    meta = convert(hub, root / "out16", fingerprint="size_mtime", progress=False)
    assert meta["dtype"] == "bfloat16"
    m16 = param_leaves(restore(root / "out16"))
    m32 = param_leaves(restore(converted[1]))
    pinned = 0
    for path, var in m16.items():
        a16, a32 = np.asarray(var.get_value()), np.asarray(m32[path].get_value())
        if a32.dtype == np.float32 and a16.dtype == np.float32:  # kept fp32 (norms, mHC, sinks, ape, bias)
            pinned += 1
            np.testing.assert_array_equal(a16, a32, err_msg=path)
        elif a16.dtype == np.int32:
            np.testing.assert_array_equal(a16, a32, err_msg=path)
        else:
            assert a16.dtype == ml_dtypes.bfloat16, path
            np.testing.assert_array_equal(a16, a32.astype(ml_dtypes.bfloat16), err_msg=path)
    assert pinned > 20


# ---------------------------------------------------------------------------- metadata, layout, CLI
def test_metadata_and_layout(hub, converted):
    meta, out = converted
    assert (out / "COMPLETE").read_text().strip() == hashlib.sha256((out / "metadata.json").read_bytes()).hexdigest()
    assert json.loads((out / "metadata.json").read_text()) == meta
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hub / name).read_bytes()
    src_files = {p.name for p in hub.glob("*.safetensors")} | {INDEX_FILE, "config.json"}
    assert set(meta["source"]["files"]) == src_files
    for name, digest in meta["source"]["files"].items():
        assert digest == hashlib.sha256((hub / name).read_bytes()).hexdigest(), name
    assert meta["source"]["layout"] == "hub" and meta["source"]["fingerprint_policy"] == "sha256"
    assert meta["converter"]["version"] == convert_mod.CONVERTER_VERSION
    fp8, fp4 = meta["dequantised"]["fp8_e4m3 (128x128 e8m0 scales)"], meta["dequantised"]["fp4_e2m1 (1x32 e8m0 scales)"]
    assert fp8["tensors"] == 3 * 8 + 1 and fp8["keys"]["layers.{i}.attn.indexer.wq_b.weight"] == 1
    assert fp4["tensors"] == 3 * CFG.n_routed_experts * 3
    assert set(meta["items"]) == {"top", "layer_000", "layer_001", "layer_002"}
    assert {p.name for p in (out / "params").iterdir()} == set(meta["items"])
    assert meta["items"]["layer_002"]["params"]["ffn.w1"] == f"float32[{CFG.n_routed_experts}, 128, 128]"
    s = meta["stats"]
    assert s["source_bytes"] == sum(p.stat().st_size for p in hub.glob("*.safetensors")) - sum(
        8 + int.from_bytes(open(p, "rb").read(8), "little") for p in hub.glob("*.safetensors"))
    assert s["source_gb_per_s"] > 0 and s["peak_rss_bytes"] >= s["baseline_rss_bytes"] > 0


def test_cli_refuses_to_overwrite_unless_asked(hub, root, capsys):
    out = root / "cli"
    assert main([str(hub), str(out), "--fingerprint", "size_mtime", "--no-progress"]) == 0
    assert "GB/s" in capsys.readouterr().out
    assert main([str(hub), str(out), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([str(hub), str(out), "--dtype", "float32", "--overwrite", "--no-progress"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["dtype"] == "float32" and meta["source"]["fingerprint_policy"] == "sha256"
    assert [p.name for p in root.iterdir() if p.name.startswith(".cli")] == []  # no temp or old dirs left


def test_restore_refuses_incomplete_or_foreign(converted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(converted[1], out)
    (out / "COMPLETE").unlink()
    with pytest.raises(RestoreError, match="no COMPLETE marker"):
        restore(out)
    shutil.copy(converted[1] / "COMPLETE", out / "COMPLETE")
    meta = json.loads((out / "metadata.json").read_text())
    meta["dtype"] = "float16"
    (out / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(RestoreError, match="does not match the SHA-256"):
        restore(out)
    other = config.tiny("mixed")
    with pytest.raises(RestoreError, match="converted for another config"):
        restore(converted[1], other)


def test_transformers_saved_directory_round_trip(root):
    hf = build_hf(CFG, seed=1)
    hf.save_pretrained(str(root / "hf_saved"))
    meta = convert(root / "hf_saved", root / "hf_out", dtype="float32", fingerprint="size_mtime", progress=False)
    assert meta["source"]["layout"] == "transformers" and meta["dequantised"] == {}
    got = last_logits(restore(root / "hf_out", mesh=make_mesh(1)), prompts(1))
    err = rel_err(got, reference_logits(hf, prompts(1)))
    assert err <= TOL["parity_fp32"][0], f"transformers-saved directory: rel err {err:.2e}"


# ---------------------------------------------------------------------------- bad inputs
def _index(d):
    return json.loads((d / INDEX_FILE).read_text())["weight_map"]


def _rewrite_shard(d, key, edit):
    """Apply edit(tensors dict) to the shard holding `key` and keep the index in step."""
    ck = ShardedCheckpoint(d)
    shard = ck.file_of(key)
    tensors = {k: ck.get(k) for k, f in _index(d).items() if f == shard.name}
    edit(tensors)
    shard.unlink()
    write_safetensors(shard, tensors)
    wm = {k: f for k, f in _index(d).items() if f != shard.name} | {k: shard.name for k in tensors}
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return shard.name


def _missing_shard(d):
    name = _index(d)["layers.1.attn.wq_a.weight"]
    (d / name).unlink()
    return [name, "layers.1.attn.wq_a.weight|is not a file"]


def _truncated(d):
    name = _index(d)["layers.2.attn.wo_b.weight"]
    with open(d / name, "r+b") as f:
        f.truncate(os.path.getsize(d / name) - 100)
    return [name, "truncated"]


def _lying_header(d):
    name = _index(d)["layers.1.ffn_norm.weight"]
    raw = (d / name).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["layers.1.ffn_norm.weight"]["shape"] = [64]  # the data_offsets still span 128 bf16
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n
    (d / name).write_bytes(raw[:8] + blob + b" " * (n - len(blob)) + raw[8 + n:])
    return [name, "layers.1.ffn_norm.weight", "needs 128"]


def _missing_key(d):
    _rewrite_shard(d, "layers.2.attn.wo_b.weight",
                   lambda t: [t.pop("layers.2.attn.wo_b.weight"), t.pop("layers.2.attn.wo_b.scale")])
    return ["layers.2.attn.wo_b.weight: missing"]


def _unexpected_key(d):
    name = _rewrite_shard(d, "layers.0.attn.wq_a.weight",
                          lambda t: t.update({"layers.0.attn.bogus.weight": np.zeros((4, 4), np.float32)}))
    return [name, "layers.0.attn.bogus.weight", "unexpected"]


def _unexpected_for_config(d):  # layer 0 is sliding-only: no indexer
    name = _rewrite_shard(d, "layers.0.attn.wq_a.weight", lambda t: t.update(
        {"layers.0.attn.indexer.weights_proj.weight": np.zeros((16, 128), ml_dtypes.bfloat16)}))
    return [name, "layers.0.attn.indexer.weights_proj.weight", "unexpected checkpoint key for this config"]


def _misshaped_key(d):
    name = _rewrite_shard(d, "layers.1.attn_norm.weight", lambda t: t.update(
        {"layers.1.attn_norm.weight": np.ones((64,), ml_dtypes.bfloat16)}))
    return [name, "layers.1.attn_norm.weight", r"expected shape \(128,\).*got \(64,\)"]


def _nan_after_dequant(d):  # e8m0 byte 255 is NaN: found only when layer 2 is dequantised
    def edit(t):
        s = t["layers.2.attn.wq_b.scale"].view(np.uint8).copy()
        s[1, 0] = 255
        t["layers.2.attn.wq_b.scale"] = s.view(t["layers.2.attn.wq_b.scale"].dtype)

    _rewrite_shard(d, "layers.2.attn.wq_b.scale", edit)
    return [_index(d)["layers.2.attn.wq_b.weight"], "layers.2.attn.wq_b.weight", "non-finite"]


def _inf_in_plain_tensor(d):
    def edit(t):
        w = t["layers.0.attn.q_norm.weight"].copy()
        w[3] = np.inf
        t["layers.0.attn.q_norm.weight"] = w

    name = _rewrite_shard(d, "layers.0.attn.q_norm.weight", edit)
    return [name, "layers.0.attn.q_norm.weight", "NaN or Inf"]


def _config_disagrees(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    return ["config.json disagrees with the tensors", r"model-\d+-of-\d+\.safetensors: layers\.\d+\."]


def _config_has_more_layers(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_hidden_layers=4, layer_types=cfg["layer_types"] + [CSA],
               mlp_layer_types=cfg["mlp_layer_types"] + [MOE])
    (d / "config.json").write_text(json.dumps(cfg))
    return [r"layers\.3\.\*: missing from the checkpoint", "the checkpoint has layers 0..2 but config.json says "
            "num_hidden_layers=4"]


BAD = [_missing_shard, _truncated, _lying_header, _missing_key, _unexpected_key, _unexpected_for_config,
       _misshaped_key, _nan_after_dequant, _inf_in_plain_tensor, _config_disagrees, _config_has_more_layers]


def _assert_nothing_left(parent, out):
    assert not out.exists()
    assert [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.")] == []


@pytest.mark.parametrize("corrupt", BAD, ids=lambda f: f.__name__.strip("_"))
def test_bad_input_is_named_and_leaves_nothing(hub, tmp_path, corrupt):
    src = tmp_path / "src"
    shutil.copytree(hub, src)
    patterns = corrupt(src)
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as err:
        convert(src, out, fingerprint="size_mtime", progress=False)
    for pat in patterns:
        assert re.search(pat, str(err.value)), f"{pat!r} not in:\n{err.value}"
    _assert_nothing_left(tmp_path, out)


def test_interrupted_conversion_leaves_no_loadable_directory(hub, converted, tmp_path, monkeypatch):
    import redknot_jax.weights as weights

    real, calls = weights.place_tensors, []

    def place_then_interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # two layers already handed to Orbax
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(weights, "place_tensors", place_then_interrupt)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(hub, out, fingerprint="size_mtime", progress=False)
    _assert_nothing_left(tmp_path, out)

    # A failed conversion with --overwrite keeps the previous complete output.
    shutil.copytree(converted[1], out)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        convert(hub, out, fingerprint="size_mtime", progress=False, overwrite=True)
    assert convert_mod.is_complete(out) and (out / "params" / "layer_002").is_dir()

    # Killed before it could clean up (rmtree never runs): the temp dir stays but is not loadable.
    calls.clear()
    monkeypatch.setattr(convert_mod.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(KeyboardInterrupt):
        convert(hub, tmp_path / "killed", fingerprint="size_mtime", progress=False)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".killed.tmp-")]
    assert len(left) == 1 and (left[0] / "params" / "layer_000").is_dir()
    assert not (tmp_path / "killed").exists()
    with pytest.raises(RestoreError, match="no COMPLETE marker"):
        restore(left[0], CFG)
