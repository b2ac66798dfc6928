"""The one key map between checkpoint tensors and the model's parameter tree.

Hub keys (DeepSeek's safetensors layout, spec §7.2) map to parameter paths of `Model`;
transformers keys (spec §7.4) are first renamed to hub keys. Routed experts are stored per
expert in the hub (`ffn.experts.E.w1.weight` [f, d]) and stacked here in the x @ W layout
ragged_dot takes ([e, d, f]); transformers merges them (`gate_up_proj` [e, 2f, d]).

Loading checks every tensor: a missing, unexpected or mis-shaped key is an error naming it.
FP8 / FP4 tensors with a `.scale` sibling are dequantised exactly on the way in.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterator

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.config import ModelConfig


class WeightError(ValueError):
    """A checkpoint that does not fit the model: names the key and what was wrong."""


# hub key (layer index as {i}) -> parameter path below the model; experts handled apart.
_TOP = {
    "embed.weight": "embed", "head.weight": "head", "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
}
_LAYER = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn.fn", "hc_attn_base": "hc_attn.base", "hc_attn_scale": "hc_attn.scale",
    "hc_ffn_fn": "hc_ffn.fn", "hc_ffn_base": "hc_ffn.base", "hc_ffn_scale": "hc_ffn.scale",
    "attn.attn_sink": "attn.attn_sink",
    "attn.wq_a.weight": "attn.wq_a", "attn.q_norm.weight": "attn.q_norm.weight",
    "attn.wq_b.weight": "attn.wq_b", "attn.wkv.weight": "attn.wkv", "attn.kv_norm.weight": "attn.kv_norm.weight",
    "attn.wo_a.weight": "attn.wo_a", "attn.wo_b.weight": "attn.wo_b",
    "attn.compressor.wkv.weight": "attn.compressor.wkv", "attn.compressor.wgate.weight": "attn.compressor.wgate",
    "attn.compressor.ape": "attn.compressor.ape", "attn.compressor.norm.weight": "attn.compressor.norm.weight",
    "attn.indexer.wq_b.weight": "attn.indexer.wq_b",
    "attn.indexer.weights_proj.weight": "attn.indexer.weights_proj",
    "attn.indexer.compressor.wkv.weight": "attn.indexer.compressor.wkv",
    "attn.indexer.compressor.wgate.weight": "attn.indexer.compressor.wgate",
    "attn.indexer.compressor.ape": "attn.indexer.compressor.ape",
    "attn.indexer.compressor.norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn.gate.weight": "ffn.gate", "ffn.gate.bias": "ffn.bias", "ffn.gate.tid2eid": "ffn.tid2eid",
    "ffn.shared_experts.w1.weight": "ffn.s1", "ffn.shared_experts.w3.weight": "ffn.s3",
    "ffn.shared_experts.w2.weight": "ffn.s2",
}
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")

# transformers name <-> hub name (spec §7.4). "{i}" is the layer index; an entry ending in
# "." renames a prefix and keeps the rest (".weight", or ".scale" / ".weight_scale_inv").
_HF_NAMES = [
    ("model.embed_tokens.weight", "embed.weight"), ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"), ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"), ("model.hc_head.hc_scale", "hc_head_scale"),
    ("model.layers.{i}.input_layernorm.", "layers.{i}.attn_norm."),
    ("model.layers.{i}.post_attention_layernorm.", "layers.{i}.ffn_norm."),
    ("model.layers.{i}.attn_hc.fn", "layers.{i}.hc_attn_fn"),
    ("model.layers.{i}.attn_hc.base", "layers.{i}.hc_attn_base"),
    ("model.layers.{i}.attn_hc.scale", "layers.{i}.hc_attn_scale"),
    ("model.layers.{i}.ffn_hc.fn", "layers.{i}.hc_ffn_fn"),
    ("model.layers.{i}.ffn_hc.base", "layers.{i}.hc_ffn_base"),
    ("model.layers.{i}.ffn_hc.scale", "layers.{i}.hc_ffn_scale"),
    ("model.layers.{i}.self_attn.sinks", "layers.{i}.attn.attn_sink"),
    ("model.layers.{i}.self_attn.q_a_proj.", "layers.{i}.attn.wq_a."),
    ("model.layers.{i}.self_attn.q_a_norm.", "layers.{i}.attn.q_norm."),
    ("model.layers.{i}.self_attn.q_b_proj.", "layers.{i}.attn.wq_b."),
    ("model.layers.{i}.self_attn.kv_proj.", "layers.{i}.attn.wkv."),
    ("model.layers.{i}.self_attn.kv_norm.", "layers.{i}.attn.kv_norm."),
    ("model.layers.{i}.self_attn.o_a_proj.", "layers.{i}.attn.wo_a."),
    ("model.layers.{i}.self_attn.o_b_proj.", "layers.{i}.attn.wo_b."),
    ("model.layers.{i}.self_attn.compressor.indexer.q_b_proj.", "layers.{i}.attn.indexer.wq_b."),
    ("model.layers.{i}.self_attn.compressor.indexer.scorer.weights_proj.", "layers.{i}.attn.indexer.weights_proj."),
    ("model.layers.{i}.self_attn.compressor.indexer.kv_proj.", "layers.{i}.attn.indexer.compressor.wkv."),
    ("model.layers.{i}.self_attn.compressor.indexer.gate_proj.", "layers.{i}.attn.indexer.compressor.wgate."),
    ("model.layers.{i}.self_attn.compressor.indexer.position_bias", "layers.{i}.attn.indexer.compressor.ape"),
    ("model.layers.{i}.self_attn.compressor.indexer.kv_norm.", "layers.{i}.attn.indexer.compressor.norm."),
    ("model.layers.{i}.self_attn.compressor.kv_proj.", "layers.{i}.attn.compressor.wkv."),
    ("model.layers.{i}.self_attn.compressor.gate_proj.", "layers.{i}.attn.compressor.wgate."),
    ("model.layers.{i}.self_attn.compressor.position_bias", "layers.{i}.attn.compressor.ape"),
    ("model.layers.{i}.self_attn.compressor.kv_norm.", "layers.{i}.attn.compressor.norm."),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.ffn.gate.weight"),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.ffn.gate.bias"),
    ("model.layers.{i}.mlp.gate.tid2eid", "layers.{i}.ffn.gate.tid2eid"),
    ("model.layers.{i}.mlp.shared_experts.gate_proj.", "layers.{i}.ffn.shared_experts.w1."),
    ("model.layers.{i}.mlp.shared_experts.up_proj.", "layers.{i}.ffn.shared_experts.w3."),
    ("model.layers.{i}.mlp.shared_experts.down_proj.", "layers.{i}.ffn.shared_experts.w2."),
]
_HF_MERGED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _rename(key: str, src: int) -> str | None:
    for pair in _HF_NAMES:
        a, b = pair[src], pair[1 - src]
        rx = "^" + re.escape(a).replace(r"\{i\}", r"(?P<i>\d+)") + ("(?P<rest>.+)$" if a.endswith(".") else "$")
        mt = re.match(rx, key)
        if mt:
            return b.replace("{i}", mt.groupdict().get("i") or "") + (mt.group("rest") if a.endswith(".") else "")
    return None


def hf_to_hub(key: str) -> str:
    """Rename one transformers key to its hub key (`.weight_scale_inv` -> `.scale`)."""
    key = re.sub(r"\.weight_scale_inv$", ".scale", key)
    out = _rename(key, 0)
    if out is None:
        raise WeightError(f"{key}: not a DeepSeek-V4 transformers key")
    return out


def hub_to_hf(key: str) -> str:
    """Inverse of `hf_to_hub` for non-expert keys (test fixtures write transformers files)."""
    out = _rename(key, 1)
    if out is None:
        raise WeightError(f"{key}: no transformers name for this hub key")
    return re.sub(r"\.scale$", ".weight_scale_inv", out)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one hub tensor lands: a parameter path, and an expert slot for routed experts."""

    path: str
    expert: int | None = None


