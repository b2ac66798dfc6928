"""A request whose documents come from the artifact store (DESIGN §5): looked up by content,
certified, and any store problem turned into a counted fallback of the whole request. The
store knows artifacts; this is where the runtime meets it."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.runtime import ReuseFallback


def prefill_from_store(store, runtime, documents: Sequence, tail=None, *, arm: str = "redknot",
                       require_reuse: bool = False, query_rows: tuple[int, ...] = ()):
    """`runtime.prefill` of [documents..., tail] with each document's artifact from `store`
    (an `ArtifactStore`).

    Documents are found by content (`document_id` of tokens, the runtime's profile, model
    config and checkpoint fingerprint) for the runtime's TP geometry and minimum generation.
    In the RedKnot arm, if any document has no artifact that verifies, the request runs the
    Recomputed arm and the first failing document's reason is counted once in
    `runtime.counters` (as `ReuseRuntime.certify` failures are); `require_reuse` raises
    `ReuseFallback` instead. Artifacts that are found are certified again by the runtime.
    """
    docs = [np.asarray(d, np.int32) for d in documents]
    extra = [Segment(np.asarray(tail, np.int32))] if tail is not None and len(tail) else []
    plain = Request([Segment(d) for d in docs] + extra, query_rows=query_rows)
    if arm != "redknot":
        return runtime.prefill(plain, arm)
    segs = []
    for i, d in enumerate(docs):
        r = store.lookup(d, runtime.profile, runtime.cfg, runtime.fingerprint, tp=runtime.tp,
                         min_generation=runtime.min_generation)
        if r.reason is not None:
            runtime.counters.record_fallback(r.reason)
            detail = f"document {i} ({r.doc_id}): {r.detail}"
            if require_reuse:
                raise ReuseFallback(f"RedKnot arm fell back to recomputation: {r.reason.value}: {detail}")
            res = runtime.prefill(plain, "recompute")
            return dataclasses.replace(res, fallback=r.reason, fallback_detail=detail)
        segs.append(Segment(d, r.artifact))
    return runtime.prefill(Request(segs + extra, query_rows=query_rows), "redknot", require_reuse=require_reuse)
