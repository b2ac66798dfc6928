"""DeepSeek-V4 safetensors (hub FP8/FP4 or transformers-saved) -> an Orbax parameter tree.

Output layout (docs/converter.md):

    OUT/params/top/          Orbax item: embed, head, norm, hc_head.*
    OUT/params/layer_000/    Orbax item per layer: the layer's parameters, relative paths
    ...                      (attn.wq_a, ffn.w1 [e, in, out], ...)
    OUT/config.json          copied from the source, plus tokenizer / generation files
    OUT/metadata.json        format, converter version, source fingerprint, what was
                             dequantised, per-item parameter shapes/dtypes, throughput, memory
    OUT/COMPLETE             written last; holds the SHA-256 of metadata.json

The conversion streams one layer at a time: the layer's source tensors are read (in parallel
threads) and dequantised exactly, checked and placed by `weights.place_tensors` (the same
code that loads a checkpoint into a live model), and handed to Orbax's asynchronous save
while the next layer is read; so at most about two layers are in host memory. Everything is
written into a hidden sibling `.OUT.tmp-XXXX` that is renamed to OUT only once complete; on
any error it is removed, and a directory without COMPLETE never restores.

Before any tensor data is read the whole checkpoint is checked from its headers: every key of
the model present with the right shape, no unexpected key, and the config consistent with the
tensors. Errors name the file and the key.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import datetime
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from checkpoints_convert.safetensors_io import CheckpointError, ShardedCheckpoint
from redknot_jax.config import ConfigError, ModelConfig

CONVERTER_VERSION = "1.0.0"
FORMAT = "redknot-jax/orbax-params"
FORMAT_VERSION = 1
PARAMS_DIR = "params"
METADATA_FILE = "metadata.json"
COMPLETE_FILE = "COMPLETE"
TOP_ITEM = "top"
DTYPES = ("bfloat16", "float32")
FINGERPRINTS = ("sha256", "size_mtime")
# Non-weight files a checkpoint directory carries that a server needs next to the weights.
COPY_PATTERNS = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                 "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken", "chat_template*")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


class ConversionError(ValueError):
    """A source checkpoint that cannot be converted (message names the file and key), or an
    output directory that must not be written."""


# ------------------------------------------------------------------------------ layout
def item_of(path: str) -> tuple[str, str]:
    """(Orbax item, path inside the item) of a parameter path or hub key:
    `layers.3.attn.wq_a` -> ("layer_003", "attn.wq_a"); `embed` -> ("top", "embed")."""
    mt = _LAYER.match(path)
    return (f"layer_{int(mt.group(1)):03d}", mt.group(2)) if mt else (TOP_ITEM, path)


def path_of(item: str, sub: str) -> str:
    """Inverse of `item_of`."""
    return sub if item == TOP_ITEM else f"layers.{int(item.removeprefix('layer_'))}.{sub}"


def spec_str(shape, dtype) -> str:
    """How metadata.json records a parameter: "bfloat16[1024, 4096]"."""
    return f"{np.dtype(dtype)}[{', '.join(map(str, shape))}]"


def parse_spec(spec: str) -> tuple[tuple[int, ...], str]:
    """Inverse of `spec_str`: (shape, dtype name)."""
    dtype, dims = spec[:-1].split("[")
    return tuple(int(x) for x in dims.split(",") if x.strip()), dtype


def nest(flat: dict[str, object]) -> dict:
    """{"attn.wq_a": x} -> {"attn": {"wq_a": x}} (Orbax trees are nested dicts)."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """Inverse of `nest`."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def is_complete(directory) -> bool:
    d = Path(directory)
    return (d / COMPLETE_FILE).is_file() and (d / METADATA_FILE).is_file()


# ------------------------------------------------------------------------------ memory / progress
def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the process-lifetime peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class _PeakRSS:
    """Samples the resident set size every few ms; `peak` over the `with` block."""

    def __init__(self, every_s: float = 0.005):
        self.every_s, self.baseline, self.peak = every_s, _rss_bytes(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.every_s)

    def __enter__(self):
        self.peak = self.baseline
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", file=sys.stderr,
                dynamic_ncols=True, smoothing=0.1)


# ------------------------------------------------------------------------------ source checks
def _fail(msg: str, cause: BaseException | None = None):
    raise ConversionError(msg) from cause


