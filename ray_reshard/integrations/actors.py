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
from ..engines.vllm.launch import vllm_worker_actors
from ..runtime.membership import current_actor, train_worker_actors

__all__ = ["current_actor", "train_worker_actors", "vllm_worker_actors"]
