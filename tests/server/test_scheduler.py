"""The server's scheduler in-process: units (queue back-pressure and shutdown, prefill chunk,
sampling, memory metrics, per-tenant stores, kernels flag); the start-up warm-up, served by uvicorn
on a thread (fixture `warm_state`); worker steps (chunked prompts, document prefills a layer a step,
cancellation, out-of-memory deferral); the document warm-up. The scheduler is
`server/scheduler.py`, its warm-up `server/warmup.py`, its jobs `server/jobs.py`; the server over
a subprocess's sockets: test_server.py.

Sections, in this order (each under a `# ----` rule): units, start-up warm-up, worker steps,
document warm-up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import re
import socket
import threading
import time

import pytest

from tests.server.sockets import MODEL, ROOT, Server


# ------------------------------------------------------------------ units
class _StubEngine:
    capacity = 4096

    def new_cache(self, b):
        return {}


def _sched(max_queue):
    from redknot_jax.reuse.certificate import CertCounters
    from redknot_jax.server.metrics import Metrics
    from redknot_jax.server.scheduler import Scheduler

    return Scheduler(_StubEngine(), None, Metrics(CertCounters()), slots=2, max_queue=max_queue)


def test_queue_full_is_backpressure_and_shutdown_fails_queued_jobs():
    from redknot_jax.server.jobs import Job
    from redknot_jax.server.scheduler import QueueFull, ShuttingDown

    loop = asyncio.new_event_loop()
    try:
        s = _sched(max_queue=2)  # worker not started: jobs stay queued
        jobs = [Job("plain", loop, tokens=[3]) for _ in range(2)]
        for j in jobs:
            s.submit(j)
        with pytest.raises(QueueFull, match="queue full"):
            s.submit(Job("plain", loop, tokens=[3]))
        from types import SimpleNamespace

        from redknot_jax.server.app import ApiError, submit

        with pytest.raises(ApiError) as e:  # what a client sees: 429 with Retry-After
            submit(SimpleNamespace(scheduler=s), Job("plain", loop, tokens=[3]))
        resp = e.value.response()
        assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
        s.stop(grace_s=0)
        with pytest.raises(ShuttingDown):
            s.submit(Job("plain", loop, tokens=[3]))
        loop.run_until_complete(asyncio.sleep(0))
        for j in jobs:
            ev = j.out.get_nowait()
            assert ev[0] == "error" and ev[1] == 503 and "shutting down" in ev[2]
    finally:
        loop.close()


def test_document_requests_in_flight_stay_within_the_slots():
    """The worker starts jobs first in first out: plain ones into free slots, document requests
    together up to --reuse-batch, but only while fewer than `slots` of them are in flight
    (prefilling, decoding, deferred); a blocked one holds back the jobs behind it."""
    from types import SimpleNamespace

    from redknot_jax.server.jobs import Job

    loop = asyncio.new_event_loop()
    try:
        s = _sched(max_queue=8)  # 2 slots: batches of up to 2, not the default 4
        assert s.reuse_batch == 2 and s.batch_sizes == (2,)
        r1, r2, r3, r4 = (Job("reuse", loop, tokens=[3], docs=[]) for _ in range(4))
        p1 = Job("plain", loop, tokens=[3])
        s._pending.extend([r1, r2, r3, p1, r4])
        s._reuse[:] = ["r0"]  # one decoding: room for one more, not a batch of 2
        assert s._next_jobs(2) == ([], [r1])
        s._pending.appendleft(r1)
        s._reuse[:] = []
        assert s._next_jobs(2) == ([], [r1, r2])
        s._reuse[:] = ["r1", "r2"]  # both decoding
        assert s._next_jobs(2) == ([], None) and list(s._pending) == [r3, p1, r4]  # r3 waits, p1 behind it
        s._reuse[:] = ["r1"]
        assert s._next_jobs(2) == ([], [r3])
        s._deferred[:] = []
        s._reuse[:] = ["r1", "r3"]
        assert s._next_jobs(1) == ([p1], None) and list(s._pending) == [r4]
        s._reuse[:] = []
        s._deferred[:] = [({"job": r1}, 1)]  # one deferred for device memory: nothing starts
        assert s._next_jobs(2) == ([], None)
        s._deferred[:] = []  # two prefix-arm requests decoding as rows of the plain batch: still in flight
        s._slots[:] = [SimpleNamespace(job=r1), SimpleNamespace(job=r2)]
        assert s._next_jobs(0) == ([], None) and list(s._pending) == [r4]
    finally:
        loop.close()


def test_prefill_chunk_is_one_power_of_two_within_the_cache():
    """The plain path's prefill chunk: the largest power of two within --prefill-chunk and the
    cache (one compiled program); a bad flag is named."""
    from redknot_jax.reuse.certificate import CertCounters
    from redknot_jax.server.metrics import Metrics
    from redknot_jax.server.scheduler import Scheduler
    from redknot_jax.server.state import ServeConfig

    class Eng(_StubEngine):
        capacity = 64

    chunk = lambda eng, n: Scheduler(eng, None, Metrics(CertCounters()), slots=1, prefill_chunk=n).prefill_chunk
    assert chunk(_StubEngine(), 256) == 256 and chunk(_StubEngine(), 300) == 256 and chunk(_StubEngine(), 16) == 16
    assert chunk(_StubEngine(), 8192) == 4096
    assert chunk(Eng(), 256) == 64 and chunk(Eng(), 48) == 32
    with pytest.raises(ValueError, match="prefill_chunk: expected a positive int, got 0"):
        ServeConfig(prefill_chunk=0)


def test_host_sampling_greedy_and_nucleus():
    import numpy as np

    from redknot_jax.server.jobs import Sampling, sample_host

    lg = np.array([0.0, 3.0, 2.9, -5.0])
    rng = np.random.default_rng(0)
    assert sample_host(lg, Sampling(temperature=0.0), rng) == 1
    # top_p small: only the most probable token survives the nucleus
    assert {sample_host(lg, Sampling(temperature=1.0, top_p=0.3), rng) for _ in range(50)} == {1}
    draws = {sample_host(lg, Sampling(temperature=1.0, top_p=1.0), rng) for _ in range(200)}
    assert {1, 2} <= draws


def test_memory_metrics_process_and_devices(monkeypatch):
    """/metrics reports the process's resident set, and its devices' memory summed where the
    backend keeps statistics (GPUs; fake devices here), nothing where one does not (CPU)."""
    from types import SimpleNamespace

    from redknot_jax.reuse.certificate import CertCounters
    from redknot_jax.server import metrics

    def page(*stats):
        monkeypatch.setattr(metrics.jax, "local_devices", lambda: [SimpleNamespace(memory_stats=lambda s=s: s)
                                                                   for s in stats])
        return metrics.Metrics(CertCounters()).render().decode()

    gpu = {"bytes_in_use": 3 << 30, "peak_bytes_in_use": 5 << 30, "bytes_limit": 70 << 30}
    text = page(gpu, dict(gpu, bytes_in_use=1 << 30))
    got = dict(re.findall(r'^redknot_device_memory_bytes\{stat="(\w+)"\} (\S+)$', text, re.M))
    assert {k: float(v) for k, v in got.items()} == {"in_use": 4 << 30, "peak": 10 << 30, "limit": 140 << 30}
    assert "process_resident_memory_bytes" in text
    assert "redknot_device_memory_bytes" not in page(None)


def test_byte_tokenizer_and_tenant_salted_ids(tmp_path):
    from redknot_jax.server.documents import DocumentRegistry, valid_id
    from redknot_jax.server.tokenizer import ByteTokenizer

    tok = ByteTokenizer(97)
    text = "Hello, World ~ 0123 {}"
    ids = tok.encode(text)
    assert all(2 <= i < 97 for i in ids) and tok.decode(ids) == text  # printable ASCII round-trips
    assert all(2 <= i < 97 for i in tok.encode("naïve\n"))  # other bytes fold, still in vocab
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(50)
    reg = DocumentRegistry(str(tmp_path / "store"))
    a, created = reg.add("a", [3, 4, 5], shared=False)
    b, _ = reg.add("b", [3, 4, 5], shared=False)
    assert created and a.id != b.id and valid_id(a.id) and not valid_id("../" + a.id[3:])
    assert reg.get("b", a.id) is None and reg.get("a", a.id) is a and not reg.delete("b", a.id)
    # records survive a restart with the same ids (secret kept in the store)
    again = DocumentRegistry(str(tmp_path / "store"))
    assert again.get("a", a.id).tokens.tolist() == [3, 4, 5] and again.content_id("a", [3, 4, 5]) == a.id


@dataclasses.dataclass
class _Doc:
    """What the scheduler reads of a registered document."""
    id: str
    tenant: str
    tokens: object
    artifact: object = None


def _run_reuse(sched, jobs) -> None:
    """Document requests from prefill to their last token on `sched`, nothing else running."""
    sched._start_reuse(jobs)
    while sched._active():  # (a native decode state decodes in the plain batch)
        sched._step()


def _tiny_runtime():
    """The tiny mixed model (fp32, seed 2) and its RedKnot runtime: (cfg, model, runtime)."""
    import jax.numpy as jnp

    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.reuse.profile import tiny_profile
    from redknot_jax.reuse.runtime import ReuseRuntime

    cfg = config.tiny("mixed")
    model = random_model(cfg, seed=2, dtype=jnp.float32)
    return cfg, model, ReuseRuntime(model, tiny_profile(cfg.num_layers), "fp-test")


def test_artifacts_persist_in_per_tenant_stores(tmp_path):
    """With an artifact store, a built artifact is published; after a restart (a new scheduler
    on the same directory) it is read back verified ("disk") and certifies; another tenant's
    store never serves it (no cross-tenant reuse of stored artifacts). A document the device
    arena cannot hold is served recomputed, counted."""
    import numpy as np

    from redknot_jax.generate import Engine
    from redknot_jax.reuse.planner import Request, Segment
    from redknot_jax.server.metrics import Metrics
    from redknot_jax.server.scheduler import Scheduler

    cfg, model, rt = _tiny_runtime()

    def scheduler():
        return Scheduler(Engine(model, capacity=64), rt, Metrics(rt.counters), slots=1, checkpoint_fingerprint="fp-test",
                         store_root=str(tmp_path / "artifacts"))

    toks = np.random.default_rng(0).integers(2, cfg.vocab_size, 40).astype(np.int32)
    assert scheduler()._ensure_artifact(_Doc("a" * 64, "tenant-a", toks)) == "built"
    doc = _Doc("a" * 64, "tenant-a", toks)
    assert scheduler()._ensure_artifact(doc) == "disk"  # a restart reads it back, verified
    assert rt.certify(Request([Segment(toks, doc.artifact), Segment(toks[:5])])) is None
    assert scheduler()._ensure_artifact(_Doc("b" * 64, "tenant-b", toks)) == "built"  # not a's store
    # a document longer than the whole device arena: the request is served by the Recomputed arm,
    # counted as ARENA_FULL and said in its `redknot` info, and it pins nothing
    import asyncio

    from redknot_jax.reuse.certificate import FallbackReason
    from redknot_jax.server.jobs import Job, Sampling

    small = Scheduler(Engine(model, capacity=64), rt, Metrics(rt.counters), slots=1, checkpoint_fingerprint="fp-test",
                      arena_rows=cfg.hca_rate)
    job = Job("reuse", asyncio.new_event_loop(), tokens=[5, 6, 7], docs=[doc], sampling=Sampling(max_tokens=2))
    events = []
    job.emit = lambda *ev: events.append(ev)
    _run_reuse(small, [job])
    info = next(e[1] for e in events if e[0] == "info")
    assert (info["arm"], info["fallback"]) == ("recompute", "arena_full") and "more than the arena" in info[
        "fallback_detail"], info
    assert events[-1][0] == "done" and rt.counters.fallback[FallbackReason.ARENA_FULL] == 1
    assert small.arena.snapshot()["docs"] == 0
    # arm "auto" with a break-even table saying the Recomputed arm is faster here: the request
    # leaves for the continuous batch (a plain job, the documents' tokens first), says why, counted
    from redknot_jax.reuse.break_even import BreakEven

    table = BreakEven.from_dict({"device": "cpu", "date": "2026-12-05", "command": "test", "profile": rt.profile.name,
                                 "profile_digest": rt.profile.digest(), "points": [
        {"tier": t, "tokens": 100, "recompute_s": 0.1, "redknot_s": 1.0} for t in ("device", "host", "disk")]})
    auto = Scheduler(Engine(model, capacity=64), rt, Metrics(rt.counters), slots=1, checkpoint_fingerprint="fp-test",
                     break_even=table)
    job = Job("reuse", asyncio.new_event_loop(), tokens=[5, 6, 7], docs=[doc], sampling=Sampling(max_tokens=2),
              arm="auto")
    events = []
    job.emit = lambda *ev: events.append(ev)
    _run_reuse(auto, [job])
    assert (job.kind, job.arm, job.tokens) == ("plain", "recompute", doc.tokens.tolist() + [5, 6, 7])
    assert list(auto._pending) == [job] and events[0][0] == "info"
    choice = events[0][1]["arm_choice"]  # the document is in host memory, not in the arena: tier "host"
    assert (choice["arm"], choice["tier"], choice["tokens"]) == ("recompute", "host", len(doc.tokens) + 3)
    assert auto.metrics.arm_choice.labels("recompute", "host")._value.get() == 1
    # document requests waiting together prefill in one batch and give each its tokens alone
    def run(sched, prompts):
        jobs, events = [], []
        for k, p in enumerate(prompts):
            j = Job("reuse", asyncio.new_event_loop(), tokens=p, docs=[doc], sampling=Sampling(max_tokens=3),
                    arm="redknot")
            j.emit = lambda *ev, k=k: events.append((k, ev))
            jobs.append(j)
        _run_reuse(sched, jobs)
        return [[ev[1] for kk, ev in events if kk == k and ev[0] == "token"] for k in range(len(prompts))]

    together = Scheduler(Engine(model, capacity=64), rt, Metrics(rt.counters), slots=1, checkpoint_fingerprint="fp-test")
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    both = run(together, prompts)
    assert together.metrics.reuse_batch._sum.get() == 2 and all(len(t) == 3 for t in both)
    assert both == [run(together, [p])[0] for p in prompts]


def test_kernels_flag_is_resolved_or_refused():
    """ServeConfig.kernels (serve.py --kernels) reaches both the RedKnot runtime and the engine,
    resolved (off a GPU "auto" runs none); a kernel name it does not know is refused at start-up;
    likewise the other flags ServeConfig checks."""
    from redknot_jax.server.state import ServeConfig, build_state

    for flag in ("auto", "xla"):
        st = build_state(ServeConfig(preset="tiny", kernels=flag, warmup=False))
        assert st.runtime.consumer.kernels == st.scheduler.eng.kernels == ""
    # the tiny model cannot run the restoration kernel: refused by the runtime, naming it
    with pytest.raises(ValueError, match="restore kernel cannot run"):
        build_state(ServeConfig(preset="tiny", kernels="restore", warmup=False))
    with pytest.raises(ValueError, match="kernels: expected 'auto', 'xla', 'mosaic' or a comma list.*'triton'"):
        build_state(ServeConfig(preset="tiny", kernels="triton", warmup=False))
    # --shape-buckets reaches the consumer, or is refused naming the flag
    assert build_state(ServeConfig(preset="tiny", shape_buckets=2, warmup=False)).runtime.consumer.buckets.per_octave == 2
    with pytest.raises(ValueError, match="shape_buckets: Buckets: per_octave must be 0 or a power of two, got 3"):
        ServeConfig(shape_buckets=3)
    with pytest.raises(ValueError, match="arena_rows: expected an int >= 0.*got -1"):
        ServeConfig(arena_rows=-1)
    with pytest.raises(ValueError, match="arena_docs: expected a positive int, got 0"):
        ServeConfig(arena_docs=0)
    with pytest.raises(ValueError, match="break_even: break-even table /nonexistent/t.json: .*No such file"):
        ServeConfig(break_even="/nonexistent/t.json")
    # a break-even table of another profile than the served one: refused before the weights load
    with pytest.raises(ValueError, match=r"break_even: .*measured with RedKnot profile 'qa-5F-4R-3F-b75-dev-refresh-"
                                         r"restore' .*but the server serves 'tiny-1F-4R-1F'"):
        build_state(ServeConfig(preset="tiny", break_even=str(ROOT / "docs/results/break_even_cpu.json"), warmup=False))
    # --profile names are checked with the flags (before any model loads); --artifact-codec reaches the profile
    with pytest.raises(ValueError, match=r"profile: expected auto, tiny, tiny-exact, flash, pro or a JSON file, "
                                         r"got 'tinyy' \(no such file\)"):
        ServeConfig(profile="tinyy")
    with pytest.raises(ValueError, match="artifact_codec: expected one of dense, fp8, fp4, got 'int8'"):
        ServeConfig(artifact_codec="int8")
    assert build_state(ServeConfig(preset="tiny", artifact_codec="fp4", warmup=False)).runtime.profile.artifact_codec \
        == "fp4"


# ------------------------------------------------------------------ start-up warm-up (in-process)
def test_warmup_buckets_flag_is_parsed_or_refused(capsys):
    """--warmup-buckets: comma-separated positive prompt lengths; anything else is refused naming
    the item (the parser, ServeConfig, and serve.py's argparse message, before any model loads)."""
    import importlib.util

    from redknot_jax.server.state import ServeConfig, parse_warmup_buckets

    assert parse_warmup_buckets("512,4096") == (512, 4096)
    assert parse_warmup_buckets(" 64, 8 ,64") == (8, 64)
    for text, item in (("abc", "'abc'"), ("0", "'0'"), ("-3", "'-3'"), ("5,,6", "''"), ("", "''"), ("1e3", "'1e3'"),
                       ("2.5", "'2.5'"), ("²", "'²'")):
        with pytest.raises(ValueError, match=f"expected comma-separated positive integers .*got {re.escape(item)}$"):
            parse_warmup_buckets(text)
    with pytest.raises(ValueError, match=r"warmup_buckets: prompt length 64 outside \[1, 63\]"):
        ServeConfig(max_model_len=64, warmup_buckets=(8, 64))
    with pytest.raises(ValueError, match=r"warmup_buckets \[8\] given with warmup=False \(--no-warmup\)"):
        ServeConfig(warmup=False, warmup_buckets=(8,))
    with pytest.raises(ValueError, match="warmup_buckets: expected a non-empty tuple"):
        ServeConfig(warmup_buckets=())

    spec = importlib.util.spec_from_file_location("serve_cli", ROOT / "launch" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    for argv, msg in ((["--warmup-buckets", "512,x"], "argument --warmup-buckets: warmup buckets '512,x': expected "
                                                      "comma-separated positive integers"),
                      (["--warmup-buckets", "8", "--no-warmup"], "--warmup-buckets and --no-warmup: give one of them"),
                      (["--warmup-buckets", "4096", "--max-model-len", "2048"],
                       r"--warmup-buckets: prompt length 4096 outside \[1, 2047\]")):
        with pytest.raises(SystemExit) as e:  # '' keeps this process's compilation cache setting
            serve.main([*argv, "--compilation-cache", "", "--log-level", "warning"])
        assert e.value.code == 2
        assert re.search(msg, capsys.readouterr().err), argv


class _Serving:
    """An app served by uvicorn on a thread over a real socket, listening before uvicorn runs
    (early connections wait in the backlog: no start-up polling)."""

    def __init__(self, state):
        import uvicorn

        from redknot_jax.server.app import create_app

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.uv = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.srv = Server(None, self.sock.getsockname()[1], None)

    def __enter__(self) -> Server:
        self.thread.start()
        return self.srv

    def __exit__(self, *exc):
        self.uv.should_exit = True
        self.thread.join(60)
        self.sock.close()


def _get(srv: Server, path: str, body=None):
    """(status, headers, parsed JSON) without auth (the warm-up state has no API keys)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request("POST" if body is not None else "GET", path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), json.loads(r.read())
    conn.close()
    return out


@pytest.fixture(scope="module")
def warm_state():
    """The tiny model's server state (not started): warm-up of a 5-token prompt, 16-row prefill chunks."""
    from redknot_jax.server.state import ServeConfig, build_state

    import dataclasses as dc

    st = build_state(ServeConfig(preset="tiny", profile="tiny-exact", max_model_len=64, prefill_chunk=16, slots=2,
                                 warmup_buckets=(5,)))
    return dc.replace(st, keys={})  # no auth, whatever $REDKNOT_API_KEYS holds


def test_healthz_is_503_warming_until_the_warmup_ends_and_the_warmed_length_compiles_nothing(warm_state, caplog):
    """The socket answers while the model worker warms (held on an event here): /healthz 503
    "warming" with Retry-After, model routes 503 `warming_up` with Retry-After, other routes
    answer; once warm, /healthz 200 and a prompt of the warmed length lowers no program
    (redknot_compiled_programs_total unchanged), while a prompt of several chunks, which the
    one-chunk warm-up did not cover, does (the counter sees request-time compiles). The log times each
    part of the warm-up. Runs before any other in-process prefill of this module (the negative control
    needs its programs new)."""
    sched = warm_state.scheduler
    assert sched.phase == "warming" and sched.warmup_lengths == (5,)
    entered, gate = threading.Event(), threading.Event()
    real = sched.warmup

    def held(lengths=None):
        entered.set()
        assert gate.wait(300), "test never opened the warm-up gate"
        real(lengths)

    sched.warmup = held
    with caplog.at_level("INFO", logger="redknot.server"), _Serving(warm_state) as srv:
        assert entered.wait(120), "the worker never started its warm-up"
        st, hdr, body = _get(srv, "/healthz")
        assert st == 503 and body["status"] == "warming" and hdr.get("retry-after") == "5", (st, hdr, body)
        assert body["warmup"]["lengths"] == [5] and body["warmup"]["done"] == 0
        for path, req in (("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2}),
                          ("/v1/documents", {"text": "a document"})):
            st, hdr, body = _get(srv, path, req)
            assert st == 503 and body["error"]["code"] == "warming_up" and hdr.get("retry-after") == "5", (path, body)
            assert "warming up" in body["error"]["message"]
        assert _get(srv, "/v1/models")[0] == 200  # no model work: answered while warming
        assert sched.alive and not sched.warmed.is_set()

        gate.set()
        assert sched.warmed.wait(300)
        st, hdr, body = _get(srv, "/healthz")
        assert st == 200 and body["status"] == "ok" and "retry-after" not in hdr, body
        assert body["warmup"]["done"] == 1 and body["warmup"]["programs"] > 0 and body["warmup"]["seconds"] > 0
        parts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: ")]
        assert [re.sub(r"in [\d.]+s \(\d+ programs\)$", "", m) for m in parts] == [
            f"warm-up: a 5-token prompt prefilled (chunks of {sched.prefill_chunk} rows) ",
            f"warm-up: a decode step of {sched.slots_n} slots "], parts

        def lowered(prompt_len):
            before = srv.metric("redknot_compiled_programs_total")
            st, _, r = _get(srv, "/v1/completions", {"model": MODEL, "prompt": [7] * prompt_len, "max_tokens": 3,
                                                     "ignore_eos": True})
            assert st == 200 and r["usage"]["completion_tokens"] == 3, r
            return srv.metric("redknot_compiled_programs_total") - before

        assert lowered(5) == 0  # the warmed length: prefill, splice, logits read back, decode steps
        assert lowered(40) > 0  # three chunks: merging the chunks' logits was not warmed


def test_warmup_failure_is_reported_and_logged_not_half_ready(warm_state, caplog):
    """A warm-up that raises: logged with its traceback, /healthz 503 "failed" naming the error
    (no Retry-After: it will not recover), model routes 503 `warmup_failed`; the worker exits."""
    import dataclasses as dc

    from redknot_jax.server.scheduler import Scheduler

    sched = Scheduler(warm_state.scheduler.eng, warm_state.runtime, warm_state.metrics, slots=1, prefill_chunk=16,
                      warmup=(5,))

    def fail(lengths=None):
        raise RuntimeError("injected: compiling ran out of memory")

    sched.warmup = fail
    with caplog.at_level("ERROR", logger="redknot.server"), _Serving(dc.replace(warm_state, scheduler=sched)) as srv:
        assert sched.warmed.wait(120)
        st, hdr, body = _get(srv, "/healthz")
        assert st == 503 and body["status"] == "failed" and "retry-after" not in hdr, (hdr, body)
        assert body["error"] == "RuntimeError: injected: compiling ran out of memory"
        st, hdr, body = _get(srv, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert st == 503 and body["error"]["code"] == "warmup_failed" and "retry-after" not in hdr, body
        assert "injected" in body["error"]["message"]
        sched._thread.join(30)
        assert not sched.alive and sched.phase == "failed"
    failed = [r for r in caplog.records if "warm-up failed" in r.getMessage()]
    assert failed and "injected: compiling ran out of memory" in failed[0].getMessage()


# ------------------------------------------------------------------ worker steps (in-process; after the warm-up
# tests, whose negative control needs the multi-chunk programs this one compiles)
def test_long_prompts_prefill_between_decode_steps_and_document_requests_decode_beside_the_batch():
    """A worker step runs the running sequences' decode rows, then prefill chunks of joining
    sequences and layers of document prefills within --max-batched-tokens: a long prompt (3
    chunks) joining while a sequence decodes prefills one chunk a step with decode steps between
    its chunks; two document requests prefill together a few layers a step, with decode steps
    between them, then decode a token a step as rows of one decode batch beside the plain batch,
    not after it. Each gets the tokens it
    gets alone; a budget that is not a positive int is refused naming the flag."""
    import numpy as np

    from redknot_jax.generate import Engine
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.server.metrics import Metrics
    from redknot_jax.server.jobs import Job, Sampling
    from redknot_jax.server.scheduler import Scheduler
    from redknot_jax.server.state import ServeConfig

    cfg, model, rt = _tiny_runtime()
    toks = np.random.default_rng(0).integers(2, cfg.vocab_size, 40).astype(np.int32)

    doc = _Doc("a" * 64, "t", toks, build_artifact(model, rt.profile, toks, checkpoint_fingerprint="fp-test"))
    with pytest.raises(ValueError, match="max_batched_tokens: expected a positive int, got 0"):
        ServeConfig(max_batched_tokens=0)
    with pytest.raises(ValueError, match="max_batched_tokens: expected a positive int, got 1.5"):
        Scheduler(Engine(model, capacity=64), rt, Metrics(rt.counters), max_batched_tokens=1.5)

    def scheduler():  # one decode row + one 16-row chunk a step
        return Scheduler(Engine(model, capacity=64), rt, Metrics(rt.counters), slots=2, prefill_chunk=16,
                         max_batched_tokens=17, checkpoint_fingerprint="fp-test")

    log, first_a = [], threading.Event()

    def job(name, kind, tokens, n, **kw):
        j = Job(kind, None, tokens=tokens, sampling=Sampling(max_tokens=n), **kw)
        j.name = name
        j.emit = lambda *ev: (log.append((name, ev[0], ev[1] if ev[0] == "token" else None)),
                              name == "a" and ev[0] == "token" and first_a.set())
        return j

    def run(jobs, after_first_a=()):
        sched = scheduler()
        real_decode, real_fill = sched._decode_batch, sched._fill
        submitted = threading.Event()  # a's decode waits until b and c are queued: they join mid-generation
        sched._decode_batch = lambda *a: (submitted.wait(300), log.append(("*", "decode", None)), real_decode(*a))[2]
        sched._fill = lambda i: (log.append((sched._slots[i].job.name, "chunk", None)), real_fill(i))
        docs = sched.decoding
        real_layer, real_docs = sched._prefill_layer, docs.step
        sched._prefill_layer = lambda g: (log.append((g.preps[0]["job"].name, "layer", None)), real_layer(g))
        docs.step = lambda t: (log.append(("*", "documents", docs.size)), real_docs(t))[1]
        sched.start()
        try:
            for j in jobs:
                sched.submit(j)
            if after_first_a:
                assert first_a.wait(300)
                for j in after_first_a:
                    sched.submit(j)
            submitted.set()
            deadline = time.time() + 600
            while sum(e[1] in ("done", "error") for e in log) < len(jobs) + len(after_first_a):
                assert time.time() < deadline, log
                time.sleep(0.01)
        finally:
            sched.stop(grace_s=0)
        return sched

    rng = np.random.default_rng(1)
    prompt_a, prompt_b = rng.integers(2, cfg.vocab_size, 5).tolist(), rng.integers(2, cfg.vocab_size, 40).tolist()
    mk = lambda: (job("a", "plain", prompt_a, 16), job("b", "plain", prompt_b, 3),
                  job("c", "reuse", [5, 6, 7], 4, docs=[doc], arm="redknot"),
                  job("d", "reuse", [7, 6, 5], 4, docs=[doc], arm="redknot"))
    a, b, c, d = mk()
    run([a], after_first_a=[b, c, d])
    assert not [e for e in log if e[1] == "error"], log
    together = {n: [e[2] for e in log if e[0] == n and e[1] == "token"] for n in "abcd"}
    chunks = [i for i, e in enumerate(log) if e[:2] == ("b", "chunk")]
    assert len(chunks) == 3, log  # 40 rows in 16-row chunks
    between = lambda lo, hi, what: sum(1 for e in log[lo:hi] if e[:2] == what)
    assert between(chunks[0], chunks[-1], ("*", "decode")) >= 2, log  # a decode step between chunks
    layers = [i for i, e in enumerate(log) if e[:2] == ("c", "layer")]  # c's prefill, a layer at a time:
    assert len(layers) == cfg.num_layers + 1 and between(layers[0], layers[-1], ("*", "decode")) >= 2, log  # spread
    c_tokens = [i for i, e in enumerate(log) if e[:2] == ("c", "token")]
    assert len(c_tokens) == 4 and between(c_tokens[0], c_tokens[-1], ("a", "token")) >= 2, log  # beside the batch
    assert [e[2] for e in log if e[1] == "documents"] == [2, 2, 2], log  # c and d: rows of one decode batch
    assert len(together["a"]) == 16 and len(together["b"]) == 3
    for j in mk():  # each alone
        log.clear()
        run([j])
        assert [e[2] for e in log if e[1] == "token"] == together[j.name], j.name


def _one_layer_steps():
    """The tiny runtime, one 40-token document, a scheduler maker whose steps run one layer of a
    document prefill each (a budget of one token), and a maker of RedKnot jobs citing the document
    that record their events: (rt, doc, sched, job)."""
    import asyncio

    import numpy as np

    from redknot_jax.generate import Engine
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.server.metrics import Metrics
    from redknot_jax.server.jobs import Job, Sampling
    from redknot_jax.server.scheduler import Scheduler

    cfg, model, rt = _tiny_runtime()  # the worker-steps test's documents and prompts: its programs
    toks = np.random.default_rng(0).integers(2, cfg.vocab_size, 40).astype(np.int32)
    doc = _Doc("a" * 64, "t", toks, build_artifact(model, rt.profile, toks, checkpoint_fingerprint="fp-test"))
    sched = lambda: Scheduler(Engine(model, capacity=64), rt, Metrics(rt.counters), slots=2, max_batched_tokens=1,
                              checkpoint_fingerprint="fp-test")

    def job(prompt):
        j = Job("reuse", asyncio.new_event_loop(), tokens=prompt, docs=[doc], sampling=Sampling(max_tokens=4),
                arm="redknot")
        j.events = []
        j.emit = lambda *ev: j.events.append(ev)
        return j

    return rt, doc, sched, job


def test_a_document_request_cancelled_mid_prefill_leaves_its_batch_and_unpins():
    """Document prefills run a layer per step (a budget of one token: one layer a step). A request
    cancelled between two layers of a batched prefill gets no token and unpins its documents;
    the other request of its batch finishes with the tokens it gets alone. A prefix-arm request
    decodes as a row of the plain batch. A lone request cancelled mid-prefill stops prefilling
    at once."""
    import numpy as np

    from redknot_jax.reuse.arena import doc_key
    from redknot_jax.reuse.planner import Request, Segment

    rt, doc, sched, job = _one_layer_steps()

    s = sched()
    c, d = job([5, 6, 7]), job([7, 6, 5])
    s._start_reuse([c, d])
    assert len(s._prefilling) == 1 and s.arena._res[doc_key(doc.artifact)].pins == 2  # one batch, both pinned
    s._step()
    s._step()  # two layers of the batch's prefill
    assert s._prefilling and not c.events and not d.events
    c.cancelled.set()
    while s._prefilling or s._reuse:
        s._step()
    assert c.events == [] and s.metrics.cancelled._value.get() == 1
    alone = job([7, 6, 5])
    _run_reuse(sched(), [alone])
    assert [e for e in d.events if e[0] == "token"] == [e for e in alone.events if e[0] == "token"]
    assert d.events[-1][0] == "done" and s.arena._res[doc_key(doc.artifact)].pins == 0
    # the prefix arm (a native decode state): its caches spliced into the plain batch, whose decode
    # steps generate its tokens, those of its own decode state
    p = job([5, 6, 7])
    p.arm = "prefix"
    rows = []
    real = s._decode_batch
    s._decode_batch = lambda t, active: (rows.append([sl.job for sl in s._slots if sl is not None]), real(t, active))[1]
    _run_reuse(s, [p])
    assert rows and all(r == [p] for r in rows), rows
    want, first = rt.generate(Request([Segment(doc.tokens, doc.artifact), Segment(np.asarray([5, 6, 7], np.int32))]), 4,
                              "prefix")
    assert first.arm == "prefix" and [e[1] for e in p.events if e[0] == "token"] == want
    assert p.events[-1][0] == "done" and p.events[-1][2]["cached_tokens"] == 40 and p.events[-1][2]["arm"] == "prefix"
    e = job([5, 6, 7])  # alone, cancelled after its first layer: its prefill stops, nothing pinned
    s._start_reuse([e])
    s._step()
    e.cancelled.set()
    s._step()
    assert not s._prefilling and not s._reuse and e.events == []
    assert s.arena._res[doc_key(doc.artifact)].pins == 0 and s.metrics.cancelled._value.get() == 2


def test_a_document_prefill_out_of_device_memory_waits_for_fewer_in_flight():
    """A document prefill that runs out of device memory (XLA's RESOURCE_EXHAUSTED, injected here)
    while another request is in flight is deferred, counted, its documents still pinned; once the
    other request ends it prefills again and gets the tokens it gets alone. A request alone on the
    device that does not fit fails with 503, its documents unpinned; a batch alone that does not fit
    runs one request at a time, and caps the batches below its size."""
    import jax

    from redknot_jax.reuse.arena import doc_key

    rt, doc, sched, job = _one_layer_steps()

    tokens = lambda j: [e[1] for e in j.events if e[0] == "token"]
    alone = {p: job(p) for p in ((5, 6, 7), (7, 6, 5))}
    for j in alone.values():
        _run_reuse(sched(), [j])
    real, ooms = rt.prefill_steps, []

    def oom(*args, **kw):  # the next prefill fails at its first layer, with the message queued
        raise jax.errors.JaxRuntimeError(ooms.pop())
        yield

    s = sched()
    s.rt.prefill_steps = lambda *a, **k: (oom if ooms else real)(*a, **k)
    c, d = job([5, 6, 7]), job([7, 6, 5])
    s._start_reuse([c])
    s._step()
    ooms.append("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.33GiB")
    s._start_reuse([d])
    for _ in range(4 * rt.cfg.num_layers):  # c's prefill, then d's first layer
        if s._deferred or d.events:
            break
        s._step()
    assert s.metrics.deferred._value.get() == 1 and s._deferred[0][1] == 1 and not d.events
    assert s.arena._res[doc_key(doc.artifact)].pins == 2
    while s._active():
        s._step()
    assert tokens(c) == tokens(alone[(5, 6, 7)]) and tokens(d) == tokens(alone[(7, 6, 5)]) and d.events[-1][0] == "done"
    e = job([5, 6, 7])
    # XLA's autotuner that found no memory for its candidates (as on an H100, 2026-12-07) counts too
    ooms.append("NOT_FOUND: All configs failed during profiling or were excluded from selection.\nFailures (1):\n"
                "EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 848.00MiB")
    _run_reuse(s, [e])
    assert e.events[-1][:2] == ("error", 503) and "ran out of memory" in e.events[-1][2]
    assert s.arena._res[doc_key(doc.artifact)].pins == 0 and s.metrics.deferred._value.get() == 1
    # a batch out of device memory alone on the device: its requests prefill one at a time, and later
    # batches stay below its size (it would fail every time)
    s.rt.prefill_batch_steps = lambda *a, **k: (ooms.append("RESOURCE_EXHAUSTED: Out of memory"), oom())[1]
    f, g = job([5, 6, 7]), job([7, 6, 5])
    _run_reuse(s, [f, g])
    del s.rt.prefill_batch_steps
    assert tokens(f) == tokens(alone[(5, 6, 7)]) and tokens(g) == tokens(alone[(7, 6, 5)])
    assert s.split_batches == {(2, True): 1} and s.reuse_batch == 1 and s.batch_sizes == (1,)
    s._pending.extend([f, g])
    assert s._next_jobs(2) == ([], [f])


# ------------------------------------------------------------------ document warm-up (in-process)
def test_warmed_document_requests_compile_nothing(caplog):
    """--warmup-documents: after warming requests of 2 documents of 24 tokens and a 3-token prompt,
    requests of that shape (other documents, other prompts, fewer tokens asked: decode states are
    made for --max-tokens-limit) compile no program, alone or batched; one citing 3 documents does.
    A batch of 4 that runs out of device memory in the warm-up (injected) caps the batches at 2 (logged
    once). The warm-up leaves /metrics as it found it. Its flag is parsed, or refused naming the item."""
    import asyncio

    import jax
    import numpy as np

    from redknot_jax.generate import Engine
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.server.metrics import Metrics, compiled_programs
    from redknot_jax.server.jobs import Job, Sampling
    from redknot_jax.server.scheduler import Scheduler
    from redknot_jax.server.state import ServeConfig, parse_warmup_documents

    assert parse_warmup_documents("4x8192+32, 1x16+2") == ((4, 8192, 32), (1, 16, 2))
    for bad in ("4x8192", "0x8+2", "4*8+2"):
        with pytest.raises(ValueError, match=f"expected comma-separated DOCSxTOKENS\\+PROMPT.*got '{re.escape(bad)}'"):
            parse_warmup_documents(bad)
    with pytest.raises(ValueError, match=r"warmup_documents: \(2, 32, 3\): .*fit max_model_len 64"):
        ServeConfig(max_model_len=64, warmup_documents=((2, 32, 3),))
    cfg, model, rt = _tiny_runtime()
    sched = Scheduler(Engine(model, capacity=128), rt, Metrics(rt.counters), slots=4, prefill_chunk=16, warmup=(5,),
                      warmup_documents=((2, 24, 3),), max_new_tokens=4, checkpoint_fingerprint="fp-test")
    def scrape():  # /metrics but what the warm-up is for: programs compiled, the arena's arrays allocated, memory
        return [ln for ln in sched.metrics.render().decode().splitlines()
                if not any(k in ln for k in ("compiled_programs", "arena_bytes", "process_", "device_memory"))]

    batched = rt.prefill_batch_steps

    def out_of_memory_at_4(reqs, *args, **kw):
        def oom():
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6.63GiB")
            yield
        return oom() if len(reqs) == 4 else batched(reqs, *args, **kw)

    scraped = scrape()
    rt.prefill_batch_steps = out_of_memory_at_4
    sched.warmup()
    del rt.prefill_batch_steps
    assert sched.warmup_status()["done"] == 2 and not sched.arena.snapshot()["docs"]  # warm-up documents gone
    assert sched.warmup_status()["reuse_batch"] == 2 and sched.batch_sizes == (2,)
    assert sched.split_batches == {(4, True): 1}
    assert sum("batches capped at 2" in r.getMessage() for r in caplog.records) == 1, caplog.records
    # the warm-up's requests are no client's: no TTFT, ledger, certificate or arena admission recorded
    assert scrape() == scraped and not sched.arena.stats["admitted"]
    rng = np.random.default_rng(9)
    docs = []
    for k in range(3):
        toks = rng.integers(2, cfg.vocab_size, 24).astype(np.int32)
        art = build_artifact(model, rt.profile, toks, checkpoint_fingerprint="fp-test")
        docs.append(_Doc(str(k) * 64, "t", toks, art))
    events = []

    def job(ds, prompt):
        j = Job("reuse", asyncio.new_event_loop(), tokens=prompt, docs=ds, sampling=Sampling(max_tokens=3),
                arm="redknot")
        j.emit = lambda *ev: events.append(ev)
        return j

    before = compiled_programs()
    _run_reuse(sched, [job(docs[:2], [4, 5, 6])])
    _run_reuse(sched, [job(docs[:2], [6, 5, 4]), job(docs[1:], [5, 5, 5])])
    assert compiled_programs() == before and sum(e[0] == "token" for e in events) == 9, events
    assert not [e for e in events if e[0] == "error"]
    _run_reuse(sched, [job(docs, [4, 5, 6])])
    assert compiled_programs() > before  # a shape the warm-up did not cover