def _with_file(source: ShardedCheckpoint, key: str | None, msg: str) -> str:
    """Prefix an error message with the shard holding `key`, unless it already names it."""
    try:
        where = str(source.file_of(key)) if key is not None else str(source.directory)
    except KeyError:
        where = str(source.directory)
    return msg if where in msg else f"{where}: {msg}"


def _load_config(src: Path) -> tuple[ModelConfig, Path]:
    path = src / "config.json"
    if not path.is_file():
        _fail(f"{path}: missing (the converter needs the model's config.json next to the shards)")
    try:
        cfg = ModelConfig.from_json(path)
    except ConfigError as e:
        _fail(str(e), e)
    raw = json.loads(path.read_text())
    q = raw.get("quantization_config")
    if isinstance(q, dict):
        block = q.get("weight_block_size")
        if block is not None and list(block) != [128, 128]:
            _fail(f"{path}: quantization_config.weight_block_size {block} is not supported "
                  f"(DeepSeek-V4 FP8 uses [128, 128], spec §7.3)")
        if q.get("quant_method", "fp8") != "fp8":
            _fail(f"{path}: quantization_config.quant_method {q.get('quant_method')!r} is not supported (fp8 only)")
    return cfg, path


def _pattern(hub_key: str) -> str:
    return re.sub(r"\.experts\.\d+\.", ".experts.{e}.", re.sub(r"^layers\.\d+\.", "layers.{i}.", hub_key))


def _preflight(source, cfg: ModelConfig, cfg_path: Path, want: dict, hf: bool):
    """Check the checkpoint against the model from headers alone; return the read plan:
    (item -> source keys, hub key -> source key, source key -> bytes incl. scale, dequant summary)."""
    from redknot_jax.weights import (WeightError, hub_target, is_scale_key, plan_hub_tensors,
                                     scale_key_of)

    keys = set(source.keys())
    try:
        plan = plan_hub_tensors(source)
    except WeightError as e:
        _fail(_with_file(source, e.key, str(e)), e)
    items: dict[str, list[str]] = collections.defaultdict(list)
    src_of: dict[str, str] = {}
    nbytes: dict[str, int] = {}
    problems, shape_problems, ignored, misshaped = [], [], [], set()
    dequant: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    scales_used = set()
    for src_key, entries in plan.items():
        file = source.file_of(src_key).name  # the header line names the directory
        scale_key = scale_key_of(src_key, hf)
        has_scale = scale_key in keys
        nbytes[src_key] = source.info(src_key).nbytes + (source.info(scale_key).nbytes if has_scale else 0)
        placed = False
        for hub_key, shape in entries:
            try:
                tgt = hub_target(hub_key)
            except WeightError as e:
                problems.append(f"{file}: {e}")
                continue
            if tgt is None:
                ignored.append(hub_key)
                continue
            if hub_key not in want:
                problems.append(f"{file}: {hub_key}: unexpected checkpoint key for this config")
            elif shape != want[hub_key]:
                misshaped.add(hub_key)
                shape_problems.append(f"{file}: {hub_key}: expected shape {want[hub_key]}, got {shape}")
            else:
                src_of[hub_key] = src_key
                placed = True
                if has_scale:
                    fmt = "fp4_e2m1 (1x32 e8m0 scales)" if source.info(src_key).dtype in ("I8", "U8") \
                        else "fp8_e4m3 (128x128 e8m0 scales)"
                    dequant[fmt][_pattern(hub_key)] += 1
        if placed:
            items[item_of(entries[0][0])[0]].append(src_key)
            if has_scale:
                scales_used.add(scale_key)
    for key in sorted(k for k in keys if is_scale_key(k) and k not in scales_used):
        base = key.removesuffix(".scale").removesuffix(".weight_scale_inv")
        if not any(k in keys for k in (base, base + ".weight")):
            problems.append(f"{source.file_of(key).name}: {key}: scale without a weight to scale")
    missing_by_item = collections.defaultdict(list)
    for k in sorted(set(want) - set(src_of) - misshaped):
        missing_by_item[item_of(k)[0]].append(k)
    for item, ks in sorted(missing_by_item.items()):
        if item != TOP_ITEM and len(ks) > 1 and len(ks) == sum(item_of(k)[0] == item for k in want):
            problems.append(f"{path_of(item, '*')}: missing from the checkpoint (all {len(ks)} keys of the layer)")
        else:
            problems += [f"{k}: missing from the checkpoint (expected shape {want[k]})" for k in ks]
    problems += shape_problems
    if problems:
        n_ok = len(src_of)
        hint = ""
        if shape_problems and len(shape_problems) >= n_ok:
            hint = (f"; {cfg_path.name} disagrees with the tensors ({len(shape_problems)} of "
                    f"{len(shape_problems) + n_ok} tensors have other shapes than it implies)")
        layers = {int(m.group(1)) for k in plan for h, _ in plan[k] if (m := _LAYER.match(h))}
        if layers and max(layers) + 1 != cfg.num_layers:
            hint += (f"; the checkpoint has layers 0..{max(layers)} but {cfg_path.name} says "
                     f"num_hidden_layers={cfg.num_layers}")
        shown = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
        _fail(f"{source.directory}: checkpoint does not fit the model of {cfg_path} "
              f"({len(problems)} problem{'s' if len(problems) > 1 else ''}{hint}):\n  {shown}")
    summary = {fmt: {"tensors": sum(c.values()), "keys": dict(sorted(c.items()))} for fmt, c in dequant.items()}
    return dict(items), src_of, nbytes, summary, sorted(set(map(_pattern, ignored)))


