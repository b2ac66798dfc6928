"""Multi-controller run: 2 processes on this machine (CPU, loopback coordinator), each with 4
CPU devices; data parallel across processes (one sequence each), tensor parallel inside. Checks
each process's prefill and decode logits equal the single-process result (tp = 1, which
test_tp holds bit-identical to `Model.forward`), and that both processes return from
cross-rank agreements in which only one process's rank failed (no deadlock)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.server.sockets import free_port
from tests.sharding.helpers import DECODE_STEPS, reference_run
from tests.tolerances import TOL, rel_err

ROOT = Path(__file__).resolve().parents[2]
NPROC, LOCAL_DEVICES, TIMEOUT_S = 2, 4, 300


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


def _logs(logs) -> str:
    return "\n".join(f"--- process {i} ---\n{_tail(log)}" for i, log in enumerate(logs))


def test_two_processes_dp_x_tp_equal_single_process(tmp_path):
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}")
    procs, logs, handles = [], [], []
    for i in range(NPROC):
        log = tmp_path / f"process-{i}.log"
        logs.append(log)
        handles.append(log.open("w"))
        cmd = [sys.executable, "-m", "tests.sharding.multihost_worker", "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(NPROC), "--process-id", str(i), "--out", str(tmp_path)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handles[-1], stderr=subprocess.STDOUT))
    try:
        ref, _ = reference_run()  # meanwhile, in this process
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:  # the others would wait on it until their distributed timeouts
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"multi-host workers still running after {TIMEOUT_S} s (deadlock?)\n" + _logs(logs))
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for h in handles:
            h.close()
    codes = [p.returncode for p in procs]
    assert codes == [0] * NPROC, f"worker exit codes {codes} (-9: killed after another failed)\n" + _logs(logs)

    tight = TOL["resharded_fp32"][0]
    for i in range(NPROC):
        got = np.load(tmp_path / f"process-{i}.npz")
        summary = json.loads((tmp_path / f"process-{i}.json").read_text())
        assert summary["processes"] == NPROC and summary["global_devices"] == NPROC * LOCAL_DEVICES
        assert summary["mesh"] == {"dp": NPROC, "tp": LOCAL_DEVICES}
        for step, key in enumerate(["prefill"] + [f"step{s}" for s in range(DECODE_STEPS)]):
            want = ref[step][i:i + 1]
            assert got[key].shape == want.shape, (i, key)
            err = rel_err(got[key], want)
            assert err <= tight, f"process {i} {key}: rel err {err:.2e} > {tight}"
        # round r corrupted rank 1 of process r: that process's request falls back, the other reuses
        for d in summary["decisions"]:
            if d["round"] == i:
                assert (d["reuse"], d["reason"], d["failing_ranks"]) == (False, "checksum", [1]), d
            else:
                assert (d["reuse"], d["reason"], d["failing_ranks"]) == (True, None, []), d
        assert summary["counters"]["validated"] == NPROC - 1
        assert summary["counters"]["fallback"]["checksum"] == 1
