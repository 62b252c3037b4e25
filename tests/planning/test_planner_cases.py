"""Exhaustive small cases and the worked examples of the README and the reshard literature."""
from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest

from ray_reshard.planning.schedule import (bucket_starts, forward_segment, forward_segments,
                                           is_forward_key, parent_key, run_order)
from ray_reshard.planning.share import build_share
import torch

from ray_reshard.layout import Box, Layout, Mesh, Replicate, Shard, TensorSpec, shard_tensor
from ray_reshard.planning import Endpoint, plan
from ray_reshard.planning.canonical import plan_tensor
from ray_reshard.planning.moves import DOMAIN, LOCAL, NETWORK, Topology
from ray_reshard.execution.reference import simulate_refit

F32 = torch.float32


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def run(specs, n_src, n_dst, bucket=1 << 20, seed=0, **topo):
    """Plan, execute in process, and check every destination shard bit-exactly."""
    p = plan(specs, n_src=n_src, n_dst=n_dst, **topo)
    gen = torch.Generator().manual_seed(seed)
    fulls = {n: torch.randn(s.shape, generator=gen).to(s.source_dtype) for n, s in specs.items()}
    src = [dict() for _ in range(n_src)]
    dst = [dict() for _ in range(n_dst)]
    for n, s in specs.items():
        for r in s.src.ranks:
            src[r][n] = shard_tensor(fulls[n], s.src, r)
        for r in s.dst.ranks:
            dst[r][n] = torch.full(s.dst.local_shape(r, s.shape), float("nan"), dtype=s.dtype)
    moved = simulate_refit(p, src, dst, bucket_bytes=bucket)
    for n, s in specs.items():
        want = fulls[n].to(s.dtype)
        for r in s.dst.ranks:
            assert torch.equal(bits(dst[r][n]), bits(shard_tensor(want, s.dst, r))), (n, r)
    assert moved == {"network": p.stats.network_bytes, "domain": p.stats.domain_bytes,
                     "local": p.stats.local_bytes}
    return p


# ------------------------------------------------------------------ exhaustive small cases


def small_layouts(shape):
    """Meshes of 1 to 4 ranks (1-d in and out of order, 2x2 in and out of order) with every
    placement combination for a tensor of `shape`."""
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    grids = [[0], [0, 1], [2, 0, 1], [0, 1, 2, 3], [3, 2, 1, 0], [[0, 1], [2, 3]],
             [[3, 1], [2, 0]]]
    out = []
    for g in grids:
        mesh = Mesh(g)
        for pls in itertools.product(options, repeat=mesh.ndim):
            out.append(Layout(mesh, pls))
    return out


TOPOLOGIES = {
    "own-domains": {},
    "two-domains": dict(src_domains=["A"] * 4, dst_domains=["B"] * 4),
    "colocated": dict(src_domains=["n0", "n0", "n1", "n1"], dst_domains=["n0", "n0", "n1", "n1"],
                      src_devices=[0, 1, 2, 3], dst_devices=[0, 1, 2, 3]),
    "dst-in-src-domain": dict(src_domains=["A", "A", "B", "B"], dst_domains=["A"] * 4),
}


@pytest.mark.parametrize("topo,shape", [(t, (3, 5)) for t in TOPOLOGIES]
                         + [("own-domains", (4, 2)), ("two-domains", (1, 3))])
def test_all_small_layout_pairs(topo, shape):
    """Every pair of small layouts; one plan per source layout holding every destination layout
    as its own tensor. Exact data, network bytes at the bound, schedule sound."""
    lays = small_layouts(shape)
    for i, src in enumerate(lays):
        specs = {f"d{j}": TensorSpec(shape, F32, src, dst) for j, dst in enumerate(lays)}
        p = run(specs, 4, 4, bucket=4096, seed=i, **TOPOLOGIES[topo])
        for name, tp in zip(p.names, p.tensor_plans):
            assert tp.stats.network_bytes == tp.stats.min_network_bytes, (src, name)
            # Every source move reads a region its sender holds; forwards were received first.
            spec = p.specs[p.index[name]]
            got_network = defaultdict(list)
            for m in tp.moves:
                if m.path == NETWORK:
                    got_network[m.dst].append(m.box)
            for m in tp.moves:
                if m.src.side == "src":
                    assert spec.src.box(m.src.rank, shape).contains(m.box)
                else:
                    assert any(b.contains(m.box) for b in got_network[m.src.rank])
                    assert m.path in (DOMAIN, LOCAL)


