"""Training the QA model with optax on the project's own modules (issue 10).

Forward (`forward_train`): the same computation as `Model.forward` over a full row from an
empty cache (embedding, per block: mHC pre -> attn_norm -> `Attention` -> mHC post -> mHC pre
-> ffn_norm -> MoE -> mHC post, then `Model.logits`), written as the block loop so that two
things can be read on the way:

* **Lightning Indexer loss.** Top-k selection is not differentiable, so the next-token loss
  gives the indexer (its query projection, head weights and its own compressor) no gradient at
  all. As in DeepSeek-V3.2 / V4, the indexer is trained by an auxiliary KL divergence: for every
  CSA layer and query row, the target is the main heads' attention distribution over all
  visible compressed entries (dense, softmax per head, averaged over heads, stop-gradient), and
  the prediction is the softmax of the indexer scores over the same entries. The indexer's
  inputs are detached, so this loss trains the indexer only and the next-token loss trains
  everything else (the main attention sees only the entries the indexer selects).
* **MoE routing statistics** for the auxiliary-loss-free balancing of the learned layers
  (DeepSeek-V3/V4): after each step the selection bias of expert e moves by
  `bias_rate * sign(mean load - load_e)`; the bias only affects which experts are chosen, so it
  gets no gradient.

The routed experts are evaluated densely in training (every expert on every token, multiplied
by the router's top-k weight, zero for unselected experts): the same sum as `MoE.experts`
(`tests/quality` checks the logits equal `Model.forward`'s), but one batched matmul per weight
instead of the inference path's tiled scan, which is built for long prefill, not backward.

Loss: next-token cross-entropy weighted per target (answer tokens and their <eos> 1, other
tokens `other_weight`, padding 0) + `indexer_coef` x mean indexer KL.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib

import numpy as np
import jax
import jax.numpy as jnp
import ml_dtypes
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

from redknot_jax import weights as W
from redknot_jax.config import ModelConfig
from redknot_jax.indexer import index_scores
from redknot_jax.mhc import HyperConnection
from redknot_jax.model import Model
from redknot_jax.moe import swiglu

HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- forward
def moe_dense(ffn, x, ids):
    """`MoE.__call__` without fan-out, experts evaluated densely. x [b, t, d] -> (y [b, t, d]
    in x's dtype, per-expert assignment counts [e])."""
    b, t, d = x.shape
    xf, idf = x.reshape(b * t, d), ids.reshape(b * t)
    sel, wts, _ = ffn.route(xf, idf)
    n = xf.shape[0]
    gate = jnp.zeros((n, ffn.e), jnp.float32).at[jnp.arange(n)[:, None], sel].add(wts)  # [n, e]
    g = jnp.einsum("nd,edf->nef", xf, ffn.w1[...], precision=HIGHEST)
    u = jnp.einsum("nd,edf->nef", xf, ffn.w3[...], precision=HIGHEST)
    h = swiglu(g, u, ffn.limit) * gate[:, :, None]  # weight before w2: sum_e w_e (h_e @ w2_e)
    y = jnp.einsum("nef,efd->nd", h.astype(x.dtype), ffn.w2[...], preferred_element_type=jnp.float32,
                   precision=HIGHEST)
    y = (y + ffn.shared(xf)).astype(x.dtype)
    load = jnp.zeros((ffn.e,), jnp.float32).at[sel.reshape(-1)].add(1.0)
    return y.reshape(b, t, d), jax.lax.stop_gradient(load)


def indexer_kl(attn, xa, entries, freqs):
    """Mean over query rows (with at least one visible entry) of KL(main heads' attention over
    the compressed entries || softmax of the indexer scores). xa [b, t, d] is the attention
    input (detached here); entries [b, >= t/m, k] the layer's CSA entries."""
    b, t, _ = xa.shape
    xs = jax.lax.stop_gradient(xa)
    m = attn.indexer.m
    nw = t // m
    pos0 = jnp.zeros((b,), jnp.int32)
    pos = pos0[:, None] + jnp.arange(t)
    q, cq = attn.query(xs, pos, freqs)
    q, cq = jax.lax.stop_gradient(q), jax.lax.stop_gradient(cq)
    ent = jax.lax.stop_gradient(entries[:, :nw]).astype(q.dtype)
    vis = jnp.arange(nw)[None, None, :] < ((pos + 1) // m)[..., None]  # [b, t, w]
    lg = jnp.einsum("bthk,bwk->bthw", q, ent, preferred_element_type=jnp.float32, precision=HIGHEST)
    lg = jnp.where(vis[:, :, None, :], lg * attn.k ** -0.5, -jnp.inf)
    target = jnp.mean(jax.nn.softmax(lg, axis=-1), axis=2)  # [b, t, w]
    target = jax.lax.stop_gradient(jnp.where(vis, target, 0.0))
    keys, _, _ = attn.indexer.compressor(xs, pos0, jnp.full((b,), t, jnp.int32),
                                         attn.indexer.compressor.init_state(b), freqs)
    iq, iw = attn.indexer.queries(xs, cq, pos, freqs)
    s = index_scores(iq, iw, keys[:, :nw])
    logp = jax.nn.log_softmax(jnp.where(vis, s, -jnp.inf), axis=-1)
    kl = jnp.sum(jnp.where(vis & (target > 0), target * (jnp.log(jnp.maximum(target, 1e-30)) - logp), 0.0), -1)
    rows = jnp.any(vis, -1).astype(jnp.float32)
    return jnp.sum(kl * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def forward_train(model: Model, ids, block: int = 512, dense_moe: bool = True):
    """Logits [b, t, vocab] of every row of ids [b, t] (a prefill from position 0), the
    indexer KL of each CSA layer and the expert loads of each learned MoE layer."""
    cfg = model.cfg
    b, t = ids.shape
    step = math.lcm(cfg.csa_rate, cfg.hca_rate)
    cache = model.init_cache(b, -(-t // step) * step)
    pos0, n_new = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)
    block = min(block, t)
    x = model.embed_streams(ids)
    kls, loads = {}, {}
    for i, blk in enumerate(model.layers):
        freqs = model.freqs(i)
        u, post, comb = blk.hc_attn.pre(x)
        xa = blk.attn_norm(u)
        a, c = blk.attn(xa, pos0, n_new, cache["layers"][i], freqs, block)
        if blk.attn.indexer is not None:
            kls[i] = indexer_kl(blk.attn, xa, c["entries"], freqs)
        x = HyperConnection.post(x, a, post, comb)
        u, post, comb = blk.hc_ffn.pre(x)
        if dense_moe:
            y, load = moe_dense(blk.ffn, blk.ffn_norm(u), ids)
            if not blk.ffn.is_hash:
                loads[i] = load
        else:
            y = blk.ffn(blk.ffn_norm(u), ids)
        x = HyperConnection.post(x, y, post, comb)
    rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return model.logits(x, rows), kls, loads


# ----------------------------------------------------------------------------- loss / step
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup_frac: float = 0.03
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.05
    clip: float = 1.0
    indexer_coef: float = 0.1
    bias_rate: float = 1e-3
    block: int = 512
    compute_dtype: str = "float32"  # "bfloat16": mixed precision (see Trainer)

    def __post_init__(self):
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainConfig.compute_dtype: expected 'float32' or 'bfloat16', got {self.compute_dtype!r}")


def answer_stats(logits, targets, w, eos_id: int):
    """(weighted next-token CE, answer CE, answer_acc, span_acc) of logits [b, t, v] against
    targets [b, t] with per-target weights w (answer tokens and their <eos> weigh >= 1).
    answer_acc counts the answer tokens and their <eos>; span_acc the answer tokens alone: the
    <eos> is right almost from the start (answer_acc = (span_acc + 1) / 2 for one-token
    answers), so span_acc is the figure to compare with chance."""
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    lm = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-6)
    ans = w >= 1.0
    span = ans & (targets != eos_id)
    hit = jnp.argmax(logits, -1) == targets
    mean_over = lambda x, m: jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1)
    return lm, mean_over(ce, ans), mean_over(hit, ans), mean_over(hit, span)


def lr_at(tc: TrainConfig, frac: float) -> float:
    """Linear warm-up then cosine decay to min_lr_frac, by the fraction of the training budget
    used (time or steps, whichever the caller budgets)."""
    frac = min(max(frac, 0.0), 1.0)
    if frac < tc.warmup_frac:
        return tc.lr * (frac / tc.warmup_frac)
    p = (frac - tc.warmup_frac) / max(1e-9, 1 - tc.warmup_frac)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(tc: TrainConfig):
    """Adam with global-norm clipping over the flat parameter vector, without its learning
    rate or weight decay (the step applies lr, a traced scalar so the schedule can follow
    wall-clock time, and decoupled decay on matrices). One flat vector instead of ~360 leaves
    keeps the compiled step small: per-leaf optimizer updates were thousands of tiny kernels."""
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.scale_by_adam(b1=tc.b1, b2=tc.b2))


def _roll_sinkhorn(model: Model) -> None:
    """Sinkhorn as a loop, not unrolled: a small program to compile (mhc.sinkhorn)."""
    for _, m in nnx.iter_graph(model):
        if isinstance(m, HyperConnection):
            m.unroll_sinkhorn = False


class Trainer:
    """Functional training state over one model: (params, rest, opt_state), a jitted step.

    Parameters, gradients and the optimizer stay fp32. With `TrainConfig.compute_dtype =
    "bfloat16"` the forward (training and evaluation) runs the model as it is served: every
    parameter cast to the dtype a bf16 `Model` gives it (mHC, sinks and the like stay fp32) and
    the modules built for bf16, so matmuls take bf16 operands (tensor cores on a GPU) with fp32
    accumulation; the casts are differentiable, so fp32 master weights get the gradients."""

    def __init__(self, model: Model, tc: TrainConfig = TrainConfig()):
        self.cfg, self.tc = model.cfg, tc
        _roll_sinkhorn(model)
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self._dtypes = None
        if tc.compute_dtype == "bfloat16":
            shadow = nnx.eval_shape(lambda: Model(model.cfg, jnp.bfloat16))
            self._dtypes = jax.tree.map(lambda v: v.dtype, nnx.split(shadow, nnx.Param, ...)[1])
        flat, self._unravel = ravel_pytree(self.params)
        # decoupled weight decay on matrices only, as a flat 0/1 vector (an argument, not a constant)
        self.decay = ravel_pytree(jax.tree.map(lambda p: jnp.full(p.shape, p.ndim >= 2, p.dtype), self.params))[0]
        self.tx = make_optimizer(tc)
        self.opt_state = self.tx.init(flat)
        self._step = self.step_fn()
        self._eval_graphdef = self._compute_graphdef()
        self._eval = jax.jit(self._eval_logits)

    def model(self) -> Model:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def step_fn(self, index_topk: int | None = None):
        """The jitted train step (assign it to `_step` to use it). index_topk: the CSA layers'
        top-k during these steps (None: the model's own). A top-k that covers every compressed
        entry makes CSA attention dense (`Attention` attends every visible entry): the dense
        warm-up. Top-k selection gives the main attention a gradient only through the entries
        the indexer already picks, and the indexer learns from the main attention's
        distribution; dense steps break that circle (DeepSeek-V3.2 warms its indexer up with
        dense attention too). Parameters are the same either way."""
        return jax.jit(functools.partial(self._train_step, self._compute_graphdef(index_topk)),
                       donate_argnums=(0, 2))

    def _compute_graphdef(self, index_topk: int | None = None):
        """The graph the forward runs: the model's own, or (compute_dtype "bfloat16") a bf16
        model's; with index_topk its CSA layers' top-k set to that."""
        if index_topk is None and self._dtypes is None:
            return self.graphdef
        model = self.model() if self._dtypes is None else nnx.eval_shape(lambda: Model(self.cfg, jnp.bfloat16))
        _roll_sinkhorn(model)
        for blk in model.layers:
            if index_topk is not None and blk.attn.indexer is not None:
                blk.attn.indexer.topk = int(index_topk)
        return nnx.split(model, nnx.Param, ...)[0]

    def _compute_params(self, params):
        """params as the forward takes them (cast to the compute dtypes; fp32 ones stay)."""
        if self._dtypes is None:
            return params
        return jax.tree.map(lambda p, d: p.astype(d), params, self._dtypes)

    def _loss(self, graphdef, params, rest, tokens, w):
        model = nnx.merge(graphdef, self._compute_params(params), rest)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits, kls, loads = forward_train(model, inputs, self.tc.block)
        lm, ans_ce, acc, span_acc = answer_stats(logits, targets, w, model.cfg.eos_token_id)
        ikl = jnp.mean(jnp.stack(list(kls.values()))) if kls else jnp.zeros(())
        return lm + self.tc.indexer_coef * ikl, (lm, ikl, ans_ce, acc, span_acc, loads)

    def _train_step(self, graphdef, params, rest, opt_state, tokens, w, lr, decay):
        (loss, (lm, ikl, ans_ce, acc, span_acc, loads)), grads = jax.value_and_grad(self._loss, argnums=1, has_aux=True)(
            graphdef, params, rest, tokens, w)
        g, p = ravel_pytree(grads)[0], ravel_pytree(params)[0]
        gnorm = jnp.linalg.norm(g)
        u, opt_state = self.tx.update(g, opt_state, p)
        params = self._unravel(p - lr * (u + self.tc.weight_decay * decay * p))
        if loads:  # aux-loss-free balancing of the learned routers
            model = nnx.merge(graphdef, params, rest)
            for i, load in loads.items():
                bias = model.layers[i].ffn.bias
                bias[...] = bias[...] + self.tc.bias_rate * jnp.sign(jnp.mean(load) - load)
            _, params, _ = nnx.split(model, nnx.Param, ...)
        stats = {"loss": loss, "lm": lm, "indexer_kl": ikl, "answer_ce": ans_ce, "answer_acc": acc,
                 "span_acc": span_acc, "grad_norm": gnorm}
        return params, opt_state, stats

    def step(self, tokens, w, lr: float):
        self.params, self.opt_state, stats = self._step(self.params, self.rest, self.opt_state,
                                                        jnp.asarray(tokens), jnp.asarray(w),
                                                        jnp.asarray(lr, jnp.float32), self.decay)
        return stats

    def _eval_logits(self, params, rest, inputs):
        model = nnx.merge(self._eval_graphdef, self._compute_params(params), rest)
        return forward_train(model, inputs, self.tc.block)[0]

    def logits(self, inputs):
        return self._eval(self.params, self.rest, jnp.asarray(inputs))

    def round_to_bf16(self):
        """Round every parameter the shipped checkpoint stores in bf16 (see `hub_tensors`), so
        that evaluation after this sees exactly the shipped weights."""
        keep = _f32_paths(self.cfg)
        flat = nnx.to_flat_state(self.params)
        for path, var in flat:
            v = var.get_value()
            if ".".join(str(x) for x in path) not in keep and jnp.issubdtype(v.dtype, jnp.floating):
                var.set_value(v.astype(jnp.bfloat16).astype(v.dtype))
        self.params = nnx.from_flat_state(flat)


# ----------------------------------------------------------------------------- checkpoint
def _f32_paths(cfg: ModelConfig) -> set[str]:
    """Parameter paths the hub stores in fp32 (mHC, sinks, ape, router bias)."""
    out = set()
    for hub in W._HUB_F32:
        if hub in W._TOP:
            out.add(W._TOP[hub])
        else:
            for i in range(cfg.num_layers):
                out.add(f"layers.{i}.{W._LAYER[hub]}")
    return out


def hub_tensors(model: Model) -> dict[str, np.ndarray]:
    """The model's parameters under hub keys ([out, in] per expert), floating tensors in bf16
    except the ones the hub keeps in fp32; the hash table as int32."""
    cfg = model.cfg
    leaves = {k: np.asarray(v.get_value()) for k, v in W.param_leaves(model).items()}
    want = W.expected_hub_shapes(cfg, model)
    out = {}
    for key in want:
        tgt = W.hub_target(key)
        arr = leaves[tgt.path]
        if tgt.expert is not None:
            arr = arr[tgt.expert].T
        if W.hub_format(key) == "f32":
            arr = arr.astype(np.float32)
        elif arr.dtype.kind == "f":
            arr = arr.astype(ml_dtypes.bfloat16)
        out[key] = np.ascontiguousarray(arr)
    return out


def save_checkpoint(model: Model, directory, shard_bytes: int = 12 << 20, metadata=None) -> list[str]:
    """Write hub-layout safetensors shards (each under shard_bytes) + config.json; returns the
    file names. Loadable by `weights.load_checkpoint` (so by the server with --checkpoint)."""
    from checkpoints_convert.safetensors_io import write_safetensors

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = hub_tensors(model)
    shards, cur, size = [], {}, 0
    for key in sorted(tensors, key=_key_order):
        nb = tensors[key].nbytes
        if cur and size + nb > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[key] = tensors[key]
        size += nb
    shards.append(cur)
    names = []
    for old in d.glob("model-*.safetensors"):
        old.unlink()
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(d / name, sh, metadata={"format": "pt", **(metadata or {})})
        names.append(name)
    (d / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=1))
    return names


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}answer :{% endif %}")


