"""WorkerView: a Ray actor standing in, in a ReshardGroup, for an engine worker that is not a
Ray actor, by mapping the worker's memory. Real: a local Ray cluster, a process exporting its
tensors as an engine worker does, the view, a ReshardGroup writing through it."""
import functools
import os
import signal
import time

import pytest
import ray
import torch

import ray_reshard as rr
from ray_reshard.engines.views import (WorkerView, entry, export_tensors,
                                                   local_tensors)

KEY = "views"


@ray.remote(num_cpus=0, max_restarts=0)
class EngineWorker:
    """A process holding weights it exports (as the vLLM backend exports a worker's)."""

    def __init__(self):
        self.w = torch.zeros(4, 6)

    def export(self):
        return export_tensors({"w": self.w})

    def weights(self):
        return self.w.clone()

    def pid(self):
        return os.getpid()


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, w):
        entry(KEY)["tensors"] = lambda: {"w": w}


def test_a_refit_through_a_view_of_a_dead_worker_is_refused(cluster):
    worker = EngineWorker.options(resources={"node1": 1}).remote()
    view = WorkerView.options(resources={"node1": 1}).remote(KEY, 0, ray.get(worker.export.remote()))
    full = torch.randn(4, 6)
    layout = rr.Layout(rr.Mesh([0, 1], ("tp",)), (rr.Shard(1),))
    trainers = [Trainer.options(resources={"node0": 1}).remote(rr.shard_tensor(full, layout, r))
                for r in range(2)]
    spec = rr.TensorSpec(full.shape, torch.float32, src=layout,
                         dst=rr.Layout(rr.Mesh([0], ("tp",)), (rr.Replicate(),)))
    with rr.ReshardGroup(trainers, [view], tensors=functools.partial(local_tensors, KEY),
                         timeout_s=30) as group:
        group.refit({"w": spec})
        assert torch.equal(ray.get(worker.weights.remote()), full)   # the worker's own memory
        os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
        t_end = time.monotonic() + 30
        while True:             # until Ray saw the process go
            try:
                ray.get(worker.pid.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            assert time.monotonic() < t_end
            time.sleep(0.2)
        t0 = time.monotonic()
        with pytest.raises(rr.RefitError, match=r"dst rank 0.*engine worker 0 \(process \d+\) "
                                                r"is gone"):
            group.refit({"w": spec})
        assert time.monotonic() - t0 < 15
