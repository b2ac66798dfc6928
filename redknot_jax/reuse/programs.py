"""The consumer's jitted layer programs (DESIGN §7): layers with equal structure share one
compiled program (the nnx graph definition is a static argument), so the 43-layer flash stack
compiles a few layer programs instead of one unrolled program. Each merges its layer's state
and runs the math of `layer.py` (a reusable layer: single request, keeping what decoding reads,
a batch), `decode.py` (a decode step, alone or of a `DecodeBatch`) or the model's (a native
layer, embedding, head), and the controller's scores and latent deviation
(`Consumer.controller`)."""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.indexer import TOPK_STAGES
from redknot_jax.pallas.indexer_scores import index_scores
from redknot_jax.reuse import codec
from redknot_jax.reuse.decode import decode_attention, decode_entries
from redknot_jax.reuse.layer import ffn_args, reusable_attention, reusable_ffn, reusable_layer
from redknot_jax.reuse.planner import latent_deviation
from redknot_jax.rope import apply_rope


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "block", "cap", "kernels", "topk_stages", "rows"))
def native_jit(state, x, ids, n_real, row0=0, *, graphdef, freqs, block, cap, kernels="", topk_stages=TOPK_STAGES,
               rows=0):
    """One native layer over a batch of b padded requests (n_real [b] real rows each); rows > 0:
    only rows [row0, row0 + rows) come out (`Block.__call__`'s `out`)."""
    blk = nnx.merge(graphdef, state)
    b = x.shape[0]
    cache = blk.attn.init_cache(b, cap, x.dtype)
    x, _ = blk(x, ids, jnp.zeros((b,), jnp.int32), n_real, cache, freqs, block, kernels=kernels,
               topk_stages=topk_stages, out=(row0, rows) if rows else None)
    return x


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "glob", "block", "fan", "kernels", "topk_stages",
                                             "ffn_rows", "longest_doc"))
def reusable_jit(state, x, ids, tab, pool_layer, *, graphdef, freqs, glob, block, fan, kernels,
                 topk_stages=TOPK_STAGES, ffn_rows="run", longest_doc=None):
    """A reusable layer of one request (`layer.reusable_layer`)."""
    blk = nnx.merge(graphdef, state)
    return reusable_layer(blk, x, ids, tab, pool_layer, freqs=freqs, glob=np.asarray(glob), block=block, fan=fan,
                          kernels=kernels, topk_stages=topk_stages, ffn_rows=ffn_rows, longest_doc=longest_doc)


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "glob", "block", "fan", "kernels", "topk_stages",
                                             "ffn_rows", "longest_doc"))
def reusable_keys_jit(state, x, ids, tab, pool_layer, keep_rows, *, graphdef, freqs, glob, block, fan, kernels,
                      topk_stages=TOPK_STAGES, ffn_rows="run", longest_doc=None):
    """`reusable_jit` that also returns what decoding reads of rows `keep_rows` (see
    `reusable_attention`)."""
    blk = nnx.merge(graphdef, state)
    x, keys = reusable_attention(blk, x, tab, pool_layer, freqs=freqs, glob=np.asarray(glob), block=block,
                                 keep_rows=keep_rows, kernels=kernels, topk_stages=topk_stages,
                                 longest_doc=longest_doc)
    x, hist = reusable_ffn(blk, x, ids, tab["pos"] < tab["n_real"], fan, kernels=kernels,
                           **ffn_args(ffn_rows, tab, pool_layer))
    return x, hist, keys


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "glob", "block", "fan", "kernels", "topk_stages",
                                             "ffn_rows", "longest_doc"))