def test_colocated_same_device_copies_are_local():
    """A destination on the device of a source holding its data copies locally."""
    src = Layout.sharded([0, 1, 2, 3], 0)
    dst = Layout(Mesh([[0, 1], [2, 3]]), [Shard(0), Replicate()])
    p = run({"w": TensorSpec((8, 4), F32, src, dst)}, 4, 4, **TOPOLOGIES["colocated"])
    moves = p.tensor_plans[0].moves
    assert p.stats.network_bytes == 0
    local = [m for m in moves if m.path == LOCAL]
    assert {(m.src.rank, m.dst) for m in local} == {(0, 0), (1, 1), (2, 2), (3, 3)}
    assert p.stats.local_bytes == 4 * 2 * 4 * 4       # each dst holds 4x4; 2 rows are local


def test_local_copy_comes_from_the_holder_on_the_destinations_own_device():
    """Of two holders in a destination's domain, the one on its device copies locally (not the
    domain's first holder, on another device)."""
    spec = TensorSpec((8, 4), F32, Layout.replicated([0, 1]), Layout.replicated([0]))
    topo = Topology.make(2, 1, ["a", "a"], ["a"], src_devices=[0, 1], dst_devices=[1])
    moves = plan_tensor(spec.signature, topo).moves
    assert [(m.src, m.dst, m.path) for m in moves] == [(Endpoint("src", 1), 0, LOCAL)]


def test_mixed_dtypes_in_one_bucket_stay_aligned():
    """A bucket packing a bf16 tensor then an fp32 one must not view fp32 at an odd offset."""
    lay_s, lay_d = Layout.replicated([0]), Layout.replicated([0])
    specs = {"a": TensorSpec((3,), torch.bfloat16, lay_s, lay_d),
             "b": TensorSpec((5,), torch.float32, lay_s, lay_d),
             "c": TensorSpec((1,), torch.uint8, lay_s, lay_d, src_dtype=torch.float32),
             "d": TensorSpec((2,), torch.complex128, lay_s, lay_d),
             "e": TensorSpec((), torch.float64, lay_s, lay_d)}
    p = plan(specs, n_src=1, n_dst=1)
    sched = p.schedule(1 << 10)
    assert len(sched) == 1
    (t,) = sched.transfers
    off = 0
    for it in t.items:
        size = p.specs[it.tensor].itemsize
        assert off % size == 0, (p.names[it.tensor], off)
        off += it.box.numel * size
    gen = torch.Generator().manual_seed(0)
    fulls = {n: (torch.rand(s.shape, generator=gen) * 50).to(s.source_dtype)
             for n, s in specs.items()}
    dst = [{n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}]
    simulate_refit(p, [dict(fulls)], dst)
    for n, s in specs.items():
        assert torch.equal(bits(dst[0][n]), bits(fulls[n].to(s.dtype))), n


# --------------------------------------------------------------------- worked examples


def test_rows_to_columns_8x8():
    """8x8 rows over 2 sources -> columns over 4 destinations: each destination receives one
    4x2 block from each source."""
    spec = TensorSpec((8, 8), F32, Layout.sharded([0, 1], 0), Layout.sharded([0, 1, 2, 3], 1))
    p = run({"w": spec}, 2, 4)
    moves = p.tensor_plans[0].moves
    assert len(moves) == 8 and all(m.path == NETWORK for m in moves)
    for j in range(4):
        into = sorted((m.src.rank, m.box) for m in moves if m.dst == j)
        assert into == [(0, Box((0, 2 * j), (4, 2))), (1, Box((4, 2 * j), (4, 2)))]
    assert p.stats.network_bytes == p.stats.min_network_bytes == 8 * 8 * 4
    assert dict(p.send_bytes_by_rank) == {0: 128, 1: 128}
    assert dict(p.recv_bytes_by_rank) == {j: 64 for j in range(4)}


