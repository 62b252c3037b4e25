"""The storages `local_state` builds match the engines' fused layouts, written here
independently with plain tensor ops (view / cat / chunk), the way conversion scripts do."""
import pytest
import torch

from ray_reshard.models import VLLM, Megatron, local_state, storage_shapes
from models_testutil import make_model


def pad_rows(t, multiple):
    n = -(-t.shape[0] // multiple) * multiple
    out = torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def vllm_rank(rank, par):
    """(dp, pp, tp) coordinates of a vLLM rank."""
    return rank // (par.pp * par.tp), (rank // par.tp) % par.pp, rank % par.tp


def vllm_reference(cfg, sd, par: VLLM, rank: int) -> dict:
    """Storages of the first layers a vLLM rank holds, built from the HF state dict."""
    _, p, t = vllm_rank(rank, par)
    tp = par.tp
    out = {}
    if p == 0:
        out["model.embed_tokens.weight"] = pad_rows(sd["model.embed_tokens.weight"], 64).chunk(tp)[t]
    if p == par.pp - 1 and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = pad_rows(sd["lm_head.weight"], 64).chunk(tp)[t]
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for l in range(cfg.num_hidden_layers):
        P = f"model.layers.{l}."
        if P + "input_layernorm.weight" not in storage_shapes(cfg, par, rank):
            continue
        if hasattr(cfg, "kv_lora_rank"):
            a = P + "self_attn."
            out[a + "fused_qkv_a_proj.weight"] = torch.cat([sd[a + "q_a_proj.weight"],
                                                            sd[a + "kv_a_proj_with_mqa.weight"]])
            out[a + "q_b_proj.weight"] = sd[a + "q_b_proj.weight"].chunk(tp)[t]
            out[a + "kv_b_proj.weight"] = sd[a + "kv_b_proj.weight"].chunk(tp)[t]
            out[a + "o_proj.weight"] = sd[a + "o_proj.weight"].chunk(tp, 1)[t]
        else:
            hd = sd[P + "self_attn.k_proj.weight"].shape[0] // nkv
            kv_idx = [t // (tp // nkv)] if tp >= nkv else list(range(t * nkv // tp, (t + 1) * nkv // tp))
            for suffix in ("weight", "bias"):
                q = sd.get(P + f"self_attn.q_proj.{suffix}")
                if q is None:
                    continue
                k, v = sd[P + f"self_attn.k_proj.{suffix}"], sd[P + f"self_attn.v_proj.{suffix}"]
                tail = q.shape[1:]
                qs = q.view(nh, hd, *tail).chunk(tp)[t].reshape(-1, *tail)
                ks = k.view(nkv, hd, *tail)[kv_idx].reshape(-1, *tail)
                vs = v.view(nkv, hd, *tail)[kv_idx].reshape(-1, *tail)
                out[P + f"self_attn.qkv_proj.{suffix}"] = torch.cat([qs, ks, vs])
            out[P + "self_attn.o_proj.weight"] = sd[P + "self_attn.o_proj.weight"].chunk(tp, 1)[t]
        m = P + "mlp."
        if m + "gate_proj.weight" in sd:
            out[m + "gate_up_proj.weight"] = torch.cat([sd[m + "gate_proj.weight"].chunk(tp)[t],
                                                        sd[m + "up_proj.weight"].chunk(tp)[t]])
            out[m + "down_proj.weight"] = sd[m + "down_proj.weight"].chunk(tp, 1)[t]
        if m + "experts.gate_up_proj" in sd:
            gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
            if par.ep > 1:
                E = gu.shape[0]
                out[m + "experts.w13_weight"] = gu.chunk(par.ep)[t]
                out[m + "experts.w2_weight"] = dn.chunk(par.ep)[t]
                assert out[m + "experts.w13_weight"].shape[0] == E // par.ep
            else:
                gate, up = gu.chunk(2, dim=1)
                out[m + "experts.w13_weight"] = torch.cat([gate.chunk(tp, 1)[t], up.chunk(tp, 1)[t]], 1)
                out[m + "experts.w2_weight"] = dn.chunk(tp, 2)[t]
            out[m + "gate.weight"] = sd[m + "gate.weight"]
        if m + "shared_experts.gate_proj.weight" in sd:
            s = m + "shared_experts."
            out[s + "gate_up_proj.weight"] = torch.cat([sd[s + "gate_proj.weight"].chunk(tp)[t],
                                                        sd[s + "up_proj.weight"].chunk(tp)[t]])
            out[s + "down_proj.weight"] = sd[s + "down_proj.weight"].chunk(tp, 1)[t]
    return out


def megatron_coords(rank, par: Megatron):
    S = par.stage_size
    s, i = divmod(rank, S)
    etp = par.expert_tp
    return dict(stage=s, tp=i % par.tp, etp=i % etp, ep=(i // etp) % par.ep)


def megatron_reference(cfg, sd, par: Megatron, rank: int, stage_layers) -> dict:
    c = megatron_coords(rank, par)
    tp, t = par.tp, c["tp"]
    out = {}
    mult = 128 * tp
    if c["stage"] == 0:
        out["embedding.word_embeddings.weight"] = pad_rows(sd["model.embed_tokens.weight"], mult).chunk(tp)[t]
    if c["stage"] == par.pp - 1 and (not cfg.tie_word_embeddings or par.pp > 1):
        head = sd["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        out["output_layer.weight"] = pad_rows(head, mult).chunk(tp)[t]
    first = sum(stage_layers[: c["stage"]])
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
    for li in range(stage_layers[c["stage"]]):
        l = first + li
        P, M = f"model.layers.{l}.", f"decoder.layers.{li}."
        if not hasattr(cfg, "kv_lora_rank"):
            hd = sd[P + "self_attn.k_proj.weight"].shape[0] // ng
            for suffix in ("weight", "bias"):
                q = sd.get(P + f"self_attn.q_proj.{suffix}")
                if q is None:
                    continue
                tail = q.shape[1:]
                k, v = sd[P + f"self_attn.k_proj.{suffix}"], sd[P + f"self_attn.v_proj.{suffix}"]
                grouped = torch.cat([q.view(ng, nh // ng * hd, *tail), k.view(ng, hd, *tail),
                                     v.view(ng, hd, *tail)], dim=1)
                out[M + f"self_attention.linear_qkv.{suffix}"] = grouped.chunk(tp)[t].reshape(-1, *tail)
            out[M + "self_attention.linear_qkv.layer_norm_weight"] = sd[P + "input_layernorm.weight"]
        else:
            out[M + "self_attention.linear_kv_up_proj.weight"] = sd[P + "self_attn.kv_b_proj.weight"].chunk(tp)[t]
            out[M + "input_layernorm.weight"] = sd[P + "input_layernorm.weight"]
        out[M + "self_attention.linear_proj.weight"] = sd[P + "self_attn.o_proj.weight"].chunk(tp, 1)[t]
        m = P + "mlp."
        if m + "gate_proj.weight" in sd:
            out[M + "mlp.linear_fc1.weight"] = torch.cat([sd[m + "gate_proj.weight"].chunk(tp)[t],
                                                          sd[m + "up_proj.weight"].chunk(tp)[t]])
            out[M + "mlp.linear_fc2.weight"] = sd[m + "down_proj.weight"].chunk(tp, 1)[t]
            out[M + "mlp.linear_fc1.layer_norm_weight"] = sd[P + "post_attention_layernorm.weight"]
        if m + "experts.gate_up_proj" in sd:
            gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
            El, etp = gu.shape[0] // par.ep, par.expert_tp
            for i in range(El):
                e = c["ep"] * El + i
                gate, up = gu[e].chunk(2)
                fc1 = torch.cat([gate.chunk(etp)[c["etp"]], up.chunk(etp)[c["etp"]]])
                fc2 = dn[e].chunk(etp, 1)[c["etp"]]
                if par.experts == "grouped":
                    out[M + f"mlp.experts.linear_fc1.weight{i}"] = fc1
                    out[M + f"mlp.experts.linear_fc2.weight{i}"] = fc2
                elif par.experts == "stacked":
                    out.setdefault(M + "mlp.experts.linear_fc1.weight", []).append(fc1)
                    out.setdefault(M + "mlp.experts.linear_fc2.weight", []).append(fc2)
            for k in ("linear_fc1", "linear_fc2"):
                key = M + f"mlp.experts.{k}.weight"
                if isinstance(out.get(key), list):
                    out[key] = torch.stack(out[key])
            out[M + "mlp.router.weight"] = sd[m + "gate.weight"]
            out[M + "pre_mlp_layernorm.weight"] = sd[P + "post_attention_layernorm.weight"]
    return out


def _compare(got: dict, want: dict, what: str):
    assert want, what
    for n, w in want.items():
        assert n in got, f"{what}: no storage {n}"
        assert got[n].shape == w.shape, f"{what}: {n} {tuple(got[n].shape)} != {tuple(w.shape)}"
        assert torch.equal(got[n], w), f"{what}: {n} differs"


VLLM_CASES = [
    ("llama", {}, VLLM(tp=4, dp=2)),              # tp > kv heads: kv replicated
    ("llama", {}, VLLM(tp=2)),                    # tp == kv heads
    ("qwen2", {"num_key_value_heads": 4}, VLLM(tp=2, pp=3)),  # 2 kv heads per rank, bias
    ("qwen3", {"tie_word_embeddings": True}, VLLM(tp=8)),
    ("qwen3_moe", {}, VLLM(tp=4)),
    ("qwen3_moe", {}, VLLM(tp=4, ep=4, dp=2)),
    ("deepseek_v3", {}, VLLM(tp=2, ep=2)),
    ("deepseek_v3", {}, VLLM(tp=4, pp=2)),
]


@pytest.mark.parametrize("family,over,par", VLLM_CASES)
def test_vllm_storages_match_reference(family, over, par):
    cfg, model = make_model(family, **over)
    sd = model.state_dict()
    for r in range(par.world):
        got = local_state(cfg, par, "dst", r, sd)
        assert set(got) == set(storage_shapes(cfg, par, r))
        _compare(got, vllm_reference(cfg, sd, par, r), f"vLLM {par} rank {r}")


MEGATRON_CASES = [
    ("llama", {}, Megatron(tp=1, pp=3, dp=2)),          # 2 groups interleaved per rank
    ("llama", {}, Megatron(tp=2, pp=1, dp=2, cp=2)),    # 1 group per rank
    ("qwen2", {"num_key_value_heads": 4}, Megatron(tp=2, pp=2)),   # 2 groups per rank, bias
    ("qwen3", {"tie_word_embeddings": True}, Megatron(tp=2, pp=2)),
    ("qwen3_moe", {}, Megatron(tp=2, ep=2, etp=1, dp=2)),
    ("qwen3_moe", {}, Megatron(tp=2, ep=2, etp=2, dp=2, experts="stacked")),
    ("deepseek_v3", {}, Megatron(tp=2, ep=4, etp=1, dp=2, pp=2)),
]


@pytest.mark.parametrize("family,over,par", MEGATRON_CASES)
def test_megatron_storages_match_reference(family, over, par):
    from ray_reshard.models.parallel import split_layers
    cfg, model = make_model(family, **over)
    sd = model.state_dict()
    stage_layers = split_layers(cfg.num_hidden_layers, par.pp, None, "front")
    for r in range(par.world):
        got = local_state(cfg, par, "src", r, sd)
        assert set(got) == set(storage_shapes(cfg, par, r))
        _compare(got, megatron_reference(cfg, sd, par, r, stage_layers), f"{par} rank {r}")


def test_rank_numbering():
    """Megatron: tp fastest, then cp, dp, pp; experts: etp, ep, edp. vLLM: dp, pp, tp."""
    from ray_reshard.models.config import model_dims
    from ray_reshard.models.sides import MegatronSide, VLLMSide
    cfg, _ = make_model("qwen3_moe")
    d = model_dims(cfg)
    m = MegatronSide(d, Megatron(tp=2, cp=2, dp=2, pp=2, ep=4, etp=1))
    assert m.dense_grid(1).tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert m.expert_grid(0).tolist() == [[[0], [1], [2], [3]], [[4], [5], [6], [7]]]
    v = VLLMSide(d, VLLM(tp=2, pp=2, dp=2))
    assert v.grid(1).tolist() == [[2, 3], [6, 7]]
