"""RedKnot profiles (DESIGN.md §2, §4): data, not code.

A profile fixes the execution roles and the online policy of the RedKnot arm:

* fences: the first `fence_first` and last `fence_last` layers are full recompute; the layers
  between are reusable;
* roles: in every output group, head `global_head` is Global (online for every row) and the
  others are Local (restored from the artifact for unprotected rows);
* protection sizes: `boundary_rows` at both ends of each relocated segment, `tail_rows`;
* how the budget's rows are ranked (`itop_rank`): by the native indexer's score for the query
  rows (the DESIGN's Itop), or by latent deviation (CacheBlend's rule, see the class doc);
* the budget controller (`choose_budget`) and the MoE fan-out rule (`fanout_*`, `tau`);
* what the FFN sub-layer of an unprotected document row of a reusable layer does (`ffn_rows`):
  "omit" (no router, no expert: the row's streams pass it unchanged), "restore" (the
  artifact's canonical FFN output enters through the native mHC post/comb) or "run" (the
  native MoE with the fan-out rule, the control);
* how the artifacts store their rows (`artifact_codec`, `reuse.codec`): "dense" as produced,
  "fp8" or "fp4" compact (z_L and the FFN output in FP8 / NVFP4, the latents' NoPE part in
  FP8), which changes the answers a little, so it is part of the profile.

Profiles are frozen, serialise to plain JSON (`to_dict` / `from_dict`), and their `digest()`
is hashed into artifact certificates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from redknot_jax.config import ModelConfig
from redknot_jax.reuse.certificate import CODECS, json_digest

LATENT_REFRESH = ("none", "protected")
ITOP_RANKS = ("indexer", "deviation")
FANOUT_MODES = ("tau", "k3", "native")
FFN_ROWS = ("omit", "restore", "run")


class ProfileError(ValueError):
    """A profile field out of its domain (the message names the field and the value)."""


def _real(name: str, v) -> float:
    # bool is an int subclass; True would silently pass as 1.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{name}: expected a finite number, got {v!r}")
    return float(v)


def _count(name: str, v, lo: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ProfileError(f"{name}: expected an int >= {lo}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class RedKnotProfile:
    """Execution roles and online policy of the RedKnot arm.

    Budget controller (`choose_budget`): `budgets` are fractions of candidate rows (rows of
    relocated and prefix documents) to protect, strictly increasing. The controller reads one
    concentration statistic c in [0, 1] (the planner's definition: the share of the query
    rows' top indexer mass held by the top-k entries; high c = attention is concentrated on
    few entries). `concentration_thresholds` is strictly decreasing with one entry fewer than
    `budgets`; the rule is

        budget = budgets[i] for the first i with c >= concentration_thresholds[i],
                 budgets[-1] if c is below every threshold,

    so concentrated queries get the smallest budget and diffuse ones the largest. With the
    defaults: c >= 0.8 -> 10 %, 0.5 <= c < 0.8 -> 20 %, c < 0.5 -> 25 %. The thresholds are
    uncalibrated starting points; a calibrated profile is a new profile (new digest).

    `budget_override` (tests and benchmarks) replaces the controller: 1.0 protects every
    candidate row.

    `itop_rank` says which candidate rows fill the budget. "indexer" (the DESIGN's Itop): the
    rows whose compressed entry the native indexer scores highest for the query rows. "deviation"
    (what CacheBlend selects): the rows whose canonical latent differs most from the latent
    this request's hidden states give at the first reusable layer, where the fences have made
    every row's input exact (`planner.latent_deviation`). Those are the rows whose meaning the
    earlier documents change, so the rule pays off with `latent_refresh="protected"`.
    """

    name: str
    fence_first: int = 3
    fence_last: int = 3
    global_head: int = 0
    latent_refresh: str = "none"
    itop_rank: str = "indexer"
    boundary_rows: int = 128
    tail_rows: int = 32768
    budgets: tuple[float, ...] = (0.10, 0.20, 0.25)
    concentration_thresholds: tuple[float, ...] = (0.8, 0.5)
    fanout_mode: str = "tau"
    tau: float = 0.9
    fanout_min: int = 3
    budget_override: float | None = None
    ffn_rows: str = "run"
    artifact_codec: str = "dense"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ProfileError(f"name: expected a non-empty str, got {self.name!r}")
        for f in ("fence_first", "fence_last", "global_head", "boundary_rows", "tail_rows"):
            _count(f, getattr(self, f))
        _count("fanout_min", self.fanout_min, lo=1)
        if self.latent_refresh not in LATENT_REFRESH:
            raise ProfileError(f"latent_refresh: expected one of {LATENT_REFRESH}, got {self.latent_refresh!r}")
        if self.itop_rank not in ITOP_RANKS:
            raise ProfileError(f"itop_rank: expected one of {ITOP_RANKS}, got {self.itop_rank!r}")
        if self.ffn_rows not in FFN_ROWS:
            raise ProfileError(f"ffn_rows: expected one of {FFN_ROWS}, got {self.ffn_rows!r}")
        if self.artifact_codec not in CODECS:
            raise ProfileError(f"artifact_codec: expected one of {CODECS}, got {self.artifact_codec!r}")
        if self.fanout_mode not in FANOUT_MODES:
            raise ProfileError(f"fanout_mode: expected one of {FANOUT_MODES}, got {self.fanout_mode!r}")

        # Normalise numbers to tuples of floats so that equal profiles have equal digests
        # (JSON writes 1 and 1.0 differently) and lists from JSON stay hashable.
        if isinstance(self.budgets, (str, bytes)) or not hasattr(self.budgets, "__iter__"):
            raise ProfileError(f"budgets: expected a sequence of fractions, got {self.budgets!r}")
        budgets = tuple(_real("budgets[]", b) for b in self.budgets)
        if not budgets or any(not 0.0 < b <= 1.0 for b in budgets) or \
                any(a >= b for a, b in zip(budgets, budgets[1:])):
            raise ProfileError(f"budgets: expected a non-empty, strictly increasing sequence in (0, 1], "
                               f"got {budgets}")
        if isinstance(self.concentration_thresholds, (str, bytes)) or \
                not hasattr(self.concentration_thresholds, "__iter__"):
            raise ProfileError(f"concentration_thresholds: expected a sequence, got "
                               f"{self.concentration_thresholds!r}")
        thr = tuple(_real("concentration_thresholds[]", t) for t in self.concentration_thresholds)
        if len(thr) != len(budgets) - 1:
            raise ProfileError(f"concentration_thresholds: expected {len(budgets) - 1} entries "
                               f"(one fewer than budgets {budgets}), got {thr}")
        if any(not 0.0 <= t <= 1.0 for t in thr) or any(a <= b for a, b in zip(thr, thr[1:])):
            raise ProfileError(f"concentration_thresholds: expected strictly decreasing values in [0, 1], "
                               f"got {thr}")
        tau = _real("tau", self.tau)
        if not 0.0 < tau <= 1.0:
            raise ProfileError(f"tau: expected 0 < tau <= 1, got {tau}")
        override = self.budget_override
        if override is not None:
            override = _real("budget_override", override)
            if not 0.0 < override <= 1.0:
                raise ProfileError(f"budget_override: expected None or a fraction in (0, 1], got {override}")
        for k, v in (("budgets", budgets), ("concentration_thresholds", thr), ("tau", tau),
                     ("budget_override", override)):
            object.__setattr__(self, k, v)

    # --------------------------------------------------------------------------- layers
    def reusable_layers(self, n_layers: int) -> range:
        """The layers between the fences: range(fence_first, n_layers - fence_last)."""
        _count("n_layers", n_layers, lo=1)
        if self.fence_first + self.fence_last > n_layers:
            raise ProfileError(f"profile {self.name!r}: fences {self.fence_first}+{self.fence_last} "
                               f"exceed n_layers {n_layers}")
        return range(self.fence_first, n_layers - self.fence_last)

    def is_fence(self, layer: int, n_layers: int) -> bool:
        """True for a full-recompute layer (native attention and top-k MoE for all rows)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ProfileError(f"layer: expected an int in [0, {n_layers}), got {layer!r}")
        return layer not in self.reusable_layers(n_layers)

    # --------------------------------------------------------------------------- heads
    def local_heads(self, heads_per_group: int) -> tuple[int, ...]:
        """Indices (within a group) of the Local heads: every head but `global_head`."""
        _count("heads_per_group", heads_per_group, lo=1)
        if self.global_head >= heads_per_group:
            raise ProfileError(f"global_head: expected < heads_per_group {heads_per_group}, "
                               f"got {self.global_head}")
        return tuple(h for h in range(heads_per_group) if h != self.global_head)

    # --------------------------------------------------------------------------- controller
    def choose_budget(self, concentration: float) -> float:
        """Fraction of candidate rows to protect (see the class docstring for the rule)."""
        if self.budget_override is not None:
            return self.budget_override
        c = float(concentration)
        if not 0.0 <= c <= 1.0:  # NaN fails this too
            raise ProfileError(f"concentration: expected a share in [0, 1], got {concentration!r}")
        for budget, threshold in zip(self.budgets, self.concentration_thresholds):
            if c >= threshold:
                return budget
        return self.budgets[-1]

    # --------------------------------------------------------------------------- I/O
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples as lists; `artifact_codec` only when not "dense")."""
        d = dataclasses.asdict(self)
        d["budgets"] = list(self.budgets)
        d["concentration_thresholds"] = list(self.concentration_thresholds)
        if self.artifact_codec == "dense":  # so profiles from before the field keep their digests
            del d["artifact_codec"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RedKnotProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ProfileError(f"unknown profile fields {unknown}; known: {sorted(names)}")
        if "name" not in d:
            raise ProfileError("profile: missing required field 'name'")
        return cls(**d)

    @classmethod
    def read(cls, path) -> "RedKnotProfile":
        """A profile from a JSON file in `to_dict`'s form (e.g. a checkpoint's redknot_profile.json)."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of every field (hashed into certificates)."""
        return json_digest(self.to_dict())


