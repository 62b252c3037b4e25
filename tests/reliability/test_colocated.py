"""Colocated refits: the same actors on both sides, where a process's destination shards share
memory with its own source shards (the same tensor re-laid out in place, or overlapping views).

Every shape must give bit-exact results (the aliased source shards are copied before anything
is written, and the copy is reported as extra memory), on one node and across nodes, with both
strategies, and in every refit mode.
"""
import sys

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.tools.testing import Holder

from reliability_util import L

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)

ROWS, COLS = 256, 6


def actors(nodes):
    return [Holder.options(resources={f"node{n}": 1}).remote() for n in nodes]


def full(step=0):
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (step + 1)


def put_shards(acts, layout, fulls, name="w"):
    ray.get([a.set.remote({name: rr.shard_tensor(fulls, layout, r)}) for r, a in enumerate(acts)])


def got(acts, name="w"):
    return [t[name] for t in ray.get([a.get.remote() for a in acts])]


def check(acts, layout, fulls, name="w"):
    for r, t in enumerate(got(acts, name)):
        want = rr.shard_tensor(fulls, layout, r)
        assert torch.equal(t, want), (r, t, want)


@pytest.mark.parametrize("strategy", ["reshard", "gather_broadcast"])
@pytest.mark.parametrize("nodes", [(0, 0), (0, 1)], ids=["one_node", "across_nodes"])
def test_same_tensor_rank_swap(cluster, strategy, nodes):
    """Shard(0) on mesh [0, 1] -> Shard(0) on mesh [1, 0]: each actor's rows go to the other,
    into the very tensor they are read from; in every mode, and again from the cached program."""
    acts = actors(nodes)
    src, dst = L([0, 1], rr.Shard(0)), L([1, 0], rr.Shard(0))
    spec = {"w": rr.TensorSpec((ROWS, COLS), torch.float32, src, dst)}
    with rr.ReshardGroup(acts, acts, strategy=strategy, timeout_s=30) as g:
        for step, mode in enumerate(["plain", "atomic", "snapshot", "plain"]):
            put_shards(acts, src, full(step))
            res = g.refit(spec, atomic=mode == "atomic", snapshot=mode == "snapshot")
            check(acts, dst, full(step))
            shard_bytes = ROWS // 2 * COLS * 4
            assert res.extra_bytes == shard_bytes, res.extra_bytes
            aliased = sum(p["aliased_bytes"] for p in res.per_process)
            assert aliased == (2 * shard_bytes if mode == "plain" else 0)
            assert g.versions() == [res.version] * 2


def test_rank_permutation_of_four(cluster):
    """A cyclic shift over four colocated actors, rows then columns: each actor's tensor
    receives another's shard while its own shard is sent away."""
    acts = actors([0, 0, 1, 1])
    specs = {"w": rr.TensorSpec((ROWS, COLS), torch.float32, L([0, 1, 2, 3], rr.Shard(0)),
                                L([1, 2, 3, 0], rr.Shard(0))),
             "v": rr.TensorSpec((COLS, ROWS), torch.float32, L([0, 1, 2, 3], rr.Shard(1)),
                                L([3, 0, 1, 2], rr.Shard(1)))}
    fw, fv = full(), full(3).t().contiguous()
    with rr.ReshardGroup(acts, acts, timeout_s=30) as g:
        ray.get([a.set.remote({"w": rr.shard_tensor(fw, specs["w"].src, r),
                               "v": rr.shard_tensor(fv, specs["v"].src, r)})
                 for r, a in enumerate(acts)])
        g.refit(specs)
        check(acts, specs["w"].dst, fw, "w")
        check(acts, specs["v"].dst, fv, "v")


def _views_of_one_buffer(actor):
    """Source 'a' and destination 'b' are overlapping row windows of one buffer."""
    buf = actor.tensors["buf"]
    return {"a": buf[:ROWS // 2], "b": buf[ROWS // 4:ROWS // 4 + ROWS // 2]}


@pytest.mark.parametrize("nodes", [(0, 0), (0, 1)], ids=["one_node", "across_nodes"])
def test_overlapping_views(cluster, nodes):
    """Source and destination are different views that partly overlap in one buffer."""
    acts = actors(nodes)
    src, dst = L([0, 1], rr.Shard(0)), L([1, 0], rr.Shard(0))
    spec = {"w": rr.TensorSpec((ROWS, COLS), torch.float32, src, dst,
                               src_slots={0: rr.Slot("a"), 1: rr.Slot("a")},
                               dst_slots={0: rr.Slot("b"), 1: rr.Slot("b")})}
    f = full(5)
    bufs = []
    for r in range(2):
        b = torch.full((ROWS, COLS), -1.0)
        b[:ROWS // 2] = rr.shard_tensor(f, src, r)
        bufs.append(b)
    ray.get([a.set.remote({"buf": b}) for a, b in zip(acts, bufs)])
    with rr.ReshardGroup(acts, acts, tensors=_views_of_one_buffer, timeout_s=30) as g:
        res = g.refit(spec)
        assert res.extra_bytes == ROWS // 2 * COLS * 4
    for r, buf in enumerate(got(acts, "buf")):
        want = rr.shard_tensor(f, dst, r)
        assert torch.equal(buf[ROWS // 4:ROWS // 4 + ROWS // 2], want), r
        assert torch.equal(buf[:ROWS // 4], rr.shard_tensor(f, src, r)[:ROWS // 4])
        assert bool((buf[ROWS // 4 + ROWS // 2:] == -1).all())


def _column_halves(actor):
    """Source and destination interleave in memory without sharing a byte (column halves)."""
    buf = actor.tensors["buf"]
    return {"a": buf[:, :COLS // 2], "b": buf[:, COLS // 2:]}


def test_interleaved_but_disjoint_views_need_no_copy(cluster):
    """Column halves of one buffer share no byte: nothing extra is copied, results exact."""
    acts = actors([0, 0])
    shape = (ROWS, COLS // 2 * 2)
    src, dst = L([0, 1], rr.Shard(0)), L([1, 0], rr.Shard(0))
    spec = {"w": rr.TensorSpec((ROWS * 2, COLS // 2), torch.float32, src, dst,
                               src_slots={0: rr.Slot("a"), 1: rr.Slot("a")},
                               dst_slots={0: rr.Slot("b"), 1: rr.Slot("b")})}
    f = torch.randn(ROWS * 2, COLS // 2)
    bufs = []
    for r in range(2):
        b = torch.zeros(shape)
        b[:, :COLS // 2] = rr.shard_tensor(f, src, r)
        bufs.append(b)
    ray.get([a.set.remote({"buf": b}) for a, b in zip(acts, bufs)])
    with rr.ReshardGroup(acts, acts, tensors=_column_halves, timeout_s=30) as g:
        res = g.refit(spec)
        assert res.extra_bytes == 0
    for r, buf in enumerate(got(acts, "buf")):
        assert torch.equal(buf[:, COLS // 2:], rr.shard_tensor(f, dst, r))
        assert torch.equal(buf[:, :COLS // 2], rr.shard_tensor(f, src, r))
