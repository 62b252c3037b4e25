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


def vllm_version(par):
    return tuple(int(x) for x in par.version.split(".")[:2])


def expert_map(ep_size, ep_rank, n_experts, strategy):
    """vLLM's determine_expert_map (fused_moe/expert_map_manager.py): global -> local expert
    index, -1 where the expert lives elsewhere; remainder experts go to the first ranks."""
    base, remainder = divmod(n_experts, ep_size)
    local = base + 1 if ep_rank < remainder else base
    emap = torch.full((n_experts,), -1, dtype=torch.int32)
    if strategy == "linear":
        start = ep_rank * base + min(ep_rank, remainder)
        emap[start:start + local] = torch.arange(0, local, dtype=torch.int32)
    else:
        emap[torch.arange(ep_rank, n_experts, ep_size)] = torch.arange(0, local, dtype=torch.int32)
    return emap


def vllm_reference(cfg, sd, par: VLLM, rank: int, layers=None) -> dict:
    """Storages of the first layers a vLLM rank holds, built from the HF state dict (`layers`:
    these layers whatever the rank's storages)."""
    d, p, t = vllm_rank(rank, par)
    tp = par.tp
    out = {}
    if p == 0:
        out["model.embed_tokens.weight"] = pad_rows(sd["model.embed_tokens.weight"], 64).chunk(tp)[t]
    if p == par.pp - 1 and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = pad_rows(sd["lm_head.weight"], 64).chunk(tp)[t]
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for l in (range(cfg.num_hidden_layers) if layers is None else layers):
        P = f"model.layers.{l}."
        if layers is None and P + "input_layernorm.weight" not in storage_shapes(cfg, par, rank):
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
            E = gu.shape[0]
            gate, up = gu.chunk(2, dim=1)
            X = m + ("experts.routed_experts." if vllm_version(par) >= (0, 33) else "experts.")
            # FusedMoEParallelConfig.make: tp flattened across the engine's dp ranks
            flat_size, flat_rank = par.engine_dp * tp, (d % par.engine_dp) * tp + t
            if par.ep > 1:
                emap = expert_map(par.ep, flat_rank, E, par.expert_placement)
                mine = sorted((int(emap[e]), e) for e in range(E) if emap[e] >= 0)
                out[X + "w13_weight"] = torch.stack([gu[e] for _, e in mine])
                out[X + "w2_weight"] = torch.stack([dn[e] for _, e in mine])
            else:
                out[X + "w13_weight"] = torch.cat([gate.chunk(flat_size, 1)[flat_rank],
                                                   up.chunk(flat_size, 1)[flat_rank]], 1)
                out[X + "w2_weight"] = dn.chunk(flat_size, 2)[flat_rank]
            out[m + "gate.weight"] = sd[m + "gate.weight"]
            if getattr(cfg, "topk_method", None) == "noaux_tc":
                out[m + "gate.e_score_correction_bias"] = sd[m + "gate.e_score_correction_bias"]
        if m + "shared_experts.gate_proj.weight" in sd:
            s = m + "shared_experts."
            # use_sequence_parallel_moe (EP, tp > 1, dp > 1): DeepseekV2MLP(disable_tp=True)
            n, i = (1, 0) if par.ep > 1 and tp > 1 and par.engine_dp > 1 else (tp, t)
            out[s + "gate_up_proj.weight"] = torch.cat([sd[s + "gate_proj.weight"].chunk(n)[i],
                                                        sd[s + "up_proj.weight"].chunk(n)[i]])
            out[s + "down_proj.weight"] = sd[s + "down_proj.weight"].chunk(n, 1)[i]
    return out


