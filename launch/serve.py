"""OpenAI-compatible HTTP server for DeepSeek-V4 with RedKnot document reuse (issue #8).

    python launch/serve.py                                  # the shipped QA model, 127.0.0.1:8000
    python launch/serve.py --preset tiny --profile tiny-exact --port 8123  # tiny random weights
    python launch/serve.py --checkpoint DIR --artifact-store /data/docs --api-keys-file keys.txt

API keys: `--api-keys-file` (lines `KEY [TENANT]`) and/or $REDKNOT_API_KEYS (`KEY[:TENANT],...`);
none given: no auth, every caller is the anonymous tenant. See README "Serving".
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys

# a serving process owns its GPU (vLLM's --gpu-memory-utilization is 0.9): flash-scale weights,
# the document arena and the decode caches do not fit JAX's default 75 %; an explicit value wins
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def _warmup_documents(text: str):
    from redknot_jax.server.state import parse_warmup_documents

    try:
        return parse_warmup_documents(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _warmup_buckets(text: str):
    from redknot_jax.server.state import parse_warmup_buckets

    try:
        return parse_warmup_buckets(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/serve.py",  # README "Serving"
                     "python launch/serve.py --preset tiny --profile tiny-exact",
                     "python launch/serve.py --checkpoint DIR --artifact-store /data/docs --api-keys-file keys.txt")
    ap.add_argument("--checkpoint", type=_cli.checkpoint_dir,
                    help="safetensors dir with config.json (+ tokenizer.json, chat template, "
                         "redknot_profile.json); default: the shipped QA model (redknot_jax/assets/qa_model)")
    ap.add_argument("--preset", help="random-weight preset (e.g. tiny, with the byte-level fallback tokenizer) "
                                     "instead of a checkpoint")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--profile", default="auto", type=_cli.profile_arg, help="auto (the checkpoint's redknot_profile.json, else by layer "
                    "count) | tiny | tiny-exact | flash | pro | profile.json")
    ap.add_argument("--artifact-codec", choices=["dense", "fp8", "fp4"],
                    help="how artifacts are stored (docs/store.md, 'Artifact codecs'; default: the profile's)")
    ap.add_argument("--artifact-store", help="directory for document records (reloaded at start-up) and their artifacts "
                    "(per-tenant ArtifactStores under DIR/artifacts: published when built, read back verified)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-keys-file", type=_cli.input_file, help="lines `KEY [TENANT]`")
    ap.add_argument("--model-name")
    ap.add_argument("--slots", type=int, default=8, help="decode batch size (continuous batching)")
    ap.add_argument("--max-queue", type=int, default=64, help="waiting jobs before 429")
    ap.add_argument("--max-model-len", type=int, default=2048, help="prompt + documents + max_tokens")
    ap.add_argument("--max-tokens-limit", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=2048,
                    help="a worker step's tokens: the running sequences' decode rows, then prefill chunks of joining "
                         "ones while this lasts (at least one chunk a step; vLLM's max_num_batched_tokens)")
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="rows per chunk of the plain path's batch-1 prefill (rounded down to a power of two, "
                         "at most the cache): one compiled program, long prompts in few calls")
    ap.add_argument("--compile-threads", type=int, default=0,
                    help="threads that compile a call's distinct layer programs side by side before its first call "
                         "(plain prefill chunks and decode steps, each document-request arm): a shorter warm-up at "
                         "model scale; 0: each compiles when its layer is reached")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20)
    ap.add_argument("--shutdown-grace-s", type=float, default=10.0)
    ap.add_argument("--no-warmup", action="store_true",
                    help="no warm-up at all: /healthz answers 200 at once, the first requests compile")
    ap.add_argument("--warmup-buckets", type=_warmup_buckets, metavar="N[,N...]",
                    help="prompt lengths in tokens (e.g. 512,4096) whose plain-path programs (chunked prefill, a "
                         "decode step) the model worker compiles at start-up while the socket is open and /healthz "
                         "answers 503 'warming'; default: a prompt of two --prefill-chunk chunks, which covers every "
                         "plain prompt length. Document requests are warmed by --warmup-documents")
    ap.add_argument("--warmup-documents", type=_warmup_documents, metavar="DxT+P[,...]",
                    help="document requests compiled at start-up after the prompt lengths, e.g. 4x8192+32: 4 "
                         "documents of 8192 tokens and a 32-token prompt (seeded random documents, built, "
                         "admitted, then requested in the RedKnot arm alone and in each batch size, and in the "
                         "prefix arm; they count in the metrics like any request)")
    ap.add_argument("--kernels", default="auto",
                    help="Mosaic GPU kernels: auto (on a GPU those measured faster than XLA that the model's shapes "
                         "allow), xla (none), mosaic (all), or a comma list of indexer, restore, ragged_dot, "
                         "sparse_attention")
    ap.add_argument("--shape-buckets", type=int, default=8,
                    help="padded sizes per octave of RedKnot requests (rows, entries, decode capacities, pools): "
                         "requests of similar sizes share compiled programs, at most 1/N padding; 0 for exact sizes")
    ap.add_argument("--arena-rows", type=int, default=0,
                    help="document rows the device arena of hot documents holds (every document request reads it; "
                         "least recently used documents leave it for host memory); default 8 x --max-model-len")
    ap.add_argument("--arena-docs", type=int, default=64, help="documents the device arena holds at once")
    ap.add_argument("--prefix-docs", type=int, default=4,
                    help="first documents whose state of every layer the prefix arm (arm='prefix') keeps on the device, "
                         "least recently used evicted (a prefix cache); 0: each prefix request reads its artifact")
    ap.add_argument("--reuse-batch", type=int, default=4,
                    help="document requests waiting together that prefill in one batch (one jitted call per layer), "
                         "at most (and at most --slots: document requests in flight stay within it); 1: one at a time")
    ap.add_argument("--break-even", metavar="FILE", type=_cli.input_file,
                    help="a break-even table (launch/bench_break_even.py): a document request that names no arm "
                         "runs the one the table says reaches the first token sooner for its length and tier")
    ap.add_argument("--compilation-cache", default=os.path.expanduser("~/.cache/redknot_jax/xla"),
                    help="persistent XLA compilation cache ('' to disable): later starts skip most compiles")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    if args.no_warmup and (args.warmup_buckets or args.warmup_documents):
        ap.error(f"{'--warmup-buckets' if args.warmup_buckets else '--warmup-documents'} and --no-warmup: give one "
                 f"of them")

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import jax

    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import uvicorn

    from redknot_jax.server.app import create_app
    from redknot_jax.server.state import ServeConfig, build_state

    try:
        sc = ServeConfig(checkpoint=args.checkpoint, preset=args.preset, dtype=args.dtype, profile=args.profile,
                         artifact_store=args.artifact_store, host=args.host, port=args.port,
                         api_keys_file=args.api_keys_file, model_name=args.model_name, slots=args.slots,
                         max_queue=args.max_queue, max_model_len=args.max_model_len,
                         max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
                         prefill_chunk=args.prefill_chunk,
                         shutdown_grace_s=args.shutdown_grace_s, warmup=not args.no_warmup,
                         warmup_buckets=args.warmup_buckets, warmup_documents=args.warmup_documents or (),
                         kernels=args.kernels,
                         shape_buckets=args.shape_buckets, arena_rows=args.arena_rows, arena_docs=args.arena_docs,
                         prefix_docs=args.prefix_docs,
                         break_even=args.break_even, reuse_batch=args.reuse_batch,
                         max_batched_tokens=args.max_batched_tokens, artifact_codec=args.artifact_codec,
                         compile_threads=args.compile_threads)
    except ValueError as e:  # a flag's value the config refuses: named by its flag, as argparse names its own
        field, sep, rest = str(e).partition(":")
        ap.error(f"--{field.replace('_', '-')}:{rest}" if sep and field in ServeConfig.__dataclass_fields__ else str(e))
    state = build_state(sc)
    uvicorn.run(create_app(state), host=sc.host, port=sc.port, log_level=args.log_level,
                timeout_graceful_shutdown=int(sc.shutdown_grace_s) + 1)


if __name__ == "__main__":
    main()
