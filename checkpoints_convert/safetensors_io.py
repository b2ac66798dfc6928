"""Hand-written safetensors reader/writer and a sharded-checkpoint view (numpy only).

Why not the official ``safetensors`` package: its numpy backend knows neither BF16 nor
the FP8 dtypes the DeepSeek-V4 hub shards are made of (F8_E4M3 weights, F8_E8M0 block
scales), and its torch backend would pull torch into the converter. The format is small
enough to parse and validate by hand (spec: https://github.com/huggingface/safetensors):

    [8 bytes: little-endian u64 N][N bytes: UTF-8 JSON header][data section]

The header maps tensor name -> {"dtype", "shape", "data_offsets": [begin, end]} with
offsets relative to the start of the data section, plus an optional ``__metadata__``
str -> str map. Validation follows the official reader: tensors, sorted by offset, must tile
the data section exactly (no overlap, no hole, no trailing bytes).

dtype mapping on read (safetensors string -> numpy):
  F64/F32/F16, I64/I32/I16/I8, U8, BOOL -> the numpy types of the same name;
  BF16 -> ml_dtypes.bfloat16; F8_E4M3 -> ml_dtypes.float8_e4m3fn; F8_E5M2 ->
  ml_dtypes.float8_e5m2; F8_E8M0 -> ml_dtypes.float8_e8m0fnu when ml_dtypes provides it
  (>= 0.5, which pyproject requires), otherwise the raw bytes as uint8 (see ``E8M0_DTYPE``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = [
    "CheckpointError",
    "DTYPES",
    "E8M0_DTYPE",
    "INDEX_FILE",
    "ShardedCheckpoint",
    "TensorInfo",
    "read_header",
    "read_tensor",
    "write_safetensors",
]


class CheckpointError(ValueError):
    """A checkpoint file (or a tensor in it) is malformed or inconsistent."""


# The official reader refuses headers above this size (safetensors MAX_HEADER_SIZE); a larger
# length field means a corrupt or non-safetensors file, not a real header.
MAX_HEADER_BYTES = 100_000_000

INDEX_FILE = "model.safetensors.index.json"

# float8_e8m0fnu arrived in ml_dtypes 0.5. Without it, E8M0 scales are handed out as their raw
# bytes (uint8): quant.e8m0_to_float32 accepts both, and the bytes are the same either way.
E8M0_DTYPE: np.dtype = np.dtype(getattr(ml_dtypes, "float8_e8m0fnu", np.uint8))

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": E8M0_DTYPE,
}

# Reverse map for the writer. setdefault keeps U8 -> "U8" when E8M0 falls back to uint8, so
# plain bytes are never silently labelled as scales.
_NAME_OF_DTYPE: dict[np.dtype, str] = {}
for _name, _dt in DTYPES.items():
    _NAME_OF_DTYPE.setdefault(_dt, _name)
del _name, _dt

_SHA256_BLOCK = 8 * 1024 * 1024
_FINGERPRINT_POLICIES = ("sha256", "size_mtime")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


# --------------------------------------------------------------------------------------------
# Reading


class _DuplicateJsonKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    # json.loads keeps the last of two equal keys; for a tensor table that would silently
    # drop a tensor, so a duplicate is an error.
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateJsonKey(key)
        out[key] = value
    return out


def _load_json(raw: bytes, where: str) -> object:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateJsonKey as e:
        raise CheckpointError(f"{where}: key {e.key!r} appears twice in the JSON") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: invalid JSON ({e})") from None


def _is_nonneg_int(x: object) -> bool:
    # bool is an int subclass in Python; JSON true/false is not a valid dimension or offset.
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_entry(path: Path, name: str, entry: object, data_offset: int, file_size: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry must be an object, got {entry!r}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise CheckpointError(f"{where}: header entry lacks {missing}: {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {sorted(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_nonneg_int(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_nonneg_int(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != need:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes but dtype {dtype} "
            f"shape {shape} needs {need}"
        )
    if data_offset + end > file_size:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} end at file byte {data_offset + end} but the file has "
            f"{file_size} bytes (truncated?)"
        )
    return TensorInfo(name, dtype, tuple(shape), data_offset + begin, data_offset + end)


def _check_tiling(path: Path, infos: list[TensorInfo], data_offset: int, file_size: int) -> None:
    """Tensors sorted by offset must cover the data section exactly, as the official reader demands."""
    pos, owner = data_offset, None
    for info in sorted(infos, key=lambda t: (t.start, t.end)):
        if info.start < pos:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} (file bytes [{info.start}, {info.end})) overlaps "
                f"tensor {owner.name!r} (file bytes [{owner.start}, {owner.end}))"
            )
        if info.start > pos:
            raise CheckpointError(
                f"{path}: file bytes [{pos}, {info.start}) before tensor {info.name!r} belong to no tensor"
            )
        pos, owner = info.end, info
    if pos != file_size:
        last = f"after the last tensor {owner.name!r}" if owner else "in a file without tensors"
        raise CheckpointError(f"{path}: {file_size - pos} trailing bytes {last} (file has {file_size} bytes)")


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and validate a safetensors header without reading any tensor data.

    Returns ``(header, metadata, data_offset)``: tensor name -> TensorInfo (absolute offsets,
    in header order), the ``__metadata__`` map ({} if absent) and the file offset where the
    data section starts. Raises CheckpointError naming the file (and the tensor, when one is at
    fault) for any inconsistency.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from None
    with f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {file_size}-byte file is too short for the 8-byte header length")
        header_len = int.from_bytes(prefix, "little")
        if not 2 <= header_len <= MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: implausible header length {header_len} (must be in [2, {MAX_HEADER_BYTES}])"
            )
        data_offset = 8 + header_len
        if data_offset > file_size:
            raise CheckpointError(
                f"{path}: header length {header_len} runs past the end of the {file_size}-byte file"
            )
        raw = f.read(header_len)

    table = _load_json(raw, f"{path}: header")
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(table).__name__}")
    metadata = table.pop("__metadata__", None)
    if metadata is None:  # absent, or JSON null (the official reader accepts both)
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{path}: __metadata__ must map str -> str, got {metadata!r}")

    header = {name: _parse_entry(path, name, entry, data_offset, file_size) for name, entry in table.items()}
    _check_tiling(path, list(header.values()), data_offset, file_size)
    return header, metadata, data_offset


def read_tensor(path: str | os.PathLike, info: TensorInfo, *, mmap: bool = False) -> np.ndarray:
    """Read one tensor's bytes (and only those) as a numpy array of its dtype and shape.

    With ``mmap=False`` (default) the bytes are read into a fresh, writable array. With
    ``mmap=True`` a read-only np.memmap view is returned, which avoids the copy for large
    tensors but faults (SIGBUS) if the file is later truncated underneath it.
    """
    path = Path(path)
    where = f"{path}: tensor {info.name!r}"
    if info.dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {info.dtype!r}")
    dtype = DTYPES[info.dtype]
    count = math.prod(info.shape)
    if info.nbytes != count * dtype.itemsize:
        raise CheckpointError(
            f"{where}: byte range [{info.start}, {info.end}) does not fit dtype {info.dtype} shape {info.shape}"
        )
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"{where}: cannot open ({e})") from None
    with f:
        # Re-checked here because a ShardedCheckpoint reads headers once and tensors much later.
        file_size = os.fstat(f.fileno()).st_size
        if info.end > file_size:
            raise CheckpointError(
                f"{where}: needs file bytes [{info.start}, {info.end}) but the file has {file_size} bytes (truncated?)"
            )
        if mmap and count:
            arr = np.memmap(f, dtype=dtype, mode="r", offset=info.start, shape=(count,))
        else:
            buf = bytearray(info.nbytes)
            f.seek(info.start)
            got = f.readinto(buf)
            if got != info.nbytes:
                raise CheckpointError(f"{where}: read {got} of {info.nbytes} bytes (file changed while reading?)")
            arr = np.frombuffer(buf, dtype=dtype)
    if dtype.itemsize > 1 and sys.byteorder != "little":
        arr = arr.byteswap()  # safetensors data is little-endian
    return arr.reshape(info.shape)


# --------------------------------------------------------------------------------------------
# Sharded checkpoints


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_SHA256_BLOCK):
            digest.update(block)
    return digest.hexdigest()


class ShardedCheckpoint:
    """A directory of safetensors shards seen as one tensor table.

    If ``model.safetensors.index.json`` exists its ``weight_map`` decides which shard holds
    each key, and the shard headers must agree with it: every mapped key is in its shard, no
    key is in two shards, and (unless ``allow_unindexed``) no shard holds a key the index does
    not list. Without an index all ``*.safetensors`` files of the directory are used, in sorted
    order, and a key found in two of them is an error. All headers are read up front; tensor
    data only on ``get``.
    """

    def __init__(self, directory: str | os.PathLike, *, allow_unindexed: bool = False):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        self.index_path: Path | None = self.directory / INDEX_FILE
        if not self.index_path.is_file():
            self.index_path = None
        self._headers: dict[str, dict[str, TensorInfo]] = {}  # shard file name -> header
        self._metadata: dict[str, dict[str, str]] = {}
        self._file_of: dict[str, str] = {}  # tensor key -> shard file name
        if self.index_path is not None:
            self._open_indexed(allow_unindexed)
        else:
            self._open_directory()

    def _read_shard(self, file_name: str) -> None:
        header, metadata, _ = read_header(self.directory / file_name)
        self._headers[file_name] = header
        self._metadata[file_name] = metadata

    def _check_no_duplicates(self) -> dict[str, str]:
        seen: dict[str, str] = {}
        for file_name, header in self._headers.items():
            for key in header:
                if key in seen:
                    raise CheckpointError(
                        f"{self.directory}: tensor {key!r} is in both {seen[key]} and {file_name}"
                    )
                seen[key] = file_name
        return seen

    def _open_directory(self) -> None:
        files = sorted(p.name for p in self.directory.glob("*.safetensors") if p.is_file())
        if not files:
            raise CheckpointError(f"{self.directory}: no {INDEX_FILE} and no *.safetensors files")
        for file_name in files:
            self._read_shard(file_name)
        self._file_of = self._check_no_duplicates()

    def _open_indexed(self, allow_unindexed: bool) -> None:
        index_path = self.index_path
        with open(index_path, "rb") as f:
            index = _load_json(f.read(), str(index_path))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index_path}: 'weight_map' must be an object mapping str -> str")

        first_key_of: dict[str, str] = {}
        for key, file_name in weight_map.items():
            first_key_of.setdefault(file_name, key)
        for file_name in sorted(first_key_of):
            shard = self.directory / file_name
            # A shard name must be a plain file in this directory: "../x" or a sub-path would let
            # an index pull tensors from elsewhere.
            if Path(file_name).name != file_name or not shard.is_file():
                raise CheckpointError(
                    f"{index_path}: weight_map names shard {file_name!r} (e.g. for tensor "
                    f"{first_key_of[file_name]!r}) but {shard} is not a file"
                )
            self._read_shard(file_name)
        found_in = self._check_no_duplicates()

        for key, file_name in weight_map.items():
            if key not in self._headers[file_name]:
                elsewhere = f"; it is in {found_in[key]}" if key in found_in else ""
                raise CheckpointError(
                    f"{index_path}: tensor {key!r} is mapped to {file_name} but that shard's header "
                    f"does not contain it{elsewhere}"
                )
        if not allow_unindexed:
            for key, file_name in found_in.items():
                if key not in weight_map:
                    raise CheckpointError(
                        f"{index_path}: shard {file_name} holds tensor {key!r} which the weight_map does not list"
                    )
        self._file_of = dict(weight_map)

    # -- lookup ------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """All tensor keys (index order with an index, else shard order then header order)."""
        return list(self._file_of)

    def __contains__(self, key: object) -> bool:
        return key in self._file_of

    def __len__(self) -> int:
        return len(self._file_of)

    @property
    def files(self) -> list[Path]:
        """The shard files in use, sorted by name."""
        return [self.directory / name for name in sorted(self._headers)]

    def _shard_name(self, key: str) -> str:
        try:
            return self._file_of[key]
        except KeyError:
            raise KeyError(f"{self.directory}: no tensor {key!r}") from None

    def file_of(self, key: str) -> Path:
        """Path of the shard holding ``key``."""
        return self.directory / self._shard_name(key)

    def info(self, key: str) -> TensorInfo:
        """Header entry of ``key`` (dtype, shape, absolute byte range in its shard)."""
        return self._headers[self._shard_name(key)][key]

    def metadata(self, file_name: str) -> dict[str, str]:
        """The ``__metadata__`` map of one shard (by file name)."""
        return dict(self._metadata[file_name])

    def get(self, key: str, *, mmap: bool = False) -> np.ndarray:
        """Read tensor ``key`` (see read_tensor for ``mmap``)."""
        return read_tensor(self.file_of(key), self.info(key), mmap=mmap)

    def fingerprint(self, policy: str = "sha256") -> dict[str, str]:
        """Identify the checkpoint's files: file name -> digest, for the shards and the index.

        ``"sha256"`` hashes every byte (streamed in 8 MiB blocks; minutes for a full model);
        ``"size_mtime"`` is instant but only notices changes that touch size or mtime.
        """
        if policy not in _FINGERPRINT_POLICIES:
            raise ValueError(f"fingerprint policy must be one of {_FINGERPRINT_POLICIES}, got {policy!r}")
        paths = self.files + ([self.index_path] if self.index_path is not None else [])
        out = {}
        for path in sorted(paths):
            if policy == "sha256":
                out[path.name] = _sha256_file(path)
            else:
                st = path.stat()
                out[path.name] = f"size={st.st_size},mtime_ns={st.st_mtime_ns}"
        return out


# --------------------------------------------------------------------------------------------
# Writing


def _is_little_endian(dtype: np.dtype) -> bool:
    return dtype.byteorder in "<|" or (dtype.byteorder == "=" and sys.byteorder == "little")


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to ``path`` in safetensors format, atomically (temp file + os.replace).

    The dtype string comes from the array dtype (see DTYPES), so ml_dtypes bfloat16 /
    float8_e4m3fn / float8_e5m2 / float8_e8m0fnu arrays are written as BF16 / F8_E4M3 /
    F8_E5M2 / F8_E8M0. Raw uint8 is always written as U8.
    """
    path = Path(path)
    prepared: list[tuple[str, str, np.ndarray]] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"{path}: invalid tensor name {name!r}")
        # Not np.ascontiguousarray: it promotes 0-d arrays to shape (1,).
        arr = np.asarray(value)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        # '>f4' and '<f4' are both F32 (the bytes are swapped to little-endian below if needed).
        native = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in ("<", ">") else arr.dtype
        dtype_name = _NAME_OF_DTYPE.get(native)
        if dtype_name is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {arr.dtype}, which has no safetensors name here "
                f"(supported: {sorted(_NAME_OF_DTYPE.values())})"
            )
        if not _is_little_endian(arr.dtype):
            arr = arr.byteswap()  # swaps the bytes, keeps the dtype label: the data we write is LE
        prepared.append((name, dtype_name, arr))
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: metadata must map str -> str, got {dict(metadata)!r}")

    # Widest dtype first keeps every tensor aligned to its itemsize inside the (8-aligned) data
    # section, like the official writer; name breaks ties so output is deterministic.
    prepared.sort(key=lambda t: (-t[2].dtype.itemsize, t[0]))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype_name, arr in prepared:
        header[name] = {"dtype": dtype_name, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # pad with spaces so the data section starts 8-aligned

    # Not tempfile.mkstemp: its 0600 mode would survive os.replace and hide the checkpoint from
    # other users; open(..., "xb") honours the umask and still refuses to clobber a file.
    tmp_name = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp_file = open(tmp_name, "xb")  # outside the try: if this fails there is nothing of ours to remove
    try:
        with tmp_file as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for _, _, arr in prepared:
                if arr.nbytes:
                    f.write(arr.reshape(-1).view(np.uint8).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
