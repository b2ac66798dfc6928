"""Artifact codecs (DESIGN §3; issue #47): how a reusable layer's rows are stored (in the store,
in host memory and in the documents' pool) and read back where they are consumed.

* "dense": the arrays as the producer made them (the model's dtype); top-k ids int32.
* "fp8": z_L, the FFN output `ffn`, and the NoPE part of the K=V rows and of the compressed
  entries in FP8 e4m3 with a power-of-two (e8m0) scale per block of a row (128 values, or the
  largest divisor of the row that divides 128: 64 for Flash's 448 NoPE columns), as
  DeepSeek-V4 scales its activations; top-k ids at the narrowest integer width.
* "fp4": as "fp8", but z_L and `ffn` in NVFP4: e2m1 codes, two per byte, an e4m3 scale per
  16 values and an fp32 scale per row (per row and output group for z_L).

In every codec the RoPE part of a latent (its trailing `rope_dim` columns), the indexer keys,
the compressor states and the controller statistic `far` stay as produced. An encoded field is
a dict of arrays (the store, the payload digest and the pools treat it as any nested payload);
every array keeps the field's leading axes (rows, then z_L's output group), so the pools
concatenate documents and shard z_L by group without knowing the codec:

    FP8   {"e4m3": float8_e4m3fn [..., n], "e8m0": uint8 [..., n / block]}
    NVFP4 {"e2m1": uint8 [..., n / 2], "e4m3": float8_e4m3fn [..., n / 16], "fp32": float32 [..., 1]}
    RoPE split {"nope": FP8 form of [..., n - r], "rope": [..., r] as produced}

`decode_layer` turns a layer back into dense arrays; the consumer calls it inside each jitted
layer program on the pool's layer, so XLA fuses the dequantisation into the gathers that read
the rows and no dense copy of a document set exists outside one layer's program.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import jax
import jax.numpy as jnp

from checkpoints_convert.quant import FP4_E2M1_MAX, FP4_E2M1_TABLE, FP8_E4M3_MAX
from redknot_jax.reuse.certificate import CODECS
FP8_BLOCK = 128  # values per e8m0 scale (at most)
FP4_BLOCK = 16  # values per e4m3 scale (NVFP4)
_E8M0_BIAS = 127
# |v| -> e2m1 magnitude code 0..7 (0, .5, 1, 1.5, 2, 3, 4, 6): the midpoints between the values
_E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
LATENTS = ("kv", "entries")  # split into an FP8 NoPE part and an exact RoPE part
# field -> the form it takes in each compact codec
_COMPACT = {"fp8": {"zl": "fp8", "ffn": "fp8"}, "fp4": {"zl": "fp4", "ffn": "fp4"}}


class CodecError(ValueError):
    """An unknown codec, or a field whose shape the codec cannot hold (the message names it)."""


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise CodecError(f"artifact codec: expected one of {CODECS}, got {codec!r}")
    return codec


# ------------------------------------------------------------------------------ FP8 (e4m3, e8m0)
def _pow2(e: jax.Array) -> jax.Array:
    """2^e exactly for integer e in [-126, 127] (float32 bits)."""
    return jax.lax.bitcast_convert_type((e + _E8M0_BIAS).astype(jnp.uint32) << 23, jnp.float32)


def encode_fp8(x: jax.Array) -> dict:
    """[..., n] -> e4m3 values with the smallest power-of-two scale per block that keeps the
    block's largest magnitude within e4m3's 448."""
    n = x.shape[-1]
    b = math.gcd(n, FP8_BLOCK)
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], n // b, b)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / FP8_E4M3_MAX
    mant, ex = jnp.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1): ceil(log2 amax) exactly
    e = jnp.clip(jnp.where(mant == 0.5, ex - 1, ex), -126, 127)
    e = jnp.where(amax > 0, e, -126)
    q = jnp.clip(xb / _pow2(e), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return {"e4m3": q.reshape(x.shape), "e8m0": (e[..., 0] + _E8M0_BIAS).astype(jnp.uint8)}


def decode_fp8(d: Mapping, dtype) -> jax.Array:
    q, s = d["e4m3"], d["e8m0"]
    n, nb = q.shape[-1], s.shape[-1]
    v = q.astype(jnp.float32).reshape(*q.shape[:-1], nb, n // nb) * _pow2(s.astype(jnp.int32) - _E8M0_BIAS)[..., None]
    return v.reshape(q.shape).astype(dtype)


# ------------------------------------------------------------------------------ NVFP4
def encode_fp4(x: jax.Array) -> dict:
    """[..., n] (n a multiple of 16) -> NVFP4: per row an fp32 scale mapping the row's largest
    magnitude to 6 x 448, per 16 values an e4m3 scale, e2m1 codes (low nibble first)."""
    n = x.shape[-1]
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], n // FP4_BLOCK, FP4_BLOCK)
    bmax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)  # [..., n/16, 1]
    g = jnp.max(bmax, axis=-2, keepdims=True) / (FP4_E2M1_MAX * FP8_E4M3_MAX)  # [..., 1, 1]
    g = jnp.where(g > 0, g, 1.0)
    s = jnp.clip(bmax / FP4_E2M1_MAX / g, 0, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    eff = s.astype(jnp.float32) * g
    v = jnp.clip(jnp.where(eff > 0, xb / jnp.where(eff > 0, eff, 1.0), 0.0), -FP4_E2M1_MAX, FP4_E2M1_MAX)
    code = jnp.searchsorted(jnp.asarray(_E2M1_MID, jnp.float32), jnp.abs(v)).astype(jnp.uint8)
    code = (code | jnp.where(v < 0, 8, 0).astype(jnp.uint8)).reshape(*x.shape[:-1], n // 2, 2)
    return {"e2m1": code[..., 0] | (code[..., 1] << 4), "e4m3": s[..., 0], "fp32": g[..., 0, :]}


def decode_fp4(d: Mapping, dtype) -> jax.Array:
    p, s, g = d["e2m1"], d["e4m3"], d["fp32"]
    table = jnp.asarray(FP4_E2M1_TABLE, jnp.float32)
    v = jnp.stack([table[p & 15], table[p >> 4]], axis=-1).reshape(*p.shape[:-1], s.shape[-1], FP4_BLOCK)
    v = v * (s.astype(jnp.float32) * g)[..., None]
    return v.reshape(*p.shape[:-1], 2 * p.shape[-1]).astype(dtype)


# ------------------------------------------------------------------------------ fields, layers
def decode(v, dtype) -> jax.Array:
    """One field, encoded or dense, as a dense `dtype` array."""
    if not isinstance(v, Mapping):
        return jnp.asarray(v).astype(dtype)
    if "nope" in v:
        return jnp.concatenate([decode(v["nope"], dtype), jnp.asarray(v["rope"]).astype(dtype)], axis=-1)
    if "e2m1" in v:
        return decode_fp4(v, dtype)
    if "e8m0" in v:
        return decode_fp8(v, dtype)
    raise CodecError(f"artifact codec: not an encoded field (keys {sorted(v)})")


def take(v, idx):
    """Rows `idx` (any integer array, indices into the leading axis) of a field, encoded or
    dense, in the same form: every array of an encoded field keeps the rows as its leading axis."""
    return jax.tree.map(lambda a: jnp.asarray(a)[idx], v)


def rows(v, idx, dtype=None) -> jax.Array:
    """Rows `idx` of a field as a dense array: gathered encoded, then decoded (so only the rows
    read are dequantised, never the whole pool). `dtype`: default the field's own (a dense
    field's, or the exact RoPE part's of a latent); required for z_L and `ffn` in a compact codec."""
    if dtype is None:
        if isinstance(v, Mapping) and "rope" not in v:
            raise CodecError("artifact codec: rows of an encoded field without an exact part need a dtype")
        dtype = (v["rope"] if isinstance(v, Mapping) else v).dtype
    return decode(take(v, idx), dtype)


def topk_dtype(entries: int):
    """The narrowest signed integer holding entry ids below `entries` and the pad -1."""
    return jnp.int16 if entries <= np.iinfo(np.int16).max + 1 else jnp.int32


def encode_layer(d: Mapping, codec: str, rope_dim: int) -> dict:
    """One reusable layer's arrays (`build_artifact`'s form) in `codec` (fields the codec does
    not name are kept as they are)."""
    if check_codec(codec) == "dense":
        return dict(d)
    out = dict(d)
    for name, form in _COMPACT[codec].items():
        if name in d:
            n = d[name].shape[-1]
            if form == "fp4" and n % FP4_BLOCK:
                raise CodecError(f"artifact codec {codec!r}: field {name!r} has {n} columns, "
                                 f"not a multiple of the NVFP4 block {FP4_BLOCK}")
            out[name] = encode_fp4(d[name]) if form == "fp4" else encode_fp8(d[name])
    for name in LATENTS:
        if name in d:
            x = d[name]
            if not 0 < rope_dim < x.shape[-1]:
                raise CodecError(f"artifact codec {codec!r}: field {name!r} has {x.shape[-1]} columns, "
                                 f"rope_dim {rope_dim} leaves no NoPE part")
            out[name] = {"nope": encode_fp8(x[..., :-rope_dim]), "rope": x[..., -rope_dim:]}
    if "topk" in d:
        entries = d["entries"].shape[0] if "entries" in d else np.iinfo(np.int32).max
        out["topk"] = jnp.asarray(d["topk"]).astype(topk_dtype(entries))
    return out


def decode_layer(d: Mapping, dtype) -> dict:
    """A layer in any codec with its latents, z_L and `ffn` dense in `dtype` and top-k ids int32
    (the other fields as they are): what the consumer's layer programs and the eager reference
    read."""
    out = dict(d)
    for name in LATENTS + ("zl", "ffn"):
        if name in d:
            out[name] = decode(d[name], dtype)
    if "topk" in d:
        out["topk"] = jnp.asarray(d["topk"]).astype(jnp.int32)
    return out


def shape(v) -> tuple[int, ...]:
    """The dense shape of a field, encoded or not."""
    if not isinstance(v, Mapping):
        return tuple(v.shape)
    if "nope" in v:
        return shape(v["nope"])[:-1] + (shape(v["nope"])[-1] + v["rope"].shape[-1],)
    if "e2m1" in v:
        return tuple(v["e2m1"].shape[:-1]) + (2 * v["e2m1"].shape[-1],)
    return tuple(v["e4m3"].shape)


def produced_dtype(layer: Mapping):
    """The dtype a layer's arrays were produced (or packed into a pool) in: its K=V rows', or
    their RoPE part's, which every codec keeps as it is."""
    kv = layer["kv"]
    return (kv["rope"] if isinstance(kv, Mapping) else kv).dtype


def dense(layer: Mapping) -> dict:
    """`decode_layer` in the layer's own dtype (`produced_dtype`): a whole layer (the eager
    reference's; the consumer reads `rows` of a pool instead)."""
    return decode_layer(layer, produced_dtype(layer))
