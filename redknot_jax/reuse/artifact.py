"""Artifact producer (DESIGN §3): a document run alone from position 0, kept per reusable
layer, certified.

Per reusable layer: the packed latent (per-row K=V [L, k], compressed entries, CSA indexer
keys), the projected Local contribution z_L [L, g, o] (Local heads' outputs after inverse
output RoPE through the Local columns of each group's wo_a), the document-local CSA top-k ids
[L, K], the open-window compressor state at the document end (boundary metadata), and a
per-row controller statistic `far` [L] (fp32): the Local heads' mean attention share on
compressed entries, i.e. how much the row's cached Local contribution depends on context
beyond its sliding window, which is what relocation changes; with a profile's
`ffn_rows="restore"` also `ffn` [L, d], the row's canonical FFN sub-layer output (the MoE output
entering mHC post). Per fence layer (`prefix_layers`): the native attention state the document
leaves (K=V rows, entries, open compressor windows `cmp`, indexer keys and state), so the
document can serve as an exact prefix (DESIGN §4; `reuse.prefix`). The certificate's `parts`
name the optional parts held. A reusable layer's arrays are stored in the profile's
`artifact_codec` (`reuse.codec`: dense, or z_L / ffn / the latents' NoPE part in FP8 or NVFP4);
`Artifact.layer(i)` reads one back dense; fence layers' native states stay exact. Held in memory
here; persistence is the store's job.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.generate import bucket
from redknot_jax.pallas import resolve_kernels
from redknot_jax.model import Model
from redknot_jax.reuse import codec
from redknot_jax.reuse.certificate import FORMAT_VERSION, Certificate, TPGeometry, payload_digest, token_digest
from redknot_jax.reuse.profile import RedKnotProfile

PREFIX = "prefix"  # a fence layer's key in `Artifact.stored_layers()`


@dataclasses.dataclass
class Artifact:
    """One document's reusable state, by reusable layer (immutable once built); `prefix_layers`:
    by fence layer, its native attention state (empty for artifacts without the "prefix" part)."""

    tokens: np.ndarray
    layers: dict[int, dict]
    certificate: Certificate
    prefix_layers: dict[int, dict] = dataclasses.field(default_factory=dict)
    _far: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)  # far_mean's
    _digest: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)  # digest()'s

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    def far_mean(self, layers) -> np.ndarray:
        """[length] fp64: the mean of `far` over `layers` (`planner.row_risk`), read from the
        device in one transfer the first time a layer set asks (the artifact is immutable)."""
        key = tuple(layers)
        if key not in self._far:
            far = jax.device_get([self.layers[i]["far"] for i in key])
            self._far[key] = np.mean([np.asarray(a, np.float64) for a in far], axis=0)
        return self._far[key]

    def layer(self, i: int) -> dict:
        """Reusable layer i's arrays dense (`codec.decode_layer`, in the dtype they were produced
        in; top-k ids int32), whatever codec stores them."""
        return codec.dense(self.layers[i])

    def native_state(self, layer: int) -> dict:
        """Layer `layer`'s native attention state (kv, and entries / cmp / idx_entries / idx
        where the layer has them): a fence layer's from `prefix_layers`, a reusable layer's
        from `layers` (dense). KeyError if the artifact holds neither."""
        if layer in self.prefix_layers:
            return self.prefix_layers[layer]
        d = self.layers[layer]  # only the latents decoded (not z_L or ffn)
        return {k: codec.decode(d[k], codec.produced_dtype(d)) if k in codec.LATENTS else d[k]
                for k in ("kv", "entries", "cmp", "idx_entries", "idx") if k in d}

    def stored_layers(self) -> dict[int, dict]:
        """Every layer's arrays as persisted and hashed: reusable layers as they are, a fence
        layer's native state under the key "prefix"."""
        out = {i: self.layers[i] for i in self.layers}
        for i, d in self.prefix_layers.items():
            if i in out:
                raise ValueError(f"Artifact: layer {i} is both reusable and a prefix (fence) layer")
            out[i] = {PREFIX: d}
        return dict(sorted(out.items()))

    @classmethod
    def from_stored(cls, tokens, stored: dict[int, dict], certificate, digest: str | None = None) -> "Artifact":
        """The inverse of `stored_layers`; `digest`: the payload digest of exactly these arrays,
        when the caller has just hashed them (the store's verified load), so `digest()` does not
        hash them again."""
        layers = {i: d for i, d in stored.items() if PREFIX not in d}
        prefix = {i: d[PREFIX] for i, d in stored.items() if PREFIX in d}
        art = cls(tokens=tokens, layers=layers, certificate=certificate, prefix_layers=prefix)
        art._digest = digest
        return art

    def payload(self) -> dict[str, np.ndarray]:
        """Flat name -> array view used for the checksum (a fence layer's: "0/['prefix']['kv']")."""
        out = {}
        for layer, d in self.stored_layers().items():
            for name, v in jax.tree_util.tree_flatten_with_path(d)[0]:
                out[f"{layer}/{jax.tree_util.keystr(name)}"] = np.asarray(v)
        return out

    def digest(self) -> str:
        """`certificate.payload_digest` of `payload()`, hashed once per artifact object (it is
        immutable once built or loaded, as `far_mean` assumes; a changed copy is a new object):
        certification compares it with the certificate's on every request. A verified load from
        the artifact store hands over the digest it checked (`from_stored`), so a document read
        from disk is hashed once, not again by the runtime."""
        if self._digest is None:
            self._digest = payload_digest(self.payload())
        return self._digest