def _check_output(out: Path, overwrite: bool):
    if not out.exists() or overwrite:
        if out.exists() and not out.is_dir():
            _fail(f"{out}: exists and is not a directory")
        return
    if is_complete(out):
        _fail(f"{out}: a complete conversion already exists; pass --overwrite (overwrite=True) to replace it")
    if not out.is_dir() or any(out.iterdir()):
        _fail(f"{out}: exists and is not an empty directory; pass --overwrite (overwrite=True) to replace it")


def _write_json_synced(path: Path, obj) -> bytes:
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def _fsync_dir(path: Path):
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _staging(out: Path, overwrite: bool):
    """A hidden sibling directory that becomes `out` when the block finishes, and is removed
    (whatever was written to it) when the block raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        _check_output(out, overwrite)  # again: something may have appeared meanwhile
        old = None
        if out.exists() and (overwrite or any(out.iterdir())):
            old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
            os.replace(out, old)
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _finish(tmp: Path, metadata: dict, copy_from: Path | None, config: dict | None):
    """Copy side files, write metadata.json, then COMPLETE (its content: metadata's SHA-256)."""
    if copy_from is not None:
        for pattern in COPY_PATTERNS:
            for f in sorted(copy_from.glob(pattern)):
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
    if config is not None:
        _write_json_synced(tmp / "config.json", config)
    data = _write_json_synced(tmp / METADATA_FILE, metadata)
    with open(tmp / COMPLETE_FILE, "w") as f:
        f.write(hashlib.sha256(data).hexdigest() + "\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


# ------------------------------------------------------------------------------ reading
def _read_group(source, src_keys: list[str], hf: bool, keys: set, pool, ahead: int,
                on_read) -> Iterator[tuple[str, np.ndarray]]:
    """(hub key, dequantised array) of the group's source keys, read `ahead` at a time in
    `pool`, yielded in order (so memory holds at most `ahead` source tensors in flight)."""
    from redknot_jax.weights import WeightError, read_hub_tensor

    def read(key):
        try:
            return read_hub_tensor(source, key, hf, keys)
        except (CheckpointError, WeightError) as e:
            raise ConversionError(_with_file(source, key, str(e))) from e

    it = iter(src_keys)
    pending = collections.deque()
    for _, k in zip(range(ahead), it):
        pending.append((k, pool.submit(read, k)))
    try:
        while pending:
            key, fut = pending.popleft()
            pieces = fut.result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(read, nxt)))
            on_read(key)
            yield from pieces
    finally:
        for _, fut in pending:
            fut.cancel()


