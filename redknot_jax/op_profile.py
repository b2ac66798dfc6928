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

Given the XLA dump of the traced programs (`hlo_dump`: the `--xla_dump_to` directory of a run
with `--xla_dump_hlo_as_text`; `dump_flags` says what to set), each top op also names the JAX
operation and the source line it came from (the op's `metadata` in the optimized HLO text of its
module, found by the event's program id, else by module name and op text), and `by_source` sums
the ops by source line: where in this repository the layer's time goes. `idle_ms` is the device
time between the first op's start and the last op's end in which no op ran (a device waiting on
the host: a loop condition or branch index copied back, a dispatch gap); `gaps` names the ops
on either side of that time.
"""

from __future__ import annotations

import collections
import functools
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


def op_events(trace_dir) -> list[tuple[str, str, str, float, int, str]]:
    """(op name, HLO module, HLO text, duration ms, start ns, program id or "") of every executed
    XLA op in the trace."""
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
                op, text = e.name, str(st.get("long_name", e.name))
            elif "hlo_op" in st:
                op, text = str(st["hlo_op"]), e.name
            else:
                continue
            out.append((op, str(st.get("hlo_module", "")), text, e.duration_ns / 1e6, int(e.start_ns),
                        str(st.get("program_id", ""))))
    return out


def dump_flags(directory) -> str:
    """The XLA_FLAGS that make XLA write what `summarize(hlo_dump=directory)` reads (set before
    JAX starts its backend)."""
    return f"--xla_dump_to={directory} --xla_dump_hlo_as_text"


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")


@functools.lru_cache(maxsize=64)
def _hlo_module(path: str) -> tuple[dict, dict]:
    """An optimized-HLO text file read once: ({op: (metadata op_name, source)}, {op: its text up
    to the metadata}). A source is the op's innermost three stack frames, "file:line (function)"
    joined by " < " (callers last), paths cut to the part from the repository's package
    (redknot_jax/...) or the file name; "" without stack frames."""
    text = pathlib.Path(path).read_text()
    table = lambda name: dict(re.findall(rf"^(\d+) (.*)$", text.split(f"\n{name}\n", 1)[1].split("\n\n", 1)[0],
                                         re.M)) if f"\n{name}\n" in text else {}
    files = {k: v.strip('"') for k, v in table("FileNames").items()}
    funcs = {k: v.strip('"') for k, v in table("FunctionNames").items()}
    locs, frames = table("FileLocations"), table("StackFrames")

    def where(frame: str) -> str:
        loc = re.search(r"file_location_id=(\d+)", frames.get(frame, ""))
        fields = dict(re.findall(r"(\w+)=(\d+)", locs.get(loc.group(1), ""))) if loc else {}
        if "file_name_id" not in fields:
            return ""
        f = files.get(fields["file_name_id"], "?")
        f = f[f.index("redknot_jax/"):] if "redknot_jax/" in f else f.rsplit("/", 1)[-1]
        return f"{f}:{fields.get('line', '?')} ({funcs.get(fields.get('function_name_id'), '?')})"

    def source(frame: str, depth: int = 3) -> str:  # the innermost frames, callers after " < "
        out = []
        while frame in frames and len(out) < depth:
            out.append(where(frame))
            parent = re.search(r"parent_frame_id=(\d+)", frames[frame])  # 1 + the parent's id; 0: none
            frame = str(int(parent.group(1)) - 1) if parent else ""
        return " < ".join(x for x in out if x)

    meta, body = {}, {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        rest = m.group(2)
        name = re.search(r'metadata=\{[^}]*op_name="([^"]*)"', rest)
        frame = re.search(r"metadata=\{[^}]*stack_frame_id=(\d+)", rest)
        meta[m.group(1)] = (name.group(1) if name else "", source(frame.group(1)) if frame else "")
        body[m.group(1)] = rest.split(", metadata=")[0]
    return meta, body


def _dump_files(hlo_dump) -> dict[str, list[tuple[str, str]]]:
    """{module name: [(program id, optimized HLO file)]} of an XLA dump directory."""
    out = collections.defaultdict(list)
    for f in sorted(pathlib.Path(hlo_dump).glob("module_*after_optimizations.txt")):
        m = re.match(r"module_(\d+)\.([^.]+)\..*after_optimizations\.txt$", f.name)
        if m:
            out[m.group(2)].append((str(int(m.group(1))), str(f)))
    return out


def op_source(files: dict, op: str, module: str, text: str, program: str) -> tuple[str, str]:
    """(JAX op name, source) of an executed op from the dump (`_dump_files`): its module's by
    program id, else the module of that name whose op of that name has the event's text, else
    the first that has the op; ("", "") when none has it."""
    cands = [f for _, f in files.get(module, [])]
    by_id = [f for pid, f in files.get(module, []) if pid == program]
    body_of = lambda t: t.split(" = ", 1)[-1].split(", metadata=")[0]
    for f in by_id or cands:
        meta, body = _hlo_module(f)
        if op in meta and (by_id or len(cands) == 1 or body_of(text) == body[op]):
            return meta[op]
    for f in cands:
        meta, _ = _hlo_module(f)
        if op in meta:
            return meta[op]
    return "", ""


def _idle(evs, top: int) -> tuple[float, list[dict]]:
    """Milliseconds between the first op's start and the last op's end covered by no op, and the
    `top` (op before, op after) pairs around those gaps by idle time ({"after", "before", "ms",
    "count"}): what the device waited behind."""
    spans = sorted((start, start + ms * 1e6, name) for name, _, _, ms, start, _ in evs)
    pairs: dict[tuple[str, str], list] = {}
    reach, last = (spans[0][1], spans[0][2]) if spans else (0.0, "")
    for a, b, name in spans[1:]:
        if a > reach:
            acc = pairs.setdefault((last, name), [0.0, 0])
            acc[0] += (a - reach) / 1e6
            acc[1] += 1
        if b >= reach:
            reach, last = b, name
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][0])
    return (sum(ms for ms, _ in pairs.values()),
            [{"after": x, "before": y, "ms": ms, "count": k} for (x, y), (ms, k) in ranked[:top]])


def summarize(trace_dir, top: int = 15, hlo_dump=None) -> dict:
    """{"ops_ms": total, "ops": count, "idle_ms", "gaps" (`_idle`), "by_category": {name: ms},
    "top": [{op, module, category, ms, count}]} of the trace under `trace_dir`, largest first;
    with `hlo_dump` (see the module doc) each top op also has "op_name" and "source", and
    "by_source" lists the `top` source lines by ms ({"source", "ms", "ops"})."""
    evs = [e for e in op_events(trace_dir) if not _container(e[0])]
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_op: dict[tuple[str, str], list] = {}
    for name, module, text, ms, _, program in evs:
        cat = op_category(name, text)
        by_cat[cat] += ms
        acc = by_op.setdefault((name, module), [0.0, 0, cat, text, program])
        acc[0] += ms
        acc[1] += 1
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][0])
    idle_ms, gaps = _idle(evs, top)
    out = {"ops_ms": sum(e[3] for e in evs), "ops": len(evs), "idle_ms": idle_ms, "gaps": gaps,
           "by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
           "top": [{"op": n, "module": m, "category": c, "ms": ms, "count": k}
                   for (n, m), (ms, k, c, *_) in ranked[:top]]}
    if hlo_dump is not None:
        files = _dump_files(hlo_dump)
        src = {key: op_source(files, key[0], key[1], text, program) for key, (*_, text, program) in ranked}
        for t in out["top"]:
            t["op_name"], t["source"] = src[(t["op"], t["module"])]
        lines: dict[str, list] = {}
        for key, (ms, k, *_) in ranked:
            acc = lines.setdefault(src[key][1] or "(no source)", [0.0, 0])
            acc[0] += ms
            acc[1] += k
        out["by_source"] = [{"source": s, "ms": ms, "ops": k}
                            for s, (ms, k) in sorted(lines.items(), key=lambda kv: -kv[1][0])[:top]]
    return out
