"""Prometheus metrics of the server (one registry per server, not the process-global one, so
tests can build several apps in one process).

* `redknot_ttft_seconds` / `redknot_inter_token_seconds`: histograms, labelled by arm
  (`engine` = the batched plain path, `redknot`, `recompute`);
* `redknot_requests_total{endpoint, arm}`, `redknot_http_responses_total{code}`;
* reuse ledgers of requests that ran the RedKnot arm: gauges of the last request and
  summaries over all (head-row saving, token-row saving, cached token rows); never summed with
  each other (DESIGN §6);
* certification: `redknot_cert_validated_total` and `redknot_cert_fallback_total{reason}`,
  read from `ReuseRuntime.counters` at scrape time;
* queue depth, active decode slots, rows per batched decode step, documents registered;
* the device arena of hot documents: `redknot_arena_rows_used`, `_rows_capacity`, `_documents`,
  `_pinned_documents`, `_bytes`, `redknot_arena_admissions_total`, `redknot_arena_evictions_total`;
* the exact prefix's device cache (both arms): `redknot_prefix_cache_documents`, `_bytes`,
  `redknot_prefix_cache_hits_total`, `_misses_total`, `_evictions_total`;
* memory: the process's (prometheus_client's `process_resident_memory_bytes` and the rest of its
  `process_*` family) and the devices' (`redknot_device_memory_bytes{stat}`: `in_use`, `peak`
  and `limit`, summed over this process's devices; absent where the backend does not say, as on CPU);
* `redknot_compiled_programs_total`: XLA programs this process lowered (jit cache misses, each
  then compiled or read from the persistent compilation cache), counted through
  `jax.monitoring`: after the start-up warm-up it grows only for request shapes the warm-up
  did not cover.
"""

from __future__ import annotations

import threading

import jax
import jax.monitoring
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, Summary, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


# JAX records this event once per program it lowers to MLIR: every jit cache miss (a program
# then compiled, or read from the persistent compilation cache), eager primitives included.
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_programs = 0
_programs_lock = threading.Lock()
_listening = False


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _programs
    if event == LOWERING_EVENT:
        with _programs_lock:
            _programs += 1


def count_compiled_programs() -> None:
    """Start counting the programs this process lowers (idempotent: one listener per process)."""
    global _listening
    with _programs_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True


def compiled_programs() -> int:
    """Programs lowered since `count_compiled_programs` was first called (process-wide)."""
    with _programs_lock:
        return _programs


class _CompileCollector:
    def collect(self):
        m = CounterMetricFamily("redknot_compiled_programs", "XLA programs lowered by this process (jit cache "
                                "misses: compiled, or read from the persistent compilation cache); growth after "
                                "the warm-up means a request shape it did not cover")
        m.add_metric([], compiled_programs())
        yield m


class _DeviceMemoryCollector:
    STATS = (("in_use", "bytes_in_use"), ("peak", "peak_bytes_in_use"), ("limit", "bytes_limit"))

    def collect(self):
        per_device = [d.memory_stats() for d in jax.local_devices()]
        if not all(per_device):  # the backend keeps no statistics (CPU)
            return
        m = GaugeMetricFamily("redknot_device_memory_bytes", "Device memory of this process's devices (summed): "
                              "in use now, the peak in use since start, the allocator's limit", labels=["stat"])
        for label, key in self.STATS:
            m.add_metric([label], sum(st.get(key, 0) for st in per_device))
        yield m


class _CertCollector:
    def __init__(self, counters):
        self.counters = counters

    def collect(self):
        snap = self.counters.snapshot()
        ok = CounterMetricFamily("redknot_cert_validated", "Artifact certificates validated (RedKnot arm ran)")
        ok.add_metric([], snap["validated"])
        yield ok
        fb = CounterMetricFamily("redknot_cert_fallback", "Fallbacks to full recomputation, by reason",
                                 labels=["reason"])
        for reason, n in sorted(snap["fallback"].items()):
            fb.add_metric([reason], n)
        yield fb


class _SnapshotCollector:
    """Gauges and counters `redknot_<prefix>_<name>` read at scrape time from `source.snapshot()`
    (the latest source given; none: nothing reported). gauges / counters: (name, key, help)."""

    def __init__(self, prefix: str, gauges, counters):
        self.source, self.prefix, self.gauges, self.counters = None, prefix, gauges, counters

    def collect(self):
        if self.source is None:
            return
        snap = self.source.snapshot()
        for family, specs in ((GaugeMetricFamily, self.gauges), (CounterMetricFamily, self.counters)):
            for name, key, help_ in specs:
                m = family(f"redknot_{self.prefix}_{name}", help_)
                m.add_metric([], snap[key])
                yield m


ARENA = ("arena", (("rows_used", "rows_used", "Document rows held by the device arena"),
                   ("rows_capacity", "rows_capacity", "Document rows the device arena can hold"),
                   ("documents", "docs", "Documents resident in the device arena"),
                   ("pinned_documents", "pinned", "Arena documents pinned by requests in flight"),
                   ("bytes", "bytes", "Device bytes of the arena's arrays")),
         (("admissions", "admitted", "Documents written into the device arena"),
          ("evictions", "evicted", "Documents evicted from the device arena (least recently used, to host memory) "
           "to make room")))
