"""The vLLM recipe refuses, before any plan, the block-FP8 engines vLLM itself refuses to build
(its validate_fp8_block_shape), naming the rule; and routed experts whose per-partition
intermediate size is not a multiple of the block."""
import pytest
import torch

import ray_reshard as rr
from ray_reshard.models import Megatron, VLLM, refit_specs

RULE = "validate_fp8_block_shape"


def llama(**over):
    from transformers import LlamaConfig
    kw = dict(vocab_size=1000, hidden_size=256, intermediate_size=320, num_hidden_layers=1,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    return LlamaConfig(**{**kw, **over})


def qwen3_moe(**over):
    from transformers import Qwen3MoeConfig
    kw = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=256, mlp_only_layers=[1])
    return Qwen3MoeConfig(**{**kw, **over})


def test_tp1_merged_gate_up_with_ragged_gate_is_refused_naming_the_rule():
    """intermediate_size=320 at TP1: gate_up_proj = [320; 320] rows, the first part ragged
    (and qkv_proj's k part, 64 rows). vLLM refuses both; so does the recipe, before a plan."""
    with pytest.raises(ValueError, match=RULE) as e:
        refit_specs(llama(), train=Megatron(tp=1), infer=VLLM(tp=1, quantization="fp8"))
    assert "qkv_proj" in str(e.value) and "64 rows" in str(e.value)
    # with 4 kv heads k and v are whole blocks: gate_up is what is refused
    with pytest.raises(ValueError, match=RULE) as e:
        refit_specs(llama(num_key_value_heads=4), train=Megatron(tp=1),
                    infer=VLLM(tp=1, quantization="fp8"))
    assert "gate_up_proj" in str(e.value) and "320 rows" in str(e.value)


def test_only_the_last_part_of_a_merged_weight_may_be_ragged_at_tp1():
    cfg = llama(num_key_value_heads=4, intermediate_size=384 + 64)
    with pytest.raises(ValueError, match=RULE):
        refit_specs(cfg, train=Megatron(tp=1), infer=VLLM(tp=1, quantization="fp8"))
    # a ragged hidden size (320) is a ragged edge of o_proj's and down_proj's rows and of
    # every input, none of them a partition or a merged part: accepted, and planned (Megatron
    # TP4: one query group per rank, so q/k/v are not cut into per-group pieces)
    specs = refit_specs(llama(num_key_value_heads=4, intermediate_size=384, hidden_size=320),
                        train=Megatron(tp=4), infer=VLLM(tp=1, quantization="fp8"))
    rr.plan(specs)


def test_tp2_every_partition_must_be_whole_blocks():
    # gate/up per rank 320 / 2 = 160 rows
    with pytest.raises(ValueError, match=RULE) as e:
        refit_specs(llama(num_key_value_heads=8, head_dim=32, num_attention_heads=8,
                          hidden_size=256, intermediate_size=320),
                    train=Megatron(tp=2), infer=VLLM(tp=2, quantization="fp8",
                                                    weight_block_size=(64, 32)))
    assert "gate_up_proj" in str(e.value) and "block_n=64" in str(e.value)
    # down_proj's input per rank: 336 / 2 = 168 columns, not a multiple of block_k = 32
    with pytest.raises(ValueError, match=RULE) as e:
        refit_specs(llama(num_key_value_heads=8, intermediate_size=336),
                    train=Megatron(tp=2), infer=VLLM(tp=2, quantization="fp8",
                                                    weight_block_size=(8, 32)))
    assert "down_proj" in str(e.value) and "block_k=32" in str(e.value)
    specs = refit_specs(llama(num_key_value_heads=8, intermediate_size=256),
                        train=Megatron(tp=2), infer=VLLM(tp=2, quantization="fp8",
                                                        weight_block_size=(32, 32)))
    rr.plan(specs)


def test_moe_experts_with_ragged_per_partition_intermediate_are_refused():
    """Experts 256 over TP4 without EP: 64 rows per partition, not whole 128-blocks: vLLM pads
    or refines their scales; the recipe refuses before any byte moves."""
    with pytest.raises(ValueError, match="routed experts.*intermediate size per partition 64"):
        refit_specs(qwen3_moe(), train=Megatron(tp=1),
                    infer=VLLM(tp=4, quantization="fp8"))
    # at TP1 the experts' 96 rows are one ragged block, and still refused
    with pytest.raises(ValueError, match="routed experts.*intermediate size per partition 96"):
        refit_specs(qwen3_moe(moe_intermediate_size=96), train=Megatron(tp=1),
                    infer=VLLM(tp=1, quantization="fp8"))
    # whole blocks per partition: accepted and planned
    rr.plan(refit_specs(qwen3_moe(), train=Megatron(tp=1), infer=VLLM(tp=2, quantization="fp8")))


def test_bf16_engines_are_not_subject_to_the_rule():
    rr.plan(refit_specs(llama(), train=Megatron(tp=1), infer=VLLM(tp=1),
                        dtype=torch.bfloat16))
