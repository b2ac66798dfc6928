"""The four ledgers of DESIGN.md §6, kept apart (never added together).

1. head-row  : Local (head, row) pairs restored / all (head, row) pairs, over all layers.
2. token-row : candidate (row, layer) pairs restored rather than recomputed, over reusable layers.
3. operator  : analytic FLOPs of the major operators in each arm, from shapes and the plan.
4. wall-clock: measured TTFT of both arms.
Plus the certification counters. Head-row, token-row and fan-out savings overlap, so each
ledger reports its own ratio and `Ledgers.to_dict` has no combined figure.

Inputs are plain numbers so the planner can call these without a model: `n_rows` rows in
the request, `protected_rows` of them protected (DESIGN.md §4: query, new, dirty, boundary,
indexer-top and tail rows; new rows are always protected, so every unprotected row is a
candidate row). `protected_rows` is either one int for every reusable layer or a sequence
with one entry per reusable layer, in layer order.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Sequence

from redknot_jax.config import CSA, HCA, ModelConfig
from redknot_jax.reuse.certificate import CertCounters
from redknot_jax.reuse.profile import RedKnotProfile, head_row_ceiling

ARMS = ("recompute", "redknot")
# Every operator of the analytic ledger, and the DESIGN.md §6 group each belongs to.
OP_GROUPS = {
    "projections": ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "compressor", "indexer_proj"),
    "attention": ("attention",),
    "indexer": ("indexer_scoring",),
    "moe": ("router", "moe_routed", "moe_shared"),
}
OPS = tuple(op for ops in OP_GROUPS.values() for op in ops)


def _rows_per_layer(name: str, value: int | Sequence[int], layers: range, hi: int) -> dict[int, int]:
    """{reusable layer: count} from one int or one entry per reusable layer; 0 <= count <= hi."""
    if isinstance(value, int) and not isinstance(value, bool):
        values = [value] * len(layers)
    else:
        values = list(value)
        if len(values) != len(layers):
            raise ValueError(f"{name}: expected one int or {len(layers)} entries (reusable layers "
                             f"{layers.start}..{layers.stop - 1}), got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise ValueError(f"{name}: expected ints in [0, {hi}], got {v!r}")
    return dict(zip(layers, values))


def _check_count(name: str, v, lo: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


# ------------------------------------------------------------------------------ 1. head-row
def head_row_ledger(cfg: ModelConfig, profile: RedKnotProfile, n_rows: int,
                    protected_rows: int | Sequence[int]) -> dict:
    """Logical head-row saving.

    restored_pairs = sum over reusable layers l of  L x (n_rows - protected_rows[l]),
    total_pairs    = num_layers x num_heads x n_rows,   saving = restored / total,
    with L = o_groups x (heads_per_group - 1) Local heads. With no protected rows the saving
    equals `head_row_ceiling` (also reported).
    """
    _check_count("n_rows", n_rows)
    layers = profile.reusable_layers(cfg.num_layers)
    prot = _rows_per_layer("protected_rows", protected_rows, layers, n_rows)
    n_local = cfg.o_groups * len(profile.local_heads(cfg.heads_per_group))
    restored = sum(n_local * (n_rows - prot[l]) for l in layers)
    total = cfg.num_layers * cfg.num_heads * n_rows
    return {"restored_pairs": restored, "total_pairs": total, "saving": _ratio(restored, total),
            "ceiling": head_row_ceiling(cfg, profile)}


# ------------------------------------------------------------------------------ 2. token-row
def token_row_ledger(cfg: ModelConfig, profile: RedKnotProfile, n_rows: int, candidate_rows: int,
                     protected_candidate_rows: int | Sequence[int], prefix_rows: int = 0) -> dict:
    """Physical token-row saving (DESIGN §6): (row, layer) pairs whose token-wide work is not
    done, over all num_layers x n_rows pairs.

    omitted_rows = prefix_rows x num_layers (an exact prefix is computed in no layer)
                 + sum over reusable layers l of (candidate_rows - protected_candidate_rows[l])
                   when the profile's ffn_rows is "omit" or "restore" (the unprotected document
                   rows run neither their Local heads nor their FFN); 0 under "run";
    saving = omitted_rows / (num_layers x n_rows). Candidate rows are the rows of relocated
    documents (not the prefix's, not new rows).
    """
    _check_count("n_rows", n_rows)
    _check_count("candidate_rows", candidate_rows)
    _check_count("prefix_rows", prefix_rows)
    if candidate_rows + prefix_rows > n_rows:
        raise ValueError(f"candidate_rows {candidate_rows} + prefix_rows {prefix_rows} exceed n_rows {n_rows}")
    layers = profile.reusable_layers(cfg.num_layers)
    prot = _rows_per_layer("protected_candidate_rows", protected_candidate_rows, layers, candidate_rows)
    omitted = prefix_rows * cfg.num_layers
    if profile.ffn_rows != "run":
        omitted += sum(candidate_rows - prot[l] for l in layers)
    total = cfg.num_layers * n_rows
    return {"omitted_rows": omitted, "total_rows": total, "prefix_rows": prefix_rows, "ffn_rows": profile.ffn_rows,
            "saving": _ratio(omitted, total)}


# ------------------------------------------------------------------------------ 3. operators
def _sum_floor(x: int, m: int) -> int:
    """sum_{p=1..x} floor(p / m): compressed entries visible to the first x rows.
    With q = x // m, r = x % m: each full block j < q contributes j m times, block q r+1 times."""
    q, r = divmod(x, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


def _sum_floor_capped(x: int, m: int, cap: int) -> int:
    """sum_{p=1..x} min(cap, floor(p / m)); floor(p/m) reaches cap at p = cap*m."""
    knee = cap * m - 1
    return _sum_floor(min(x, knee), m) + cap * max(0, x - knee)


def _key_sum(cfg: ModelConfig, layer: int, x: int) -> int:
    """Keys attended by the first x rows of a layer (positions 0..x-1), summed over rows.

    Row at position p (x = p+1 rows so far) sees min(window, p+1) sliding keys, plus
    min(index_topk, floor((p+1)/4)) selected entries (CSA) or floor((p+1)/128) entries (HCA).
    """
    w = cfg.sliding_window
    keys = x * (x + 1) // 2 if x <= w else w * (w + 1) // 2 + (x - w) * w
    if cfg.layer_types[layer] == CSA:
        keys += _sum_floor_capped(x, cfg.csa_rate, cfg.index_topk)
    elif cfg.layer_types[layer] == HCA:
        keys += _sum_floor(x, cfg.hca_rate)
    return keys


def _layer_flops(cfg: ModelConfig, layer: int, n: int, heads_all: int, heads_prot: int, prot: int,
                 index_rows: int, latent_rows: int, experts: float, ffn_rows: int | None = None,
                 out_rows: int | None = None) -> dict[str, float]:
    """FLOPs of one layer (2*m*n*k per matmul; elementwise work ignored).

    heads_all heads run for all n rows; heads_prot more heads run for the `prot` protected
    rows only; the indexer query side runs for `index_rows` rows; latents (wkv, compressors)
    are computed for `latent_rows` rows; `experts` routed experts per row; the router and
    experts run for `ffn_rows` rows (default all n); wq_a and wo_b for `out_rows` (default
    all n). Rows that run a
    subset are charged as the LATEST rows (the ones that see the most keys and entries): a
    row's cost never decreases with its position, so this bounds the RedKnot arm from above
    and its saving from below.
    """
    D, k, Rq = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    g, Ro, HI, dI = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    f = cfg.moe_inter_dim
    kind = cfg.layer_types[layer]
    head_rows = heads_all * n + heads_prot * prot                # (head, row) pairs computed
    # compressor wkv + wgate: 2 matrices of [c*k, D] (c = 2 for CSA's overlapping halves,
    # 1 for HCA); a CSA layer adds the indexer compressor, 2 matrices of [2*dI, D].
    c = {CSA: 2, HCA: 1}.get(kind, 0)
    comp_out = 2 * c * k + (2 * 2 * dI if kind == CSA else 0)
    if kind == CSA:
        # indexer wq_b [HI*dI, Rq] on c_q and weights_proj [HI, D] on x, per querying row
        index_proj = index_rows * (2 * Rq * HI * dI + 2 * D * HI)
        # one dI-dot per (querying row, visible entry, indexer head); entries uncapped (top-k
        # is chosen after scoring all of them)
        visible = _sum_floor(n, cfg.csa_rate) - _sum_floor(n - index_rows, cfg.csa_rate)
        index_score = 2 * HI * dI * visible
    else:
        index_proj = index_score = 0
    ffn = n if ffn_rows is None else ffn_rows
    out = n if out_rows is None else out_rows
    keys_all = _key_sum(cfg, layer, n)
    keys_prot = keys_all - _key_sum(cfg, layer, n - prot)
    return {
        "wq_a": 2.0 * D * Rq * out,
        "wq_b": 2.0 * Rq * k * head_rows,                        # k columns of wq_b per head
        "wkv": 2.0 * D * k * latent_rows,
        "wo_a": 2.0 * k * Ro * head_rows,                        # a head's k-slice of its group's wo_a
        "wo_b": 2.0 * g * Ro * D * out,                          # once, on the projected state z
        "compressor": 2.0 * comp_out * D * latent_rows,
        "indexer_proj": float(index_proj),
        # per (head, key): q.k (2k) and p.v (2k); V = K so both use the 512-d latent
        "attention": 4.0 * k * (heads_all * keys_all + heads_prot * keys_prot),
        "indexer_scoring": float(index_score),
        "router": 2.0 * D * cfg.n_routed_experts * ffn,
        "moe_routed": 3 * 2.0 * D * f * experts * ffn,           # w1, w3 [D, f] and w2 [f, D]
        "moe_shared": 3 * 2.0 * D * f * ffn,
    }


def operator_flops(cfg: ModelConfig, profile: RedKnotProfile, n_rows: int,
                   protected_rows: int | Sequence[int], kept_experts_per_row: float, arm: str,
                   latent_rows: int | Sequence[int] | None = None, prefix_rows: int = 0,
                   out_rows: int | None = None) -> dict[str, float]:
    """Analytic FLOPs per operator (`OPS`), summed over all layers, for one prefill of
    `n_rows` rows (positions 0..n_rows-1).

    Recompute arm: every layer runs natively for every row: all heads, the indexer for every
    row, `experts_per_tok` routed experts + the shared expert.

    RedKnot arm: fence layers as Recompute. In a reusable layer
      * wq_a, wo_b, router and shared expert run for every row;
      * the Global heads (one per group) run for every row: their wq_b columns, attention and
        wo_a slice;
      * the Local heads run for protected rows only (unprotected rows take z_L from the
        artifact), charged as the latest rows;
      * the indexer (query projection and scoring over the whole request) runs for protected
        rows only; unprotected rows use their artifact's document-local top-k;
      * latents (wkv, compressor and indexer compressor) are computed for `latent_rows` rows
        (default all rows: conservative; with canonical latents from the artifact the
        planner may pass new rows + refreshed rows);
      * `kept_experts_per_row` routed experts per row (the measured fan-out mean); with the
        profile's ffn_rows "omit" / "restore" the router and experts run for protected rows only.
    Global-head keys of unprotected rows are charged as native (their segment-local window
    and document-local top-k are never larger). An exact prefix of `prefix_rows` rows (RedKnot
    arm) is computed in no layer: each layer is charged for rows prefix_rows .. n_rows-1 only
    (its count with all rows less the prefix's own, which depends only on the positions), the
    protected rows being among those. `out_rows`: a native last layer computes queries,
    attention, wo and the MoE for that many rows only, the latest (`model.output_block`'s query
    block holding every logits row), its latents and cache for every row; None: every row.
    """
    if arm not in ARMS:
        raise ValueError(f"arm: expected one of {ARMS}, got {arm!r}")
    _check_count("n_rows", n_rows)
    kept = float(kept_experts_per_row)
    if not 0.0 <= kept <= cfg.experts_per_tok:
        raise ValueError(f"kept_experts_per_row: expected in [0, {cfg.experts_per_tok}], "
                         f"got {kept_experts_per_row!r}")
    _check_count("prefix_rows", prefix_rows)
    L = prefix_rows if arm == "redknot" else 0
    if L > n_rows:
        raise ValueError(f"prefix_rows {prefix_rows} exceed n_rows {n_rows}")
    if out_rows is not None:
        _check_count("out_rows", out_rows)
        if not 0 < out_rows <= n_rows - L:
            raise ValueError(f"out_rows: expected in [1, {n_rows - L}] (the computed rows), got {out_rows}")
    layers = profile.reusable_layers(cfg.num_layers)
    prot = _rows_per_layer("protected_rows", protected_rows, layers, n_rows - L)
    latent = _rows_per_layer("latent_rows", n_rows if latent_rows is None else latent_rows, layers, n_rows)
    n_local = cfg.o_groups * len(profile.local_heads(cfg.heads_per_group))
    total = dict.fromkeys(OPS, 0.0)
    for layer in range(cfg.num_layers):
        if arm == "redknot" and layer in layers:
            ffn = lambda n: None if profile.ffn_rows == "run" else (prot[layer] if n == n_rows else 0)
            per = [_layer_flops(cfg, layer, n, heads_all=cfg.num_heads - n_local, heads_prot=n_local,
                                prot=p, index_rows=p, latent_rows=lat, experts=kept, ffn_rows=ffn(n))
                   for n, p, lat in ((n_rows, prot[layer], latent[layer]), (L, 0, L if latent_rows is None else 0))]
        elif out_rows is not None and layer == cfg.num_layers - 1:  # trimmed: the latest out_rows rows
            per = [_layer_flops(cfg, layer, n, heads_all=0, heads_prot=cfg.num_heads, prot=q, index_rows=q,
                                latent_rows=n, experts=cfg.experts_per_tok, ffn_rows=q, out_rows=q)
                   for n, q in ((n_rows, out_rows), (L, 0))]
        else:
            per = [_layer_flops(cfg, layer, n, heads_all=cfg.num_heads, heads_prot=0, prot=0, index_rows=n,
                                latent_rows=n, experts=cfg.experts_per_tok) for n in (n_rows, L)]
        for op in per[0]:
            total[op] += per[0][op] - (per[1][op] if L else 0.0)
    return total


def operator_ledger(cfg: ModelConfig, profile: RedKnotProfile, n_rows: int,
                    protected_rows: int | Sequence[int], kept_experts_per_row: float,
                    latent_rows: int | Sequence[int] | None = None, prefix_rows: int = 0,
                    out_rows: int | None = None) -> dict:
    """Both arms of `operator_flops`, and the saving 1 - redknot / recompute per operator,
    per DESIGN.md §6 group (`OP_GROUPS`) and over all operators (FLOPs add within this one
    ledger; the saving is 0 for an operator the model does not have)."""
    arms = {arm: operator_flops(cfg, profile, n_rows, protected_rows, kept_experts_per_row, arm,
                                latent_rows=latent_rows, prefix_rows=prefix_rows, out_rows=out_rows) for arm in ARMS}

    def entry(ops):
        rec = sum(arms["recompute"][op] for op in ops)
        red = sum(arms["redknot"][op] for op in ops)
        return {"recompute": rec, "redknot": red, "saving": 1.0 - red / rec if rec else 0.0}

    return {**arms,
            "saving": {op: entry((op,))["saving"] for op in OPS},
            "groups": {name: entry(ops) for name, ops in OP_GROUPS.items()},
            "total": entry(OPS)}


# ------------------------------------------------------------------------------ 4. wall-clock
def wallclock_ledger(ttft_recompute_s: float, ttft_redknot_s: float) -> dict:
    """Measured TTFT of both arms (same timing boundary, DESIGN.md §6): speedup = recompute /
    redknot, saving = 1 - redknot / recompute."""
    for name, v in (("ttft_recompute_s", ttft_recompute_s), ("ttft_redknot_s", ttft_redknot_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}: expected a positive finite time in seconds, got {v!r}")
    rec, red = float(ttft_recompute_s), float(ttft_redknot_s)
    return {"ttft_recompute_s": rec, "ttft_redknot_s": red, "speedup": rec / red, "saving": 1.0 - red / rec}


# ------------------------------------------------------------------------------ bundle
@dataclasses.dataclass(frozen=True)
class Ledgers:
    """The four ledgers and the certification counters of one run, side by side.

    `wallclock` is None when nothing was timed. `cert` is a `CertCounters.snapshot()` (a
    `CertCounters` is snapshotted on construction). The dicts are copied in and out, so a
    `Ledgers` never changes after it is built.
    """

    head_row: dict
    token_row: dict
    operator: dict
    wallclock: dict | None
    cert: dict

    def __post_init__(self):
        if isinstance(self.cert, CertCounters):
            object.__setattr__(self, "cert", self.cert.snapshot())
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, dict) or (f.name == "wallclock" and v is None)):
                raise TypeError(f"Ledgers.{f.name}: expected a dict, got {type(v).__name__}")
            object.__setattr__(self, f.name, copy.deepcopy(v))

    def to_dict(self) -> dict:
        """{"head_row", "token_row", "operator", "wallclock", "cert"}: separate, never summed."""
        return copy.deepcopy({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
