"""Actor handles of the processes that hold the weights, for a `ReshardGroup` built by hand
(the vLLM backend finds the workers itself, through the engine's ``collective_rpc``).

`vllm_worker_actors(llm)`: vLLM-on-Ray workers in worker rank order; `train_worker_actors()`,
called on every worker inside a Ray Train training function: its workers in global rank order.
Usage: docs/ray-train.md (A group built by hand).
"""
from ..engines.vllm.launch import vllm_worker_actors
from ..runtime.membership import current_actor, train_worker_actors

__all__ = ["current_actor", "train_worker_actors", "vllm_worker_actors"]
