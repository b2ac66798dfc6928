"""The DeepSeek-V4 backbone as Flax NNX modules, and its chunk-incremental forward.

One code path serves prefill, chunked prefill and decode: `Model.forward(tokens, pos0,
n_new, cache)` runs a chunk of t rows per sequence at absolute positions pos0 + [0, t), of
which the first n_new are real (right padding), and returns the updated cache. Prefill is a
forward from an empty cache; decode is a forward with t = 1.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.graphlib import GraphDef

from redknot_jax.attention import Attention
from redknot_jax.config import SLIDING, ModelConfig
from redknot_jax.indexer import TOPK_STAGES
from redknot_jax.mhc import HyperConnection, HyperHead
from redknot_jax.moe import MoE
from redknot_jax.pallas import kernel_mode
from redknot_jax.norms import RMSNorm
from redknot_jax.rope import inv_freq

HIGHEST = jax.lax.Precision.HIGHEST


class HashedDef(GraphDef):
    """A `GraphDef` whose hash is computed once: flax's walks every node on each use, and a
    jitted program's static graphdef is hashed on every call (43 times a decode step at Flash's
    depth). Equal to an equal `HashedDef`, so programs are shared."""

    __slots__ = ("_hash",)

    def __init__(self, graphdef: GraphDef):
        super().__init__(graphdef.nodes, graphdef.attributes, graphdef.num_leaves)
        object.__setattr__(self, "_hash", GraphDef.__hash__(graphdef))

    def __hash__(self) -> int:
        return self._hash


def split(module) -> tuple[HashedDef, nnx.State]:
    """`nnx.split(module)` with the graphdef a `HashedDef`: what a jitted program per call takes."""
    graphdef, state = nnx.split(module)
    return HashedDef(graphdef), state


def top_split(model: "Model") -> tuple[HashedDef, nnx.State]:
    """`split` of the model's embedding and head parts alone (embedding table, mHC head, final
    norm, LM head): what `embed_jit` and `logits_jit` take, six leaves where the whole model's
    state (1,328 leaves at Flash shapes) would be flattened on every call."""
    return split((model.embed, model.hc_head, model.norm, model.head))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def embed_jit(state, ids, *, graphdef):
    """`Model.embed_streams` over `top_split`'s state."""
    table, hc_head, _, _ = nnx.merge(graphdef, state)
    return embed_streams(table[...], ids, hc_head.hc_base.shape[0])


@functools.partial(jax.jit, static_argnames=("graphdef",))
def logits_jit(state, x, rows, *, graphdef):
    """`Model.logits` over `top_split`'s state."""
    _, hc_head, norm, head = nnx.merge(graphdef, state)
    return lm_head(hc_head, norm, head[...], x, rows)


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "block", "kernels", "topk_stages", "rows"),
                   donate_argnames=("cache",))
def block_jit(state, x, ids, pos0, n_new, cache, row0=0, *, graphdef, freqs, block, kernels="", topk_stages=TOPK_STAGES,
              rows=0):
    """One `Block` (`nnx.split` of it: graphdef static, state) over b chunks x [b, t, n, d] at
    pos0 [b] (n_new [b] real rows) with its cache: (x, new cache). Blocks of equal structure
    share the compiled program, so a stack compiles a few layer programs, not one unrolled one.
    rows > 0: only rows [row0, row0 + rows) come out (`Block.__call__`'s `out`)."""
    return nnx.merge(graphdef, state)(x, ids, pos0, n_new, cache, freqs, block, kernels=kernels,
                                      topk_stages=topk_stages, out=(row0, rows) if rows else None)


