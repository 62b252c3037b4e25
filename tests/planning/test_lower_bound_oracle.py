"""The planner's network bytes against an element-wise lower bound counted by brute force.

For a destination domain D, every element some rank of D needs and no source rank of D holds
must cross the network into D at least once. Numbering the elements of each tensor (an arange
of its shape) and cutting each rank's shard out of it gives those sets directly, element by
element (as masks over the full tensor), with no boxes, grids or cells. The plan must reach the bound exactly: its network
moves into D carry each of those elements once and nothing else, per domain and in total.
"""
from __future__ import annotations

import math
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec, shard_tensor
from ray_reshard.planning import plan
from ray_reshard.planning.moves import NETWORK

from test_planner_props import layouts, side_topology


def held_mask(layout, shape, rank) -> torch.Tensor:
    """Bool mask over the full tensor of the elements rank `rank` holds: the numbers its shard
    of an arange (the element numbers, row-major) carries."""
    ids = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    mask = torch.zeros(math.prod(shape), dtype=torch.bool)
    shard = shard_tensor(ids, layout, rank)
    if shard is not None:
        mask[shard.reshape(-1)] = True
    return mask.reshape(shape)


def needed_from_outside(spec, n_src, n_dst, src_domains, dst_domains) -> dict:
    """Destination domain -> bool mask of the elements its ranks need and no source in it
    holds."""
    shape = tuple(spec.shape)
    need, have = {}, {}
    for r in range(n_dst):
        m = held_mask(spec.dst, shape, r)
        need[dst_domains[r]] = need[dst_domains[r]] | m if dst_domains[r] in need else m
    for r in range(n_src):
        m = held_mask(spec.src, shape, r)
        have[src_domains[r]] = have[src_domains[r]] | m if src_domains[r] in have else m
    return {dom: m & ~have[dom] if dom in have else m for dom, m in need.items()}


@st.composite
def small_problems(draw):
    n_src, n_dst = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    dev_ids = st.integers(0, 7)
    src_dom, src_dev = draw(side_topology(n_src, dev_ids))
    dst_dom, dst_dev = draw(side_topology(n_dst, dev_ids))
    specs = {}
    for t in range(draw(st.integers(1, 2))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, {1: 20, 2: 8, 3: 5}[ndim])) for _ in range(ndim))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
        specs[f"t{t}"] = TensorSpec(shape, dtype, draw(layouts(n_src, shape)),
                                    draw(layouts(n_dst, shape)))
    return dict(specs=specs, n_src=n_src, n_dst=n_dst, src_domains=src_dom,
                dst_domains=dst_dom, src_devices=src_dev, dst_devices=dst_dev)


def check_against_oracle(pr):
    src_domains = pr["src_domains"] or [("src", r) for r in range(pr["n_src"])]
    dst_domains = pr["dst_domains"] or [("dst", r) for r in range(pr["n_dst"])]
    p = plan(pr["specs"], src_domains=src_domains, dst_domains=dst_domains,
             src_devices=pr["src_devices"], dst_devices=pr["dst_devices"])
    total = 0
    for name, spec, tp in zip(p.names, p.specs, p.tensor_plans):
        shape = tuple(spec.shape)
        oracle = needed_from_outside(spec, pr["n_src"], pr["n_dst"], src_domains, dst_domains)
        arrived = {}                          # destination domain -> times each element came in
        for m in tp.moves:
            if m.path == NETWORK:
                dom = dst_domains[m.dst]
                if dom not in arrived:
                    arrived[dom] = torch.zeros(shape, dtype=torch.int32)
                arrived[dom][m.box.slices()] += 1
        for dom in set(oracle) | set(arrived):
            want = oracle.get(dom, torch.zeros(shape, dtype=torch.bool))
            got = arrived.get(dom, torch.zeros(shape, dtype=torch.int32))
            assert int(got.max()) <= 1, f"{name}: an element crosses into {dom} twice"
            extra, missing = int((got.bool() & ~want).sum()), int((want & ~got.bool()).sum())
            assert extra == missing == 0, (f"{name}: into {dom} the network brings {extra} "
                                           f"unneeded elements and misses {missing}")
        bound = sum(int(m.sum()) for m in oracle.values()) * spec.itemsize
        assert tp.stats.network_bytes == bound, (name, tp.stats.network_bytes, bound)
        assert tp.stats.min_network_bytes == bound, (name, tp.stats.min_network_bytes, bound)
        total += bound
    assert p.stats.network_bytes == total
    assert sum(p.recv_bytes_by_rank.values()) == total


