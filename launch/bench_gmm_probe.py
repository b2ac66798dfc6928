"""Probe: cost of jax.lax.ragged_dot vs a dense matmul of the same useful FLOPs on this GPU,
and of Precision.HIGHEST on bf16 operands. Prints one line per variant."""
import time, statistics, jax, jax.numpy as jnp

def bench(f, *a, reps=10):
    f(*a).block_until_ready(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(*a).block_until_ready(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)

n, d, f, e = 6 * 8192, 4096, 2048, 16
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (n, d), jnp.bfloat16)
w = jax.random.normal(k[1], (e, d, f), jnp.bfloat16)
sizes = jnp.full((e,), n // e, jnp.int32)
useful = 2 * n * d * f
t = bench(jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)), x, w, sizes); print(f"ragged_dot default: {t*1e3:.2f} ms {useful/t/1e12:.0f} TFLOP/s")
t = bench(jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST)), x, w, sizes); print(f"ragged_dot HIGHEST: {t*1e3:.2f} ms {useful/t/1e12:.0f} TFLOP/s")
t = bench(jax.jit(lambda x, w: x @ w[0]), x, w); print(f"dense same flops: {t*1e3:.2f} ms {useful/t/1e12:.0f} TFLOP/s")
t = bench(jax.jit(lambda x, w: jnp.einsum('nd,df->nf', x, w[0], precision=jax.lax.Precision.HIGHEST)), x, w); print(f"dense HIGHEST bf16: {t*1e3:.2f} ms {useful/t/1e12:.0f} TFLOP/s")
t = bench(jax.jit(lambda x, w: jnp.einsum('nd,df->nf', x, w[0], preferred_element_type=jnp.float32)), x, w); print(f"dense f32-acc: {t*1e3:.2f} ms {useful/t/1e12:.0f} TFLOP/s")
xs = x.reshape(e, n // e, d)
t = bench(jax.jit(lambda x, w: jnp.einsum('end,edf->enf', x, w)), xs, w); print(f"batched per-expert: {t*1e3:.2f} ms {useful/t/1e12:.0f} TFLOP/s")
