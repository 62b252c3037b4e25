"""vLLM inference engines: their layout (`VLLM`), the weight-transfer backend (`backend`, needs
vLLM), engines as Ray actors (`launch`) and the gate that keeps generation out of updates
(`serving`)."""
from ..registry import Engine, register_engine
from .layout import VLLM, VLLMSide

__all__ = ["VLLM", "VLLMSide"]

register_engine(Engine("vllm", VLLM, "infer", "vllm:tp=8,dp=16"))
