"""Model configuration: one frozen `ModelConfig`, read from either config.json form.

DeepSeek publishes a *hub* form (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`); transformers folds it into a *transformers* form (`layer_types`,
`mlp_layer_types`, `partial_rotary_factor`, `rope_parameters`, `compress_rates`). Both are
accepted; an unknown field, or two fields that disagree, is an error naming them
(`shared/reference/deepseek_v4.md` §1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = (HASH_MOE, MOE)


class ConfigError(ValueError):
    """A config.json that is unknown, incomplete or self-contradictory."""


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN scaling of the compressed RoPE table (no attention mscale in DeepSeek-V4)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every hyper-parameter of a DeepSeek-V4 backbone (MTP excluded)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    experts_per_tok: int
    moe_inter_dim: int
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int = 4
    hca_rate: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: Yarn | None = Yarn()
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    num_nextn_predict_layers: int = 0

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)

        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "rope_dim",
                  "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "experts_per_tok",
                  "moe_inter_dim", "sliding_window", "csa_rate", "hca_rate", "index_n_heads",
                  "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0,
                 f"{f}: expected a positive int, got {getattr(self, f)!r}")
        need(len(self.layer_types) == self.num_layers,
             f"layer_types: expected {self.num_layers} entries (num_hidden_layers), got {len(self.layer_types)}")
        need(len(self.mlp_layer_types) == self.num_layers,
             f"mlp_layer_types: expected {self.num_layers} entries, got {len(self.mlp_layer_types)}")
        bad = [t for t in self.layer_types if t not in ATTENTION_TYPES]
        need(not bad, f"layer_types: unknown entries {bad}; allowed {ATTENTION_TYPES}")
        bad = [t for t in self.mlp_layer_types if t not in MLP_TYPES]
        need(not bad, f"mlp_layer_types: unknown entries {bad}; allowed {MLP_TYPES}")
        need(self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim,
             f"rope_dim: expected an even number <= head_dim {self.head_dim}, got {self.rope_dim}")
        need(self.index_head_dim >= self.rope_dim,
             f"index_head_dim {self.index_head_dim} must hold the rope dims {self.rope_dim}")
        need(self.num_heads % self.o_groups == 0,
             f"o_groups {self.o_groups} must divide num_attention_heads {self.num_heads}")
        need(self.experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok {self.experts_per_tok} > n_routed_experts {self.n_routed_experts}")

    # ----------------------------------------------------------------------------- schedule
    def compress_ratio(self, layer: int) -> int:
        """0 for a sliding-only layer, the CSA or HCA rate otherwise."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else (self.csa_rate if t == CSA else self.hca_rate)

    def is_hash(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == HASH_MOE

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.o_groups

    # ----------------------------------------------------------------------------- I/O
    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers form (what `DeepseekV4Config(**d)` accepts)."""
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.rope_dim / self.head_dim}
        if self.yarn is not None:
            compress.update(rope_type="yarn", factor=self.yarn.factor, beta_fast=self.yarn.beta_fast,
                            beta_slow=self.yarn.beta_slow, attention_factor=1.0,
                            original_max_position_embeddings=self.yarn.original_max_position_embeddings)
        return {
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim,
            "partial_rotary_factor": self.rope_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": 1,
            "num_experts_per_tok": self.experts_per_tok, "moe_intermediate_size": self.moe_inter_dim,
            "routed_scaling_factor": self.routed_scaling_factor, "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True, "swiglu_limit": self.swiglu_limit, "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types), "mlp_layer_types": list(self.mlp_layer_types),
            "compress_rates": {CSA: self.csa_rate, HCA: self.hca_rate},
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": self.rope_theta,
                                         "partial_rotary_factor": self.rope_dim / self.head_dim},
                                "compress": compress},
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        }

    def to_hub_dict(self) -> dict[str, Any]:
        """DeepSeek's hub form: its compress_ratios name the rates (4 is CSA, any other HCA), so the
        CSA rate must be 4 and an HCA rate other than 128 needs an HCA layer to be read back."""
        if self.csa_rate != 4:
            raise ConfigError(f"hub config.json knows CSA only at compress ratio 4, this config has "
                              f"{self.csa_rate}; use to_hf_dict")
        if self.hca_rate != 128 and HCA not in self.layer_types:
            raise ConfigError(f"hub config.json: HCA rate {self.hca_rate} without an HCA layer cannot be written "
                              "(the compress_ratios name it); use to_hf_dict")
        n_hash = sum(self.is_hash(i) for i in range(self.num_layers))
        if tuple(self.mlp_layer_types) != (HASH_MOE,) * n_hash + (MOE,) * (self.num_layers - n_hash):
            raise ConfigError("hub config.json needs hash layers first (num_hash_layers)")
        d = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "qk_rope_head_dim": self.rope_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": 1,
            "num_experts_per_tok": self.experts_per_tok, "moe_intermediate_size": self.moe_inter_dim,
            "routed_scaling_factor": self.routed_scaling_factor, "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc", "norm_topk_prob": True, "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.sliding_window, "num_hash_layers": n_hash,
            "compress_ratios": [self.compress_ratio(i) for i in range(self.num_layers)]
            + [0] * self.num_nextn_predict_layers,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "num_nextn_predict_layers": self.num_nextn_predict_layers, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
        }
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", "factor": self.yarn.factor, "beta_fast": self.yarn.beta_fast,
                                 "beta_slow": self.yarn.beta_slow,
                                 "original_max_position_embeddings": self.yarn.original_max_position_embeddings}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        return _parse(dict(d))

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def fingerprint(self) -> str:
        """SHA-256 of the canonical transformers-form JSON (hashed into certificates)."""
        return hashlib.sha256(json.dumps(self.to_hf_dict(), sort_keys=True).encode()).hexdigest()


# Fields that describe the file rather than the network; accepted and not used.
_INFORMATIONAL = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "quantization_config", "expert_dtype", "use_cache", "initializer_range", "pad_token_id",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout",
    "topk_method", "mlp_bias", "_name_or_path", "n_group", "topk_group", "ep_size",
    # generic fields every transformers-saved config.json carries
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict",
}


def _parse(d: dict[str, Any]) -> ModelConfig:
    def pop(key, default=None):
        return d.pop(key, default)

    def fixed(key, want):
        got = d.pop(key, want)
        if got != want:
            raise ConfigError(f"{key}: DeepSeek-V4 requires {want!r}, got {got!r}")

    for k in [k for k in d if k in _INFORMATIONAL or k.startswith("dspark_")]:
        d.pop(k)
    fixed("num_key_value_heads", 1)
    fixed("n_shared_experts", 1)
    fixed("hidden_act", "silu")
    fixed("scoring_func", "sqrtsoftplus")
    fixed("norm_topk_prob", True)
    fixed("attention_bias", False)
    fixed("tie_word_embeddings", False)

    n = pop("num_hidden_layers")
    if not isinstance(n, int):
        raise ConfigError(f"num_hidden_layers: expected an int, got {n!r}")
    head_dim = pop("head_dim", 512)

    # --- rates and the attention schedule (hub: compress_ratios; transformers: layer_types)
    rates = pop("compress_rates") or {}
    csa_rate = int(rates.get(CSA, 4))
    hca_rate = rates.get(HCA)
    csa_rate = int(pop("compress_rate_csa", csa_rate))
    hca_rate = pop("compress_rate_hca", hca_rate)
    layer_types = pop("layer_types")
    ratios = pop("compress_ratios")
    if hca_rate is None:  # the hub form names no rates: ratio 4 is CSA (DeepSeek's code), any other HCA
        hca = sorted({r for r in (ratios or [])[:n] if r not in (0, csa_rate)})
        if len(hca) > 1:
            raise ConfigError(f"compress_ratios: two HCA (non-overlapping) ratios {hca}; a model has one HCA rate")
        hca_rate = hca[0] if hca else 128
    hca_rate = int(hca_rate)
    if csa_rate == hca_rate:
        raise ConfigError(f"compress rates: CSA and HCA rates must differ, both are {csa_rate}")
    if ratios is not None:
        by_ratio = {0: SLIDING, csa_rate: CSA, hca_rate: HCA}
        bad = [r for r in ratios if r not in by_ratio]
        if bad:
            raise ConfigError(f"compress_ratios: unknown ratios {bad}; expected 0, {csa_rate} or {hca_rate}")
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios: {len(ratios)} entries for {n} layers")
        from_ratios = [by_ratio[r] for r in ratios[:n]]
        if layer_types is not None and list(layer_types[:n]) != from_ratios:
            raise ConfigError(f"layer_types {layer_types} and compress_ratios {ratios} disagree")
        layer_types = from_ratios
    if layer_types is None:
        raise ConfigError("neither layer_types nor compress_ratios given (transformers' implicit "
                          "default schedule does not match Flash or Pro; pass it explicitly)")

    mlp_types = pop("mlp_layer_types")
    n_hash = pop("num_hash_layers")
    if n_hash is not None:
        from_hash = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        if mlp_types is not None and list(mlp_types[:n]) != from_hash:
            raise ConfigError(f"mlp_layer_types {mlp_types} and num_hash_layers {n_hash} disagree")
        mlp_types = from_hash
    if mlp_types is None:
        mlp_types = [HASH_MOE] * min(n, 3) + [MOE] * max(0, n - 3)

    # --- rope dims (hub: qk_rope_head_dim; transformers: partial_rotary_factor)
    rope_dim = pop("qk_rope_head_dim")
    prf = pop("partial_rotary_factor")
    if prf is not None:
        from_prf = int(round(head_dim * prf))
        if rope_dim is not None and rope_dim != from_prf:
            raise ConfigError(f"qk_rope_head_dim {rope_dim} and partial_rotary_factor {prf} disagree")
        rope_dim = from_prf
    rope_dim = 64 if rope_dim is None else rope_dim

    rope_theta = float(pop("rope_theta", 10000.0))
    compress_theta = float(pop("compress_rope_theta", 160000.0))
    yarn = None
    scaling = pop("rope_scaling")
    params = pop("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, comp = params["main"], params["compress"]
        if float(main.get("rope_theta", rope_theta)) != rope_theta:
            raise ConfigError(f"rope_parameters.main.rope_theta {main['rope_theta']} != rope_theta {rope_theta}")
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.main: only default RoPE is used by DeepSeek-V4, got {main}")
        if float(comp.get("rope_theta", compress_theta)) != compress_theta:
            raise ConfigError(f"rope_parameters.compress.rope_theta {comp['rope_theta']} != "
                              f"compress_rope_theta {compress_theta}")
        for sub in (main, comp):
            if "partial_rotary_factor" in sub and int(round(head_dim * sub["partial_rotary_factor"])) != rope_dim:
                raise ConfigError(f"rope_parameters partial_rotary_factor {sub['partial_rotary_factor']} "
                                  f"disagrees with rope dims {rope_dim}")
        scaling = comp if comp.get("rope_type", "default") != "default" else None
    elif isinstance(params, dict) and params:
        scaling = scaling or params  # flat transformers form: the yarn dict itself
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "yarn":
            raise ConfigError(f"rope scaling: only yarn is used by DeepSeek-V4, got {kind!r}")
        else:
            if float(scaling.get("attention_factor", 1.0)) != 1.0 or scaling.get("mscale") not in (None, 1, 1.0):
                raise ConfigError(f"rope scaling: DeepSeek-V4 applies no YaRN attention factor, got {scaling}")
            yarn = Yarn(factor=float(scaling["factor"]),
                        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                        beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1))

    try:
        cfg = ModelConfig(
            vocab_size=pop("vocab_size"), hidden_size=pop("hidden_size"), num_layers=n,
            num_heads=pop("num_attention_heads"), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=pop("q_lora_rank"), o_groups=pop("o_groups"), o_lora_rank=pop("o_lora_rank"),
            n_routed_experts=pop("n_routed_experts"), experts_per_tok=pop("num_experts_per_tok"),
            moe_inter_dim=pop("moe_intermediate_size"),
            routed_scaling_factor=float(pop("routed_scaling_factor", 1.5)),
            swiglu_limit=float(pop("swiglu_limit", 10.0)), sliding_window=pop("sliding_window", 128),
            layer_types=tuple(layer_types[:n]), mlp_layer_types=tuple(mlp_types[:n]),
            csa_rate=csa_rate, hca_rate=hca_rate,
            index_n_heads=pop("index_n_heads", 64), index_head_dim=pop("index_head_dim", 128),
            index_topk=pop("index_topk", 512), rope_theta=rope_theta, compress_rope_theta=compress_theta,
            yarn=yarn, hc_mult=pop("hc_mult", 4), hc_sinkhorn_iters=pop("hc_sinkhorn_iters", 20),
            hc_eps=float(pop("hc_eps", 1e-6)), rms_norm_eps=float(pop("rms_norm_eps", 1e-6)),
            max_position_embeddings=pop("max_position_embeddings", 1048576),
            bos_token_id=_first(pop("bos_token_id", 0)), eos_token_id=_first(pop("eos_token_id", 1)),
            num_nextn_predict_layers=pop("num_nextn_predict_layers", 0),
        )
    except TypeError as e:  # a required field missing (pop returned None into an int check)
        raise ConfigError(str(e)) from None
    if d:
        raise ConfigError(f"unknown config fields {sorted(d)}")
    return cfg


def _first(x):
    return x[0] if isinstance(x, list) else x


# ------------------------------------------------------------------------------- presets
def flash(**overrides) -> ModelConfig:
    """DeepSeek-V4-Flash (43 layers, 284B)."""
    ratios = [0, 0] + [4, 128] * 20 + [4]
    base = dict(
        vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, experts_per_tok=6,
        moe_inter_dim=2048, routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=128,
        layer_types=tuple({0: SLIDING, 4: CSA, 128: HCA}[r] for r in ratios),
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 40, index_topk=512, num_nextn_predict_layers=1)
    base.update(overrides)
    return ModelConfig(**base)


def pro(**overrides) -> ModelConfig:
    """DeepSeek-V4-Pro (61 layers, 1.6T)."""
    ratios = [128, 128] + [4, 128] * 29 + [4]
    base = dict(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, head_dim=512, rope_dim=64,
        q_lora_rank=1536, o_groups=16, o_lora_rank=1024, n_routed_experts=384, experts_per_tok=6,
        moe_inter_dim=3072, routed_scaling_factor=2.5, swiglu_limit=10.0, sliding_window=128,
        layer_types=tuple({0: SLIDING, 4: CSA, 128: HCA}[r] for r in ratios),
        mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 58, index_topk=1024, num_nextn_predict_layers=1)
    base.update(overrides)
    return ModelConfig(**base)


def flash_shaped(n_routed_experts: int = 16) -> ModelConfig:
    """Every Flash dimension and the 43-layer schedule with fewer routed experts, so random
    bf16 weights fit one H200. Top-6 routing keeps the FLOPs per token of Flash."""
    return flash(n_routed_experts=n_routed_experts)


def tiny(kind: str = "mixed", **overrides) -> ModelConfig:
    """Small configs for CPU tests. Rates 4/16 so short prompts cross many HCA windows.

    * ``mixed``: sliding, CSA and HCA layers, 3 hash layers, 4 mHC streams, YaRN.
    * ``hca2``: 2 mHC streams, HCA-first schedule (Pro-like), no YaRN.
    * ``csa``: CSA-heavy, 2 streams, small index_topk so selection really selects.
    """
    common = dict(
        vocab_size=97, hidden_size=64, num_heads=8, head_dim=32, rope_dim=8, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, n_routed_experts=8, experts_per_tok=3, moe_inter_dim=32,
        routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=8, csa_rate=4, hca_rate=16,
        index_n_heads=16, index_head_dim=16, index_topk=4, hc_sinkhorn_iters=5,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    if kind == "mixed":
        types = (SLIDING, CSA, HCA, CSA, HCA, CSA)
        extra = dict(hc_mult=4, yarn=Yarn(factor=4.0, original_max_position_embeddings=64))
    elif kind == "hca2":
        types = (HCA, HCA, CSA, HCA, CSA)
        extra = dict(hc_mult=2, yarn=None)
    elif kind == "csa":
        types = (CSA, SLIDING, CSA, CSA)
        extra = dict(hc_mult=2, yarn=Yarn(factor=8.0, original_max_position_embeddings=32), index_topk=3)
    else:
        raise ConfigError(f"tiny: unknown kind {kind!r}; expected mixed, hca2 or csa")
    n = len(types)
    base = dict(common, num_layers=n, layer_types=types,
                mlp_layer_types=(HASH_MOE,) * min(3, n - 1) + (MOE,) * (n - min(3, n - 1)), **extra)
    base.update(overrides)
    return ModelConfig(**base)


PRESETS = {"flash": flash, "pro": pro, "flash-shaped": flash_shaped,
           "tiny": tiny, "tiny-hca2": lambda: tiny("hca2"), "tiny-csa": lambda: tiny("csa"),
           # tiny with a vocabulary that splits over 2 ranks (heads, groups and experts already do)
           "tiny-tp2": lambda: tiny("mixed", vocab_size=96)}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()


def yarn_lo_hi(cfg: ModelConfig) -> tuple[float, float]:
    """YaRN correction range on the compressed table (truncated, clamped as transformers does)."""
    y, r, base = cfg.yarn, cfg.rope_dim, cfg.compress_rope_theta

    def dim_of(rot):
        return r * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(dim_of(y.beta_fast)), 0), min(math.ceil(dim_of(y.beta_slow)), r - 1)
