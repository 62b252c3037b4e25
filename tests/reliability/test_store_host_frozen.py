"""A frozen (SIGSTOPped) store host: process 0 hosts the group's store, so every vote, abort
flag and store wait of the others goes through it. None of them may outlast the refit's
deadline: the refit fails with a RefitError naming the rank that stopped answering, and the
other members are free again at once (an engine can serve, and take the next refit after
update()), however long process 0 stays frozen."""
import os
import signal
import sys
import time

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.tools.testing import Holder

from reliability_util import L

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)

TIMEOUT = 4.0
GRACE = 5.0              # what the driver waits past the deadline before naming a rank hung
MARGIN = 6.0             # scheduling noise on a loaded 2-core machine


def _pid(actor):
    return os.getpid()


def _stop_in_run(actor):
    """This process's next run stops the process (SIGSTOP) once every member voted yes."""
    from ray_reshard.runtime import executor

    real = executor.run_program

    def stop_then_run(*args, **kwargs):
        executor.run_program = real
        os.kill(os.getpid(), signal.SIGSTOP)
        return real(*args, **kwargs)
    executor.run_program = stop_then_run


def _stop_now(actor):
    os.kill(os.getpid(), signal.SIGSTOP)


SPECS = {"w": rr.TensorSpec((64, 32), torch.float32, L([0, 1], Shard(0)), L([0, 1], Shard(1))),
         "b": rr.TensorSpec((32,), torch.float32, L([0, 1], Replicate()), L([0, 1], Shard(0)))}


def load(src, dst, gen):
    g = torch.Generator().manual_seed(gen)
    f = {n: torch.randn(s.shape, generator=g) for n, s in SPECS.items()}
    ray.get([a.set.remote({n: rr.shard_tensor(f[n], s.src, r) for n, s in SPECS.items()})
             for r, a in enumerate(src)])
    ray.get([a.set.remote({n: torch.zeros(s.dst.local_shape(r, s.shape)) for n, s in SPECS.items()})
             for r, a in enumerate(dst)])
    return f


@pytest.mark.parametrize("when", ["run", "vote"])
def test_frozen_store_host_frees_the_others_within_the_deadline(cluster, when):
    src = [Holder.options(resources={"node0": 1}, max_restarts=0).remote() for _ in range(2)]
    dst = [Holder.options(resources={"node1": 1}, max_restarts=0).remote() for _ in range(2)]
    host_pid = ray.get(src[0].__ray_call__.remote(_pid))
    ray.get([a.node.remote() for a in src + dst])
    g = rr.ReshardGroup(src, dst, timeout_s=TIMEOUT)
    try:
        load(src, dst, 0)
        g.refit(SPECS, atomic=True)
        load(src, [], 1)
        before = ray.get([a.get.remote() for a in dst])
        if when == "run":                  # frozen after the vote, while bytes move
            ray.get(src[0].__ray_call__.remote(_stop_in_run))
        else:                              # frozen before the refit: the vote cannot complete
            src[0].__ray_call__.remote(_stop_now)
            time.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(rr.RefitError) as e:
            g.refit(SPECS, atomic=True)
        took = time.monotonic() - t0
        assert took < TIMEOUT + GRACE + MARGIN, f"RefitError after {took:.1f} s"
        assert e.value.failed_ranks == (("src", 0),), str(e.value)
        # Process 0 stays frozen: the destinations answer now, with their old weights.
        t1 = time.monotonic()
        got = ray.get([a.get.remote() for a in dst], timeout=TIMEOUT + MARGIN)
        assert all(torch.equal(a[n], b[n]) for a, b in zip(got, before) for n in a)
        assert ray.get(src[1].get.remote(), timeout=TIMEOUT + MARGIN)
        print(f"\nfrozen store host ({when}): RefitError after {took:.1f} s, the others "
              f"free {time.monotonic() - t1:.1f} s later")
    finally:
        os.kill(host_pid, signal.SIGCONT)
        g.close()
        for a in src + dst:
            ray.kill(a)
