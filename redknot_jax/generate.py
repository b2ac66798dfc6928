"""Prefill, chunked prefill, decode and sampling over `Model.forward` (jitted, bucketed).

Prompts of different lengths share one batch by right padding with explicit positions: every
row keeps its absolute position, so sliding windows and compression windows stay aligned
(left padding would shift them). Chunk lengths are bucketed to powers of two (at least 16)
so a handful of shapes compile; the cache is donated to each step. A prefill chunk runs layer by
layer (`model.block_jit`: one compiled program per distinct layer structure, as the reuse
consumer's layers), a decode step as one program over every layer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.ahead import AheadCompiler
from redknot_jax.model import Model, block_jit, embed_jit, logits_jit, output_block, split, top_split
from redknot_jax.pallas import resolve_kernels


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_p in (0, 1] keeps the smallest nucleus reaching top_p."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: expected a finite value >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected >= 0, got {self.max_new_tokens}")


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def sample(logits: jax.Array, key, temperature: float, top_p: float) -> jax.Array:
    """Next tokens [b] from logits [b, vocab]: greedy, or temperature + nucleus sampling."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lg = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        srt = jnp.sort(lg, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
        # keep tokens whose preceding mass is < top_p (the first token is always kept)
        cutoff_idx = jnp.sum(cum - jax.nn.softmax(srt, axis=-1) < top_p, axis=-1) - 1
        cutoff = jnp.take_along_axis(srt, cutoff_idx[:, None], axis=-1)
        lg = jnp.where(lg < cutoff, -jnp.inf, lg)
    return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]
    prefill_s: float
    decode_s: float
    first_logits: np.ndarray


