"""Tensor-parallel forward of the native model with `jax.shard_map` (DESIGN §7, issue #6).

`TPForward(model, mesh).forward(ids, pos0, n_new, cache, rows)` is `Model.forward` (prefill
chunk, chunked prefill, decode) run with every parameter split as `table.param_spec` says and
every collective written out below. Per rank (r of tp):

* embedding: the rank's vocabulary slice looks up the ids it owns (zeros elsewhere), psum;
* attention: heads h/tp (wq_b, attn_sink, wo_a by output group) over the replicated shared
  K=V latent and compressors; indexer heads i/tp (wq_b, weights_proj): the per-head queries and
  weights are all-gathered, then every rank scores and selects top-k exactly as one device
  does; wo_b row-parallel on the rank's groups' projected state, psum;
* MoE: the router, hash table and shared expert replicated; the rank runs only assignments to
  its expert index range [r e/tp, (r+1) e/tp), psum of the routed sum (fp32), then + shared;
* head: the rank's vocabulary slice of the logits, all-gathered along vocab.

The cache is replicated over "tp" (one K=V head, DESIGN §7) and split by batch over "dp" when
the mesh has that axis (data parallel across processes, TP inside a host).

The per-rank modules are the model's own (`Attention.__call__`, `MoE.route/experts/shared`,
`HyperConnection`, `Model.logits`) merged with the rank's parameter blocks; `_localize` sets the
few static per-rank counts those modules keep (heads, groups, experts, indexer heads). Why the
indexer gathers queries rather than reducing scores: `comm_per_layer` and docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from redknot_jax.config import CSA, ModelConfig
from redknot_jax.mhc import HyperConnection
from redknot_jax.pallas import kernel_mode
from redknot_jax.model import Model, lm_head
from redknot_jax.moe import token_chunk
from redknot_jax.sharding.table import AXIS, DP_AXIS, batch_spec, check_tp, param_spec


# ------------------------------------------------------------------------------ per rank
def _localize(model: Model, tp: int) -> None:
    """Make the merged per-rank model consistent with its parameter blocks: the static head /
    group / expert counts the modules keep become per-rank counts. (A module that derived them
    from its parameter shapes would need none of this; see docs/sharding.md.)"""
    for blk in model.layers:
        localize_block(blk, model.cfg, tp)


def localize_block(blk, cfg: ModelConfig, tp: int) -> None:
    """`_localize` for one block (the per-layer programs of the tensor-parallel consumer)."""
    attn, moe = blk.attn, blk.ffn
    attn.h, attn.g = cfg.num_heads // tp, cfg.o_groups // tp
    moe.e = cfg.n_routed_experts // tp
    if attn.indexer is not None and tp > 1:
        ix = attn.indexer
        ix.heads = cfg.index_n_heads // tp
        local_queries = ix.queries
        # Indexer.queries scales the head weights by 1/sqrt(its head count): correct the
        # per-rank count back to the model's.
        fix = math.sqrt(ix.heads / cfg.index_n_heads)

        def gathered_queries(x, cq, pos, freqs, _local=local_queries, _fix=fix):
            q, w = _local(x, cq, pos, freqs)  # [b, t, i/tp, j], [b, t, i/tp] fp32
            # COLLECTIVE (CSA layers): all-gather of the indexer queries over tp along heads:
            # b*t*i*j elements in the activation dtype; every rank then holds all i heads.
            q = jax.lax.all_gather(q, AXIS, axis=2, tiled=True, to="invarying")
            # COLLECTIVE (CSA layers): all-gather of the indexer head weights: b*t*i fp32.
            w = jax.lax.all_gather(w * _fix, AXIS, axis=2, tiled=True, to="invarying")
            return q, w

        object.__setattr__(ix, "queries", gathered_queries)


def _rank(tp: int):
    # a constant at tp = 1, so nothing varies over the (trivial) axis and no collective is needed
    return jax.lax.axis_index(AXIS) if tp > 1 else 0


def _embed(model: Model, ids, tp: int):
    """Vocab-parallel embedding lookup -> streams [b, t, n, d]."""
    return vocab_embed(model.embed[...], ids, model.cfg.hc_mult, tp)


def vocab_embed(table, ids, hc_mult: int, tp: int):
    """Embedding lookup with the rank's vocabulary slice `table` [v/tp, d] -> streams [b, t, n, d]."""
    v_local = table.shape[0]
    local = ids - _rank(tp) * v_local
    mine = (local >= 0) & (local < v_local)
    e = jnp.where(mine[..., None], table[jnp.clip(local, 0, v_local - 1)], 0)  # [b, t, d]
    if tp > 1:
        # COLLECTIVE: psum over tp of the rows each rank owns (exactly one rank is non-zero per
        # token, so the sum is exact): b*t*d elements in the embedding dtype.
        e = jax.lax.psum(e, AXIS)
    return jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], hc_mult, e.shape[-1]))


