"""Write a random DeepSeek-V4 checkpoint in the hub layout (FP8 / FP4 with e8m0 scales).

The layout is DeepSeek's (spec §7.2): per-expert keys, FP8 e4m3 weights with 128 x 128 e8m0
`.scale` blocks, int8-packed FP4 routed experts with 1 x 32 e8m0 scales, BF16 / F32 / I64
elsewhere, several shards and a `model.safetensors.index.json`. `config.json` carries the
hub's `quantization_config` and `expert_dtype: fp4` so transformers dequantises it too.

Used by the converter's tests (`write_hub_checkpoint`, fed the weights of a transformers
reference model) and, as a script, to make a checkpoint of a chosen size for the converter's
throughput figure (docs/converter.md):

    python launch/make_random_checkpoint.py /tmp/rand_ckpt --layers 8 --hidden 1024 \\
        --experts 16 --moe-inter 1024 --shard-mb 100
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from checkpoints_convert import quant
from checkpoints_convert.safetensors_io import INDEX_FILE, write_safetensors
from redknot_jax.weights import hub_format

# The hub's quantisation settings (spec §1.1); expert_dtype is copied into it by transformers.
HUB_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                    "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def hub_encode(key: str, w: np.ndarray, quantize: bool = True) -> dict[str, np.ndarray]:
    """The stored tensors of one hub key given its float value: the key in its hub format,
    plus `<name>.scale` for FP8 / FP4 (when `quantize`)."""
    fmt = hub_format(key)
    if fmt in ("fp8", "fp4") and quantize:
        q, s = (quant.quantize_fp8_blockwise if fmt == "fp8" else quant.quantize_fp4_blockwise)(w)
        return {key: q, key[: -len(".weight")] + ".scale": s}
    if fmt == "i64":
        return {key: np.asarray(w, np.int64)}
    if fmt == "f32":
        return {key: np.asarray(w, np.float32)}
    return {key: np.asarray(w, np.float32).astype(ml_dtypes.bfloat16)}


def write_hub_checkpoint(tensors: Iterable[tuple[str, np.ndarray]], config: Mapping, directory,
                         shard_bytes: int = 2 << 30, quantize: bool = True) -> Path:
    """Write (hub key, float32 value) pairs as a sharded hub checkpoint in `directory`.

    Tensors are encoded as the hub stores them (`hub_encode`) and written in arrival order;
    a shard is closed once it holds `shard_bytes`, so memory stays at about one shard. A key
    and its `.scale` always share a shard. `config` (a config.json dict) gets the hub's
    `quantization_config` and `expert_dtype: fp4` when `quantize`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    total = 0

    def flush():
        nonlocal pending
        if pending:
            name = f"part-{len(shards):05d}.safetensors"
            write_safetensors(directory / name, pending)
            shards.append(sorted(pending))
            pending = {}

    for key, w in tensors:
        enc = hub_encode(key, w, quantize)
        pending.update(enc)
        total += sum(a.nbytes for a in enc.values())
        if sum(a.nbytes for a in pending.values()) >= shard_bytes:
            flush()
    flush()
    # Final names follow the hub's model-0000i-of-0000n pattern, known only once all are written.
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(directory / f"part-{i:05d}.safetensors", directory / name)
        weight_map.update({k: name for k in keys})
    with open(directory / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config = dict(config)
    if quantize:
        config.update(quantization_config=dict(HUB_QUANTIZATION), expert_dtype="fp4")
    with open(directory / "config.json", "w") as f:
        json.dump(config, f, indent=1)
    return directory


def random_hub_tensors(cfg, seed: int = 0) -> Iterable[tuple[str, np.ndarray]]:
    """Random float32 values for every hub key of `cfg`, layer by layer (shapes from the model)."""
    import jax.numpy as jnp
    from flax import nnx

    from redknot_jax.model import Model
    from redknot_jax.weights import expected_hub_shapes

    abstract = nnx.eval_shape(lambda: Model(cfg, jnp.bfloat16))
    rng = np.random.default_rng(seed)
    for key, shape in sorted(expected_hub_shapes(cfg, abstract).items(), key=lambda kv: _layer_order(kv[0])):
        if key.endswith("tid2eid"):
            yield key, np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=-1)[:, : shape[1]]
        elif "norm" in key or key.endswith("_scale"):
            yield key, 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
        else:
            yield key, rng.standard_normal(shape, np.float32) / np.float32(math.sqrt(shape[-1]))


def _layer_order(key: str):
    parts = key.split(".")
    return (int(parts[1]), key) if parts[0] == "layers" else (-1, key)


def main(argv=None):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from launch import _cli
    from redknot_jax import config as config_lib

    p = _cli.parser(__doc__, __file__,  # docs/converter.md
                    "python launch/make_random_checkpoint.py /tmp/rand_ckpt --layers 8 --hidden 1024 --experts 16 "
                    "--moe-inter 1024 --shard-mb 100")
    p.add_argument("out", help="directory to write")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--moe-inter", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--shard-mb", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    # Flash's layer pattern (two sliding layers, then CSA / HCA alternating), its head_dim,
    # ranks and indexer, with the width, depth and expert count from the flags.
    types = ["sliding_attention"] * min(2, a.layers) + [
        ("compressed_sparse_attention", "heavily_compressed_attention")[i % 2] for i in range(a.layers - 2)]
    cfg = config_lib.flash(
        vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
        q_lora_rank=min(1024, a.hidden), o_groups=max(1, a.heads // 8), n_routed_experts=a.experts,
        moe_inter_dim=a.moe_inter, layer_types=tuple(types),
        mlp_layer_types=tuple(["hash_moe"] * min(3, a.layers) + ["moe"] * max(0, a.layers - 3)))
    tensors = _cli.progress(random_hub_tensors(cfg, a.seed), desc="write tensors", unit="tensor")
    out = write_hub_checkpoint(tensors, cfg.to_hub_dict(), a.out, shard_bytes=a.shard_mb << 20)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: {len(list(out.glob('*.safetensors')))} shards, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
