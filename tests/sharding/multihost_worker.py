"""One process of the multi-host test (run by tests/sharding/test_multihost.py, or by hand):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
    python -m tests.sharding.multihost_worker --coordinator 127.0.0.1:PORT \\
        --num-processes 2 --process-id I --out DIR

Joins `jax.distributed` (CPU, gloo), builds the tiny model from its seed, runs prefill and
decode steps data parallel across processes (one sequence per process) and tensor parallel
over this process's devices, then two cross-rank agreements with a failure injected on one
rank of one process. Writes DIR/process-I.npz (its logits rows) and DIR/process-I.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=int, default=120, help="distributed initialisation timeout (s)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()

    import numpy as np
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    jax.distributed.initialize(a.coordinator, a.num_processes, a.process_id, initialization_timeout=a.timeout,
                               heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)

    from redknot_jax.reuse.certificate import CertCounters
    from redknot_jax.sharding import make_mesh
    from redknot_jax.sharding.agree import agree, rank_verdict, tp_geometry
    from redknot_jax.store import split_tp
    from redknot_jax.sharding.tp import TPForward
    from tests.sharding.helpers import (BATCH, BLOCK, CAPACITY, CFG, COMPILER_OPTIONS, expectation, inputs,
                                        rank_segments, tiny_model, whole_artifact)

    pid, nproc = jax.process_index(), jax.process_count()
    tp = jax.local_device_count()
    if BATCH % nproc:
        raise SystemExit(f"batch {BATCH} does not split over {nproc} processes")
    per = BATCH // nproc
    mine = slice(pid * per, (pid + 1) * per)
    mesh = make_mesh(tp, dp=nproc)
    f = TPForward(tiny_model(), mesh, block=BLOCK, compiler_options=COMPILER_OPTIONS)

    def local(arr):  # this process's rows of a dp-split global array (equal on its tp ranks)
        shards = sorted(arr.addressable_shards, key=lambda s: s.device.id)
        return np.asarray(shards[0].data)

    ids, n_new, rows, decode = inputs()
    cache = f.init_cache(BATCH, CAPACITY)
    logits, cache = f.forward(f.put_batch(ids[mine]), f.put_batch(np.zeros(per, np.int32)),
                              f.put_batch(n_new[mine]), cache, f.put_batch(rows[mine]))
    out = {"prefill": local(logits)}
    t_prefill = time.perf_counter() - t0
    length = n_new[mine].copy()
    # Decode steps through the prefill-shaped program (one real row, the rest right padding:
    # `Model.forward`'s n_new contract), so each process compiles one program; the reference
    # decodes with one-row chunks, so this also checks padded chunks decode alike.
    pad = np.zeros((per, ids.shape[1]), np.int32)
    rows0 = np.zeros((per, rows.shape[1]), np.int32)
    for step, tok in enumerate(decode):
        chunk = pad.copy()
        chunk[:, 0] = tok[mine]
        logits, cache = f.forward(f.put_batch(chunk), f.put_batch(length), f.put_batch(np.ones(per, np.int32)),
                                  cache, f.put_batch(rows0))
        out[f"step{step}"] = local(logits)[:, :1]  # row 0 of the chunk: the decoded token
        length = length + 1
    np.savez(os.path.join(a.out, f"process-{pid}.npz"), **out)

    # Agreement: each process serves its own request (its dp row); round r injects a corrupted
    # slice on rank 1 of process r only. Every process must return from both rounds.
    tokens = np.arange(2, 42) % CFG.vocab_size
    art = whole_artifact(tokens, generation=2)
    counters = CertCounters()
    decisions = []
    for rnd in range(nproc):
        slices = split_tp(art, tp)
        if rnd == pid:
            s = slices[1]
            z = s.layers[0]["zl"].copy()
            z[0, 0, 0] += 1.0
            slices[1] = type(s)(s.tokens, {**s.layers, 0: {**s.layers[0], "zl": z}}, s.certificate)
        v = [rank_verdict(rank_segments(tokens, slices, r), expectation(), tp_geometry(CFG, tp, r)) for r in range(tp)]
        d = agree(mesh, [v], counters)
        decisions += [{"round": rnd, "reuse": x.reuse, "reason": None if x.reason is None else x.reason.value,
                       "failing_ranks": list(x.failing_ranks)} for x in d]
    summary = {"process": pid, "processes": nproc, "local_devices": tp, "global_devices": jax.device_count(),
               "mesh": dict(mesh.shape), "decisions": decisions, "counters": counters.snapshot(),
               "prefill_seconds": t_prefill, "seconds": time.perf_counter() - t0}
    with open(os.path.join(a.out, f"process-{pid}.json"), "w") as fh:
        json.dump(summary, fh)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
