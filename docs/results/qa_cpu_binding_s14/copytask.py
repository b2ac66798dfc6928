import sys, time, numpy as np, jax, jax.numpy as jnp
from redknot_jax.init import random_model
from redknot_jax.quality.model_config import qa_test_config
from redknot_jax.quality.train import TrainConfig, Trainer
hd = int(sys.argv[1]) if len(sys.argv) > 1 else 32
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
L = 24
cfg = qa_test_config(num_layers=4, hidden_size=64, head_dim=hd, rope_dim=8, q_lora_rank=32, sliding_window=128, o_lora_rank=32,
                     index_topk=64)
tr = Trainer(random_model(cfg, seed=0, dtype=jnp.float32), TrainConfig(lr=3e-3, block=64))
rng = np.random.default_rng(0)
B, T = 16, 2 * L + 2
t0 = time.time()
for s in range(steps):
    a = rng.integers(30, 100, (B, L))
    toks = np.concatenate([np.zeros((B, 1), int), a, np.full((B, 1), 4), a], 1).astype(np.int32)  # bos a sep a
    w = np.zeros((B, T - 1), np.float32); w[:, L + 1:] = 1.0  # targets of the second copy
    lr = 3e-3 * min(1, (s + 1) / 30)
    st = tr.step(toks, w, lr)
    if s % 25 == 0 or s == steps - 1:
        print(s, f"{time.time()-t0:.0f}s", "ce %.3f acc %.3f" % (float(st["answer_ce"]), float(st["answer_acc"])), flush=True)
