"""Throughput (requests/s, output tokens/s) and TTFT of the HTTP server's arms (issues #9, #46).

    python launch/bench_qps.py --concurrency 1,2,4 --duration-s 30 --out qps.json
    python launch/bench_qps.py --serve-args "--checkpoint DIR --max-model-len 4096" --out qps.json
    python launch/bench_qps.py --url http://127.0.0.1:8000 --api-key KEY --out qps.json
    python launch/bench_qps.py --arms redknot,prefix,recompute --concurrency 1,4,16 --output-len 64 \
        --headline docs/results/qps_headline.json --out qps.json

Server: without --url, `launch/serve.py` is started here as a subprocess on a free loopback port
(its flags from --serve-args; warm-up stays on so no measured request pays the plain path's
compilation) and stopped at the end (SIGTERM); its log goes to OUT.server.log. With --url a
running server is used as it is.

Workload (seeded, identical for every arm): --docs documents of about --doc-chars characters of
seeded words, each turned into token ids by the server (`POST /tokenize`) and cut to the
shortest one's length, registered once (`POST /v1/documents {"token_ids": ...}`), so every
document has the same number of tokens. Prompts likewise: a pool of PROMPT_POOL seeded texts
of about --prompt-chars characters, tokenized and cut to one length. Every request is a
non-streaming `/v1/completions` call citing --docs-per-request documents, a seeded random
subset in a random order (`documents`: the extension field), then a prompt drawn from the pool
(sent as token ids), `max_tokens` = --output-len, `ignore_eos` true (vLLM's extension: a fixed
output length), temperature 0. Output tokens are still the server's `usage.completion_tokens`,
never assumed. The arms differ only in `arm` ("redknot", "prefix": the first cited document as a
prefix cache would serve it, "recompute"); request i of client c at concurrency level L cites
the same documents with the same prompt in every arm. Equal token lengths keep every request
of an arm at few shapes; what still varies (document batch sizes up to the level, the rows a
plan protects) compiles in the warm-up rounds, or, since a round's batches depend on timing, in the
window after a round that compiled nothing (a cell's `programs_compiled_in_window` says so): give the
server `--warmup-documents` in --serve-args, which warms every batch size at start-up.

Arrival policy: closed loop, zero think time. Each of the L clients (one thread, one keep-alive
HTTP connection) sends its next request as soon as the previous one finished, from the window
start t0 until t0 + --duration-s; a request started before that deadline is always waited for
(the window ends at the last such request's end, t_end), so every request sent in the window
is in the records, errors included. Cells run level by level, the arms at each level in turn,
each after a warm-up by the same clients (kept in the output as warm-up records, not in the
window): rounds in which every client sends --warmup-requests, repeated while the server's
`redknot_compiled_programs_total` still grows (at most --warmup-max-rounds). Each cell records
the programs each round compiled and those compiled during its window
(`programs_compiled_in_window`: not 0 means the window paid for a compilation, and the run says
so on stderr).

Server batching policy (`BATCHING_POLICY`, docs/serving.md "What is batched"): plain
completions and `arm: recompute` share one continuous decode batch of `--slots` sequences, each
joining after a chunked prefill; RedKnot and prefix requests prefill a layer at a time (up to
--reuse-batch RedKnot requests together) within the step's token budget, then decode as rows
of their own batches; the cited documents stay in one device arena.

Statistics per (arm, level), over the records of the window W = t_end - t0 (seconds); TTFT is
the server's (`redknot.ttft_s` of each response: submission to first token, queue wait
included), p50 / p90 over the window's completed requests:
requests/s = completed / W (completed = HTTP 200), output tokens/s = sum of their
`completion_tokens` / W; errors = every other outcome (non-200 status or a transport error,
status 0), counted by status, never dropped. 95 % confidence intervals: a nonparametric
bootstrap over the per-request records. Each record carries its cycle time: the time from the
previous request of its client starting (t0 for a client's first) to its own start's
successor (the client's next start, or t_end for its last), so a client's cycles tile [t0,
t_end] and sum(cycles) = L * W. Then requests/s = L * sum(ok) / sum(cycle) and tokens/s =
L * sum(tokens) / sum(cycle) exactly; each of --bootstrap resamples draws the records with
replacement (numpy, seeded) and recomputes these ratios; the CI is the 2.5 / 97.5 percentile
of the resampled ratios. It treats requests as independent, so it reflects the spread of
per-request service time in this run, not run-to-run or machine-to-machine variation.

Overload (--overload FACTOR, issue #46 item 5): after the cells, each arm in turn is offered
FACTOR times its best requests/s of the run (its sustainable rate under the closed loop), open
loop: Poisson arrivals (seeded exponential gaps) for --duration-s, each request on a connection
of its own whatever the server's state, every one waited for and kept (status, Retry-After of a
refusal). Reported per arm: requests sent and completed per second, responses by status, 429s
(and those without Retry-After), 5xx, transport errors, and the server's memory (resident set,
device bytes in use) read every second: start, max, end. What a server under twice its
sustainable rate should show: 429s with Retry-After, no 5xx, memory flat.

Output: --out JSON (command, date, host, server command and device, policies, workload, per
cell the summary, the server's counter deltas from /metrics, its memory at the start and the
end of the measured window (resident set; device bytes in use and peak) and the raw records), a markdown
table on stdout, and with --headline the issue's one-row-per-point file ({"device", "date",
"command", "rows": [{"arm", "concurrency", "requests_per_s", "ci", "ttft_p50_s", "ttft_p90_s",
"tokens_per_s", "date", "command"}]}), merged into the file's earlier rows from the same device
(a run split into calls, one concurrency level each: each row keeps its own command and date).
Client side: standard library + numpy only.
"""

