"""The storages `local_state` builds are exactly the engines' storages as engine_reference
rebuilds them independently (plain view / cat / chunk from the engines' loading rules): the
same names, none missing and none extra, the same bytes."""
import pytest
import torch

from ray_reshard.models import VLLM, Megatron, local_state, storage_shapes
from engine_reference import reference_state, vllm_mtp_reference
from models_testutil import make_model


def _compare(got: dict, want: dict, what: str):
    """Every storage the recipe builds is one the reference builds, and the other way round."""
    assert want, what
    assert not set(got) - set(want), f"{what}: storages the reference lacks: {sorted(set(got) - set(want))}"
    assert not set(want) - set(got), f"{what}: storages the recipe lacks: {sorted(set(want) - set(got))}"
    for n, w in want.items():
        assert n in got, f"{what}: no storage {n}"
        assert got[n].shape == w.shape, f"{what}: {n} {tuple(got[n].shape)} != {tuple(w.shape)}"
        assert got[n].dtype == w.dtype, f"{what}: {n} {got[n].dtype} != {w.dtype}"
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
    # o_proj bias (whole on every rank), tied embedding on the last PP rank too
    ("llama", {"attention_bias": True, "tie_word_embeddings": True}, VLLM(tp=2, pp=2)),
    # MLA without q_lora_rank: q_proj column-parallel, kv_a_proj_with_mqa whole
    ("deepseek_v3", {"q_lora_rank": None}, VLLM(tp=4, pp=2, layers_per_stage=(2, 1))),
    ("deepseek_v3", {"n_shared_experts": 2}, VLLM(tp=2, dp=2, ep=4, expert_placement="round_robin")),
]


@pytest.mark.parametrize("family,over,par", VLLM_CASES)
def test_vllm_storages_match_reference(family, over, par):
    cfg, model = make_model(family, **over)
    sd = model.state_dict()
    for r in range(par.world):
        got = local_state(cfg, par, "dst", r, sd)
        assert set(got) == set(storage_shapes(cfg, par, r))
        _compare(got, reference_state(cfg, sd, par, r), f"vLLM {par} rank {r}")


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
    ("llama", {"attention_bias": True}, Megatron(tp=2, pp=3)),
    ("deepseek_v3", {}, Megatron(tp=4, pp=1, ep=2, etp=2, experts="stacked")),
    ("deepseek_v3", {"q_lora_rank": None, "n_shared_experts": 2},
     Megatron(tp=2, pp=2, ep=2, etp=1, layers_per_stage=(1, 2))),
    ("deepseek_v3", {"num_hidden_layers": 4}, Megatron(tp=2, pp=2, vpp=2, ep=2, etp=1)),
]


@pytest.mark.parametrize("family,over,par", MEGATRON_CASES)
def test_megatron_storages_match_reference(family, over, par):
    cfg, model = make_model(family, **over)
    sd = model.state_dict()
    for r in range(par.world):
        got = local_state(cfg, par, "src", r, sd)
        assert set(got) == set(storage_shapes(cfg, par, r))
        _compare(got, reference_state(cfg, sd, par, r), f"{par} rank {r}")


def test_rank_numbering():
    """Megatron: tp fastest, then cp, dp, pp; experts: etp, ep, edp. vLLM: dp, pp, tp."""
    from ray_reshard.models.config import model_dims
    from ray_reshard.engines.megatron.layout import MegatronSide
    from ray_reshard.engines.vllm.layout import VLLMSide
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
        _compare(got, reference_state(cfg, sd, par, r), f"{par} rank {r}")
