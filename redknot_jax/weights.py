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
    """A checkpoint that does not fit the model: names the key and what was wrong.

    `key` is the offending hub key when there is one, so a caller that knows which file a key
    came from can name the file too.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


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


# transformers 5.24 `save_pretrained` reverses its load-time renames only partly (spec §7.6):
# most keys come out as "model." + the hub key (experts per expert), `kv_norm` comes out as
# `attn.norm`, and embed / hc_head / norm keep their in-memory names (covered by _HF_NAMES).
_HF_SAVED_KV_NORM = re.compile(r"^model\.layers\.(\d+)\.attn\.norm\.(.+)$")


def _saved_to_hub(key: str) -> str | None:
    mt = _HF_SAVED_KV_NORM.match(key)
    if mt:
        return f"layers.{mt.group(1)}.attn.kv_norm.{mt.group(2)}"
    hub = key.removeprefix("model.")
    probe = hub[: -len(".scale")] + ".weight" if hub.endswith(".scale") else hub
    try:
        hub_target(probe)
    except WeightError:
        return None
    return hub


def hf_to_hub(key: str) -> str:
    """Rename one transformers key to its hub key (`.weight_scale_inv` -> `.scale`).

    Accepts transformers' in-memory names (spec §7.4) and the partly renamed form its
    `save_pretrained` writes (spec §7.6).
    """
    key = re.sub(r"\.weight_scale_inv$", ".scale", key)
    out = _rename(key, 0)
    if out is None:
        out = _saved_to_hub(key)
    if out is None:
        raise WeightError(f"{key}: not a DeepSeek-V4 transformers key", key)
    return out


def hub_to_hf(key: str) -> str:
    """Inverse of `hf_to_hub` for non-expert keys (test fixtures write transformers files)."""
    out = _rename(key, 1)
    if out is None:
        raise WeightError(f"{key}: no transformers name for this hub key", key)
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
    raise WeightError(f"{key}: unexpected checkpoint key (not part of DeepSeek-V4)", key)


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


# How the hub stores each backbone tensor (spec §7.2). FP8 / FP4 tensors come with a `.scale`
# sibling (e8m0; 128 x 128 blocks for FP8, 1 x 32 for the int8-packed FP4 experts).
_HUB_FP8 = {"attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
            "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
            "ffn.shared_experts.w3.weight"}
_HUB_F32 = {"hc_head_fn", "hc_head_base", "hc_head_scale", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
            "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "attn.attn_sink", "attn.compressor.ape",
            "attn.indexer.compressor.ape", "ffn.gate.bias"}


def hub_format(key: str) -> str | None:
    """Storage format of a hub key on the hub: "fp8", "fp4", "bf16", "f32" or "i64" (spec §7.2);
    None for keys the backbone ignores (mtp.*)."""
    tgt = hub_target(key)
    if tgt is None:
        return None
    if tgt.expert is not None:
        return "fp4"
    mt = _LAYER_KEY.match(key)
    sub = mt.group(2) if mt else key
    if sub == "ffn.gate.tid2eid":
        return "i64"
    return "fp8" if sub in _HUB_FP8 else "f32" if sub in _HUB_F32 else "bf16"


def is_transformers_naming(keys) -> bool:
    """Whether a checkpoint's keys use transformers names (else DeepSeek's hub names)."""
    return any(k.startswith("model.") or k == "lm_head.weight" for k in keys)


def is_scale_key(key: str) -> bool:
    return key.endswith(".scale") or key.endswith(".weight_scale_inv")


def scale_key_of(key: str, hf: bool) -> str | None:
    """Name the block scale of `key` would have (hub `.scale`, transformers `.weight_scale_inv`)."""
    if key.endswith(".weight"):
        return key[: -len(".weight")] + (".weight_scale_inv" if hf else ".scale")
    return key + "_scale_inv" if hf else None


def _hub_pieces(key: str, arr: np.ndarray, hf: bool) -> Iterator[tuple[str, np.ndarray]]:
    """The hub tensors one source tensor holds: itself under its hub name, or the per-expert
    slices of a merged transformers expert tensor."""
    mt = _HF_MERGED.match(key) if hf else None
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
    elif not (hf and key.startswith("mtp.")):
        yield (hf_to_hub(key) if hf else key), arr


def plan_hub_tensors(source) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Header-only preview of `iter_hub_tensors`: source key -> the (hub key, shape after
    dequantisation) pairs reading it will yield. Scale siblings are left out.

    `source` has keys() and info(key) with .dtype / .shape (a `ShardedCheckpoint`).
    """
    keys = set(source.keys())
    hf = is_transformers_naming(keys)
    out = {}
    for key in sorted(keys):
        if is_scale_key(key):
            continue
        info = source.info(key)
        shape = list(info.shape)
        if scale_key_of(key, hf) in keys and info.dtype in ("I8", "U8") and shape:
            shape[-1] *= 2  # FP4: two codes per byte along the input dim
        fake = np.broadcast_to(np.zeros((), np.uint8), shape)  # no memory: only shapes are read
        out[key] = [(k, tuple(a.shape)) for k, a in _hub_pieces(key, fake, hf)]
    return out