def vllm_mtp_reference(cfg, sd, par: VLLM, rank: int) -> dict:
    """The DeepSeek MTP draft model's storages: the layer converted as the main model's, then
    names rewritten as DeepSeekMTP._rewrite_spec_layer_name does with checkpoint names
    (``model.layers.61.*`` -> ``model.layers.61.mtp_block.*`` except enorm, hnorm, eh_proj,
    shared_head; the shared embed_tokens -> top level ``model.embed_tokens``)."""
    L = cfg.num_hidden_layers
    _, _, t = vllm_rank(rank, par)
    main = vllm_reference(cfg, sd, par, rank, layers=[L])
    # the checkpoint's MTP copies of the embedding and head carry the model's bytes
    ckpt = {f"model.layers.{L}.embed_tokens.weight": main.pop("model.embed_tokens.weight"),
            f"model.layers.{L}.shared_head.head.weight": main.pop("lm_head.weight")}
    ckpt.update(main)
    P = f"model.layers.{L}."
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        ckpt[P + n] = sd[P + n]      # RMSNorm / nn.Linear default loaders: whole tensor
    out = {}
    for name, v in ckpt.items():
        spec = next((w for w in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
                     if w in name), None)
        if spec is None:
            name = name.replace(P, P + "mtp_block.")
        elif spec == "embed_tokens":
            name = name.replace(P, "model.")
        out[name] = v
    return out


