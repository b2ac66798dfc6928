"""RedKnot forward (DESIGN §4-§6): both arms behind `prefill(request, arm=...)`.

Reference path in XLA (one request at a time, dense per-frame masks): the Pallas kernels of a
later issue replace its hot spots and are tested against it.

* Fences (first / last layers of the profile) run the native block over the whole request, or,
  after an exact prefix (`Plan.prefix`), over the rows after it with the prefix's native cache
  rebuilt from its artifact; the prefix rows' own outputs are never used (their keys are the
  artifact's in every layer), so the histogram leaves them out.
* A reusable layer runs mHC, norms and `wq_a` for every row; keys come per frame (canonical
  artifact latents, online latents for new or refreshed rows); every query reaches a frame's
  keys rotated by -D, partial outputs are phase-restored by R(D) and merged by log-sum-exp with
  the sink once. Global heads use, for unprotected document rows, their own frame's sliding
  window, the artifact's document-local CSA top-k and every visible HCA entry; protected rows
  use the native key set over the whole request (native indexer across frames). Local heads of
  unprotected document rows are **replaced** by the artifact's z_L; z = z_G + z_L; `wo_b` once.
* MoE on reusable layers keeps the fan-out rule's experts with their original weights.
* Any certificate failure -> the Recomputed arm for the request, counted by reason.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.config import CSA, HCA
from redknot_jax.indexer import TOPK_STAGES
from redknot_jax.mhc import HyperConnection
from redknot_jax.model import Model
from redknot_jax.pallas.indexer_scores import index_scores
from redknot_jax.relocation import merge_partials, partial_attention, rotate
from redknot_jax.reuse import ledger as ledgers
from redknot_jax.reuse.artifact import local_head_mask, profile_parts, project_heads, single_rank
from redknot_jax.reuse.consumer import Consumer, run_steps
from redknot_jax.reuse.decode import DecodeState
from redknot_jax.reuse.pool import DocPool
from redknot_jax.reuse.certificate import CertCounters, FallbackReason, TPGeometry, can_prefix, explain, token_digest
from redknot_jax.reuse.fanout import fanout_histogram, fanout_keep, mean_kept
from redknot_jax.reuse.planner import (Plan, Request, concentration, fill_itop, latent_deviation, online_frames,
                                       plan_request, row_risk)
from redknot_jax.reuse.prefix import PrefixCache, native_cache
from redknot_jax.reuse.profile import RedKnotProfile
from redknot_jax.rope import apply_rope


ARMS = ("recompute", "redknot", "prefix")


class ReuseFallback(RuntimeError):
    """Raised when the RedKnot arm was required but the request fell back to recomputation."""


@dataclasses.dataclass
class PrefillResult:
    logits: np.ndarray  # [len(query_rows), vocab]
    arm: str  # the arm that actually ran
    fallback: FallbackReason | None
    fallback_detail: str
    ledgers: ledgers.Ledgers | None
    plan: Plan | None
    seconds: float
    fanout_hist: np.ndarray | None = None
    decode: DecodeState | None = None  # with decode_rows (jit path): what next_logits reads


def sub_batches(n: int, sizes=None) -> list[int]:
    """n requests as consecutive sub-batches whose sizes are among `sizes` or 1, the largest that
    fits first (sizes 2, 4 and 7 requests: 4, 2, 1); no sizes: one batch of n. A padded batch
    would compute a whole request per padding slot; a sub-batch costs a dispatch per layer."""
    if not sizes:
        return [n]
    fits, out = sorted(set(sizes) | {1}, reverse=True), []
    while n > 0:
        out.append(next(s for s in fits if s <= n))
        n -= out[-1]
    return out


class ReuseRuntime:
    """Holds the model, profile, identity (checkpoint fingerprint, TP geometry) and counters."""

    def __init__(self, model: Model, profile: RedKnotProfile, checkpoint_fingerprint: str,
                 tp: TPGeometry | None = None, min_generation: int = 0, kernels: str = "auto", buckets: int = 8,
                 topk_stages: int = TOPK_STAGES, prefix_cache: int = 0, block: int | None = None,
                 compile_threads: int = 0):
        self.model, self.profile, self.cfg = model, profile, model.cfg
        self.fingerprint, self.tp = checkpoint_fingerprint, tp or single_rank()
        self.min_generation = min_generation
        self.counters = CertCounters()
        self.local = local_head_mask(model, profile)
        self.reusable = list(profile.reusable_layers(self.cfg.num_layers))
        # Mosaic GPU kernels: resolve_kernels; buckets: the padded sizes (pool.Buckets); topk_stages:
        # the CSA selection's entry prefixes (indexer.select_topk_causal); block: every arm's query
        # block (Consumer; None: its default); compile_threads: Consumer's (layer programs compiled ahead)
        # the device cache of first documents' states, where both arms read an exact prefix
        # (prefix.PrefixCache; 0: none, each request reads its artifact's host arrays)
        self.prefix_cache = PrefixCache(prefix_cache, self.cfg.num_layers, self.cfg.sliding_window) \
            if prefix_cache else None
        self.consumer = Consumer(model, profile, kernels=kernels, buckets=buckets, topk_stages=topk_stages,
                                 prefix_cache=self.prefix_cache, block=block,
                                 compile_threads=compile_threads)

    # ------------------------------------------------------------------ certification
    def certify(self, req: Request) -> tuple[FallbackReason, str] | None:
        for i, seg in enumerate(req.segments):
            if seg.artifact is None:
                continue
            art = seg.artifact
            absent = sorted(set(self.reusable) - set(art.layers))
            if absent:  # the data itself, whatever the certificate claims
                return FallbackReason.MISSING_LAYERS, f"segment {i}: artifact lacks layers {absent}"
            bad = explain(art.certificate, expected_tokens_digest=token_digest(seg.tokens),
                          profile_digest=self.profile.digest(), model_digest=self.cfg.fingerprint(),
                          checkpoint_fingerprint=self.fingerprint, tp=self.tp, min_generation=self.min_generation,
                          required_layers=self.reusable, actual_payload_digest=art.digest(),
                          required_parts=profile_parts(self.profile), codec=self.profile.artifact_codec)
            if bad is not None:
                return bad[0], f"segment {i}: {bad[1]}"
        return None

    # ------------------------------------------------------------------ arms
    def prefill(self, req: Request, arm: str = "redknot", require_reuse: bool = False, path: str = "jit",
                pool: DocPool | None = None, decode_rows: int = 0) -> PrefillResult:
        """Logits of the request's query rows with either arm, plus ledgers and counters.

        `path="jit"` runs the consumer (per-layer jitted, query-blocked; `pool` holds the hot
        artifacts, packed from the request's own when None); `path="reference"` the eager
        reference below, which the consumer is tested against. `decode_rows` > 0 (jit path,
        either arm, a fallback included): keep a decode state for that many generated rows, so
        `next_logits` runs one new row per step over cached keys instead of the whole request.
        `arm="prefix"` (jit path): the first segment's document is an exact prefix computed in no
        layer, every later row native (`Consumer.prefix`, what a prefix cache gives);
        certified as the RedKnot arm, and a request whose first segment is not a document, or
        whose first artifact cannot be a prefix (`can_prefix`), falls back, counted
        (NO_PREFIX_STATE)."""
        return run_steps(self.prefill_steps(req, arm, require_reuse, path, pool, decode_rows))

    def prefill_steps(self, req: Request, arm: str = "redknot", require_reuse: bool = False, path: str = "jit",
                      pool: DocPool | None = None, decode_rows: int = 0):
        """`prefill` a layer at a time: a generator that yields after each layer of the arm that
        runs (the consumer's steps) and returns the `PrefillResult` (a server runs other requests'
        decode steps between them)."""
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {list(ARMS)}, got {arm!r}")
        if path not in ("jit", "reference"):
            raise ValueError(f"path: expected 'jit' or 'reference', got {path!r}")
        if arm == "prefix" and path != "jit":
            raise ValueError("arm='prefix' runs on the jit path only")
        t0 = time.perf_counter()
        if arm == "prefix":
            bad = self.certify(req) or self._prefix_verdict(req)
            if bad is None:
                self.counters.record_ok()
                plan = plan_request(req, self.profile)
                out = yield from self.consumer.prefix_steps(req.segments[0].artifact, req.tokens, plan.query_rows,
                                                            decode_rows=decode_rows)
                logits, state = (out[0], out[1]) if decode_rows else (out, None)
                return PrefillResult(np.asarray(logits), "prefix", None, "", None, plan, time.perf_counter() - t0,
                                     decode=state)
            self.counters.record_fallback(bad[0])  # before any reuse-specific work
            if require_reuse:
                raise ReuseFallback(f"prefix arm fell back to recomputation: {bad[0].value}: {bad[1]}")
        if arm == "redknot":
            bad = self.certify(req)
            if bad is None:
                self.counters.record_ok()
                if path == "reference":
                    logits, plan, hist = self._redknot(req)
                else:
                    plan = plan_request(req, self.profile)
                    if pool is None:
                        pool = self.consumer.pool([s.artifact for s in req.segments if s.artifact is not None])
                    out = yield from self.consumer.redknot_steps(plan, req.tokens, pool, decode_rows=decode_rows)
                    logits, hist = np.asarray(out[0]), np.asarray(out[1])
                    hist = np.pad(hist, (0, max(0, 7 - hist.size)))
                    state = out[2] if decode_rows else None
                out_rows = self.consumer.last_layer_rows(plan) if path == "jit" else None
                return PrefillResult(logits, "redknot", None, "", self._ledgers(plan, hist, out_rows), plan,
                                     time.perf_counter() - t0, hist, state if path == "jit" else None)
            self.counters.record_fallback(bad[0])  # before any reuse-specific work
            if require_reuse:
                raise ReuseFallback(f"RedKnot arm fell back to recomputation: {bad[0].value}: {bad[1]}")
        plan = plan_request(req, self.profile)
        state = None
        if path == "reference":
            logits = self._recompute(req, plan.query_rows)
        elif decode_rows:
            logits, state = yield from self.consumer.recompute_steps(req.tokens, plan.query_rows,
                                                                     decode_rows=decode_rows)
        else:
            logits = yield from self.consumer.recompute_steps(req.tokens, plan.query_rows)
        reason, detail = (bad if arm != "recompute" else (None, ""))
        return PrefillResult(np.asarray(logits), "recompute", reason, detail, None, plan, time.perf_counter() - t0,
                             decode=state)

    def _prefix_verdict(self, req: Request) -> tuple[FallbackReason, str] | None:
        """Why the request's first segment cannot be an exact prefix, or None."""
        first = req.segments[0] if req.segments else None
        if first is None or first.artifact is None:
            return FallbackReason.NO_PREFIX_STATE, "segment 0: not a document (no artifact)"
        if not can_prefix(first.artifact.certificate):
            cert = first.artifact.certificate
            return FallbackReason.NO_PREFIX_STATE, (f"segment 0: artifact of format {cert.format_version}, parts "
                                                    f"{list(cert.parts)}: holds no prefix state")
        absent = sorted(set(range(self.cfg.num_layers)) - set(first.artifact.layers) - set(first.artifact.prefix_layers))
        if absent:
            return FallbackReason.MISSING_LAYERS, f"segment 0: artifact lacks the native state of layers {absent}"
        n, L = sum(len(s.tokens) for s in req.segments), first.artifact.length
        if n == L:
            return FallbackReason.NO_PREFIX_STATE, "no rows after the prefix"
        if any(int(r) % n < L for r in req.query_rows):
            return FallbackReason.NO_PREFIX_STATE, f"query rows {list(req.query_rows)} inside the prefix ({L} rows)"
        return None

    def prefill_batch(self, reqs: list[Request], arm: str = "redknot", require_reuse: bool = False,
                      pool: DocPool | None = None, decode_rows: int = 0, batch_sizes=None) -> list[PrefillResult]:
        """`prefill` for several requests, each arm's requests in one jitted call per layer
        (the consumer's `recompute_batch` / `redknot_batch`; requests padded to common shapes).
        Certification, fallback and counting are per request exactly as in `prefill`: a request
        that fails joins the Recomputed batch, counted by reason (or, with `require_reuse`,
        raises before anything runs). `pool` must hold every cited artifact (default: packed
        from the batch's own). `decode_rows` > 0: each result keeps a decode state for that
        many generated rows (`next_logits` then decodes each request on its own; a request that
        falls back is recomputed on its own with its state). `seconds` of every result is the
        whole batch's wall time."""
        return run_steps(self.prefill_batch_steps(reqs, arm, require_reuse, pool, decode_rows, batch_sizes))

    def prefill_batch_steps(self, reqs: list[Request], arm: str = "redknot", require_reuse: bool = False,
                            pool: DocPool | None = None, decode_rows: int = 0, batch_sizes=None):
        """`prefill_batch` a layer at a time (as `prefill_steps`); returns the results.
        `batch_sizes`: the sizes a RedKnot batch runs in, one sub-batch after another (`sub_batches`:
        the largest that fit first, then 1s), so that a server's batches of any size share a few
        compiled programs and no request is computed for padding."""
        if arm not in ("recompute", "redknot"):
            raise ValueError(f"arm: expected 'recompute' or 'redknot', got {arm!r}")
        if not reqs:
            raise ValueError("prefill_batch: no requests")
        t0 = time.perf_counter()
        verdicts = [self.certify(r) if arm == "redknot" else None for r in reqs]
        if require_reuse and arm == "redknot":
            bad = [(k, v) for k, v in enumerate(verdicts) if v is not None]
            if bad:
                k, v = bad[0]
                raise ReuseFallback(f"RedKnot arm would fall back for request {k}: {v[0].value}: {v[1]}")
        plans = [plan_request(r, self.profile) for r in reqs]
        red = [k for k, v in enumerate(verdicts) if arm == "redknot" and v is None]
        rec = [k for k in range(len(reqs)) if k not in red]
        out: list[PrefillResult | None] = [None] * len(reqs)
        for k in red:
            self.counters.record_ok()
        for k in rec:
            if arm == "redknot":
                self.counters.record_fallback(verdicts[k][0])
        if red:
            if pool is None:
                arts = {id(s.artifact): s.artifact for k in red for s in reqs[k].segments if s.artifact is not None}
                pool = self.consumer.pool(list(arts.values()))
            at = 0
            for size in sub_batches(len(red), batch_sizes):
                part, at = red[at:at + size], at + size
                res = yield from self.consumer.redknot_batch_steps([plans[k] for k in part],
                                                                   [reqs[k].tokens for k in part], pool,
                                                                   decode_rows=decode_rows)
                for k, (logits, hist, *state) in zip(part, res):
                    hist = np.asarray(hist) if hist is not None else None
                    if hist is not None:
                        hist = np.pad(hist, (0, max(0, 7 - hist.size)))
                    out[k] = PrefillResult(np.asarray(logits), "redknot", None, "", self._ledgers(plans[k], hist),
                                           plans[k], 0.0, hist, state[0] if state else None)
        if rec:
            if decode_rows:  # each with its own native decode state
                res = []
                for k in rec:
                    res.append((yield from self.consumer.recompute_steps(reqs[k].tokens, plans[k].query_rows,
                                                                         decode_rows=decode_rows)))
            else:
                res = [(lg, None) for lg in self.consumer.recompute_batch([reqs[k].tokens for k in rec],
                                                                         [plans[k].query_rows for k in rec])]
            for k, (logits, state) in zip(rec, res):
                reason, detail = verdicts[k] if verdicts[k] is not None else (None, "")
                out[k] = PrefillResult(np.asarray(logits), "recompute", reason, detail, None, plans[k], 0.0,
                                       decode=state)
        dt = time.perf_counter() - t0
        for r in out:
            r.seconds = dt
        return out

    def generate(self, req: Request, max_new_tokens: int, arm: str = "redknot", require_reuse: bool = False,
                 pool: DocPool | None = None):
        """Greedy tokens after the request. The first token comes from `prefill`; decoding then
        continues natively over the same relocated frames: each generated token is a new,
        protected query row appended to the last frame, and the plan of the prompt rows stays
        frozen (so earlier rows never change). Each step runs the new row alone over the prompt's
        cached keys (`decode_rows`; `Consumer.decode_step`). Returns (tokens, first PrefillResult)."""
        first = self.prefill(req, arm, require_reuse, pool=pool, decode_rows=max(0, max_new_tokens - 1))
        toks = [int(np.argmax(first.logits[-1]))]
        for _ in range(max_new_tokens - 1):
            toks.append(int(np.argmax(self.next_logits(req, first, toks))))
        return toks, first

    def generate_batch(self, reqs: list[Request], max_new_tokens: int, arm: str = "redknot",
                       require_reuse: bool = False, pool: DocPool | None = None):
        """`generate` for several requests: one batched prefill (`prefill_batch`), then every
        request decodes as a row of a `DecodeBatch` (a jitted call per layer for all of them per
        token): those in the RedKnot arm in one, those that fell back (native states) in another.
        Returns (tokens per request, PrefillResult per request), each request's equal to its
        `generate`."""
        firsts = self.prefill_batch(reqs, arm, require_reuse, pool=pool, decode_rows=max(0, max_new_tokens - 1))
        toks = [[int(np.argmax(f.logits[-1]))] for f in firsts]
        batches, rows = {}, {}  # native or not -> its batch; request -> (batch, slot)
        for k, f in enumerate(firsts):
            if f.decode is not None:
                b = batches.setdefault(f.decode.native, self.consumer.decode_batch(len(reqs)))
                rows[k] = (b, b.join(f.decode))
        for _ in range(max_new_tokens - 1):
            logits = {}
            for b in batches.values():
                last = np.zeros(b.slots, np.int32)
                for k, (bk, slot) in rows.items():
                    if bk is b:
                        last[slot] = toks[k][-1]
                out = np.asarray(b.step(last))
                logits.update({k: out[slot] for k, (bk, slot) in rows.items() if bk is b})
            for k, tk in enumerate(toks):
                tk.append(int(np.argmax(logits[k])))
        return toks, firsts

    def next_logits(self, req: Request, first: PrefillResult, generated, pool: DocPool | None = None) -> np.ndarray:
        """Logits [vocab] of the row after `generated` (tokens sampled so far after `req`), in
        the arm `first` actually ran: RedKnot continues over the same frames with the prompt's
        plan frozen; a request that fell back continues natively."""
        gen = np.asarray(generated, np.int32)
        full = np.concatenate([req.tokens, gen])
        st = first.decode
        if st is not None and st.rows == first.plan.n_rows + gen.size - 1 and st.room:
            return np.asarray(self.consumer.decode_step(int(gen[-1]), st))  # one row (RedKnot: the prefill's pool)
        if first.arm == "recompute":
            return np.asarray(self.consumer.recompute(full, [full.size - 1]))[-1]
        if first.arm == "prefix":
            return np.asarray(self.consumer.prefix(req.segments[0].artifact, full, [full.size - 1]))[-1]
        if pool is None:  # the prefill's pool when it kept one; packing is per call otherwise
            pool = st.pool if st is not None else self.consumer.pool(
                [s.artifact for s in req.segments if s.artifact is not None])
        plan = first.plan.extend(gen.size)
        logits, _ = self.consumer.redknot(plan, full, pool, frozen=True)  # the whole request again
        return np.asarray(logits)[-1]

    def _recompute(self, req, rows) -> np.ndarray:
        ids = jnp.asarray(req.tokens)[None]
        t = ids.shape[1]
        cap = -(-t // self.cfg.hca_rate) * self.cfg.hca_rate
        logits, _ = self.model.forward(ids, jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32),
                                       self.model.init_cache(1, cap), jnp.asarray(rows)[None], block=t)
        return np.asarray(logits[0])

    def _ledgers(self, plan: Plan, hist, out_rows: int | None = None) -> ledgers.Ledgers:
        """The ledgers of a RedKnot prefill; `out_rows`: its last layer's output rows
        (`Consumer.last_layer_rows`; None: every row, as a batch computes)."""
        cfg, prof = self.cfg, self.profile
        prot = int(plan.protected.sum())
        kept = mean_kept(hist) if hist is not None else float(cfg.experts_per_tok)
        # latents (wkv, compressors) run for the rows the pool does not hold: new rows, and
        # refreshed ones (a few more rows that online entries pool are not counted)
        refreshed = plan.protected & plan.doc_row if prof.latent_refresh == "protected" else False
        latent = int((~plan.doc_row | refreshed).sum()) - plan.prefix
        return ledgers.Ledgers(
            head_row=ledgers.head_row_ledger(cfg, prof, plan.n_rows, prot),
            token_row=ledgers.token_row_ledger(cfg, prof, plan.n_rows, plan.candidates,
                                               int((plan.protected & plan.doc_row).sum()), prefix_rows=plan.prefix),
            operator=ledgers.operator_ledger(cfg, prof, plan.n_rows, prot, kept, latent_rows=latent,
                                             prefix_rows=plan.prefix, out_rows=out_rows),
            wallclock=None, cert=self.counters)

    # ------------------------------------------------------------------ RedKnot arm
    def _redknot(self, req: Request, frozen: Plan | None = None):
        model, cfg, prof = self.model, self.cfg, self.profile
        plan = frozen if frozen is not None else plan_request(req, prof)
        ids = jnp.asarray(req.tokens)[None]
        t = plan.n_rows
        x = model.embed_streams(ids)
        L = plan.prefix
        unit = np.lcm(cfg.hca_rate, cfg.csa_rate)
        cap = -(-t // unit) * unit
        keep_fn = lambda sel, wts, scores: fanout_keep(wts, prof.fanout_mode, prof.tau, prof.fanout_min)
        keeps, planned = [], frozen is not None
        for i, blk in enumerate(model.layers):
            if prof.is_fence(i, cfg.num_layers):
                cache = (native_cache(blk.attn, plan.frames[0].artifact.native_state(i), cap, model.dtype) if L
                         else blk.attn.init_cache(1, cap, model.dtype))
                y, _ = blk(x[:, L:], ids[:, L:], jnp.full((1,), L, jnp.int32), jnp.full((1,), t - L, jnp.int32),
                           cache, model.freqs(i), t - L)
                x = x.at[:, L:].set(y)
                continue
            if not planned:  # the controller reads the first reusable layer's input
                self._plan_itop(plan, x)
                planned = True
            x = self._reusable_layer(i, blk, x, plan)
            x, keep, ran = self._ffn_sublayer(i, blk, x, ids, plan, keep_fn)
            keeps.append(np.asarray(keep[0])[ran & (np.arange(t) >= L)])
        h = model.logits(x, jnp.asarray(plan.query_rows)[None])
        return np.asarray(h[0]), plan, fanout_histogram(np.concatenate(keeps)) if keeps else None

    def _ffn_sublayer(self, layer: int, blk, x, ids, plan: Plan, keep_fn):
        """The FFN sub-layer of a reusable layer as the profile's `ffn_rows` says: (x, keep mask,
        rows that ran the MoE [t]). "run": every row runs it. "omit" / "restore": the MoE runs
        (here: is kept) for protected rows and rows without an artifact only; an unprotected
        document row's streams pass unchanged ("omit") or take its artifact's canonical FFN
        output through the native mHC post/comb ("restore")."""
        y, keep = blk.ffn_residual(x, ids, keep_fn, with_keep=True)
        skip = plan.doc_row & ~plan.protected
        if self.profile.ffn_rows == "run" or not skip.any():
            return y, keep, np.ones(plan.n_rows, bool)
        alt = x
        if self.profile.ffn_rows == "restore":
            canon = np.zeros((plan.n_rows, x.shape[-1]), np.float32)
            for f in plan.frames:
                if f.artifact is not None and f.doc_len:
                    canon[f.start:f.start + f.doc_len] = np.asarray(f.artifact.layer(layer)["ffn"], np.float32)
            _, post, comb = blk.hc_ffn.pre(x)
            alt = HyperConnection.post(x, jnp.asarray(canon, x.dtype)[None], post, comb)
        return jnp.where(jnp.asarray(skip)[None, :, None, None], alt, y), keep, ~skip

    def _frames_collapse(self, plan: Plan) -> bool:
        """latent_refresh='protected' with every candidate row protected: every latent is
        recomputed online, so the request is one online frame (the native computation)."""
        return self.profile.latent_refresh == "protected" and bool((plan.protected | ~plan.doc_row).all())

    def _plan_itop(self, plan: Plan, x):
        """Itop and the budget from the native indexer for the query rows, at the first
        reusable layer's input, with the first reusable CSA layer's indexer over the documents'
        indexer keys (relocated)."""
        prof, model = self.profile, self.model
        csa = [i for i in self.reusable if model.cfg.layer_types[i] == CSA]
        scores = np.full(plan.n_rows, -np.inf)
        conc = 1.0
        if csa and plan.candidates:
            li = csa[0]
            blk = model.layers[li]
            first = model.layers[self.reusable[0]]
            u, _, _ = first.hc_attn.pre(x)
            xa = blk.attn_norm(u)
            pos = jnp.arange(plan.n_rows)[None]
            freqs = model.freqs(li)
            _, cq = blk.attn.query(xa, pos, freqs)
            iq, iw = blk.attn.indexer.queries(xa, cq, pos, freqs)
            qr = jnp.asarray(plan.query_rows)
            m = blk.attn.indexer.m
            all_scores = []
            for f in plan.candidate_frames:
                if f.doc_len < m:
                    continue
                keys = f.artifact.layers[li]["idx_entries"]
                s = index_scores(rotate(iq[0, qr], -f.offset, freqs)[None], iw[:, qr], keys[None])[0]  # [q, w]
                vis = f.offset + (jnp.arange(keys.shape[0]) + 1) * m - 1 <= qr[:, None]
                s = np.asarray(jnp.max(jnp.where(vis, s, -jnp.inf), axis=0))
                all_scores.append(s)
                rows = f.start + np.arange(keys.shape[0] * m)
                scores[rows] = np.repeat(s, m)
            if all_scores:
                conc = concentration(np.concatenate(all_scores), model.cfg.index_topk)
        plan.concentration = conc
        budget = prof.budget_override if prof.budget_override is not None else prof.choose_budget(conc)
        dev = None
        if prof.itop_rank == "deviation":  # the canonical latents against this request's, first reusable layer
            li = self.reusable[0]
            first, freqs = model.layers[li], model.freqs(li)
            xa = first.attn_norm(first.hc_attn.pre(x)[0])
            dev = np.zeros(plan.n_rows)
            for f in plan.candidate_frames:
                rows = slice(f.start, f.start + f.doc_len)
                kv = first.attn.latent(xa[:, rows], jnp.arange(f.doc_len)[None], freqs)[0]
                dev[rows] = np.asarray(latent_deviation(kv, f.artifact.layer(li)["kv"]))
        fill_itop(plan, scores, budget, row_risk(plan, self.reusable), dev)

    def _reusable_layer(self, i: int, blk, x, plan: Plan):
        model, cfg = self.model, self.cfg
        attn, freqs = blk.attn, model.freqs(i)
        t, w = plan.n_rows, cfg.sliding_window
        u, post, comb = blk.hc_attn.pre(x)
        xa = blk.attn_norm(u)  # [1, t, d]
        tpos = jnp.arange(t)
        q, cq = attn.query(xa, tpos[None], freqs)
        q = q[0]
        prot = jnp.asarray(plan.protected)
        collapse = self._frames_collapse(plan)
        frames = online_frames(plan, t) if collapse else plan.frames
        frame_of_row = np.zeros(t, int) if collapse else plan.frame_of_row
        own = [jnp.asarray(frame_of_row == fi) for fi in range(len(frames))]
        doc_rows = np.zeros(t, bool) if collapse else plan.doc_row
        refresh = plan.protected if self.profile.latent_refresh == "protected" else np.zeros(t, bool)
        kinds = cfg.layer_types[i]
        keysets = [self._frame_keys(attn, xa, f, i, freqs, refresh, exact=fi == 0 and plan.prefix > 0)
                   for fi, f in enumerate(frames)]

        sel_native = None
        if kinds == CSA:
            iq, iw = attn.indexer.queries(xa, cq, tpos[None], freqs)
            m = attn.indexer.m
            per = []
            for f, ks in zip(frames, keysets):
                s = index_scores(rotate(iq[0], -f.offset, freqs)[None], iw, ks["idx_entries"][None])[0]
                vis = f.offset + (jnp.arange(ks["idx_entries"].shape[0]) + 1) * m - 1 <= tpos[:, None]
                per.append(jnp.where(vis, s, -jnp.inf))
            allsc = jnp.concatenate(per, axis=1)  # [t, all entries]: scores, not a cache copy
            k = min(attn.indexer.topk, allsc.shape[1])
            if k:
                vals, idx = jax.lax.top_k(allsc, k)
                chosen = jnp.zeros_like(allsc, bool).at[jnp.arange(t)[:, None], idx].set(vals > -jnp.inf)
            else:
                chosen = jnp.zeros_like(allsc, bool)
            sel_native, off = [], 0
            for ks in keysets:
                n = ks["idx_entries"].shape[0]
                sel_native.append(chosen[:, off:off + n])
                off += n

        parts = []
        for fi, (f, ks) in enumerate(zip(frames, keysets)):
            kpos = f.offset + jnp.arange(ks["kv"].shape[0])
            wmask = (kpos[None, :] <= tpos[:, None]) & (kpos[None, :] > tpos[:, None] - w)
            wmask = wmask & (prot[:, None] | own[fi][:, None])  # unprotected: own frame's window only
            keys, masks = [ks["kv"]], [wmask]
            if kinds in (CSA, HCA):
                mm = attn.compressor.m
                ent = ks["entries"]
                vis = f.offset + (jnp.arange(ent.shape[0]) + 1) * mm - 1 <= tpos[:, None]
                if kinds == CSA:
                    mine = jnp.zeros((t, ent.shape[0]), bool)
                    if f.artifact is not None and f.doc_len and not collapse:
                        tk = f.artifact.layer(i)["topk"]  # [doc_len, K] document-local ids
                        rows = jnp.arange(f.start, f.start + f.doc_len)
                        hit = jnp.zeros((f.doc_len, ent.shape[0] + 1), bool).at[
                            jnp.arange(f.doc_len)[:, None], jnp.where(tk >= 0, tk, ent.shape[0])].set(True)
                        mine = mine.at[rows].set(hit[:, : ent.shape[0]])
                    unprot_doc = jnp.asarray(doc_rows) & ~prot
                    cm = jnp.where(unprot_doc[:, None], mine & own[fi][:, None], sel_native[fi]) & vis
                else:
                    cm = vis
                keys.append(ent)
                masks.append(cm)
            kcat = jnp.concatenate(keys, 0).astype(q.dtype)
            mcat = jnp.concatenate(masks, 1)[:, None, :]
            o, lse = partial_attention(rotate(q, -f.offset, freqs), kcat, mcat, attn.k ** -0.5)
            parts.append((rotate(o, f.offset, freqs), lse))  # output-phase restore
        o, _ = merge_partials(parts, attn.attn_sink[...])
        o = apply_rope(o.astype(q.dtype), tpos, freqs, inverse=True)
        z_g = project_heads(attn, o, ~self.local)
        z_l = project_heads(attn, o, self.local)
        if not collapse:
            z_l = self._restore_local(z_l, plan, i)
        y = attn.wo_b_apply((z_g + z_l)[None])
        return HyperConnection.post(x, y.astype(x.dtype), post, comb)

    def _restore_local(self, z_l, plan: Plan, layer: int):
        """Rows replaced by the artifact's z_L: unprotected document rows (never added)."""
        unprot = plan.doc_row & ~plan.protected
        for f in plan.frames:
            if f.artifact is None:
                continue
            rows = np.arange(f.start, f.start + f.doc_len)
            z_art = f.artifact.layer(layer)["zl"].astype(z_l.dtype)
            z_l = z_l.at[rows].set(jnp.where(jnp.asarray(unprot[rows])[:, None, None], z_art, z_l[rows]))
        return z_l

    def _frame_keys(self, attn, xa, f, layer, freqs, refresh, exact: bool = False):
        """A frame's keys in its canonical coordinates: per-row K=V, compressed entries, CSA
        indexer keys. Artifact rows keep their canonical latents unless refreshed; online rows
        (and refreshed windows) are computed from this request's hidden states. `exact`: the
        frame starts with the exact prefix, whose rows are never refreshed, so its windows are
        the artifact's and those after it continue from the artifact's open windows."""
        rows = slice(f.start, f.end)
        n = f.end - f.start
        cpos = jnp.arange(n)
        x_f = xa[:, rows]
        kv = attn.latent(x_f, cpos[None], freqs)[0]
        out = {}
        art = f.artifact.layer(layer) if f.artifact is not None else None
        ref = jnp.asarray(refresh[rows])
        if art is not None:
            use_art = (jnp.arange(n) < f.doc_len) & ~ref
            kv = jnp.where(use_art[:, None], jnp.pad(art["kv"].astype(kv.dtype), ((0, n - f.doc_len), (0, 0))), kv)
        out["kv"] = kv
        for name, mod, state in (("entries", attn.compressor, "cmp"), ("idx_entries", attn.indexer, "idx")):
            if mod is None:
                continue
            comp = mod if name == "entries" else mod.compressor
            m = comp.m
            nw = n // m
            online = _compress(comp, x_f, 0, n, comp.init_state(1), freqs, nw)
            if art is None:
                out[name] = online
                continue
            dw = f.doc_len // m
            cont = _compress(comp, x_f[:, f.doc_len:], f.doc_len, n - f.doc_len,
                             jax.tree.map(lambda a: a[None], art[state]), freqs, nw)
            base = jnp.concatenate([art[name][:dw].astype(online.dtype), cont[dw:]], 0)
            # a window is refreshed if it (or, for CSA, the window whose A halves it pools) holds a
            # refreshed row
            win_ref = jnp.any(ref[: nw * m].reshape(nw, m), axis=1) if nw else jnp.zeros((0,), bool)
            if comp.overlap and nw:
                win_ref = win_ref | jnp.concatenate([jnp.zeros((1,), bool), win_ref[:-1]])
            out[name] = base if exact else jnp.where(win_ref[:, None], online, base)
        return out


def _compress(comp, x, pos0: int, n_new: int, state, freqs, nw: int):
    """Entries [nw, dk] of the windows closed by rows x at canonical pos0.. (others zero)."""
    if x.shape[1] == 0:
        return jnp.zeros((nw, comp.dk), jnp.float32)
    ent, ids, _ = comp(x, jnp.full((1,), pos0, jnp.int32), jnp.full((1,), n_new, jnp.int32), state, freqs)
    buf = jnp.zeros((nw, comp.dk), jnp.float32)
    return buf.at[jnp.where(ids[0] < 0, nw, ids[0])].set(ent[0], mode="drop")

