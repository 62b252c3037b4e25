"""Every storage a Megatron-core or vLLM rank holds, rebuilt from a full HF state dict with plain
tensor ops (view / cat / chunk / stack), the way the engines' loaders and conversion scripts cut
and fuse each HF tensor.

Written from the engines' loading rules, not from ray_reshard.models: the tests compare the
recipes' `local_state` and every refit's destinations with what is built here. The only
things read from the layout objects (`Megatron`, `VLLM`) are their fields, the parallel sizes
a user gives.

vLLM (``weight_loader`` of each layer class):
  * VocabParallelEmbedding / ParallelLMHead: vocabulary padded to `vocab_padding` rows, the
    padded table cut in `tp` equal blocks; a tied head is the embedding (on the last PP rank
    too, which then builds ``model.embed_tokens``);
  * QKVParallelLinear: per TP rank [q heads of the rank; its kv heads; same for v], a kv head
    repeated on tp / kv_heads ranks when tp > kv_heads; biases alike;
  * MergedColumnParallelLinear gate_up_proj: [gate rows of the rank; up rows of the rank];
    RowParallelLinear (o_proj, down_proj): columns cut, bias whole on every rank;
  * RMSNorm, ReplicatedLinear (MoE gate, kv_a_proj_with_mqa), e_score_correction_bias: whole;
    MLA: fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa] whole, q_b_proj / kv_b_proj /
    q_proj column-parallel;
  * FusedMoE w13 = [gate; up] per expert, w2 = down per expert; tp flattened over an engine's
    dp ranks; with expert parallelism, experts placed by determine_expert_map;
  * pipeline: get_pp_indices (the extra layers on the stages before the last).
Megatron-core (GPT model, Transformer Engine spec, Megatron-Bridge's conversions):
  * word embeddings / output layer: vocabulary padded to make_vocab_size_divisible_by * tp, cut
    in tp blocks; a tied output layer on a last stage other than the first is a copy;
  * linear_qkv: per query group [q heads of the group; k; v], groups cut over tp, input norm as
    its layer_norm_weight; linear_proj: row-parallel (bias whole);
  * dense MLP: linear_fc1 = [gate rows of the rank; up rows of the rank] (post-attention norm as
    its layer_norm_weight), linear_fc2 row-parallel; MoE layers: pre_mlp_layernorm, router,
    expert_bias, experts over ep in contiguous ranges, their FFN dim over etp, shared experts
    tensor-parallel like a dense MLP;
  * MLA: input_layernorm, linear_q_down_proj / linear_kv_down_proj duplicated on every rank,
    linear_q_up_proj / linear_kv_up_proj column-parallel with the q_a / kv_a norm as
    layer_norm_weight, linear_q_proj without q_lora_rank;
  * layers over (virtual) pipeline stages as get_num_layers_to_build / get_transformer_layer_
    offset compute them, each model chunk numbering its layers from 0; MTP layers on the last
    stage's last chunk.
"""
from __future__ import annotations

import torch

ROUTER_BIAS = "e_score_correction_bias"


def cfg_get(cfg, key, default=None):
    """A config field from a dict or a transformers PretrainedConfig."""
    if isinstance(cfg, dict):
        v = cfg.get(key, default)
    else:
        v = getattr(cfg, key, default)
    return default if v is None else v


def kv_heads(cfg):
    return cfg_get(cfg, "num_key_value_heads", cfg_get(cfg, "num_attention_heads"))


def has_router_bias(cfg):
    """vLLM (DeepseekV2MoE) allocates gate.e_score_correction_bias only for noaux_tc."""
    return cfg_get(cfg, "model_type") == "deepseek_v3" and cfg_get(cfg, "topk_method") == "noaux_tc"


