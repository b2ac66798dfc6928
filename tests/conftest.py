"""Test session setup: 8 virtual CPU devices (sharded code runs on every commit) and the
highest matmul precision, so fp32 parity against PyTorch is meaningful."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