def profile_parts(profile: RedKnotProfile) -> tuple[str, ...]:
    """The optional artifact parts (`certificate.PARTS`) a consumer of `profile` needs."""
    return ("ffn",) if profile.ffn_rows == "restore" else ()


def single_rank() -> TPGeometry:
    return TPGeometry(tp_size=1, rank=0, channel_ranges=((0, 1),))


def local_head_mask(model: Model, profile: RedKnotProfile) -> np.ndarray:
    """[h] True for Local heads (every head of a group but the profile's Global one)."""
    hpg = model.cfg.heads_per_group
    local = set(profile.local_heads(hpg))
    return np.array([(h % hpg) in local for h in range(model.cfg.num_heads)])


def project_heads(attn, o: jax.Array, heads: np.ndarray) -> jax.Array:
    """wo_a applied to the chosen heads only (others zeroed): [t, h, k] -> [t, g, o]."""
    return attn.wo_a_apply((o * jnp.asarray(heads, o.dtype)[None, :, None])[None])[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "block", "cap", "local", "keep", "ffn",
                                             "kernels"))
def _layer(state, x, ids, n_new, *, graphdef, freqs, block, cap, local, keep, ffn, kernels):
    """One layer of the document's native run and what it keeps: keep "reusable" (K=V, z_L,
    far, entries, states, top-k; with `ffn` the FFN output), "fence" (the native attention
    state only) or "" (nothing)."""
    blk = nnx.merge(graphdef, state)
    cache = blk.attn.init_cache(1, cap, x.dtype)
    if not keep:
        return blk(x, ids, jnp.zeros((1,), jnp.int32), n_new, cache, freqs, block, kernels=kernels)[0], None
    x, c, tr = blk(x, ids, jnp.zeros((1,), jnp.int32), n_new, cache, freqs, block, trace=True, kernels=kernels)
    heads = np.asarray(local)
    d = {"kv": tr["kv"][0]}
    if keep == "reusable":
        d["zl"] = project_heads(blk.attn, tr["o"][0], heads)
        d["far"] = jnp.mean(tr["far"][0][:, heads], axis=-1).astype(jnp.float32)
    if ffn:
        d["ffn"] = tr["ffn"][0]
    if blk.attn.compressor is not None:
        d["entries"] = c["entries"][0]
        d["cmp"] = jax.tree.map(lambda a: a[0], c["cmp"])
    if blk.attn.indexer is not None:
        d["idx_entries"] = c["idx_entries"][0]
        d["idx"] = jax.tree.map(lambda a: a[0], c["idx"])
        if keep == "reusable":
            d["topk"] = tr["topk"][0]
    return x, d


_encode = jax.jit(codec.encode_layer, static_argnames=("codec", "rope_dim"))


