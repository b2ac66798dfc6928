"""Artifact store micro-benchmark: publish and disk-read throughput, host-to-device GB/s
(pageable vs pinned host memory) against the link's measured peak, and how much of the
host-to-device traffic prefetch hides behind a compute loop.

    python launch/bench_store.py                                   # CPU smoke (small sizes)
    python launch/bench_store.py --out docs/results/bench_store_h200.json      # on a GPU

Data: one document's artifact shaped like a DeepSeek-V4-Flash TP-rank slice (TP 8: one output
group per rank; `--tokens` rows per layer; K=V latent and z_L in bf16, compressed entries,
indexer keys and rings in fp32, document-local top-512 ids in int32), `--groups` layer groups
of `--layers-per-group` layers, random contents (speed does not depend on values).

Measured (each the best of `--repeats`; every repeat is in the JSON):
* publish: `ArtifactStore.publish` (hashing, fsync'ed writes, atomic rename), GB/s.
* disk read: every layer group through `read_group` (read + SHA-256 verify), from the page
  cache ("warm") and after `posix_fadvise(DONTNEED)` on every file ("cold"; the kernel may
  ignore it on some file systems: compare the two), per codec; plus a bare read of the same
  files without verification (what hashing costs); and a full `load` with the digest the
  runtime's certification compares (`Artifact.digest`), from the page cache.
* host -> device: a contiguous `--peak-mb` buffer from pinned host memory (the link's
  measured peak) and from pageable memory; one layer group's tiles (a dict of arrays, one
  `jax.device_put`) from pageable numpy and from pinned host memory.
* overlap: G layer groups, each a data-dependent compute step (a chain of bf16 matmuls
  calibrated to take about as long as one group's transfer, `--compute-ratio`) that consumes
  the group's tiles. serial = transfer group k, wait, compute k; overlapped = `TieredCache.
  prefetch` of group k+1 (a worker thread + async `jax.device_put`) while group k computes.
  transfer = all groups requested at once (the pipelined transfer alone); hidden = (compute +
  transfer - overlapped) / min(compute, transfer): 1.0 = the smaller of the two is completely
  hidden, 0 = no overlap. Run from the host tier (host -> device only) and from disk
  (disk -> host -> device, host tier off).

Prints a markdown table (device, date, command) and writes JSON (+ the table as .md) to --out.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def flash_rank_layers(n: int, layers: int, rng) -> dict[int, dict]:
    """Tiles of one Flash TP-rank slice (shapes from config.flash(), one group per rank)."""
    import ml_dtypes

    from redknot_jax import config

    cfg = config.flash()
    bf16 = ml_dtypes.bfloat16
    out = {}
    for i in range(layers):
        csa = i % 2 == 0
        m = cfg.csa_rate if csa else cfg.hca_rate
        r = lambda *s, dt=np.float32: rng.standard_normal(s, np.float32).astype(dt)
        d = {"kv": r(n, cfg.head_dim, dt=bf16), "zl": r(n, 1, cfg.o_lora_rank, dt=bf16),
             "entries": r(n // m, cfg.head_dim),
             "cmp": {"kv": r(2 * m if csa else m, (2 if csa else 1) * cfg.head_dim),
                     "gate": r(2 * m if csa else m, (2 if csa else 1) * cfg.head_dim)}}
        if csa:
            d["idx_entries"] = r(n // m, cfg.index_head_dim)
            d["idx"] = {"kv": r(2 * m, 2 * cfg.index_head_dim), "gate": r(2 * m, 2 * cfg.index_head_dim)}
            d["topk"] = rng.integers(-1, n // m, (n, cfg.index_topk), dtype=np.int32)
        out[3 + i] = d  # after Flash's 3 fence layers
    return out


def make_artifact(n: int, n_layers: int, seed: int = 0):
    from redknot_jax import config
    from redknot_jax.reuse.artifact import Artifact
    from redknot_jax.reuse.certificate import FORMAT_VERSION, Certificate, TPGeometry, payload_digest, token_digest
    from redknot_jax.reuse.profile import flash_profile

    rng = np.random.default_rng(seed)
    cfg = config.flash()
    toks = rng.integers(2, cfg.vocab_size, n).astype(np.int32)
    art = Artifact(tokens=toks, layers=flash_rank_layers(n, n_layers, rng), certificate=None)
    art.certificate = Certificate(
        checkpoint_fingerprint="bench", token_digest=token_digest(toks), profile_digest=flash_profile().digest(),
        model_digest=cfg.fingerprint(), tp=TPGeometry(1, 0, ((0, cfg.o_lora_rank),)), generation=1,
        format_version=FORMAT_VERSION, layers=tuple(sorted(art.layers)), payload_digest=payload_digest(art.payload()))
    return art


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, repeats: int, setup=None) -> list[float]:
    out = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/bench_store.py --root $PWD/bs_root --tokens 8192 --repeats 3 "
                                        "--out bench_store_h200.json")  # docs/store.md
    ap.add_argument("--root", help="store directory (default: a fresh temporary directory, removed at the end)")
    ap.add_argument("--tokens", type=int, help="rows per layer (default: 16384 on GPU, 512 on CPU)")
    ap.add_argument("--groups", type=int, help="layer groups (default: 4 on GPU, 3 on CPU)")
    ap.add_argument("--layers-per-group", type=int, default=4)
    ap.add_argument("--codecs", default="raw,orbax")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-mb", type=int, help="contiguous buffer for the link peak (default 1024 GPU, 64 CPU)")
    ap.add_argument("--compute-ratio", type=float, default=1.0, help="compute time per group / transfer time")
    ap.add_argument("--io-threads", type=int, default=None)
    ap.add_argument("--host-kind", default="auto", choices=["auto", "numpy", "pinned", "both"],
                    help="host tier memory for the overlap runs (auto: pinned on a GPU)")
    ap.add_argument("--prefetch-depth", type=int, default=1, help="layer groups requested ahead of the one computing")
    ap.add_argument("--out", type=Path, help="write JSON here and the markdown table beside it (.md)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from redknot_jax.store import ArtifactStore, TieredCache

    dev = jax.devices()[0]
    gpu = dev.platform != "cpu"
    n = args.tokens or (16384 if gpu else 512)
    G = args.groups or (4 if gpu else 3)
    peak_bytes = (args.peak_mb or (1024 if gpu else 64)) << 20
    R = args.repeats
    kinds = {m.kind for m in dev.addressable_memories()}
    has_pinned = "pinned_host" in kinds
    rows, res = [], {}

    def row(metric, value, unit, note=""):
        rows.append((metric, value, unit, note))

    tmp_root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="bench_store_"))
    art = make_artifact(n, G * args.layers_per_group)
    total = sum(a.nbytes for a in art.payload().values())
    res["artifact_bytes"] = total
    gb = lambda b, s: b / s / 1e9

    # ------------------------------------------------------------------ publish / disk
    stores = {}
    for codec in _cli.progress(args.codecs.split(","), desc="publish + read", unit="codec", leave=False):
        st = ArtifactStore(tmp_root / codec, codec=codec, layer_group_size=args.layers_per_group,
                           io_threads=args.io_threads)
        times, pubs = [], []
        for _ in range(R):
            t0 = time.perf_counter()
            pubs.append(st.publish(art, on_conflict="retry"))
            times.append(time.perf_counter() - t0)
        doc, gen = pubs[-1].doc_id, pubs[-1].generation
        meta = st.open_slice(doc, gen, art.certificate.tp)
        files = [str(p) for p in __import__("redknot_jax.store.codecs", fromlist=["codec"]).codec(codec).files(
            meta.path, meta.tiles)]
        res[f"publish_{codec}_s"] = times
        row(f"publish ({codec})", f"{gb(total, min(times)):.2f}", "GB/s", f"{total / 1e6:.0f} MB, fsync, hash, rename")

        def read_all():
            for g in sorted(meta.groups):
                st.read_group(meta, g)

        warm = timed(read_all, R, setup=None)
        cold = timed(read_all, R, setup=lambda: drop_cache(files))
        res[f"read_{codec}_warm_s"], res[f"read_{codec}_cold_s"] = warm, cold
        row(f"disk read + verify ({codec}), page cache", f"{gb(total, min(warm)):.2f}", "GB/s", f"{len(files)} files")
        row(f"disk read + verify ({codec}), cold", f"{gb(total, min(cold)):.2f}", "GB/s", "after fadvise(DONTNEED)")
        load = timed(lambda: st.load(doc, gen, tp=art.certificate.tp).digest(), R, setup=None)
        res[f"load_{codec}_warm_s"] = load
        row(f"full load + certification digest ({codec}), page cache", f"{gb(total, min(load)):.2f}", "GB/s",
            "store.load(...).digest(): every byte hashed once")
        stores[codec] = (st, doc, gen, meta, files)

    st, doc, gen, meta, files = stores.get("raw", next(iter(stores.values())))
    if "raw" in stores:
        from concurrent.futures import ThreadPoolExecutor

        def read_one(p):
            with open(p, "rb", buffering=0) as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(buf)

        def bare():  # same parallelism as read_group, no hashing
            with ThreadPoolExecutor(st.io_threads) as ex:
                list(ex.map(read_one, files))

        b = timed(bare, R, setup=lambda: drop_cache(files))
        res["read_raw_bare_cold_s"] = b
        row("disk read, no verify (raw), cold", f"{gb(total, min(b)):.2f}", "GB/s", "what SHA-256 costs: compare")

    # ------------------------------------------------------------------ host -> device
    to_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device") if "device" in kinds else dev
    pinned_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host") if has_pinned else None
    big = np.random.default_rng(1).integers(0, 255, peak_bytes, dtype=np.uint8)
    put = lambda x, s: jax.block_until_ready(jax.device_put(x, s))
    put(big[:1024], to_dev)  # warm the transfer path
    pageable = timed(lambda: put(big, to_dev), R)
    row("host -> device, pageable, contiguous", f"{gb(peak_bytes, min(pageable)):.2f}", "GB/s",
        f"{peak_bytes >> 20} MiB")
    res["h2d_pageable_contig_s"] = pageable
    peak = None
    if has_pinned:
        stage = timed(lambda: put(big, pinned_sh), R)
        big_pinned = put(big, pinned_sh)
        pk = timed(lambda: put(big_pinned, to_dev), R)
        peak = gb(peak_bytes, min(pk))
        res["h2d_pinned_contig_s"], res["stage_pinned_s"] = pk, stage
        row("host -> device, pinned, contiguous (link peak)", f"{peak:.2f}", "GB/s", "the measured peak")
        row("pageable -> pinned staging copy", f"{gb(peak_bytes, min(stage)):.2f}", "GB/s", "host memcpy")
    big = None  # freed (the timed lambdas above have run)

    host_groups = {g: st.read_group(meta, g) for g in sorted(meta.groups)}
    gbytes = sum(a.nbytes for a in host_groups[0].values())
    tg = timed(lambda: put(host_groups[0], to_dev), R)
    res["h2d_group_pageable_s"] = tg
    note = f"{gbytes / 1e6:.0f} MB, {len(host_groups[0])} tiles"
    pct = lambda s: f"{100 * gb(gbytes, s) / peak:.0f} % of peak" if peak else ""
    row("host -> device, one group, pageable", f"{gb(gbytes, min(tg)):.2f}", "GB/s", f"{note}; {pct(min(tg))}")
    if has_pinned:
        pinned_groups = {g: put(t, pinned_sh) for g, t in host_groups.items()}
        tp_ = timed(lambda: put(pinned_groups[0], to_dev), R)
        res["h2d_group_pinned_s"] = tp_
        row("host -> device, one group, pinned", f"{gb(gbytes, min(tp_)):.2f}", "GB/s", f"{note}; {pct(min(tp_))}")
        del pinned_groups

    # ------------------------------------------------------------------ overlap
    D = 4096 if gpu else 256
    w = jax.device_put(jnp.asarray(np.random.default_rng(2).standard_normal((D, D)) / np.sqrt(D), jnp.bfloat16), dev)
    x0 = jax.device_put(jnp.ones((D, D), jnp.bfloat16), dev)

    def make_step(iters):
        @jax.jit
        def step(x, tiles):  # depends on the group's tiles, as the real consumer does
            dep = sum(jnp.sum(t.reshape(-1)[:8].astype(jnp.float32)) for t in jax.tree.leaves(tiles))
            for _ in range(iters):
                x = jnp.tanh(x @ w)
            return x + (dep * 0).astype(x.dtype)
        return step

    dev_tiles = put(host_groups[0], to_dev)
    probe = make_step(8)  # per-iteration time from a chain, not one launch (launch overhead)
    jax.block_until_ready(probe(x0, dev_tiles))
    t1 = min(timed(lambda: jax.block_until_ready(probe(x0, dev_tiles)), 3)) / 8
    host_kinds = {"auto": ["pinned" if (gpu and has_pinned) else "numpy"], "both": ["numpy", "pinned"]}.get(
        args.host_kind, [args.host_kind])
    if "pinned" in host_kinds and not has_pinned:
        host_kinds = ["numpy"]
    transfer_group = min(res["h2d_group_pinned_s"] if host_kinds[-1] == "pinned" else tg)
    iters = max(1, int(round(args.compute_ratio * transfer_group / max(t1, 1e-6))))
    step = make_step(iters)
    jax.block_until_ready(step(x0, dev_tiles))
    groups = sorted(meta.groups)
    all_dev = {g: put(host_groups[g], to_dev) for g in groups}
    for g in groups:  # compile for every group's tile names before timing
        jax.block_until_ready(step(x0, all_dev[g]))
    depth = max(1, args.prefetch_depth)
    tp_ = art.certificate.tp

    # Does device_put return before its copy ends (asynchronous dispatch) for each host kind?
    for hk in host_kinds:
        src = host_groups[0] if hk == "numpy" else put(host_groups[0], pinned_sh)
        ret, done = [], []
        for _ in range(R):
            t0 = time.perf_counter()
            y = jax.device_put(src, to_dev)
            ret.append(time.perf_counter() - t0)
            jax.block_until_ready(y)
            done.append(time.perf_counter() - t0)
        res[f"device_put_return_{hk}_s"], res[f"device_put_done_{hk}_s"] = ret, done
        row(f"device_put of one group ({hk}): returns / done", f"{min(ret) * 1e3:.2f} / {min(done) * 1e3:.2f}", "ms",
            "returns early = asynchronous dispatch")

    def compute_only():
        x = x0
        for g in groups:
            x = step(x, all_dev[g])
        jax.block_until_ready(x)

    def run_cache(cache, serial: bool):
        x = x0
        if serial:
            for g in groups:
                t = jax.block_until_ready(cache.group(doc, g, generation=gen, tp=tp_))
                x = jax.block_until_ready(step(x, t))
            return
        futs = {}

        def ask(i):
            futs[i] = cache.prefetch([doc], [groups[i]], generation=gen, tp=tp_)[(doc, groups[i])]

        for i in range(min(depth, len(groups))):
            ask(i)
        for i, g in enumerate(groups):
            t = futs.pop(i).result()
            if i + depth < len(groups):  # groups k+1..k+depth move while group k computes
                ask(i + depth)
            x = step(x, t)
        jax.block_until_ready(x)

    def fresh(source, hk):
        # device tier off: every group is copied host -> device each run
        c = TieredCache(st, device_bytes=0, host_bytes=(1 << 40) if source == "host" else 0, device=dev,
                        host_kind=hk, workers=max(2, depth + 1))
        if source == "host":
            for g in groups:
                c.group(doc, g, generation=gen, tp=tp_, tier="host")
        return c

    comp = timed(compute_only, R)
    res["compute_s"] = comp
    for source, hk in _cli.progress([(s, h) for s in ("host", "disk") for h in host_kinds], desc="overlap",
                                    unit="run", leave=False):
        caches = [None]

        def transfer_only():  # every group requested at once: the pipelined transfer time
            futs = caches[0].prefetch([doc], groups, generation=gen, tp=tp_)
            jax.block_until_ready([f.result() for f in futs.values()])

        def setup():
            if caches[0] is not None:
                caches[0].close()
            caches[0] = fresh(source, hk)
            if source == "disk":
                drop_cache(files)

        tr = timed(transfer_only, R, setup)
        ser = timed(lambda: run_cache(caches[0], True), R, setup)
        ovl = timed(lambda: run_cache(caches[0], False), R, setup)
        caches[0].close()
        C, T, S, O = min(comp), min(tr), min(ser), min(ovl)
        hidden = (C + T - O) / min(C, T)
        res[f"overlap_{source}_{hk}"] = {"compute_s": comp, "transfer_s": tr, "serial_s": ser,
                                         "overlapped_s": ovl, "hidden": hidden, "bytes": total,
                                         "host_kind": hk, "iters": iters, "prefetch_depth": depth}
        src = "host tier -> device" if source == "host" else "disk -> host -> device (cold)"
        row(f"overlap, {src}, {hk}: transfer only", f"{gb(total, T):.2f}", "GB/s",
            f"{G} groups, {total / 1e6:.0f} MB, all requested at once"
            + (f"; {100 * gb(total, T) / peak:.0f} % of peak" if peak and source == "host" else ""))
        row(f"overlap, {src}, {hk}: compute / serial / overlapped", f"{C * 1e3:.1f} / {S * 1e3:.1f} / {O * 1e3:.1f}",
            "ms", f"hidden {100 * hidden:.0f} % of min(compute, transfer); prefetch depth {depth}")

    for s, *_ in stores.values():
        s.close()
    if not args.root:
        shutil.rmtree(tmp_root, ignore_errors=True)

    meta_lines = [
        f"device: {dev.platform} {dev.device_kind} (memories: {', '.join(sorted(kinds))})",
        f"date: {datetime.date.today().isoformat()}; jax {jax.__version__}; python {platform.python_version()}; "
        f"{os.cpu_count()} CPUs",
        f"command: python launch/bench_store.py {' '.join(sys.argv[1:])}".rstrip(),
        f"artifact: {total / 1e6:.1f} MB = {G} groups x {args.layers_per_group} layers x {n} rows "
        f"(Flash TP-rank slice shapes); best of {R}",
        f"store: {tmp_root}",
    ]
    table = "\n".join(meta_lines) + "\n\n| measurement | value | unit | notes |\n|---|---|---|---|\n" + "\n".join(
        f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    print(table)
    if args.out:
        res.update({"device": f"{dev.platform}:{dev.device_kind}", "date": datetime.date.today().isoformat(),
                    "jax": jax.__version__, "argv": sys.argv[1:], "tokens": n, "groups": G,
                    "layers_per_group": args.layers_per_group, "table": rows})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=float) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")
    return res


if __name__ == "__main__":
    main()
