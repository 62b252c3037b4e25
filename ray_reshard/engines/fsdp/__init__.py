"""torch FSDP2 training ranks on Hugging Face names: their layout (`FSDP`) and their shards."""
from ..registry import Engine, register_engine
from .layout import FSDP, FSDPSide, fsdp_local_tensors

__all__ = ["FSDP", "FSDPSide", "fsdp_local_tensors"]

register_engine(Engine("fsdp", FSDP, "train", "fsdp:shard=8,replicate=2"))