from __future__ import annotations

import collections
import datetime
import http.client
import json
import math
import os
import pathlib
import platform
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from launch import _cli  # noqa: E402
DEFAULT_SERVE_ARGS = "--preset tiny --profile tiny-exact --max-model-len 512"
ARMS = ("redknot", "prefix", "recompute")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu north south east west river "
         "stone cloud field light ember frost amber cedar maple harbor lantern meadow summit valley").split()
PROMPT_POOL = 32  # distinct prompts a run draws from
ARRIVAL_POLICY = ("closed loop, zero think time: each of L clients (one thread, one keep-alive HTTP/1.1 "
                  "connection) sends its next non-streaming request when the previous one finished, from the "
                  "window start until --duration-s later; requests started before the deadline are waited for "
                  "and all counted (the window ends at the last one's end)")
BATCHING_POLICY = ("server (docs/serving.md 'What is batched'): each worker step runs the decode rows, then prefill "
                   "chunks and document-prefill layers within --max-batched-tokens; plain completions and "
                   "arm=recompute share one continuous decode batch of --slots sequences (each joins after a "
                   "chunked prefill of --prefill-chunk rows); RedKnot requests prefill a layer at a time, up to "
                   "--reuse-batch together, then decode as rows of one document decode batch of --slots; prefix-arm "
                   "requests prefill alone, then their caches join the plain batch; cited documents stay in one "
                   "device arena")
CI_METHOD = ("bootstrap over per-request records: each record's cycle time (its client's previous boundary to "
             "its next start, or window end) tiles the window, rate = L * sum(ok or tokens) / sum(cycle); "
             "resampled with replacement, 2.5/97.5 percentiles; requests treated as independent")
COUNTERS = ("redknot_requests_total", "redknot_http_responses_total", "redknot_cert_validated_total",
            "redknot_cert_fallback_total", "redknot_rejected_total", "redknot_artifact_tier_hits_total",
            "redknot_cancelled_total", "redknot_deferred_out_of_memory_total")
# the server's batching per cell, as means of these histograms' observations (their _sum and _count)
BATCHING = ("redknot_decode_batch_rows", "redknot_reuse_batch_requests", "redknot_reuse_decode_batch_rows")


