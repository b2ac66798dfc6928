"""Test session setup: 8 virtual CPU devices (sharded code runs on every commit) and the
highest matmul precision, so fp32 parity against PyTorch is meaningful; one persistent
compilation cache per test run; the heaviest test files scheduled first."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Lower XLA's CPU backend (LLVM) effort for every test program, as tests/sharding/helpers.py
# already did for its own: the suite is compile-bound (about 30 % less compile time), and a
# program's semantics (fp32, highest matmul precision) are unchanged. Server subprocesses
# started by tests/server/sockets.py get only this flag (FAST_COMPILE) and one device;
# test_bench_qps.py's server keeps XLA's default (it is bound by running, not compiling).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One JAX persistent compilation cache per test run, created by the first process that loads
# this file (pytest's controller under xdist; the workers inherit it): the per-module
# jax.clear_caches() below and the two workers would otherwise compile the same tiny-model
# programs again and again. Removed at exit by its creator; an existing setting is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="redknot-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
# Every program is cached, the eager ops' too: a test file compiles ~1900 programs, most of them
# one primitive at ~17 ms each, which every module (after its jax.clear_caches()) and both workers
# would otherwise compile again (three reuse files in one process, cold: 448 s at a 0.2 s
# threshold, 360 s at 0; 2-core CPU, 2026-12-07).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module: one process runs the whole suite,
    and hundreds of kept XLA CPU executables (tp=8 shard_map programs among them) otherwise
    grow the process until the compiler fails late in the run."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def refused(capsys):
    """refused(main, argv, named): main(argv) stops with a non-zero exit before doing anything,
    and what it says (argparse's message on stderr, or the SystemExit's text) matches the regex
    `named`, so a test of one bad flag cannot pass on another error."""
    def check(main, argv, named):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(argv)
        code = e.value.code
        said = capsys.readouterr().err + ("" if code is None or isinstance(code, int) else str(code))
        assert code not in (0, None), f"{argv}: exited with {code!r}"
        assert re.search(named, said), f"{argv}: expected {named!r} in {said!r}"
    return check


# Files by their measured cost (seconds on the 2-core CI machine, `--durations`), heaviest first:
# with `--dist loadfile --no-loadscope-reorder` xdist hands out files in this order, so no
# long file starts last while the other worker idles. Files not named keep collection order.
HEAVY_FIRST = (
    "tests/reuse/test_consumer.py",  # ~320 s
    "tests/reuse/test_runtime.py",
    "tests/quality/test_quality.py",
    "tests/sharding/test_bench_tp.py",  # ~110 s, 2 tests
    "tests/server/test_shipped_model.py",  # ~250 s, 1 test
    "tests/sharding/test_consumer_tp.py",
    "tests/server/test_server.py",
    "tests/server/test_scheduler.py",
    "tests/pallas/test_restore.py",
    "tests/pallas/test_sparse_attention.py",  # ~95 s (the kernel in interpret mode, in a model)
    "tests/pallas/test_ragged_dot.py",  # ~70 s
    "tests/reuse/test_bench_ttft.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {f: i for i, f in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))  # stable: file order kept
