"""What two model configs differ in that makes a refit from one into the other unsound."""
import pytest

from ray_reshard.models import config_differences

QWEN3 = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=320,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             tie_word_embeddings=True, hidden_act="silu", max_position_embeddings=256)


def test_equal_configs_and_what_inference_may_set_apart():
    assert config_differences(QWEN3, dict(QWEN3)) == []
    # context length, RoPE scaling, norm epsilon and dtype do not change what weights mean;
    # a head_dim left to its default equals the one spelled out
    served = dict(QWEN3, max_position_embeddings=4096, rope_scaling={"type": "yarn"},
                  rms_norm_eps=1e-5, torch_dtype="bfloat16")
    assert config_differences(QWEN3, served) == []
    assert config_differences(dict(QWEN3, head_dim=None), QWEN3) == []


@pytest.mark.parametrize("change, named", [
    (dict(intermediate_size=384), "intermediate_size: 320 vs 384"),
    (dict(intermediate_size=256), "intermediate_size: 320 vs 256"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings: True vs False"),
    (dict(num_key_value_heads=4), "num_key_value_heads: 2 vs 4"),
    (dict(attention_bias=True), "attention_bias: False vs True"),
    (dict(hidden_act="gelu"), "hidden_act: 'silu' vs 'gelu'"),
    (dict(model_type="qwen2"), "model_type: 'qwen3' vs 'qwen2'"),
])
def test_a_difference_in_shape_or_meaning_is_named(change, named):
    assert config_differences(QWEN3, dict(QWEN3, **change)) == [named]


def test_moe_structure_is_compared():
    moe = dict(QWEN3, model_type="qwen3_moe", num_experts=6, moe_intermediate_size=64,
               num_experts_per_tok=2, mlp_only_layers=[0])
    assert config_differences(moe, dict(moe, mlp_only_layers=[])) == [
        "MoE layers (decoder_sparse_step, mlp_only_layers, first_k_dense_replace, "
        "moe_layer_freq): [1] vs [0, 1]"]
    assert config_differences(moe, dict(moe, num_experts_per_tok=3)) == [
        "num_experts_per_tok: 2 vs 3"]
