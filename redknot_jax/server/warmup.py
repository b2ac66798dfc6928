"""The server's start-up warm-up: the part of `Scheduler` (`scheduler.py`) that it inherits.

With `warmup=` prompt lengths, the worker's first task, before any job, runs what a plain
request of each length runs (`_prefill_slot`: the chunked prefill, the splice into a slot, the
logits read back; then one batched decode step), so a later request of those lengths compiles
nothing. Until it ends `phase` is "warming" and `submit` raises `NotReady` (HTTP 503 with
Retry-After: a readiness probe keeps traffic away meanwhile, and a request that still arrives
is told when to come back instead of holding a connection through minutes of compiling); a
failure is logged and leaves `phase` "failed" with `warmup_error`, every submission refused.
Document requests are warmed only for the shapes `warmup_documents` lists (`_warm_documents`):
their programs follow the number of cited documents, each one's length and the prompt's
(padded by `Buckets`), not one length. A batch size whose prefill runs out of device memory there
caps the document batches at the largest size that ran (logged; `/healthz` reports it), as
vLLM's start-up profiling sizes its KV cache: the server then serves smaller batches instead of
deferring or failing every batch of that size. Each part of the warm-up waits for the programs
its compile-ahead threads still compile (their autotuning takes device memory the next part
would need), so its logged time includes them.

`WarmUp` runs on the scheduler's own parts: the engine (`eng`), the plain path's admission and
decode step (`_prefill_slot`, `_decode_batch`), the document path (`rt`, `arena`, `_start_reuse`,
`_step`, `_active`, `batch_sizes`, `reuse_batch`, `set_reuse_batch`, `split_batches`), its metrics
and `_stopping`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback

import numpy as np

from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.certificate import CertCounters
from redknot_jax.server.documents import Document
from redknot_jax.server.jobs import Job, Sampling
from redknot_jax.server.metrics import Metrics, compiled_programs

log = logging.getLogger("redknot.server")


class NotReady(RuntimeError):
    """The start-up warm-up is running (`retry_after` seconds: try again then) or failed
    (`retry_after` None: it will not become ready)."""

    def __init__(self, message: str, retry_after: int | None):
        super().__init__(message)
        self.retry_after = retry_after


WARMING_RETRY_AFTER_S = 5  # what 503s during the warm-up tell clients (Retry-After)


class WarmUp:
    """The warm-up's state (`phase`, `warmup_*`, `warmed`) and steps, mixed into `Scheduler`."""

    def _init_warmup(self, warmup, warmup_documents) -> None:
        """warmup: prompt lengths the worker warms before its first job (a sequence of ints),
        "auto" (`default_warmup`), or None (no warm-up: ready at once); warmup_documents: document
        requests it warms then, (documents, tokens each, prompt tokens) each (`_warm_documents`)."""
        self.warmup_lengths = self._warmup_lengths(warmup)
        self.warmup_documents = tuple(tuple(d) for d in warmup_documents) if self.warmup_lengths else ()
        self.phase = "warming" if self.warmup_lengths else "ready"  # -> "ready" | "failed"
        self.warmup_error: str | None = None
        self.warmup_done = 0  # lengths warmed so far
        self.warmup_programs = 0  # programs the warm-up lowered (compiled or read from the persistent cache)
        self.warmup_s: float | None = None
        self._warm_t0: float | None = None
        self._warm_p0 = 0
        self.warmed = threading.Event()  # set when the warm-up has ended (ready or failed)
        if not self.warmup_lengths:
            self.warmed.set()

    def default_warmup(self) -> tuple[int, ...]:
        """One prompt a row longer than a prefill chunk (within the cache): two chunks, so every
        program of the plain path (the chunk program, its logits merge, the splice, the batched
        decode step) compiles; any other prompt length runs the same programs."""
        return (min(self.prefill_chunk + 1, self.eng.capacity - 1),)

    def _warmup_lengths(self, warmup) -> tuple[int, ...]:
        if warmup is None:
            return ()
        if isinstance(warmup, str):
            if warmup != "auto":
                raise ValueError(f"warmup: expected 'auto', None or prompt lengths, got {warmup!r}")
            return self.default_warmup()
        lengths = tuple(warmup)
        for n in lengths:
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < self.eng.capacity:
                raise ValueError(f"warmup: prompt length {n!r} outside [1, {self.eng.capacity - 1}] (a prompt leaves "
                                 f"at least one row of the cache capacity {self.eng.capacity} to generate)")
        return tuple(sorted(set(lengths)))

    def warmup_status(self) -> dict:
        """What /healthz reports of the warm-up."""
        elapsed, programs = self.warmup_s, self.warmup_programs
        if elapsed is None and self._warm_t0 is not None:  # under way
            elapsed, programs = time.perf_counter() - self._warm_t0, compiled_programs() - self._warm_p0
        return {"lengths": list(self.warmup_lengths), "documents": [list(d) for d in self.warmup_documents],
                "done": self.warmup_done, "total": len(self.warmup_lengths) + len(self.warmup_documents),
                "reuse_batch": self.reuse_batch,
                "programs": programs, "seconds": None if elapsed is None else round(elapsed, 3)}

    def check_ready(self) -> None:
        """Raise `NotReady` unless the warm-up has finished well."""
        if self.phase == "warming":
            st = self.warmup_status()
            raise NotReady(f"server is warming up (compiling prompt lengths {st['lengths']}: {st['done']} of "
                           f"{st['total']} done); retry in {WARMING_RETRY_AFTER_S} s", WARMING_RETRY_AFTER_S)
        if self.phase == "failed":
            raise NotReady(f"server warm-up failed, it will not serve: {self.warmup_error}", None)

    def warmup(self, lengths=None) -> None:
        """Compile what a plain request of each prompt length runs (`lengths`, default
        `self.warmup_lengths`): its batch-1 chunked prefill spliced into a slot with the logits
        read back, then a batched decode step with that slot active (the slot is free
        afterwards: the next admission splices over it). Synchronous, on the calling thread."""
        with self._unrecorded():
            self._warmup(lengths)

    @contextlib.contextmanager
    def _unrecorded(self):
        """The warm-up's requests are no client's: what they record (the server's metrics, the
        certification counters, the arena's admissions and evictions, the prefix cache's
        statistics) goes to scratch copies, so /metrics after start-up counts client requests
        only; the prefix cache forgets the warm-up's documents."""
        metrics, self.metrics = self.metrics, Metrics(CertCounters())
        counters = self.rt.counters if self.rt is not None else None
        arena_stats = dict(self.arena.stats) if self.arena is not None else None
        prefixes = self.rt.prefix_cache if self.rt is not None else None
        prefix_stats = dict(prefixes.stats) if prefixes is not None else None
        if self.rt is not None:
            self.rt.counters = CertCounters()
        try:
            yield
        finally:
            self.metrics = metrics
            if self.rt is not None:
                self.rt.counters = counters
            if self.arena is not None:
                self.arena.stats.update(arena_stats)
            if prefixes is not None:
                prefixes.clear()
                prefixes.stats.update(prefix_stats)

    @contextlib.contextmanager
    def _timed(self, what: str):
        """Log how long a part of the warm-up took and how many programs it lowered: a warm-up that
        overruns a caller's patience (a benchmark's start-up timeout) shows where it stands."""
        t0, p0 = time.perf_counter(), compiled_programs()
        yield
        self.eng.ahead.drain()
        if self.rt is not None:
            self.rt.consumer.ahead.drain()
        log.info("warm-up: %s in %.1fs (%d programs)", what, time.perf_counter() - t0, compiled_programs() - p0)

    def _warmup(self, lengths) -> None:
        vocab = self.eng.cfg.vocab_size
        for n in self.warmup_lengths if lengths is None else lengths:
            if self._stopping:  # shut down while warming: the rest would be thrown away
                break
            with self._timed(f"a {n}-token prompt prefilled (chunks of {self.prefill_chunk} rows)"):
                self._prefill_slot([int(t) for t in np.arange(n) % vocab], 0)
            toks, active = np.zeros(self.slots_n, np.int32), np.zeros(self.slots_n, np.int32)
            active[0] = 1
            with self._timed(f"a decode step of {self.slots_n} slots"):
                np.asarray(self._decode_batch(toks, active))
            if lengths is None:
                self.warmup_done += 1
        for spec in self.warmup_documents if lengths is None else ():
            if self._stopping:
                break
            self._warm_documents(*spec)
            self.warmup_done += 1

    def _warm_documents(self, n_docs: int, tokens: int, prompt: int) -> None:
        """Compile what document requests of `n_docs` documents of `tokens` tokens and a prompt of
        `prompt` tokens run: seeded random documents, built (the builder's programs) and admitted
        to the arena, then requests through the worker's own path: RedKnot ones alone and in each
        padded batch size (prefill, decode batch), a prefix-arm one (its prefill, the splice into
        the plain batch); then the documents leave the arena. A batch size whose prefill runs out of
        device memory caps the batches at the largest size that ran (module doc). A request whose
        plan differs (another number of protected rows, documents or lengths) may still compile."""
        rt, vocab = self.rt, self.eng.cfg.vocab_size
        rng = np.random.default_rng([n_docs, tokens, prompt])
        docs = []
        with self._timed(f"{n_docs} documents of {tokens} tokens built"):
            for k in range(n_docs):
                toks = rng.integers(2, vocab, tokens).astype(np.int32)
                docs.append(Document(f"warmup-{k}", "", toks, shared=False, created=0, artifact=build_artifact(
                    rt.model, rt.profile, toks, checkpoint_fingerprint=self.fp, kernels=rt.consumer.kernels)))
        fits = 1  # the largest batch whose prefill ran
        for arm, size in [("redknot", 1)] + [("redknot", b) for b in self.batch_sizes if b > 1] + [("prefix", 1)]:
            if size > self.reuse_batch:  # capped below
                continue
            jobs, events, split = [], [], self.split_batches.copy()
            for _ in range(size):
                j = Job("reuse", None, tokens=rng.integers(2, vocab, prompt).tolist(), docs=docs,
                        sampling=Sampling(max_tokens=2), arm=arm)
                j.emit = lambda *ev: events.append(ev)
                jobs.append(j)
            what = f"document requests ({n_docs} x {tokens} tokens + {prompt}, {arm}, batch of {size})"
            with self._timed(what):
                self._start_reuse(jobs)
                while self._active():
                    self._step()
            bad = [e for e in events if e[0] == "error"]
            failed = self.split_batches - split  # the batch failed, then its requests ran one at a time
            if failed:
                if not all(oom for _, oom in failed) or any(e[1] != 503 for e in bad):
                    raise RuntimeError(f"warm-up of {what}: the batched prefill failed (logged above)"
                                       + (f"; then {bad[0][2]}" if bad else ""))
                if self.reuse_batch > fits:  # else the scheduler's _cap_reuse_batch capped (and logged) it
                    log.warning("warm-up: %s ran out of device memory; document batches capped at %d", what, fits)
                    self.set_reuse_batch(fits)
                continue
            if bad:
                raise RuntimeError(f"warm-up of {what}: {bad[0][2]}")
            if arm == "redknot":
                fits = size
        self.arena.evict([d.artifact for d in docs])

    def _warm(self) -> bool:
        """The worker's warm-up: phase "ready" on success; on a failure, logged, phase "failed"
        with `warmup_error` (the worker then exits: nothing is served)."""
        self._warm_p0 = p0 = compiled_programs()
        self._warm_t0 = time.perf_counter()
        log.info("warming up: prompt lengths %s (plain path, prefill chunks of %d rows + a decode step); /healthz "
                 "answers 503 'warming' until done", list(self.warmup_lengths), self.prefill_chunk)
        try:
            self.warmup()
        except Exception as e:
            self.warmup_error = f"{type(e).__name__}: {e}"
            self.warmup_programs = compiled_programs() - p0
            self.warmup_s = time.perf_counter() - self._warm_t0
            log.error("warm-up failed after %.1fs (%d of %d lengths done); the server will not serve, /healthz "
                      "answers 503 'failed':\n%s", self.warmup_s, self.warmup_done, len(self.warmup_lengths),
                      traceback.format_exc())
            self.phase = "failed"
            return False
        self.warmup_programs = compiled_programs() - p0
        self.warmup_s = time.perf_counter() - self._warm_t0
        log.info("warm-up done in %.1fs: prompt lengths %s, %d programs compiled (or read from the persistent "
                 "cache); ready", self.warmup_s, list(self.warmup_lengths), self.warmup_programs)
        self.phase = "ready"
        return True