def _moe(moe, x, ids, tp: int, keep_fn=None, chunk: int | None = None, kernels: str = "xla"):
    """`MoE.__call__` with the rank's expert index range: x [b, t, d] -> [b, t, d]. kernels:
    the rank's grouped matmuls by XLA or the Mosaic GPU kernel (`MoE.experts`). The token
    chunk defaults to `token_chunk` of the global expert count, as on one device."""
    b, t, d = x.shape
    lo = _rank(tp) * moe.e  # moe.e is the per-rank expert count here

    def run(xc, ic):
        sel, wts, scores = moe.route(xc, ic)  # replicated router: global expert ids
        keep = (sel >= lo) & (sel < lo + moe.e)
        if keep_fn is not None:
            keep = keep & keep_fn(sel, wts, scores)
        routed = moe.experts(xc, sel - lo, wts, keep, kernels)  # [n, d] fp32, this rank's experts only
        if tp > 1:
            # COLLECTIVE: psum over tp of the routed-expert sums: n*d fp32 per chunk of n tokens
            # (each token's <= top-k experts live on <= top-k ranks; the rest add zeros).
            routed = jax.lax.psum(routed, AXIS)
        return (routed + moe.shared(xc)).astype(x.dtype)

    n, chunk = b * t, chunk or token_chunk(moe.e * tp)
    xf, idf = x.reshape(n, d), ids.reshape(n)
    if n <= chunk:
        y = run(xf, idf)
    else:
        pad = (-n) % chunk
        xp = jnp.pad(xf, ((0, pad), (0, 0))).reshape(-1, chunk, d)
        ip = jnp.pad(idf, (0, pad)).reshape(-1, chunk)
        y = jax.lax.map(lambda a: run(*a), (xp, ip)).reshape(-1, d)[:n]
    return y.reshape(b, t, d)


def _block(blk, x, ids, pos0, n_new, cache, freqs, block: int, tp: int, keep_fn=None, kernels: str = "", out=None):
    """`Block.__call__` with the two reductions of a tensor-parallel layer. `kernels`: a resolved
    kernel set, as `Block`'s: the indexer's scores (every rank holds all indexer heads after the
    all-gather, so the kernel runs per rank unchanged) and the rank's expert matmuls. `out`: as
    `Block`'s (rows [row0, row0 + rows) only come out)."""
    u, post, comb = blk.hc_attn.pre(x)
    y, cache = blk.attn(blk.attn_norm(u), pos0, n_new, cache, freqs, block,
                        kernels=kernel_mode(kernels, "indexer"), out=out)  # rank's heads only
    if out is not None:
        x, ids, post, comb = (jax.lax.dynamic_slice_in_dim(v, out[0], out[1], axis=1) for v in (x, ids, post, comb))
    if tp > 1:
        # COLLECTIVE: psum over tp of the row-parallel wo_b outputs (each rank projected its g/tp
        # groups' o_lora_rank channels): b*t*d elements in the activation dtype.
        y = jax.lax.psum(y, AXIS)
    x = HyperConnection.post(x, y, post, comb)
    u, post, comb = blk.hc_ffn.pre(x)
    y = _moe(blk.ffn, blk.ffn_norm(u), ids, tp, keep_fn, kernels=kernel_mode(kernels, "ragged_dot"))
    return HyperConnection.post(x, y, post, comb), cache


def _rank_forward(graphdef, tp: int, block: int, params, ids, pos0, n_new, cache, rows):
    model = nnx.merge(graphdef, params)
    _localize(model, tp)
    x = _embed(model, ids, tp)
    new_layers = []
    for i, blk in enumerate(model.layers):
        x, c = _block(blk, x, ids, pos0, n_new, cache["layers"][i], model.freqs(i), block, tp)
        new_layers.append(c)
    return vocab_logits(model.hc_head, model.norm, model.head[...], x, rows, tp), \
        {"length": pos0 + n_new, "layers": new_layers}


def vocab_logits(hc_head, norm, table, x, rows, tp: int):
    """LM head with the rank's vocabulary slice `table` [v/tp, d], gathered: [b, r, vocab] fp32."""
    logits = lm_head(hc_head, norm, table, x, rows)  # [b, r, vocab/tp]: the rank's slice
    if tp > 1:
        # COLLECTIVE: all-gather over tp of the logits along vocab: b*r*vocab fp32.
        logits = jax.lax.all_gather(logits, AXIS, axis=2, tiled=True, to="invarying")
    return logits


