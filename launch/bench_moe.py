"""One routed MoE layer on the device, Flash dimensions (hidden 4096, expert width 2048, top 6):
its time against the token chunk (`MoE.__call__(chunk=)`, the tokens whose expert rows one
grouped matmul takes) for each expert count and path (`MoE.experts`' kernels: mosaic, xla); at
decode sizes (--tokens 1..16), the paths side by side.

    python launch/bench_moe.py --tokens 16384 --experts 16,256 --chunks 4096,8192,16384
    python launch/bench_moe.py --tokens 1 --experts 16,256 --chunks 4096 --kernels xla,mosaic

Why: at 256 experts (Flash) a 4096-token chunk gives ~96 rows per expert, so each matmul reads
every expert's weights (4 GB for w1) for under one 128-row tile of work each; the ragged_dot
kernel ran at 23 % of the bf16 peak there against 64 % at 16 experts
(`docs/results/kernels_ragged_dot_experts_h200.json`). Chunking does not change any token's
result (each token's experts see the same rows), which `max_rel_diff` checks (against the first
chunk of the first path). `weights_gb_s`: the routed weights the rows use, read once, per second
(at a decode step's few rows "xla" is XLA's ragged_dot, a dense dot over every expert on a GPU).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
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
    ap.add_argument("--kernels", default="mosaic", help="comma list of MoE paths: mosaic (the ragged_dot kernel), "
                                                        "xla (by size)")
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
        used = len(np.unique(np.asarray(nnx.merge(graphdef, state).route(x[0], ids[0])[0])))
        used_bytes = used * 3 * cfg.hidden_size * cfg.moe_inter_dim * 2  # bf16
        first = None
        for kern in kernels:
            for c in chunks:
                f = jax.jit(lambda st, x, ids, c=c, kern=kern: nnx.merge(graphdef, st)(x, ids, chunk=c, kernels=kern))
                y = f(state, x, ids).astype(jnp.float32)
                first = y if first is None else first
                diff = float(jnp.max(jnp.abs(y - first)) / jnp.max(jnp.abs(first)))
                sec = median_time(f, state, x, ids, iters=a.iters)
                per = min(c, t) * cfg.experts_per_tok / e  # rows per expert in one grouped matmul
                rows.append(dict(experts=e, kernels=kern, chunk=c, rows_per_expert=per,
                                 ms=sec * 1e3, routed_tflops=flop / sec / 1e12, used_experts=used,
                                 weights_gb_s=used_bytes / sec / 1e9, max_rel_diff=diff))
                _cli.echo(f"experts {e} {kern} chunk {c} ({per:.2g} rows/expert): "
                          f"{sec * 1e3:.3f} ms, routed {flop / sec / 1e12:.0f} TFLOP/s, {used} experts' weights "
                          f"{used_bytes / sec / 1e9:.0f} GB/s, diff {diff:.1e}")
                bar.update()
        del state
    bar.close()
    return record("moe", a.json, argv, program="python launch/bench_moe.py", tokens=t, rows=rows)


if __name__ == "__main__":
    main()
