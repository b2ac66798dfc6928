"""Planner (DESIGN §4): segments -> offsets, frames, row classes and the protected set.

A request is segments laid out contiguously: documents (with an artifact, built alone at 0)
and new rows (no artifact). Each document starts a **frame**: a coordinate system with offset
D in which the document's canonical latents are used as stored; new rows that follow a
document continue its frame (their latents and compressor windows are computed online in that
frame, continuing the artifact's open-window state), so a prefix document at offset 0 plus new
rows is exactly the native computation. Queries reach a frame's keys rotated by -D.

Row classes (bool [T] each): Q query rows, N new rows, D dirty rows, B boundary rows (first /
last `boundary_rows` of every relocated document), T tail rows, I budget rows (set later
by `fill_itop`, filling the budget: ranked by the native indexer's scores for the query rows, ties
within a compressed window by the artifacts' per-row statistic `far` (`row_risk`); or, with the
profile's `itop_rank="deviation"`, by `latent_deviation`).
Candidate rows are the relocated documents' rows; protected = union of the classes.

**The exact prefix** (`Plan.prefix`): a first document at offset 0 whose artifact holds every
layer's native state (`certificate.can_prefix`), with no dirty row and every query row after it,
is the request's state in every layer already, so its rows are computed in no layer: they are
no candidates and in no class. Any other first document is relocated at offset 0 like the rest.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from redknot_jax.reuse.artifact import Artifact
from redknot_jax.reuse.certificate import can_prefix
from redknot_jax.reuse.profile import RedKnotProfile


class RequestError(ValueError):
    """A request that cannot be planned: names the segment and what is wrong."""


@dataclasses.dataclass
class Segment:
    """Tokens of one segment; `artifact` for a document, None for new rows. `dirty` lists
    document rows (segment-local) whose artifact state the caller marks as changed."""

    tokens: np.ndarray
    artifact: Artifact | None = None
    dirty: tuple[int, ...] = ()


@dataclasses.dataclass
class Request:
    segments: list[Segment]
    query_rows: tuple[int, ...] = ()  # request rows whose logits are wanted; default: the last

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([np.asarray(s.tokens, np.int32) for s in self.segments])


@dataclasses.dataclass(frozen=True)
class Frame:
    offset: int  # D: absolute position of the frame's canonical position 0
    start: int  # request rows [start, end)
    end: int
    doc_len: int  # leading rows backed by the artifact (0: an online-only frame)
    artifact: Artifact | None

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class Plan:
    n_rows: int
    frames: list[Frame]
    frame_of_row: np.ndarray  # [T] frame index
    doc_row: np.ndarray  # [T] row is backed by an artifact (a candidate row)
    classes: dict[str, np.ndarray]
    query_rows: np.ndarray
    budget: float = 0.0
    concentration: float = float("nan")
    deviation: np.ndarray | None = None  # [T] `latent_deviation` when the profile ranks by it
    prefix: int = 0  # rows of the exact prefix (computed in no layer); 0: none

    @property
    def protected(self) -> np.ndarray:
        out = np.zeros(self.n_rows, bool)
        for v in self.classes.values():
            out |= v
        return out

    @property
    def candidates(self) -> int:
        return int(self.doc_row.sum())

    def extend(self, n_new: int) -> "Plan":
        """This plan with n_new generated rows appended to the last frame as protected new
        query rows (decoding: the prompt rows keep their classes)."""
        t = self.n_rows + n_new
        frames = list(self.frames)
        frames[-1] = dataclasses.replace(frames[-1], end=frames[-1].end + n_new)
        classes = {k: np.r_[v, np.zeros(n_new, bool)] for k, v in self.classes.items()}
        classes["N"][self.n_rows:] = True
        classes["Q"][:] = False
        classes["Q"][t - 1] = True
        return dataclasses.replace(self, n_rows=t, frames=frames, classes=classes,
                                   frame_of_row=np.r_[self.frame_of_row, np.full(n_new, len(frames) - 1)],
                                   doc_row=np.r_[self.doc_row, np.zeros(n_new, bool)], query_rows=np.array([t - 1]))

    @property
    def candidate_frames(self) -> list[Frame]:
        """Frames whose document rows are candidates: every frame backed by an artifact but the
        exact prefix's."""
        return [f for k, f in enumerate(self.frames) if f.artifact is not None and f.doc_len
                and not (k == 0 and self.prefix)]

    def fraction_protected(self) -> float:
        """Protected share of the candidate rows (what the tail and budget yield)."""
        return float((self.protected & self.doc_row).sum() / max(1, self.candidates))


