"""The RedKnot consumer (DESIGN §4, §7): both arms jitted per layer, query-blocked, at serving
scale. `runtime.py` is the eager reference it is tested against (tests/reuse/test_consumer.py).
It reads the documents through a `DocPool` (`pool.py`: hot artifacts packed once per reusable
layer, never copied or rewritten by a request) and a request's `Layout` (`layout.py`: index
tables saying where each row's keys, entries and z_L come from). `Consumer` runs a request
layer by layer through the jitted layer programs (`programs.py`), one compiled program per
distinct layer structure.

The consumer in four modules: `layer.py` the math of a reusable layer (passes A and B,
restoration, `wo_b` once, the FFN by `ffn_rows`), `programs.py` the jitted layers, `decode.py`
what decoding keeps (`DecodeState`) and a decode step's layer, and here the arms: `recompute`,
`prefix`, `redknot` (with the `controller`), `decode_step`, and their batches; `layer_times` /
`layer_traces` profile runs through `_LayerClock`.

An exact prefix (`Plan.prefix`, DESIGN §4) is computed in no layer of the RedKnot arm: only the
rows after it are embedded and run; a fence reads the prefix's native cache from its artifact
(`prefix.native_cache`) and runs those rows as one chunk after it; a reusable layer reads the
prefix's keys, entries and open windows from the pool like any document's.

Steps: each arm has a form that runs a layer at a time (`recompute_steps`, `prefix_steps`,
`redknot_steps`, `redknot_batch_steps`): a generator that yields after each layer's programs are
dispatched and returns what the arm returns, so a server can run other requests' decode steps
between a long prefill's layers (`run_steps` drains one: the arm itself).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.ahead import AheadCompiler
from redknot_jax.config import CSA, HCA
from redknot_jax.indexer import TOPK_STAGES
from redknot_jax.model import block_jit, embed_jit, logits_jit, output_block, split, top_split
from redknot_jax.pallas import DECODE_ONLY, resolve_kernels
from redknot_jax.reuse.arena import DocArena
from redknot_jax.reuse.artifact import local_head_mask
from redknot_jax.reuse.decode import DecodeState
from redknot_jax.reuse.decode_batch import DecodeBatch
from redknot_jax.reuse.layer import SPAN_DOC_ROWS, pass_a_kernels
from redknot_jax.reuse.layout import NEVER, build_layout, common_sizes, frame_rows
from redknot_jax.reuse.planner import Plan, concentration, fill_itop, row_risk
from redknot_jax.reuse.pool import ENTRY_PAD, Buckets, DocPool, HostPool, ceil_to
from redknot_jax.reuse.prefix import PrefixCache, native_cache, prefix_check
from redknot_jax.reuse.programs import (controller_jit, decode_entries_jit, deviation_jit,
                                        native_jit, reusable_batch_jit, reusable_jit, reusable_keys_jit,
                                        reusable_step_jit)


def _shapes(tree) -> tuple:
    """The leaves' shapes and dtypes (a signature for `Consumer._compile_ahead`)."""
    return tuple((np.shape(a), str(getattr(a, "dtype", type(a).__name__))) for a in jax.tree.leaves(tree))