# ------------------------------------------------------------------------------ conversion
def convert(src_dir, out_dir, dtype: str = "bfloat16", fingerprint: str = "sha256", progress: bool = True,
            overwrite: bool = False, workers: int | None = None) -> dict:
    """Convert the checkpoint in `src_dir` (hub layout with model.safetensors.index.json, or a
    transformers-saved directory) into an Orbax parameter tree in `out_dir`; return the
    metadata written to out_dir/metadata.json.

    dtype: "bfloat16" (default) or "float32" for the weights (norms, mHC, sinks, ape and
    router bias stay float32 as the model keeps them). fingerprint: "sha256" (every shard
    byte hashed) or "size_mtime" (instant; only notices changes of size or mtime).
    overwrite: replace an existing out_dir (only once the new conversion is complete).
    workers: threads reading and dequantising tensors (default min(8, cpus)).
    Raises ConversionError naming file and key; on any error nothing is left in out_dir.
    """
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    from redknot_jax.model import Model
    from redknot_jax.weights import WeightError, expected_hub_shapes, is_transformers_naming, place_tensors

    t_start = time.perf_counter()
    src, out = Path(src_dir).resolve(), Path(out_dir).resolve()
    if dtype not in DTYPES:
        _fail(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    if fingerprint not in FINGERPRINTS:
        _fail(f"fingerprint: expected one of {FINGERPRINTS}, got {fingerprint!r}")
    _check_output(out, overwrite)
    cfg, cfg_path = _load_config(src)
    try:
        source = ShardedCheckpoint(src)  # reads and validates every header (and the index)
    except (CheckpointError, OSError) as e:
        _fail(str(e), e)
    keys = set(source.keys())
    hf = is_transformers_naming(keys)
    stamp = source.fingerprint("size_mtime")
    abstract = nnx.eval_shape(lambda: Model(cfg, jnp.dtype(dtype)))  # shapes only, nothing allocated
    want = expected_hub_shapes(cfg, abstract)
    groups, src_of, nbytes, dequantised, ignored = _preflight(source, cfg, cfg_path, want, hf)

    t_fp = time.perf_counter()  # after the checks: no point hashing a checkpoint that cannot convert
    files = source.fingerprint(fingerprint)
    files["config.json"] = (hashlib.sha256(cfg_path.read_bytes()).hexdigest() if fingerprint == "sha256"
                            else f"size={cfg_path.stat().st_size},mtime_ns={cfg_path.stat().st_mtime_ns}")
    t_fp = time.perf_counter() - t_fp
    wanted_by_item: dict[str, dict] = collections.defaultdict(dict)
    for k, shape in want.items():
        wanted_by_item[item_of(k)[0]][k] = shape
    order = sorted(wanted_by_item, key=lambda it: (it == TOP_ITEM, it))  # layers first, top last
    total = sum(nbytes[k] for g in groups.values() for k in g)
    workers = workers or min(8, os.cpu_count() or 1)

    items_meta: dict[str, dict] = {}
    out_bytes = 0
    largest = {"source_bytes": 0, "output_bytes": 0}
    with _staging(out, overwrite) as tmp, _PeakRSS() as mem, _progress_bar(total, progress) as bar, \
            cf.ThreadPoolExecutor(workers, thread_name_prefix="convert-read") as pool:
        ckptr = ocp.StandardCheckpointer()
        t_stream = time.perf_counter()
        try:
            for item in order:
                src_keys = groups.get(item, [])

                def on_read(key, item=item):
                    if bar is not None:
                        bar.update(nbytes[key])
                        bar.set_postfix_str(f"{item} rss={_rss_bytes() / 2**30:.2f}GiB", refresh=False)

                tensors = _read_group(source, src_keys, hf, keys, pool, 2 * workers, on_read)
                flat = {}
                try:
                    for path, arr in place_tensors(cfg, abstract, tensors, want=wanted_by_item[item]):
                        flat[item_of(path)[1]] = arr
                except WeightError as e:
                    _fail(_with_file(source, src_of.get(e.key), str(e)), e)
                size = sum(a.nbytes for a in flat.values())
                items_meta[item] = {"params": {p: spec_str(a.shape, a.dtype) for p, a in sorted(flat.items())},
                                    "bytes": size}
                out_bytes += size
                largest = {"source_bytes": max(largest["source_bytes"], sum(nbytes[k] for k in src_keys)),
                           "output_bytes": max(largest["output_bytes"], size)}
                # Orbax writes this item in the background while the next one is read; waiting
                # for the previous write first keeps at most two items referenced (plus
                # TensorStore's encode buffers: measured peak ~3 items, docs/converter.md).
                ckptr.wait_until_finished()
                ckptr.save(tmp / PARAMS_DIR / item, nest(flat))
                del flat
            ckptr.wait_until_finished()
        finally:
            ckptr.close()
        t_stream = time.perf_counter() - t_stream
        if source.fingerprint("size_mtime") != stamp:
            _fail(f"{src}: source files changed during the conversion (size or mtime); convert again")
        seconds = time.perf_counter() - t_start
        metadata = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "converter": {"name": "checkpoints_convert", "version": CONVERTER_VERSION,
                          "redknot_jax": _package_version(), "python": sys.version.split()[0]},
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": {"path": str(src), "layout": "transformers" if hf else "hub",
                       "fingerprint_policy": fingerprint, "files": files,
                       "index": source.index_path.name if source.index_path else None,
                       "tensors": len(keys), "bytes": total},
            "config_fingerprint": cfg.fingerprint(),
            "dtype": dtype,
            "dequantised": dequantised,
            "ignored": ignored,
            "items": items_meta,
            "stats": {
                "seconds_total": round(seconds, 3), "seconds_fingerprint": round(t_fp, 3),
                "seconds_stream": round(t_stream, 3), "source_bytes": total, "output_bytes": out_bytes,
                "source_gb_per_s": round(total / t_stream / 1e9, 4) if t_stream else None,
                "output_gb_per_s": round(out_bytes / t_stream / 1e9, 4) if t_stream else None,
                "workers": workers, "baseline_rss_bytes": mem.baseline, "peak_rss_bytes": mem.peak,
                "peak_rss_delta_bytes": mem.peak - mem.baseline,
                "largest_item_source_bytes": largest["source_bytes"],
                "largest_item_output_bytes": largest["output_bytes"],
            },
        }
        _finish(tmp, metadata, src, None)
    return metadata