def _to_global(value, sharding: NamedSharding):
    """A global array with `sharding` from a value every process holds whole (host or device)."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


class TPForward:
    """`Model.forward` as one jitted shard_map program over `mesh` (axis "tp", optional "dp").

    `forward(ids, pos0, n_new, cache, rows)` takes and returns what `Model.forward` does:
    ids [b, t] int32, pos0 / n_new [b], cache from `init_cache`, rows [b, r]; returns
    (logits [b, r, vocab] fp32, new cache). With a "dp" axis, b is split over it; on several
    processes, pass global arrays (`put_batch` builds them from each process's rows).
    `compiler_options` go to `jax.jit` (XLA flags for this program only).
    """

    def __init__(self, model: Model, mesh: jax.sharding.Mesh, block: int = 256, compiler_options=None):
        self.cfg: ModelConfig = model.cfg
        self.mesh, self.block, self.dtype = mesh, block, model.dtype
        self.tp = mesh.shape[AXIS]
        self.dp = mesh.shape[DP_AXIS] if DP_AXIS in mesh.axis_names else 1
        check_tp(self.cfg, self.tp)
        # structure only (init_cache reads no parameter): the caller's model is not kept alive here
        self._abstract = nnx.eval_shape(lambda: Model(self.cfg, self.dtype))
        graphdef, state = nnx.split(model)
        flat = nnx.to_flat_state(state)
        self.paths = [".".join(str(p) for p in path) for path, _ in flat]
        specs = [param_spec(p, v.shape, self.tp) for p, (_, v) in zip(self.paths, flat)]
        shardings = [NamedSharding(mesh, s) for s in specs]
        self.params = nnx.from_flat_state(
            [(path, _to_global(v.get_value(), sh)) for (path, v), sh in zip(flat, shardings)])
        param_specs = nnx.from_flat_state([(path, s) for (path, _), s in zip(flat, specs)])
        self.graphdef = graphdef

        def body(params, ids, pos0, n_new, cache, rows):
            return _rank_forward(graphdef, self.tp, self._block_for(ids.shape[1]), params, ids, pos0, n_new,
                                 cache, rows)

        def fwd(params, ids, pos0, n_new, cache, rows):
            bspec = lambda a: batch_spec(mesh, a.ndim)
            cache_specs = jax.tree.map(bspec, cache)
            # check_vma=False: moe.grouped_matmul starts its scan carry from jnp.zeros (invariant)
            # while a rank's expert weights make the body varying, which the type check refuses;
            # replication of the outputs (logits after the all-gather, caches computed from the
            # psum'd stream) holds by construction and is tested (tp = 1, 2, 8 agree).
            f = jax.shard_map(body, mesh=mesh, check_vma=False,
                              in_specs=(param_specs, bspec(ids), bspec(pos0), bspec(n_new), cache_specs,
                                        bspec(rows)),
                              out_specs=(batch_spec(mesh, 3), cache_specs))
            return f(params, ids, pos0, n_new, cache, rows)

        self._fwd = jax.jit(fwd, donate_argnums=(4,), compiler_options=compiler_options)

    def _block_for(self, t: int) -> int:
        block = min(self.block, t)
        if t % block:
            raise ValueError(f"chunk length {t} must be a multiple of the query block {block}")
        return block

    # ------------------------------------------------------------------ inputs
    def batch_sharding(self, ndim: int) -> NamedSharding:
        return NamedSharding(self.mesh, batch_spec(self.mesh, ndim))

    def put_batch(self, local):
        """A global batch array from this process's rows (its dp slice; all rows on 1 process)."""
        local = np.asarray(local)
        sh = self.batch_sharding(local.ndim)
        if jax.process_count() == 1:
            return jax.device_put(local, sh)
        return jax.make_array_from_process_local_data(sh, local)

    def cache_shapes(self, b: int, capacity: int) -> dict:
        """ShapeDtypeStructs of `init_cache(b, capacity)`."""
        return jax.eval_shape(lambda: self._abstract.init_cache(b, capacity))

    def init_cache(self, b: int, capacity: int) -> dict:
        """Empty caches for a global batch of b, split over dp, replicated over tp."""
        model = self._abstract
        out = jax.tree.map(lambda s: self.batch_sharding(len(s.shape)), self.cache_shapes(b, capacity))
        return jax.jit(lambda: model.init_cache(b, capacity), out_shardings=out)()

    def forward(self, ids, pos0, n_new, cache, rows):
        """One chunk (see `Model.forward`); cache is donated."""
        return self._fwd(self.params, ids, pos0, n_new, cache, rows)

    def lower(self, ids, pos0, n_new, cache, rows):
        """The lowered program for these shapes (arrays or ShapeDtypeStructs), e.g. to list
        its collectives: `.as_text()` holds one all_reduce / all_gather per ledger entry."""
        return self._fwd.lower(self.params, ids, pos0, n_new, cache, rows)


# ------------------------------------------------------------------------------ ledger
@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the tensor-parallel forward, per rank."""

    name: str  # where it sits
    op: str  # "psum" (all-reduce) or "all_gather"
    what: str
    elements: int  # of the reduced / gathered result, per call
    dtype_bytes: int
    calls: int = 1  # executions per forward (the MoE runs 4096-token chunks)

    @property
    def call_bytes(self) -> int:
        """Size of one call's result tensor (what is reduced / gathered)."""
        return self.elements * self.dtype_bytes

    @property
    def payload_bytes(self) -> int:
        return self.call_bytes * self.calls

    def wire_bytes(self, tp: int) -> int:
        """Bytes each rank sends per forward with a ring algorithm: 2 (tp-1)/tp x payload for
        an all-reduce, (tp-1)/tp x payload for an all-gather."""
        f = 2 if self.op == "psum" else 1
        return f * (tp - 1) * self.payload_bytes // tp

    def to_dict(self, tp: int) -> dict:
        return {"name": self.name, "op": self.op, "what": self.what, "elements": self.elements,
                "calls": self.calls, "call_bytes": self.call_bytes, "payload_bytes": self.payload_bytes,
                "wire_bytes_per_rank": self.wire_bytes(tp)}


def comm_per_layer(cfg: ModelConfig, rows: int, tp: int, act_dtype=jnp.bfloat16,
                   moe_chunk: int = 4096) -> list[list[Collective]]:
    """The collectives of each layer for a chunk of `rows` token rows (batch x chunk length,
    padding rows included) at degree `tp`, in program order; [] per layer when tp == 1.
    `act_dtype` is the model dtype (activations, indexer queries)."""
    if tp == 1:
        return [[] for _ in range(cfg.num_layers)]
    check_tp(cfg, tp)
    a = jnp.dtype(act_dtype).itemsize
    d = cfg.hidden_size
    moe_calls, moe_rows = (1, rows) if rows <= moe_chunk else (-(-rows // moe_chunk), moe_chunk)
    out = []
    for layer in range(cfg.num_layers):
        cols = []
        if cfg.layer_types[layer] == CSA:
            i, j = cfg.index_n_heads, cfg.index_head_dim
            cols.append(Collective(f"layers.{layer}.attn.indexer", "all_gather",
                                   "indexer queries [b, t, i, j] over heads", rows * i * j, a))
            cols.append(Collective(f"layers.{layer}.attn.indexer", "all_gather",
                                   "indexer head weights [b, t, i] fp32 over heads", rows * i, 4))
        cols.append(Collective(f"layers.{layer}.attn.wo_b", "psum",
                               "row-parallel wo_b output [b, t, d]", rows * d, a))
        cols.append(Collective(f"layers.{layer}.ffn", "psum",
                               "routed-expert sum [n, d] fp32", moe_rows * d, 4, moe_calls))
        out.append(cols)
    return out


def comm_model_ends(cfg: ModelConfig, rows: int, out_rows: int, tp: int, act_dtype=jnp.bfloat16
                    ) -> list[Collective]:
    """The two collectives outside the layers: embedding psum and logits all-gather."""
    if tp == 1:
        return []
    return [Collective("embed", "psum", "vocab-parallel embedding rows [b, t, d]", rows * cfg.hidden_size,
                       jnp.dtype(act_dtype).itemsize),
            Collective("head", "all_gather", "logits [b, r, vocab] fp32 along vocab", out_rows * cfg.vocab_size, 4)]


def comm_ledger(cfg: ModelConfig, rows: int, out_rows: int, tp: int, act_dtype=jnp.bfloat16) -> dict:
    """JSON-able communication ledger of one forward of `rows` token rows returning logits for
    `out_rows` rows: per layer the collective count (executions), payload bytes and ring wire
    bytes per rank, each collective listed; the model ends; totals."""
    layers = comm_per_layer(cfg, rows, tp, act_dtype)
    ends = comm_model_ends(cfg, rows, out_rows, tp, act_dtype)
    summary = lambda cs: {"count": sum(c.calls for c in cs), "payload_bytes": sum(c.payload_bytes for c in cs),
                          "wire_bytes_per_rank": sum(c.wire_bytes(tp) for c in cs)}
    per_layer = [{"layer": i, **summary(c), "collectives": [x.to_dict(tp) for x in c]} for i, c in enumerate(layers)]
    return {"tp": tp, "rows": rows, "out_rows": out_rows, "per_layer": per_layer,
            "ends": [x.to_dict(tp) for x in ends], "total": summary([x for c in layers for x in c] + ends)}
