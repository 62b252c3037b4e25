"""The planner's network bytes against an element-wise lower bound counted by brute force.

For a destination domain D, every element some rank of D needs and no source rank of D holds
must cross the network into D at least once. Numbering the elements of each tensor (an arange
of its shape) and cutting each rank's shard out of it gives those sets directly, element by
element, with no boxes, grids or cells. The plan must reach the bound exactly: its network
moves into D carry each of those elements once and nothing else, per domain and in total.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec, shard_tensor
from ray_reshard.planning import plan
from ray_reshard.planning.planner import NETWORK

from test_planner_props import layouts, side_topology


def held_elements(layout, shape, rank) -> set[int]:
    """Element numbers (row-major index into the full tensor) rank `rank` holds."""
    ids = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    shard = shard_tensor(ids, layout, rank)
    return set() if shard is None else set(shard.reshape(-1).tolist())


def needed_from_outside(spec, n_src, n_dst, src_domains, dst_domains) -> dict:
    """Destination domain -> the elements its ranks need that no source in it holds."""
    shape = tuple(spec.shape)
    need, have = defaultdict(set), defaultdict(set)
    for r in range(n_dst):
        need[dst_domains[r]] |= held_elements(spec.dst, shape, r)
    for r in range(n_src):
        have[src_domains[r]] |= held_elements(spec.src, shape, r)
    return {dom: elems - have[dom] for dom, elems in need.items()}


def box_elements(shape, box) -> list[int]:
    ids = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    return ids[box.slices()].reshape(-1).tolist()


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
        arrived = defaultdict(list)           # destination domain -> elements, with repeats
        for m in tp.moves:
            if m.path == NETWORK:
                arrived[dst_domains[m.dst]] += box_elements(shape, m.box)
        for dom in set(oracle) | set(arrived):
            got, want = arrived.get(dom, []), oracle.get(dom, set())
            assert len(got) == len(set(got)), f"{name}: an element crosses into {dom} twice"
            assert set(got) == want, (f"{name}: into {dom} the network brings "
                                      f"{len(set(got) - want)} unneeded and misses "
                                      f"{len(want - set(got))} elements")
        bound = sum(len(e) for e in oracle.values()) * spec.itemsize
        assert tp.stats.network_bytes == bound, (name, tp.stats.network_bytes, bound)
        assert tp.stats.min_network_bytes == bound, (name, tp.stats.min_network_bytes, bound)
        total += bound
    assert p.stats.network_bytes == total
    recv = defaultdict(int)
    for r, b in p.recv_bytes_by_rank.items():
        recv[dst_domains[r]] += b
    assert sum(recv.values()) == total


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(small_problems())
def test_network_bytes_equal_the_element_wise_bound(pr):
    check_against_oracle(pr)


def test_oracle_counts_a_hand_case():
    """8x8 rows over 2 sources in domain A; columns over 4 destinations, two in A and two in
    B: A needs nothing from outside (its sources hold the whole tensor), B needs its 2 column
    blocks (8x4 elements)."""
    spec = TensorSpec((8, 8), torch.float32, Layout(Mesh([0, 1]), [Shard(0)]),
                      Layout(Mesh([0, 1, 2, 3]), [Shard(1)]))
    oracle = needed_from_outside(spec, 2, 4, ["A", "A"], ["A", "A", "B", "B"])
    assert len(oracle["A"]) == 0 and len(oracle["B"]) == 32
    check_against_oracle(dict(specs={"w": spec}, n_src=2, n_dst=4, src_domains=["A", "A"],
                              dst_domains=["A", "A", "B", "B"], src_devices=None,
                              dst_devices=None))
    # replicated destination over 3 domains of one rank each: the whole tensor crosses 3 times
    spec = TensorSpec((5, 3), torch.bfloat16, Layout(Mesh([0]), [Replicate()]),
                      Layout(Mesh([0, 1, 2]), [Replicate()]))
    oracle = needed_from_outside(spec, 1, 3, ["S"], ["X", "Y", "Z"])
    assert sum(len(e) for e in oracle.values()) == 45
    check_against_oracle(dict(specs={"w": spec}, n_src=1, n_dst=3, src_domains=["S"],
                              dst_domains=["X", "Y", "Z"], src_devices=None, dst_devices=None))
