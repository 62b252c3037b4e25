"""Model dimensions read from a Hugging Face config (a dict, a config.json path, or a
transformers PretrainedConfig), normalised over the supported families."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# model_type -> family. Mistral and Llama share the Llama layout.
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
}


@dataclass(frozen=True)
class ModelDims:
    """Everything the recipes need to know about a model's parameters."""

    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tie: bool = False
    qkv_bias: bool = False          # q/k/v projections carry a bias (Qwen2, Llama attention_bias)
    o_bias: bool = False            # o_proj carries a bias (Llama attention_bias)
    qk_norm: bool = False           # per-head RMSNorm of q and k (Qwen3)
    # Mixture of experts
    experts: int = 0
    moe_intermediate: int = 0
    moe_layers: frozenset = field(default_factory=frozenset)
    shared_intermediate: int = 0    # shared experts' total intermediate size (0: none)
    router_bias: bool = False       # gate.e_score_correction_bias (topk_method "noaux_tc")
    # Multi-head latent attention (DeepSeek-V3)
    mla: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek multi-token prediction layers (num_nextn_predict_layers), numbered after the
    # decoder layers as in the checkpoints: model.layers.{layers + j}
    mtp_layers: int = 0

    @property
    def query_groups(self) -> int:
        return self.kv_heads

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return json.load(f)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        # transformers may serialise a field under another name (attribute_map aliases)
        for alias, target in (getattr(config, "attribute_map", None) or {}).items():
            if alias not in d and target in d:
                d[alias] = d[target]
        return d
    raise TypeError(f"config must be a dict, a path to config.json or a transformers "
                    f"PretrainedConfig, got {type(config).__name__}")