def save_model(model, out_dir, overwrite: bool = False) -> dict:
    """Write a live (possibly sharded) model's parameters in the converter's layout, so it
    restores like a converted checkpoint. Returns the metadata written."""
    import orbax.checkpoint as ocp

    from redknot_jax.weights import param_leaves

    out = Path(out_dir).resolve()
    _check_output(out, overwrite)
    cfg = model.cfg
    by_item: dict[str, dict] = collections.defaultdict(dict)
    for path, var in param_leaves(model).items():
        item, sub = item_of(path)
        by_item[item][sub] = var.get_value()
    dtypes = {str(a.dtype) for it in by_item.values() for a in it.values()} - {"float32", "int32"}
    with _staging(out, overwrite) as tmp:
        ckptr = ocp.StandardCheckpointer()
        try:
            for item, flat in sorted(by_item.items()):
                ckptr.save(tmp / PARAMS_DIR / item, nest(flat))
                ckptr.wait_until_finished()
        finally:
            ckptr.close()
        metadata = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "converter": {"name": "checkpoints_convert.save_model", "version": CONVERTER_VERSION,
                          "redknot_jax": _package_version(), "python": sys.version.split()[0]},
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": {"layout": "model"},
            "config_fingerprint": cfg.fingerprint(),
            "dtype": dtypes.pop() if len(dtypes) == 1 else "float32",
            "dequantised": {}, "ignored": [],
            "items": {item: {"params": {p: spec_str(a.shape, a.dtype) for p, a in sorted(flat.items())},
                             "bytes": sum(a.nbytes for a in flat.values())} for item, flat in by_item.items()},
        }
        _finish(tmp, metadata, None, cfg.to_hf_dict())
    return metadata


def _package_version() -> str:
    import redknot_jax

    return redknot_jax.__version__


def main(argv: Iterable[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m checkpoints_convert",
                                description="Convert DeepSeek-V4 safetensors (hub FP8/FP4 or transformers-saved) "
                                            "into an Orbax parameter tree, one layer at a time.")
    p.add_argument("src", help="checkpoint directory (model.safetensors.index.json + shards, or *.safetensors)")
    p.add_argument("out", help="output directory (written atomically)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weight dtype (default bfloat16)")
    p.add_argument("--fingerprint", choices=FINGERPRINTS, default="sha256",
                   help="source fingerprint policy: hash every byte, or record size+mtime (default sha256)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--workers", type=int, default=None, help="reader threads (default min(8, cpus))")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(None if argv is None else list(argv))
    try:
        meta = convert(a.src, a.out, dtype=a.dtype, fingerprint=a.fingerprint, progress=not a.no_progress,
                       overwrite=a.overwrite, workers=a.workers)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = meta["stats"]
    print(f"wrote {a.out}: {len(meta['items'])} items, {s['output_bytes'] / 1e9:.3f} GB from "
          f"{s['source_bytes'] / 1e9:.3f} GB in {s['seconds_stream']:.1f} s "
          f"({s['source_gb_per_s']:.3f} GB/s read, {s['output_gb_per_s']:.3f} GB/s written; "
          f"+{s['seconds_fingerprint']:.1f} s fingerprint); peak RSS {s['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"(+{s['peak_rss_delta_bytes'] / 2**30:.2f} GiB over the start; largest item "
          f"{s['largest_item_output_bytes'] / 2**30:.2f} GiB)")
    return 0
