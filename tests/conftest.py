"""Test session setup: 8 virtual CPU devices (sharded code runs on every commit) and the
highest matmul precision, so fp32 parity against PyTorch is meaningful."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module: one process runs the whole suite,
    and hundreds of kept XLA CPU executables (tp=8 shard_map programs among them) otherwise
    grow the process until the compiler fails late in the run."""
    yield
    jax.clear_caches()
    gc.collect()
