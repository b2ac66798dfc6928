"""One model worker thread behind a bounded queue.

What is batched: plain completions (no documents, or `arm="recompute"`, whose document tokens
are then ordinary prompt tokens) share one decode batch of `slots` sequences: a joining
sequence is prefilled alone (batch 1, in chunks of `prefill_chunk` rows: one shape compiles) and its
cache is spliced into a free slot of the batch cache; every decode step then runs all slots
at once with a per-slot active mask (`Engine.decode(tokens, cache, active)`), so sequences join
and leave between steps (continuous batching). Sampling is per slot on the host (each request
keeps its own temperature, top_p and seed).

A worker step (vLLM's scheduler step, with its `max_num_batched_tokens`): the decode rows of
every running sequence (the plain batch's step, then the document requests'), then prefill
chunks of joining sequences and layers of document prefills, oldest first, while the step's
token budget (`max_batched_tokens`) lasts, at least one chunk or layer a step. A long prompt so
prefills across many steps, and running sequences keep decoding meanwhile (chunked prefill).

Requests citing documents in the RedKnot arm run through `ReuseRuntime` over the device arena
of hot documents (`reuse/arena.py`: one copy of each document whatever set cites it, fixed
shapes so a new set compiles nothing, least recently used documents back to host memory): up
to `reuse_batch` of them waiting at the queue's front prefill together (one jitted call per
layer, `prefill_batch_steps`, each keeping its decode state; the batch run as sub-batches of
powers of two or `reuse_batch`, `runtime.sub_batches`, so few batch sizes compile), a layer at a
time: a layer costs the requests' rows over the model's layers of the step's budget, so a long
document prefill spreads over steps as a chunked prompt does. Each then decodes as a row of the document decode
batch (`reuse/decode_batch.py`, `slots` rows: every member's token in one jitted call per
layer, a step each worker step right after the plain batch's: two calls, not yet one); one
that finds its batch full decodes on its own. Requests in the prefix arm (`arm="prefix"`, what
a prefix cache gives: the first document's artifact an exact prefix, every later row native)
and fallbacks to the Recomputed arm keep native decode states: each moves into a free slot of
the plain batch (its caches spliced in) and decodes as one of its rows. Artifact
builds (`build_artifact`) run whole between two steps. Model work never runs on the event loop: the
HTTP side only enqueues jobs and reads their events.

Warm-up: `server/warmup.py` (`WarmUp`, which the scheduler is).

Back-pressure: `submit` raises `QueueFull` when `max_queue` jobs wait (HTTP 429); document
requests start only while fewer than `slots` of them are in flight (`_next_jobs`), so a rate
beyond the device's fills the queue instead of slowing every running request. Device
memory: a document prefill that runs out of it (`out_of_memory`) while other sequences are in
flight is deferred, its documents still pinned, and prefills again once fewer are in flight (as
vLLM preempts a request when its KV blocks run out); meanwhile no other request starts, so what
is in flight only ends, the queue fills and clients get 429s, not 5xx. A request that runs out
of device memory otherwise (alone on the device, or on the plain path) fails with 503. A batched
document prefill that fails runs its requests one at a time; one out of device memory alone on
the device also caps later batches below its size (`_cap_reuse_batch`, as the warm-up does).
Cancellation: a job's `cancelled` event (set when the client goes away) frees its slot before the next step.
Shutdown: `stop(grace_s)` refuses new jobs, fails queued ones (`ShuttingDown`), lets running
sequences finish for up to `grace_s` seconds, then fails whatever is left, explicitly.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import threading
import time
import traceback

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.generate import Engine, Prefill
from redknot_jax.reuse.arena import ArenaFull
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.break_even import request_tier
from redknot_jax.reuse.certificate import FallbackReason
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.runtime import ReuseRuntime, sub_batches
from redknot_jax.server.jobs import Job, sample_host
from redknot_jax.server.warmup import WarmUp

log = logging.getLogger("redknot.server")


class QueueFull(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    pass


def out_of_memory(e: Exception) -> bool:
    """Whether `e` is the device running out of memory (XLA's RESOURCE_EXHAUSTED, also where it is
    one of the failures another error lists: the autotuner's "All configs failed during profiling")."""
    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


@dataclasses.dataclass
class _Slot:
    """A decoding sequence of the plain batch (`info`: what its "done" event says; None: a plain
    completion's)."""
    job: Job
    last: int
    n: int
    rng: np.random.Generator
    t_last: float
    info: dict | None = None


@dataclasses.dataclass
class _Filling:
    """A sequence whose prompt is being prefilled a chunk per worker step; its slot is held."""
    job: Job
    prefill: Prefill


@dataclasses.dataclass
class _Prefilling:
    """Document requests prefilling, a layer per `next(steps)` (`ReuseRuntime.prefill_steps` or,
    several together, `prefill_batch_steps`); `cost`: a layer's share of the step's token
    budget; `dropped`: jobs that left (cancelled, or failed by shutdown)."""
    preps: list
    steps: object
    cost: int
    dropped: set = dataclasses.field(default_factory=set)

    def live(self) -> int:
        """Requests still prefilling in the group."""
        return len(self.preps) - len(self.dropped)


@dataclasses.dataclass
class _Reuse:
    """A document request generating (`Scheduler._generation`): `gen` is sent the logits of its
    next row (None: it computes them itself) and yields after each token; `arts` pinned in the
    arena; `slot` its row of the document decode batch (None: it decodes on its own); `last` its
    last token (None until its first)."""
    job: Job
    gen: object
    arts: list
    slot: int | None = None
    last: int | None = None


class Scheduler(WarmUp):
    def __init__(self, engine: Engine, runtime: ReuseRuntime, metrics, *, slots: int = 8, max_queue: int = 64,
                 checkpoint_fingerprint: str = "", store_root: str | None = None, prefill_chunk: int = 2048,
                 warmup=None, arena_rows: int = 16384, arena_docs: int = 64, break_even=None, reuse_batch: int = 4,
                 max_batched_tokens: int = 2048, warmup_documents=(), max_new_tokens: int | None = None):
        """warmup, warmup_documents: `WarmUp._init_warmup`'s. max_batched_tokens: a worker step's
        token budget (decode rows + prefill chunk rows; at least one chunk runs). max_new_tokens:
        the most tokens a request may ask for; document requests' decode states are made for that
        many (one set of shapes, whatever a request asks), else (None) for each request's own."""
        self.eng, self.rt, self.metrics = engine, runtime, metrics
        # one compiled prefill program: prompts run in chunks of this many rows (the last one
        # padded), the largest power of two within both the flag and the cache's capacity
        self.prefill_chunk = 1 << (min(prefill_chunk, engine.capacity).bit_length() - 1)
        if isinstance(max_batched_tokens, bool) or not isinstance(max_batched_tokens, int) or max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens: expected a positive int, got {max_batched_tokens!r}")
        self.max_batched_tokens = max_batched_tokens
        self._init_warmup(warmup, warmup_documents)
        self.max_new_tokens = max_new_tokens
        self.store_root, self._stores = store_root, {}
        self.slots_n, self.max_queue, self.fp = slots, max_queue, checkpoint_fingerprint
        self._cond = threading.Condition()
        self._pending: collections.deque[Job] = collections.deque()
        self._slots: list[_Slot | _Filling | None] = [None] * slots
        self._prefilling: list[_Prefilling] = []  # document requests prefilling, oldest first
        self._reuse: list[_Reuse] = []  # document requests decoding, oldest first
        # document requests whose prefill ran out of device memory beside others in flight, oldest first, each with
        # that number of others: restarted once fewer are in flight (`_resume_deferred`)
        self._deferred: list[tuple[dict, int]] = []
        self._stopping = False
        self._deadline = None
        self._thread: threading.Thread | None = None
        self.cache = engine.new_cache(slots)
        self._splice = jax.jit(lambda big, one, i: jax.tree.map(
            lambda b, o: jax.lax.dynamic_update_index_in_dim(b, o[0], i, 0), big, one), donate_argnums=(0,))
        self.alive = False
        self.break_even = break_even  # reuse.break_even.BreakEven: picks the arm of "auto" requests, or None
        self.set_reuse_batch(reuse_batch)
        # batched document prefills that failed and ran one at a time instead, by (batch size, out of device memory)
        self.split_batches: collections.Counter = collections.Counter()
        # the hot tier: one device arena of documents for every document request (reuse/arena.py)
        self.arena = runtime.consumer.arena(arena_rows, arena_docs) if runtime is not None else None
        if self.arena is not None:
            metrics.watch_arena(self.arena)
            metrics.watch_prefix_cache(runtime.prefix_cache)
        # document requests in the RedKnot arm decode as rows of one batch of `slots` (reuse/decode_batch.py)
        self.decoding = runtime.consumer.decode_batch(slots) if runtime is not None else None

    def set_reuse_batch(self, n: int) -> None:
        """At most `n` document requests waiting together prefill in one batch, in the sizes
        `batch_sizes` (powers of two, and n; runtime.sub_batches): few compiled programs. Never
        more than `slots` (no more are in flight, `_next_jobs`), so the warm-up compiles no batch
        size that cannot run."""
        if n > self.slots_n:
            log.info("document batches capped at --slots %d (not %d): no more document requests are in flight",
                     self.slots_n, n)
            n = self.slots_n
        self.reuse_batch = n
        self.batch_sizes = tuple(sorted({1 << k for k in range(1, n.bit_length()) if 1 << k < n} | {n}))

    # ------------------------------------------------------------------ event-loop side
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise ShuttingDown("server is shutting down")
            self.check_ready()
            if len(self._pending) >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(f"queue full ({self.max_queue} requests waiting); retry later")
            self._pending.append(job)
            self.metrics.queue_depth.set(len(self._pending))
            self._cond.notify()

    def start(self) -> None:
        self.alive = True
        self._thread = threading.Thread(target=self._run, name="redknot-model-worker", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._deadline = time.perf_counter() + grace_s
            while self._pending:
                self._pending.popleft().emit("error", 503, "server is shutting down; request not started")
            self.metrics.queue_depth.set(0)
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(grace_s + 30)

    # ------------------------------------------------------------------ worker
    def _active(self) -> int:
        """Sequences in flight: slots held (decoding or prefilling), document requests generating,
        and those deferred (`_deferred`)."""
        return self._in_flight() + len(self._deferred)

    def _in_flight(self) -> int:
        """Sequences holding device memory: slots held and document requests prefilling or decoding."""
        return sum(s is not None for s in self._slots) + len(self._reuse) + self._prefill_requests()

    def _documents_in_flight(self) -> int:
        """Document requests prefilling, deferred, or decoding (in their batch, on their own, or as
        rows of the plain batch: the prefix arm's and fallbacks')."""
        return (len(self._reuse) + len(self._deferred) + self._prefill_requests()
                + sum(s is not None and s.job.kind == "reuse" for s in self._slots))

    def _prefill_requests(self) -> int:
        return sum(g.live() for g in self._prefilling)

    def _run(self) -> None:
        try:
            if self.warmup_lengths:
                try:
                    if not self._warm():
                        return
                finally:
                    self.warmed.set()
            while True:
                with self._cond:
                    while not self._pending and not self._active() and not self._stopping:
                        self._cond.wait()
                    if self._stopping and (not self._active() or time.perf_counter() > self._deadline):
                        break
                    free = [i for i, s in enumerate(self._slots) if s is None]
                    admit, special = self._next_jobs(len(free))
                    self.metrics.queue_depth.set(len(self._pending))
                for job, slot in zip(admit, free):  # outside the lock: submissions are not held up
                    self._guard(job, self._admit, job, slot)
                if special is not None:
                    if special[0].kind == "reuse":
                        self._start_reuse(special)  # fails each request on its own
                    else:
                        self._guard(special[0], self._run_build, special[0])
                self._step()
                self.metrics.active.set(self._active())
        except Exception:  # the worker must never die silently
            log.error("model worker crashed:\n%s", traceback.format_exc())
        finally:
            self.alive = False
            for i, s in enumerate(self._slots):
                if s is not None:
                    s.job.emit("error", 503, "server is shutting down; generation stopped")
                    self._slots[i] = None
            for r in self._reuse:
                r.job.emit("error", 503, "server is shutting down; generation stopped")
                self.arena.release(r.arts)
            self._reuse.clear()
            for g in self._prefilling:
                for p in g.preps:
                    if p["job"] not in g.dropped:
                        p["job"].emit("error", 503, "server is shutting down; generation stopped")
                        self.arena.release(p["arts"])
            self._prefilling.clear()
            for p, _ in self._deferred:
                p["job"].emit("error", 503, "server is shutting down; request not started")
                self.arena.release(p["arts"])
            self._deferred.clear()
            with self._cond:
                while self._pending:
                    self._pending.popleft().emit("error", 503, "server is shutting down; request not started")

    def _next_jobs(self, free: int) -> tuple[list[Job], list[Job] | None]:
        """The jobs the worker starts now, first in first out (called holding the lock): plain ones
        into the `free` slots of the plain batch, up to the first other job, which starts alone
        (an artifact build) or with the document requests queued behind it (up to `reuse_batch`,
        prefilling together). Document requests in flight (prefilling, decoding, deferred) stay
        within `slots`, the rows of their decode batch, as vLLM's `max_num_seqs` bounds running
        sequences: at a rate the device cannot sustain, the queue fills and clients get 429s
        rather than every request slowing down. None starts while one is deferred for device
        memory (it is older): what is in flight only ends."""
        admit, special = [], None
        room = len(self._slots) - self._documents_in_flight()
        while self._pending and not self._deferred:
            j = self._pending[0]
            if j.kind == "plain":
                if len(admit) >= free:
                    break
                admit.append(self._pending.popleft())
                continue
            if j.kind == "reuse" and room < 1:
                break
            special = [self._pending.popleft()]
            while (special[0].kind == "reuse" and self._pending and len(special) < min(self.reuse_batch, room)
                   and self._pending[0].kind == "reuse"):
                special.append(self._pending.popleft())
            break
        return admit, special

    def _step(self) -> None:
        """One worker step: the decode rows (a step of the plain batch, a token of each document
        request), then prefill chunks of joining sequences and layers of document prefills, oldest
        first, within what is left of `max_batched_tokens` (at least one chunk or layer)."""
        plain = sum(isinstance(s, _Slot) for s in self._slots)
        budget = self.max_batched_tokens - plain - len(self._reuse)
        # the plain batch's step is dispatched first and read back after the document requests'
        # step is dispatched: the device runs one while the host prepares the other
        pending = self._decode_dispatch()
        self._reuse_step()
        if pending is not None:
            self._decode_finish(*pending)
        filling = sorted((i for i, s in enumerate(self._slots) if isinstance(s, _Filling)),
                         key=lambda i: self._slots[i].job.t_submit)
        ran = 0
        for i in filling:
            while isinstance(self._slots[i], _Filling) and (ran == 0 or budget >= self.prefill_chunk):
                self._guard(self._slots[i].job, self._fill, i)
                budget -= self.prefill_chunk
                ran += 1
            if budget < self.prefill_chunk:
                break
        self._resume_deferred()
        for g in list(self._prefilling):
            while g in self._prefilling and (ran == 0 or budget >= g.cost):
                self._prefill_layer(g)
                budget -= g.cost
                ran += 1
            if g in self._prefilling:
                break

    def _guard(self, job: Job, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # one bad job fails itself, not the server
            self._fail(job, e)

    def _resume_deferred(self) -> None:
        """The oldest deferred document request prefills again once fewer sequences are in flight
        than when its prefill ran out of device memory (one a step); a cancelled one leaves,
        unpinning its documents; past the shutdown grace each fails with 503."""
        late = self._past_grace()
        for p, others in list(self._deferred):
            if self._leaves(p["job"], late, "request not started"):
                self._deferred.remove((p, others))
                self.arena.release(p["arts"])
        if self._deferred and self._in_flight() < self._deferred[0][1]:
            p, _ = self._deferred.pop(0)
            self._prefilling.insert(0, self._prefill_group([p]))

    def _count_cancel(self, job: Job) -> None:
        if not job.by_stop:
            self.metrics.cancelled.inc()

    def _past_grace(self) -> bool:
        """Whether the shutdown's grace period is over (`stop`): what is still running fails."""
        with self._cond:
            return self._stopping and time.perf_counter() > self._deadline

    def _leaves(self, job: Job, late: bool, what: str) -> bool:
        """Whether a document request leaves now: its client went away (counted), or `late` (past
        the shutdown grace: a 503 saying `what` of it)."""
        if job.cancelled.is_set():
            self._count_cancel(job)
            return True
        if late:
            job.emit("error", 503, f"server is shutting down; {what}")
            return True
        return False

    def _token(self, job: Job, tok: int, n: int, t_prev: float | None, arm: str) -> str | None:
        """Emit one token; return the finish reason if the sequence ends here."""
        now = time.perf_counter()
        if t_prev is None:
            job.ttft_s = now - job.t_submit
            self.metrics.ttft.labels(arm).observe(job.ttft_s)
        else:
            self.metrics.itl.labels(arm).observe(now - t_prev)
        job.emit("token", tok)
        if tok in job.stop_ids:
            return "stop"
        if n >= job.sampling.max_tokens:
            return "length"
        return None

    def _admit(self, job: Job, slot: int) -> None:
        """A plain job takes `slot`; its prompt is prefilled a chunk per step (`_fill`)."""
        if job.cancelled.is_set():
            self._count_cancel(job)
            return
        self._slots[slot] = _Filling(job, Prefill(self.eng, [job.tokens], chunk=self.prefill_chunk))

    def _fill(self, slot: int) -> None:
        """The next prefill chunk of the sequence joining at `slot`; after the last, its cache is
        spliced into the batch cache, its first token sampled, and it decodes from the next step.
        A failure or a cancellation frees the slot."""
        f = self._slots[slot]
        self._slots[slot] = None  # held again below unless it ends here
        if f.job.cancelled.is_set():
            self._count_cancel(f.job)
            return
        if not f.prefill.step():
            self._slots[slot] = f
            return
        self.cache = self._splice(self.cache, f.prefill.cache, slot)
        self._start_decoding(f.job, np.asarray(f.prefill.last[0]), slot)

    def _start_decoding(self, job: Job, row: np.ndarray, slot: int) -> None:
        rng = np.random.default_rng(job.sampling.seed)
        tok = sample_host(row, job.sampling, rng)
        fin = self._token(job, tok, 1, None, job.arm)
        if fin is not None:
            job.emit("done", fin, {"arm": job.arm, "cached_tokens": 0})
            return
        self._slots[slot] = _Slot(job, tok, 1, rng, time.perf_counter())

    def _prefill_slot(self, tokens, slot: int) -> np.ndarray:
        """Prefill one prompt (batch 1, chunked) into `slot` of the batch cache; its last row's
        logits [vocab] on the host. The warm-up's admission: the chunk, splice and logits programs
        an admission runs over several steps (`_fill`), run back to back."""
        logits, one = self.eng.prefill([tokens], chunk=self.prefill_chunk)
        self.cache = self._splice(self.cache, one, slot)
        return np.asarray(logits[0])

    def _decode_batch(self, toks: np.ndarray, active: np.ndarray) -> jax.Array:
        """One batched decode step of every slot (inactive ones not written), dispatched: logits
        [slots, vocab] on the device. What a decode step and the warm-up run."""
        logits, self.cache = self.eng.decode(toks, self.cache, active)
        return logits

    def _decode_dispatch(self) -> tuple | None:
        """The plain batch's decode step dispatched (cancelled sequences leave first): (logits on
        the device, the active mask), or None when no sequence decodes."""
        toks = np.zeros(self.slots_n, np.int32)
        active = np.zeros(self.slots_n, np.int32)
        for i, s in enumerate(self._slots):
            if not isinstance(s, _Slot):
                continue
            if s.job.cancelled.is_set():
                self._count_cancel(s.job)
                self._slots[i] = None
                continue
            toks[i], active[i] = s.last, 1
        if not active.any():
            return None
        self.metrics.batch_rows.observe(int(active.sum()))
        try:
            return self._decode_batch(toks, active), active
        except Exception as e:
            self._decode_failed(e)
            return None

    def _decode_finish(self, logits, active: np.ndarray) -> None:
        """The dispatched step's logits read back; each active sequence samples its token."""
        try:
            logits = np.asarray(logits)
        except Exception as e:  # an error raised on the device surfaces here
            self._decode_failed(e)
            return
        for i, s in enumerate(self._slots):
            if not isinstance(s, _Slot) or not active[i]:
                continue
            tok = sample_host(logits[i], s.job.sampling, s.rng)
            s.n += 1
            fin = self._token(s.job, tok, s.n, s.t_last, s.job.arm)
            s.last, s.t_last = tok, time.perf_counter()
            if fin is not None:
                s.job.emit("done", fin, s.info or {"arm": s.job.arm, "cached_tokens": 0})
                self._slots[i] = None

    def _decode_failed(self, e: Exception) -> None:
        """The batch cache is lost: every decoding sequence with it; a fresh cache replaces it."""
        log.error("decode step failed:\n%s", traceback.format_exc())
        for i, s in enumerate(self._slots):
            if isinstance(s, _Slot):
                s.job.emit("error", 500, f"internal error in decode: {type(e).__name__}: {e}")
                self._slots[i] = None
        self.cache = self.eng.new_cache(self.slots_n)

    # ------------------------------------------------------------------ special jobs
    def _ensure_artifact(self, doc) -> str | None:
        """Give `doc` its artifact; returns where it came from when it was not in memory: "disk"
        (the artifact store: verified read) or "built" (constructed now, then published to the
        store when there is one). A store miss or a failed verification is counted by reason
        in the certification counters and the artifact is rebuilt."""
        if doc.artifact is not None:
            return None
        rt, store = self.rt, self._store(doc.tenant)
        if store is not None:
            got = store.lookup_for_request(doc.tokens, rt.profile, rt.cfg, self.fp, tp=rt.tp,
                                           min_generation=rt.min_generation)
            if not isinstance(got, FallbackReason):
                doc.artifact = got
                return "disk"
            if got != FallbackReason.UNKNOWN_ARTIFACT:
                log.warning("document %s: stored artifact unusable (%s); rebuilding", doc.id[:12], got.value)
        doc.artifact = build_artifact(rt.model, rt.profile, doc.tokens, checkpoint_fingerprint=self.fp,
                                      kernels=rt.consumer.kernels)
        if store is not None:
            store.publish(doc.artifact)  # a new generation; readers of an older one are unaffected
        return "built"

    def _store(self, tenant: str):
        """The tenant's own artifact store (no sharing of stored artifacts across tenants, so
        a build's timing says nothing about another tenant's documents: vLLM's cache_salt)."""
        if self.store_root is None:
            return None
        key = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        if key not in self._stores:
            from redknot_jax.store import ArtifactStore

            self._stores[key] = ArtifactStore(os.path.join(self.store_root, key))
        return self._stores[key]

    def _acquire(self, docs, fetched) -> list:
        """The cited documents' artifacts, resident in the device arena (the hot tier) and pinned
        until `arena.release`: a document resident already (cited before, by any request, in any
        set) is a hit; the others are written in now, evicting the least recently used unpinned
        ones. Each cited artifact is counted by the tier it came from (`fetched`: what
        `_ensure_artifact` said). `ArenaFull` if they do not fit beside the documents pinned by
        requests in flight."""
        arts = [d.artifact for d in docs]
        resident = [self.arena.resident(a) for a in arts]
        self.arena.acquire(arts)
        for where, hot in zip(fetched, resident):
            self.metrics.artifact_tier.labels("device" if hot else (where or "host")).inc()
        return arts

    def _run_build(self, job: Job) -> None:
        self._ensure_artifact(job.doc)
        job.emit("done", "built", {})

    # ------------------------------------------------------------------ document requests: prepared, prefilled a
    # layer per step (_prefill_layer), then decoded in the document decode batch or the plain one (_generation)
    def _start_reuse(self, jobs: list[Job]) -> None:
        """Requests citing documents, RedKnot arm (each falls back to recomputation, counted, when
        an artifact fails certification), made ready and queued to prefill a layer at a time
        (`_prefill_layer`, from `_step`): those certified and resident in the device arena together, one
        jitted call per layer (`ReuseRuntime.prefill_batch_steps`, each keeping its decode
        state); a lone one or a fallback on its own (`prefill_steps`). Decoding after the first
        token follows `ReuseRuntime.generate` (plan frozen, generated tokens appended as
        protected new rows, each over the prompt's cached keys) with each request's sampling, a
        token per worker step. Its certified documents stay pinned in the arena until the
        request ends (cancelled or not); when they do not fit there, it runs the Recomputed arm,
        counted as ARENA_FULL. One request's failure fails that request only."""
        ready = []
        for job in jobs:
            try:
                prep = self._prepare(job)
            except Exception as e:
                self._fail(job, e)
                continue
            if prep is not None:
                ready.append(prep)
        batch = [p for p in ready if p["pool"] is not None]
        groups = [batch] if len(batch) > 1 else []
        groups += [[p] for p in ready if len(batch) < 2 or p["pool"] is None]
        self._prefilling += [self._prefill_group(g) for g in groups]

    def _prefill_group(self, preps: list[dict]) -> _Prefilling:
        """Requests' prefill as steps of a layer each (of each sub-batch, `sub_batches`); a step's
        share of the token budget is the requests' rows over the steps."""
        decode_rows = self._decode_rows(max(p["job"].sampling.max_tokens for p in preps))
        parts = 1
        if len(preps) > 1:
            steps = self.rt.prefill_batch_steps([p["req"] for p in preps], "redknot", pool=self.arena,
                                                decode_rows=decode_rows, batch_sizes=self.batch_sizes)
            parts = len(sub_batches(len(preps), self.batch_sizes))
        else:
            p = preps[0]
            steps = self.rt.prefill_steps(p["req"], p["arm"], pool=p["pool"], decode_rows=decode_rows)
        rows = sum(int(p["req"].tokens.size) for p in preps)
        return _Prefilling(preps, steps, max(1, rows // (self.rt.cfg.num_layers * parts)))

    def _cap_reuse_batch(self, n: int) -> None:
        """A batch of `n` requests ran out of device memory with nothing else in flight: it never
        fits, so later batches stay below its largest sub-batch (as the warm-up caps them) rather
        than failing and splitting every time."""
        top = sub_batches(n, self.batch_sizes)[0]
        fits = max([b for b in self.batch_sizes if b < top], default=1)
        if fits < self.reuse_batch:
            log.warning("a batch of %d document requests ran out of device memory alone on the device; document "
                        "batches capped at %d", n, fits)
            self.set_reuse_batch(fits)

    def _decode_rows(self, max_tokens: int) -> int:
        """Rows a document request's decode state is made for: `max_new_tokens` - 1 when the
        server sets it (one set of shapes), else the request's own."""
        return max(0, (self.max_new_tokens or max_tokens) - 1)

    def _prefill_layer(self, g: _Prefilling) -> None:
        """The next layer of a document prefill. At its end each request still wanted gets its
        first token (`_generation`) and decodes from the next step. A cancelled request leaves
        the group (a group left empty stops); past the shutdown grace every request fails with
        503; a failure fails the request, or splits a batch into requests prefilling alone."""
        late = self._past_grace()
        for p in g.preps:
            if p["job"] not in g.dropped and self._leaves(p["job"], late, "generation stopped"):
                g.dropped.add(p["job"])
                self.arena.release(p["arts"])
        if not g.live():
            g.steps.close()
            self._prefilling.remove(g)
            return
        try:
            next(g.steps)
            return
        except StopIteration as end:
            results = end.value
        except Exception as e:
            at = self._prefilling.index(g)
            if len(g.preps) > 1:  # each then prefills on its own (and fails alone if it must)
                log.error("batched document prefill failed; prefilling one at a time:\n%s", traceback.format_exc())
                self.split_batches[len(g.preps), out_of_memory(e)] += 1
                if out_of_memory(e) and self._in_flight() == g.live():
                    self._cap_reuse_batch(len(g.preps))
                self._prefilling[at:at + 1] = [self._prefill_group([p]) for p in g.preps if p["job"] not in g.dropped]
            else:
                del self._prefilling[at]
                g.steps.close()
                p, others = g.preps[0], self._in_flight()
                if out_of_memory(e) and others:  # retried when fewer are in flight, as a preempted vLLM request is
                    log.warning("document prefill ran out of device memory beside %d sequences in flight; deferred "
                                "until fewer are: %s", others, str(e).splitlines()[0][:200])
                    self._deferred.append((p, others))
                    self.metrics.deferred.inc()
                else:
                    self._fail(p["job"], e)
                    self.arena.release(p["arts"])
            return
        self._prefilling.remove(g)
        if len(g.preps) > 1:
            self.metrics.reuse_batch.observe(len(g.preps))
        for p, first in zip(g.preps, results if len(g.preps) > 1 else [results]):
            if p["job"] in g.dropped:
                continue
            r = _Reuse(p["job"], None, p["arts"])
            r.gen = self._generation(r, p, first)
            self._reuse.append(r)
            self._advance(r)

    def _reuse_step(self) -> None:
        """One token of each document request decoding: the decode batch's members in one
        batched step, the others each on its own. One that ends (done, cancelled, failed, or past
        the shutdown grace) leaves the batch and unpins its documents. A failed batched step fails
        its members (their rows were in it), not the others."""
        late = self._past_grace()
        for r in list(self._reuse):
            if self._leaves(r.job, late, "generation stopped"):
                self._end(r)
        old = list(self._reuse)
        members = [r for r in old if r.slot is not None]
        if members:
            toks = np.zeros(self.decoding.slots, np.int32)
            for r in members:
                toks[r.slot] = r.last
            self.metrics.reuse_decode_rows.observe(len(members))
            try:
                logits = np.asarray(self.decoding.step(toks))
            except Exception as e:
                log.error("batched document decode step failed:\n%s", traceback.format_exc())
                for r in members:
                    r.job.emit("error", 500, f"internal error in decode: {type(e).__name__}: {e}")
                    self._end(r)
                self.decoding = self.rt.consumer.decode_batch(self.decoding.slots)
                members = []
            for r in members:
                self._advance(r, logits[r.slot])
        for r in old:
            if r.slot is None and r in self._reuse:
                self._advance(r, None)

    def _advance(self, r: _Reuse, logits=None) -> None:
        """The request's next token (its first if it has none yet); it ends when its generation
        does or fails."""
        try:
            if r.last is None:
                next(r.gen)
            else:
                r.gen.send(logits)
            return
        except StopIteration:
            pass
        except Exception as e:
            self._fail(r.job, e)
        self._end(r)

    def _end(self, r: _Reuse) -> None:
        self._reuse.remove(r)
        r.gen.close()
        if r.slot is not None:
            self.decoding.leave(r.slot)
        self.arena.release(r.arts)

    def _fail(self, job: Job, e: Exception) -> None:
        """A failed job: 503 when the device ran out of memory for it, else 500."""
        log.error("job failed:\n%s", traceback.format_exc())
        if out_of_memory(e):
            job.emit("error", 503, "the device ran out of memory for this request: a shorter prompt, fewer documents "
                                   f"or a later retry may fit ({str(e).splitlines()[0][:200]})")
        else:
            job.emit("error", 500, f"internal error: {type(e).__name__}: {e}")

    def _engine_cache(self, st) -> dict:
        """A native decode state's caches as the plain batch's cache of one sequence: each array
        padded to the engine's capacity, or cut to it (rows past `max_model_len` are never
        written)."""
        want = jax.eval_shape(lambda: self.eng.new_cache(1))["layers"]

        def fit(a, shape):
            a = a[tuple(slice(0, n) for n in shape.shape)]
            return jnp.pad(a, [(0, n - m) for m, n in zip(a.shape, shape.shape)]).astype(shape.dtype)

        layers = [jax.tree.map(fit, st.layers[i], want[i]) for i in range(len(want))]
        return {"length": jnp.full((1,), st.rows, jnp.int32), "layers": layers}

    def _prepare(self, job: Job) -> dict | None:
        """A document request made ready to prefill: its arm chosen (an "auto" request the
        table sends to the Recomputed arm goes back to the queue's front as a plain job: None),
        artifacts fetched, certified ones pinned in the arena; None if it was cancelled."""
        if job.cancelled.is_set():
            self._count_cancel(job)
            return None
        choice = self._choose_arm(job)
        if choice is not None and choice["arm"] == "recompute":  # through the continuous batch, next
            job.kind, job.arm = "plain", "recompute"
            job.tokens = [t for d in job.docs for t in np.asarray(d.tokens).tolist()] + list(job.tokens)
            job.emit("info", {"arm": "recompute", "arm_choice": choice, "cached_tokens": 0})
            with self._cond:
                self._pending.appendleft(job)
            return None
        prompt = Segment(np.asarray(job.tokens, np.int32))
        if job.arm == "prefix":  # a prefix cache: the first document's artifact, every later row native
            self._ensure_artifact(job.docs[0])
            segs = [Segment(np.asarray(d.tokens, np.int32), d.artifact if k == 0 else None)
                    for k, d in enumerate(job.docs)]
            return {"job": job, "req": Request(segs + [prompt]), "arts": [], "pool": None, "arm": "prefix",
                    "detail": "", "choice": None}  # certified by the runtime's prefix arm (fallback counted)
        fetched = [self._ensure_artifact(d) for d in job.docs]
        segs = [Segment(np.asarray(d.tokens, np.int32), d.artifact) for d in job.docs]
        req = Request(segs + [prompt])
        prep = {"job": job, "req": req, "arts": [], "pool": None, "arm": "redknot", "detail": "", "choice": choice}
        if self.rt.certify(req) is None:  # only certified artifacts enter the arena (each hashed once)
            try:
                prep["arts"], prep["pool"] = self._acquire(job.docs, fetched), self.arena
            except ArenaFull as e:  # served, recomputed: counted like a certificate fallback
                log.warning("document request recomputed: %s", e)
                self.rt.counters.record_fallback(FallbackReason.ARENA_FULL)
                prep.update(req=Request([Segment(s.tokens) for s in req.segments]), arm="recompute", detail=str(e))
        return prep  # a certificate that fails: the runtime falls back at prefill, counted

    def _choose_arm(self, job: Job) -> dict | None:
        """For an "auto" request with a break-even table: the arm it says reaches the first token
        sooner at this length and the request's tier (its slowest document: resident in the arena,
        in host memory, or to be read or built), counted by arm and tier; else None (RedKnot)."""
        if job.arm != "auto" or self.break_even is None:
            return None
        tiers = ["disk" if d.artifact is None else "device" if self.arena.resident(d.artifact) else "host"
                 for d in job.docs]
        tokens = sum(len(d.tokens) for d in job.docs) + len(job.tokens)
        c = self.break_even.choose(request_tier(tiers), tokens)
        self.metrics.arm_choice.labels(c.arm, c.tier).inc()
        return c.to_dict()

    def _generation(self, r: _Reuse, prep: dict, first):
        """One document request's generation (`_Reuse`) after its prefill (`first`): at the first
        `next` its info event and first token; then a native decode state (the prefix arm's, a
        fallback's) moves into a free slot of the plain batch (its generation here ends), and a
        RedKnot one joins the document decode batch when it has a free slot; then at each
        `send(logits)` a token (logits None: from its own decode state)."""
        job, req, pool, detail = prep["job"], prep["req"], prep["pool"], prep["detail"]
        arm = first.arm
        fallback = first.fallback or (FallbackReason.ARENA_FULL if detail else None)
        info = {"arm": arm, "fallback": fallback.value if fallback else None,
                "fallback_detail": first.fallback_detail or detail, "cached_tokens": 0, "arm_choice": prep["choice"]}
        if arm == "prefix":  # the first document's rows: computed in no layer
            info["cached_tokens"] = int(req.segments[0].tokens.size)
        if first.ledgers is not None:
            plan = first.plan
            # rows not computed: the exact prefix's, and the documents' rows restored from artifacts
            cached = int(plan.prefix + plan.candidates - (plan.protected & plan.doc_row).sum())
            led = first.ledgers.to_dict()
            info["cached_tokens"] = cached
            info["ledgers"] = {"head_row": led["head_row"], "token_row": led["token_row"],
                               "operator_total": led["operator"]["total"],
                               "protected_fraction": plan.fraction_protected(), "budget": plan.budget}
            self.metrics.record_ledgers(led, cached)
        job.emit("info", info)  # before any token: a stop string may end the request early
        rng = np.random.default_rng(job.sampling.seed)
        toks = [sample_host(first.logits[-1], job.sampling, rng)]
        fin = self._token(job, toks[0], 1, None, arm)
        t_prev, r.last = time.perf_counter(), toks[0]
        st = first.decode
        free = [i for i, s in enumerate(self._slots) if s is None]
        if fin is None and st is not None and st.native and free:  # a row of the plain batch from the next step
            self.cache = self._splice(self.cache, self._engine_cache(st), free[0])
            job.arm = arm  # the arm that ran labels its inter-token times
            self._slots[free[0]] = _Slot(job, toks[0], 1, rng, t_prev, info)
            return
        if fin is None and st is not None and not st.native and self.decoding.size < self.decoding.slots:
            try:
                r.slot = self.decoding.join(st)
            except Exception:  # it decodes on its own
                log.warning("document request decodes outside the batch:\n%s", traceback.format_exc())
        while fin is None:
            logits = yield
            if logits is None:
                logits = self.rt.next_logits(req, first, toks, pool=pool)
            toks.append(sample_host(logits, job.sampling, rng))
            fin = self._token(job, toks[-1], len(toks), t_prev, arm)
            t_prev, r.last = time.perf_counter(), toks[-1]
        job.emit("done", fin, info)

