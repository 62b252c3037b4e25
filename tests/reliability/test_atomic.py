"""Atomic refits: all or nothing. A refit that fails part-way leaves every destination as it was
(bit for bit) and no process at the new version; a successful one is bit-exact and reports the
staging memory it used. Non-atomic refits that fail may leave mixed weights but never report
the new version. snapshot=True copies the sources first.
"""
import os
import sys

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.runtime import worker
from ray_reshard.tools.testing import Holder, start_cluster

from reliability_util import L, check_exact, fill, raw, same_raw

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)


def new_actors(n, node):
    return [Holder.options(resources={f"node{node}": 1}, max_restarts=0).remote()
            for _ in range(n)]


@pytest.fixture(scope="module")
def rig():
    c = start_cluster(2)
    src, dst, spares = new_actors(2, 0), new_actors(2, 1), new_actors(2, 0)
    ray.get([a.node.remote() for a in src + dst + spares])
    group = rr.ReshardGroup(src, dst, tensors=lookup, timeout_s=8)
    yield group, spares
    group.close()
    ray.shutdown()
    c.shutdown()


def lookup(actor):
    return actor.tensors


def arm_exit(actor, after_s: float = 1.0):
    """The actor's process exits `after_s` after its next refit starts moving bytes (once
    every process's tensors passed the checks). The delay lets the transfers that do not
    involve it finish first even on a loaded machine, so what arrived is deterministic."""
    def patch(self):
        import time

        from ray_reshard.runtime import executor

        def exit_later(*args, **kwargs):
            time.sleep(after_s)
            os._exit(1)
        executor.run_program = exit_later
    ray.get(actor.__ray_call__.remote(patch))


def record_received(actor):
    """The actor's process notes the bytes its next run received (None until a run returns)."""
    def patch(self):
        from ray_reshard.runtime import executor

        real = executor.run_program
        self.rr_received = None

        def recording(*args, **kwargs):
            executor.run_program = real
            out = real(*args, **kwargs)
            self.rr_received = out["recv_bytes"]
            return out
        executor.run_program = recording
    ray.get(actor.__ray_call__.remote(patch))


def received(actor):
    return ray.get(actor.__ray_call__.remote(lambda self: self.rr_received))


def mixed_specs():
    """Uneven shards, a dtype conversion, a tensor only one source holds."""
    return {"w": rr.TensorSpec((7, 6), torch.float32, L([0, 1], Shard(0)), L([0, 1], Shard(0))),
            "h": rr.TensorSpec((10,), torch.bfloat16, L([0, 1], Replicate()),
                               L([0, 1], Replicate()), src_dtype=torch.float32),
            "a": rr.TensorSpec((5, 4), torch.float32, L([1], Replicate()), L([0], Replicate()))}


def disjoint_specs():
    """Destination 0 is fed only by source 1 and destination 1 only by source 0: when source 0
    dies, destination 0 still receives everything it needs (deterministically part-way)."""
    return {"a": rr.TensorSpec((5, 4), torch.float32, L([1], Replicate()), L([0], Replicate())),
            "z": rr.TensorSpec((6, 3), torch.float32, L([0], Replicate()), L([1], Replicate()))}


def fulls_for(specs, step):
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(s.shape, generator=g) for k, s in specs.items()}


def shard_bytes(specs, side, rank):
    total = 0
    for s in specs.values():
        lay = s.layout(side)
        if lay.box(rank, s.shape) is not None:
            n = 1
            for d in lay.local_shape(rank, s.shape):
                n *= d
            total += n * torch.empty((), dtype=s.dtype if side == "dst" else s.source_dtype).element_size()
    return total


def proc_versions(group, actors_):
    return ray.get([a.__ray_call__.remote(worker.version, group.group_id) for a in actors_])