def write_serving_files(directory) -> list[str]:
    """What a server needs beside the weights: tokenizer.json (the task's word-level vocabulary),
    chat_template.jinja (the messages' contents, then `answer :`: a user message `question :
    where does ka lo live ?` becomes the task's question row) and redknot_profile.json (the QA
    model's default RedKnot profile, read by the server's `--profile auto`)."""
    from redknot_jax.quality.data import tokenizer_json
    from redknot_jax.quality.model_config import PROFILE_FILE, qa_profile

    d = pathlib.Path(directory)
    cfg = ModelConfig.from_json(d / "config.json")
    (d / "tokenizer.json").write_text(tokenizer_json())
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (d / PROFILE_FILE).write_text(json.dumps(qa_profile(cfg.num_layers, cfg.sliding_window).to_dict(), indent=1))
    return ["tokenizer.json", "chat_template.jinja", PROFILE_FILE]


def _key_order(key: str):
    parts = key.split(".")
    return (int(parts[1]) if parts[0] == "layers" else -1, key)


def load_model(directory, dtype=jnp.float32, progress=None) -> Model:
    """A `Model` from a checkpoint directory written by `save_checkpoint` (or any hub /
    transformers safetensors directory with config.json); `progress` as `weights.load_checkpoint`'s."""
    cfg = ModelConfig.from_json(pathlib.Path(directory) / "config.json")
    model = Model(cfg, dtype)
    W.load_checkpoint(model, cfg, directory, progress=progress)
    return model


