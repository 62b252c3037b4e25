"""Overlapped refits: refit_async returns once the sources are captured; a trainer's optimizer
step right after it does not change what destinations receive."""
import sys
import time

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.tools.testing import Holder

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)

SHAPE = (512, 256)
SRC = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(0),))
DST = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(1),))


@ray.remote(num_cpus=0, max_concurrency=2)
class Trainer(Holder.__ray_actor_class__):
    """Takes 'optimizer steps' (adds 1 in place) while a refit's bytes may be moving."""

    def step(self):
        for t in self.tensors.values():
            t.add_(1.0)
        return time.monotonic()


def test_step_right_after_refit_async_does_not_change_what_is_sent(cluster):
    src = [Trainer.options(resources={"node0": 1}).remote() for _ in range(2)]
    dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(2)]
    specs = {"w": rr.TensorSpec(SHAPE, torch.float32, SRC, DST)}
    full = torch.randn(SHAPE)
    with rr.ReshardGroup(src, dst, timeout_s=30) as g:
        for step in range(3):
            v = full + 10 * step
            ray.get([a.set.remote({"w": rr.shard_tensor(v, SRC, r)}) for r, a in enumerate(src)]
                    + [a.set.remote({"w": torch.zeros(DST.local_shape(r, SHAPE))})
                       for r, a in enumerate(dst)])
            pending = g.refit_async(specs)
            assert pending.version == g.version + 1
            ray.get([a.step.remote() for a in src])        # the next step, at once
            res = pending.wait()
            assert res.version == pending.version == g.version
            assert res.extra_bytes == SHAPE[0] // 2 * SHAPE[1] * 4   # the captured shard
            got = ray.get([a.get.remote() for a in dst])
            for r in range(2):
                assert torch.equal(got[r]["w"], rr.shard_tensor(v, DST, r)), (step, r)
            trained = ray.get([a.get.remote() for a in src])
            assert torch.equal(trained[0]["w"], rr.shard_tensor(v + 1, SRC, 0))
        # Another call waits for a refit still in flight; versions stay in order.
        p = g.refit_async(specs)
        assert g.refit(specs).version == p.version + 1 and p.wait().version == p.version