def exact_prefix(req: Request) -> int:
    """Rows of the request's exact prefix (module doc), or 0 when its first segment cannot be
    one: no document, an artifact without every layer's native state (a format-3 artifact
    relocates), dirty rows, no row after it, or a query row inside it."""
    first = req.segments[0]
    if first.artifact is None or first.dirty or not can_prefix(first.artifact.certificate):
        return 0
    L = first.artifact.length
    n = sum(len(s.tokens) for s in req.segments)
    if n <= L or any(int(r) < L for r in req.query_rows or (n - 1,)):
        return 0
    return L


def plan_request(req: Request, profile: RedKnotProfile) -> Plan:
    """Offsets, frames and every row class except I (which needs the model's indexer); the
    first document is the exact prefix where it can be one (`exact_prefix`)."""
    if not req.segments:
        raise RequestError("request: no segments")
    toks = [np.asarray(seg.tokens) for seg in req.segments]
    for si, tk in enumerate(toks):
        if tk.ndim != 1 or tk.shape[0] == 0:
            raise RequestError(f"segment {si}: expected a non-empty 1-D token list, got shape {tk.shape}")
    t = sum(int(tk.shape[0]) for tk in toks)
    frames, fr, doc = [], np.zeros(t, np.int64), np.zeros(t, bool)
    cl = {k: np.zeros(t, bool) for k in ("Q", "N", "D", "B", "T", "I")}
    pos = 0
    for si, (seg, tk) in enumerate(zip(req.segments, toks)):
        n, art = int(tk.shape[0]), seg.artifact
        bad = [r for r in seg.dirty if not 0 <= r < n]
        if bad:
            raise RequestError(f"segment {si}: dirty rows {bad} outside [0, {n})")
        if art is not None:
            if art.length != n:
                raise RequestError(f"segment {si}: artifact covers {art.length} tokens, segment has {n}")
            frames.append(Frame(offset=pos, start=pos, end=pos + n, doc_len=n, artifact=art))
        elif frames:  # new rows continue the current frame
            frames[-1] = dataclasses.replace(frames[-1], end=frames[-1].end + n)
        else:
            frames.append(Frame(offset=pos, start=pos, end=pos + n, doc_len=0, artifact=None))
        fr[pos:pos + n] = len(frames) - 1
        doc[pos:pos + n] = art is not None
        cl["N"][pos:pos + n] = art is None
        cl["D"][pos + np.asarray(seg.dirty, np.int64)] = True
        if art is not None and pos > 0:  # relocated: windows cross the boundary
            br = min(profile.boundary_rows, n)
            cl["B"][pos:pos + br] = cl["B"][pos + n - br:pos + n] = True
        pos += n
    q = np.asarray(req.query_rows or (t - 1,), np.int64)
    if q.min() < 0 or q.max() >= t:
        raise RequestError(f"query_rows {q.tolist()} outside the request's {t} rows")
    cl["Q"][q] = True
    cl["T"][t - min(profile.tail_rows, t):] = True
    L = exact_prefix(req)
    doc[:L] = False
    for v in cl.values():
        v[:L] = False
    return Plan(n_rows=t, frames=frames, frame_of_row=fr, doc_row=doc, classes=cl, query_rows=q,
                prefix=L)