PREFIX_CACHE = ("prefix_cache", (("documents", "docs", "First documents held hot on the device as exact prefixes"),
                                 ("bytes", "bytes", "Device bytes of the exact-prefix cache")),
                (("hits", "hits", "Exact-prefix lookups (prefix or RedKnot arm) whose first document's states "
                  "were held hot"),
                 ("misses", "misses", "Exact-prefix lookups that decoded states of their first document onto the "
                  "device"),
                 ("evictions", "evictions", "Hot prefix states dropped, least recently used, to make room")))


class Metrics:
    def __init__(self, cert_counters):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("redknot_ttft_seconds", "Time from admission to first token", ["arm"],
                              buckets=LAT_BUCKETS, registry=r)
        self.itl = Histogram("redknot_inter_token_seconds", "Time between consecutive tokens", ["arm"],
                             buckets=LAT_BUCKETS, registry=r)
        self.requests = Counter("redknot_requests", "Completion requests run, by endpoint and the arm asked for "
                                "(auto: redknot_arm_choice_total says which ran)", ["endpoint", "arm"], registry=r)
        self.responses = Counter("redknot_http_responses", "HTTP responses by status code", ["code"], registry=r)
        self.queue_depth = Gauge("redknot_queue_depth", "Jobs waiting for the model worker", registry=r)
        self.active = Gauge("redknot_active_sequences", "Sequences in the continuous decode batch", registry=r)
        self.batch_rows = Histogram("redknot_decode_batch_rows", "Active sequences per batched decode step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.documents = Gauge("redknot_documents", "Documents registered (all tenants)", registry=r)
        self.rejected = Counter("redknot_rejected", "Requests refused by back-pressure (429)", registry=r)
        self.deferred = Counter("redknot_deferred_out_of_memory", "Document prefills that ran out of device memory "
                                "beside other sequences in flight, deferred until fewer were", registry=r)
        self.cancelled = Counter("redknot_cancelled", "Generations stopped because the client went away",
                                 registry=r)
        self.head_row_last = Gauge("redknot_head_row_saving_last",
                                   "Logical head-row saving of the last RedKnot request (ledger 1)", registry=r)
        self.token_row_last = Gauge("redknot_token_row_saving_last",
                                    "Physical token-row saving of the last RedKnot request (ledger 2)", registry=r)
        self.cached_rows_last = Gauge("redknot_cached_tokens_last", "Prompt rows not computed (exact prefix + "
                                      "restored document rows), last RedKnot request", registry=r)
        self.head_row = Summary("redknot_head_row_saving", "Head-row saving per RedKnot request", registry=r)
        self.token_row = Summary("redknot_token_row_saving", "Token-row saving per RedKnot request", registry=r)
        self.cached_rows = Summary("redknot_cached_tokens", "Prompt rows not computed (exact prefix + restored "
                                   "document rows) per RedKnot request", registry=r)
        self.artifact_tier = Counter(
            "redknot_artifact_tier_hits", "Artifacts a RedKnot request cited, by where they were found: device "
            "(resident in the device arena already), host (in memory, written into the arena now), disk (read "
            "from the artifact store, verified), built (constructed for this request)",
            ["tier"], registry=r)
        self.reuse_batch = Histogram("redknot_reuse_batch_requests", "Document requests prefilled together in "
                                     "one batch (one jitted call per layer)", buckets=(2, 3, 4, 6, 8, 16), registry=r)
        self.reuse_decode_rows = Histogram("redknot_reuse_decode_batch_rows", "Document requests decoding as rows "
                                           "of one batched step (DecodeBatch: one jitted call per layer)",
                                           buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.arm_choice = Counter("redknot_arm_choice", "Arms the break-even table chose for requests that named "
                                  "none (--break-even), by arm and by the request's tier (where its slowest document "
                                  "was: device arena, host memory, disk)", ["arm", "tier"], registry=r)
        r.register(_CertCollector(cert_counters))
        count_compiled_programs()
        r.register(_CompileCollector())
        ProcessCollector(registry=r)
        r.register(_DeviceMemoryCollector())
        self._arena, self._prefixes = _SnapshotCollector(*ARENA), _SnapshotCollector(*PREFIX_CACHE)
        r.register(self._arena)
        r.register(self._prefixes)

    def watch_arena(self, arena) -> None:
        """Report this device arena's occupancy, admissions and evictions (the latest one given)."""
        self._arena.source = arena

    def watch_prefix_cache(self, cache) -> None:
        """Report the exact prefix's device cache (`reuse.prefix.PrefixCache`): size, hits, misses."""
        self._prefixes.source = cache

    def record_ledgers(self, ledgers: dict, cached: int) -> None:
        self.head_row_last.set(ledgers["head_row"]["saving"])
        self.token_row_last.set(ledgers["token_row"]["saving"])
        self.cached_rows_last.set(cached)
        self.head_row.observe(ledgers["head_row"]["saving"])
        self.token_row.observe(ledgers["token_row"]["saving"])
        self.cached_rows.observe(cached)

    def render(self) -> bytes:
        return generate_latest(self.registry)
