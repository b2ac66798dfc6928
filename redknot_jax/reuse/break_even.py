"""The break-even table (issue #47): measured TTFT of both arms by where a request's documents
are (the tier) and how long the request is, and the arm it says to run.

Tiers, fastest first: "device" (resident in the device arena), "host" (artifacts in host memory,
written into the arena for the request), "disk" (only in the artifact store: a verified read,
then the arena). A request's tier is its slowest document's. Between measured lengths both
arms' times are interpolated linearly; beyond them they scale in proportion to the length from
the nearest point. The Recomputed arm does not depend on the tier, but each tier's points carry
it, measured in the same run.

The table is data (`launch/bench_break_even.py` writes it, with the device, date, command and
the RedKnot profile it measured); the server reads it with `--break-even FILE`, refuses a table
of another profile than the one it serves (`check_profile`: another budget or tail is another
RedKnot time), and then runs, for a request that does not name its arm, the one the table says
is faster (`choose`), saying why in the response and the metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math

TIERS = ("device", "host", "disk")
SOURCE = {"device": "where the points were measured", "date": "when the points were measured",
          "command": "how the points were measured", "profile": "the RedKnot profile measured (its name)",
          "profile_digest": "the RedKnot profile measured (RedKnotProfile.digest)"}


class BreakEvenError(ValueError):
    """A table that is malformed (the message names the field and the point)."""


@dataclasses.dataclass(frozen=True)
class Choice:
    arm: str  # "redknot" | "recompute"
    tier: str
    tokens: int
    recompute_s: float
    redknot_s: float

    def to_dict(self) -> dict:
        return {"arm": self.arm, "tier": self.tier, "tokens": self.tokens,
                "estimate_s": {"recompute": round(self.recompute_s, 6), "redknot": round(self.redknot_s, 6)},
                "table": "break-even"}


@dataclasses.dataclass(frozen=True)
class BreakEven:
    """points: {tier: ((tokens, recompute_s, redknot_s), ...)} sorted by tokens; `source`: the
    device, date and command that measured them, and the RedKnot profile (its name and digest)."""

    points: dict
    source: dict

    @classmethod
    def from_dict(cls, d) -> "BreakEven":
        if not isinstance(d, dict) or not isinstance(d.get("points"), list) or not d["points"]:
            raise BreakEvenError("break-even table: expected {'device', 'date', 'command', 'points': [...]} "
                                 "with at least one point")
        for f in SOURCE:
            if not isinstance(d.get(f), str) or not d[f]:
                raise BreakEvenError(f"break-even table: '{f}' must say {SOURCE[f]}, got {d.get(f)!r}")
        pts: dict[str, list] = {}
        for i, p in enumerate(d["points"]):
            if not isinstance(p, dict) or p.get("tier") not in TIERS:
                raise BreakEvenError(f"break-even table: points[{i}].tier: expected one of {TIERS}, got "
                                     f"{p.get('tier') if isinstance(p, dict) else p!r}")
            n = p.get("tokens")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise BreakEvenError(f"break-even table: points[{i}].tokens: expected an int >= 1, got {n!r}")
            for f in ("recompute_s", "redknot_s"):
                v = p.get(f)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise BreakEvenError(f"break-even table: points[{i}].{f}: expected seconds > 0, got {v!r}")
            pts.setdefault(p["tier"], []).append((n, float(p["recompute_s"]), float(p["redknot_s"])))
        for tier, ps in pts.items():
            ns = [n for n, _, _ in ps]
            if len(set(ns)) != len(ns):
                raise BreakEvenError(f"break-even table: tier {tier!r} has two points at one length ({sorted(ns)})")
        return cls({t: tuple(sorted(ps)) for t, ps in pts.items()}, {f: d[f] for f in SOURCE})

    def check_profile(self, profile) -> None:
        """Refuses (BreakEvenError) a table measured with another RedKnot profile than `profile`
        (a reuse.profile.RedKnotProfile): its RedKnot times would be another profile's."""
        if self.source["profile_digest"] != profile.digest():
            raise BreakEvenError(
                f"break-even table: measured with RedKnot profile {self.source['profile']!r} (digest "
                f"{self.source['profile_digest'][:12]}), but the server serves {profile.name!r} (digest "
                f"{profile.digest()[:12]}); measure the served one (launch/bench_break_even.py --profile, as "
                f"serve.py's)")

    @classmethod
    def read(cls, path) -> "BreakEven":
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise BreakEvenError(f"break-even table {path}: {e}") from None
        return cls.from_dict(d)

    def estimate(self, tier: str, tokens: int) -> tuple[float, float]:
        """(Recomputed, RedKnot) TTFT in seconds for a request of `tokens` rows at `tier` (a tier
        without points: the next slower tier measured, else the fastest)."""
        if tier not in TIERS:
            raise BreakEvenError(f"tier: expected one of {TIERS}, got {tier!r}")
        order = TIERS[TIERS.index(tier):] + TIERS[:TIERS.index(tier)][::-1]
        ps = self.points[next(t for t in order if t in self.points)]
        if tokens <= ps[0][0]:
            n, rec, red = ps[0]
            return rec * tokens / n, red * tokens / n
        for (n0, rec0, red0), (n1, rec1, red1) in zip(ps, ps[1:]):
            if tokens <= n1:
                w = (tokens - n0) / (n1 - n0)
                return rec0 + w * (rec1 - rec0), red0 + w * (red1 - red0)
        n, rec, red = ps[-1]
        return rec * tokens / n, red * tokens / n

    def choose(self, tier: str, tokens: int) -> Choice:
        """The arm the table says reaches the first token sooner (RedKnot on a tie)."""
        rec, red = self.estimate(tier, tokens)
        return Choice("recompute" if rec < red else "redknot", tier, int(tokens), rec, red)


def request_tier(tiers) -> str:
    """A request's tier: its slowest document's."""
    tiers = list(tiers)
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise BreakEvenError(f"tier: expected one of {TIERS}, got {bad}")
    return max(tiers, key=TIERS.index) if tiers else "device"
