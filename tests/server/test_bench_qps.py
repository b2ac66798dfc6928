"""launch/bench_qps.py (issue #9 item 2): the throughput benchmark against a real server
subprocess (tiny random preset, concurrency 1 and 2, both arms, 3 s windows), plus its
bootstrap helper and flag validation in-process."""

from __future__ import annotations

import importlib.util
import json
import signal
import time

import numpy as np
import pytest

from tests.server.sockets import ROOT, free_port

_spec = importlib.util.spec_from_file_location("bench_qps", ROOT / "launch" / "bench_qps.py")
bench_qps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_qps)


def test_bootstrap_ratio_ci():
    rng = np.random.default_rng(1)
    num = np.ones(200)
    den = rng.exponential(0.5, 200)
    point = num.sum() / den.sum()
    lo, hi = bench_qps.bootstrap_ratio_ci(num, den, n_boot=1000, seed=3)
    assert lo < point < hi and hi - lo < 0.5 * point
    assert bench_qps.bootstrap_ratio_ci(num, den, n_boot=1000, seed=3) == (lo, hi)  # seeded
    # scale multiplies the statistic; equal records give a zero-width interval at the point
    lo2, hi2 = bench_qps.bootstrap_ratio_ci(num, den, scale=2.0, n_boot=1000, seed=3)
    assert lo2 == pytest.approx(2 * lo) and hi2 == pytest.approx(2 * hi)
    assert bench_qps.bootstrap_ratio_ci([1, 1, 1], [0.5, 0.5, 0.5], n_boot=200) == pytest.approx((2.0, 2.0))
    assert bench_qps.bootstrap_ratio_ci([], []) is None
    with pytest.raises(ValueError, match="num and den"):
        bench_qps.bootstrap_ratio_ci([1, 2], [1.0])


def test_cycles_tile_the_window():
    recs = [{"client": 0, "start_s": 0.01, "end_s": 1.0}, {"client": 0, "start_s": 1.02, "end_s": 2.0},
            {"client": 1, "start_s": 0.02, "end_s": 2.5}]
    cyc = bench_qps.cycles(recs, 2.5)
    assert cyc == pytest.approx([1.02, 1.48, 2.5])
    s = bench_qps.summarize([dict(r, status=200, completion_tokens=4) for r in recs], 2, 200, 0)
    assert s["requests_per_s"] == pytest.approx(3 / 2.5) and s["output_tokens_per_s"] == pytest.approx(12 / 2.5)
    # an error is counted, never dropped, and lowers the completed rate
    s = bench_qps.summarize([dict(r, status=200 if i else 503, completion_tokens=4) for i, r in enumerate(recs)],
                            2, 200, 0)
    assert s["errors"] == 1 and s["errors_by_status"] == {"503": 1} and s["completed"] == 2


@pytest.mark.parametrize("argv, named", [
    (["--concurrency", "1,0"], "--concurrency: expected comma-separated positive integers, got '1,0'"),
    (["--concurrency", "1,-2"], "--concurrency: expected comma-separated positive integers, got '1,-2'"),
    (["--concurrency", "a"], "--concurrency: expected comma-separated positive integers, got 'a'"),
    (["--concurrency", "2,2"], "--concurrency: repeated level in '2,2'"),
    (["--overload", "-1"], r"--overload: expected a factor > 0 \(0: off\), got -1.0"),
    (["--duration-s", "0"], "--duration-s: expected a positive number, got 0.0"),
    (["--arms", "redknot,native"],
     "--arms: expected a comma-separated subset of redknot,prefix,recompute, got 'redknot,native'"),
    (["--docs", "2", "--docs-per-request", "3"], r"--docs-per-request: expected 1..--docs \(2\), got 3"),
    (["--serve-args", "--preset tiny --port 9"], r"--serve-args: --port is set here \(use --port\)"),
    (["--url", "http://127.0.0.1:1", "--serve-args", "--preset tiny"], "--serve-args: given with --url"),
    (["--url", "http://127.0.0.1:1", "--port", "9"], "--port: given with --url"),
])
def test_bad_flags_name_the_flag(argv, named, refused):
    """Each bad flag is refused before anything starts, by the message of its own check (the
    usage line names every flag, so the error line itself is matched)."""
    refused(bench_qps.main, argv, "error: " + named)


def test_a_failed_warmup_stops_the_wait_at_once(tmp_path):
    """A server whose /healthz says its warm-up failed (503 "failed") will never be ready: the
    bench stops it and exits naming the error, instead of polling out --startup-timeout-s."""
    import sys
    import time

    port = free_port()
    srv = bench_qps.SpawnedServer([], port, str(tmp_path / "server.log"), startup_timeout_s=600)
    srv.cmd = [sys.executable, "-c", f"""
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"status": "failed", "error": "RuntimeError: injected"}}).encode()
        self.send_response(503); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
"""]
    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match=r"warm-up failed \(RuntimeError: injected\)"):
        srv.start()
    assert time.perf_counter() - t0 < 60 and srv.proc.poll() is not None  # stopped, not waited out


