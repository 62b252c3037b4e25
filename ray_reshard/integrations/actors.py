"""Actor handles of the processes that hold the weights, for a `ReshardGroup` built by hand
(the vLLM backend finds the workers itself, through the engine's ``collective_rpc``).

Neither vLLM nor Ray Train exposes its worker actors publicly, but every Ray actor can name
itself (``ray.get_runtime_context().current_actor``), so the handles are collected by running a
small function inside the workers:

    # vLLM on Ray (distributed_executor_backend="ray"): one handle per worker, in worker rank
    # order (dp-major, then pp, then tp: the order `VLLM(...)` numbers ranks)
    llm = vllm.LLM(model, tensor_parallel_size=4, distributed_executor_backend="ray")
    dst_actors = vllm_worker_actors(llm)

    # Ray Train: inside the training function, on every worker (uses the default
    # torch.distributed group Ray Train set up; rank order = the trainer's global rank)
    def train_func():
        src_actors = train_worker_actors()

With several vLLM engines (data parallel as separate engines), concatenate their lists in engine
order. A group that calls into Ray Train workers while their training function waits needs Ray
Train V2, whose workers run that function in a thread and take calls meanwhile;
`ray_reshard.integrations.ray_train.WeightSync` does all of this for vLLM engines.
"""
from __future__ import annotations

from typing import Any


def current_actor() -> Any:
    """The handle of the Ray actor this code runs in (Ray raises RuntimeError outside one)."""
    import ray

    return ray.get_runtime_context().current_actor


def _worker_actor(worker) -> Any:
    return current_actor()


def vllm_worker_actors(llm, timeout: float | None = 60.0) -> list:
    """Handles of an `LLM`'s Ray worker actors, in vLLM's worker rank order, through
    ``LLM.collective_rpc`` (which runs the function on every worker and returns results by
    rank). Needs ``distributed_executor_backend="ray"``."""
    return list(llm.collective_rpc(_worker_actor, timeout=timeout))


def train_worker_actors(group=None) -> list:
    """Handles of every worker of a Ray Train run, in torch.distributed rank order; call it on
    every worker (a collective over `group`, default the default process group)."""
    import torch.distributed as dist

    me = current_actor()
    if not dist.is_available() or not dist.is_initialized():
        return [me]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, me, group=group)
    return out
