"""Batch prefill + greedy generation on a model, printing tokens and timings.

With no flags it runs the embedded default: the tiny random-weight DeepSeek-V4 (`tiny`
preset, seed 0), so it works on a fresh machine with no checkpoint.

    python launch/generate.py                         # embedded tiny model
    python launch/generate.py --checkpoint DIR        # safetensors dir (hub or transformers)
    python launch/generate.py --preset tiny-csa --max-new-tokens 32 --chunk 64
"""

from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.generate import Engine, SamplingParams
from redknot_jax.init import random_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/generate.py")  # README "Main job"
    ap.add_argument("--checkpoint", type=_cli.checkpoint_dir,
                    help="safetensors directory with config.json (default: embedded tiny model)")
    ap.add_argument("--preset", default="tiny", help=f"random-weight preset when no checkpoint: {sorted(config.PRESETS)}")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=96, help="longest prompt; others are shorter")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=None, help="chunked prefill of this many rows")
    args = ap.parse_args(argv)

    dtype = jnp.dtype(args.dtype)
    t0 = time.perf_counter()
    if args.checkpoint:
        model = _cli.load_model(args.checkpoint, dtype)
        cfg = model.cfg
    else:
        cfg = config.preset(args.preset)
        model = random_model(cfg, seed=0, dtype=dtype)
    print(f"model: {args.checkpoint or args.preset} ({cfg.num_layers} layers, {cfg.hidden_size} hidden) "
          f"on {jax.devices()[0].platform}, loaded in {time.perf_counter() - t0:.2f}s")

    rng = np.random.default_rng(0)
    lens = [max(1, args.prompt_len - 17 * i) for i in range(args.batch)]
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in lens]
    eng = Engine(model, capacity=args.prompt_len + args.max_new_tokens + 16)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop_tokens=(cfg.eos_token_id,))
    eng.generate(prompts, params, chunk=args.chunk)  # compile (warm-up)
    gen = eng.generate(prompts, params, chunk=args.chunk)
    for i, toks in enumerate(gen.tokens):
        print(f"prompt {i} ({lens[i]} tokens) -> {toks}")
    n_new = sum(len(t) for t in gen.tokens)
    print(f"prefill {sum(lens)} tokens in {gen.prefill_s * 1e3:.1f} ms; decode {n_new} tokens in "
          f"{gen.decode_s * 1e3:.1f} ms ({n_new / max(gen.decode_s, 1e-9):.1f} tok/s)")


if __name__ == "__main__":
    main()
