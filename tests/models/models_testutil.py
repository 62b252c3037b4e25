"""Small HF models and the end-to-end refit check shared by the model tests. Sources and
expected destinations come from engine_reference (the engines' loading rules rebuilt
independently), never from the recipes under test."""
from __future__ import annotations

import copy

import torch

import ray_reshard as rr
from ray_reshard.models import (assemble_state_dict, empty_storage, hf_parameter_shapes,
                                padding_mask, refit_specs, tied_aliases)
from ray_reshard.execution.reference import simulate_refit
from engine_reference import reference_state

SENTINEL = 7.0
# the only storages with padding rows (vocabulary blocks), on either engine
VOCAB_STORAGES = {"model.embed_tokens.weight", "lm_head.weight",
                  "embedding.word_embeddings.weight", "output_layer.weight"}


def is_vocab_storage(name: str) -> bool:
    """Vocabulary blocks, also under a Megatron model chunk prefix (model0., model1.) or as the
    MTP draft's shared_head.head."""
    return name.split(".", 1)[-1] in VOCAB_STORAGES or name in VOCAB_STORAGES or \
        name.endswith("shared_head.head.weight")

BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2)


def make_model(family: str, **over):
    """A small random model of `family` built with transformers' own classes."""
    import transformers
    transformers.logging.set_verbosity_error()
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig,
                              LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    if family == "llama":
        cfg = LlamaConfig(**{**BASE, **over})
        cls = LlamaForCausalLM
    elif family == "qwen2":
        cfg = Qwen2Config(**{**BASE, **over})
        cls = Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = Qwen3Config(**{**BASE, "head_dim": 16, **over})
        cls = Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**BASE, "head_dim": 16, "num_experts": 8,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "mlp_only_layers": [1], **over})
        cls = Qwen3MoeForCausalLM
    elif family == "deepseek_v3":
        kw = dict(vocab_size=1000, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=24,
                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                  n_group=2, topk_group=1, topk_method="noaux_tc")
        cfg = DeepseekV3Config(**{**kw, **over})
        cls = DeepseekV3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        # Random everything (norm weights too, so a misplaced norm shows in the logits).
        seen = set()
        for t in model.state_dict().values():
            if t.data_ptr() in seen or not t.is_floating_point():
                continue
            seen.add(t.data_ptr())
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return cfg, model


def logits(model, seed: int = 5):
    x = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x).logits


def check_coverage(cfg, model, specs):
    """The specs cover every HF parameter exactly: names, shapes, 100% of the bytes."""
    sd = model.state_dict()
    aliases = tied_aliases(cfg)
    expected = {k: tuple(v.shape) for k, v in sd.items() if k not in aliases}
    if getattr(cfg, "topk_method", None) != "noaux_tc":
        # transformers keeps the routing bias buffer always; vLLM only for noaux_tc
        expected = {k: s for k, s in expected.items() if "e_score_correction_bias" not in k}
    assert hf_parameter_shapes(cfg) == expected
    by_hf: dict[str, int] = {}
    for name, spec in specs.items():
        hf = name.split("@", 1)[0]
        assert hf in expected, name
        by_hf[hf] = by_hf.get(hf, 0) + spec.numel
    assert set(by_hf) == set(expected)
    for k, shape in expected.items():
        n = 1
        for s in shape:
            n *= s
        assert by_hf[k] == n, (k, by_hf[k], n)
    for n in aliases:
        assert sd[n].data_ptr() == sd[aliases[n]].data_ptr()


def run_refit(cfg, model, train, infer, dtype=torch.float32, train_dtype=None,
              ranks_per_domain: int = 2, hf_experts: str = "auto", state_dict=None):
    """Shard, plan, simulate, check storages bit-exactly and padding untouched, reassemble.

    Returns the reassembled HF state dict."""
    sd = state_dict if state_dict is not None else model.state_dict()
    specs = refit_specs(cfg, train, infer, dtype=dtype, train_dtype=train_dtype,
                        hf_experts=hf_experts)
    if state_dict is None:
        check_coverage(cfg, model, specs)
    src_dt = train_dtype or dtype
    for r in range(train.world):
        # every logical element placed once; only vocabulary rows are padding
        for n, pad in padding_mask(cfg, train, r, hf_experts=hf_experts).items():
            if pad.any():
                assert is_vocab_storage(n), n
    src = [reference_state(cfg, sd, train, r, dtype=src_dt) for r in range(train.world)]
    dst = [empty_storage(cfg, infer, r, dtype=dtype, fill=SENTINEL) for r in range(infer.world)]
    plan = rr.plan(specs, [("s", r // ranks_per_domain) for r in range(train.world)],
                   [("d", r // ranks_per_domain) for r in range(infer.world)])
    assert plan.stats.network_bytes >= plan.stats.min_network_bytes
    simulate_refit(plan, src, dst)
    for r in range(infer.world):
        # the engine's storages, padding rows still holding the fill
        want = reference_state(cfg, sd, infer, r, dtype=dtype, fill=SENTINEL)
        assert set(want) == set(dst[r]), f"dst rank {r}: {sorted(set(want) ^ set(dst[r]))}"
        for n, got in dst[r].items():
            assert got.dtype == want[n].dtype, n
            assert got.shape == want[n].shape, n
            assert torch.equal(got, want[n]), f"dst rank {r}: {n} differs"
    return assemble_state_dict(cfg, infer, dst, hf_experts=hf_experts)


def check_logits(cfg, model, hf_sd, dtype=torch.float32):
    """Load the reassembled state dict into a fresh model; its logits equal the source's
    (the source rounded to `dtype` when the refit converts)."""
    sd = model.state_dict()
    ref = model
    if dtype != torch.float32:
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for n, t in ref.state_dict().items():
                if not t.is_floating_point() or "e_score_correction_bias" in n:
                    continue    # the routing bias stays float32 on both engines
                t.copy_(t.to(dtype).to(t.dtype))
    rsd = ref.state_dict()
    for n, t in hf_sd.items():
        assert torch.equal(t.to(rsd[n].dtype), rsd[n]), n
    fresh = type(model)(cfg).eval()
    fresh.load_state_dict({k: v.to(sd[k].dtype) for k, v in hf_sd.items()}, strict=True)
    assert torch.equal(logits(fresh), logits(ref))


def split_experts(sd: dict) -> dict:
    """A fused-experts state dict (transformers >= 5) with one 2-d tensor per expert and
    projection (transformers 4, checkpoints)."""
    out = {}
    for n, t in sd.items():
        if n.endswith("experts.gate_up_proj"):
            pre, I = n[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = t[e, :I]
                out[f"{pre}{e}.up_proj.weight"] = t[e, I:]
        elif n.endswith("experts.down_proj"):
            pre = n[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e]
        else:
            out[n] = t
    return out
