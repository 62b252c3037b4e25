"""Engines, one folder each: a training or inference engine's layout (where each rank keeps each
piece of a model) and its own integration, found by name through the registry. An engine
registers itself when its folder is imported: the line below imports the built-in ones."""
from .registry import Engine, engine, engines, register_engine
from . import fsdp, megatron, vllm  # noqa: F401,E402  (built-in engines)

__all__ = ["Engine", "engine", "engines", "register_engine"]
