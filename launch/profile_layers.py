"""Per-layer time breakdown of the flash-shaped stack on one GPU: for a sliding, a CSA and an
HCA layer (Flash dimensions, 16 experts), time the attention half and the MoE half of one
8192-row chunk, at a given cache capacity (context length), each jitted on its own.

    python launch/profile_layers.py --chunk 8192 --contexts 8448,65792
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # flash-shaped weights + a long pool: JAX's 75 % is too little
import jax
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from redknot_jax.init import random_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def timeit(f, *a, reps=5):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/profile_layers.py --chunk 8192 --contexts 8448,65792")
    ap.add_argument("--chunk", type=int, default=8192, help="rows of the timed chunk")
    ap.add_argument("--contexts", default="8448,65792", help="cache capacities (context lengths), comma-separated")
    args = ap.parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts: expected comma-separated integers, got {args.contexts!r}")
    short = [c for c in contexts if c < args.chunk + 256]
    if short:
        ap.error(f"--contexts {short}: each must hold the --chunk ({args.chunk}) rows and 256 more")
    cfg = config.flash(num_layers=3, layer_types=(SLIDING, CSA, HCA), mlp_layer_types=(HASH_MOE, MOE, MOE),
                       n_routed_experts=16)
    model = random_model(cfg, seed=0, dtype=jnp.bfloat16)
    t = args.chunk
    x = jax.random.normal(jax.random.key(1), (1, t, cfg.hidden_size), jnp.bfloat16)
    ids = jnp.zeros((1, t), jnp.int32)
    print("| layer | context | attention ms | MoE ms |")
    print("|---|---|---|---|")
    bar = _cli.progress(desc="layers x contexts", total=3 * len(contexts), unit="layer")
    for cap in contexts:
        for i, name in enumerate(("sliding", "CSA", "HCA")):
            blk = model.layers[i]
            cache = blk.attn.init_cache(1, cap, jnp.bfloat16)
            pos0 = jnp.full((1,), cap - t - 256, jnp.int32)  # the chunk is the last of the context
            att = jax.jit(lambda x, c, p: blk.attn(x, p, jnp.full((1,), t, jnp.int32), c, model.freqs(i), 256)[0])
            moe = jax.jit(lambda x: blk.ffn(x, ids))
            ta = timeit(att, x, cache, pos0)
            tm = timeit(moe, x)
            _cli.echo(f"| {name} | {cap} | {ta * 1e3:.1f} | {tm * 1e3:.1f} |")
            bar.update()
    bar.close()


if __name__ == "__main__":
    main()
