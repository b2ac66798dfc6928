"""ServeConfig (frozen) and the server state built from it: model, engine, reuse runtime,
tokenizer, document registry, scheduler, metrics, API keys."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time

import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.generate import Engine
from redknot_jax.quality import SHIPPED_MODEL
from redknot_jax.quality.model_config import PROFILE_FILE
from redknot_jax.reuse import profile as profiles
from redknot_jax.reuse.break_even import BreakEven, BreakEvenError
from redknot_jax.reuse.certificate import CODECS
from redknot_jax.reuse.pool import Buckets
from redknot_jax.reuse.runtime import ReuseRuntime
from redknot_jax.server.documents import DocumentRegistry
from redknot_jax.server.metrics import Metrics
from redknot_jax.server.scheduler import Scheduler
from redknot_jax.server.tokenizer import load_chat_template, load_tokenizer

log = logging.getLogger("redknot.server")




@dataclasses.dataclass(frozen=True)
class ServeConfig:
    checkpoint: str | None = None  # safetensors dir with config.json (None and no preset: the shipped QA model)
    preset: str | None = None  # random-weight preset (e.g. "tiny") instead of a checkpoint
    dtype: str = "float32"
    profile: str = "auto"  # auto | tiny | tiny-exact | flash | pro | path/to/profile.json
    artifact_codec: str | None = None  # dense | fp8 | fp4: the artifacts' codec (None: the profile's own)
    artifact_store: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys_file: str | None = None
    api_keys_env: str = "REDKNOT_API_KEYS"
    model_name: str | None = None
    slots: int = 8  # decode batch size (continuous batching)
    max_queue: int = 64
    max_model_len: int = 2048  # prompt (documents included) + max_tokens
    prefill_chunk: int = 2048  # plain-path prefill chunk (rounded down to a power of two within the cache)
    max_batched_tokens: int = 2048  # a worker step's tokens: decode rows + prefill chunk rows (vLLM's name)
    max_tokens_limit: int = 256
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 10.0
    warmup: bool = True  # False (--no-warmup): no warm-up at all, ready at once
    # prompt lengths (tokens) the model worker warms before serving (--warmup-buckets); None: the
    # default (Scheduler.default_warmup: a prompt one row longer than a prefill chunk, so two
    # chunks: every plain-path program)
    warmup_buckets: tuple[int, ...] | None = None
    # document requests warmed after them (--warmup-documents): (documents, tokens each, prompt tokens)
    warmup_documents: tuple[tuple[int, int, int], ...] = ()
    kernels: str = "auto"  # Mosaic GPU kernels (redknot_jax.pallas.resolve_kernels): auto | xla | mosaic | a list
    shape_buckets: int = 8  # RedKnot requests' padded sizes per octave (reuse.pool.Buckets; 0: exact)
    arena_rows: int = 0  # the device arena's document rows (reuse.arena.DocArena; 0: 8 x max_model_len)
    arena_docs: int = 64  # documents the arena holds at once
    prefix_docs: int = 4  # the exact prefix's device cache, both arms (reuse.prefix.PrefixCache): documents; 0: none
    break_even: str | None = None  # a break-even table (reuse.break_even): "auto" requests run the faster arm
    reuse_batch: int = 4  # document requests waiting together that prefill in one batch, at most
    compile_threads: int = 0  # threads compiling a call's distinct layer programs side by side (0: in turn)

    def __post_init__(self):
        if self.profile not in profiles.NAMES and not os.path.isfile(self.profile):
            raise ValueError(f"profile: expected {', '.join(profiles.NAMES)} or a JSON file, got {self.profile!r} "
                             f"(no such file)")
        if self.artifact_codec is not None and self.artifact_codec not in CODECS:
            raise ValueError(f"artifact_codec: expected one of {', '.join(CODECS)}, got {self.artifact_codec!r}")
        if self.break_even is not None:
            try:
                BreakEven.read(self.break_even)
            except BreakEvenError as e:
                raise ValueError(f"break_even: {e}") from None
        if not isinstance(self.prefix_docs, int) or self.prefix_docs < 0:
            raise ValueError(f"prefix_docs: expected an int >= 0 (0: no prefix cache), got {self.prefix_docs!r}")
        if not isinstance(self.compile_threads, int) or self.compile_threads < 0:
            raise ValueError(f"compile_threads: expected an int >= 0 (0: compile in turn), "
                             f"got {self.compile_threads!r}")
        if not isinstance(self.arena_rows, int) or self.arena_rows < 0:
            raise ValueError(f"arena_rows: expected an int >= 0 (0: 8 x max_model_len), got {self.arena_rows!r}")
        for f in ("slots", "max_queue", "max_model_len", "max_tokens_limit", "max_body_bytes", "prefill_chunk",
                  "max_batched_tokens", "arena_docs", "reuse_batch"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if self.checkpoint and self.preset:
            raise ValueError(f"checkpoint {self.checkpoint!r} and preset {self.preset!r}: give one of them")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: expected float32 or bfloat16, got {self.dtype!r}")
        if self.warmup_buckets is not None:
            if not isinstance(self.warmup_buckets, tuple) or not self.warmup_buckets:
                raise ValueError(f"warmup_buckets: expected a non-empty tuple of prompt lengths, got "
                                 f"{self.warmup_buckets!r}")
            if not self.warmup:
                raise ValueError(f"warmup_buckets {list(self.warmup_buckets)} given with warmup=False (--no-warmup): "
                                 f"give one of them")
            for n in self.warmup_buckets:
                if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < self.max_model_len:
                    raise ValueError(f"warmup_buckets: prompt length {n!r} outside [1, {self.max_model_len - 1}] "
                                     f"(a prompt leaves room for one generated token within max_model_len "
                                     f"{self.max_model_len})")
        if self.warmup_documents and not self.warmup:
            raise ValueError("warmup_documents given with warmup=False (--no-warmup): give one of them")
        for spec in self.warmup_documents:
            ok = isinstance(spec, tuple) and len(spec) == 3 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in spec)
            if not ok or spec[0] * spec[1] + spec[2] + 2 > self.max_model_len:
                raise ValueError(f"warmup_documents: {spec!r}: expected (documents, tokens each, prompt tokens), "
                                 f"positive, whose request and 2 generated tokens fit max_model_len "
                                 f"{self.max_model_len}")
        try:
            Buckets(self.shape_buckets)
        except ValueError as e:
            raise ValueError(f"shape_buckets: {e}") from None


def parse_warmup_buckets(text: str) -> tuple[int, ...]:
    """`--warmup-buckets 512,4096`: comma-separated positive prompt lengths in tokens (sorted,
    duplicates dropped); anything else is a ValueError naming the bad item."""
    items = [x.strip() for x in text.split(",")]
    out = set()
    for x in items:
        if not re.fullmatch(r"[0-9]+", x) or int(x) < 1:  # no sign, no blank, no "1e3"
            raise ValueError(f"warmup buckets {text!r}: expected comma-separated positive integers (prompt lengths "
                             f"in tokens, e.g. 512,4096), got {x!r}")
        out.add(int(x))
    return tuple(sorted(out))


def parse_warmup_documents(text: str) -> tuple[tuple[int, int, int], ...]:
    """`--warmup-documents 4x8192+32,1x2048+16`: document requests to warm, each DOCSxTOKENS+PROMPT
    (documents, tokens each, prompt tokens); anything else is a ValueError naming the bad item."""
    out = []
    for x in (x.strip() for x in text.split(",")):
        m = re.fullmatch(r"([0-9]+)x([0-9]+)\+([0-9]+)", x)
        if not m or min(int(g) for g in m.groups()) < 1:
            raise ValueError(f"warmup documents {text!r}: expected comma-separated DOCSxTOKENS+PROMPT (e.g. "
                             f"4x8192+32: 4 documents of 8192 tokens and a 32-token prompt), got {x!r}")
        out.append(tuple(int(g) for g in m.groups()))
    return tuple(out)


def model_source(sc: ServeConfig) -> tuple[str | None, str | None]:
    """(checkpoint directory, random preset): what the flags say, else the shipped QA model
    (`redknot_jax/assets/qa_model`), else (a package installed without it) the tiny preset."""
    if sc.checkpoint or sc.preset:
        return sc.checkpoint, sc.preset
    if (SHIPPED_MODEL / "config.json").is_file():
        return str(SHIPPED_MODEL), None
    log.warning("no shipped model under %s: serving the tiny random-weight preset", SHIPPED_MODEL)
    return None, "tiny"


@dataclasses.dataclass
class ServerState:
    cfg: ServeConfig
    model_name: str
    vocab_size: int
    eos_id: int
    capacity: int
    tokenizer: object
    chat_template: str | None  # the checkpoint's Jinja chat template, if any
    registry: DocumentRegistry
    scheduler: Scheduler
    metrics: Metrics
    runtime: ReuseRuntime
    keys: dict
    created: int


def build_state(sc: ServeConfig) -> ServerState:
    from redknot_jax.server.app import load_api_keys

    t0 = time.perf_counter()
    dtype = jnp.dtype(sc.dtype)
    ckpt, preset = model_source(sc)
    # the profile and the break-even table first: a mismatch is refused before the weights load
    cfg = config.ModelConfig.from_json(os.path.join(ckpt, "config.json")) if ckpt else config.preset(preset)
    prof = profiles.named(sc.profile, cfg.num_layers, os.path.join(ckpt, PROFILE_FILE) if ckpt else None)
    if sc.artifact_codec is not None:
        prof = dataclasses.replace(prof, artifact_codec=sc.artifact_codec)
    break_even = None
    if sc.break_even:
        try:
            break_even = BreakEven.read(sc.break_even)
            break_even.check_profile(prof)
        except BreakEvenError as e:
            raise ValueError(f"break_even: {e}") from None
    if ckpt:
        from checkpoints_convert.safetensors_io import ShardedCheckpoint
        from redknot_jax.model import Model
        from redknot_jax.weights import load_checkpoint

        model = Model(cfg, dtype)
        load_checkpoint(model, cfg, ckpt)
        files = ShardedCheckpoint(ckpt).fingerprint("size_mtime")
        fp = "ckpt:" + hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        name = sc.model_name or os.path.basename(os.path.normpath(ckpt))
    else:
        from redknot_jax.init import random_model

        model = random_model(cfg, seed=0, dtype=dtype)
        fp = f"embedded-random:{preset}:seed0:{sc.dtype}:{cfg.fingerprint()}"
        name = sc.model_name or f"redknot-{preset}-random"
    rt = ReuseRuntime(model, prof, fp, kernels=sc.kernels, buckets=sc.shape_buckets, prefix_cache=sc.prefix_docs,
                      compile_threads=sc.compile_threads)
    eng = Engine(model, capacity=sc.max_model_len, kernels=sc.kernels, compile_threads=sc.compile_threads)
    metrics = Metrics(rt.counters)
    # artifacts persist in per-tenant artifact stores under the registry's directory
    store_root = os.path.join(sc.artifact_store, "artifacts") if sc.artifact_store else None
    sched = Scheduler(eng, rt, metrics, slots=sc.slots, max_queue=sc.max_queue, checkpoint_fingerprint=fp,
                      prefill_chunk=sc.prefill_chunk, store_root=store_root,
                      warmup=(sc.warmup_buckets or "auto") if sc.warmup else None,
                      warmup_documents=sc.warmup_documents, max_new_tokens=sc.max_tokens_limit,
                      arena_rows=sc.arena_rows or 8 * sc.max_model_len, arena_docs=sc.arena_docs,
                      break_even=break_even, reuse_batch=sc.reuse_batch,
                      max_batched_tokens=sc.max_batched_tokens)
    keys = load_api_keys(sc.api_keys_file, os.environ.get(sc.api_keys_env))
    log.info("model %s (%d layers), profile %s, kernels %r, %d API keys, loaded in %.1fs; warm-up: %s (on the model "
             "worker once the server listens)", name, cfg.num_layers, prof.name, rt.consumer.kernels or "none (XLA)",
             len(keys), time.perf_counter() - t0,
             f"prompt lengths {list(sched.warmup_lengths)}" if sched.warmup_lengths else "none")
    return ServerState(cfg=sc, model_name=name, vocab_size=cfg.vocab_size, eos_id=cfg.eos_token_id,
                       capacity=sc.max_model_len, tokenizer=load_tokenizer(ckpt, cfg.vocab_size),
                       chat_template=load_chat_template(ckpt),
                       registry=DocumentRegistry(sc.artifact_store), scheduler=sched, metrics=metrics, runtime=rt,
                       keys=keys, created=int(time.time()))