def read_hub_tensor(source, key: str, hf: bool | None = None,
                    keys: set[str] | None = None) -> list[tuple[str, np.ndarray]]:
    """Read one source tensor (and its `.scale`, dequantising exactly) and return the hub
    tensors it holds (see `iter_hub_tensors`). Thread-safe for a `ShardedCheckpoint`."""
    keys = set(source.keys()) if keys is None else keys
    hf = is_transformers_naming(keys) if hf is None else hf
    arr = source.get(key)
    scale_key = scale_key_of(key, hf)
    if scale_key in keys:
        arr = _dequantize(arr, source.get(scale_key), key)
    return list(_hub_pieces(key, arr, hf))


def iter_hub_tensors(source, keys=None) -> Iterator[tuple[str, np.ndarray]]:
    """(hub key, float/int numpy array) from a checkpoint in hub or transformers naming.

    `source` has keys() and get(key) (a `ShardedCheckpoint`). FP8/FP4 weights with a
    `.scale` sibling are dequantised; merged transformers experts are split per expert.
    `keys` restricts reading to those source keys (default: all, sorted).
    """
    all_keys = set(source.keys())
    hf = is_transformers_naming(all_keys)
    for key in sorted(all_keys) if keys is None else keys:
        if not is_scale_key(key):
            yield from read_hub_tensor(source, key, hf, all_keys)


def _dequantize(arr, scale, key):
    """FP4 experts are int8-packed; everything else scaled is FP8 e4m3."""
    from checkpoints_convert import quant

    if arr.ndim == 3:  # merged transformers experts [e, out, in], one scale grid per expert
        return np.stack([_dequantize(a, s, f"{key}[{e}]") for e, (a, s) in enumerate(zip(arr, scale))])
    if arr.dtype == np.int8:
        return quant.dequant_fp4_blockwise(arr, scale, name=key)
    return quant.dequant_fp8_blockwise(arr, scale, name=key)


def place_tensors(cfg: ModelConfig, model: nnx.Module, tensors: Iterator[tuple[str, np.ndarray]],
                  want: dict[str, tuple[int, ...]] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Check (hub key, array) pairs and turn them into finished parameters.

    Yields (parameter path, numpy array in the parameter's dtype and layout) as soon as a
    parameter is complete; routed experts once every expert has arrived, stacked [e, in, out].
    `want` (hub key -> shape; default every key of the model) limits the check to a subset,
    e.g. one layer. `model` may be abstract (`nnx.eval_shape`). Raises WeightError naming the
    key on an unexpected, duplicate, mis-shaped or non-finite tensor, and after the last pair
    on missing keys.
    """
    leaves = param_leaves(model)
    want = expected_hub_shapes(cfg, model) if want is None else want
    seen: set[str] = set()
    stacks: dict[str, np.ndarray] = {}
    filled: dict[str, int] = {}
    for key, arr in tensors:
        tgt = hub_target(key)
        if tgt is None:
            continue
        if key not in want:
            raise WeightError(f"{key}: unexpected checkpoint key for this config", key)
        if key in seen:
            raise WeightError(f"{key}: appears twice in the checkpoint", key)
        arr = np.asarray(arr)
        if tuple(arr.shape) != want[key]:
            raise WeightError(f"{key}: expected shape {want[key]}, got {tuple(arr.shape)}", key)
        # jnp.issubdtype, not dtype.kind == "f": ml_dtypes' bfloat16 has kind "V".
        if jnp.issubdtype(arr.dtype, jnp.floating) and not np.isfinite(arr).all():
            raise WeightError(f"{key}: NaN or Inf in the checkpoint tensor", key)
        seen.add(key)
        var = leaves[tgt.path]
        dtype = np.dtype(var.get_value().dtype)
        if arr.dtype.kind in "iu" and dtype.kind in "iu" and arr.size and (
                arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
            raise WeightError(f"{key}: values [{arr.min()}, {arr.max()}] do not fit {dtype}", key)
        if tgt.expert is None:
            yield tgt.path, arr.astype(dtype, copy=False)
            continue
        if tgt.path not in stacks:
            stacks[tgt.path] = np.empty(var.shape, dtype)
        stacks[tgt.path][tgt.expert] = arr.astype(dtype, copy=False).T  # cast contiguous, then transpose
        filled[tgt.path] = filled.get(tgt.path, 0) + 1
        if filled[tgt.path] == var.shape[0]:
            yield tgt.path, stacks.pop(tgt.path)
    missing = sorted(set(want) - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(f"missing checkpoint keys: {missing[:5]}{more}", missing[0])


def load_into(model: nnx.Module, cfg: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]],
              put: Callable[[str, np.ndarray], jax.Array] | None = None) -> None:
    """Fill the model's parameters from (hub key, array) pairs; every key checked (see
    `place_tensors`).

    `put(path, array)` places a finished parameter (default: jnp.asarray; the array is already
    in the parameter's dtype); the sharded loader passes one that device_puts into the target
    sharding.
    """
    leaves = param_leaves(model)
    for path, arr in place_tensors(cfg, model, tensors):
        leaves[path].set_value(put(path, arr) if put is not None else jnp.asarray(arr))


def load_checkpoint(model: nnx.Module, cfg: ModelConfig, directory, put=None, progress=None) -> None:
    """Load a safetensors directory (hub or transformers naming; bf16/fp32 or FP8/FP4).
    `progress`: wraps the sorted stored keys as they are read (e.g. a tqdm bar)."""
    from checkpoints_convert.safetensors_io import ShardedCheckpoint

    src = ShardedCheckpoint(directory)
    keys = None if progress is None else progress(sorted(k for k in src.keys() if not is_scale_key(k)))
    load_into(model, cfg, iter_hub_tensors(src, keys), put)
