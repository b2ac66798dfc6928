"""mHC at prefill scale on the device, side by side in one run: the two forms of
`HyperConnection.post`'s stream mix, and the two forms of the site's `pre` (mixing logits,
Sinkhorn, the pre-weighted sum).

    python launch/bench_mhc.py --rows 65536 --json mhc_64k.json

Forms of X'[k] = post_k * y + sum_j comb[j, k] X[j] (x in bf16, Flash: n = 4, d = 4096):
  * "matmul": the per-token [n, n] x [n, d] batched matmul (`einsum("btjk,btjd->btkd")`, the
    form `redknot_jax.mhc` used until session 10);
  * "streams": the sum over the n streams written out in fp32 (`HyperConnection.post` now).
Bytes: x read once and X' written once (2 * t * n * d * 2) are what either form must move.

Forms of the mixing logits m = fn @ RMSNorm(flatten(x)):
  * "normalized": the fp32 normalised streams written, then the fp32 [t, n*d] x [n*d, (2+n)n]
    projection at HIGHEST precision (`redknot_jax.mhc` until session 46);
  * "scaled": `mhc.mix_logits` (`HyperConnection.pre` now): the projection of x itself (bf16 x:
    fn as two bf16 parts on the tensor cores), scaled by the row's rsqrt(mean(x^2) + eps).
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp

from redknot_jax import mhc
from redknot_jax.mhc import HyperConnection
from redknot_jax.pallas.timing import median_time, record

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def post_matmul(x, y, post, comb):
    dt = x.dtype
    mixed = jnp.einsum("btjk,btjd->btkd", comb.astype(dt), x, precision=jax.lax.Precision.HIGHEST)
    return post.astype(dt)[..., None] * y[..., None, :] + mixed


def mix_logits_normalized(x, fn, eps):
    f = x.reshape(*x.shape[:-2], -1).astype(jnp.float32)
    f = f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)
    return jnp.einsum("btf,cf->btc", f, fn, precision=jax.lax.Precision.HIGHEST)


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/bench_mhc.py --rows 65536")  # docs/benchmarks.md
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    t, n, d = a.rows, a.streams, a.hidden
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (1, t, n, d), jnp.bfloat16)
    y = jax.random.normal(ks[1], (1, t, d), jnp.bfloat16)
    post = jax.random.uniform(ks[2], (1, t, n), jnp.float32)
    comb = jax.nn.softmax(jax.random.normal(ks[3], (1, t, n, n), jnp.float32), -1)
    site = HyperConnection(n, d, 20, 1e-6, 1e-6)
    site.fn[...] = jax.random.normal(ks[4], site.fn.shape, jnp.float32) * d ** -0.5
    copy = jax.jit(lambda u: u + 1)
    t_copy = median_time(copy, x, iters=a.iters)
    forms = {"matmul": jax.jit(post_matmul), "streams": jax.jit(HyperConnection.post)}
    ref = forms["matmul"](x, y, post, comb).astype(jnp.float32)
    rows = {"copy_ms": t_copy * 1e3, "copy_gbs": 2 * x.nbytes / t_copy / 1e9}
    for name, f in _cli.progress(forms.items(), desc="post forms", total=len(forms), unit="form", leave=False):
        out = f(x, y, post, comb).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        rows[f"post_{name}_ms"] = median_time(f, x, y, post, comb, iters=a.iters) * 1e3
        rows[f"post_{name}_max_rel_diff"] = err
    rows["pre_ms"] = median_time(jax.jit(site.pre), x, iters=a.iters) * 1e3
    fn, eps = site.fn[...], site.norm_eps
    logits = {"normalized": jax.jit(lambda x, fn: mix_logits_normalized(x, fn, eps)),
              "scaled": jax.jit(lambda x, fn: mhc.mix_logits(x, fn, eps))}
    ref = logits["normalized"](x, fn)
    for name, f in logits.items():
        rows[f"logits_{name}_ms"] = median_time(f, x, fn, iters=a.iters) * 1e3
        rows[f"logits_{name}_max_rel_diff"] = float(jnp.max(jnp.abs(f(x, fn) - ref)) / jnp.max(jnp.abs(ref)))
    res = record("mhc", a.json, argv, program="python launch/bench_mhc.py", rows=t, streams=n, hidden=d, **rows,
                 post_streams_over_matmul=rows["post_matmul_ms"] / rows["post_streams_ms"],
                 logits_scaled_over_normalized=rows["logits_normalized_ms"] / rows["logits_scaled_ms"])
    print(json.dumps(res, indent=1))
    return res

if __name__ == "__main__":
    main()