@st.composite
def large_problems(draw):
    """Fewer, larger tensors (4-16 MiB): regions past the planner's size thresholds are split
    over a domain's receivers and over source replicas."""
    n_src, n_dst = draw(st.integers(1, 4)), draw(st.integers(2, 6))
    src_dom = [f"dom{draw(st.integers(0, 2))}" for _ in range(n_src)]
    dst_dom = [f"dom{draw(st.integers(1, 3))}" for _ in range(n_dst)]
    shape = (draw(st.integers(1024, 2048)), draw(st.integers(1024, 2048)))
    spec = TensorSpec(shape, torch.float32, draw(layouts(n_src, shape)),
                      draw(layouts(n_dst, shape)))
    return dict(specs={"w": spec}, n_src=n_src, n_dst=n_dst, src_domains=src_dom,
                dst_domains=dst_dom, src_devices=None, dst_devices=None)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(small_problems())
def test_network_bytes_equal_the_element_wise_bound(pr):
    check_against_oracle(pr)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(large_problems())
def test_network_bytes_equal_the_bound_on_large_tensors(pr):
    check_against_oracle(pr)


def test_large_region_split_over_a_domains_receivers():
    """16 MiB held whole by two sources in one domain, needed whole by the 4 ranks of another:
    it enters that domain once, in parts spread over its ranks and over both sources."""
    shape = (2048, 2048)
    spec = TensorSpec(shape, torch.float32, Layout(Mesh([0, 1]), [Replicate()]),
                      Layout(Mesh([0, 1, 2, 3]), [Replicate()]))
    pr = dict(specs={"w": spec}, n_src=2, n_dst=4, src_domains=["S", "S"],
              dst_domains=["D"] * 4, src_devices=None, dst_devices=None)
    check_against_oracle(pr)
    p = plan(pr["specs"], src_domains=pr["src_domains"], dst_domains=pr["dst_domains"])
    net = [m for m in p.tensor_plans[0].moves if m.path == NETWORK]
    assert {m.dst for m in net} == {0, 1, 2, 3} and {m.src.rank for m in net} == {0, 1}


def test_oracle_counts_a_hand_case():
    """8x8 rows over 2 sources in domain A; columns over 4 destinations, two in A and two in
    B: A needs nothing from outside (its sources hold the whole tensor), B needs its 2 column
    blocks (8x4 elements)."""
    spec = TensorSpec((8, 8), torch.float32, Layout(Mesh([0, 1]), [Shard(0)]),
                      Layout(Mesh([0, 1, 2, 3]), [Shard(1)]))
    oracle = needed_from_outside(spec, 2, 4, ["A", "A"], ["A", "A", "B", "B"])
    assert int(oracle["A"].sum()) == 0 and int(oracle["B"].sum()) == 32
    check_against_oracle(dict(specs={"w": spec}, n_src=2, n_dst=4, src_domains=["A", "A"],
                              dst_domains=["A", "A", "B", "B"], src_devices=None,
                              dst_devices=None))
    # replicated destination over 3 domains of one rank each: the whole tensor crosses 3 times
    spec = TensorSpec((5, 3), torch.bfloat16, Layout(Mesh([0]), [Replicate()]),
                      Layout(Mesh([0, 1, 2]), [Replicate()]))
    oracle = needed_from_outside(spec, 1, 3, ["S"], ["X", "Y", "Z"])
    assert sum(int(m.sum()) for m in oracle.values()) == 45
    check_against_oracle(dict(specs={"w": spec}, n_src=1, n_dst=3, src_domains=["S"],
                              dst_domains=["X", "Y", "Z"], src_devices=None, dst_devices=None))
