"""End to end over real (small, random) HF models: Megatron storages -> plan -> simulate ->
vLLM storages, checked bit-exactly, padding untouched, then logits of the reassembled model."""
import pytest
import torch

from ray_reshard.models import VLLM, Megatron, refit_specs, storage_shapes
from models_testutil import check_logits, make_model, run_refit, split_experts

CASES = [
    # id, family, config overrides, train, infer, dtype, train dtype
    ("llama-gqa-tp>kv-pp2-bf16", "llama", {},
     Megatron(tp=2, pp=2, dp=2, first_stage_layers=2), VLLM(tp=4, dp=2), torch.bfloat16, torch.float32),
    ("llama-bias-groups-interleaved", "llama", {"attention_bias": True},
     Megatron(tp=1, pp=3, dp=2), VLLM(tp=2, dp=2), torch.float32, None),
    ("qwen2-bias-tp8>kv", "qwen2", {},
     Megatron(tp=1, pp=2, dp=2, cp=2, last_stage_layers=1), VLLM(tp=8), torch.float32, None),
    ("qwen2-tp<kv", "qwen2", {"num_key_value_heads": 4},
     Megatron(tp=2, pp=1, dp=2), VLLM(tp=2, dp=3), torch.float32, None),
    ("qwen3-tied-pp2-both", "qwen3", {"tie_word_embeddings": True},
     Megatron(tp=2, pp=2, dp=1, last_stage_layers=2), VLLM(tp=2, pp=2, dp=2), torch.bfloat16, torch.float32),
    ("qwen3-tied-pp1", "qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 8},
     Megatron(tp=4, dp=1), VLLM(tp=8), torch.float32, None),
    ("qwen3moe-ep-train-tp-infer", "qwen3_moe", {},
     Megatron(tp=2, ep=4, etp=1, dp=2), VLLM(tp=4, dp=2), torch.bfloat16, torch.float32),
    ("qwen3moe-tp-train-ep-infer-stacked", "qwen3_moe", {},
     Megatron(tp=2, etp=2, ep=1, pp=2, first_stage_layers=1, experts="stacked"), VLLM(tp=2, ep=2, dp=2),
     torch.float32, None),
    ("qwen3moe-etp-ep-sequential", "qwen3_moe", {"decoder_sparse_step": 1, "mlp_only_layers": []},
     Megatron(tp=2, etp=2, ep=2, dp=2, experts="sequential"), VLLM(tp=4, ep=4),
     torch.float32, None),
    ("deepseekv3-mla-pp-ep", "deepseek_v3", {},
     Megatron(tp=1, pp=2, ep=4, dp=4, layers_per_stage=(1, 2)), VLLM(tp=4, ep=4, dp=2), torch.bfloat16, torch.float32),
    ("deepseekv3-no-qlora-tp", "deepseek_v3", {"q_lora_rank": None},
     Megatron(tp=2, etp=1, ep=2, dp=1, experts="stacked"), VLLM(tp=2, dp=2),
     torch.float32, None),
    ("qwen3moe-vpp-to-engine-dp-ep", "qwen3_moe", {"num_hidden_layers": 4, "mlp_only_layers": []},
     Megatron(tp=1, pp=2, vpp=2, ep=2, dp=2), VLLM(tp=2, dp=2, ep=4), torch.bfloat16, torch.float32),
    ("qwen3moe-engine-dp-no-ep", "qwen3_moe", {},
     Megatron(tp=2, ep=2, etp=1, dp=2), VLLM(tp=2, dp=4, engine_dp=2), torch.float32, None),
    ("qwen3moe-10-experts-round-robin", "qwen3_moe", {"num_experts": 10},
     Megatron(tp=2, ep=2, etp=1, dp=1, experts="stacked"),
     VLLM(tp=4, dp=2, ep=4, expert_placement="round_robin"), torch.float32, None),
    ("deepseekv3-engine-dp-shared-replicated", "deepseek_v3", {},
     Megatron(tp=2, pp=3, ep=2, etp=1, dp=1), VLLM(tp=2, dp=4, ep=4), torch.float32, None),
    # the recipes are symmetric: vLLM storages back into Megatron's (e.g. to seed a trainer)
    ("reverse-vllm-to-megatron", "qwen3_moe", {"tie_word_embeddings": True},
     VLLM(tp=2, ep=2, dp=2), Megatron(tp=2, ep=2, etp=1, pp=2, first_stage_layers=2), torch.float32, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refit_model(case):
    _, family, over, train, infer, dtype, train_dtype = case
    cfg, model = make_model(family, **over)
    hf_sd = run_refit(cfg, model, train, infer, dtype=dtype, train_dtype=train_dtype)
    check_logits(cfg, model, hf_sd, dtype=dtype)


def test_split_expert_naming_matches_checkpoints():
    """hf_experts="split": logical experts are the checkpoint's per-expert 2-d tensors."""
    cfg, model = make_model("qwen3_moe")
    sd = dict(model.state_dict())
    split = split_experts(sd)
    train, infer = Megatron(tp=2, ep=2, dp=2), VLLM(tp=2, ep=2, dp=2)
    specs = refit_specs(cfg, train, infer, hf_experts="split")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in specs
    assert set(specs) <= set(split)
    out = run_refit(cfg, model, train, infer, hf_experts="split", state_dict=split)
    assert set(out) == set(split)
    for k, v in split.items():
        assert torch.equal(out[k], v), k


def test_names_are_hf_names_when_no_interleaving():
    """Without Megatron's multi-group interleaving, logical names are exactly the HF names."""
    cfg, model = make_model("llama")
    specs = refit_specs(cfg, Megatron(tp=2, pp=3), VLLM(tp=4))
    sd = model.state_dict()
    assert set(specs) == set(sd)
    for n, s in specs.items():
        assert s.shape == tuple(sd[n].shape)
    # interleaved groups: q/k/v cut per query group, everything else keeps its name
    specs = refit_specs(cfg, Megatron(tp=1), VLLM(tp=4))
    cut = {n for n in specs if "@" in n}
    assert cut and all(n.split("@")[0].endswith(("q_proj.weight", "k_proj.weight",
                                                  "v_proj.weight")) for n in cut)


def test_dtype_and_router_bias_dtype():
    cfg, _ = make_model("deepseek_v3")
    specs = refit_specs(cfg, Megatron(ep=2, dp=2), VLLM(tp=2, ep=2), dtype=torch.bfloat16,
                        train_dtype=torch.float32)
    bias = specs["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.source_dtype == torch.float32
    q = specs["model.layers.0.self_attn.q_b_proj.weight"]
    assert q.dtype == torch.bfloat16 and q.source_dtype == torch.float32


def test_routing_bias_only_for_noaux_tc():
    """vLLM allocates gate.e_score_correction_bias only for topk_method "noaux_tc"."""
    cfg, model = make_model("deepseek_v3", topk_method="greedy")
    specs = refit_specs(cfg, Megatron(ep=2, dp=2), VLLM(tp=2, ep=2))
    assert not any("e_score_correction_bias" in n for n in specs)
    for r in range(2):
        assert not any("e_score_correction_bias" in n for n in storage_shapes(cfg, VLLM(tp=2, ep=2), r))
        assert not any("expert_bias" in n for n in storage_shapes(cfg, Megatron(ep=2, dp=2), r))
    hf_sd = run_refit(cfg, model, Megatron(ep=2, dp=2), VLLM(tp=2, ep=2))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in hf_sd


def test_megatron_uneven_pipeline_is_refused_without_stage_sizes():
    cfg, _ = make_model("llama")                               # 3 layers
    with pytest.raises(ValueError, match="not divisible by pp=2.*first_stage_layers"):
        refit_specs(cfg, Megatron(pp=2), VLLM(tp=2))
    with pytest.raises(ValueError, match="not divisible over the 2 other stages"):
        refit_specs(cfg, Megatron(pp=3, first_stage_layers=2), VLLM(tp=2))
    with pytest.raises(ValueError, match="vpp=2"):
        refit_specs(cfg, Megatron(pp=2, vpp=2, first_stage_layers=2), VLLM(tp=2))
    specs = refit_specs(cfg, Megatron(pp=2, first_stage_layers=1), VLLM(tp=2))
    src = specs["model.layers.1.mlp.down_proj.weight"].src_slots
    assert {slot.storage for _, slot in src} == {"decoder.layers.0.mlp.linear_fc2.weight"}


def test_bad_layouts_are_refused():
    cfg, _ = make_model("llama")
    with pytest.raises(ValueError, match="query groups"):
        refit_specs(cfg, Megatron(tp=4), VLLM(tp=2))          # 2 kv heads over tp 4
    with pytest.raises(ValueError, match="not divisible"):
        refit_specs(cfg, Megatron(tp=2), VLLM(tp=3))
    with pytest.raises(ValueError, match="ep must be 1 or engine_dp"):
        VLLM(tp=4, ep=2)
    with pytest.raises(ValueError, match="ep must be 1 or engine_dp"):
        VLLM(tp=2, dp=4, ep=4, engine_dp=1)
    with pytest.raises(ValueError):
        Megatron(tp=2, dp=1, ep=4)                             # 2 ranks per stage < ep


def test_config_forms(tmp_path):
    """A dict, a config.json path, its directory and a PretrainedConfig give the same specs."""
    import json
    cfg, _ = make_model("qwen3_moe")
    d = cfg.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(d))
    train, infer = Megatron(tp=2, ep=2, etp=1), VLLM(tp=2)
    ref = refit_specs(cfg, train, infer)
    for form in (d, str(tmp_path / "config.json"), tmp_path):
        assert refit_specs(form, train, infer) == ref


def test_bench_llama70b_real_size():
    """Real-size recipe: all bytes through reshard, at the lower bound."""
    from ray_reshard.tools.bench.model_bytes import measure
    from ray_reshard.tools.cli_args import LLAMA3_70B
    m = measure(LLAMA3_70B, Megatron(tp=8, pp=4), VLLM(tp=8, dp=4))
    assert m["share"] == 1.0
    assert m["network"] == m["bound"]
    assert m["gb"] > 5 * m["network"]


def test_mtp_refit_megatron_to_vllm_draft():
    """Megatron's mtp.layers.0 (last stage) -> vLLM's DeepSeek MTP draft model, with the
    draft's embedding and shared head fed from the model's embedding and output layer."""
    from ray_reshard.models import hf_parameter_shapes
    cfg, model = make_model("deepseek_v3")
    sd = dict(model.state_dict())
    g = torch.Generator().manual_seed(5)
    for n, shape in hf_parameter_shapes(cfg, mtp=True).items():
        sd.setdefault(n, torch.randn(shape, generator=g))
    train = Megatron(tp=2, pp=2, ep=2, etp=1, first_stage_layers=1, mtp=True)
    draft = VLLM(tp=2, dp=2, ep=4, model="mtp")
    out = run_refit(cfg, model, train, draft, state_dict=sd)
    assert "model.layers.3.eh_proj.weight" in out and "lm_head.weight" in out
    for k, v in out.items():
        assert torch.equal(v, sd[k]), k
    # the main model's refit from the same trainer leaves the MTP layer out
    main = refit_specs(cfg, train, VLLM(tp=2))
    assert not any(n.startswith("model.layers.3.") for n in main)
    with pytest.raises(ValueError, match="Megatron\\(mtp=True\\)"):
        refit_specs(cfg, Megatron(tp=2, ep=2, etp=1), draft)


GROUPED = [(c[0], c[1], c[2], c[3], c[4]) for c in CASES if "moe" in c[1] or "deepseek" in c[1]]


def _check_specs_as_each_piece(cfg, train, infer, hf_experts, layers=None):
    """Recipe.specs places the per-expert pieces a layer and kind at a time and builds each
    group's specs from its first; every spec must be what placing its piece alone gives, in
    the pieces' order, and hash as a spec built whole (with `layers`, the pieces of those
    layers and every piece outside a layer)."""
    from ray_reshard.layout.spec import TensorSpec
    from ray_reshard.models import Recipe

    recipe = Recipe(cfg, train, infer, hf_experts)
    specs = recipe.specs(torch.bfloat16, torch.float32)
    assert list(specs) == [pc.name for pc in recipe.pieces]
    experts = 0
    for pc, (name, spec) in zip(recipe.pieces, specs.items()):
        if layers is not None and pc.layer is not None and pc.layer not in layers:
            continue
        (s_lay, s_slots), (d_lay, d_slots) = recipe.src.place(pc), recipe.dst.place(pc)
        assert spec.shape == pc.shape and spec.src == s_lay and spec.dst == d_lay, name
        assert tuple(spec.src_slots) == tuple(s_slots), name
        assert tuple(spec.dst_slots) == tuple(d_slots), name
        whole = TensorSpec(spec.shape, spec.dtype, spec.src, spec.dst, spec.src_dtype,
                           tuple(spec.src_slots), tuple(spec.dst_slots), spec.quant)
        assert spec == whole and hash(spec) == hash(whole), name
        experts += pc.expert is not None
    return experts


@pytest.mark.parametrize("case", GROUPED, ids=[c[0] for c in GROUPED])
@pytest.mark.parametrize("hf_experts", ["split", "fused"])
def test_expert_groups_give_each_piece_its_own_placement(case, hf_experts):
    _, family, over, train, infer = case
    cfg, _ = make_model(family, **over)
    experts = _check_specs_as_each_piece(cfg, train, infer, hf_experts)
    assert experts > 0 or hf_experts == "fused"    # fused: per-expert pieces only where cut


def test_expert_groups_at_deepseek_v3_scale():
    """The real model's recipes, main model and MTP draft, checked on the first and last MoE
    layers and the MTP layer (the whole model takes seconds)."""
    from ray_reshard.tools.cli_args import DEEPSEEK_V3

    stages = dict(pp=16, first_stage_layers=3, last_stage_layers=2)
    layers = {3, 60, 61}                  # stage 0's first MoE layer, stage 15's last, MTP
    for train, infer, moe_layers in (
            (Megatron(tp=1, ep=16, etp=1, dp=16, **stages), VLLM(tp=32, dp=8), 2),
            (Megatron(tp=1, ep=16, etp=1, dp=16, mtp=True, **stages),
             VLLM(tp=32, dp=8, ep=32, model="mtp"), 1)):
        experts = _check_specs_as_each_piece(DEEPSEEK_V3, train, infer, "split", layers)
        assert experts == moe_layers * 256 * 3