# ----------------------------------------------------------------------------- teacher-forced eval
def distance_bucket(distance: int, window: int) -> str:
    """"inside" the sliding window (< window tokens back), "1-2 windows" or "beyond 2 windows"
    (only compressed entries reach the last two)."""
    return "inside" if distance < window else "1-2 windows" if distance < 2 * window else "beyond 2 windows"


def by_distance(records, window: int) -> dict:
    """`teacher_forced_scores` records grouped by question type and `distance_bucket`:
    {"lookup inside": {"n", "em", "chance"}, ...}."""
    res = {}
    for r in records:
        d = res.setdefault(f"{r['qtype']} {distance_bucket(r['distance'], window)}", {"n": 0, "em": 0.0, "chance": 0.0})
        d["n"] += 1
        d["em"] += r["em"]
        d["chance"] += r["chance"]
    for d in res.values():
        d["em"] = round(d["em"] / d["n"], 3)
        d["chance"] = round(d["chance"] / d["n"], 3)
    return dict(sorted(res.items()))


def recall_scores(trainer: Trainer, tokens, meta, batch: int, window: int):
    """Teacher-forced accuracy of `quality.data.recall_probe` rows by how far back the stated
    value lies (`distance_bucket`). A query counts when the argmax of every target of its value
    is right. Per bucket: n, acc and the mean in-context chance."""
    res = {}
    for s in range(0, len(tokens), batch):
        arr = np.asarray(tokens[s:s + batch])
        arr = np.concatenate([arr, np.repeat(arr[-1:], batch - len(arr), 0)])
        pred = np.asarray(jnp.argmax(trainer.logits(arr[:, :-1]), -1))
        for j, queries in enumerate(meta[s:s + batch]):
            for span, dist, chance in queries:
                key = distance_bucket(dist, window)
                d = res.setdefault(key, {"n": 0, "acc": 0.0, "chance": 0.0})
                d["n"] += 1
                d["acc"] += float((pred[j, span] == arr[j, np.asarray(span) + 1]).all())
                d["chance"] += chance
    for d in res.values():
        d["acc"] /= d["n"]
        d["chance"] /= d["n"]
    return res