def hub_target(key: str) -> Target | None:
    """Parameter target of a hub key; None for keys the backbone ignores (mtp.*)."""
    if key.startswith("mtp."):
        return None
    if key in _TOP:
        return Target(_TOP[key])
    mt = _EXPERT.match(key)
    if mt:
        return Target(f"layers.{mt.group(1)}.ffn.{mt.group(3)}", int(mt.group(2)))
    mt = _LAYER_KEY.match(key)
    if mt and mt.group(2) in _LAYER:
        return Target(f"layers.{mt.group(1)}.{_LAYER[mt.group(2)]}")
    raise WeightError(f"{key}: unexpected checkpoint key (not part of DeepSeek-V4)")


def param_leaves(model: nnx.Module) -> dict[str, nnx.Variable]:
    """Every loadable variable of the model by dotted path."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        out[".".join(str(p) for p in path)] = var
    return out


def expected_hub_shapes(cfg: ModelConfig, model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Hub key -> the shape the checkpoint must hold (experts per expert, [out, in])."""
    shapes = {}
    leaves = param_leaves(model)
    for hub, path in _TOP.items():
        shapes[hub] = tuple(leaves[path].shape)
    for i in range(cfg.num_layers):
        for sub, path in _LAYER.items():
            p = f"layers.{i}.{path}"
            if p in leaves:
                shapes[f"layers.{i}.{sub}"] = tuple(leaves[p].shape)
        for e in range(cfg.n_routed_experts):
            for w in ("w1", "w3", "w2"):
                s = leaves[f"layers.{i}.ffn.{w}"].shape
                shapes[f"layers.{i}.ffn.experts.{e}.{w}.weight"] = (s[2], s[1])
    return shapes