# ------------------------------------------------------------------------------- presets
def flash_profile() -> RedKnotProfile:
    """DeepSeek-V4-Flash, 3F-37R-3F: 7 Local + 1 Global head per group (56 / 8 of 64).
    ffn_rows="restore": on the shipped QA model restoring the FFN output of unprotected rows
    gives the answers of running it (docs/quality.md, "Speed-quality frontier") without their
    MoE; the artifacts then carry it (8 KB per row and reusable layer at Flash shapes).
    artifact_codec="fp4" (docs/store.md, "Artifact codecs"): the dense artifacts' answers on
    every question measured, at 301 KiB a token against 974 dense; a dense 64K pool (64.9 GB)
    beside the weights leaves the Recomputed arm out of memory on one H200."""
    return RedKnotProfile(name="flash-3F-37R-3F", ffn_rows="restore", artifact_codec="fp4")


def pro_profile() -> RedKnotProfile:
    """DeepSeek-V4-Pro, 3F-55R-3F: 7 Local + 1 Global head per group (112 / 16 of 128);
    ffn_rows and artifact_codec as `flash_profile`."""
    return RedKnotProfile(name="pro-3F-55R-3F", ffn_rows="restore", artifact_codec="fp4")


def tiny_profile(n_layers: int) -> RedKnotProfile:
    """Tiny test models (4-6 layers): fences 1/1 so reusable layers exist; protection sizes
    shrunk to the tiny sliding window (8) so short prompts still have unprotected rows."""
    _count("n_layers", n_layers, lo=3)  # at least one reusable layer between the fences
    return RedKnotProfile(name=f"tiny-1F-{n_layers - 2}R-1F", fence_first=1, fence_last=1,
                          boundary_rows=8, tail_rows=8)