def megatron_coords(rank, par: Megatron):
    S = par.stage_size
    s, i = divmod(rank, S)
    etp = par.expert_tp
    return dict(stage=s, tp=i % par.tp, etp=i % etp, ep=(i // etp) % par.ep)


def megatron_num_layers_to_build(L, par, pp_rank):
    """Megatron's get_num_layers_to_build (transformer_block.py), per model chunk."""
    first, last = par.first_stage_layers, par.last_stage_layers
    if first is not None or last is not None:
        left, stages_left = L, par.pp
        for given in (first, last):
            if given is not None:
                left -= given
                stages_left -= 1
        n = left // stages_left if stages_left > 0 else 0
        if pp_rank == 0 and first is not None:
            n = first
        if pp_rank == par.pp - 1 and last is not None:
            n = last
    else:
        n = L // par.pp
    return n // par.vpp


def megatron_layer_offset(L, par, pp_rank, vp_stage):
    """Megatron's get_transformer_layer_offset (transformer_layer.py)."""
    if par.pp == 1:
        return 0
    first, last = par.first_stage_layers, par.last_stage_layers
    vpp = par.vpp if par.vpp > 1 else None
    if first is not None or last is not None:
        middle_stages = par.pp - sum(1 for x in (first, last) if x is not None)
        f, l_ = first or 0, last or 0
        middle = L - f - l_
        middle_rank = pp_rank if first is None else pp_rank - 1
        if vpp:
            fc = 0 if first is None else first // vpp
            lc = 0 if last is None else last // vpp
            mc = middle // vpp
            total = fc + mc + lc
            if pp_rank == 0:
                return vp_stage * total
            return vp_stage * total + fc + middle_rank * (mc // middle_stages)
        per = middle // middle_stages if middle_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_rank * per + f
    per_rank = L // par.pp
    if vpp:
        return vp_stage * (L // vpp) + pp_rank * (per_rank // vpp)
    return pp_rank * per_rank


def _megatron_layer(cfg, sd, par, c, P, M, out):
    """One HF decoder layer (prefix P) into Megatron names (prefix M) for coordinates c."""
    tp, t = par.tp, c["tp"]
    nh, ng = cfg.num_attention_heads, cfg.num_key_value_heads
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
            elif par.experts == "sequential":
                out[M + f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = fc1
                out[M + f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = fc2
            else:
                out.setdefault(M + "mlp.experts.linear_fc1.weight", []).append(fc1)
                out.setdefault(M + "mlp.experts.linear_fc2.weight", []).append(fc2)
        for k in ("linear_fc1", "linear_fc2"):
            key = M + f"mlp.experts.{k}.weight"
            if isinstance(out.get(key), list):
                out[key] = torch.stack(out[key])
        out[M + "mlp.router.weight"] = sd[m + "gate.weight"]
        if m + "gate.e_score_correction_bias" in sd:
            out[M + "mlp.router.expert_bias"] = sd[m + "gate.e_score_correction_bias"]
        out[M + "pre_mlp_layernorm.weight"] = sd[P + "post_attention_layernorm.weight"]


def megatron_reference(cfg, sd, par: Megatron, rank: int) -> dict:
    c = megatron_coords(rank, par)
    tp, t, s = par.tp, c["tp"], c["stage"]
    L = cfg.num_hidden_layers
    out = {}
    mult = 128 * tp
    chunk = (lambda v: f"model{v}.") if par.vpp > 1 else (lambda v: "")
    last_chunk = chunk(par.vpp - 1)
    embed = pad_rows(sd["model.embed_tokens.weight"], mult).chunk(tp)[t]
    if s == 0:
        out[chunk(0) + "embedding.word_embeddings.weight"] = embed
    if s == par.pp - 1 and (not cfg.tie_word_embeddings or par.pp > 1):
        head = sd["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        out[last_chunk + "output_layer.weight"] = pad_rows(head, mult).chunk(tp)[t]
    for v in range(par.vpp):
        first = megatron_layer_offset(L, par, s, v)
        for li in range(megatron_num_layers_to_build(L, par, s)):
            _megatron_layer(cfg, sd, par, c, f"model.layers.{first + li}.",
                            f"{chunk(v)}decoder.layers.{li}.", out)
    if par.mtp and s == par.pp - 1:
        if par.pp > 1:      # the MTP stage's own embedding copy
            out[last_chunk + "embedding.word_embeddings.weight"] = embed
        for j in range(cfg.num_nextn_predict_layers):
            P, M = f"model.layers.{L + j}.", f"{last_chunk}mtp.layers.{j}."
            out[M + "enorm.weight"] = sd[P + "enorm.weight"]
            out[M + "hnorm.weight"] = sd[P + "hnorm.weight"]
            out[M + "eh_proj.weight"] = sd[P + "eh_proj.weight"].chunk(tp)[t]
            out[M + "final_layernorm.weight"] = sd[P + "shared_head.norm.weight"]
            _megatron_layer(cfg, sd, par, c, P, M + "mtp_model_layer.", out)
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
    # names of vLLM before the MoE runner (FusedMoE owns w13_weight directly)
    ("qwen3_moe", {}, VLLM(tp=2, ep=2, version="0.10.2")),
    # data parallelism inside one engine: MoE over dp*tp ranks
    ("qwen3_moe", {}, VLLM(tp=2, dp=2, ep=4)),
    ("qwen3_moe", {}, VLLM(tp=2, dp=4, engine_dp=2)),                     # no EP: 4-way expert TP
    ("deepseek_v3", {}, VLLM(tp=2, dp=4, ep=4)),        # 2 engines; shared experts replicated
    ("deepseek_v3", {}, VLLM(tp=1, dp=2, ep=2)),
    # placement: round robin, experts not divisible by ep (remainder on the first ranks)
    ("qwen3_moe", {}, VLLM(tp=4, ep=4, expert_placement="round_robin")),
    ("qwen3_moe", {"num_experts": 10}, VLLM(tp=2, dp=2, ep=4)),
    ("qwen3_moe", {"num_experts": 10}, VLLM(tp=4, ep=4, dp=2, expert_placement="round_robin")),
    # no routing bias unless topk_method == "noaux_tc"
    ("deepseek_v3", {"topk_method": "greedy"}, VLLM(tp=2, ep=2)),
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
    ("qwen2", {"num_key_value_heads": 4}, Megatron(tp=2, pp=2, first_stage_layers=1)),
    ("qwen3", {"tie_word_embeddings": True}, Megatron(tp=2, pp=2, last_stage_layers=1)),
    # virtual pipeline: chunks restart layer numbering
    ("qwen3", {"num_hidden_layers": 8}, Megatron(tp=2, pp=2, vpp=2)),
    ("qwen3_moe", {"num_hidden_layers": 10, "mlp_only_layers": [3]},
     Megatron(tp=1, pp=3, vpp=2, ep=2, dp=2, first_stage_layers=2, last_stage_layers=4)),
    ("llama", {"num_hidden_layers": 7}, Megatron(tp=2, pp=3, first_stage_layers=1,
                                                   last_stage_layers=2)),
    ("qwen3_moe", {}, Megatron(tp=2, ep=2, etp=1, dp=2)),
    ("qwen3_moe", {}, Megatron(tp=2, ep=2, etp=2, dp=2, experts="stacked")),
    ("deepseek_v3", {}, Megatron(tp=2, ep=4, etp=1, dp=2, pp=2, first_stage_layers=1)),
    ("qwen3_moe", {}, Megatron(tp=2, ep=2, etp=1, dp=2, experts="sequential")),
]


@pytest.mark.parametrize("family,over,par", MEGATRON_CASES)
def test_megatron_storages_match_reference(family, over, par):
    cfg, model = make_model(family, **over)
    sd = model.state_dict()
    for r in range(par.world):
        got = local_state(cfg, par, "src", r, sd)
        assert set(got) == set(storage_shapes(cfg, par, r))
        _compare(got, megatron_reference(cfg, sd, par, r), f"{par} rank {r}")


def test_rank_numbering():
    """Megatron: tp fastest, then cp, dp, pp; experts: etp, ep, edp. vLLM: dp, pp, tp."""
    from ray_reshard.models.config import model_dims
    from ray_reshard.models.megatron import MegatronSide
    from ray_reshard.models.vllm import VLLMSide
    cfg, _ = make_model("qwen3_moe")
    d = model_dims(cfg)
    m = MegatronSide(d, Megatron(tp=2, cp=2, dp=2, pp=2, ep=4, etp=1, first_stage_layers=2))
    assert m.dense_grid(1).tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert m.expert_grid(0).tolist() == [[[0], [1], [2], [3]], [[4], [5], [6], [7]]]
    v = VLLMSide(d, VLLM(tp=2, pp=2, dp=2))
    assert v.grid(1).tolist() == [[2, 3], [6, 7]]


def _with_mtp(cfg, model, seed=7):
    """The model's state dict plus random MTP layers under their checkpoint names."""
    from ray_reshard.models import hf_parameter_shapes
    sd = dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    for n, shape in hf_parameter_shapes(cfg, mtp=True).items():
        if n not in sd:
            sd[n] = torch.randn(shape, generator=g)
    return sd


@pytest.mark.parametrize("par", [VLLM(tp=2, ep=2, dp=2), VLLM(tp=4), VLLM(tp=2, dp=2, ep=4)])
def test_vllm_mtp_draft_matches_reference(par):
    cfg, model = make_model("deepseek_v3")
    sd = _with_mtp(cfg, model)
    draft = VLLM(tp=par.tp, dp=par.dp, ep=par.ep, engine_dp=par.engine_dp, model="mtp")
    for r in range(draft.world):
        got = local_state(cfg, draft, "dst", r, sd)
        assert set(got) == set(storage_shapes(cfg, draft, r))
        want = vllm_mtp_reference(cfg, sd, draft, r)
        assert "model.layers.3.mtp_block.mlp.experts.routed_experts.w13_weight" in want
        _compare(got, want, f"{draft} rank {r}")


@pytest.mark.parametrize("layers,par", [
    (3, Megatron(tp=2, pp=2, ep=2, etp=1, first_stage_layers=1, mtp=True)),
    (3, Megatron(tp=2, pp=2, mtp=True, last_stage_layers=2, experts="stacked")),
    (3, Megatron(tp=1, ep=2, dp=2, mtp=True)),
    (4, Megatron(tp=1, pp=2, vpp=2, ep=2, dp=2, mtp=True)),     # MTP on the last chunk
])
def test_megatron_mtp_matches_reference(layers, par):
    cfg, model = make_model("deepseek_v3", num_hidden_layers=layers)
    sd = _with_mtp(cfg, model)
    for r in range(par.world):
        got = local_state(cfg, par, "src", r, sd)
        assert set(got) == set(storage_shapes(cfg, par, r))
        _compare(got, megatron_reference(cfg, sd, par, r), f"{par} rank {r}")
