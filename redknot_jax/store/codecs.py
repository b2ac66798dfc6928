"""Tile codecs: how one layer group of one TP slice is laid out in files.

A *tile* is one array of an artifact (e.g. layer 3's `zl`, or layer 3's `cmp` ring `kv`).
Both codecs record, per tile, the SHA-256 of its canonical bytes (C order, little-endian,
exactly `payload_digest`'s byte stream for that array) and check it on every read, so a
flipped, truncated or missing file is detected before any consumer sees the data.

* `raw` (the default): one file per tile, `group-<k>/L<layer>.<key>[.<key>].bin`, holding the
  array's bytes and nothing else (dtype and shape live in the integrity-checked manifest). A
  read is `readinto` a fresh buffer + one SHA-256 pass; many tiles are read in parallel
  (hashlib and file reads release the GIL).
* `orbax`: one Orbax item (`StandardCheckpointHandler`, TensorStore/OCDBT underneath) per
  layer group, `group-<k>/`. Same per-tile checksums, computed on the restored arrays; any
  restore error is an integrity failure. Kept for stores that must be readable by Orbax
  tooling or live on TensorStore-only storage; see docs/store.md for why it is not the
  default (per-item latency, throughput, its own commit protocol nested inside ours).

Files are written with O_EXCL (never overwrite) and, when `durable`, fsync'ed; the store
makes the whole generation visible with one rename afterwards.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from concurrent.futures import Executor
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from redknot_jax.reuse.certificate import FallbackReason

_FILE = re.compile(r"^group-[0-9]+/[A-Za-z0-9_.]+$")
_GROUP = re.compile(r"^group-[0-9]+$")


class TileError(RuntimeError):
    """A tile that does not read back as recorded (the store turns it into a CHECKSUM fallback)."""

    reason = FallbackReason.CHECKSUM


# --------------------------------------------------------------------------- bytes and files
def dtype_from_name(name: str) -> np.dtype:
    """np.dtype of a stored dtype *name* (ml_dtypes names such as bfloat16 included)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        t = getattr(ml_dtypes, name, None)
        if t is None:
            raise TileError(f"unknown dtype name {name!r}") from None
        return np.dtype(t)


def canonical(a) -> np.ndarray:
    """C-contiguous little-endian copy/view of `a` (the bytes that are hashed and stored)."""
    a = np.asarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def sha256_of(a: np.ndarray) -> str:
    return hashlib.sha256(a.reshape(-1).view(np.uint8).data).hexdigest()


def write_file(path: Path, data, durable: bool) -> None:
    """Create `path` (never overwrite), write all of `data`, fsync if `durable`."""
    mv = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done:])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_exact(path: Path, nbytes: int) -> np.ndarray:
    """The whole file as a uint8 buffer; TileError if its size is not `nbytes`."""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise TileError(f"{path}: tile file missing") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != nbytes:
            raise TileError(f"{path}: expected {nbytes} bytes, file has {size} (truncated or extended)")
        buf = np.empty(nbytes, np.uint8)
        mv, done = memoryview(buf), 0
        while done < nbytes:
            n = f.readinto(mv[done:])
            if not n:
                raise TileError(f"{path}: expected {nbytes} bytes, read ended at {done}")
            done += n
    return buf


def check_tile(name: str, a: np.ndarray, entry: Mapping) -> np.ndarray:
    """`a` if its dtype, shape and checksum are the manifest's, else TileError."""
    want_dt, want_shape = dtype_from_name(entry["dtype"]), tuple(entry["shape"])
    if a.dtype != want_dt or tuple(a.shape) != want_shape:
        raise TileError(f"tile {name}: expected {want_dt.name}{list(want_shape)}, "
                        f"got {a.dtype.name}{list(a.shape)}")
    got = sha256_of(canonical(a))
    if got != entry["sha256"]:
        raise TileError(f"tile {name}: sha256 expected {entry['sha256']}, got {got}")
    return a


