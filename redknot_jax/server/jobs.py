"""A job of the model worker (`scheduler.Scheduler`): what the HTTP side enqueues and the events
it reads back, and how each generated token is sampled on the host."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np


@dataclasses.dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """kind: "plain" (tokens), "reuse" (segments: [(tokens, Document)] + prompt tokens), "build" (doc)."""

    kind: str
    loop: asyncio.AbstractEventLoop
    tokens: list[int] | None = None
    docs: list | None = None
    doc: object = None
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    arm: str = "engine"
    stop_ids: frozenset = frozenset()
    out: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    t_submit: float = dataclasses.field(default_factory=time.perf_counter)
    by_stop: bool = False  # cancelled because a stop string matched, not because the client left
    ttft_s: float | None = None  # from submission to its first token's emission (queue wait included)

    def emit(self, *ev) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


def sample_host(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """Greedy (temperature 0) or temperature + nucleus (top_p) sampling of one row."""
    if s.temperature == 0.0:
        return int(np.argmax(logits))
    lg = logits.astype(np.float64) / s.temperature
    p = np.exp(lg - lg.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        ps = p[order]
        keep = (np.cumsum(ps) - ps) < s.top_p  # preceding mass below top_p; the top token always kept
        q = np.zeros_like(p)
        q[order[keep]] = ps[keep]
        p = q / q.sum()
    return int(rng.choice(p.shape[0], p=p))