def iter_hub_tensors(source) -> Iterator[tuple[str, np.ndarray]]:
    """(hub key, float/int numpy array) from a checkpoint in hub or transformers naming.

    `source` has keys() and get(key) (a `ShardedCheckpoint`). FP8/FP4 weights with a
    `.scale` sibling are dequantised; merged transformers experts are split per expert.
    """
    from checkpoints_convert import quant

    keys = set(source.keys())
    hf = any(k.startswith("model.") or k == "lm_head.weight" for k in keys)
    for key in sorted(keys):
        if key.endswith(".scale") or key.endswith(".weight_scale_inv"):
            continue
        mt = _HF_MERGED.match(key) if hf else None
        arr = source.get(key)
        scale_key = (key[: -len(".weight")] + (".weight_scale_inv" if hf else ".scale")) if key.endswith(
            ".weight") else (key + "_scale_inv" if hf else None)
        if scale_key in keys:
            arr = _dequantize(quant, arr, source.get(scale_key), key)
        if mt:
            i, kind = mt.groups()
            if kind == "gate_up_proj":  # [e, 2f, d]: gate rows first
                f = arr.shape[1] // 2
                for e in range(arr.shape[0]):
                    yield f"layers.{i}.ffn.experts.{e}.w1.weight", arr[e, :f]
                    yield f"layers.{i}.ffn.experts.{e}.w3.weight", arr[e, f:]
            else:
                for e in range(arr.shape[0]):
                    yield f"layers.{i}.ffn.experts.{e}.w2.weight", arr[e]
            continue
        if hf and key.startswith("mtp."):
            continue
        yield (hf_to_hub(key) if hf else key), arr


def _dequantize(quant, arr, scale, key):
    """FP4 experts are int8-packed; everything else scaled is FP8 e4m3."""
    if arr.dtype == np.int8:
        return quant.dequant_fp4_blockwise(arr, scale, name=key)
    return quant.dequant_fp8_blockwise(arr, scale, name=key)


def load_into(model: nnx.Module, cfg: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]],
              put: Callable[[str, np.ndarray], jax.Array] | None = None) -> None:
    """Fill the model's parameters from (hub key, array) pairs; every key checked.

    `put(path, array)` places a finished parameter (default: jnp.asarray in the parameter's
    dtype); the sharded loader passes one that device_puts into the target sharding.
    """
    leaves = param_leaves(model)
    want = expected_hub_shapes(cfg, model)
    seen: set[str] = set()
    stacks: dict[str, np.ndarray] = {}
    filled: dict[str, int] = {}
    for key, arr in tensors:
        tgt = hub_target(key)
        if tgt is None:
            continue
        if key not in want:
            raise WeightError(f"{key}: unexpected checkpoint key for this config")
        if key in seen:
            raise WeightError(f"{key}: appears twice in the checkpoint")
        if tuple(arr.shape) != want[key]:
            raise WeightError(f"{key}: expected shape {want[key]}, got {tuple(arr.shape)}")
        seen.add(key)
        var = leaves[tgt.path]
        if tgt.expert is None:
            _assign(var, tgt.path, np.asarray(arr), put)
            continue
        if tgt.path not in stacks:
            stacks[tgt.path] = np.zeros(var.shape, np.float32)
        stacks[tgt.path][tgt.expert] = np.asarray(arr, np.float32).T
        filled[tgt.path] = filled.get(tgt.path, 0) + 1
        if filled[tgt.path] == cfg.n_routed_experts:
            _assign(var, tgt.path, stacks.pop(tgt.path), put)
    missing = sorted(set(want) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(f"missing checkpoint keys: {missing[:5]}{more}")


def _assign(var: nnx.Variable, path: str, arr: np.ndarray, put) -> None:
    if arr.dtype.kind == "f" and not np.all(np.isfinite(np.asarray(arr, np.float32))):
        raise WeightError(f"{path}: NaN or Inf in the checkpoint tensor")
    if put is not None:
        var.set_value(put(path, arr))
    else:
        var.set_value(jnp.asarray(arr, dtype=var.get_value().dtype))


def load_checkpoint(model: nnx.Module, cfg: ModelConfig, directory, put=None) -> None:
    """Load a safetensors directory (hub or transformers naming; bf16/fp32 or FP8/FP4)."""
    from checkpoints_convert.safetensors_io import ShardedCheckpoint

    load_into(model, cfg, iter_hub_tensors(ShardedCheckpoint(directory)), put)
