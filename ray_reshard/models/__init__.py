"""Refit recipes for real models: Megatron-core training layouts to vLLM inference layouts.

    from ray_reshard.models import Megatron, VLLM, refit_specs, local_state, empty_storage
    specs = refit_specs(hf_config, train=Megatron(tp=4, pp=8, ep=16, etp=1, dp=4),
                        infer=VLLM(tp=8, dp=16), dtype=torch.bfloat16,
                        train_dtype=torch.float32)
    plan = ray_reshard.plan(specs, src_domains, dst_domains)

Families: Llama (and Mistral), Qwen2, Qwen3 (q_norm/k_norm), Qwen3-MoE, DeepSeek-V3 (MLA with
or without q_lora_rank, dense first layers, routed + shared experts, routing bias for
topk_method "noaux_tc", MTP layers). `config` is
a HF config dict, a path to config.json (or its directory), or a transformers PretrainedConfig.

Logical tensors
    The Hugging Face parameters: names and shapes of the HF model's state dict, so the specs
    cover 100% of the model's bytes (a tied lm_head is the embedding, refit once). A parameter
    is cut into named sub-pieces (``name@tag``) only where some rank keeps its shard in several
    separate places of its storage: q/k/v per query group when a Megatron rank holds more than
    one group (``@g3``), and transformers>=5 fused experts (``gate_up_proj@gate``/``@up``, or
    ``@e5.gate``/``@e5.up``/``down_proj@e5`` when Megatron keeps one tensor per expert). See
    `pieces`. `hf_experts` chooses the HF expert naming: "fused" (transformers >= 5 modules),
    "split" (checkpoint files, transformers 4: one 2-d tensor per expert) or "auto".

Engines, one module each (`megatron`, `vllm`) over a shared description of an engine's
storage (`storage`): each engine's own names, fusion and padding, expressed with Slots, so the
bytes land directly in the engine's parameters: Megatron linear_qkv [q_g; k_g; v_g] per query
group, linear_fc1 = [gate; up], experts per local expert (TE grouped ``weight{i}``, sequential)
or stacked, padded vocabulary (make_vocab_size_divisible_by * tp), virtual pipeline chunks,
uneven first/last stages, MTP layers; vLLM qkv_proj = [q; k; v] per TP rank (kv heads
replicated when tp > kv heads), gate_up_proj, routed experts w13/w2 with tensor or expert
parallelism over an engine's dp x tp ranks (linear or round-robin placement, uneven counts),
fused_qkv_a_proj for MLA, vocabulary padded to 64 rows and cut in VocabParallelEmbedding's
per-rank blocks (padding rows are never written), the DeepSeek MTP draft model. Rank
numbering: see each engine module (Megatron tp-cp-ep-dp-pp, tp fastest; vLLM dp, pp, tp).

Helpers: `local_state` (a rank's storages from a full HF state dict, either side),
`empty_storage` (destination storages, padded), `assemble_state_dict` (back to HF),
`padding_mask`, `storage_shapes`, `tied_aliases`, `hf_parameter_shapes`, `config_differences`
(what two configs differ in that changes a parameter's shape or meaning).
"""
from .config import FAMILIES, ModelDims, config_differences, model_dims
from .fsdp import FSDP, fsdp_local_tensors
from .megatron import Megatron
from .vllm import VLLM
from .pieces import Piece, enumerate_pieces, resolve_hf_experts
from .registry import Engine, engine, engines, register_engine
from .recipe import (Recipe, assemble_state_dict, empty_storage, hf_parameter_shapes,
                     local_state, logical_to_hf, padding_mask, refit_specs, storage_shapes,
                     tied_aliases)

__all__ = [
    "Engine", "FAMILIES", "FSDP", "Megatron", "ModelDims", "Piece", "Recipe", "VLLM",
    "assemble_state_dict", "config_differences", "empty_storage", "enumerate_pieces", "fsdp_local_tensors",
    "hf_parameter_shapes", "local_state", "logical_to_hf", "model_dims", "padding_mask",
    "engine", "engines", "refit_specs", "register_engine", "resolve_hf_experts",
    "storage_shapes", "tied_aliases",
]