# --------------------------------------------------------------------------- codecs
class RawCodec:
    """One file per tile; bytes only (see module docstring)."""

    name = "raw"

    def write_group(self, slice_dir: Path, group: int, tiles: Mapping[str, np.ndarray], durable: bool,
                    write: Callable = write_file) -> dict[str, dict]:
        gdir = slice_dir / f"group-{group}"
        gdir.mkdir()
        out = {}
        for stem, a in tiles.items():
            rel = f"group-{group}/{stem}.bin"
            write(slice_dir / rel, a.reshape(-1).view(np.uint8), durable)
            out[stem] = {"file": rel}
        if durable:
            fsync_dir(gdir)
        return out

    def read_group(self, slice_dir: Path, entries: Mapping[str, Mapping], pool: Executor | None,
                   verify: bool = True) -> dict[str, np.ndarray]:
        """verify=False: no tile checksum (the caller checks a digest over every tile read)."""
        def one(item):
            name, e = item
            if not _FILE.match(e["file"]):
                raise TileError(f"tile {name}: bad file name {e['file']!r}")
            buf = read_exact(slice_dir / e["file"], int(e["nbytes"]))
            if verify:
                got = hashlib.sha256(buf.data).hexdigest()
                if got != e["sha256"]:
                    raise TileError(f"tile {name} ({e['file']}): sha256 expected {e['sha256']}, got {got}")
            dt = dtype_from_name(e["dtype"]).newbyteorder("<")
            try:
                return name, buf.view(dt).reshape(tuple(e["shape"]))
            except ValueError:
                raise TileError(f"tile {name}: {e['nbytes']} bytes do not hold {dt.name}{list(e['shape'])}") from None

        items = list(entries.items())
        results = pool.map(one, items) if pool is not None and len(items) > 1 else map(one, items)
        return dict(results)

    def files(self, slice_dir: Path, entries: Mapping[str, Mapping]) -> list[Path]:
        return [slice_dir / e["file"] for e in entries.values()]


class OrbaxCodec:
    """One Orbax item per layer group (see module docstring)."""

    name = "orbax"

    def _ckptr(self):
        import orbax.checkpoint as ocp

        return ocp, ocp.Checkpointer(ocp.StandardCheckpointHandler())

    def write_group(self, slice_dir: Path, group: int, tiles: Mapping[str, np.ndarray], durable: bool,
                    write: Callable = write_file) -> dict[str, dict]:
        ocp, ck = self._ckptr()
        rel = f"group-{group}"
        # Orbax refuses zero-size arrays (a document shorter than a compression window has
        # no entries): those live in the manifest alone (dtype, shape, checksum of no bytes).
        full = {k: a for k, a in tiles.items() if a.size}
        try:
            if full:
                ck.save(slice_dir / rel, args=ocp.args.StandardSave(full))
            else:
                (slice_dir / rel).mkdir()
        except Exception as e:  # Orbax wraps OSErrors; find ENOSPC so the store reports "disk full"
            cause = e
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__cause__ or cause.__context__
            if isinstance(cause, OSError):
                raise cause from e
            # TensorStore reports them as text: "... No space left on device [os_error_code='28']"
            m = re.search(r"os_error_code='?([0-9]+)", str(e))
            if m:
                code = int(m.group(1))
                raise OSError(code, os.strerror(code), str(slice_dir / rel)) from e
            raise
        finally:
            ck.close()
        if durable:  # Orbax's own commit does not promise fsync of every file
            for root, dirs, files in os.walk(slice_dir / rel):
                for f in files:
                    fd = os.open(os.path.join(root, f), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                fsync_dir(Path(root))
        return {stem: {"file": rel, "item_key": stem if stem in full else None} for stem in tiles}

    def read_group(self, slice_dir: Path, entries: Mapping[str, Mapping], pool: Executor | None,
                   verify: bool = True) -> dict[str, np.ndarray]:
        """verify=False: no tile checksum (the caller checks a digest over every tile read)."""
        check = check_tile if verify else (lambda name, a, e: a)
        dirs = {e["file"] for e in entries.values()}
        if len(dirs) != 1 or not _GROUP.match(next(iter(dirs))):
            raise TileError(f"orbax group: expected one group-<k> item, got {sorted(dirs)}")
        path = slice_dir / next(iter(dirs))
        if not path.is_dir():
            raise TileError(f"{path}: orbax item missing")
        tree = {}
        if any(e["item_key"] is not None for e in entries.values()):
            ocp, ck = self._ckptr()
            try:
                tree = ck.restore(path)
            except Exception as e:  # a damaged item can fail anywhere inside TensorStore
                raise TileError(f"{path}: orbax restore failed: {type(e).__name__}: {e}") from e
            finally:
                ck.close()
        out = {}
        for name, e in entries.items():
            if e["item_key"] is None:  # zero-size tile (see write_group)
                out[name] = check(name, np.zeros(tuple(e["shape"]), dtype_from_name(e["dtype"])), e)
                continue
            if e["item_key"] not in tree:
                raise TileError(f"tile {name}: missing from orbax item {path}")
            out[name] = check(name, np.asarray(tree[e["item_key"]]), e)
        return out

    def files(self, slice_dir: Path, entries: Mapping[str, Mapping]) -> list[Path]:
        out = []
        for d in {e["file"] for e in entries.values()}:
            for root, _, files in os.walk(slice_dir / d):
                out += [Path(root) / f for f in files]
        return out


CODECS = {"raw": RawCodec(), "orbax": OrbaxCodec()}


def codec(name: str):
    if name not in CODECS:
        raise ValueError(f"codec: expected one of {sorted(CODECS)}, got {name!r}")
    return CODECS[name]


def is_no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
