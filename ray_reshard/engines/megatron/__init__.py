"""Megatron-core training ranks: their layout (`Megatron`) and where each keeps each piece."""
from ..registry import Engine, register_engine
from .layout import Megatron, MegatronSide, fill_dp

__all__ = ["Megatron", "MegatronSide"]

register_engine(Engine("megatron", Megatron, "train", "megatron:tp=4,pp=8,ep=16", fill_dp))