def _tp4_to_tp2_dp2(shape=(8, 16), n=1, **topo):
    src = Layout.sharded([0, 1, 2, 3], 0)                                       # TP4
    dst = Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Replicate(), Shard(0)])   # TP2 x DP2
    spec = TensorSpec(shape, F32, src, dst)
    return run({f"w{i}": spec for i in range(n)}, 4, 4, **topo), spec


def test_tp4_to_tp2xdp2_one_domain_sends_each_byte_once():
    # Small tensors cross into the domain whole, to one replica, which forwards them to the
    # other; which replica receives rotates across the tensors laid out alike.
    p, spec = _tp4_to_tp2_dp2(n=2, src_domains=list("abcd"), dst_domains=["D"] * 4)
    st = p.stats
    assert st.network_bytes == st.min_network_bytes == 2 * spec.nbytes
    shard = spec.nbytes // 2                          # each destination holds half the tensor
    for i, tp in enumerate(p.tensor_plans):
        receivers = {m.dst for m in tp.moves if m.path == NETWORK}
        assert receivers == ({0, 1} if i == 0 else {2, 3})
        for m in tp.moves:
            if m.path == DOMAIN:
                assert m.src.side == "dst" and m.src.rank in receivers and \
                    {m.src.rank, m.dst} in ({0, 2}, {1, 3})
    assert p.recv_bytes_by_rank == {j: shard for j in range(4)}
    assert st.domain_bytes == 2 * 2 * shard
    # Every source shard crosses the network exactly once per tensor
    assert p.send_bytes_by_rank == {i: 2 * spec.nbytes // 4 for i in range(4)}


def test_tp4_to_tp2xdp2_one_domain_splits_large_regions_over_the_replicas():
    p, spec = _tp4_to_tp2_dp2(shape=(4096, 1024), src_domains=list("abcd"),
                              dst_domains=["D"] * 4)
    st = p.stats
    assert st.network_bytes == st.min_network_bytes == spec.nbytes
    shard = spec.nbytes // 2
    # Each destination gets half its shard over the network, half from its replica over NVLink
    assert p.recv_bytes_by_rank == {j: shard // 2 for j in range(4)}
    assert st.domain_bytes == 4 * (shard // 2)
    for m in p.tensor_plans[0].moves:
        if m.path == DOMAIN:
            assert m.src.side == "dst" and {m.src.rank, m.dst} in ({0, 2}, {1, 3})
    assert p.send_bytes_by_rank == {i: spec.nbytes // 4 for i in range(4)}


def test_tp4_to_tp2xdp2_own_domains_sends_twice():
    p, spec = _tp4_to_tp2_dp2()
    st = p.stats
    assert st.network_bytes == st.min_network_bytes == 2 * spec.nbytes
    assert st.domain_bytes == 0
    assert p.recv_bytes_by_rank == {j: spec.nbytes // 2 for j in range(4)}


def test_gather_broadcast_figure():
    p, spec = _tp4_to_tp2_dp2()
    # 4 sources each gather 3/4 of the tensor, then 4 destinations each receive all of it
    assert p.stats.gather_broadcast_bytes == 4 * (spec.nbytes * 3 // 4) + 4 * spec.nbytes


SRC_TP2_DP2 = Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Replicate(), Shard(0)])


def test_replica_choice_balances_a_large_tensor():
    """src TP2xDP2 -> dst TP1: both replicas of each half send; the busiest source sends about
    half of its shard (a quarter of the tensor) instead of all of it."""
    spec = TensorSpec((1024, 512), F32, SRC_TP2_DP2, Layout.replicated([0]))
    p = run({"w": spec}, 4, 1)
    assert p.send_bytes_by_rank == {i: spec.nbytes // 4 for i in range(4)}
    assert p.stats.max_send_bytes == spec.nbytes // 4


def test_replica_choice_balances_across_small_tensors():
    """Tensors too small to split still spread over the replicas, tensor after tensor."""
    specs = {f"norm{i}": TensorSpec((64, 64), F32, SRC_TP2_DP2, Layout.replicated([0]))
             for i in range(10)}
    p = run(specs, 4, 1)
    total = sum(s.nbytes for s in specs.values())
    assert p.stats.network_bytes == total
    assert p.send_bytes_by_rank == {i: total // 4 for i in range(4)}
    assert p.stats.max_send_bytes <= math.ceil(total / 4)


def test_pipeline_stage_meshes_and_experts():
    """A source side of 2 stages x 2 ranks; stage-replicated weights and single-owner experts,
    to TP2 x DP2 destinations in two domains."""
    stage = [Layout.replicated([0, 1]), Layout.replicated([2, 3])]
    dst_mesh = Mesh([[0, 1], [2, 3]], ("dp", "tp"))
    col = Layout(dst_mesh, [Replicate(), Shard(0)])
    row = Layout(dst_mesh, [Replicate(), Shard(1)])
    rep = Layout(dst_mesh, [Replicate(), Replicate()])
    specs = {}
    for layer in range(4):
        s = layer // 2
        specs[f"l{layer}.norm"] = TensorSpec((12,), F32, stage[s], rep)
        specs[f"l{layer}.qkv"] = TensorSpec((24, 12), F32, stage[s], col)
        specs[f"l{layer}.o"] = TensorSpec((12, 24), F32, stage[s], row)
        for e in range(4):
            owner = Layout.replicated([2 * s + e // 2])
            specs[f"l{layer}.e{e}.up"] = TensorSpec((10, 12), F32, owner, col,
                                                   src_dtype=torch.float32)
            specs[f"l{layer}.e{e}.down"] = TensorSpec((12, 10), torch.bfloat16, owner, row,
                                                     src_dtype=torch.float32)
    topo = dict(src_domains=["s0", "s0", "s1", "s1"], dst_domains=["d0", "d0", "d1", "d1"])
    p = run(specs, 4, 4, bucket=200, **topo)
    assert p.stats.network_bytes == p.stats.min_network_bytes
    # Each dst domain (one DP replica: both TP ranks) needs every byte once
    assert p.stats.network_bytes == 2 * p.stats.total_bytes
    # Same stage-relative structure: stages share canonical plans, experts share per owner
    assert p.stats.n_signatures < len(specs)


# ------------------------------------------------------------------------------ caching


def test_equal_signatures_share_one_plan_object():
    src = Layout(Mesh([[0, 1], [2, 3]]), [Shard(0), Shard(1)])
    dst = Layout.sharded([0, 1, 2], 1)
    specs = {"a": TensorSpec((9, 6), torch.bfloat16, src, dst),
             "b": TensorSpec((9, 6), torch.bfloat16, src, dst),
             "c": TensorSpec((9, 6), torch.float16, src, dst),                     # same bytes
             "d": TensorSpec((9, 6), torch.bfloat16, src, dst, src_dtype=F32),
             "e": TensorSpec((9, 6), F32, src, dst),                               # 4 bytes
             "f": TensorSpec((9, 6), torch.bfloat16,
                             Layout(Mesh([[0, 1], [2, 3]]), [Shard(0), Shard(1)]), dst)}
    before = plan_tensor.cache_info()
    p = plan(specs)
    after = plan_tensor.cache_info()
    tps = dict(zip(p.names, p.tensor_plans))
    assert tps["a"] is tps["b"] is tps["c"] is tps["d"] is tps["f"]
    assert tps["e"] is not tps["a"]
    assert p.stats.n_signatures == 2
    p2 = plan(specs)
    assert p2.tensor_plans[0] is p.tensor_plans[0]
    assert plan_tensor.cache_info().hits > after.hits
    assert after.misses - before.misses <= 2


def test_rank_renamed_stages_share_the_canonical_plan():
    """Stage 1 is stage 0 on other ranks: its plan is stage 0's with the ranks renamed."""
    dst = Layout(Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0)])
    topo = Topology.make(8, 4, src_domains=[i // 2 for i in range(8)],
                         dst_domains=[9, 9, 10, 10])
    p0 = plan_tensor(TensorSpec((8, 4), F32, Layout.replicated([0, 1]), dst).signature, topo)
    p1 = plan_tensor(TensorSpec((8, 4), F32, Layout.replicated([6, 7]), dst).signature, topo)
    assert len(p0.moves) == len(p1.moves)
    rename = {Endpoint("src", 0): Endpoint("src", 6), Endpoint("src", 1): Endpoint("src", 7)}
    for a, b in zip(p0.moves, p1.moves):
        assert rename.get(a.src, a.src) == b.src and (a.dst, a.box, a.path) == (b.dst, b.box,
                                                                               b.path)
    assert {r - 6: v for r, v in p1.stats.send_bytes} == dict(p0.stats.send_bytes)


def test_moves_for_endpoint_index():
    spec = TensorSpec((8, 16), F32, Layout.sharded([0, 1, 2, 3], 0),
                      Layout(Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0)]))
    p = plan({"w": spec}, src_domains=list("abcd"), dst_domains=["D"] * 4)
    tp = p.tensor_plans[0]
    for side, n in (("src", 4), ("dst", 4)):
        for r in range(n):
            ep = Endpoint(side, r)
            want = [m for m in tp.moves if m.src == ep or (side == "dst" and m.dst == r)]
            assert list(tp.moves_for(ep)) == want
    assert set(p.for_rank("dst", 0)) == {"w"}


# ----------------------------------------------------------------------------- schedule


def test_schedule_orders_forwards_after_their_network_bucket():
    spec = TensorSpec((64, 16), F32, Layout.sharded([0, 1, 2, 3], 0),
                      Layout(Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0)]))
    p = plan({"w": spec}, src_domains=list("abcd"), dst_domains=["D"] * 4)
    sched = p.schedule(256)
    pos = {t.key: i for i, t in enumerate(sched.transfers)}
    for i, t in enumerate(sched.transfers):
        assert t.nbytes <= 256
        if t.src.side == "dst":
            net = [u for u in sched.transfers[:i] if u.path == NETWORK and u.dst == t.src.rank]
            assert net, t
            # After the network bucket that delivered it, in a later segment of its rotations
            parent = parent_key(t)
            assert any(u.key == parent for u in net)
            assert t.key > parent
    assert len(pos) == len(sched)
    mine = sched.for_endpoints([Endpoint("dst", 0)])
    assert mine and all(t.dst == 0 or t.src == Endpoint("dst", 0) for t in mine)


def test_a_pairs_buckets_are_about_equal():
    """A pair's bytes go into ceil(total / bucket) buckets of about equal size, not full buckets
    and a remainder: the pairs of a round then stay alike in size."""
    # 10 tensors of 1 KiB from source 0 to destination 0 across domains: 10 KiB in 4 KiB buckets
    specs = {f"w{i}": TensorSpec((256,), F32, Layout.sharded([0], 0), Layout.sharded([0], 0))
             for i in range(10)}
    p = plan(specs, src_domains=["a"], dst_domains=["b"])
    sizes = [t.nbytes for t in p.schedule(4096).transfers]
    assert sizes == [3072, 4096, 3072]            # greedy would cut 4096, 4096, 2048
    assert [t.key[0] for t in p.schedule(4096).transfers] == [0, 1, 2]
    # the cut never passes a bucket, and an entry larger than the share goes where it fits
    assert bucket_starts([3000, 3000, 3000, 100], 4096) == [1, 2]
    assert bucket_starts([1] * 109, 64) == [55]
    assert bucket_starts([64, 64, 10], 64) == [1, 2]
    assert bucket_starts([5], 64) == [] and bucket_starts([], 64) == []


def _replicas_plan(n_dst=8):
    """TP4 -> TP2 x DP(n_dst / 2) into one domain: each piece crosses once and is forwarded to
    the other replicas; every forwarder takes network buckets from two sources per round."""
    dst = Layout(Mesh(np.arange(n_dst).reshape(n_dst // 2, 2).tolist()), [Replicate(), Shard(0)])
    specs = {f"w{i}": TensorSpec((64, 16), F32, Layout.sharded([0, 1, 2, 3], 0), dst)
             for i in range(6)}
    specs["b"] = TensorSpec((8,), F32, Layout.replicated([0, 1, 2, 3]),
                            Layout.replicated(range(n_dst)))
    return plan(specs, src_domains=list("abcd"), dst_domains=["D"] * n_dst)


@pytest.mark.parametrize("n_dst, expect_segments", [(8, 1), (64, 4)])
def test_forwards_merge_per_forwarder_target_and_segment(n_dst, expect_segments):
    """What a forwarder passes to one target out of a segment of a round's rotations travels in
    as few buckets as the bucket size allows, after every network bucket it draws from (up to
    its parent key), in the next segment, at its rotation (ring rotation + chunk) mod its width."""
    p = _replicas_plan(n_dst)
    n_src = 4
    segments = forward_segments(n_src, n_dst)
    assert segments == expect_segments
    width = n_dst // segments
    bucket = 4096
    sched = p.schedule(bucket)
    net_key = {}                      # (forwarder, tensor, box) -> key of the bucket bringing it
    for t in sched.transfers:
        if t.path == NETWORK:
            for it in t.items:
                net_key[(t.dst, it.tensor, it.box)] = t.key
    per_pair = defaultdict(list)
    for t in sched.transfers:
        if t.src.side != "dst":
            continue
        assert is_forward_key(t.key)
        f, parent = t.src.rank, parent_key(t)
        assert parent in {u.key for u in sched.transfers if u.path == NETWORK and u.dst == f}
        # the next segment after the parent's
        seg = forward_segment(parent[2], n_src, n_dst)
        assert (t.key[0], forward_segment(t.key[2], n_src, n_dst)) == divmod(
            parent[0] * segments + seg + 1, segments)
        for it in t.items:
            brought = net_key[(f, it.tensor, it.box)]
            assert brought <= parent
            assert (brought[0], forward_segment(brought[2], n_src, n_dst)) == (parent[0], seg)
        j, chunk = (t.dst - f) % n_dst, t.key[8]
        assert t.key[2] % width == (j + chunk) % width
        per_pair[(f, t.dst, parent[0], seg)].append(t)
    assert per_pair
    merged = 0
    for (f, target, rnd, seg), ts in per_pair.items():
        total = sum(t.nbytes for t in ts)
        assert all(t.nbytes <= bucket for t in ts)
        # greedy packing of pieces no larger than a bucket: at most twice the minimum
        assert len(ts) <= max(1, 2 * math.ceil(total / bucket))
        sources = {net_key[(f, it.tensor, it.box)][3] for t in ts for it in t.items}
        merged += len(sources) > len(ts)
    assert merged, "some forward buckets should hold pieces of several network buckets"
    # every process's share agrees with the schedule
    for r in range(0, n_dst, max(1, n_dst // 8)):
        eps = [Endpoint("dst", r)]
        assert build_share(p, eps, bucket) == sched.for_endpoints(eps)


@pytest.mark.parametrize("n_dst", [8, 64])
@pytest.mark.parametrize("span", [1, 2, 3, 4])
def test_run_order_keeps_groups_whole_and_forwards_after_their_parents(span, n_dst):
    p = _replicas_plan(n_dst)
    sched = p.schedule(512)
    for r in range(0, n_dst, n_dst // 8):
        steps = sorted(sched.for_endpoints([Endpoint("dst", r)]), key=lambda t: run_order(t.key, span))
        pos = {t.key: i for i, t in enumerate(steps)}
        seen_groups, last = set(), None
        for i, t in enumerate(steps):
            if t.path == NETWORK:
                g = (t.key[0], t.key[2] // span)
                assert g == last or g not in seen_groups, "a network group cut in two"
                seen_groups.add(g)
                last = g
            else:
                last = None
            if t.src == Endpoint("dst", r):       # forwards sent here follow their parent
                assert pos[parent_key(t)] < i


def test_plan_pickles_without_its_schedule_cache():
    import pickle

    spec = TensorSpec((64, 16), F32, Layout.sharded([0, 1, 2, 3], 0),
                      Layout(Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0)]))
    p = plan({"w": spec}, src_domains=list("abcd"), dst_domains=["D"] * 4)
    sched = p.schedule(256)
    back = pickle.loads(pickle.dumps(p))
    assert "_schedules" not in back.__dict__
    assert back.names == p.names and back.stats == p.stats
    assert back.tensor_plans[0].moves == p.tensor_plans[0].moves
    assert [t.key for t in back.schedule(256).transfers] == [t.key for t in sched.transfers]
    assert back.schedule(256).transfers == sched.transfers