def teacher_forced_scores(trainer: Trainer, episodes, seq_len: int, batch: int, records: list | None = None,
                          by_relation: bool = False):
    """Greedy-equivalent EM per question type, each question in a row of its own (the world's
    documents, then that question: what a served request sees): a question counts as exact when
    the argmax of every target of its answer span and of the <eos> after it is the gold token
    (exactly what greedy decoding would then emit). Also per-token accuracy and the
    mean in-context chance (`QA.chance`), the EM to compare with.
    `records`: a list to which one dict per question is appended (qtype, relation, em, the
    question's in-context chance `QA.chance`, and
    `distance`: tokens from the answer back to the start of the farthest fact it needs; beyond
    the sliding window only compressed entries reach it).
    `by_relation`: also one entry per question type and relation, keyed "lookup:city" etc."""
    from redknot_jax.quality.data import Episode, fact_distance, teacher_forced_rows

    rows, meta = [], []
    for ep in episodes:
        # one row per question, as a served request: no earlier question's answer in view (with
        # several per row, a repeated question could be copied and answered ones eliminated)
        for qa in ep.qas:
            r = teacher_forced_rows(Episode(ep.docs, [qa]), seq_len)
            if r is None:
                continue
            rows.append(r[0])
            meta.append((r[1], r[2]))
    res = {}
    for s in range(0, len(rows), batch):
        chunk = rows[s:s + batch]
        pad = batch - len(chunk)
        arr = np.stack(chunk + [chunk[-1]] * pad)
        pred = np.asarray(jnp.argmax(trainer.logits(arr[:, :-1]), -1))
        for j, (qas, spans) in enumerate(meta[s:s + batch]):
            for qa, span in zip(qas, spans):
                ok = pred[j, span] == arr[j, np.asarray(span) + 1]
                for key in (qa.qtype, f"{qa.qtype}:{qa.relation}")[:1 + by_relation]:
                    d = res.setdefault(key, {"n": 0, "em": 0.0, "token_acc": 0.0, "chance": 0.0})
                    d["n"] += 1
                    d["em"] += float(ok.all())
                    d["token_acc"] += float(ok.mean())
                    d["chance"] += qa.chance
                if records is not None:
                    records.append({"qtype": qa.qtype, "relation": qa.relation, "em": float(ok.all()),
                                    "chance": qa.chance,
                                    "distance": fact_distance(arr[j], qa, span[0] + 1)})
    for d in res.values():
        for k in ("em", "token_acc", "chance"):
            d[k] /= max(1, d["n"])
    return res
