"""Relocated segment latent attention (DESIGN §4) as a Mosaic GPU kernel, beside its reference.

Queries q [t, h, k] (RoPE'd at their absolute positions) attend several *segments* of keys
sharing K = V (one latent head, k = 512, RoPE on the last r = 64 dims, interleaved pairs).
Segment j is a static range [start_j, end_j) of one key source, placed at offset D_j: its
keys are canonical latents (document built at position 0). Each query row sees, per segment,
one half-open interval [row_lo[t, j], row_hi[t, j]) of key indices of that source: the
sliding window (128), causal visibility of compressed HCA entries, a dense range, or the first
`count` entries of a per-row gathered CSA top-k list all have this shape.

Relocation (relocation.py): per segment the query's RoPE slice is rotated by -D_j, the
segment's partial output's RoPE slice turned back by +D_j, and all segments are merged by
log-sum-exp with the per-head sink logit entering once. Outputs o [t, h, k] (q.dtype) and
lse [t, h] (fp32, sink included).

Kernel layout (one CTA = one query row x one split of every segment's interval):
* the 64 heads of a row are the wgmma M dimension (K = V is one head, so all heads share the
  key tile: MQA-style "heads in M");
* 3 warpgroups: a producer issuing TMA copies (q once, per-segment rotation matrices, key
  blocks [block_kv, 512] through a `slots`-deep ring) and two consumers, each computing the
  whole logit tile (k = 512 contraction, redundant across the two) and owning half of the
  output columns (a [64, 512] fp32 accumulator would need 256 registers per thread);
* rotations are small wgmmas against 64 x 64 rotation matrices prepared by the wrapper in
  fp32 and split hi + lo into bf16 (products exact, fp32 accumulation): q_rope @ R(-D_j)
  per segment, and the consumer holding the RoPE slice of the running accumulator moves it
  from segment j-1's frame to segment j's (R(D_{j-1} - D_j)), finally to the absolute frame
  (R(D_last)). Rotation commutes with the online-softmax rescaling, so the accumulator can
  live in the current segment's frame;
* with `num_splits` > 1 (decode: few rows) each CTA handles 1/num_splits of every interval.
  The kernel writes per-split partials (o normalised within the split, lse) without the sink;
  the wrapper merges splits and the sink once (relocation.merge_partials' formula), a small
  elementwise pass that XLA fuses into its consumer.

CSA top-k entries are gathered per row by XLA (`gather_relocated`), already turned into the
absolute frame during the gather (the gather copies them anyway; <R(t)q, R(D)k> needs no
further rotation), and enter as one segment at offset 0 whose interval is [0, count).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from redknot_jax.pallas.mosaic import LOG2E, softmax_finish, specialise
from redknot_jax.pallas.timing import matmul_peak_tflops, median_time, record, rel_err
from redknot_jax.relocation import merge_partials, partial_attention, rotate
from redknot_jax.rope import apply_rope

HEADS = 64  # wgmma M: one row's heads
HEAD_DIM = 512
ROPE_DIM = 64


@dataclasses.dataclass(frozen=True)
class Segment:
    """A static key range [start, end) of source `src` (0: shared `keys`, 1: per-row gathered
    `gkeys` flattened to [t * G, k]) placed at a traced offset (seg_offset[j])."""

    start: int
    end: int
    src: int = 0


@dataclasses.dataclass(frozen=True)
class SegAttentionConfig:
    """Tuning config. block_kv: keys per pipeline step (wgmma N of the logit tile and K of the
    PV product); slots: depth of the key-block ring; num_splits: CTAs per query row (decode).
    Only block_kv=64, slots=2 fit this kernel on Hopper; num_splits is the free knob."""

    block_kv: int = 64
    slots: int = 2
    num_splits: int = 1

    def __post_init__(self):
        # PV takes P from registers: a bf16 register A operand needs K (= block_kv) % 64 == 0
        # (H200, 2026-11-29: block_kv=32 failed to compile), and two [64, 512] bf16 key slots are
        # all the shared memory leaves beside q and the rotation matrices
        if self.block_kv != 64:
            raise ValueError(f"SegAttentionConfig.block_kv: expected 64, got {self.block_kv}")
        if self.slots != 2:
            raise ValueError(f"SegAttentionConfig.slots: expected 2, got {self.slots}")
        if self.num_splits < 1:
            raise ValueError(f"SegAttentionConfig.num_splits: expected >= 1, got {self.num_splits}")
        smem = smem_bytes(self)
        if smem > SMEM_LIMIT:
            raise ValueError(f"SegAttentionConfig: {smem} bytes of shared memory > {SMEM_LIMIT} "
                             f"(block_kv={self.block_kv}, slots={self.slots})")


SMEM_LIMIT = 227 * 1024  # H100/H200 opt-in dynamic shared memory per block


def smem_bytes(cfg: SegAttentionConfig) -> int:
    keys = cfg.slots * cfg.block_kv * HEAD_DIM * 2
    q = HEADS * HEAD_DIM * 2  # also the output staging buffer
    mats = 4 * ROPE_DIM * ROPE_DIM * 2
    return keys + q + mats + HEADS * 4 + 1024  # + lse, barriers


DECODE_CONFIG = SegAttentionConfig(block_kv=64, slots=2, num_splits=16)
PREFILL_CONFIG = SegAttentionConfig(block_kv=64, slots=2, num_splits=1)


# ----------------------------------------------------------------------------- helpers
def _rot_matrix(angle_offset, freqs) -> jax.Array:
    """[.., r, r] fp32 M with x_row @ M = x turned by angle offset * freqs (interleaved)."""
    freqs = jnp.asarray(freqs, jnp.float32)
    r = 2 * freqs.shape[0]
    ang = jnp.asarray(angle_offset, jnp.float32)[..., None] * freqs  # [.., r/2]
    c, s = jnp.cos(ang), jnp.sin(ang)
    # pair i: out[2i] = a c - b s, out[2i+1] = a s + b c with (a, b) = (x[2i], x[2i+1]);
    # as x @ M: M[2i, 2i] = c, M[2i+1, 2i] = -s, M[2i, 2i+1] = s, M[2i+1, 2i+1] = c.
    eye = jnp.eye(r // 2, dtype=jnp.float32)
    blk = jnp.stack([jnp.stack([c, s], -1), jnp.stack([-s, c], -1)], -2)  # [.., r/2, 2, 2]
    m = jnp.einsum("...iab,ij->...iajb", blk, eye)
    return m.reshape(*m.shape[:-4], r, r)


def rotation_tables(seg_offset, freqs) -> jax.Array:
    """[n + 1, 4, r, r] bf16: per segment j (R(-D_j) hi, lo, R(D_{j-1} - D_j) hi, lo); entry n
    holds (unused, unused, R(D_{n-1}) hi, lo) for the final turn into the absolute frame."""
    d = jnp.asarray(seg_offset, jnp.int32)
    # angles fl(D * f) exactly as rotate() rounds them; a transition is the product
    # R(D_{j-1}) R(-D_j) (not R(D_{j-1} - D_j)), so the chain telescopes to R(D_last) R(-D_j)
    # whatever the fp32 rounding of large angles, and output turns cancel query turns as in
    # the reference
    qrot = _rot_matrix(-d, freqs)  # [n, r, r]
    plus = _rot_matrix(d, freqs)
    eye = jnp.eye(qrot.shape[-1], dtype=jnp.float32)[None]
    trans = jnp.concatenate([eye, jnp.einsum("nab,nbc->nac", plus[:-1], qrot[1:],
                                             precision=jax.lax.Precision.HIGHEST)], 0)
    fin = plus[-1:]
    qrot = jnp.concatenate([qrot, jnp.zeros_like(fin)], 0)
    trans = jnp.concatenate([trans, fin], 0)

    def split(m):
        hi = m.astype(jnp.bfloat16)
        return hi, (m - hi.astype(jnp.float32)).astype(jnp.bfloat16)

    qh, ql = split(qrot)
    th, tl = split(trans)
    return jnp.stack([qh, ql, th, tl], 1)


def gather_relocated(entries: jax.Array, entry_offset: jax.Array, sel: jax.Array, freqs):
    """Per-row gathered CSA entries in the absolute frame, valid ones first.

    entries [w, k] canonical entries of all segments (packed); entry_offset [w] int32 the
    offset D of each entry's segment; sel [t, K] entry ids (-1: none). Returns
    (gkeys [t, K, k], count [t]): rows turned by R(D) during the gather (the copy the gather
    makes anyway), so they enter attention at offset 0."""
    valid = sel >= 0
    order = jnp.argsort(~valid, axis=1, stable=True)  # valid first, original order kept
    sel = jnp.take_along_axis(sel, order, 1)
    valid = jnp.take_along_axis(valid, order, 1)
    ids = jnp.where(valid, sel, 0)
    g = entries[ids]  # [t, K, k]
    g = apply_rope(g, entry_offset[ids], freqs)  # turn each entry by its own segment offset
    g = jnp.where(valid[..., None], g, jnp.zeros((), g.dtype))
    return g, jnp.sum(valid, axis=1).astype(jnp.int32)


def _check(q, keys, gkeys, segments, seg_offset, row_lo, row_hi, sink, freqs):
    t, h, k = q.shape
    if q.ndim != 3 or keys.ndim != 2 or keys.shape[1] != k:
        raise ValueError(f"seg_attention: expected q [t, h, k] and keys [s, k], got {q.shape}, {keys.shape}")
    n = len(segments)
    if n < 1:
        raise ValueError("seg_attention: expected at least one segment")
    if seg_offset.shape != (n,) or row_lo.shape != (t, n) or row_hi.shape != (t, n):
        raise ValueError(f"seg_attention: expected seg_offset [{n}], row_lo/row_hi [{t}, {n}], got "
                         f"{seg_offset.shape}, {row_lo.shape}, {row_hi.shape}")
    if sink.shape != (h,):
        raise ValueError(f"seg_attention: expected sink [{h}], got {sink.shape}")
    if 2 * freqs.shape[0] > k:
        raise ValueError(f"seg_attention: rope dims {2 * freqs.shape[0]} > head dim {k}")
    for j, sg in enumerate(segments):
        src = keys if sg.src == 0 else gkeys
        if src is None:
            raise ValueError(f"seg_attention: segment {j} reads gkeys, none given")
        if not 0 <= sg.start <= sg.end <= src.shape[0]:
            raise ValueError(f"seg_attention: segment {j} range [{sg.start}, {sg.end}) outside source of "
                             f"{src.shape[0]} rows")


# ----------------------------------------------------------------------------- reference
def seg_attention_reference(q, keys, segments, seg_offset, row_lo, row_hi, sink, freqs, *, scale,
                            gkeys=None, config=None):
    """jnp reference built from relocation.py: per segment rotate(q, -D), partial_attention
    over the segment's keys with the row interval as mask, rotate(o, +D), merge_partials with
    the sink once. gkeys: per-row gathered keys flattened [t * G, k] (segments with src=1).
    Returns (o [t, h, k] in q.dtype, lse [t, h] fp32)."""
    del config
    freqs = jnp.asarray(freqs, jnp.float32)
    seg_offset = jnp.asarray(seg_offset, jnp.int32)
    _check(q, keys, gkeys, segments, seg_offset, row_lo, row_hi, sink, freqs)
    t = q.shape[0]
    parts = []
    for j, sg in enumerate(segments):
        d = seg_offset[j]
        qj = rotate(q, -d, freqs)
        if sg.src == 0:
            kj = keys[sg.start:sg.end].astype(q.dtype)
            idx = sg.start + jnp.arange(sg.end - sg.start)
            mask = (idx[None, :] >= row_lo[:, j:j + 1]) & (idx[None, :] < row_hi[:, j:j + 1])  # [t, s]
            o, lse = partial_attention(qj, kj, mask[:, None, :], scale)
        else:  # per-row gathered keys: row i owns gkeys[i*G:(i+1)*G]; never a [t, h, t*G] tensor
            if sg.start != 0 or sg.end != gkeys.shape[0] or gkeys.shape[0] % t:
                raise ValueError(f"seg_attention: a gathered segment spans all of gkeys [t * G, k], got "
                                 f"[{sg.start}, {sg.end}) of {gkeys.shape[0]} rows for t={t}")
            g = gkeys.shape[0] // t
            kg = gkeys.reshape(t, g, -1).astype(q.dtype)
            idx = jnp.arange(t)[:, None] * g + jnp.arange(g)[None, :]
            mask = (idx >= row_lo[:, j:j + 1]) & (idx < row_hi[:, j:j + 1])  # [t, G]
            o, lse = jax.vmap(lambda qi, ki, mi: partial_attention(qi[None], ki, mi[None, None, :], scale))(
                qj, kg, mask)
            o, lse = o[:, 0], lse[:, 0]
        parts.append((rotate(o, d, freqs), lse))
    o, lse = merge_partials(parts, sink)
    return o.astype(q.dtype), lse


# ----------------------------------------------------------------------------- kernel
def _kernel_call(q, keys, gkeys, mats, row_lo, row_hi, *, segments, scale, cfg):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    t, h, k = q.shape
    n = len(segments)
    bkv, slots, nsplit = cfg.block_kv, cfg.slots, cfg.num_splits
    r = ROPE_DIM
    nope = k - r
    half = k // 2
    dtype = q.dtype
    sl2 = scale * LOG2E
    has_g = gkeys is not None

    def seg_blocks(lo_ref, hi_ref, row, split, j):
        lo = lo_ref[row, j]
        hi = hi_ref[row, j]
        # blocks start at multiples of block_kv (aligned TMA boxes); keys below lo are masked
        base = lax.div(lo, jnp.int32(bkv)) * bkv
        nb = jnp.where(hi > lo, lax.div(hi - base + (bkv - 1), jnp.int32(bkv)), 0)
        per = lax.div(nb + (nsplit - 1), jnp.int32(nsplit))
        b0 = jnp.minimum(split * per, nb)
        b1 = jnp.minimum(b0 + per, nb)
        return lo, hi, base, b0, b1 - b0

    def body(*refs):
        if has_g:
            q_ref, k_ref, g_ref, m_ref, lo_ref, hi_ref, o_ref, lse_ref, scratch = refs
        else:
            q_ref, k_ref, m_ref, lo_ref, hi_ref, o_ref, lse_ref, scratch = refs
            g_ref = None
        ((q_s, o_s), k_s, (m_s, lse_s)), (q_bar, m_bar, k_bar), (m_free, k_free, done) = scratch
        row = lax.axis_index("t")
        split = lax.axis_index("split")
        wg = lax.axis_index("wg")
        src_of = lambda j: k_ref if segments[j].src == 0 else g_ref

        def consumer(w):
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_bar)
            m_i = plgpu.layout_cast(jnp.full((HEADS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((HEADS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            zeros = lambda c: plgpu.layout_cast(jnp.full((HEADS, c), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            accs = (zeros(half),) if w == 0 else (zeros(half - r), zeros(r))
            step = jnp.int32(0)

            def turn_rope(accs, which):  # accumulator RoPE slice (consumer 1) through mats[which]
                if w == 0:
                    return accs
                a = accs[1]
                a_hi = a.astype(dtype)
                a_lo = (a - a_hi.astype(jnp.float32)).astype(dtype)

                def mm(acc_ref):
                    plgpu.wgmma(acc_ref, a_hi, m_s.at[which])
                    plgpu.wgmma(acc_ref, a_hi, m_s.at[which + 1])
                    plgpu.wgmma(acc_ref, a_lo, m_s.at[which])
                    return acc_ref[...]

                return (accs[0], pl.run_scoped(mm, plgpu.ACC((HEADS, r), jnp.float32)))

            for j in range(n):
                lo, hi, base, b0, nb = seg_blocks(lo_ref, hi_ref, row, split, j)
                plgpu.barrier_wait(m_bar)

                def qrot_mm(acc_ref):
                    plgpu.wgmma(acc_ref, q_s.at[:, pl.ds(nope, r)], m_s.at[0])
                    plgpu.wgmma(acc_ref, q_s.at[:, pl.ds(nope, r)], m_s.at[1])
                    return acc_ref[...]

                qrot = pl.run_scoped(qrot_mm, plgpu.ACC((HEADS, r), jnp.float32)).astype(dtype)
                accs = turn_rope(accs, 2)
                plgpu.barrier_arrive(m_free)

                def kv_step(b, carry, j=j, lo=lo, hi=hi, base=base, b0=b0, qrot=qrot, step=step):
                    accs, m_i, l_i = carry
                    slot = lax.rem(step + b, jnp.int32(slots))
                    plgpu.barrier_wait(k_bar.at[slot])
                    ks = k_s.at[slot]

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_s.at[:, pl.ds(0, nope)], ks.at[:, pl.ds(0, nope)].T)
                        plgpu.wgmma(acc_ref, qrot, ks.at[:, pl.ds(nope, r)].T)
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((HEADS, bkv), jnp.float32))
                    start = base + (b0 + b) * bkv
                    kid = start + plgpu.broadcasted_iota(jnp.int32, (HEADS, bkv), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where((kid >= lo) & (kid < hi), s * sl2, -jnp.inf)
                    m_new = jnp.maximum(m_i, s.max(axis=1))
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l_i = l_i * alpha + p.sum(axis=1)
                    accs = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs)
                    p16 = p.astype(dtype)

                    vcols = [(0, half)] if w == 0 else [(half, half - r), (nope, r)]

                    def pv(acc_refs):
                        for a_ref, (c0, cn) in zip(acc_refs, vcols):
                            plgpu.wgmma(a_ref, p16, ks.at[:, pl.ds(c0, cn)])

                    accs = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in accs))
                    plgpu.barrier_arrive(k_free.at[slot])
                    return accs, m_new, l_i

                accs, m_i, l_i = lax.fori_loop(0, nb, kv_step, (accs, m_i, l_i))
                step = step + nb

            plgpu.barrier_wait(m_bar)  # entry n: the final turn into the absolute frame
            accs = turn_rope(accs, 2)
            plgpu.barrier_arrive(m_free)

            inv, lse = softmax_finish(m_i, l_i)
            # q_s becomes the output staging buffer once both consumers are past their last QK
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
            outs = [a * lax.broadcast_in_dim(inv, a.shape, [0]) for a in accs]
            if w == 0:
                o_s.at[0][...] = outs[0].astype(dtype)
                lse_s[...] = lse
            else:
                o_s.at[1, :, pl.ds(0, half - r)][...] = outs[0].astype(dtype)
                o_s.at[1, :, pl.ds(half - r, r)][...] = outs[1].astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[w], o_ref.at[split, row, :, pl.ds(w * half, half)])
            if w == 0:
                plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[split, row])
            plgpu.wait_smem_to_gmem(0)

        def producer():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(q_ref.at[row], q_s, q_bar)
            step = jnp.int32(0)
            for j in range(n):
                if j:
                    plgpu.barrier_wait(m_free)
                plgpu.copy_gmem_to_smem(m_ref.at[j], m_s, m_bar)
                lo, hi, base, b0, nb = seg_blocks(lo_ref, hi_ref, row, split, j)
                src = src_of(j)

                @pl.loop(0, nb)
                def _load(b, j=j, base=base, b0=b0, src=src, step=step):
                    g = step + b
                    slot = lax.rem(g, jnp.int32(slots))

                    @pl.when(g >= slots)
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])

                    plgpu.copy_gmem_to_smem(src.at[pl.ds(pl.multiple_of(base + (b0 + b) * bkv, bkv), bkv)], k_s.at[slot], k_bar.at[slot])

                step = step + nb
            plgpu.barrier_wait(m_free)
            plgpu.copy_gmem_to_smem(m_ref.at[n], m_s, m_bar)

        specialise(wg, consumer, producer)

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        # q is dead once both consumers pass `done`: the output staging reuses it
        (plgpu.RefUnion(plgpu.SMEM((HEADS, k), dtype, transforms=tiled),
                        plgpu.SMEM((2, HEADS, half), dtype, transforms=tiled)),
         plgpu.SMEM((slots, bkv, k), dtype, transforms=tiled),
         # the rotation matrices are dead once both consumers pass `done`: lse staging reuses them
         plgpu.RefUnion(plgpu.SMEM((4, r, r), dtype, transforms=tiled), plgpu.SMEM((HEADS,), jnp.float32))),
        (plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(num_barriers=slots)),
        (plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2, num_barriers=slots),
         plgpu.Barrier(num_arrivals=2)),
    )
    out_type = (jax.ShapeDtypeStruct((nsplit, t, h, k), dtype), jax.ShapeDtypeStruct((nsplit, t, h), jnp.float32))

    def entry(*refs):
        nin = 6 if has_g else 5
        ins, outs = refs[:nin], refs[nin:nin + 2]
        pl.run_scoped(lambda *sc: body(*ins, *outs, sc), *scratch, collective_axes="wg")

    args = (q, keys) + ((gkeys,) if has_g else ()) + (mats, row_lo, row_hi)
    return plgpu.kernel(
        entry, out_type=out_type, grid=(nsplit, t), grid_names=("split", "t"), num_threads=3,
        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*args)


def seg_attention_unsupported(h: int, k: int, r: int, dtype, gpu: bool = True) -> str | None:
    """Why the kernel cannot run q [t, h, k] with r RoPE dims in `dtype` (None: it can). `gpu`:
    whether a GPU is there (the kernel has no interpret mode)."""
    if (h, k, r) != (HEADS, HEAD_DIM, ROPE_DIM):
        return f"supports (heads, head dim, rope dims) = {(HEADS, HEAD_DIM, ROPE_DIM)}, got {(h, k, r)}"
    if isinstance(dtype, str) or jnp.dtype(dtype) != jnp.bfloat16:
        return f"bf16 q / keys expected, got {dtype}"
    if not gpu:
        return "Mosaic GPU interpret mode cannot run it (register wgmma operands): it runs on a GPU only"
    return None


def seg_attention(q, keys, segments, seg_offset, row_lo, row_hi, sink, freqs, *, scale, gkeys=None,
                  config: SegAttentionConfig | None = None):
    """Mosaic GPU relocated segment attention; same signature as `seg_attention_reference`.

    Supported: h == 64, k == 512, r == 64, bf16 q / keys; anything else raises ValueError
    (the runtime then calls the reference explicitly). Mosaic GPU interpret mode (CPU) cannot
    run it: its wgmma takes A operands from shared memory only, this kernel feeds the rotated
    query and the accumulator's RoPE slice from registers."""
    t, h, k = q.shape
    freqs = jnp.asarray(freqs, jnp.float32)
    seg_offset = jnp.asarray(seg_offset, jnp.int32)
    _check(q, keys, gkeys, segments, seg_offset, row_lo, row_hi, sink, freqs)
    why = seg_attention_unsupported(h, k, 2 * freqs.shape[0], q.dtype)
    if why is None and (keys.dtype != jnp.bfloat16 or (gkeys is not None and gkeys.dtype != jnp.bfloat16)):
        why = f"bf16 q / keys expected, got {q.dtype}, {keys.dtype}"
    if why:
        raise ValueError(f"seg_attention kernel: {why}")
    cfg = config or (DECODE_CONFIG if t <= 8 else PREFILL_CONFIG)
    row_lo = jnp.asarray(row_lo, jnp.int32)
    row_hi = jnp.asarray(row_hi, jnp.int32)
    # intervals are clamped to the segment's static range, so the kernel never reads beyond it
    starts = jnp.asarray([sg.start for sg in segments], jnp.int32)[None]
    ends = jnp.asarray([sg.end for sg in segments], jnp.int32)[None]
    row_lo = jnp.clip(row_lo, starts, ends)
    row_hi = jnp.clip(row_hi, starts, ends)
    # TMA boxes tile rows by 8: a source whose row count is not a multiple of 8 is padded (a copy;
    # callers that keep packed keys 8-row aligned pay nothing)
    pad8 = lambda a: a if a is None or a.shape[0] % 8 == 0 else jnp.pad(a, ((0, -a.shape[0] % 8), (0, 0)))
    keys, gkeys = pad8(keys), pad8(gkeys)
    mats = rotation_tables(seg_offset, freqs)
    o, lse = _kernel_call(q, keys, gkeys, mats, row_lo, row_hi, segments=tuple(segments), scale=float(scale),
                          cfg=cfg)
    # splits and the sink merged once (relocation.merge_partials; XLA fuses it with its consumer)
    o, lse = merge_partials([(o[i].astype(jnp.float32), lse[i]) for i in range(cfg.num_splits)], sink)
    return o.astype(q.dtype), lse


