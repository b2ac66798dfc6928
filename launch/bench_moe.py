"""One routed MoE layer at prefill scale on the device, Flash dimensions (hidden 4096, expert
width 2048, top 6): its time against the token chunk (`MoE.__call__(chunk=)`, the tokens whose
expert rows one grouped matmul takes) for each expert count, kernel or XLA path.

    python launch/bench_moe.py --tokens 16384 --experts 16,256 --chunks 4096,8192,16384

Why: at 256 experts (Flash) a 4096-token chunk gives ~96 rows per expert, so each matmul reads
every expert's weights (4 GB for w1) for under one 128-row tile of work each; the ragged_dot
kernel ran at 23 % of the bf16 peak there against 64 % at 16 experts
(`docs/results/kernels_ragged_dot_experts_h200.json`). Chunking does not change any token's
result (each token's experts see the same rows), which `max_rel_diff` checks.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax import config
from redknot_jax.init import random_module
from redknot_jax.moe import MoE
from redknot_jax.pallas.timing import median_time, record

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def main(argv=None):
    ap = _cli.parser(__doc__, __file__,  # docs/kernels.md
                     "python launch/bench_moe.py --tokens 16384 --experts 16,256 --chunks 4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", default="16,256")
    ap.add_argument("--chunks", default="4096,8192,16384")
    ap.add_argument("--kernels", default="mosaic", help="comma list of MoE paths: mosaic (ragged_dot), xla")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048, help="expert width")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    t = a.tokens
    try:
        experts, chunks = ([int(v) for v in getattr(a, f).split(",")] for f in ("experts", "chunks"))
    except ValueError:
        ap.error(f"--experts / --chunks: expected comma-separated integers, got {a.experts!r} / {a.chunks!r}")
    kernels = a.kernels.split(",")
    rows = []
    bar = _cli.progress(desc="experts x kernels x chunks", total=len(experts) * len(kernels) * len(chunks), unit="run")
    for e in experts:
        cfg = config.flash(n_routed_experts=e, hidden_size=a.hidden, moe_inter_dim=a.inter)
        layer = cfg.mlp_layer_types.index(config.MOE)  # learned routing
        graphdef, state = nnx.split(random_module(lambda: MoE(cfg, layer, jnp.bfloat16), e, seed=e))
        kx, ki = jax.random.split(jax.random.key(1))
        x = jax.random.normal(kx, (1, t, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
        ids = jax.random.randint(ki, (1, t), 0, cfg.vocab_size)
        flop = 2 * 3 * t * cfg.experts_per_tok * cfg.hidden_size * cfg.moe_inter_dim  # routed experts
        for kern in kernels:
            first = None
            for c in chunks:
                f = jax.jit(lambda st, x, ids, c=c, kern=kern: nnx.merge(graphdef, st)(x, ids, chunk=c, kernels=kern))
                y = f(state, x, ids).astype(jnp.float32)
                first = y if first is None else first
                diff = float(jnp.max(jnp.abs(y - first)) / jnp.max(jnp.abs(first)))
                sec = median_time(f, state, x, ids, iters=a.iters)
                rows.append(dict(experts=e, kernels=kern, chunk=c, rows_per_expert=c * cfg.experts_per_tok / e,
                                 ms=sec * 1e3, routed_tflops=flop / sec / 1e12, max_rel_diff=diff))
                _cli.echo(f"experts {e} {kern} chunk {c} ({c * cfg.experts_per_tok / e:.0f} rows/expert): "
                          f"{sec * 1e3:.2f} ms, routed {flop / sec / 1e12:.0f} TFLOP/s, diff {diff:.1e}")
                bar.update()
        del state
    bar.close()
    return record("moe", a.json, argv, program="python launch/bench_moe.py", tokens=t, rows=rows)


if __name__ == "__main__":
    main()
