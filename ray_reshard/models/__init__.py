"""Specs of a refit from a Hugging Face config: the model's pieces, each engine's storage, and
the recipes that pair a training engine with an inference engine (docs/engines.md). The engine
layouts live in `ray_reshard.engines` and are handed on here (`models.VLLM`, ...) on first use:
the engines build on this package, which imports none of them."""
from .config import FAMILIES, ModelDims, config_differences, model_dims
from .pieces import Piece, enumerate_pieces, resolve_hf_experts
from .recipe import (Recipe, assemble_state_dict, empty_storage, hf_parameter_shapes,
                     local_state, logical_to_hf, padding_mask, refit_specs, storage_shapes,
                     tied_aliases)

__all__ = [
    "Engine", "FAMILIES", "FSDP", "Megatron", "ModelDims", "Piece", "Recipe", "VLLM",
    "assemble_state_dict", "config_differences", "empty_storage", "engine", "engines",
    "enumerate_pieces", "fsdp_local_tensors", "hf_parameter_shapes", "local_state",
    "logical_to_hf", "model_dims", "padding_mask", "refit_specs", "register_engine",
    "resolve_hf_experts", "storage_shapes", "tied_aliases",
]
_ENGINE_NAMES = {"Engine", "engine", "engines", "register_engine", "FSDP", "fsdp_local_tensors",
                 "Megatron", "VLLM"}


def __getattr__(name):
    if name in _ENGINE_NAMES:
        from .. import engines
        from ..engines.fsdp import FSDP, fsdp_local_tensors
        from ..engines.megatron import Megatron
        from ..engines.vllm import VLLM
        found = {"FSDP": FSDP, "fsdp_local_tensors": fsdp_local_tensors, "Megatron": Megatron,
                 "VLLM": VLLM}
        return found.get(name) or getattr(engines, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