# ---------------------------------------------------------------------------------- statistics
def bootstrap_ratio_ci(num, den, scale: float = 1.0, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05,
                       chunk: int = 250) -> tuple[float, float] | None:
    """Percentile bootstrap CI of `scale * sum(num) / sum(den)` resampling the (num, den) pairs
    (records) with replacement; None without records. A resample whose den sums to 0 is dropped."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"num and den: expected equal 1-d shapes, got {num.shape} and {den.shape}")
    n = num.size
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    stats = []
    for start in range(0, n_boot, chunk):
        idx = rng.integers(0, n, (min(chunk, n_boot - start), n))
        d = den[idx].sum(1)
        ok = d > 0
        stats.append(scale * num[idx].sum(1)[ok] / d[ok])
    s = np.concatenate(stats)
    if s.size == 0:
        return None
    lo, hi = np.quantile(s, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def cycles(records: list[dict], t_end: float) -> np.ndarray:
    """Per record (in list order), the cycle time: from its client's previous boundary (window
    start 0 for the client's first request, else this request's start) to the next boundary (the
    client's next start, or t_end for its last). A client's cycles sum to t_end."""
    out = np.zeros(len(records))
    by_client: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        by_client.setdefault(r["client"], []).append(i)
    for idxs in by_client.values():
        idxs.sort(key=lambda i: records[i]["start_s"])
        bounds = [0.0] + [records[i]["start_s"] for i in idxs[1:]] + [t_end]
        for k, i in enumerate(idxs):
            out[i] = bounds[k + 1] - bounds[k]
    return out


def summarize(records: list[dict], level: int, n_boot: int, seed: int, duration_s: float = 0.0) -> dict:
    """A cell's figures. The window runs from 0 to the last request's end, or to `duration_s`
    (the clients' deadline: none starts a request after it) if that is later."""
    t_end = max([r["end_s"] for r in records] + [duration_s])
    ok = np.array([r["status"] == 200 for r in records], np.float64)
    toks = np.array([(r.get("completion_tokens") or 0) if r["status"] == 200 else 0 for r in records], np.float64)
    cyc = cycles(records, t_end)
    clients = len({r["client"] for r in records})
    lat = np.array([r["end_s"] - r["start_s"] for r in records if r["status"] == 200])
    errors: dict[str, int] = {}
    for r in records:
        if r["status"] != 200:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    s = {"clients": clients, "window_s": t_end, "requests_sent": len(records), "completed": int(ok.sum()),
         "errors": int(len(records) - ok.sum()), "errors_by_status": errors,
         "output_tokens": int(toks.sum()),
         "fallbacks": sum(1 for r in records if r["status"] == 200 and r.get("fallback")),
         "arm_ran": sorted({r.get("arm_ran") for r in records if r["status"] == 200} - {None}),
         "requests_per_s": float(ok.sum() / t_end) if t_end > 0 else None,
         "output_tokens_per_s": float(toks.sum() / t_end) if t_end > 0 else None,
         "requests_per_s_ci95": None, "output_tokens_per_s_ci95": None,
         "latency_s": None, "ttft_s": None}
    if t_end > 0 and records:
        # clients = L: every client sends at least one request per window, so sum(cyc) = L * W
        s["requests_per_s_ci95"] = bootstrap_ratio_ci(ok, cyc, clients, n_boot, seed)
        s["output_tokens_per_s_ci95"] = bootstrap_ratio_ci(toks, cyc, clients, n_boot, seed + 1)
    if lat.size:
        s["latency_s"] = {"mean": float(lat.mean()), "p50": float(np.quantile(lat, 0.5)),
                          "p90": float(np.quantile(lat, 0.9)), "p99": float(np.quantile(lat, 0.99)),
                          "max": float(lat.max())}
    ttft = np.array([r["ttft_s"] for r in records if r["status"] == 200 and r.get("ttft_s") is not None])
    if ttft.size:
        s["ttft_s"] = {"mean": float(ttft.mean()), "p50": float(np.quantile(ttft, 0.5)),
                       "p90": float(np.quantile(ttft, 0.9)), "max": float(ttft.max())}
    return s


# ---------------------------------------------------------------------------------- HTTP client
class Client:
    """One keep-alive connection (reopened after a transport error, or when the server closed it)."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--url: expected http(s)://host:port, got {url!r}")
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.key, self.timeout, self.conn = api_key, timeout, None
        self.headers: dict[str, str] = {}  # the last response's, names lower-cased

    def _connect(self):
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        self.conn = cls(self.host, self.port, timeout=self.timeout)

    def request(self, method: str, path: str, body=None) -> tuple[int, object]:
        """(status, parsed JSON or text); status 0 and {"error": ...} for a transport error."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        for attempt in (0, 1):
            if self.conn is not None and self._closed_by_server():
                self.close()
            if self.conn is None:
                self._connect()
            try:
                self.conn.request(method, self.prefix + path, body=data, headers=headers)
                r = self.conn.getresponse()
                status, text = r.status, r.read().decode("utf-8", "replace")
                self.headers = {k.lower(): v for k, v in r.getheaders()}
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self.close()
                if attempt == 0 and method == "GET":  # a stale keep-alive socket: one retry, GETs only
                    continue
                return 0, {"error": f"{type(e).__name__}: {e}"}
            except (OSError, http.client.HTTPException) as e:
                self.close()
                return 0, {"error": f"{type(e).__name__}: {e}"}
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def _closed_by_server(self) -> bool:
        """Whether the idle keep-alive connection reads as ready, i.e. the server closed it (uvicorn
        does after 5 s idle) or sent what no request asked for: then it is not reused, as urllib3
        checks a pooled connection before reusing it (a POST sent into it would fail, and is not
        resent)."""
        sock = self.conn.sock
        return sock is not None and bool(select.select([sock], [], [], 0)[0])

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def parse_memory(text: str) -> dict[str, float | None]:
    """The server's memory in MiB from a Prometheus text page: its resident set (`server_rss`) and
    its devices' bytes in use and peak (`device_in_use`, `device_peak`); None where not reported
    (no device statistics on CPU)."""
    def sample(pattern):
        m = re.search(rf"^{pattern} ([0-9.eE+-]+)$", text, re.M)
        return round(float(m.group(1)) / 2**20, 1) if m else None

    return {"server_rss": sample("process_resident_memory_bytes"),
            "device_in_use": sample(r'redknot_device_memory_bytes\{stat="in_use"\}'),
            "device_peak": sample(r'redknot_device_memory_bytes\{stat="peak"\}')}


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS samples of a Prometheus text page, and the BATCHING histograms' _sum and
    _count, keyed by 'name{labels}'."""
    names = set(COUNTERS) | {h + end for h in BATCHING for end in ("_sum", "_count")}
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(1) in names:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def batching_means(deltas: dict[str, float]) -> dict[str, float]:
    """Per BATCHING histogram observed in a cell (warm-up rounds included), the mean observation:
    rows per plain decode step, requests per batched document prefill, rows per document decode step."""
    return {h: deltas[h + "_sum"] / deltas[h + "_count"] for h in BATCHING if deltas.get(h + "_count")}


# ---------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROBE = ("import jax, json; d = jax.devices(); print(json.dumps({'backend': jax.default_backend(), "
         "'device_kind': d[0].device_kind, 'count': len(d), 'jax': jax.__version__}))")


def probe_device(env: dict) -> dict:
    """What `jax.devices()` gives in the server's environment (same interpreter, same env),
    asked in a short separate process before the server starts (no GPU memory preallocated)."""
    penv = dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        p = subprocess.run([sys.executable, "-c", PROBE], env=penv, capture_output=True, text=True, timeout=300)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        return json.loads(line) if p.returncode == 0 and line else {"error": p.stderr[-500:]}
    except (subprocess.TimeoutExpired, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


class SpawnedServer:
    def __init__(self, serve_args: list[str], port: int, log_path: str, startup_timeout_s: float):
        self.cmd = [sys.executable, str(ROOT / "launch" / "serve.py"), *serve_args, "--host", "127.0.0.1",
                    "--port", str(port)]
        self.url = f"http://127.0.0.1:{port}"
        self.env = dict(os.environ)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc = None
        self.startup_s = None

    def start(self) -> None:
        self.log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        c = Client(self.url, None, 5)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench_qps: the server exited with {self.proc.returncode} before answering "
                                 f"/healthz; last log lines ({self.log_path}):\n{self.tail()}")
            st, body = c.request("GET", "/healthz")
            if st == 200:
                break
            if st == 503 and isinstance(body, dict) and body.get("status") == "failed":  # it will not recover
                self.stop()
                raise SystemExit(f"bench_qps: the server's warm-up failed ({body.get('error')}); last log lines "
                                 f"({self.log_path}):\n{self.tail()}")
            if time.perf_counter() - t0 > self.startup_timeout_s:
                self.stop()
                raise SystemExit(f"bench_qps: the server did not answer /healthz within --startup-timeout-s "
                                 f"{self.startup_timeout_s:g}; last log lines:\n{self.tail()}")
            time.sleep(0.5 if time.perf_counter() - t0 < 10 else 2.0)  # a warm-up of minutes: fewer log lines
        c.close()
        self.startup_s = time.perf_counter() - t0

    def tail(self, n: int = 4000) -> str:
        try:
            return pathlib.Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> dict | None:
        """SIGTERM (graceful: uvicorn drains, the model worker is joined, then it re-raises the
        signal, so the exit status is 0 or -SIGTERM); SIGKILL after 60 s."""
        if self.proc is None:
            return None
        how = "exited before the end"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            how = "SIGTERM"
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                how = "SIGKILL after SIGTERM went unanswered for 60 s"
        self.log.close()
        return {"exit_code": self.proc.returncode, "stopped_by": how}

    def device_lines(self) -> list[str]:
        """Lines of the server log that name an accelerator backend (JAX's fallback warnings etc.)."""
        return [ln for ln in self.tail(1 << 20).splitlines()
                if re.search(r"\b(GPU|CUDA|cuda|TPU|rocm|backend)\b", ln)][:20]


# ---------------------------------------------------------------------------------- workload
def make_text(rng: np.random.Generator, n_chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append(WORDS[int(rng.integers(len(WORDS)))])
    return " ".join(words)[:n_chars].rstrip().ljust(n_chars, ".")


def request_stream(seed: int, level: int, client: int, n_docs: int, k: int, prompts: list):
    """Endless seeded (document order, prompt) pairs of one client at one level: the same in both arms."""
    rng = np.random.default_rng([seed, level, client])
    while True:
        docs = [int(i) for i in rng.permutation(n_docs)[:k]]
        yield docs, prompts[int(rng.integers(len(prompts)))]


def equal_length_ids(admin, texts: list[str], what: str) -> list[list[int]]:
    """The texts as the server's token ids (`POST /tokenize`), each cut to the shortest one's length."""
    ids = []
    for i, text in enumerate(texts):
        st, r = admin.request("POST", "/tokenize", {"prompt": text})
        if st != 200 or not isinstance(r, dict) or not isinstance(r.get("tokens"), list):
            raise SystemExit(f"bench_qps: POST /tokenize ({what} {i}) answered {st}: {r!r} (the server must "
                             "tokenize, so every request of an arm has the same shapes)")
        ids.append(r["tokens"])
    n = min(len(t) for t in ids)
    if n < 1:
        raise SystemExit(f"bench_qps: a {what} tokenizes to no tokens; raise its --*-chars")
    return [t[:n] for t in ids]


def one_request(client: Client, model: str, doc_ids: list[str], order: list[int], prompt: str, arm: str,
                output_len: int, t0: float, cid: int, seq: int, deadline: float | None = None) -> dict | None:
    """One completion, timed; None (nothing sent) when it would start at or after `deadline`."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "documents": [doc_ids[i] for i in order], "arm": arm}
    start = time.perf_counter()
    if deadline is not None and start >= deadline:
        return None
    status, resp = client.request("POST", "/v1/completions", body)
    end = time.perf_counter()
    rec = {"client": cid, "seq": seq, "start_s": start - t0, "end_s": end - t0, "status": status, "docs": order}
    if status == 200 and isinstance(resp, dict):
        u, ext = resp.get("usage") or {}, resp.get("redknot") or {}
        rec.update(completion_tokens=u.get("completion_tokens"), prompt_tokens=u.get("prompt_tokens"),
                   cached_tokens=(u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                   finish_reason=(resp.get("choices") or [{}])[0].get("finish_reason"),
                   arm_ran=ext.get("arm"), fallback=ext.get("fallback"), ttft_s=ext.get("ttft_s"))
    else:
        err = resp.get("error") if isinstance(resp, dict) else resp
        rec["error"] = (json.dumps(err) if not isinstance(err, str) else err)[:500]
        rec["retry_after"] = client.headers.get("retry-after") if status else None
    return rec


def run_cell(url, api_key, model, doc_ids, prompts, arm, level, args) -> dict:
    """Warm-up then one measured window of `level` closed-loop clients in `arm`."""
    clients = [Client(url, api_key, args.request_timeout_s) for _ in range(level)]
    streams = [request_stream(args.seed, level, c, len(doc_ids), args.docs_per_request, prompts)
               for c in range(level)]
    warm: list[dict] = []
    lock = threading.Lock()
    t_warm = time.perf_counter()
    rounds = []  # programs the server compiled in each warm-up round
    metrics = Client(url, None, args.request_timeout_s)

    def warm_worker(c, rnd):  # a round: each client sends its warm-up requests back to back
        for k in range(args.warmup_requests):
            seq = (rnd * level + c) * args.warmup_requests + k
            order, prompt = next(request_stream(args.seed + 10_007, level, seq, len(doc_ids),
                                                args.docs_per_request, prompts))
            r = one_request(clients[c], model, doc_ids, order, prompt, arm, args.output_len, t_warm, c, seq)
            with lock:
                warm.append(dict(r, round=rnd))

    while args.warmup_requests and len(rounds) < args.warmup_max_rounds:
        before = scrape(metrics)[0]
        ts = [threading.Thread(target=warm_worker, args=(c, len(rounds))) for c in range(level)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        after = scrape(metrics)[0]
        rounds.append(None if before is None or after is None else after - before)
        if not rounds[-1]:  # nothing compiled (or the server does not say): warm
            break
    if warm and all(r["status"] != 200 for r in warm):
        raise SystemExit(f"bench_qps: every warm-up request of arm {arm}, concurrency {level} failed; "
                         f"first: status {warm[0]['status']}: {warm[0].get('error')}")
    before, mem0 = scrape(metrics)

    records: list[dict] = []
    go = threading.Event()
    box = {}

    def worker(c):
        go.wait()
        t0, deadline = box["t0"], box["t0"] + args.duration_s
        seq = 0
        while True:  # at least one request per client, so every client's cycles tile the window
            order, prompt = next(streams[c])
            r = one_request(clients[c], model, doc_ids, order, prompt, arm, args.output_len, t0, c, seq,
                            deadline if seq else None)
            if r is None:  # the window closed before it started
                return
            with lock:
                records.append(r)
            seq += 1

    ts = [threading.Thread(target=worker, args=(c,)) for c in range(level)]
    for t in ts:
        t.start()
    box["t0"], box["t0_unix"] = time.perf_counter(), time.time()
    go.set()
    for t in ts:
        t.join()
    for c in clients:
        c.close()
    records.sort(key=lambda r: (r["start_s"], r["client"]))
    after, mem1 = scrape(metrics)
    metrics.close()
    return {"arm": arm, "concurrency": level, "t0_unix": box["t0_unix"], "records": records,
            "warmup_records": sorted(warm, key=lambda r: r["start_s"]), "warmup_round_programs": rounds,
            "programs_compiled_in_window": None if before is None or after is None else after - before,
            "memory_mib": {k: [mem0[k], mem1[k]] for k in mem0}}  # the window's first and last: flat under load?


OVERLOAD_MAX_OPEN = 1024  # requests in flight at once before the offered load stops (the client's limit)


def run_overload(url, api_key, model, doc_ids, prompts, arm, rate, args) -> dict:
    """Open-loop load on `arm`: requests arrive as a Poisson process of `rate` per second (seeded
    exponential gaps) for --duration-s, each on a connection of its own, whatever the server's
    state (issue #46: at twice the sustainable rate, 429 with Retry-After, never a 5xx, memory
    flat); every request sent is waited for and kept. The server's memory is read every second."""
    rng = np.random.default_rng([args.seed, 3, ARMS.index(arm)])
    stream = request_stream(args.seed + 20_011, 0, 0, len(doc_ids), args.docs_per_request, prompts)
    records, lock, threads = [], threading.Lock(), []
    metrics = Client(url, None, args.request_timeout_s)
    before, mem0 = scrape(metrics)
    samples, done = [], threading.Event()
    t0 = time.perf_counter()

    def sample():  # the server's memory once a second (its own connection: /metrics answers between steps)
        c = Client(url, None, args.request_timeout_s)
        while not done.wait(1.0):
            samples.append({"t_s": time.perf_counter() - t0, **scrape(c)[1]})
        c.close()

    def send(seq, order, prompt):
        c = Client(url, api_key, args.request_timeout_s)
        r = one_request(c, model, doc_ids, order, prompt, arm, args.output_len, t0, seq, seq)
        c.close()
        with lock:
            records.append(r)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t_next, seq, stopped = float(rng.exponential(1 / rate)), 0, None
    while t_next < args.duration_s:
        time.sleep(max(0.0, t0 + t_next - time.perf_counter()))
        with lock:
            open_now = len(threads) - len(records)  # sent, not yet answered
        if open_now >= OVERLOAD_MAX_OPEN:
            stopped = f"{OVERLOAD_MAX_OPEN} requests open at {t_next:.2f} s: the offered load stopped there"
            break
        order, prompt = next(stream)
        threads.append(threading.Thread(target=send, args=(seq, order, prompt)))
        threads[-1].start()
        seq, t_next = seq + 1, t_next + float(rng.exponential(1 / rate))
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    after, mem1 = scrape(metrics)
    metrics.close()
    records.sort(key=lambda r: r["start_s"])
    window = max([r["end_s"] for r in records] + [args.duration_s])
    by_status = collections.Counter(str(r["status"]) for r in records)
    refused = [r for r in records if r["status"] == 429]
    ttft = np.array([r["ttft_s"] for r in records if r["status"] == 200 and r.get("ttft_s") is not None])
    return {"arm": arm, "factor": args.overload, "offered_per_s": rate, "records": records,
            "client_stopped": stopped, "memory_samples": samples,
            "programs_compiled_in_window": None if before is None or after is None else after - before,
            "summary": {"sent": len(records), "window_s": window, "completed": by_status.get("200", 0),
                        "completed_per_s": by_status.get("200", 0) / window, "by_status": dict(by_status),
                        "refused_429": len(refused),
                        "refused_without_retry_after": sum(not r.get("retry_after") for r in refused),
                        "server_errors_5xx": sum(r["status"] >= 500 for r in records),
                        "transport_errors": by_status.get("0", 0),
                        "ttft_p50_s": float(np.quantile(ttft, 0.5)) if ttft.size else None,
                        "memory_mib": {k: {"start": mem0[k],  # start / max / end, the table's order
                                           "max": max((m[k] for m in samples + [mem0, mem1] if m[k] is not None),
                                                      default=None), "end": mem1[k]} for k in mem0}}}


def overload_table(runs: list[dict]) -> str:
    rows = ["| arm | offered req/s | sent | completed req/s | 429 (no Retry-After) | 5xx | transport errors | "
            "server RSS MiB start / max / end | device MiB start / max / end |",
            "|---|---:|---:|---:|---|---:|---:|---|---|"]
    for o in runs:
        s = o["summary"]
        mem = lambda k: " / ".join("-" if v is None else f"{v:.0f}" for v in s["memory_mib"][k].values())
        rows.append(f"| {o['arm']} | {o['offered_per_s']:.2f} ({o['factor']:g}x) | {s['sent']} | "
                    f"{s['completed_per_s']:.2f} | {s['refused_429']} ({s['refused_without_retry_after']}) | "
                    f"{s['server_errors_5xx']} | {s['transport_errors']} | {mem('server_rss')} | "
                    f"{mem('device_in_use')} |")
    return "\n".join(rows)


def scrape(client: Client) -> tuple[float | None, dict]:
    """From one /metrics page: the server's `redknot_compiled_programs_total` (programs it lowered
    so far; None if it does not say) and its memory (`parse_memory`)."""
    st, text = client.request("GET", "/metrics")
    text = text if st == 200 and isinstance(text, str) else ""
    m = re.search(r"^redknot_compiled_programs_total ([0-9.eE+-]+)$", text, re.M)
    return (float(m.group(1)) if m else None), parse_memory(text)


# ---------------------------------------------------------------------------------- CLI
def parse_args(argv):
    ap = _cli.parser(__doc__, __file__, "python launch/bench_qps.py --concurrency 1,4 --out qps.json")  # README
    ap.add_argument("--url", help="attach to a running server (http://host:port) instead of starting one")
    ap.add_argument("--serve-args", default=None, help=f"flags for launch/serve.py when it is started here "
                    f"(default {DEFAULT_SERVE_ARGS!r}; --host/--port are set here)")
    ap.add_argument("--port", type=int, default=0, help="port of the started server (default: a free one)")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--api-key", default=os.environ.get("BENCH_QPS_API_KEY"), help="Bearer key, if the server has keys")
    ap.add_argument("--arms", default="redknot,recompute", help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--concurrency", default="1,2,4", help="comma-separated numbers of closed-loop clients")
    ap.add_argument("--duration-s", type=float, default=30.0, help="measurement window per arm and level")
    ap.add_argument("--warmup-requests", type=int, default=2,
                    help="per client and warm-up round, before each arm and level's window")
    ap.add_argument("--warmup-max-rounds", type=int, default=4,
                    help="warm-up rounds at most: they repeat while the server still compiles programs")
    ap.add_argument("--docs", type=int, default=6, help="documents registered")
    ap.add_argument("--docs-per-request", type=int, default=2)
    ap.add_argument("--doc-chars", type=int, default=96,
                    help="characters per document text (token ids then cut to the shortest document's length)")
    ap.add_argument("--prompt-chars", type=int, default=32, help="characters per prompt text (cut likewise)")
    ap.add_argument("--output-len", type=int, default=16, help="max_tokens of every request (ignore_eos: exact)")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples per interval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-device-probe", action="store_true",
                    help="skip asking jax.devices() in the started server's environment")
    ap.add_argument("--overload", type=float, default=0.0,
                    help="after the cells, each arm offered FACTOR x its best requests/s of the run, open loop "
                         "(Poisson arrivals) for --duration-s: 429s, 5xx and memory under overload (0: off)")
    ap.add_argument("--out", default="qps.json")
    ap.add_argument("--headline", default=None, help="also write the one-row-per-point summary here (JSON)")
    args = ap.parse_args(argv)

    def need(flag, ok, what):
        if not ok:
            ap.error(f"{flag}: {what}")

    try:
        args.concurrency_levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated positive integers, got {args.concurrency!r}")
    need("--concurrency", args.concurrency_levels and all(c > 0 for c in args.concurrency_levels),
         f"expected comma-separated positive integers, got {args.concurrency!r}")
    need("--concurrency", len(set(args.concurrency_levels)) == len(args.concurrency_levels),
         f"repeated level in {args.concurrency!r}")
    args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
    need("--arms", args.arm_list and set(args.arm_list) <= set(ARMS) and len(set(args.arm_list)) == len(args.arm_list),
         f"expected a comma-separated subset of {','.join(ARMS)}, got {args.arms!r}")
    need("--duration-s", math.isfinite(args.duration_s) and args.duration_s > 0,
         f"expected a positive number, got {args.duration_s}")
    need("--warmup-requests", args.warmup_requests >= 0, f"expected >= 0, got {args.warmup_requests}")
    need("--warmup-max-rounds", args.warmup_max_rounds >= 1, f"expected >= 1, got {args.warmup_max_rounds}")
    need("--docs", args.docs >= 1, f"expected >= 1, got {args.docs}")
    need("--docs-per-request", 1 <= args.docs_per_request <= args.docs,
         f"expected 1..--docs ({args.docs}), got {args.docs_per_request}")
    need("--doc-chars", args.doc_chars >= 1, f"expected >= 1, got {args.doc_chars}")
    need("--prompt-chars", args.prompt_chars >= 1, f"expected >= 1, got {args.prompt_chars}")
    need("--output-len", args.output_len >= 1, f"expected >= 1, got {args.output_len}")
    need("--overload", math.isfinite(args.overload) and args.overload >= 0,
         f"expected a factor > 0 (0: off), got {args.overload}")
    need("--bootstrap", args.bootstrap >= 100, f"expected >= 100 resamples, got {args.bootstrap}")
    need("--request-timeout-s", args.request_timeout_s > 0, f"expected > 0, got {args.request_timeout_s}")
    need("--port", 0 <= args.port < 65536, f"expected 0..65535, got {args.port}")
    if args.url:
        need("--serve-args", args.serve_args is None, "given with --url: a running server is not started here")
        need("--port", args.port == 0, "given with --url: the port is the URL's")
        args.serve_list = None
    else:
        try:
            args.serve_list = shlex.split(args.serve_args if args.serve_args is not None else DEFAULT_SERVE_ARGS)
        except ValueError as e:
            ap.error(f"--serve-args: {e}")
        clash = [a for a in args.serve_list if a.split("=")[0] in ("--host", "--port")]
        need("--serve-args", not clash, f"{clash[0] if clash else ''} is set here (use --port)")
    return args


def table(cells: list[dict]) -> str:
    def ci(v, c, fmt):
        if v is None:
            return "-"
        return f"{v:{fmt}} [{c[0]:{fmt}}, {c[1]:{fmt}}]" if c else f"{v:{fmt}}"

    rows = ["| arm | clients | completed | errors | fallbacks | window s | requests/s [95% CI] | "
            "output tok/s [95% CI] | latency mean / p50 / p90 s | TTFT p50 / p90 s | server RSS MiB | device MiB |",
            "|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|"]
    for c in cells:
        s = c["summary"]
        lat = s["latency_s"]
        lat_s = f"{lat['mean']:.3f} / {lat['p50']:.3f} / {lat['p90']:.3f}" if lat else "-"
        tt = s.get("ttft_s")
        ttft_s = f"{tt['p50']:.3f} / {tt['p90']:.3f}" if tt else "-"
        mem = c.get("memory_mib", {})
        span = lambda k: " -> ".join("-" if v is None else f"{v:.0f}" for v in mem.get(k, [None, None]))
        rows.append(f"| {c['arm']} | {c['concurrency']} | {s['completed']} | {s['errors']} | {s['fallbacks']} | "
                    f"{s['window_s']:.2f} | {ci(s['requests_per_s'], s['requests_per_s_ci95'], '.2f')} | "
                    f"{ci(s['output_tokens_per_s'], s['output_tokens_per_s_ci95'], '.1f')} | {lat_s} | {ttft_s} | "
                    f"{span('server_rss')} | {span('device_in_use')} |")
    return "\n".join(rows)


def headline(out: dict) -> dict:
    """The one-row-per-point summary of a run (issue #46's qps_headline.json shape)."""
    dev = out.get("server", {}).get("device")
    device = (f"{dev.get('count')} x {dev.get('device_kind')} ({dev.get('backend')}, jax {dev.get('jax')})"
              if isinstance(dev, dict) and "device_kind" in dev else str(dev))
    rows = []
    for c in out["cells"]:
        s = c["summary"]
        tt = s.get("ttft_s") or {}
        rows.append({"arm": c["arm"], "concurrency": c["concurrency"], "requests_per_s": s["requests_per_s"],
                     "ci": s["requests_per_s_ci95"], "ttft_p50_s": tt.get("p50"), "ttft_p90_s": tt.get("p90"),
                     "tokens_per_s": s["output_tokens_per_s"], "completed": s["completed"], "errors": s["errors"],
                     "memory_mib": c.get("memory_mib"), "date": out["date"], "command": shlex.join(out["command"])})
    head = {"device": device, "date": out["date"], "command": shlex.join(out["command"]), "rows": rows}
    if out.get("overload"):
        head["overload"] = [{"arm": o["arm"], "factor": o["factor"], "offered_per_s": o["offered_per_s"],
                             **{k: o["summary"][k] for k in ("sent", "completed_per_s", "by_status", "refused_429",
                                                             "refused_without_retry_after", "server_errors_5xx",
                                                             "memory_mib")}} for o in out["overload"]]
    return head


def merge_headline(old: dict | None, new: dict) -> dict:
    """`new`'s rows over an earlier run's file on the same device (a run split over several calls,
    e.g. a concurrency level each within a device's per-call time limit): a row of the same
    (arm, concurrency) is replaced, the others kept; each row keeps its own command and date,
    the file's are the latest run's (its `overload` too, when it has one). A file from another
    device is refused, naming both."""
    if old is None:
        return new
    if old.get("device") != new["device"]:
        raise SystemExit(f"bench_qps: --headline file is from device {old.get('device')!r}, this run's is "
                         f"{new['device']!r}: give another file")
    key = lambda r: (r["arm"], r["concurrency"])
    mine = {key(r) for r in new["rows"]}
    keep = {"overload": old["overload"]} if "overload" in old else {}  # a later run's overload replaces it
    return {**keep, **new, "rows": [r for r in old.get("rows", []) if key(r) not in mine] + new["rows"]}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out_path = pathlib.Path(args.out)
    out = {"command": ["python", "launch/bench_qps.py", *argv],
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": {"node": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
                    "python": platform.python_version(), "cpu_count": os.cpu_count(), "numpy": np.__version__},
           "policies": {"arrival": ARRIVAL_POLICY, "server_batching": BATCHING_POLICY, "ci": CI_METHOD},
           "workload": {"seed": args.seed, "docs": args.docs, "docs_per_request": args.docs_per_request,
                        "doc_chars": args.doc_chars, "prompt_chars": args.prompt_chars,
                        "output_len": args.output_len, "ignore_eos": True, "temperature": 0, "stream": False,
                        "endpoint": "/v1/completions", "duration_s": args.duration_s,
                        "warmup_requests": args.warmup_requests, "warmup_max_rounds": args.warmup_max_rounds,
                        "concurrency": args.concurrency_levels,
                        "arms": args.arm_list, "bootstrap": args.bootstrap, "overload": args.overload},
           "cells": []}
    srv = None
    try:
        if args.url:
            url = args.url.rstrip("/")
            out["server"] = {"url": url, "started_here": False, "command": None,
                             "device": "unknown: attached to a running server (its /metrics and API do not report "
                                       "the device)"}
        else:
            port = args.port or free_port()
            srv = SpawnedServer(args.serve_list, port, str(out_path) + ".server.log", args.startup_timeout_s)
            url = srv.url
            env = {k: srv.env.get(k) for k in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "XLA_FLAGS")}
            out["server"] = {"url": url, "started_here": True, "command": srv.cmd, "env": env,
                             "log": srv.log_path,
                             "device": probe_device(srv.env) if not args.no_device_probe else "not probed"}
            srv.start()
            out["server"]["startup_s"] = srv.startup_s
        admin = Client(url, args.api_key, args.request_timeout_s)
        st, models = admin.request("GET", "/v1/models")
        if st != 200 or not isinstance(models, dict) or not models.get("data"):
            raise SystemExit(f"bench_qps: GET /v1/models answered {st}: {models!r}"
                             + (" (give --api-key)" if st == 401 else ""))
        model = models["data"][0]["id"]
        out["server"]["model"] = model

        rng = np.random.default_rng([args.seed, 1])
        texts = [f"Document {i}: " + make_text(rng, max(args.doc_chars - len(f"Document {i}: "), 1))
                 for i in range(args.docs)]
        texts = [t[:args.doc_chars] for t in texts]
        t0 = time.perf_counter()
        docs = []
        for i, ids in enumerate(equal_length_ids(admin, texts, "document")):
            st, d = admin.request("POST", "/v1/documents", {"token_ids": ids})
            if st not in (200, 201) or not isinstance(d, dict) or "id" not in d:
                raise SystemExit(f"bench_qps: POST /v1/documents (document {i}) answered {st}: {d!r}")
            docs.append({"id": d["id"], "tokens": d.get("tokens"), "chars": len(texts[i])})
        out["workload"]["registration_s"] = time.perf_counter() - t0
        out["workload"]["documents"] = docs
        prng = np.random.default_rng([args.seed, 2])
        prompts = equal_length_ids(admin, ["Q: " + make_text(prng, max(args.prompt_chars - 3, 1))
                                           for _ in range(PROMPT_POOL)], "prompt")
        out["workload"]["prompt_tokens"] = len(prompts[0])
        doc_ids = [d["id"] for d in docs]

        def save():
            out_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = out_path.with_name(out_path.name + ".tmp")
            tmp.write_text(json.dumps(out, indent=1))
            os.replace(tmp, out_path)

        bar = _cli.progress(desc="cells (level x arm)", total=len(args.concurrency_levels) * len(args.arm_list),
                            unit="cell")
        for level in args.concurrency_levels:
            for arm in args.arm_list:
                bar.set_postfix_str(f"{arm} x{level}")
                _, m0 = admin.request("GET", "/metrics")
                cell = run_cell(url, args.api_key, model, doc_ids, prompts, arm, level, args)
                _, m1 = admin.request("GET", "/metrics")
                c0, c1 = parse_counters(m0 if isinstance(m0, str) else ""), parse_counters(
                    m1 if isinstance(m1, str) else "")
                cell["server_counter_deltas"] = {k: v - c0.get(k, 0.0) for k, v in c1.items() if v != c0.get(k, 0.0)}
                cell["server_batching"] = batching_means(cell["server_counter_deltas"])
                cell["summary"] = summarize(cell["records"], level, args.bootstrap, args.seed, args.duration_s)
                cell["warmup_errors"] = sum(r["status"] != 200 for r in cell["warmup_records"])
                out["cells"].append(cell)
                s = cell["summary"]
                bar.write(f"bench_qps: {arm} x{level}: {s['completed']} completed, {s['errors']} errors, "
                          f"{s['requests_per_s']:.3f} req/s over {s['window_s']:.2f} s", file=sys.stderr)
                if cell["programs_compiled_in_window"]:
                    bar.write(f"bench_qps: WARNING: {arm} x{level}: the server compiled "
                              f"{cell['programs_compiled_in_window']:.0f} programs during the window (warm-up rounds "
                              f"compiled {cell['warmup_round_programs']}): raise --warmup-max-rounds", file=sys.stderr)
                bar.update()
                save()
        bar.close()
        if args.overload:
            out["overload"] = []
            for arm in args.arm_list:
                best = max((c["summary"]["requests_per_s"] or 0 for c in out["cells"] if c["arm"] == arm), default=0)
                if not best:
                    print(f"bench_qps: overload of {arm} skipped: no request of it completed", file=sys.stderr)
                    continue
                o = run_overload(url, args.api_key, model, doc_ids, prompts, arm, args.overload * best, args)
                out["overload"].append(o)
                s = o["summary"]
                print(f"bench_qps: overload {arm} at {o['offered_per_s']:.2f} req/s: {s['by_status']}", file=sys.stderr)
                if s["server_errors_5xx"] or s["refused_without_retry_after"] or o["client_stopped"]:
                    print(f"bench_qps: WARNING: overload {arm}: {s['server_errors_5xx']} 5xx, "
                          f"{s['refused_without_retry_after']} 429s without Retry-After"
                          + (f"; {o['client_stopped']}" if o["client_stopped"] else ""), file=sys.stderr)
                save()
        admin.close()
    finally:
        if srv is not None:
            out.setdefault("server", {})["stop"] = srv.stop()
            out["server"]["log_device_lines"] = srv.device_lines()
    out["results"] = {arm: {str(c["concurrency"]): c["summary"] for c in out["cells"] if c["arm"] == arm}
                      for arm in args.arm_list}
    out["table_markdown"] = table(out["cells"])
    if out.get("overload"):
        out["table_markdown"] += "\n\nOverload (open loop):\n\n" + overload_table(out["overload"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    if args.headline:
        path = pathlib.Path(args.headline)
        old = json.loads(path.read_text()) if path.is_file() else None
        path.write_text(json.dumps(merge_headline(old, headline(out)), indent=1) + "\n")
    print(out["table_markdown"])
    return out


if __name__ == "__main__":
    main()