def reusable_batch_jit(state, x, ids, tab, pool_layer, keep_rows=None, *, graphdef, freqs, glob, block, fan,
                       kernels="", topk_stages=TOPK_STAGES, ffn_rows="run", longest_doc=None):
    """A reusable layer over a batch x [b, t, n, d]: the attention half request by request in
    one loop (`lax.map`; tables stacked on a leading axis, one shared pool), each request the
    single-request program's (`reusable_attention` with the kernels and the staged causal
    top-k, which `vmap` would forbid: a request of thousands of rows fills the device alone),
    then the MoE half once over the batch's rows that run it (tokens are independent there).
    Returns (x, histogram per request), and with `keep_rows` [b, R] what decoding reads of
    those compact rows, per request (`reusable_keys_jit`)."""
    blk = nnx.merge(graphdef, state)

    def one(args):
        xx, tt, kr = args
        out = reusable_attention(blk, xx[None], tt, pool_layer, freqs=freqs, glob=np.asarray(glob), block=block,
                                 keep_rows=kr, kernels=kernels, topk_stages=topk_stages, longest_doc=longest_doc)
        return (out[0][0], out[1]) if kr is not None else (out[0], None)

    x, keys = jax.lax.map(one, (x, tab, keep_rows))
    x, hist = reusable_ffn(blk, x, ids, tab["pos"] < tab["n_real"][:, None], fan, kernels=kernels, per_request=True,
                           **ffn_args(ffn_rows, tab, pool_layer))
    return (x, hist) if keep_rows is None else (x, hist, keys)


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "fan", "kernels"), donate_argnames=("keys",))
def reusable_step_jit(state, x, ids, tab, pool_layer, keys, t0, *, graphdef, freqs, fan, kernels=""):
    """A reusable layer for new rows over the cached keys (`decode_attention`, which writes
    them in place), then the MoE (XLA: `kernels` reaches the attention only)."""
    blk = nnx.merge(graphdef, state)
    x, keys = decode_attention(blk, x, tab, pool_layer, keys, t0, freqs=freqs, kernels=kernels)
    x, _ = reusable_ffn(blk, x, ids, jnp.ones(x.shape[1], bool), fan)
    return x, keys


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "fan"), donate_argnames=("keys",))
def reusable_step_batch_jit(state, x, ids, tabs, pool_layer, keys, t0, *, graphdef, freqs, fan):
    """`reusable_step_jit` for the members of a `DecodeBatch`: x [b, 1, n, d] (a new row each),
    their decode layouts `tabs` and compact rows `keys` stacked on a leading axis, t0 [b]: the
    attention vmapped over them (XLA), the MoE once over the b rows."""
    blk = nnx.merge(graphdef, state)

    def one(xx, tt, kk, t):
        y, kk = decode_attention(blk, xx[None], tt, pool_layer, kk, t, freqs=freqs)
        return y[0], kk

    x, keys = jax.vmap(one)(x, tabs, keys, t0)
    b = x.shape[0]
    y, _ = reusable_ffn(blk, x.reshape((1, b) + x.shape[2:]), ids.reshape(1, b), jnp.ones(b, bool), fan)
    return y.reshape(x.shape), keys


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs"))
def decode_entries_jit(state, keys, tab, pool_layer, *, graphdef, freqs):
    return decode_entries(nnx.merge(graphdef, state).attn, keys, tab, pool_layer, freqs=freqs)


@functools.partial(jax.jit, static_argnames=("pre_def", "csa_def", "freqs", "m"))
def controller_jit(pre_state, csa_state, xq, qr, ikeys, d_e, end_e, *, pre_def, csa_def, freqs, m):
    """Indexer scores of the documents' windows for the query rows (max over query rows)."""
    first, blk = nnx.merge(pre_def, pre_state), nnx.merge(csa_def, csa_state)
    u, _, _ = first.hc_attn.pre(xq)
    xa = blk.attn_norm(u)
    _, cq = blk.attn.query(xa, qr[None], freqs)
    iq, iw = blk.attn.indexer.queries(xa, cq, qr[None], freqs)
    keys = apply_rope(ikeys.astype(jnp.float32), d_e, freqs).astype(ikeys.dtype)
    s = index_scores(iq, iw, keys[None])[0]  # [q, E]
    s = jnp.where(end_e[None] <= qr[:, None], s, -jnp.inf)
    return jnp.max(s, axis=0)


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs"))
def deviation_jit(state, x, pool_kv, pool_row, cpos, *, graphdef, freqs):
    """`latent_deviation` of every row with a pool row at the layer's input x [1, t, n, d]; 0 elsewhere."""
    blk = nnx.merge(graphdef, state)
    u, _, _ = blk.hc_attn.pre(x)
    kv = blk.attn.latent(blk.attn_norm(u), cpos[None], freqs)[0]
    dev = latent_deviation(kv, codec.rows(pool_kv, jnp.maximum(pool_row, 0)))  # (encoded or dense)
    return jnp.where(pool_row >= 0, dev, 0.0)
