"""Actor handles of the processes holding weights, collected from inside them."""
import pytest
import ray

from ray_reshard.integrations.actors import current_actor, train_worker_actors, vllm_worker_actors


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, index):
        self.index = index

    def whoami(self):
        return self.index

    def gather(self, world, path):
        """What a Ray Train worker runs: torch.distributed is set up, then the collective."""
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=self.index,
                                world_size=world)
        try:
            return train_worker_actors()
        finally:
            dist.destroy_process_group()

    def alone(self):
        return train_worker_actors()


class LLMStandIn:
    """vLLM's LLM.collective_rpc runs a function on every worker, results by worker rank."""

    def __init__(self, workers):
        self.workers = workers

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return ray.get([w.__ray_call__.remote(lambda actor, f=method: f(actor))
                        for w in self.workers], timeout=timeout)


def test_actor_handles(cluster, tmp_path):
    ranks = [Rank.remote(i) for i in range(3)]
    got = ray.get([r.gather.remote(3, str(tmp_path / "pg")) for r in ranks])
    for handles in got:
        assert ray.get([h.whoami.remote() for h in handles]) == [0, 1, 2]
    alone = ray.get(ranks[1].alone.remote())
    assert ray.get(alone[0].whoami.remote()) == 1
    handles = vllm_worker_actors(LLMStandIn(ranks[::-1]))
    assert ray.get([h.whoami.remote() for h in handles]) == [2, 1, 0]
    with pytest.raises(RuntimeError, match="only available in an actor"):
        current_actor()
