"""The PyTorch reference (transformers' DeepseekV4ForCausalLM) on random weights, and its
export to a hub-layout safetensors directory that the project's loader reads."""

from __future__ import annotations

import inspect
import json
import math
import os

import numpy as np
import torch
from safetensors.numpy import save_file

from redknot_jax.config import ModelConfig
from redknot_jax.weights import hf_to_hub


def build_hf(cfg: ModelConfig, seed: int):
    """A float32 transformers model of `cfg` with every tensor drawn at random (seeded)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    hf_cfg = DeepseekV4Config(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(_random_like(name, t, cfg, g))
    return model


def _random_like(name: str, t: torch.Tensor, cfg: ModelConfig, g) -> torch.Tensor:
    def normal(std, mean=0.0):
        return torch.randn(t.shape, generator=g) * std + mean

    if name.endswith("tid2eid"):  # distinct experts per token
        perm = torch.argsort(torch.rand((t.shape[0], cfg.n_routed_experts), generator=g), dim=-1)
        return perm[:, : t.shape[1]].to(t.dtype)
    if "norm" in name:
        return normal(0.1, 1.0)
    if name.endswith(("attn_hc.fn", "ffn_hc.fn", "hc_head.hc_fn")):
        return normal(0.02)
    if name.endswith(("hc.base", "hc_base")):
        return normal(0.5)
    if name.endswith(("hc.scale", "hc_scale")):
        return 0.5 + torch.rand(t.shape, generator=g)
    if name.endswith("sinks"):
        return normal(1.0)
    if name.endswith("position_bias"):
        return normal(0.5)
    if name.endswith("e_score_correction_bias"):
        return normal(0.1)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("gate_up_proj") or name.endswith("down_proj") and t.ndim == 3:
        return normal(1.0 / math.sqrt(t.shape[-1]))
    if t.ndim == 2:
        return normal(1.0 / math.sqrt(t.shape[-1]))
    raise AssertionError(f"no random rule for {name} {tuple(t.shape)}")


def export_hub(model, cfg: ModelConfig, directory: str, shards: int = 2) -> str:
    """Write the model's weights in DeepSeek's hub layout (per-expert keys), sharded, with an
    index file, through the official safetensors writer."""
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        a = t.detach().cpu().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            i = name.split(".")[2]
            f = a.shape[1] // 2
            for e in range(a.shape[0]):
                tensors[f"layers.{i}.ffn.experts.{e}.w1.weight"] = a[e, :f]
                tensors[f"layers.{i}.ffn.experts.{e}.w3.weight"] = a[e, f:]
        elif name.endswith("mlp.experts.down_proj"):
            i = name.split(".")[2]
            for e in range(a.shape[0]):
                tensors[f"layers.{i}.ffn.experts.{e}.w2.weight"] = a[e]
        else:
            tensors[hf_to_hub(name)] = a
    keys = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: np.ascontiguousarray(tensors[k]) for k in keys[s::shards]}
        save_file(part, os.path.join(directory, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    return directory


@torch.no_grad()
def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    """All-position logits of one-shot prefill, [b, t, vocab]."""
    return model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


@torch.no_grad()
def hf_generate_logits(model, ids: np.ndarray, steps: int):
    """Greedy decode with transformers' cache: (prefill logits of the last row, then each
    step's logits, tokens), all for a batch of equal-length prompts."""
    from transformers import DynamicCache

    # the cache argument is `cache` from transformers 5.2x on, `past_key_values` before (5.17,
    # the GPU image's)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=True, **{kw: cache})
    logits = [out.logits[:, -1].float().numpy()]
    toks = []
    nxt = out.logits[:, -1].argmax(-1)
    for _ in range(steps):
        toks.append(nxt.numpy())
        out = model(input_ids=nxt[:, None], use_cache=True, **{kw: getattr(out, kw)})
        logits.append(out.logits[:, -1].float().numpy())
        nxt = out.logits[:, -1].argmax(-1)
    return np.stack(logits, 1), np.stack(toks, 1)