# ----------------------------------------------------------------------------- problems, benchmark
def make_problem(key, *, t: int, doc_len: int, n_docs: int, gathered: int, query_pos: str, m: int = 128,
                 window: int = 128, dtype=jnp.bfloat16):
    """A request-shaped random problem: n_docs documents placed back to back at offsets D_i
    (not multiples of m), each contributing its per-row K=V latents (sliding-window interval)
    and its HCA-style entries (causal visibility interval); optionally `gathered` per-row CSA
    entries (random count per row, already in the absolute frame). query_pos: "decode" (t
    rows after the last document) or "prefill" (the last document's own last t rows).
    Returns (args, kwargs) for seg_attention / seg_attention_reference."""
    ks = jax.random.split(key, 6)
    n_ent = doc_len // m
    offsets = [13 + i * (doc_len + 77) for i in range(n_docs)]
    end = offsets[-1] + doc_len
    if query_pos == "decode":
        pos = end + jnp.arange(t)
    else:
        pos = offsets[-1] + doc_len - t + jnp.arange(t)
    per_doc = doc_len + n_ent
    keys = jax.random.normal(ks[0], (n_docs * per_doc, HEAD_DIM), jnp.float32)
    keys = (keys / jnp.linalg.norm(keys, axis=-1, keepdims=True) * 8.0).astype(dtype)
    q = (jax.random.normal(ks[1], (t, HEADS, HEAD_DIM), jnp.float32) * 0.5).astype(dtype)
    sink = jax.random.normal(ks[2], (HEADS,), jnp.float32)
    segs, offs, lo, hi = [], [], [], []
    for i, d in enumerate(offsets):
        b = i * per_doc
        segs.append(Segment(b, b + doc_len))  # per-row latents: window interval
        offs.append(d)
        lo.append(jnp.clip(pos - d - window + 1, 0, doc_len) + b)
        hi.append(jnp.clip(pos - d + 1, 0, doc_len) + b)
        segs.append(Segment(b + doc_len, b + per_doc))  # entries: visible iff d + (e+1)m - 1 <= pos
        offs.append(d)
        lo.append(jnp.full((t,), b + doc_len))
        hi.append(b + doc_len + jnp.clip((pos - d + 1) // m, 0, n_ent))
    gkeys = None
    if gathered:
        gkeys = (jax.random.normal(ks[3], (t * gathered, HEAD_DIM), jnp.float32) * 0.35).astype(dtype)
        cnt = jax.random.randint(ks[4], (t,), gathered // 2, gathered + 1)
        segs.append(Segment(0, t * gathered, src=1))
        offs.append(0)
        lo.append(jnp.arange(t) * gathered)
        hi.append(jnp.arange(t) * gathered + cnt)
    freqs = 1.0 / (160000.0 ** (np.arange(0, ROPE_DIM, 2, dtype=np.float32) / ROPE_DIM))
    args = (q, keys, tuple(segs), jnp.asarray(offs, jnp.int32), jnp.stack(lo, 1).astype(jnp.int32),
            jnp.stack(hi, 1).astype(jnp.int32), sink, jnp.asarray(freqs))
    return args, {"scale": HEAD_DIM ** -0.5, "gkeys": gkeys}


def attention_flops(row_lo, row_hi) -> float:
    """Useful FLOPs: QK^T and PV over the visible keys (2 * 2 * h * k per key)."""
    n = float(jnp.sum(jnp.maximum(row_hi - row_lo, 0)))
    return 4.0 * HEADS * HEAD_DIM * n


def main(argv=None):
    """Kernel vs XLA reference on the decode and prefill shapes; prints a table, writes JSON.
    (A RedKnot decode step's HCA attention in its two forms, the kernel vs turning every entry
    in XLA: `python -m redknot_jax.reuse.decode`.)"""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    shapes = [
        ("decode t=1, 4 docs x 4096, CSA 512", dict(t=1, doc_len=4096, n_docs=4, gathered=512, query_pos="decode"),
         DECODE_CONFIG),
        ("decode t=4, 8 docs x 8192, CSA 512", dict(t=4, doc_len=8192, n_docs=8, gathered=512, query_pos="decode"),
         DECODE_CONFIG),
        ("prefill t=1024, 2 docs x 4096, CSA 512", dict(t=1024, doc_len=4096, n_docs=2, gathered=512,
                                                         query_pos="prefill"), PREFILL_CONFIG),
        ("prefill t=2048, 1 doc x 8192, no CSA", dict(t=2048, doc_len=8192, n_docs=1, gathered=0,
                                                       query_pos="prefill"), PREFILL_CONFIG),
    ]
    if a.quick:
        shapes = shapes[:1] + shapes[2:3]
    peak = matmul_peak_tflops()  # bf16 matmul peak measured in the same run
    rows = []
    for name, kw, cfg in shapes:
        args, kwargs = make_problem(jax.random.key(0), **kw)
        segs = args[2]
        rest = args[:2] + args[3:]
        ker = jax.jit(lambda *r, g=None: seg_attention(*r[:2], segs, *r[2:], scale=kwargs["scale"], gkeys=g,
                                                       config=cfg))
        ref = jax.jit(lambda *r, g=None: seg_attention_reference(*r[:2], segs, *r[2:], scale=kwargs["scale"],
                                                                 gkeys=g))
        g = kwargs["gkeys"]
        ok, lk = ker(*rest, g=g)
        orf, lr = ref(*rest, g=g)
        err = rel_err(ok, orf)
        lerr = float(jnp.max(jnp.abs(lk - lr)))
        finite = bool(jnp.all(jnp.isfinite(ok.astype(jnp.float32))))
        tk = median_time(ker, *rest, g=g)
        tr = median_time(ref, *rest, g=g)
        fl = attention_flops(args[4], args[5])
        rows.append(dict(shape=name, config=dataclasses.asdict(cfg), rel_err_o=err, max_abs_err_lse=lerr,
                         finite=finite, kernel_ms=tk * 1e3, xla_ms=tr * 1e3, speedup=tr / tk,
                         kernel_tflops=fl / tk / 1e12, xla_tflops=fl / tr / 1e12,
                         kernel_frac_of_peak=fl / tk / 1e12 / peak))
        print(f"{name:42s} err {err:.2e} lse {lerr:.1e} kernel {tk * 1e3:8.3f} ms  xla {tr * 1e3:8.3f} ms  "
              f"x{tr / tk:5.2f}  {fl / tk / 1e12:6.1f} TFLOP/s ({fl / tk / 1e12 / peak:.0%} of {peak:.0f})",
              flush=True)
    return record("seg_attention", a.json, argv, bf16_matmul_peak_tflops=peak, rows=rows)


if __name__ == "__main__":
    main()
