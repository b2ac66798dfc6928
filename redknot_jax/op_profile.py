"""Op-level summary of a `jax.profiler` trace: where one layer's device time goes.

`summarize(trace_dir)` reads the trace's XSpace (`*.xplane.pb`) through `jax.profiler.ProfileData`
and sums the executed XLA ops' durations:
* on a GPU, only the device planes: a plane's "XLA Ops" line where the trace has one (a line
  xprof derives, one event per executed HLO op), else the kernel events of its stream lines
  that carry an `hlo_op` statistic (each kernel's time goes to the op that launched it);
* on a CPU (no device plane), the host events that carry an `hlo_op` statistic (the thunk
  executor's, one per executed op).
Control-flow ops (`while`, `conditional`, `call`) are left out: their bodies' ops are counted
on their own, so the sum covers each executed op once.
Each op goes to a category by the first keyword of CATEGORIES found in its name (e.g.
`gemm_fusion_dot.2` is `matmul`, `sort.1` is `sort / top-k`); a name that says nothing (a
`custom-call.N`) is read through its custom-call target in the HLO text (`long_name`), or the
kernel's name (`__cublas$gemm` is `matmul`, a Mosaic GPU call is `custom kernel`). Operand
names in the HLO text are never read: a fusion that consumes a dot is not a matmul.
Categories are a reading aid; `top` lists the ops by their own names, which is what to look
up in the HLO.
"""

from __future__ import annotations

import collections
import pathlib
import re

CATEGORIES = (  # (category, keywords): the first category with a keyword in the op's text wins
    ("collective", ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "nccl")),
    ("custom kernel", ("mosaic", "pallas", "triton_kernel", "__gpu$xla.gpu.triton")),
    ("matmul", ("gemm", "cublas", "dot", "convolution", "ynn_fusion", "matmul")),
    ("sort / top-k", ("sort", "topk", "top-k")),
    ("gather / scatter", ("gather", "scatter", "dynamic-slice", "dynamic_slice", "dynamic-update-slice",
                          "dynamic_update_slice")),
    ("copy / transpose", ("copy", "transpose", "concatenate", "pad")),
    ("reduction", ("reduce",)),
    ("elementwise fusion", ("fusion", "loop", "convert", "multiply", "add", "exp")),
)


def category(text: str) -> str:
    t = text.lower()
    for name, keys in CATEGORIES:
        if any(k in t for k in keys):
            return name
    return "other"


def op_category(op: str, text: str) -> str:
    """An executed op's category from its name, else (a custom call, an unnamed kernel) from its
    custom-call target in the HLO text, or the text itself when that is a kernel's name."""
    cat = category(op)
    if cat != "other":
        return cat
    target = re.search(r'custom_call_target="([^"]+)"', text)
    if target:
        return category(target.group(1))
    return "other" if "=" in text else category(text)  # HLO text names only operands; a kernel name is read


CONTAINERS = ("while", "conditional", "call")  # ops whose time is their bodies' ops'


def _container(op: str) -> bool:
    head = op.split(".")[0].split(" ")[0].lower()
    return head in CONTAINERS


def _xplane(trace_dir) -> pathlib.Path:
    found = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"))
    if not found:
        raise FileNotFoundError(f"op_profile: no *.xplane.pb under {trace_dir} (was a jax.profiler trace written?)")
    return found[-1]


def op_events(trace_dir) -> list[tuple[str, str, str, float]]:
    """(op name, HLO module, HLO text, duration ms) of every executed XLA op in the trace."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(_xplane(trace_dir)))
    devices = [p for p in data.planes if p.name.startswith("/device:")]
    lines = []
    for plane in devices or data.planes:
        ops_line = [ln for ln in plane.lines if ln.name == "XLA Ops"]
        lines += ops_line or list(plane.lines)
    out = []
    for line in lines:
        for e in line.events:
            st = dict(e.stats)
            if line.name == "XLA Ops":
                out.append((e.name, str(st.get("hlo_module", "")), str(st.get("long_name", e.name)),
                            e.duration_ns / 1e6))
            elif "hlo_op" in st:
                out.append((str(st["hlo_op"]), str(st.get("hlo_module", "")), e.name, e.duration_ns / 1e6))
    return out


def summarize(trace_dir, top: int = 15) -> dict:
    """{"ops_ms": total, "ops": count, "by_category": {name: ms}, "top": [{op, module, category,
    ms, count}]} of the trace under `trace_dir`, largest first."""
    evs = [e for e in op_events(trace_dir) if not _container(e[0])]
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_op: dict[tuple[str, str], list] = {}
    for name, module, text, ms in evs:
        cat = op_category(name, text)
        by_cat[cat] += ms
        acc = by_op.setdefault((name, module), [0.0, 0, cat])
        acc[0] += ms
        acc[1] += 1
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    return {"ops_ms": sum(ms for *_, ms in evs), "ops": len(evs),
            "by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top": [{"op": n, "module": m, "category": c, "ms": ms, "count": k} for (n, m), (ms, k, c) in ranked]}