NAMES = ("auto", "tiny", "tiny-exact", "flash", "pro")  # `named`'s; else a profile JSON file


def named(name: str, n_layers: int, shipped: str | None = None) -> RedKnotProfile:
    """The profile `serve.py --profile` and the benchmarks name: `auto` (the file `shipped`, a
    checkpoint's own redknot_profile.json, when it exists; else by layer count: flash, pro,
    tiny), `tiny`, `tiny-exact` (the tiny profile with native MoE fan-out, so prefix-only requests
    are exact: DESIGN §4, a prefix document at 0 plus new rows is the native computation),
    `flash`, `pro`, or a profile JSON file."""
    if name == "auto" and shipped and os.path.isfile(shipped):
        name = shipped
    elif name == "auto":
        name = {43: "flash", 61: "pro"}.get(n_layers, "tiny")
    if name == "tiny":
        return tiny_profile(n_layers)
    if name == "tiny-exact":
        return dataclasses.replace(tiny_profile(n_layers), name=f"tiny-exact-{n_layers}", fanout_mode="native")
    if name == "flash":
        return flash_profile()
    if name == "pro":
        return pro_profile()
    if os.path.isfile(name):
        return RedKnotProfile.read(name)
    raise ProfileError(f"profile: expected {', '.join(NAMES)} or a JSON file, got {name!r}")


def head_row_ceiling(cfg: ModelConfig, profile: RedKnotProfile) -> float:
    """Structural logical head-row ceiling (DESIGN.md §2): the head-row saving with no
    protected rows, (reusable layers x Local heads) / (layers x heads).
    Flash 37*56 / (43*64) = 0.7529, Pro 55*112 / (61*128) = 0.7889."""
    local = cfg.o_groups * len(profile.local_heads(cfg.heads_per_group))
    return len(profile.reusable_layers(cfg.num_layers)) * local / (cfg.num_layers * cfg.num_heads)
