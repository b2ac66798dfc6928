"""Random weights for a model built abstractly: tests, the embedded demo model and benchmarks
(speed does not depend on weight values). Drawn on the device inside one jit, so a
flash-shaped model never passes through host memory.

Scales keep activations O(1): linear weights ~ N(0, 1/in), norms ~ 1 + N(0, 0.1), mHC mixing
small, sinks and gate biases O(1); `tid2eid` gets distinct experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.config import ModelConfig
from redknot_jax.model import Model


def rule(name: str, shape) -> tuple[str, float, float]:
    """How leaf `name` of `shape` is drawn: ("normal", std, mean), ("uniform", low, width), or
    ("experts", 0, 0) (`tid2eid`: distinct experts per token). One table for every drawer (the
    jitted one below; the numpy one of the sharding tests)."""
    if name == "tid2eid":
        return "experts", 0.0, 0.0
    if name == "weight":  # every RMSNorm weight
        return "normal", 0.1, 1.0
    if name in ("fn", "hc_fn"):
        return "normal", 0.02, 0.0
    if name in ("base", "hc_base", "attn_sink", "ape"):
        return "normal", 0.5, 0.0
    if name in ("scale", "hc_scale"):
        return "uniform", 0.5, 1.0
    if name == "bias":
        return "normal", 0.1, 0.0
    if name == "embed":
        return "normal", 1.0, 0.0
    if name in ("w1", "w3", "w2") or len(shape) == 2:  # [e, in, out] and [out, in]
        return "normal", shape[1] ** -0.5, 0.0
    raise ValueError(f"{name}: no random-initialisation rule for shape {shape}")


@functools.partial(jax.jit, static_argnames=("name", "shape", "dtype", "n_experts"))
def _draw(key, name: str, shape, dtype, n_experts: int):
    """One leaf; jitted per (rule, shape) so a 43-layer model compiles a handful of kernels."""
    kind, a, b = rule(name, shape)
    if kind == "experts":
        order = jnp.argsort(jax.random.uniform(key, (shape[0], n_experts)), axis=-1)
        return order[:, : shape[1]].astype(dtype)
    if kind == "uniform":
        return (a + b * jax.random.uniform(key, shape)).astype(dtype)
    return (jax.random.normal(key, shape, jnp.float32) * a + b).astype(dtype)


def random_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, shardings=None) -> Model:
    """A `Model` of cfg with random weights drawn on the default device (or `shardings`,
    a pytree of NamedShardings matching the state)."""
    return random_module(lambda: Model(cfg, dtype), cfg.n_routed_experts, seed, shardings)


def random_module(make, n_experts: int, seed: int = 0, shardings=None):
    """The module `make()` builds (a Model, or one block's MoE for a benchmark), its weights
    drawn by the rules above without ever being built with zeros."""
    abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    paths = [".".join(str(p) for p in path) for path, _ in flat]
    specs = [(v.shape, v.dtype) for _, v in flat]

    keys = jax.random.split(jax.random.key(seed), len(paths))
    shardings = [None] * len(paths) if shardings is None else list(shardings)
    for (_, var), p, (s, d), k, sh in zip(flat, paths, specs, keys, shardings):
        val = _draw(k, p.split(".")[-1], tuple(s), jnp.dtype(d), n_experts)
        var.set_value(val if sh is None else jax.device_put(val, sh))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
