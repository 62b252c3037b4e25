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