def test_atomic_success_bit_exact_and_extra_bytes(rig):
    group, _ = rig
    specs = mixed_specs()
    for step in (1, 2):
        fulls = fulls_for(specs, step)
        fill(group.src_actors, group.dst_actors, specs, fulls, dst_seed=step)
        res = group.refit(specs, atomic=True)
        check_exact(group.dst_actors, specs, fulls)
        want = max(shard_bytes(specs, "dst", r) for r in range(2))
        assert want == 4 * 6 * 4 + 10 * 2 + 5 * 4 * 4          # dst rank 0 is the busiest
        assert res.extra_bytes == want
        assert [p["extra_bytes"] for p in res.per_process] == \
            [0, 0, shard_bytes(specs, "dst", 0), shard_bytes(specs, "dst", 1)]
        assert group.versions() == [res.version] * 4
    plain = group.refit(specs)
    assert plain.extra_bytes == 0


def test_snapshot(rig):
    group, _ = rig
    specs = mixed_specs()
    fulls = fulls_for(specs, 7)
    fill(group.src_actors, group.dst_actors, specs, fulls, dst_seed=7)
    res = group.refit(specs, snapshot=True)
    check_exact(group.dst_actors, specs, fulls)
    src_bytes = [shard_bytes(specs, "src", r) for r in range(2)]
    assert src_bytes == [4 * 6 * 4 + 10 * 4, 3 * 6 * 4 + 10 * 4 + 5 * 4 * 4]
    assert res.extra_bytes == max(src_bytes)
    # both: each process holds its own kind of copy
    fulls = fulls_for(specs, 8)
    fill(group.src_actors, group.dst_actors, specs, fulls, dst_seed=8)
    res = group.refit(specs, snapshot=True, atomic=True)
    check_exact(group.dst_actors, specs, fulls)
    assert [p["extra_bytes"] for p in res.per_process] == \
        src_bytes + [shard_bytes(specs, "dst", r) for r in range(2)]


@pytest.mark.parametrize("atomic", [True, False])
def test_source_dies_part_way(rig, atomic):
    group, spares = rig
    specs = disjoint_specs()
    src, dst = list(group.src_actors), list(group.dst_actors)
    fulls = fulls_for(specs, 10)
    fill(src, dst, specs, fulls, dst_seed=10)
    group.refit(specs)                                   # old weights, version v
    v = group.version
    old = raw(dst)
    new = fulls_for(specs, 11)
    fill(src, [], specs, new)
    arm_exit(src[0])
    for d in dst:
        record_received(d)
    with pytest.raises(rr.RefitError) as info:
        group.refit(specs, atomic=atomic, timeout_s=8)
    assert info.value.failed_ranks == (("src", 0),), info.value
    # The fault struck mid-transfer: destination 0 had received every new byte it needs (from
    # source 1) while destination 1 was still waiting on source 0.
    assert received(dst[0]) == shard_bytes(specs, "dst", 0) == 5 * 4 * 4
    assert received(dst[1]) is None
    # Nobody reports the new version, whichever mode.
    assert group.version == v
    assert proc_versions(group, [src[1]] + dst) == [v] * 3
    after = raw(dst)
    if atomic:
        # all or nothing: destination 0 received all of its new weights into staging and
        # still holds the old ones, bit for bit
        assert same_raw(old[0], after[0]) and same_raw(old[1], after[1])
    else:
        # in place: destination 0 got its new tensor, destination 1 kept its old one (mixed)
        got = ray.get(dst[0].get.remote())
        assert torch.equal(got["a"], new["a"])
        assert same_raw(old[1], after[1])
    # Recovery with a replacement source.
    src[0] = spares.pop()
    group.update(src_actors=src)
    fulls = fulls_for(specs, 12)
    fill(src, dst, specs, fulls, dst_seed=12)
    res = group.refit(specs, atomic=True)
    check_exact(dst, specs, fulls)
    assert res.version == v + 1 and group.versions() == [v + 1] * 4


def test_atomic_gather_broadcast(rig):
    """Staging is the executor's, not the strategy's: the baseline is atomic too."""
    group, _ = rig
    specs = mixed_specs()
    fulls = fulls_for(specs, 20)
    src, dst = list(group.src_actors), list(group.dst_actors)
    fill(src, dst, specs, fulls, dst_seed=20)
    with rr.ReshardGroup(src, dst, strategy="gather_broadcast", timeout_s=20) as gb:
        res = gb.refit(specs, atomic=True)
    check_exact(dst, specs, fulls)
    assert res.extra_bytes == max(shard_bytes(specs, "dst", r) for r in range(2))