def pad_rows(t, multiple, fill=0.0):
    n = -(-t.shape[0] // multiple) * multiple
    out = torch.full((n,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def fuse_split_experts(sd):
    """A state dict with checkpoint-style experts (``experts.{e}.gate_proj.weight``, ...) in
    transformers>=5's fused form (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]); fused state dicts come back unchanged."""
    out, experts = {}, {}
    for k, v in sd.items():
        parts = k.split(".")
        if "experts" in parts and k.endswith(("gate_proj.weight", "up_proj.weight",
                                               "down_proj.weight")):
            i = parts.index("experts")
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                pre = ".".join(parts[: i + 1]) + "."
                experts.setdefault(pre, {})[(int(parts[i + 1]), parts[i + 2])] = v
                continue
        out[k] = v
    for pre, d in experts.items():
        E = 1 + max(e for e, _ in d)
        out[pre + "gate_up_proj"] = torch.stack(
            [torch.cat([d[(e, "gate_proj")], d[(e, "up_proj")]]) for e in range(E)])
        out[pre + "down_proj"] = torch.stack([d[(e, "down_proj")] for e in range(E)])
    return out


def cast(sd, dtype):
    """The state dict in `dtype`; routing biases stay float32 (both engines keep them so)."""
    if dtype is None:
        return dict(sd)
    return {k: (v.float() if ROUTER_BIAS in k else v.to(dtype)) for k, v in sd.items()}


# ------------------------------------------------------------------------------------ vLLM

def vllm_rank(rank, par):
    """(dp, pp, tp) coordinates of a vLLM rank: data parallel outer, tensor inner."""
    return rank // (par.pp * par.tp), (rank // par.tp) % par.pp, rank % par.tp


def vllm_version(par):
    return tuple(int(x) for x in par.version.split(".")[:2])


def vllm_pp_layers(n_layers, par, pp_rank):
    """vLLM's get_pp_indices: equal parts, the remainder one each on the stages before the last
    (or the layout the user gave)."""
    if par.layers_per_stage is not None:
        counts = list(par.layers_per_stage)
    else:
        counts = [n_layers // par.pp] * par.pp
        for i in range(2, n_layers % par.pp + 2):
            counts[-i] += 1
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


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


def _vllm_layer(cfg, sd, par, d, t, P, out):
    tp = par.tp
    a = P + "self_attn."
    out[P + "input_layernorm.weight"] = sd[P + "input_layernorm.weight"]
    out[P + "post_attention_layernorm.weight"] = sd[P + "post_attention_layernorm.weight"]
    if cfg_get(cfg, "model_type") == "deepseek_v3":
        if a + "q_a_proj.weight" in sd:
            out[a + "fused_qkv_a_proj.weight"] = torch.cat([sd[a + "q_a_proj.weight"],
                                                            sd[a + "kv_a_proj_with_mqa.weight"]])
            out[a + "q_a_layernorm.weight"] = sd[a + "q_a_layernorm.weight"]
            out[a + "q_b_proj.weight"] = sd[a + "q_b_proj.weight"].chunk(tp)[t]
        else:
            out[a + "q_proj.weight"] = sd[a + "q_proj.weight"].chunk(tp)[t]
            out[a + "kv_a_proj_with_mqa.weight"] = sd[a + "kv_a_proj_with_mqa.weight"]
        out[a + "kv_a_layernorm.weight"] = sd[a + "kv_a_layernorm.weight"]
        out[a + "kv_b_proj.weight"] = sd[a + "kv_b_proj.weight"].chunk(tp)[t]
        out[a + "o_proj.weight"] = sd[a + "o_proj.weight"].chunk(tp, 1)[t]
    else:
        nh, nkv = cfg_get(cfg, "num_attention_heads"), kv_heads(cfg)
        hd = sd[a + "k_proj.weight"].shape[0] // nkv
        kv_idx = [t // (tp // nkv)] if tp >= nkv else list(range(t * nkv // tp, (t + 1) * nkv // tp))
        for suffix in ("weight", "bias"):
            q = sd.get(a + f"q_proj.{suffix}")
            if q is None:
                continue
            k, v = sd[a + f"k_proj.{suffix}"], sd[a + f"v_proj.{suffix}"]
            tail = q.shape[1:]
            qs = q.view(nh, hd, *tail).chunk(tp)[t].reshape(-1, *tail)
            ks = k.view(nkv, hd, *tail)[kv_idx].reshape(-1, *tail)
            vs = v.view(nkv, hd, *tail)[kv_idx].reshape(-1, *tail)
            out[a + f"qkv_proj.{suffix}"] = torch.cat([qs, ks, vs])
        out[a + "o_proj.weight"] = sd[a + "o_proj.weight"].chunk(tp, 1)[t]
        if a + "o_proj.bias" in sd:
            out[a + "o_proj.bias"] = sd[a + "o_proj.bias"]
        for n in ("q_norm.weight", "k_norm.weight"):
            if a + n in sd:
                out[a + n] = sd[a + n]
    m = P + "mlp."
    if m + "gate_proj.weight" in sd:
        out[m + "gate_up_proj.weight"] = torch.cat([sd[m + "gate_proj.weight"].chunk(tp)[t],
                                                    sd[m + "up_proj.weight"].chunk(tp)[t]])
        out[m + "down_proj.weight"] = sd[m + "down_proj.weight"].chunk(tp, 1)[t]
    if m + "experts.gate_up_proj" in sd:
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        E = gu.shape[0]
        gate, up = gu.chunk(2, dim=1)
        X = m + ("experts.routed_experts." if vllm_version(par) >= (0, 32) else "experts.")
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
        if has_router_bias(cfg):
            out[m + "gate." + ROUTER_BIAS] = sd[m + "gate." + ROUTER_BIAS]
    if m + "shared_experts.gate_proj.weight" in sd:
        s = m + "shared_experts."
        # use_sequence_parallel_moe (EP, tp > 1, dp > 1): DeepseekV2MLP(disable_tp=True)
        n, i = (1, 0) if par.ep > 1 and tp > 1 and par.engine_dp > 1 else (tp, t)
        out[s + "gate_up_proj.weight"] = torch.cat([sd[s + "gate_proj.weight"].chunk(n)[i],
                                                    sd[s + "up_proj.weight"].chunk(n)[i]])
        out[s + "down_proj.weight"] = sd[s + "down_proj.weight"].chunk(n, 1)[i]


def vllm_reference(cfg, sd, par, rank, fill=0.0) -> dict:
    """Every storage of a vLLM rank (main model), from the HF state dict `sd`; vocabulary
    padding rows hold `fill`."""
    d, p, t = vllm_rank(rank, par)
    tp, pad = par.tp, par.vocab_padding
    tie = bool(cfg_get(cfg, "tie_word_embeddings", False))
    out = {}
    if p == 0 or (tie and p == par.pp - 1):
        out["model.embed_tokens.weight"] = pad_rows(sd["model.embed_tokens.weight"], pad, fill).chunk(tp)[t]
    if p == par.pp - 1:
        out["model.norm.weight"] = sd["model.norm.weight"]
        if not tie:
            out["lm_head.weight"] = pad_rows(sd["lm_head.weight"], pad, fill).chunk(tp)[t]
    for l in vllm_pp_layers(cfg_get(cfg, "num_hidden_layers"), par, p):
        _vllm_layer(cfg, sd, par, d, t, f"model.layers.{l}.", out)
    return out


def vllm_mtp_reference(cfg, sd, par, rank, fill=0.0) -> dict:
    """vLLM's DeepSeek MTP draft model (DeepSeekMTP): the MTP layer converted like a decoder
    layer, names rewritten as _rewrite_spec_layer_name does (``model.layers.{L}.*`` ->
    ``model.layers.{L}.mtp_block.*`` except enorm, hnorm, eh_proj, shared_head; the shared
    embedding at ``model.embed_tokens``); the checkpoint's MTP embedding and shared head carry
    the model's embedding and lm_head bytes."""
    L = cfg_get(cfg, "num_hidden_layers")
    d, _, t = vllm_rank(rank, par)
    P = f"model.layers.{L}."
    out = {"model.embed_tokens.weight":
           pad_rows(sd["model.embed_tokens.weight"], par.vocab_padding, fill).chunk(par.tp)[t],
           P + "shared_head.head.weight":
           pad_rows(sd["lm_head.weight"], par.vocab_padding, fill).chunk(par.tp)[t]}
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        out[P + n] = sd[P + n]      # RMSNorm / nn.Linear default loaders: whole tensor
    block = {}
    _vllm_layer(cfg, sd, par, d, t, P, block)
    for name, v in block.items():
        out[name.replace(P, P + "mtp_block.")] = v
    return out


# -------------------------------------------------------------------------------- Megatron

def megatron_coords(rank, par):
    """Stage, tp rank, and the expert grid's etp / ep ranks (tp-cp-ep-dp-pp order, expert
    ranks etp fastest, then ep, then expert dp)."""
    S = par.tp * par.cp * par.dp
    s, i = divmod(rank, S)
    etp = par.tp if par.etp is None else par.etp
    return dict(stage=s, tp=i % par.tp, etp=i % etp, ep=(i // etp) % par.ep, etp_size=etp)


def megatron_num_layers_to_build(L, par, pp_rank, vp_stage):
    """Megatron's get_num_layers_to_build (transformer_block.py), per model chunk."""
    if par.layers_per_stage is not None:       # pipeline_model_parallel_layout
        return par.layers_per_stage[vp_stage * par.pp + pp_rank]
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
    if par.layers_per_stage is not None:
        return sum(par.layers_per_stage[: vp_stage * par.pp + pp_rank])
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
    A, a = M + "self_attention.", P + "self_attn."
    if cfg_get(cfg, "model_type") != "deepseek_v3":
        nh, ng = cfg_get(cfg, "num_attention_heads"), kv_heads(cfg)
        hd = sd[a + "k_proj.weight"].shape[0] // ng
        for suffix in ("weight", "bias"):
            q = sd.get(a + f"q_proj.{suffix}")
            if q is None:
                continue
            tail = q.shape[1:]
            k, v = sd[a + f"k_proj.{suffix}"], sd[a + f"v_proj.{suffix}"]
            grouped = torch.cat([q.view(ng, nh // ng * hd, *tail), k.view(ng, hd, *tail),
                                 v.view(ng, hd, *tail)], dim=1)
            out[A + f"linear_qkv.{suffix}"] = grouped.chunk(tp)[t].reshape(-1, *tail)
        out[A + "linear_qkv.layer_norm_weight"] = sd[P + "input_layernorm.weight"]
        if a + "q_norm.weight" in sd:
            out[A + "q_layernorm.weight"] = sd[a + "q_norm.weight"]
            out[A + "k_layernorm.weight"] = sd[a + "k_norm.weight"]
        if a + "o_proj.bias" in sd:
            out[A + "linear_proj.bias"] = sd[a + "o_proj.bias"]
    else:
        out[M + "input_layernorm.weight"] = sd[P + "input_layernorm.weight"]
        if a + "q_a_proj.weight" in sd:
            out[A + "linear_q_down_proj.weight"] = sd[a + "q_a_proj.weight"]
            out[A + "linear_q_up_proj.layer_norm_weight"] = sd[a + "q_a_layernorm.weight"]
            out[A + "linear_q_up_proj.weight"] = sd[a + "q_b_proj.weight"].chunk(tp)[t]
        else:
            out[A + "linear_q_proj.weight"] = sd[a + "q_proj.weight"].chunk(tp)[t]
        out[A + "linear_kv_down_proj.weight"] = sd[a + "kv_a_proj_with_mqa.weight"]
        out[A + "linear_kv_up_proj.layer_norm_weight"] = sd[a + "kv_a_layernorm.weight"]
        out[A + "linear_kv_up_proj.weight"] = sd[a + "kv_b_proj.weight"].chunk(tp)[t]
    out[A + "linear_proj.weight"] = sd[a + "o_proj.weight"].chunk(tp, 1)[t]
    m = P + "mlp."
    if m + "gate_proj.weight" in sd:
        out[M + "mlp.linear_fc1.weight"] = torch.cat([sd[m + "gate_proj.weight"].chunk(tp)[t],
                                                      sd[m + "up_proj.weight"].chunk(tp)[t]])
        out[M + "mlp.linear_fc2.weight"] = sd[m + "down_proj.weight"].chunk(tp, 1)[t]
        out[M + "mlp.linear_fc1.layer_norm_weight"] = sd[P + "post_attention_layernorm.weight"]
    if m + "experts.gate_up_proj" in sd:
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        El, etp = gu.shape[0] // par.ep, c["etp_size"]
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
        if has_router_bias(cfg):
            out[M + "mlp.router.expert_bias"] = sd[m + "gate." + ROUTER_BIAS]
        out[M + "pre_mlp_layernorm.weight"] = sd[P + "post_attention_layernorm.weight"]
        s = m + "shared_experts."
        if s + "gate_proj.weight" in sd:
            out[M + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [sd[s + "gate_proj.weight"].chunk(tp)[t], sd[s + "up_proj.weight"].chunk(tp)[t]])
            out[M + "mlp.shared_experts.linear_fc2.weight"] = sd[s + "down_proj.weight"].chunk(tp, 1)[t]


def megatron_reference(cfg, sd, par, rank, fill=0.0) -> dict:
    """Every storage of a Megatron-core rank, from the HF state dict `sd`; vocabulary padding
    rows hold `fill`."""
    c = megatron_coords(rank, par)
    tp, t, s = par.tp, c["tp"], c["stage"]
    L = cfg_get(cfg, "num_hidden_layers")
    tie = bool(cfg_get(cfg, "tie_word_embeddings", False))
    out = {}
    mult = par.vocab_divisible_by * tp
    chunk = (lambda v: f"model{v}.") if par.vpp > 1 else (lambda v: "")
    last_chunk = chunk(par.vpp - 1)
    embed = pad_rows(sd["model.embed_tokens.weight"], mult, fill).chunk(tp)[t]
    if s == 0:
        out[chunk(0) + "embedding.word_embeddings.weight"] = embed
    if s == par.pp - 1:
        out[last_chunk + "decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        if not tie or par.pp > 1:
            head = sd["model.embed_tokens.weight" if tie else "lm_head.weight"]
            out[last_chunk + "output_layer.weight"] = pad_rows(head, mult, fill).chunk(tp)[t]
    for v in range(par.vpp):
        first = megatron_layer_offset(L, par, s, v)
        for li in range(megatron_num_layers_to_build(L, par, s, v)):
            _megatron_layer(cfg, sd, par, c, f"model.layers.{first + li}.",
                            f"{chunk(v)}decoder.layers.{li}.", out)
    if par.mtp and s == par.pp - 1:
        if par.pp > 1:      # the MTP stage's own embedding copy
            out[last_chunk + "embedding.word_embeddings.weight"] = embed
        for j in range(cfg_get(cfg, "num_nextn_predict_layers", 0)):
            P, M = f"model.layers.{L + j}.", f"{last_chunk}mtp.layers.{j}."
            out[M + "enorm.weight"] = sd[P + "enorm.weight"]
            out[M + "hnorm.weight"] = sd[P + "hnorm.weight"]
            out[M + "eh_proj.weight"] = sd[P + "eh_proj.weight"].chunk(tp)[t]
            out[M + "final_layernorm.weight"] = sd[P + "shared_head.norm.weight"]
            _megatron_layer(cfg, sd, par, c, P, M + "mtp_model_layer.", out)
    return out


# ------------------------------------------------------------------------- vLLM block FP8

# Storages vLLM's Fp8LinearMethod / Fp8MoEMethod keep in FP8 (every linear projection of
# attention and MLPs, the routed experts), each with a float32 `<name>_scale_inv`.
FP8_STORAGES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight",
                "w13_weight", "w2_weight", "fused_qkv_a_proj.weight", "q_b_proj.weight",
                "kv_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight")
# HF weights they are made of, quantised as the checkpoint holds them (one tensor at a time)
FP8_SOURCES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
               "gate_proj.weight", "up_proj.weight", "down_proj.weight", "q_a_proj.weight",
               "kv_a_proj_with_mqa.weight", "q_b_proj.weight", "kv_b_proj.weight")


def _quantised(sd, block):
    """(FP8 bytes as uint8, float32 scales) of every HF tensor vLLM FP8 quantises, each in
    blocks of `block` over its last two dims; fused experts per half, as the checkpoint's
    separate gate and up tensors."""
    from ray_reshard.execution.fp8 import reference_quantize

    def q(t):
        w, s = reference_quantize(t.float(), block)
        return w.view(torch.uint8), s

    wq, sc = {}, {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            (gw, gs), (uw, us) = (q(h) for h in v.chunk(2, dim=1))
            wq[k], sc[k] = torch.cat([gw, uw], 1), torch.cat([gs, us], 1)
        elif k.endswith("experts.down_proj") or (
                k.endswith(FP8_SOURCES) and "shared_head" not in k and "eh_proj" not in k):
            wq[k], sc[k] = q(v)
    return wq, sc


def vllm_fp8_reference(cfg, sd, par, rank, dtype, fill=0.0) -> dict:
    """A vLLM FP8 engine's storages: the quantised tensors cut and fused by the same rules as
    the model dtype's (applied to the FP8 bytes and, block by block, to the scales; the
    engine's shards are whole blocks), everything else as in `vllm_reference`."""
    block = tuple(par.weight_block_size)
    wq, sc = _quantised(sd, block)
    plain = vllm_reference(cfg, cast(sd, dtype), par, rank, fill)
    weights = vllm_reference(cfg, {**sd, **wq}, par, rank, fill)
    scales = vllm_reference(cfg, {**sd, **sc}, par, rank, fill)
    out = {}
    for name, t in plain.items():
        if name.endswith(FP8_STORAGES):
            out[name] = weights[name].view(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = scales[name]
        else:
            out[name] = t
    return out


# ------------------------------------------------------------------------------- either side

def reference_state(cfg, sd, par, rank, dtype=None, fill=0.0) -> dict:
    """Every storage rank `rank` of `par` (a Megatron or VLLM layout) holds for the HF state
    dict `sd` (fused or checkpoint-style experts), in `dtype`, padding rows holding `fill`.
    A vLLM FP8 engine's quantised storages hold `sd` quantised from its own dtype."""
    sd = fuse_split_experts(sd)
    kind = type(par).__name__
    if kind not in ("Megatron", "VLLM"):
        raise TypeError(f"reference_state: par must be Megatron or VLLM, got {kind}")
    if kind == "VLLM" and par.quantization == "fp8":
        if par.model == "mtp":
            raise NotImplementedError("reference_state: FP8 MTP draft models")
        return vllm_fp8_reference(cfg, sd, par, rank, dtype, fill)
    sd = cast(sd, dtype)
    if kind == "Megatron":
        return megatron_reference(cfg, sd, par, rank, fill)
    if par.model == "mtp":
        return vllm_mtp_reference(cfg, sd, par, rank, fill)
    return vllm_reference(cfg, sd, par, rank, fill)
