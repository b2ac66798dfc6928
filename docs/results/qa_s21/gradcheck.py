# which parameters get gradient from far-recall targets (shipped model, CPU)
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from redknot_jax.quality import data as D
from redknot_jax.quality.train import TrainConfig, Trainer, load_model, forward_train
m = load_model("redknot_jax/assets/qa_model")
toks, meta = D.recall_probe("val", 1, 5, D.Curriculum(3, 3, 32, 8), 512)
w = np.zeros((1, 512), np.float32)
for span, dist, ch in meta[0]:
    if dist >= 256:
        w[0, span] = 1.0
print("far targets", int(w.sum()))
graphdef, params, rest = nnx.split(m, nnx.Param, ...)
def loss(params):
    mm = nnx.merge(graphdef, params, rest)
    logits, _, _ = forward_train(mm, jnp.asarray(toks[:, :-1]), 512)
    lp = jax.nn.log_softmax(logits, -1)
    tgt = jnp.asarray(toks[:, 1:])
    nll = -jnp.take_along_axis(lp, tgt[..., None], -1)[..., 0]
    return (nll * w).sum() / w.sum(), logits
(l, logits), g = jax.value_and_grad(loss, has_aux=True)(params)
pred = np.asarray(jnp.argmax(logits, -1))[0]
print("loss", float(l), "acc", float((pred[w[0] > 0] == toks[0, 1:][w[0] > 0]).mean()))
flat = nnx.to_flat_state(g)
rows = []
for path, v in flat:
    name = ".".join(str(x) for x in path)
    rows.append((name, float(jnp.linalg.norm(v.get_value()))))
for name, n in rows:
    if "compressor" in name or "indexer" in name or ("layers.4." in name and "attn" in name):
        print(f"{n:10.3e} {name}")
