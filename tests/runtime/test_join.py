"""A new engine filled from a replica that holds the current version, not from the trainers;
then the group grows to include it with update()."""
from __future__ import annotations

import pytest
import ray
import torch

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.runtime import worker
from ray_reshard.tools.testing import holders


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


def specs_for(n_replicas):
    train = L([0, 1], Shard(0))
    grid = [[2 * d, 2 * d + 1] for d in range(n_replicas)]
    infer = L(grid, Replicate(), Shard(1), names=("dp", "tp"))
    whole = L(grid, Replicate(), Replicate(), names=("dp", "tp"))
    return {"w": rr.TensorSpec((16, 8), torch.float32, train, infer),
            "b": rr.TensorSpec((8,), torch.bfloat16, train, whole, src_dtype=torch.float32)}


def load(actors, specs, fulls, side):
    per = []
    for r in range(len(actors)):
        d = {}
        for n, s in specs.items():
            lay = s.layout(side)
            if lay.box(r, s.shape) is None:
                continue
            d[n] = rr.shard_tensor(fulls[n].to(s.source_dtype), lay, r) if side == "src" else \
                torch.zeros(lay.local_shape(r, s.shape), dtype=s.dtype)
        per.append(d)
    ray.get([a.set.remote(t) for a, t in zip(actors, per)])


def exact(actors, specs, fulls, ranks):
    got = ray.get([a.get.remote() for a in actors])
    return all(torch.equal(got[i][n], rr.shard_tensor(fulls[n].to(s.dtype), s.dst, r))
               for i, r in enumerate(ranks) for n, s in specs.items())


@pytest.mark.slow
def test_new_engine_joins_from_a_replica_then_the_group_grows(cluster):
    trainers, engines, new = holders(2, 0), holders(4, 1), holders(2, 1)
    specs = specs_for(2)
    g = torch.Generator().manual_seed(3)
    fulls = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    load(trainers, specs, fulls, "src")
    load(engines, specs, fulls, "dst")
    with rr.ReshardGroup(trainers, engines) as group:
        group.refit(specs)
        assert exact(engines, specs, fulls, range(4))
        # The new engine mirrors replica 1 (engines 2 and 3); the trainers take no part.
        join, ranks = rr.replica_specs(specs, {"dp": 1})
        ray.get([a.set.remote({n: torch.zeros(s.dst.local_shape(r, s.shape), dtype=s.dtype)
                               for n, s in join.items()}) for r, a in enumerate(new)])
        with rr.ReshardGroup([engines[r] for r in ranks], new) as joiner:
            res = joiner.refit(join)
            held = sum(s.dst.box(r, s.shape).numel * s.itemsize for s in join.values()
                       for r in range(2))
            assert sum(res.bytes_by_path.values()) == held      # each new rank's shards, once
            member_of = ray.get([t.__ray_call__.remote(worker.member_groups) for t in trainers])
            assert all(joiner.group_id not in groups for groups in member_of)
        got = ray.get([a.get.remote() for a in new])
        want = ray.get([engines[r].get.remote() for r in ranks])
        assert all(torch.equal(got[i][n], want[i][n]) for i in range(2) for n in join)
        # The group grows to three replicas: same trainers, same plans cache, a new version.
        fulls2 = {n: f + 1 for n, f in fulls.items()}
        load(trainers, specs, fulls2, "src")
        group.update(dst_actors=engines + new)
        specs3 = specs_for(3)
        res = group.refit(specs3)
        assert exact(engines + new, specs3, fulls2, range(6)) and res.version == 2


def test_joining_from_a_replica_ray_restarted_is_refused_and_it_is_listed_stale(cluster):
    """A replica whose actor Ray restarted lost its group state and the weights it held: a join
    from it is a RefitError naming its rank, and stale_destinations lists it."""
    import os
    import time

    from ray_reshard.tools.testing import Holder

    trainers = holders(2, 0)
    engines = [Holder.options(resources={"node1": 1}, max_restarts=1).remote() for _ in range(4)]
    new = holders(2, 1)
    specs = specs_for(2)
    fulls = {n: torch.randn(s.shape) for n, s in specs.items()}
    load(trainers, specs, fulls, "src")
    load(engines, specs, fulls, "dst")
    with rr.ReshardGroup(trainers, engines, timeout_s=30) as group:
        group.refit(specs)
        pid = ray.get(engines[3].__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(engines[3], no_restart=False)
        t_end = time.monotonic() + 60
        while True:                                   # until Ray restarted it
            try:
                if ray.get(engines[3].__ray_call__.remote(lambda self: os.getpid()),
                           timeout=5) != pid:
                    break
            except Exception:
                pass
            assert time.monotonic() < t_end
            time.sleep(0.2)
        assert group.stale_destinations() == {}       # nothing told the driver yet
        assert list(group.stale_destinations(check=True)) == [3]
        assert "Ray restarted it" in group.stale_destinations()[3]
        with pytest.raises(rr.RefitError, match=r"dst rank 3: Ray restarted it"):
            group.join(specs, {"dp": 1}, new)
        assert list(group.stale_destinations()) == [3]
        join, ranks = rr.replica_specs(specs, {"dp": 0})
        ray.get([a.set.remote({n: torch.zeros(s.dst.local_shape(r, s.shape), dtype=s.dtype)
                               for n, s in join.items()}) for r, a in enumerate(new)])
        res = group.join(specs, {"dp": 0}, new)       # the other replica holds v1
        assert res.version == 1 and exact(new, join, fulls, range(2))