class Prefill:
    """A batch prefill in progress: each `step()` runs the next chunk of `chunk` rows (one
    chunk of the bucketed prompt length when None) and says whether it was the last. When done,
    `last` holds each prompt's last-row logits [b, vocab] and `cache` the batch's cache. A server
    runs other sequences' decode steps between two chunks (chunked prefill); `Engine.prefill`
    runs them back to back."""

    def __init__(self, engine: "Engine", prompts: Sequence[Sequence[int]], chunk: int | None = None, cache=None):
        self.eng = engine
        self.lens = lens = engine._check_prompts(prompts)
        b, tmax = len(prompts), int(lens.max())
        self.cache = engine.new_cache(b) if cache is None else cache
        self.width = bucket(tmax) if chunk is None else bucket(chunk)
        self.ids = np.zeros((b, -(-tmax // self.width) * self.width), np.int32)
        for i, p in enumerate(prompts):
            self.ids[i, : len(p)] = p
        self.start, self.last = 0, None

    @property
    def chunks_left(self) -> int:
        return (self.ids.shape[1] - self.start) // self.width

    def step(self) -> bool:
        """Run the next chunk; True once every chunk has run."""
        lens, start, w = self.lens, self.start, self.width
        n_new = np.clip(lens - start, 0, w)
        r = np.clip(lens - 1 - start, 0, w - 1)[:, None]
        # finished prompts sit at their own length with no new rows, so nothing is written
        pos0 = np.minimum(start, lens)
        logits, self.cache = self.eng.forward(self.ids[:, start:start + w], pos0, n_new, r, self.cache)
        here = ((lens - 1 >= start) & (lens - 1 < start + w))[:, None]
        self.last = logits[:, 0] if self.last is None else jnp.where(here, logits[:, 0], self.last)
        self.start += w
        return self.chunks_left == 0


class Engine:
    """Jitted batch prefill / decode for one model (the notebook-facing API)."""

    def __init__(self, model: Model, capacity: int = 4096, block: int = 256, kernels: str = "auto",
                 compile_threads: int = 0):
        """kernels: the Mosaic GPU kernels prefill chunks run (`redknot_jax.pallas.resolve_kernels`:
        "auto" = on a GPU those measured faster than XLA that the model allows, i.e. the indexer
        scores, the MoE's grouped matmul and the CSA layers' gathered-key attention; "xla"; or a
        comma list), resolved here into
        `self.kernels`. Decode steps (one row per sequence) run XLA: the kernels are measured on
        prefill shapes only. compile_threads: the first chunk of each shape submits its distinct
        layer programs to an `AheadCompiler` of that many threads, so they compile side by side
        instead of each when its layer is reached (0: in turn)."""
        cfg = model.cfg
        step = math.lcm(cfg.csa_rate, cfg.hca_rate)
        self.capacity = -(-capacity // step) * step
        self.block, self.model, self.cfg = block, model, cfg
        self.kernels = resolve_kernels(kernels, model)
        self.top_def, self.top_state = top_split(model)
        self.layer_defs = [split(blk) for blk in model.layers]
        self.ahead = AheadCompiler(compile_threads)

    def _chunk(self, ids, pos0, n_new, rows, cache, kernels: str):
        """`Model.forward` of a chunk, one jitted program per distinct layer structure
        (`model.block_jit`, the cache donated) instead of one unrolled over every layer: XLA
        compiles a few layer programs, so any chunk length, a decode step's one row included,
        compiles in about the time of one layer. rows: host ints; the last layer computes the
        outputs of their query block only (`model.output_block`)."""
        t = ids.shape[1]
        block = min(self.block, t)
        if t % block:
            raise ValueError(f"chunk length {t} must be a multiple of the query block {block}")
        x = embed_jit(self.top_state, ids, graphdef=self.top_def)
        layers, last = [], len(self.layer_defs) - 1
        row0, out = output_block(rows, t, block)

        def call(i, x):
            gd, st = self.layer_defs[i]
            return (st, x, ids, pos0, n_new, cache["layers"][i], row0 if i == last else 0), dict(
                graphdef=gd, freqs=self.model.freqs(i), block=block, kernels=kernels, rows=out if i == last else 0)

        if self.ahead.pool is not None and self.ahead.first(
                (ids.shape, kernels, out, tuple(a.shape for a in jax.tree.leaves(cache["layers"][0])))):
            # every layer's input; a placement only where the call's will be committed to one (AheadCompiler)
            spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
            for i in range(last + 1):
                self.ahead.submit(block_jit, *call(i, spec))
        for i in range(last + 1):
            x, c = self.ahead(block_jit, *call(i, x))
            layers.append(c)
        logits = logits_jit(self.top_state, x, jnp.asarray(rows - row0, jnp.int32), graphdef=self.top_def)
        return logits, {"length": pos0 + n_new, "layers": layers}

    def new_cache(self, batch: int):
        return self.model.init_cache(batch, self.capacity)

    def forward(self, ids, pos0, n_new, rows, cache):
        """One chunk (see `Model.forward`) layer by layer (`_chunk`): a prefill chunk (several
        rows) with the kernels, a decode step (one row) in XLA."""
        ids = jnp.asarray(ids, jnp.int32)
        return self._chunk(ids, jnp.asarray(pos0, jnp.int32), jnp.asarray(n_new, jnp.int32), np.asarray(rows, np.int32),
                           cache, self.kernels if ids.shape[1] > 1 else "")

    def _check_prompts(self, prompts: Sequence[Sequence[int]], extra: int = 0) -> np.ndarray:
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        lens = np.array([len(p) for p in prompts], np.int32)
        if lens.min() < 1:
            raise ValueError(f"prompt {int(lens.argmin())}: empty prompt")
        if lens.max() + extra > self.capacity:
            raise ValueError(f"prompt of {lens.max()} tokens (+{extra} to generate) exceeds the cache "
                             f"capacity {self.capacity}")
        for i, p in enumerate(prompts):
            bad = [t for t in p if not (0 <= int(t) < self.cfg.vocab_size)]
            if bad:
                raise ValueError(f"prompt {i}: token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")
        return lens

    def prefill(self, prompts: Sequence[Sequence[int]], chunk: int | None = None, cache=None, rows=None):
        """Prefill a batch; returns (logits of each prompt's last row [b, vocab], cache).

        `chunk` splits long prompts into chunks of that many rows (chunked prefill; equals
        one-shot prefill; `Prefill` runs the same chunks one call at a time). `rows` [b, r] asks
        for logits of other prompt rows instead (one-shot only): returns [b, r, vocab].
        """
        if rows is None:
            p = Prefill(self, prompts, chunk, cache)
            while not p.step():
                pass
            return p.last, p.cache
        if chunk is not None:
            raise ValueError("rows= is only supported for one-shot prefill")
        lens = self._check_prompts(prompts)
        b, tmax = len(prompts), int(lens.max())
        cache = self.new_cache(b) if cache is None else cache
        ids = np.zeros((b, bucket(tmax)), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        rows = np.asarray(rows, np.int32)
        if rows.min() < 0 or (rows >= lens[:, None]).any():
            raise ValueError(f"rows {rows.tolist()} outside the prompts (lengths {lens.tolist()})")
        return self.forward(ids, np.zeros(b), lens, rows, cache)

    def decode(self, tokens, cache, active=None):
        """One decode step: tokens [b] at each sequence's next position; inactive rows
        (finished) are not written. Returns (logits [b, vocab], cache)."""
        b = len(tokens)
        n_new = np.ones(b, np.int32) if active is None else np.asarray(active, np.int32)
        ids = np.asarray(tokens, np.int32).reshape(b, 1)
        logits, cache = self.forward(ids, cache["length"], n_new, np.zeros((b, 1)), cache)
        return logits[:, 0], cache

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
                 chunk: int | None = None) -> Generation:
        """Prefill then decode until max_new_tokens or a stop token, per sequence."""
        lens = self._check_prompts(prompts, params.max_new_tokens)
        key = jax.random.key(params.seed)
        t0 = time.perf_counter()
        logits, cache = self.prefill(prompts, chunk=chunk)
        first = np.asarray(logits)
        t1 = time.perf_counter()
        b = len(lens)
        out: list[list[int]] = [[] for _ in range(b)]
        active = np.ones(b, bool)
        stop = set(params.stop_tokens)
        for step in range(params.max_new_tokens):
            key, sub = jax.random.split(key)
            tok = np.asarray(sample(logits, sub, params.temperature, params.top_p))
            for i in range(b):
                if active[i]:
                    out[i].append(int(tok[i]))
                    if int(tok[i]) in stop:
                        active[i] = False
            if not active.any() or step == params.max_new_tokens - 1:
                break
            logits, cache = self.decode(tok, cache, active)
        jax.block_until_ready(logits)
        return Generation(out, t1 - t0, time.perf_counter() - t1, first)
