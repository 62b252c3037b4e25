"""Refit recipes for real models: Megatron-core training layouts to vLLM inference layouts.

    from ray_reshard.models import Megatron, VLLM, refit_specs, local_state, empty_storage
    specs = refit_specs(hf_config, train=Megatron(tp=4, pp=8, ep=16, dp=4),
                        infer=VLLM(tp=8, dp=16), dtype=torch.bfloat16)

Logical tensors are the Hugging Face parameters (see `pieces` for the few cases where a
parameter is cut into named sub-pieces); the rank numbering of both engines is documented in
`parallel`; each engine's storage naming and fusion in `sides`.
"""
from .config import FAMILIES, ModelDims, model_dims
from .parallel import VLLM, Megatron
from .pieces import Piece, enumerate_pieces, resolve_hf_experts
from .recipe import (Recipe, assemble_state_dict, empty_storage, hf_parameter_shapes,
                     local_state, logical_to_hf, padding_mask, refit_specs, storage_shapes,
                     tied_aliases)

__all__ = [
    "FAMILIES", "Megatron", "ModelDims", "Piece", "Recipe", "VLLM", "assemble_state_dict",
    "empty_storage", "enumerate_pieces", "hf_parameter_shapes", "local_state", "logical_to_hf",
    "model_dims", "padding_mask", "refit_specs", "resolve_hf_experts", "storage_shapes",
    "tied_aliases",
]
