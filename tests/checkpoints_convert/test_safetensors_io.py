"""checkpoints_convert.safetensors_io: interop with the official safetensors library both ways,
and one CheckpointError (naming file and tensor) for every malformed input."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

from checkpoints_convert.safetensors_io import (
    DTYPES,
    INDEX_FILE,
    CheckpointError,
    ShardedCheckpoint,
    TensorInfo,
    read_header,
    read_tensor,
    write_safetensors,
)

# dtypes the official numpy backend can read/write; the rest (BF16, FP8, E8M0) go through
# its torch backend, which knows them.
NUMPY_LIB_DTYPES = ["F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"]
TORCH_ONLY_DTYPES = ["BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"]
assert sorted(NUMPY_LIB_DTYPES + TORCH_ONLY_DTYPES) == sorted(DTYPES)

TORCH_DTYPE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip

SHAPES = [(3, 5), (), (0, 4), (2, 1, 3)]


def sample(dtype_name: str, shape, seed: int = 0) -> np.ndarray:
    """Random array; the ml_dtypes floats get random bytes so every bit pattern (NaN too) occurs."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype_name]
    if dtype_name == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if dtype_name in ("F64", "F32", "F16"):
        return rng.standard_normal(shape).astype(dt)
    raw = rng.integers(0, 256, (*shape, dt.itemsize), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def as_bytes(a) -> bytes:
    """Raw little-endian bytes of a numpy array or torch tensor: bit-exact comparison, NaN-safe."""
    if isinstance(a, torch.Tensor):
        a = a.contiguous().reshape(-1)
        return a.view(torch.uint8).numpy().tobytes() if a.numel() else b""
    return np.ascontiguousarray(a).tobytes()


def write_raw(path: Path, header, data: bytes = b"", header_len: int | None = None) -> Path:
    """A hand-made safetensors file; header is a dict (JSON-encoded here) or raw bytes."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(n.to_bytes(8, "little") + blob + data)
    return path


def f32_entry(begin: int, end: int, shape=(4,)):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


def raises_naming(*parts: str):
    """pytest.raises(CheckpointError) whose message must contain every part, in order."""
    return pytest.raises(CheckpointError, match=".*".join(re.escape(p) for p in parts))


# --------------------------------------------------------------------------------------------
# Interop with the official library


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype_name", NUMPY_LIB_DTYPES)
def test_numpy_interop_both_ways(tmp_path, dtype_name, shape):
    arr = sample(dtype_name, shape)
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, {"t": arr})
    loaded = safetensors.numpy.load_file(ours)["t"]
    assert loaded.dtype == arr.dtype and loaded.shape == arr.shape
    assert as_bytes(loaded) == as_bytes(arr)

    theirs = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file({"t": arr}, theirs)
    header, _, _ = read_header(theirs)
    assert header["t"].dtype == dtype_name and header["t"].shape == shape
    got = read_tensor(theirs, header["t"])
    assert got.dtype == arr.dtype and got.shape == arr.shape
    assert as_bytes(got) == as_bytes(arr)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_torch_interop_both_ways(tmp_path, dtype_name):
    arr = sample(dtype_name, (3, 5), seed=1)
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, {"t": arr})
    loaded = safetensors.torch.load_file(ours)["t"]
    assert loaded.dtype == TORCH_DTYPE[dtype_name] and tuple(loaded.shape) == arr.shape
    assert as_bytes(loaded) == as_bytes(arr)

    theirs = tmp_path / "theirs.safetensors"
    flat = torch.from_numpy(np.frombuffer(as_bytes(arr), dtype=np.uint8).copy())
    safetensors.torch.save_file({"t": flat.view(TORCH_DTYPE[dtype_name]).reshape(3, 5)}, theirs)
    header, _, _ = read_header(theirs)
    assert header["t"].dtype == dtype_name
    got = read_tensor(theirs, header["t"])
    assert got.dtype == arr.dtype and got.shape == arr.shape
    assert as_bytes(got) == as_bytes(arr)


def test_mixed_file_with_metadata_both_ways(tmp_path):
    tensors = {f"t_{name.lower()}": sample(name, (2, 3), seed=i) for i, name in enumerate(sorted(DTYPES))}
    metadata = {"format": "pt", "note": "ünïcode ok"}
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors, metadata)
    with safetensors.safe_open(ours, framework="pt") as f:
        assert f.metadata() == metadata
        assert sorted(f.keys()) == sorted(tensors)
        for key, arr in tensors.items():
            assert as_bytes(f.get_tensor(key)) == as_bytes(arr), key

    theirs = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(safetensors.torch.load_file(ours), theirs, metadata=metadata)
    header, got_metadata, data_offset = read_header(theirs)
    assert got_metadata == metadata and sorted(header) == sorted(tensors)
    assert data_offset % 8 == 0
    for key, arr in tensors.items():
        assert as_bytes(read_tensor(theirs, header[key])) == as_bytes(arr), key


def test_writer_layout_and_awkward_inputs(tmp_path):
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    transposed = np.arange(12, dtype=np.int64).reshape(3, 4).T
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"be": big_endian, "tr": transposed, "b": np.ones(3, np.int8)})
    loaded = safetensors.numpy.load_file(path)
    np.testing.assert_array_equal(loaded["be"], big_endian)
    np.testing.assert_array_equal(loaded["tr"], transposed)
    header, _, data_offset = read_header(path)
    # 8-aligned data section and each tensor aligned to its itemsize, so memmaps are aligned.
    assert data_offset % 8 == 0
    assert all(info.start % info.numpy_dtype.itemsize == 0 for info in header.values())
    mm = read_tensor(path, header["tr"], mmap=True)
    assert isinstance(mm, np.memmap) and not mm.flags.writeable
    np.testing.assert_array_equal(mm, transposed)
    assert read_tensor(path, header["tr"]).flags.writeable


def test_writer_failure_leaves_existing_file_and_no_temp(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.zeros(2, np.float32)})
    before = path.read_bytes()
    with raises_naming(str(path), "'bad'", "complex128"):
        write_safetensors(path, {"a": np.ones(2, np.float32), "bad": np.zeros(2, np.complex128)})
    with raises_naming(str(path), "metadata"):
        write_safetensors(path, {"a": np.ones(2, np.float32)}, {"k": 1})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


# --------------------------------------------------------------------------------------------
# Malformed single files


def test_truncated_file_names_file_and_tensor(tmp_path):
    path = tmp_path / "trunc.safetensors"
    write_safetensors(path, {"a": np.zeros(4, np.float32), "b": np.ones(4, np.float32)})
    header, _, _ = read_header(path)
    path.write_bytes(path.read_bytes()[:-3])
    with raises_naming(str(path), "'b'", "truncated"):
        read_header(path)
    # A header read before the truncation must not lead read_tensor past the end.
    with raises_naming(str(path), "'b'", "truncated"):
        read_tensor(path, header["b"])
    np.testing.assert_array_equal(read_tensor(path, header["a"]), np.zeros(4, np.float32))


BAD_FILES = {
    # id: (header (dict or bytes), data, header_len override, substrings the message must contain)
    "header_len_beyond_file": ({"a": f32_entry(0, 16)}, bytes(16), 10_000, ["header length 10000", "runs past"]),
    "header_len_zero": (b"", b"", 0, ["implausible header length 0"]),
    "header_len_huge": ({}, b"", 2**63, ["implausible header length"]),
    "invalid_json": (b"{not json", b"", None, ["invalid JSON"]),
    "not_utf8": (b'{"\xff": 1}', b"", None, ["invalid JSON"]),
    "header_not_object": (b"[1, 2]", b"", None, ["must be a JSON object"]),
    "duplicate_json_key": (
        b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
        b'"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
        bytes(16), None, ["'a'", "twice"],
    ),
    "unknown_dtype": ({"a": {"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 2]}}, bytes(2), None,
                      ["'a'", "unknown dtype 'Q4_K'"]),
    "unsupported_real_dtype": ({"a": {"dtype": "F8_E4M3FNUZ", "shape": [4], "data_offsets": [0, 4]}}, bytes(4),
                               None, ["'a'", "unknown dtype 'F8_E4M3FNUZ'"]),
    "offsets_lie_about_size": ({"a": f32_entry(0, 12, shape=(2, 2))}, bytes(12), None,
                               ["'a'", "span 12 bytes", "needs 16"]),
    "offsets_past_end": ({"a": f32_entry(0, 16)}, bytes(8), None, ["'a'", "truncated"]),
    "overlap": ({"a": f32_entry(0, 16), "b": f32_entry(8, 24)}, bytes(24), None, ["'b'", "overlaps", "'a'"]),
    "hole": ({"a": f32_entry(0, 16), "b": f32_entry(20, 36)}, bytes(36), None,
             ["[", "before tensor 'b'", "belong to no tensor"]),
    "trailing_bytes": ({"a": f32_entry(0, 16)}, bytes(20), None, ["4 trailing bytes", "'a'"]),
    "negative_dim": ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", None, ["'a'", "shape"]),
    "bool_dim": ({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, bytes(1), None, ["'a'", "shape"]),
    "reversed_offsets": ({"a": f32_entry(16, 0)}, bytes(16), None, ["'a'", "data_offsets"]),
    "missing_field": ({"a": {"dtype": "F32", "shape": [4]}}, bytes(16), None, ["'a'", "lacks", "data_offsets"]),
    "entry_not_object": ({"a": [1, 2]}, b"", None, ["'a'", "must be an object"]),
    "metadata_not_str": ({"__metadata__": {"k": 1}, "a": f32_entry(0, 16)}, bytes(16), None, ["__metadata__"]),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_FILES, ids=str)
def test_malformed_file_raises_naming_file_and_tensor(tmp_path, case):
    header, data, header_len, parts = BAD_FILES[case]
    path = write_raw(tmp_path / f"{case}.safetensors", header, data, header_len)
    with raises_naming(str(path), *parts):
        read_header(path)


def test_our_strictness_matches_official_reader(tmp_path):
    """Negative control for the table above: the official reader rejects the same files."""
    for case in ("offsets_lie_about_size", "overlap", "hole", "trailing_bytes", "header_len_beyond_file"):
        header, data, header_len, _ = BAD_FILES[case]
        path = write_raw(tmp_path / f"{case}.safetensors", header, data, header_len)
        with pytest.raises(Exception):
            safetensors.numpy.load_file(path)


def test_tiny_and_empty_files(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with raises_naming(str(short), "too short"):
        read_header(short)
    with raises_naming(str(tmp_path / "absent.safetensors"), "cannot open"):
        read_header(tmp_path / "absent.safetensors")
    empty = write_raw(tmp_path / "empty.safetensors", {"__metadata__": None})
    assert read_header(empty)[:2] == ({}, {})


def test_read_tensor_rejects_inconsistent_info(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": np.zeros(4, np.float32)})
    info = read_header(path)[0]["a"]
    with raises_naming(str(path), "'a'", "does not fit"):
        read_tensor(path, TensorInfo("a", "F32", (5,), info.start, info.end))
    with raises_naming(str(path), "'a'", "unknown dtype"):
        read_tensor(path, TensorInfo("a", "F12", (4,), info.start, info.end))


# --------------------------------------------------------------------------------------------
# Sharded checkpoints


def make_sharded(directory: Path, shards: dict[str, dict[str, np.ndarray]], index: bool) -> dict:
    directory.mkdir(exist_ok=True)
    weight_map = {}
    for file_name, tensors in shards.items():
        write_safetensors(directory / file_name, tensors)
        weight_map.update({k: file_name for k in tensors})
    if index:
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return weight_map


SHARDS = {
    "model-00001-of-00002.safetensors": {"embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4)},
    "model-00002-of-00002.safetensors": {
        "head.weight": np.ones((2, 2), np.float16),
        "layers.0.attn.wq_a.scale": np.arange(4, dtype=np.uint8),
    },
}


@pytest.mark.parametrize("index", [True, False], ids=["index", "glob"])
def test_sharded_lookup(tmp_path, index):
    weight_map = make_sharded(tmp_path, SHARDS, index)
    ckpt = ShardedCheckpoint(tmp_path)
    assert sorted(ckpt.keys()) == sorted(weight_map) and len(ckpt) == 3 and "head.weight" in ckpt
    for shard, tensors in SHARDS.items():
        for key, arr in tensors.items():
            assert ckpt.file_of(key) == tmp_path / shard
            assert ckpt.info(key).shape == arr.shape
            np.testing.assert_array_equal(ckpt.get(key), arr)
    with pytest.raises(KeyError, match="nope"):
        ckpt.get("nope")


def test_fingerprint(tmp_path):
    make_sharded(tmp_path, SHARDS, index=True)
    ckpt = ShardedCheckpoint(tmp_path)
    digests = ckpt.fingerprint("sha256")
    assert sorted(digests) == sorted([*SHARDS, INDEX_FILE])
    for name, digest in digests.items():
        assert digest == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    quick = ckpt.fingerprint("size_mtime")
    first = next(iter(SHARDS))
    assert quick[first].startswith(f"size={(tmp_path / first).stat().st_size},mtime_ns=")
    write_safetensors(tmp_path / first, {"embed.weight": np.zeros((3, 4), np.float32)})
    assert ckpt.fingerprint("sha256")[first] != digests[first]
    with pytest.raises(ValueError, match="'md5'"):
        ckpt.fingerprint("md5")


def test_index_names_missing_shard(tmp_path):
    make_sharded(tmp_path, SHARDS, index=True)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with raises_naming(INDEX_FILE, "model-00002-of-00002.safetensors", "'head.weight'"):
        ShardedCheckpoint(tmp_path)


def test_index_shard_outside_directory(tmp_path):
    make_sharded(tmp_path / "ckpt", SHARDS, index=False)
    write_safetensors(tmp_path / "outside.safetensors", {"x": np.zeros(1, np.int8)})
    (tmp_path / "ckpt" / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))
    with raises_naming("../outside.safetensors", "'x'", "not a file"):
        ShardedCheckpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("index", [True, False], ids=["index", "glob"])
def test_duplicate_key_across_shards(tmp_path, index):
    # With an index, both shards must be referenced by it (a_only) for the clash to be seen.
    shards = {
        "a.safetensors": {"dup.weight": np.zeros(2, np.float32), "a_only": np.ones(1, np.int8)},
        "b.safetensors": {"dup.weight": np.ones(2, np.float32), "other": np.ones(1, np.int8)},
    }
    make_sharded(tmp_path, shards, index)
    with raises_naming("'dup.weight'", "a.safetensors", "b.safetensors"):
        ShardedCheckpoint(tmp_path)


def test_index_key_not_in_shard_header(tmp_path):
    weight_map = make_sharded(tmp_path, SHARDS, index=False)
    weight_map["layers.0.attn.wq_a.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with raises_naming(INDEX_FILE, "'layers.0.attn.wq_a.weight'", "model-00001-of-00002.safetensors"):
        ShardedCheckpoint(tmp_path)


def test_index_key_mapped_to_wrong_shard(tmp_path):
    weight_map = make_sharded(tmp_path, SHARDS, index=False)
    weight_map["head.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with raises_naming("'head.weight'", "model-00001-of-00002.safetensors", "it is in model-00002-of-00002"):
        ShardedCheckpoint(tmp_path)


def test_shard_key_missing_from_index(tmp_path):
    weight_map = make_sharded(tmp_path, SHARDS, index=False)
    del weight_map["head.weight"]
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with raises_naming(INDEX_FILE, "model-00002-of-00002.safetensors", "'head.weight'"):
        ShardedCheckpoint(tmp_path)
    ckpt = ShardedCheckpoint(tmp_path, allow_unindexed=True)
    assert "head.weight" not in ckpt and len(ckpt) == 2


def test_bad_index_and_directory(tmp_path):
    with raises_naming(str(tmp_path), "no " + INDEX_FILE):
        ShardedCheckpoint(tmp_path)
    with raises_naming(str(tmp_path / "nope"), "not a directory"):
        ShardedCheckpoint(tmp_path / "nope")
    (tmp_path / INDEX_FILE).write_text('{"weight_map": {"a": 3}}')
    with raises_naming(INDEX_FILE, "weight_map"):
        ShardedCheckpoint(tmp_path)
    (tmp_path / INDEX_FILE).write_text('{"weight_map": ')
    with raises_naming(INDEX_FILE, "invalid JSON"):
        ShardedCheckpoint(tmp_path)


def test_shard_error_propagates_with_shard_name(tmp_path):
    make_sharded(tmp_path, SHARDS, index=True)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with raises_naming(str(shard), "'embed.weight'", "truncated"):
        ShardedCheckpoint(tmp_path)