def online_frames(plan: Plan, t: int) -> list[Frame]:
    """The request as one frame at offset 0 over t rows: the exact prefix's artifact (if any),
    then every row online (`latent_refresh="protected"` with every candidate row protected:
    the native computation)."""
    return [dataclasses.replace(plan.frames[0], offset=0, start=0, end=t, doc_len=plan.prefix,
                                artifact=plan.frames[0].artifact if plan.prefix else None)]


def concentration(scores: np.ndarray, k: int) -> float:
    """The controller's statistic: the softmax mass of the k best entries among the finite
    scores (1.0 when there are none), in float64 and clipped to [0, 1] so that rounding cannot
    push a share of 1 above it."""
    flat = np.asarray(scores, np.float64).ravel()
    flat = flat[np.isfinite(flat)]
    if not flat.size:
        return 1.0
    p = np.exp(flat - flat.max())
    p /= p.sum()
    return float(np.clip(np.sort(p)[::-1][:k].sum(), 0.0, 1.0))


def row_risk(plan: Plan, layers) -> np.ndarray:
    """[T] per-row controller statistic: for rows backed by an artifact, the mean over `layers`
    (the reusable ones) of the artifact's `far` (the Local heads' attention share beyond the
    sliding window, measured when the document was built alone); 0 for other rows."""
    risk = np.zeros(plan.n_rows)
    for f in plan.frames:
        if f.artifact is not None and f.doc_len:
            risk[f.start:f.start + f.doc_len] = f.artifact.far_mean(layers)
    return risk


DEVIATION_FLOOR = 0.02  # relative; a bf16 latent recomputed from equal inputs differs by ~0.3 %


def latent_deviation(online, canonical):
    """[t] per row: ||online - canonical|| / ||canonical|| (fp32), how far a row's canonical
    latent (its document built alone) is from the latent this request's hidden states give at
    the same canonical position: CacheBlend's KV deviation."""
    a, b = jnp.asarray(online, jnp.float32), jnp.asarray(canonical, jnp.float32)
    return jnp.linalg.norm(a - b, axis=-1) / jnp.maximum(jnp.linalg.norm(b, axis=-1), 1e-30)


def fill_itop(plan: Plan, row_scores: np.ndarray, budget: float, risk: np.ndarray | None = None,
              deviation: np.ndarray | None = None) -> None:
    """Protect the best-ranked candidate rows until the protected candidates reach the budget.

    row_scores [T]: the native indexer's score of each row's entry for the query rows (higher
    first). Rows of one compressed window share their entry's score; among them the rows with
    the larger `risk` ([T], `row_risk`: reliance on context beyond the window, which relocation
    changes) go first, then the earlier row. `deviation` ([T], `latent_deviation`; the profile's
    `itop_rank="deviation"`) ranks before all of these: rows whose latent moved by more than
    DEVIATION_FLOOR first, largest first; rows below it (unmoved up to rounding, e.g. rows whose
    fence layers saw only their own document) in the indexer's order."""
    plan.budget = budget
    plan.deviation = None if deviation is None else np.asarray(deviation, np.float64)
    want = int(np.ceil(budget * plan.candidates))
    have = plan.protected & plan.doc_row
    free = np.flatnonzero(plan.doc_row & ~have)
    extra = max(0, want - int(have.sum()))
    r = np.zeros(plan.n_rows) if risk is None else np.asarray(risk, np.float64)
    moved = np.zeros(plan.n_rows) if deviation is None else np.where(deviation > DEVIATION_FLOOR, deviation, 0.0)
    s = np.asarray(row_scores, np.float64)[free]
    if deviation is None and 0 < extra < free.size:  # only rows scored at least the extra-th best can be taken
        keep = s >= np.partition(s, free.size - extra)[free.size - extra]
        free, s = free[keep], s[keep]
    order = free[np.lexsort((-r[free], -s, -moved[free]))][:extra]  # stable: ties in row order (free ascends)
    plan.classes["I"][order] = True