def run_steps(steps):
    """What a steps generator (module doc) returns, run to its end."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class _LayerClock:
    """Per-layer wall time for a profile run: when given a list, waits for each layer's output
    (which serialises host and device, so only profile runs pass one) and appends its seconds.
    `traces` (directory, layer indices): those layers also run inside a `jax.profiler` trace of
    their own, `directory/layer_NN` (started once the previous layer is done, stopped once this
    one is: the trace holds that layer's work only; `redknot_jax.op_profile` summarises it)."""

    def __init__(self, times: list | None, x, traces: tuple[str, Sequence[int]] | None = None):
        if traces is not None and times is None:
            raise ValueError("layer traces are taken in a profile run: pass layer_times too")
        self.times, self.i = times, 0
        self.dir, self.traced = (traces[0], set(traces[1])) if traces is not None else (None, set())
        if times is not None:
            jax.block_until_ready(x)
            self._start()

    def _start(self) -> None:
        if self.i in self.traced:
            jax.profiler.start_trace(os.path.join(self.dir, f"layer_{self.i:02d}"))
        self.t0 = time.perf_counter()

    def lap(self, x) -> None:
        if self.times is not None:
            jax.block_until_ready(x)
            self.times.append(time.perf_counter() - self.t0)
            if self.i in self.traced:
                jax.profiler.stop_trace()
            self.i += 1
            self._start()


class Consumer:
    """Both arms of a model at serving scale: `recompute(req)` and `redknot(req, pool)`."""

    def __init__(self, model, profile, block: int | None = None, kernels: str = "auto", buckets: int = 8,
                 topk_stages: int = TOPK_STAGES, prefix_cache: PrefixCache | None = None, compile_threads: int = 0):
        """kernels: which Mosaic GPU kernels prefills (single or batched) run: see
        `resolve_kernels`; `self.kernels` is the resolved set. A kernel
        named explicitly that the model cannot run is refused here, not silently replaced by its
        reference. buckets: `Buckets.per_octave` of every padded size (rows, protected rows,
        entries, decode capacities, pools), so requests of similar sizes share compiled
        programs; 0 pads to the query block and ENTRY_PAD only. topk_stages: a CSA query block
        scores and selects over the shortest of that many entry prefixes holding what it sees
        (`indexer.select_topk_causal`; the same picks; 1 scores every entry, the form before).
        "sparse_global" (pass A's kernel) runs for requests whose longest document exceeds
        `span_doc_rows` rows; below that pass A's span form is faster (`layer.pass_a_kernels`).
        prefix_cache: where both the prefix arm and the RedKnot arm read an exact prefix's
        native states (`_hot`); None: from the artifact, host arrays copied per request.
        compile_threads: a single request's arms (`recompute`, `prefix`, `redknot`) submit their
        layer programs to an `AheadCompiler` of that many threads as soon as their shapes are
        known (the native layers at the start, the reusable ones once the layout is), so that a
        first request compiles them side by side; 0: each compiles when first reached."""
        # query block: 256 rows at model scale; 32 for the small test models (fewer padded rows)
        block = block or (256 if model.cfg.hidden_size >= 1024 else 32)
        self.model, self.profile, self.cfg, self.block = model, profile, model.cfg, block
        self.buckets = Buckets(buckets)
        self.defs = [split(b) for b in model.layers]
        self.top_def, self.top_state = top_split(model)
        local = local_head_mask(model, profile)
        self.glob = tuple(int(i) for i in np.flatnonzero(~local))
        self.reusable = list(profile.reusable_layers(self.cfg.num_layers))
        self.fences = [i for i in range(self.cfg.num_layers) if i not in self.reusable]  # the prefix states it reads
        self.fan = (profile.fanout_mode, float(profile.tau), int(profile.fanout_min))
        self.ffn_rows = profile.ffn_rows
        self.kernels = resolve_kernels(kernels, model, len(self.glob) // self.cfg.o_groups)
        self.span_doc_rows = SPAN_DOC_ROWS  # pass A: the kernel above documents of this many rows (`_pass_a`)
        self.prefix_cache = prefix_cache
        if not isinstance(topk_stages, int) or topk_stages < 1:
            raise ValueError(f"Consumer: topk_stages must be an int >= 1, got {topk_stages!r}")
        self.topk_stages = topk_stages
        self.ahead = AheadCompiler(compile_threads)

    @property
    def decode_kernels(self) -> str:
        """The kernels of `self.kernels` that a RedKnot decode step's HCA layers run: the segment
        attention ("seg_attention"); the rest of a step is XLA."""
        return ",".join(k for k in self.kernels.split(",") if k in DECODE_ONLY)

    @property
    def prefill_kernels(self) -> str:
        """`self.kernels` less the decode-only ones, so kernel sets that differ only in those
        share the prefill's compiled programs."""
        return ",".join(k for k in self.kernels.split(",") if k not in DECODE_ONLY)

    def pool(self, artifacts, resident: str = "device", host_kind: str = "auto") -> DocPool:
        """The documents' artifacts packed for the RedKnot arm: "device" (hot: every layer on the
        device now) or "host" (prefetched: payloads stay in host memory, streamed per layer;
        `host_kind` as `HostPool`'s)."""
        if resident == "host":
            return HostPool(artifacts, self.reusable, self.model.dtype, host_kind, self.buckets)
        if resident != "device":
            raise ValueError(f"pool: resident must be one of ['device', 'host'], got {resident!r}")
        return DocPool(artifacts, self.reusable, self.model.dtype, self.buckets)

    def arena(self, rows: int, docs: int = 64) -> DocArena:
        """A device arena of `rows` document rows and `docs` documents (`arena.py`): one pool for
        every request, whatever documents it cites; `DocArena.acquire` the request's artifacts
        before running it over the arena, `release` them after its last decode step."""
        rates = {}
        for i in self.reusable:
            attn = self.model.layers[i].attn
            rates[i] = {"entries": attn.compressor.m} if attn.compressor is not None else {}
            if attn.indexer is not None:
                rates[i]["idx_entries"] = attn.indexer.m
        return DocArena(self.reusable, self.model.dtype, rows, docs, rates,
                        unit=math.lcm(self.cfg.csa_rate, self.cfg.hca_rate),
                        topk=self.cfg.index_topk, buckets=self.buckets)

    # -------------------------------------------------------------- pieces
    def _rows(self, n: int) -> int:
        """Padded rows of a request of n rows (its bucket of query blocks)."""
        return self.buckets(n, self.block)

    def _cap(self, n: int) -> int:
        """Cache capacity (rows) for n rows: their bucket, whole HCA windows."""
        return ceil_to(self._rows(n), self.cfg.hca_rate)

    def _layout(self, plan: Plan, pool: DocPool, pad_to: dict | None = None, runs: bool = False, place: bool = True):
        return build_layout(plan, pool, self.profile, self.cfg, self.block, pad_to, self.buckets, runs, place)

    def _pad(self, tokens):
        t_real = len(tokens)
        t = self._rows(t_real)
        ids = jnp.asarray(np.pad(np.asarray(tokens, np.int32), (0, t - t_real)))[None]
        return ids, t, t_real

    def _native(self, i, x, ids, t_real, t, out=(0, 0), ahead: bool = False):
        """t_real: an int, or one per request of the batch; `out`: `_out`'s; ahead: the
        program's compilation submitted (`AheadCompiler`), nothing run."""
        gd, st = self.defs[i]
        args = (st, x, ids, jnp.asarray(np.reshape(t_real, -1), jnp.int32), out[0])
        kw = dict(graphdef=gd, freqs=self.model.freqs(i), block=min(self.block, t), cap=self._cap(t),
                  kernels=self.prefill_kernels, topk_stages=self.topk_stages, rows=out[1])
        return self.ahead.submit(native_jit, args, kw) if ahead else self.ahead(native_jit, args, kw)

    def _out(self, i: int, rows, t: int) -> tuple[int, int]:
        """The rows of layer i's output that are read when `rows` (of t computed rows) are the
        only ones whose logits are, as (row0, count) for `_native` / `_native_cached`: in the
        last layer `model.output_block`'s, in any other (0, 0), every row."""
        return output_block(rows, t, self.block) if i == self.cfg.num_layers - 1 else (0, 0)

    def _compile_ahead(self, layer, layers, *sig) -> None:
        """With compile threads (`AheadCompiler`), for the first request of signature `sig`:
        `layer(i, ahead=True)` for each of `layers`, whose distinct programs then compile side by
        side while the arm runs up to them."""
        if self.ahead.first((layer.__qualname__, tuple(layers)) + sig):
            for i in layers:
                layer(i, ahead=True)

    def last_layer_rows(self, plan: Plan) -> int | None:
        """How many rows the RedKnot arm's last layer computes outputs for (`_out`: a fence
        trims to the logits rows' query block), None for every row (the operator ledger's
        `out_rows`)."""
        n = plan.n_rows - plan.prefix
        if not self.profile.is_fence(self.cfg.num_layers - 1, self.cfg.num_layers):
            return None
        q = self._out(self.cfg.num_layers - 1, plan.query_rows - plan.prefix, self._rows(n))[1]
        return min(q, n) if q else None

    def _embed(self, ids):
        return embed_jit(self.top_state, ids, graphdef=self.top_def)

    def _logits(self, x, rows):
        """Logits of `rows` of x; several rows are padded to a bucket of 8 (one row, a decode
        step's or a single query's, is not: the head would run 8 times)."""
        rows = np.asarray(rows, np.int32).reshape(-1)
        padded = np.r_[rows, np.full(self.buckets(rows.size, 8) - rows.size, rows[-1])] if rows.size > 1 else rows
        return logits_jit(self.top_state, x, jnp.asarray(padded)[None], graphdef=self.top_def)[0, :rows.size]

    def _pass_a(self, layouts) -> dict:
        """A reusable layer's `kernels` and `longest_doc` for these layouts: the rows of their
        longest document, bucketed as rows are (a few compiled programs), size pass A's span form
        (`layer.reusable_attention`); up to `span_doc_rows` rows it runs instead of the kernel
        (`layer.pass_a_kernels`)."""
        longest = self.buckets(max(lay.longest_doc for lay in layouts), self.block)
        return dict(kernels=pass_a_kernels(self.prefill_kernels, longest, self.span_doc_rows), longest_doc=longest)

    def _compact_rows(self, state: DecodeState, plan: Plan, layout, decode_rows: int) -> None:
        """A decode state's compact rows: the prompt layout's own rows, then room for the new rows."""
        state.own = layout.own_rows(plan.n_rows).size
        state.own_cap = self._rows(state.own + decode_rows)

    def _decode_layout(self, state: DecodeState, plan: Plan, layout, decode_rows: int) -> None:
        """A decode state's decode layout: the plan extended by `decode_rows` (`state.plan`). Built
        once the prompt's layers are dispatched (the host builds it while the device runs them)."""
        kept = layout.own_rows(plan.n_rows)
        state.plan = plan.extend(decode_rows)
        state.layout = self._layout(state.plan, state.pool, runs=bool(self.decode_kernels))
        if not np.array_equal(state.layout.own_rows(plan.n_rows), kept):
            raise AssertionError("decode layout: the prompt's compact rows changed")

    # -------------------------------------------------------------- arms
    def _prefix_cap(self, L: int, c: int, n: int) -> int:
        """Cache capacity of a request of n rows (decode rows included) whose exact prefix of L
        rows is followed by c padded computed rows: whole windows of both compression rates."""
        return ceil_to(max(self._cap(n), L + c), math.lcm(self.cfg.hca_rate, self.cfg.csa_rate))

    def _hot(self, artifact, layers=None):
        """Where an exact prefix's native states of `layers` (default all) are read: `artifact`'s
        hot copy in the prefix cache (`prefix.hot_prefix`, made on a miss), or without a cache
        the artifact itself."""
        return artifact if artifact is None or self.prefix_cache is None else self.prefix_cache.get(artifact, layers)

    def _native_cached(self, i, x, ids, pos0, n_real, cap, artifacts, state=None, out=(0, 0), ahead: bool = False):
        """Native layer i over computed rows x [b, C, ...] with a cache of `cap` rows: after each
        request's exact prefix (`artifacts`: one per request, None for a request without one,
        whose pos0 is then 0), the cache rebuilt from the artifact (`prefix.native_cache`); with
        `state` (a `DecodeState`, or one per request of a batch) the cache is kept for decoding;
        `out`: `_out`'s; ahead: as `_native`'s (the cache's shapes only)."""
        gd, st = self.defs[i]
        attn = self.model.layers[i].attn

        def build():
            caches = [native_cache(attn, a.native_state(i), cap, self.model.dtype) if a is not None
                      else attn.init_cache(1, cap, self.model.dtype) for a in artifacts]
            return caches[0] if len(caches) == 1 else jax.tree.map(lambda *c: jnp.concatenate(c), *caches)

        cache = jax.eval_shape(build) if ahead else build()
        args = (st, x, ids, jnp.asarray(pos0, jnp.int32).reshape(-1), jnp.asarray(n_real, jnp.int32).reshape(-1),
                cache, out[0])
        kw = dict(graphdef=gd, freqs=self.model.freqs(i), block=min(self.block, x.shape[1]),
                  kernels=self.prefill_kernels, topk_stages=self.topk_stages, rows=out[1])
        if ahead:
            return self.ahead.submit(block_jit, args, kw)
        x, cache = self.ahead(block_jit, args, kw)
        if isinstance(state, DecodeState):
            state.layers[i] = cache
        elif state is not None:  # a batch: each request's row of the cache
            for b, st_b in enumerate(state):
                st_b.layers[i] = jax.tree.map(lambda c: c[b:b + 1], cache)
        return x

    def recompute(self, tokens, query_rows, layer_times: list | None = None,
                  layer_traces: tuple[str, Sequence[int]] | None = None, decode_rows: int = 0):
        """The Recomputed arm: every layer native over the whole request (logits [q, vocab]),
        and with `decode_rows` > 0 a native `DecodeState` for that many generated rows
        (`decode_step`). `layer_times`: a profile; each layer is waited for and its seconds
        appended; `layer_traces` (directory, layers): those layers traced on their own
        (`_LayerClock`)."""
        return run_steps(self.recompute_steps(tokens, query_rows, layer_times, layer_traces, decode_rows))

    def recompute_steps(self, tokens, query_rows, layer_times=None, layer_traces=None, decode_rows: int = 0):
        """`recompute` a layer at a time (module doc, "steps")."""
        ids, t, t_real = self._pad(tokens)
        x = self._embed(ids)
        clock = _LayerClock(layer_times, x, layer_traces)
        state = DecodeState(t_real, self._cap(t_real + decode_rows), None, native=True) \
            if decode_rows else None

        def layer(i, ahead=False):
            out = self._out(i, query_rows, t)
            return self._native(i, x, ids, t_real, t, out, ahead) if state is None else \
                self._native_cached(i, x, ids, 0, t_real, state.cap, [None], state, out, ahead)

        last = self.cfg.num_layers - 1
        self._compile_ahead(layer, range(last + 1), t, self._out(last, query_rows, t), state and state.cap)
        for i in range(self.cfg.num_layers):
            x = layer(i)
            clock.lap(x)
            yield
        out = self._out(last, query_rows, t)
        logits = self._logits(x, np.asarray(query_rows) - out[0])
        return (logits, state) if decode_rows else logits

    def prefix(self, artifact, tokens, query_rows, decode_rows: int = 0, layer_times: list | None = None,
               layer_traces: tuple[str, Sequence[int]] | None = None):
        """The prefix arm (what a prefix cache gives): `artifact`'s document (tokens[:L]) computed
        in no layer, every layer's cache rebuilt from it (`prefix.native_cache`), the rows
        tokens[L:] run natively as one chunk at pos0 = L. query_rows: request rows (>= L).
        Returns logits [q, vocab] fp32, and with `decode_rows` > 0 also a native `DecodeState`
        (rows = the request length) that `decode_step` continues. `layer_times`: as
        `recompute`'s, `layer_traces` too."""
        return run_steps(self.prefix_steps(artifact, tokens, query_rows, decode_rows, layer_times, layer_traces))

    def prefix_steps(self, artifact, tokens, query_rows, decode_rows: int = 0, layer_times=None, layer_traces=None):
        """`prefix` a layer at a time (module doc, "steps")."""
        tokens = np.asarray(tokens, np.int32)
        prefix_check(artifact, tokens, self.cfg.num_layers)
        n, L = int(tokens.size), artifact.length
        q = np.asarray(query_rows, np.int64).reshape(-1)
        if q.size == 0 or (q < L).any() or (q >= n).any():
            raise ValueError(f"prefix arm: query rows must lie in [{L}, {n}) (after the prefix), got {q.tolist()}")
        ids, t, t_real = self._pad(tokens[L:])
        cap = self._prefix_cap(L, t, n + decode_rows)
        artifact = self._hot(artifact)
        x = self._embed(ids)
        clock = _LayerClock(layer_times, x, layer_traces)
        state = DecodeState(n, cap, None, native=True)

        def layer(i, ahead=False):
            return self._native_cached(i, x, ids, L, t_real, cap, [artifact], state, self._out(i, q - L, t), ahead)

        last = self.cfg.num_layers - 1
        self._compile_ahead(layer, range(last + 1), L, t, cap, self._out(last, q - L, t))
        for i in range(self.cfg.num_layers):
            x = layer(i)
            clock.lap(x)
            yield
        out = self._out(last, q - L, t)
        logits = self._logits(x, q - L - out[0])
        return (logits, state) if decode_rows else logits

    def controller_scores(self, plan: Plan, x):
        """The controller's indexer scores of the candidate documents' windows, dispatched (a
        device array, not read) with those documents; (None, []) with no reusable CSA layer or no
        candidate document of a whole window."""
        cfg = self.cfg
        csa = [i for i in self.reusable if cfg.layer_types[i] == CSA]
        docs = [f for f in plan.candidate_frames if f.doc_len >= cfg.csa_rate]
        if not (csa and docs):
            return None, []
        L, li, m = plan.prefix, csa[0], cfg.csa_rate
        keys = jnp.concatenate([jnp.asarray(f.artifact.layers[li]["idx_entries"]) for f in docs])
        d_e = np.concatenate([np.full(f.doc_len // m, f.offset) for f in docs]).astype(np.int32)
        w_e = np.concatenate([np.arange(f.doc_len // m) for f in docs])
        end_e = d_e + (w_e + 1) * m - 1
        # padded to buckets: entries never visible (scores -inf, then dropped), query rows repeated
        n_e, qr = keys.shape[0], np.asarray(plan.query_rows, np.int32)
        pad_e = self.buckets(n_e, ENTRY_PAD) - n_e
        keys = jnp.pad(keys, ((0, pad_e), (0, 0)))
        d_e, end_e = np.r_[d_e, np.zeros(pad_e, np.int32)], np.r_[end_e, np.full(pad_e, NEVER)]
        qr = np.r_[qr, np.full(self.buckets(qr.size, 8) - qr.size, qr[-1])]
        pd, ps = self.defs[self.reusable[0]]
        cd, cs = self.defs[li]
        return controller_jit(ps, cs, x[:, qr - L], jnp.asarray(qr), keys, jnp.asarray(d_e, jnp.int32),
                              jnp.asarray(end_e, jnp.int32), pre_def=pd, csa_def=cd, freqs=self.model.freqs(li),
                              m=m), docs

    def controller(self, plan: Plan, x, pool: DocPool, pool_layer: dict, scores=None) -> None:
        """Fill Itop and the budget (profile rule) from the native indexer for the query rows;
        with `itop_rank="deviation"` the budget's rows are those of largest `latent_deviation` at
        x, the first reusable layer's input (`pool_layer`: that layer of `pool`). x holds the
        computed rows (after the exact prefix, whose rows are no candidates). `scores`: this
        request's `controller_scores`, dispatched earlier (a batch dispatches all of them first)."""
        cfg, prof = self.cfg, self.profile
        scores = self.controller_scores(plan, x) if scores is None else scores
        s, docs = scores
        conc = 1.0
        L = plan.prefix
        row_score = np.full(plan.n_rows, -np.inf)
        if s is not None:
            m = cfg.csa_rate
            s = np.asarray(s)[:sum(f.doc_len // m for f in docs)]
            off = 0
            for f in docs:
                n = f.doc_len // m
                row_score[f.start:f.start + n * m] = np.repeat(s[off:off + n], m)
                off += n
            conc = concentration(s, cfg.index_topk)
        plan.concentration = conc
        budget = prof.budget_override if prof.budget_override is not None else prof.choose_budget(conc)
        dev = None
        if prof.itop_rank == "deviation":
            rows = L + np.arange(x.shape[1])
            d_row, pool_row = frame_rows(plan.frames, pool, rows[-1] + 1)
            gd, st = self.defs[self.reusable[0]]
            kv = jax.device_put(pool_layer["kv"], x.sharding)  # TP: the controller runs on one device
            dev = np.zeros(plan.n_rows)
            dev[L:] = np.asarray(deviation_jit(st, x, kv, jnp.asarray(pool_row[rows], jnp.int32),
                                               jnp.asarray(rows - d_row[rows], jnp.int32), graphdef=gd,
                                               freqs=self.model.freqs(self.reusable[0])))[:plan.n_rows - L]
        fill_itop(plan, row_score, budget, row_risk(plan, self.reusable), dev)

    def redknot(self, plan: Plan, tokens, pool: DocPool, timings: dict | None = None, frozen: bool = False,
                decode_rows: int = 0, layer_times: list | None = None,
                layer_traces: tuple[str, Sequence[int]] | None = None):
        """The RedKnot arm for a planned request whose artifacts are in `pool`; fills Itop
        (unless the plan is `frozen`: decode continuation keeps the prompt's protected set).
        Returns (logits [q, vocab], fan-out histogram [k+1] over reusable layers and rows), and
        with `decode_rows` > 0 a `DecodeState` for that many generated rows (`decode_step`).
        `layer_times`: a profile; each layer is waited for and its seconds appended (the first
        reusable layer's include the controller and the layout); `layer_traces` (directory,
        layers): those layers traced on their own (`_LayerClock`). An exact prefix
        (`plan.prefix` rows) is computed in no layer (module doc)."""
        return run_steps(self.redknot_steps(plan, tokens, pool, timings, frozen, decode_rows, layer_times,
                                            layer_traces))

    def redknot_steps(self, plan: Plan, tokens, pool: DocPool, timings=None, frozen: bool = False,
                      decode_rows: int = 0, layer_times=None, layer_traces=None):
        """`redknot` a layer at a time (module doc, "steps")."""
        cfg, prof = self.cfg, self.profile
        L, n = plan.prefix, plan.n_rows
        ids, t, t_real = self._pad(np.asarray(tokens)[L:])  # the computed rows
        x = self._embed(ids)
        clock = _LayerClock(layer_times, x, layer_traces)
        hist, layout = None, None
        cap = self._prefix_cap(L, t, n + decode_rows) if L else self._cap(n + decode_rows)
        state = DecodeState(n, cap, pool) if decode_rows else None
        first = self._hot(plan.frames[0].artifact, self.fences) if L else None  # the prefix's fence states

        def fence(i, ahead=False):
            out = self._out(i, plan.query_rows - L, t)
            if L or state is not None:
                return self._native_cached(i, x, ids, L, t_real, cap, [first], state, out, ahead)
            return self._native(i, x, ids, t_real, t, out, ahead)

        def reusable(i, pool_layer, ahead=False):
            gd, st = self.defs[i]
            kw = dict(graphdef=gd, freqs=self.model.freqs(i), glob=self.glob, block=self.block, fan=self.fan,
                      topk_stages=self.topk_stages, ffn_rows=self.ffn_rows, **pass_a)
            fn, args = (reusable_jit, (st, x, ids, layout.tables, pool_layer)) if state is None else \
                (reusable_keys_jit, (st, x, ids, layout.tables, pool_layer, keep_rows))
            return self.ahead.submit(fn, args, kw) if ahead else self.ahead(fn, args, kw)

        last = cfg.num_layers - 1
        self._compile_ahead(fence, self.fences, L, t, cap, state is None, self._out(last, plan.query_rows - L, t))
        for i in range(cfg.num_layers):
            if prof.is_fence(i, cfg.num_layers):
                x = fence(i)
                clock.lap(x)
                yield
                continue
            pool_layer = pool.layers[i]  # read once: a HostPool streams each layer once
            if layout is None:  # the controller reads the first reusable layer's input
                t0 = time.perf_counter()
                if not frozen:
                    self.controller(plan, x, pool, pool_layer)
                t1 = time.perf_counter()
                layout = self._layout(plan, pool)
                pass_a = self._pass_a([layout])
                if layout.c != t:
                    raise AssertionError(f"layout of {layout.c} computed rows for {t} embedded rows")
                if state is not None:
                    self._compact_rows(state, plan, layout, decode_rows)
                    keep_rows = jnp.arange(state.own_cap, dtype=jnp.int32)  # compact rows: the own rows, in order
                if timings is not None:  # host seconds (the controller's include its device read)
                    timings.update(plan_s=time.perf_counter() - t0, controller_s=t1 - t0)
                if self.ahead.pool is not None and not isinstance(pool, HostPool):  # (a host pool's layers
                    # are read once, when run; the signature's shapes cost host time: only with threads)
                    self._compile_ahead(lambda j, ahead: reusable(j, pool.layers[j], ahead), self.reusable,
                                        state is None, _shapes(layout.tables), _shapes(pool_layer),
                                        tuple(sorted(pass_a.items())))
            x, h, *kept = reusable(i, pool_layer)
            if kept:
                state.layers[i] = kept[0]
            hist = h if hist is None else hist + h
            clock.lap(x)
            yield
        if state is not None and layout is not None:
            self._decode_layout(state, plan, layout, decode_rows)
        out = self._out(last, plan.query_rows - L, t) if prof.is_fence(last, cfg.num_layers) else (0, 0)
        logits = self._logits(x, plan.query_rows - L - out[0])
        return (logits, hist, state) if decode_rows else (logits, hist)

    def decode_step(self, token: int, state: "DecodeState") -> jax.Array:
        """Logits [vocab] after one generated `token` appended to a request, reading the earlier
        rows' keys, entries and caches from `state` (from `redknot` or `recompute` with
        `decode_rows`; updated in place) instead of re-running the request: native layers (all
        of a `native` state's; the fences otherwise) decode with their caches, reusable layers
        run the new row (protected: every head over the native key sets) over the cached keys
        and entries, renewing the entries of the new row's windows. Equals the arm over the whole
        extended request (RedKnot's with the plan frozen, `Plan.extend`)."""
        cfg, prof, lay = self.cfg, self.profile, state.layout
        t0 = state.rows
        if state.batch is not None:
            raise ValueError("decode_step: this decode state joined a DecodeBatch, which holds its rows: step the "
                             "batch (a state that left one is spent)")
        if not state.room:
            raise ValueError(f"decode_step: the decode state holds {state.rows} rows and has no room for more")
        if lay is not None and (int(lay.own_slot[t0]) != state.own or state.own >= state.own_cap):
            raise RuntimeError(f"decode_step: row {t0} would be compact row {int(lay.own_slot[t0])}, "
                               f"expected {state.own} of {state.own_cap}")
        ids = jnp.asarray([[token]], jnp.int32)
        x = self._embed(ids)
        for i in range(cfg.num_layers):
            gd, st = self.defs[i]
            if state.native or prof.is_fence(i, cfg.num_layers):
                x, state.layers[i] = block_jit(st, x, ids, jnp.full((1,), t0, jnp.int32), jnp.ones((1,), jnp.int32),
                                               state.layers[i], graphdef=gd, freqs=self.model.freqs(i), block=1)
                continue
            pool_layer = state.pool.layers[i]
            if not state.stepped:  # the first step: the request's entries, once
                state.layers[i] = decode_entries_jit(st, state.layers[i], lay.tables, pool_layer, graphdef=gd,
                                                     freqs=self.model.freqs(i))
            x, state.layers[i] = reusable_step_jit(st, x, ids, lay.tables, pool_layer, state.layers[i],
                                                   jnp.int32(t0), graphdef=gd, freqs=self.model.freqs(i),
                                                   fan=self.fan,
                                                   kernels=self.decode_kernels if cfg.layer_types[i] == HCA else "")
        state.rows += 1
        state.own += lay is not None
        state.stepped = True
        return self._logits(x, [0])[0]

    def decode_batch(self, slots: int) -> DecodeBatch:
        """A batch of `slots` RedKnot decode states stepped together, one jitted call per layer
        (`decode_batch.py`): `join` a state from `redknot` / `redknot_batch` with `decode_rows`."""
        return DecodeBatch(self, slots)

    # -------------------------------------------------------------- batches
    def _pad_batch(self, token_lists, t_min: int = 0):
        """ids [b, t] (each request padded to the batch's common row count), t, real lengths."""
        t_real = [len(x) for x in token_lists]
        t = max(self._rows(max(t_real)), t_min)
        ids = np.stack([np.pad(np.asarray(x, np.int32), (0, t - n)) for x, n in zip(token_lists, t_real)])
        return jnp.asarray(ids), t, t_real

    def _logits_batch(self, x, rows_list):
        r = max(len(q) for q in rows_list)
        rows = np.stack([np.r_[q, np.full(r - len(q), q[-1])] for q in map(np.asarray, rows_list)])
        out = logits_jit(self.top_state, x, jnp.asarray(rows, jnp.int32), graphdef=self.top_def)
        return [out[b, :len(q)] for b, q in enumerate(rows_list)]

    def recompute_batch(self, token_lists, query_rows_list) -> list[jax.Array]:
        """The Recomputed arm for several requests in one jitted call per layer (padded to a
        common row count; each request's real length masks its padding)."""
        ids, t, t_real = self._pad_batch(token_lists)
        x = self._embed(ids)
        for i in range(self.cfg.num_layers):
            x = self._native(i, x, ids, t_real, t)
        return self._logits_batch(x, query_rows_list)

    def redknot_batch(self, plans: list[Plan], token_lists, pool: DocPool, decode_rows: int = 0):
        """The RedKnot arm for several planned requests whose artifacts are all in `pool`, in
        one jitted call per layer: fences natively over the batch, the controller per request
        (its query rows only), layouts padded to the batch's common sizes, a reusable layer's
        attention request by request inside its call (`reusable_batch_jit`: the kernels and the
        staged top-k of a request alone); each request's exact prefix computed in no layer
        (`redknot`). Returns [(logits [q, vocab], fan-out histogram)] per request, equal to
        `redknot` request by request, and with `decode_rows` > 0 each request's `DecodeState` too
        (caches of the batch's common capacity; `decode_step` then runs each request on its own)."""
        return run_steps(self.redknot_batch_steps(plans, token_lists, pool, decode_rows))

    def redknot_batch_steps(self, plans: list[Plan], token_lists, pool: DocPool, decode_rows: int = 0):
        """`redknot_batch` a layer at a time (module doc, "steps")."""
        cfg, prof = self.cfg, self.profile
        Ls = [p.prefix for p in plans]
        ids, t, t_real = self._pad_batch([np.asarray(tk)[L:] for tk, L in zip(token_lists, Ls)])
        x = self._embed(ids)
        hist, tabs, keep_rows = None, None, None
        cap = max(self._prefix_cap(L, t, p.n_rows + decode_rows) for L, p in zip(Ls, plans))
        hot = {id(p.frames[0].artifact): self._hot(p.frames[0].artifact, self.fences)
               for p in plans if p.prefix}  # once a document
        firsts = [hot[id(p.frames[0].artifact)] if p.prefix else None for p in plans]
        states = [DecodeState(p.n_rows, cap, pool) for p in plans] if decode_rows else None
        for i in range(cfg.num_layers):
            if prof.is_fence(i, cfg.num_layers):
                x = self._native_cached(i, x, ids, Ls, t_real, cap, firsts, states) if any(Ls) or states else \
                    self._native(i, x, ids, t_real, t)
                yield
                continue
            pool_layer = pool.layers[i]
            if tabs is None:
                scores = [self.controller_scores(plan, x[b:b + 1]) for b, plan in enumerate(plans)]  # all dispatched
                for b, (plan, sc) in enumerate(zip(plans, scores)):
                    self.controller(plan, x[b:b + 1], pool, pool_layer, sc)
                # host tables, stacked, then one transfer
                first = [self._layout(plan, pool, {"t": 0, "C": t, "P": 0, "K": 0, "rates": {}}, place=False)
                         for plan in plans]
                sizes = common_sizes(first)  # rebuilt only where the batch pads further
                layouts = [lay if lay.sizes() == sizes else self._layout(plan, pool, sizes, place=False)
                           for plan, lay in zip(plans, first)]
                pass_a = self._pass_a(layouts)
                tabs = jax.device_put(jax.tree.map(lambda *a: np.stack(a), *[lay.tables for lay in layouts]))
                if states is not None:  # as `redknot`
                    for plan, lay, st_b in zip(plans, layouts, states):
                        self._compact_rows(st_b, plan, lay, decode_rows)
                    keep_rows = jnp.tile(jnp.arange(max(s.own_cap for s in states), dtype=jnp.int32), (len(plans), 1))
            gd, st = self.defs[i]
            out = reusable_batch_jit(st, x, ids, tabs, pool_layer, keep_rows, graphdef=gd, freqs=self.model.freqs(i),
                                     glob=self.glob, block=self.block, fan=self.fan,
                                     topk_stages=self.topk_stages, ffn_rows=self.ffn_rows, **pass_a)
            x, hb = out[:2]
            if states is not None:  # each request's compact rows, cut to its own capacity
                for b, st_b in enumerate(states):
                    st_b.layers[i] = jax.tree.map(lambda k: k[b, :st_b.own_cap], out[2])
            hist = hb if hist is None else hist + hb
            yield
        if states is not None and tabs is not None:
            for plan, lay, st_b in zip(plans, layouts, states):
                self._decode_layout(st_b, plan, lay, decode_rows)
        logits = self._logits_batch(x, [p.query_rows - p.prefix for p in plans])
        return [(lg, None if hist is None else hist[b]) + ((states[b],) if states else ())
                for b, lg in enumerate(logits)]