def output_block(rows, t: int, block: int) -> tuple[int, int]:
    """(row0, rows) for a last layer (`block_jit`'s row0 / rows) of a call of t rows whose
    only read outputs are at `rows` (any shape; a first token: the prompt's last row): the one
    query block holding them all, or (0, 0), every row, when they span more or t is one block.
    Exact: no later layer reads the other rows' output, and their keys and cache are still
    computed. One block, not a bucket of their span, so a last layer has two programs at most."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    lo = int(rows.min()) // block * block
    return (0, 0) if t <= block or int(rows.max()) >= lo + block else (lo, block)


class Block(nnx.Module):
    """mHC -> attention -> mHC -> MoE (spec §3.3)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        d, n = cfg.hidden_size, cfg.hc_mult
        self.hc_attn = HyperConnection(n, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.hc_ffn = HyperConnection(n, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, dtype)
        self.ffn = MoE(cfg, layer, dtype)
        self.compressed = cfg.layer_types[layer] != SLIDING

    def __call__(self, x, ids, pos0, n_new, cache, freqs, block, trace: bool = False, keep_fn=None,
                 kernels: str = "", topk_stages: int = TOPK_STAGES, out=None):
        """x [b, t, n, d] streams -> (streams, cache[, trace]); see `Attention.__call__`.
        kernels: the Mosaic GPU kernels to run, a comma list of `redknot_jax.pallas.KERNELS`
        ("": the XLA references); the block uses "indexer", "sparse_attention" and "ragged_dot".
        topk_stages: the CSA selection's entry prefixes (`indexer.select_topk_causal`). The
        trace (`Attention.__call__`'s) also holds `ffn`, the FFN sub-layer output [b, t, d].
        `out` (row0, rows): the streams of those rows only ([b, rows, n, d]: the last layer
        when only some rows' logits are read), every row's cache; None: every row."""
        u, post, comb = self.hc_attn.pre(x)
        res = self.attn(self.attn_norm(u), pos0, n_new, cache, freqs, block, trace=trace,
                        kernels=kernel_mode(kernels, "indexer"), sparse=kernel_mode(kernels, "sparse_attention"),
                        topk_stages=topk_stages, out=out)
        a, cache = res[0], res[1]
        if out is not None:
            x, ids, post, comb = (jax.lax.dynamic_slice_in_dim(v, out[0], out[1], axis=1) for v in (x, ids, post, comb))
        x = HyperConnection.post(x, a, post, comb)
        if not trace:
            return self.ffn_residual(x, ids, keep_fn, kernels=kernels), cache
        x, y = self.ffn_residual(x, ids, keep_fn, kernels=kernels, with_out=True)
        return x, cache, {**res[2], "ffn": y}

    def ffn_residual(self, x, ids, keep_fn=None, with_keep: bool = False, kernels: str = "",
                     with_out: bool = False):
        """The MoE half of the block: mHC pre, ffn_norm, MoE (optional fan-out), mHC post.
        With `with_keep`, also the expert keep mask [b, t, k] the MoE applied; with `with_out`
        (last), the MoE output [b, t, d] entering mHC post, in the streams' dtype."""
        u, post, comb = self.hc_ffn.pre(x)
        y, keep = self.ffn(self.ffn_norm(u), ids, keep_fn=keep_fn, with_keep=True,
                           kernels=kernel_mode(kernels, "ragged_dot"))
        x = HyperConnection.post(x, y, post, comb)
        return (x,) + ((keep,) if with_keep else ()) + ((y.astype(x.dtype),) if with_out else ()) \
            if with_keep or with_out else x


def embed_streams(table, ids, n: int):
    """The token embeddings of ids [b, t] copied into the n mHC streams: [b, t, n, d]."""
    e = table[ids]  # [b, t, d]
    return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], n, e.shape[-1]))


def lm_head(hc_head, norm, table, x, rows):
    """mHC head and final norm of rows [b, r] of the streams x, then the LM head `table`
    [vocab, d] (or a rank's vocabulary slice of it): logits [b, r, vocab] fp32."""
    xr = jnp.take_along_axis(x, rows[:, :, None, None], axis=1)  # [b, r, n, d]
    return jnp.einsum("brd,vd->brv", norm(hc_head(xr)), table, preferred_element_type=jnp.float32,
                      precision=HIGHEST)


class Model(nnx.Module):
    """DeepSeek-V4 for causal LM (embedding, blocks, mHC head, norm, LM head)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.bfloat16):
        self.cfg, self.dtype = cfg, dtype
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([Block(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        # static (hashable) so they are constants of the traced program, not state
        self.freqs_main = tuple(float(f) for f in inv_freq(cfg, compressed=False))
        self.freqs_compress = tuple(float(f) for f in inv_freq(cfg, compressed=True))

    def freqs(self, layer: int):
        return self.freqs_compress if self.layers[layer].compressed else self.freqs_main

    def init_cache(self, b: int, capacity: int) -> dict:
        """Empty per-layer caches for b sequences of up to `capacity` positions."""
        if capacity % self.cfg.hca_rate or capacity % self.cfg.csa_rate:
            raise ValueError(f"cache capacity {capacity} must be a multiple of the compress rates "
                             f"{self.cfg.csa_rate} and {self.cfg.hca_rate}")
        return {"length": jnp.zeros((b,), jnp.int32),
                "layers": [blk.attn.init_cache(b, capacity, self.dtype) for blk in self.layers]}

    def embed_streams(self, ids):
        return embed_streams(self.embed[...], ids, self.cfg.hc_mult)

    def logits(self, x, rows):
        """mHC head, final norm and LM head (fp32) for rows [b, r] of the chunk's streams x."""
        return lm_head(self.hc_head, self.norm, self.head[...], x, rows)

    def forward(self, ids, pos0, n_new, cache, rows, block: int = 256, kernels: str = ""):
        """Run a chunk. ids [b, t] int32, pos0/n_new [b] int32, rows [b, r] chunk indices whose
        logits are wanted. Returns (logits [b, r, vocab] fp32, new cache). kernels: a resolved
        Mosaic GPU kernel set (`redknot_jax.pallas.resolve_kernels`; "" = XLA throughout)."""
        t = ids.shape[1]
        block = min(block, t)
        if t % block:
            raise ValueError(f"chunk length {t} must be a multiple of the query block {block}")
        x = self.embed_streams(ids)
        new_layers = []
        for i, blk in enumerate(self.layers):
            x, c = blk(x, ids, pos0, n_new, cache["layers"][i], self.freqs(i), block, kernels=kernels)
            new_layers.append(c)
        return self.logits(x, rows), {"length": pos0 + n_new, "layers": new_layers}