def model_dims(config: Any) -> ModelDims:
    """Read a HF config into ModelDims; raises for unsupported families or options."""
    if isinstance(config, ModelDims):
        return config
    c = _as_dict(config)
    mtype = c.get("model_type")
    if mtype not in FAMILIES:
        raise ValueError(f"unsupported model_type {mtype!r}; supported: {sorted(FAMILIES)}")
    fam = FAMILIES[mtype]

    def need(key):
        if c.get(key) is None:
            raise ValueError(f"{mtype} config lacks {key!r}")
        return int(c[key])

    H, L, nh = need("hidden_size"), need("num_hidden_layers"), need("num_attention_heads")
    nkv = int(c.get("num_key_value_heads") or nh)
    hd = int(c.get("head_dim") or H // nh)
    common = dict(family=fam, vocab=need("vocab_size"), hidden=H, layers=L, heads=nh,
                  kv_heads=nkv, head_dim=hd, intermediate=int(c.get("intermediate_size") or 0),
                  tie=bool(c.get("tie_word_embeddings", False)))
    if c.get("mlp_bias"):
        raise NotImplementedError("mlp_bias=True is not supported by the refit recipes")
    if nh % nkv:
        raise ValueError(f"num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
    if fam == "llama":
        ab = bool(c.get("attention_bias", False))
        return ModelDims(**common, qkv_bias=ab, o_bias=ab)
    if fam == "qwen2":
        return ModelDims(**common, qkv_bias=True)
    if fam == "qwen3":
        ab = bool(c.get("attention_bias", False))
        return ModelDims(**common, qkv_bias=ab, o_bias=ab, qk_norm=True)
    if fam == "qwen3_moe":
        ab = bool(c.get("attention_bias", False))
        E = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        step = int(c.get("decoder_sparse_step") or 1)
        only = set(c.get("mlp_only_layers") or ())
        moe = frozenset(l for l in range(L)
                        if l not in only and E > 0 and (l + 1) % step == 0)
        return ModelDims(**common, qkv_bias=ab, o_bias=ab, qk_norm=True, experts=E,
                         moe_intermediate=need("moe_intermediate_size") if moe else 0,
                         moe_layers=moe)
    # deepseek_v3
    E = int(c.get("n_routed_experts") or 0)
    first = int(c.get("first_k_dense_replace") or 0)
    freq = int(c.get("moe_layer_freq") or 1)
    mtp = int(c.get("num_nextn_predict_layers") or 0)
    moe = frozenset(l for l in range(L + mtp) if E > 0 and l >= first and l % freq == 0)
    n_shared = int(c.get("n_shared_experts") or 0)
    mi = need("moe_intermediate_size") if moe else 0
    q_lora = c.get("q_lora_rank")
    if c.get("attention_bias"):
        raise NotImplementedError("DeepSeek-V3 with attention_bias=True is not supported")
    # vLLM allocates gate.e_score_correction_bias only for topk_method == "noaux_tc"
    # (DeepseekV2MoE); Megatron's router keeps expert_bias for the same models.
    bias = bool(moe) and c.get("topk_method") == "noaux_tc"
    return ModelDims(**common, experts=E, moe_intermediate=mi, moe_layers=moe,
                     shared_intermediate=mi * n_shared, router_bias=bias, mla=True,
                     mtp_layers=mtp,
                     q_lora_rank=None if q_lora is None else int(q_lora),
                     kv_lora_rank=need("kv_lora_rank"), qk_nope_dim=need("qk_nope_head_dim"),
                     qk_rope_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"))


# ModelDims field -> the config key(s) it comes from, for naming a difference
_DIMS_KEYS = {
    "family": "model_type", "vocab": "vocab_size", "hidden": "hidden_size",
    "layers": "num_hidden_layers", "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "intermediate": "intermediate_size", "tie": "tie_word_embeddings",
    "qkv_bias": "attention_bias", "o_bias": "attention_bias", "qk_norm": "model_type",
    "experts": "num_experts / n_routed_experts", "moe_intermediate": "moe_intermediate_size",
    "moe_layers": "MoE layers (decoder_sparse_step, mlp_only_layers, first_k_dense_replace, "
                  "moe_layer_freq)",
    "shared_intermediate": "n_shared_experts", "router_bias": "topk_method",
    "mla": "model_type", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_dim": "qk_nope_head_dim", "qk_rope_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim", "mtp_layers": "num_nextn_predict_layers",
}
# Keys that change what the weights mean without changing a shape, compared where both configs
# give them. Left out on purpose: what inference may set apart from training (context length,
# RoPE scaling, norm epsilon, dtype, generation settings).
MEANING_KEYS = ("hidden_act", "num_experts_per_tok", "norm_topk_prob", "n_group", "topk_group",
                "routed_scaling_factor", "scoring_func")


def with_defaults(config: Mapping) -> dict:
    """`config` with the defaults transformers gives its model type filled in (what an engine
    that loaded it reports), or as it is where transformers is not installed."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return dict(config)
    try:
        return {**AutoConfig.for_model(**dict(config)).to_dict(), **dict(config)}
    except Exception:       # noqa: BLE001  (a config transformers refuses: compared as given)
        return dict(config)


def config_differences(config: Any, other: Any) -> list[str]:
    """Every difference between two HF configs that changes a parameter's shape or meaning in
    the main model (multi-token prediction layers left out), as "key: <config> vs <other>"
    lines (empty when a refit from one to the other is sound). Keys one side leaves out take
    transformers' defaults for the model type."""
    a, b = with_defaults(_as_dict(config)), with_defaults(_as_dict(other))
    out = []
    if a.get("model_type") != b.get("model_type"):
        return [f"model_type: {a.get('model_type')!r} vs {b.get('model_type')!r}"]
    da, db = model_dims(a), model_dims(b)
    ignored = {"mtp_layers"} | ({"head_dim"} if da.mla else set())  # MLA: qk/v dims instead
    seen = set()
    for f in da.__dataclass_fields__:
        va, vb = getattr(da, f), getattr(db, f)
        if f == "moe_layers":
            va, vb = (frozenset(l for l in v if l < d.layers) for v, d in ((va, da), (vb, db)))
        if va == vb or f in ignored:
            continue
        key = _DIMS_KEYS.get(f, f)
        if key in seen:
            continue
        seen.add(key)
        if isinstance(va, frozenset):
            va, vb = sorted(va), sorted(vb)
        out.append(f"{key}: {va!r} vs {vb!r}")
    for key in MEANING_KEYS:
        if a.get(key) is not None and b.get(key) is not None and a[key] != b[key]:
            out.append(f"{key}: {a[key]!r} vs {b[key]!r}")
    return out
