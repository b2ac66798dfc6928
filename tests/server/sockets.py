"""A `launch/serve.py` subprocess for tests, over a real socket on 127.0.0.1 (a free port): start it
once it answers /healthz, ask it (JSON, the OpenAI client, /metrics, its resident memory), stop it.
Used by the server's socket tests (test_server.py), the shipped model's and bench_qps's."""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "redknot-tiny-random"
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def request(self, method, path, body=None, key=KEY_A, raw: bytes | None = None, timeout=120):
        """(status, parsed JSON or text)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def client(self, key=KEY_A):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)

    def metric(self, name: str, labels: str = "") -> float:
        _, text = self.request("GET", "/metrics", key=None)
        pat = re.escape(name + (("{" + labels + "}") if labels else "")) + r" ([0-9.eE+-]+)"
        m = re.search(r"^" + pat + r"$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def rss_mb(self) -> float:
        # the server is the python child of this Popen (no wrapper), so its own RSS
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


FAST_COMPILE = "--xla_backend_optimization_level=0"  # as tests/conftest.py sets for in-process programs


def start_server(tmp, args, wait_s: float = 240) -> Server:
    """`launch/serve.py --port P ARGS` as a subprocess on one CPU device (log under tmp), once
    it answers /healthz."""
    port = free_port()
    env = dict(os.environ)
    # one CPU device, not the test session's 8; XLA's CPU backend at the suite's low compile effort
    env["XLA_FLAGS"] = FAST_COMPILE
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("REDKNOT_API_KEYS", None)
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "serve.py"), "--port", str(port), *args],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    srv = Server(proc, port, log)
    deadline = time.time() + wait_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read()[-4000:]}")
        try:
            st, health = srv.request("GET", "/healthz", key=None, timeout=2)
            if st == 200:
                return srv
            if isinstance(health, dict) and health.get("status") == "failed":  # will never be ready
                proc.kill()
                log.seek(0)
                pytest.fail(f"server warm-up failed: {health}\n{log.read()[-4000:]}")
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not answer /healthz within {wait_s:.0f} s")
        time.sleep(0.5)


def stop_server(srv: Server) -> None:
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(10)
    srv.log.close()