def test_a_keep_alive_connection_the_server_closed_is_reopened():
    """A server closes an idle keep-alive connection (uvicorn after 5 s, without a word to the
    client): the client's next request, a POST it must not resend, opens a fresh connection
    instead of failing with a broken pipe (on the H100 at 16 clients, 2026-12-07, the first
    request of every client that had waited out the others' warm-up failed so)."""
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"ok": True}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True  # closed after answering, no "Connection: close" sent

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = bench_qps.Client(f"http://127.0.0.1:{srv.server_address[1]}", None, 10)
        for _ in range(3):
            assert c.request("POST", "/v1/completions", {"prompt": "x"}) == (200, {"ok": True})
            time.sleep(0.2)  # the server's close reaches the client's socket
        c.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_bench_against_real_server(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the server needs one CPU device, not the session's 8
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("REDKNOT_API_KEYS", raising=False)
    out_file, head_file = tmp_path / "qps.json", tmp_path / "qps_headline.json"
    dur = 3.0
    res = bench_qps.main(["--serve-args", "--preset tiny --profile tiny-exact --max-model-len 512 --log-level warning "
                          "--max-queue 2 --reuse-batch 2",
                          "--port", str(free_port()), "--concurrency", "1,2", "--arms", "redknot,prefix,recompute",
                          "--duration-s", str(dur), "--warmup-requests", "1", "--warmup-max-rounds", "3", "--docs", "4",
                          "--docs-per-request", "2", "--doc-chars", "48", "--prompt-chars", "16",
                          "--output-len", "4", "--bootstrap", "500", "--overload", "4", "--out", str(out_file),
                          "--headline", str(head_file)])
    printed = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + printed)
    data = json.loads(out_file.read_text())
    assert data["cells"] == json.loads(json.dumps(res["cells"]))
    assert data["server"]["started_here"]
    stop = data["server"]["stop"]  # graceful: uvicorn re-raises SIGTERM after draining
    assert stop["stopped_by"] == "SIGTERM" and stop["exit_code"] in (0, -signal.SIGTERM), stop
    assert data["server"]["device"]["backend"] == "cpu"
    assert data["host"]["node"] and "serve.py" in " ".join(data["server"]["command"])
    assert "closed loop" in data["policies"]["arrival"] and "decode batch" in data["policies"]["server_batching"]
    assert [d["tokens"] for d in data["workload"]["documents"]] == [48] * 4  # byte tokenizer: one id per char
    assert set(data["results"]) == {"redknot", "prefix", "recompute"}
    for arm in ("redknot", "prefix", "recompute"):
        assert set(data["results"][arm]) == {"1", "2"}
    assert "| redknot | 1 |" in printed and "| recompute | 2 |" in printed
    for cell in data["cells"]:
        s, recs = cell["summary"], cell["records"]
        assert s["completed"] > 0 and s["errors"] == 0 and cell["warmup_errors"] == 0, s
        assert s["clients"] == cell["concurrency"] and s["fallbacks"] == 0
        mem = cell["memory_mib"]  # the server's resident set before and after; no device statistics on CPU
        assert all(v > 100 for v in mem["server_rss"]) and mem["device_in_use"] == [None, None], mem
        assert s["arm_ran"] == [cell["arm"]]  # the RedKnot arm really ran, and recompute ran natively
        # raw records kept: one per request sent in the window, every client at least once
        assert len(recs) == s["requests_sent"] == s["completed"]
        assert {r["client"] for r in recs} == set(range(cell["concurrency"]))
        assert all(0 <= r["start_s"] < dur for r in recs)  # started before the deadline
        assert s["window_s"] == pytest.approx(max(dur, max(r["end_s"] for r in recs)))  # to the deadline at least
        # a fixed output length (ignore_eos) and one prompt length: every request at one set of shapes
        assert all(r["completion_tokens"] == 4 and r["finish_reason"] == "length" and len(r["docs"]) == 2
                   for r in recs)
        assert {r["prompt_tokens"] for r in recs} == {2 * 48 + data["workload"]["prompt_tokens"]}
        assert s["output_tokens"] == sum(r["completion_tokens"] for r in recs)
        if cell["arm"] == "redknot":
            assert all(r["cached_tokens"] > 0 for r in recs)
            # the server's batching in the cell: RedKnot requests decode as rows of the document batch
            assert 1 <= cell["server_batching"]["redknot_reuse_decode_batch_rows"] <= cell["concurrency"], cell
        else:  # prefix-arm and Recomputed requests decode as rows of the plain batch
            assert 1 <= cell["server_batching"]["redknot_decode_batch_rows"] <= cell["concurrency"], cell
        if cell["arm"] == "prefix":  # the first cited document: computed in no layer
            assert all(r["cached_tokens"] == 48 for r in recs)
        ttft = sorted(r["ttft_s"] for r in recs)  # the server's, per request
        assert 0 < ttft[0] and ttft[-1] < max(r["end_s"] - r["start_s"] for r in recs)
        assert s["ttft_s"]["p50"] == pytest.approx(float(np.quantile(ttft, 0.5)))
        assert s["requests_per_s"] == pytest.approx(s["completed"] / s["window_s"], rel=1e-9)
        assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["window_s"], rel=1e-9)
        for key in ("requests_per_s", "output_tokens_per_s"):
            lo, hi = s[key + "_ci95"]
            assert lo <= s[key] * (1 + 1e-9) and s[key] <= hi * (1 + 1e-9), (key, lo, s[key], hi)
        # warm-up rounds (each client 1 request) until one compiles nothing, at most 3; the window's compiles said
        rounds = cell["warmup_round_programs"]
        assert len(cell["warmup_records"]) == len(rounds) * cell["concurrency"]
        if cell["concurrency"] == 1 and cell["arm"] != "recompute":  # an arm's first request compiles (the
            assert rounds[0] > 0  # plain path, recompute's, was warmed at start-up)
        assert (rounds[-1] == 0 or len(rounds) == 3) and 0 not in rounds[:-1], rounds
        assert cell["programs_compiled_in_window"] >= 0 and data["workload"]["warmup_max_rounds"] == 3
    # both arms see the same request stream at a level: same citations in the same order
    by = {(c["arm"], c["concurrency"]): c["records"] for c in data["cells"]}
    for level in (1, 2):
        a = {(r["client"], r["seq"]): r["docs"] for r in by["redknot", level]}
        b = {(r["client"], r["seq"]): r["docs"] for r in by["recompute", level]}
        assert all(a[k] == b[k] for k in a.keys() & b.keys())
    # open loop at 4x each arm's best closed-loop rate (a 2-client rate, under the 8-slot decode batch's
    # capacity): a queue of 2 refuses with 429 and Retry-After, never a 5xx
    assert [o["arm"] for o in data["overload"]] == ["redknot", "prefix", "recompute"]
    for o in data["overload"]:
        s = o["summary"]
        best = max(c["summary"]["requests_per_s"] for c in data["cells"] if c["arm"] == o["arm"])
        assert o["offered_per_s"] == pytest.approx(4 * best) and o["client_stopped"] is None
        assert s["sent"] == len(o["records"]) and s["completed"] > 0 and set(s["by_status"]) == {"200", "429"}, s
        assert s["refused_429"] == s["by_status"]["429"] and s["refused_without_retry_after"] == 0
        assert all(r["retry_after"] == "1" for r in o["records"] if r["status"] == 429)
        assert s["memory_mib"]["server_rss"]["max"] >= s["memory_mib"]["server_rss"]["start"] > 100, s["memory_mib"]
    assert "Overload (open loop)" in printed
    head = json.loads(head_file.read_text())  # issue #46's summary: one row per (arm, level)
    assert [o["arm"] for o in head["overload"]] == ["redknot", "prefix", "recompute"]
    assert head["date"] == data["date"] and "bench_qps.py" in head["command"] and "cpu" in head["device"]
    assert [(r["arm"], r["concurrency"]) for r in head["rows"]] == [(c["arm"], c["concurrency"]) for c in data["cells"]]
    # a run split into calls: a later call's rows replace the same points, the others stay
    later = {**head, "date": "later", "rows": [dict(head["rows"][0], requests_per_s=-1.0, date="later")]}
    merged = bench_qps.merge_headline(head, later)
    assert len(merged["rows"]) == len(head["rows"]) and merged["date"] == "later"
    assert [r["requests_per_s"] for r in merged["rows"]].count(-1.0) == 1
    with pytest.raises(SystemExit, match="from device 'cpu x1'"):
        bench_qps.merge_headline({**head, "device": "cpu x1"}, later)
    for r, c in zip(head["rows"], data["cells"]):
        assert (r["requests_per_s"], r["ci"], r["ttft_p50_s"], r["ttft_p90_s"]) == (
            c["summary"]["requests_per_s"], c["summary"]["requests_per_s_ci95"], c["summary"]["ttft_s"]["p50"],
            c["summary"]["ttft_s"]["p90"])