def _produce(model: Model, profile: RedKnotProfile, tokens: np.ndarray, kernels: str):
    """The document's run: (reusable layers in the profile's codec, fence layers' native states)."""
    cfg = model.cfg
    n = int(tokens.shape[0])
    width = bucket(n)
    ids = jnp.asarray(np.pad(tokens, (0, width - n)))[None]
    cap = -(-width // cfg.hca_rate) * cfg.hca_rate
    x = model.embed_streams(ids)
    n_new = jnp.full((1,), n, jnp.int32)
    local = tuple(bool(v) for v in local_head_mask(model, profile))
    reusable = set(profile.reusable_layers(cfg.num_layers))
    ffn = "ffn" in profile_parts(profile)
    layers, prefix = {}, {}
    for i, blk in enumerate(model.layers):  # one jitted program per distinct layer structure
        graphdef, state = nnx.split(blk)
        keep = "reusable" if i in reusable else "fence"
        x, d = _layer(state, x, ids, n_new, graphdef=graphdef, freqs=model.freqs(i), block=min(256, width),
                      cap=cap, local=local, keep=keep, ffn=keep == "reusable" and ffn, kernels=kernels)
        m = blk.attn.compressor.m if blk.attn.compressor is not None else 1
        cut = {"kv": n, "zl": n, "far": n, "topk": n, "ffn": n, "entries": n // m}
        if blk.attn.indexer is not None:
            cut["idx_entries"] = n // blk.attn.indexer.m
        d = {k: (v[: cut[k]] if k in cut else v) for k, v in d.items()}
        if keep == "reusable":
            layers[i] = d if profile.artifact_codec == "dense" else _encode(
                d, codec=profile.artifact_codec, rope_dim=cfg.rope_dim)
        else:
            prefix[i] = d
    return layers, prefix


def stored_bytes(cfg, profile: RedKnotProfile, n: int, dtype=jnp.bfloat16) -> dict:
    """What an artifact of an n-token document holds, by shape alone (the producer traced on an
    abstract model of `cfg` in `dtype`: no weights, nothing computed; any size, Flash's
    included): {"reusable": bytes of the reusable layers (what a pool packs), "prefix": bytes
    of the fence layers' native states, "total", "per_token": total / n}."""
    abstract = nnx.eval_shape(lambda: Model(cfg, dtype))
    graphdef, state = nnx.split(abstract)
    tokens = np.zeros(n, np.int32)
    shapes = jax.eval_shape(lambda st: _produce(nnx.merge(graphdef, st), profile, tokens, ""), state)
    size = lambda tree: int(sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))
    out = {"reusable": size(shapes[0]), "prefix": size(shapes[1])}
    out["total"] = out["reusable"] + out["prefix"]
    out["per_token"] = out["total"] / n
    return out


def build_artifact(model: Model, profile: RedKnotProfile, tokens, *, checkpoint_fingerprint: str,
                   generation: int = 1, tp: TPGeometry | None = None, kernels: str = "auto") -> Artifact:
    """Run `tokens` alone at position 0 and keep what reusable layers need, and every fence
    layer's native attention state (the "prefix" part; with `profile.ffn_rows == "restore"`
    the "ffn" part too), reusable layers in `profile.artifact_codec`. kernels: the Mosaic GPU
    kernels the run uses (`redknot_jax.pallas.resolve_kernels`; "auto": on a GPU those measured
    faster than XLA, as the Recomputed arm runs)."""
    cfg = model.cfg
    tokens = np.asarray(tokens, np.int32)
    if tokens.shape[0] < 1:
        raise ValueError("build_artifact: empty document")
    layers, prefix = _produce(model, profile, tokens, resolve_kernels(kernels, model))
    parts = ("prefix",) + profile_parts(profile)
    tp = tp or single_rank()
    art = Artifact(tokens=tokens, layers=layers, certificate=None, prefix_layers=prefix)
    art._digest = payload_digest(art.payload())  # kept: its certification hashes nothing again (`digest`)
    art.certificate = Certificate(
        checkpoint_fingerprint=checkpoint_fingerprint, token_digest=token_digest(tokens),
        profile_digest=profile.digest(), model_digest=cfg.fingerprint(), tp=tp, generation=generation,
        format_version=FORMAT_VERSION, layers=tuple(sorted(art.stored_layers())), parts=tuple(sorted(parts)),
        codec=profile.artifact_codec, payload_digest=art._digest)
    return art
