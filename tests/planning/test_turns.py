"""Network buckets in turns: each turn a matching of sources to destinations, filled first fit."""
from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec
from ray_reshard.planning import Endpoint, plan
from ray_reshard.planning.schedule import (assign_turns, bucket_count, bucket_starts, group_span,
                                           network_bucket_counts, network_entries)
from ray_reshard.planning.share import build_share
from ray_reshard.planning.moves import NETWORK

F32 = torch.float32


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=40), st.integers(64, 6000))
def test_bucket_count_is_the_cuts_count(sizes, bucket):
    sizes = [min(s, bucket) for s in sizes]      # the schedule's pieces never pass a bucket
    assert bucket_count(sizes, bucket) == len(bucket_starts(sizes, bucket)) + 1


def _check_turns(counts, turns):
    assert set(turns) == set(counts)
    by_turn_src, by_turn_dst = Counter(), Counter()
    for (s, d), ts in turns.items():
        assert len(ts) == counts[(s, d)]
        assert list(ts) == sorted(set(ts))            # a pair's buckets in order
        for t in ts:
            by_turn_src[(t, s)] += 1
            by_turn_dst[(t, d)] += 1
    assert max(by_turn_src.values(), default=1) == 1 and max(by_turn_dst.values(), default=1) == 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 7), st.integers(1, 7), st.data())
def test_every_turn_is_a_matching(n_src, n_dst, data):
    counts = {}
    for s in range(n_src):
        for d in range(n_dst):
            c = data.draw(st.integers(0, 5))
            if c:
                counts[(s, d)] = c
    turns = assign_turns(counts, max(n_src, n_dst))
    _check_turns(counts, turns)
    assert assign_turns(dict(reversed(list(counts.items()))), max(n_src, n_dst)) == turns


def test_alike_pairs_keep_the_rotation_schedule():
    """Where every pair has as many buckets, bucket k of (s, d) is at round k, position
    (d - s) mod n."""
    n = 5
    counts = {(s, d): 3 for s in range(n) for d in range(n)}
    turns = assign_turns(counts, n)
    assert all(ts == tuple(k * n + (d - s) % n for k in range(3)) for (s, d), ts in turns.items())


def test_light_pairs_leave_turns_the_busy_ones_fill():
    """Two pairs with a second bucket at different rotations: the rotation schedule puts them
    at positions 0 and 1 of round 1, first fit both in the first turn after round 0."""
    counts = {(s, d): 1 for s in range(4) for d in range(4)}
    counts[(0, 0)] = counts[(1, 2)] = 2
    turns = assign_turns(counts, 4)
    _check_turns(counts, turns)
    assert turns[(0, 0)] == (0, 4) and turns[(1, 2)] == (1, 4)
    assert max(t for ts in turns.values() for t in ts) == 4
    # one pair with more buckets than the rest: its source and destination busy in every turn
    counts = {(s, d): 1 for s in range(4) for d in range(4)}
    counts[(0, 0)] = 4
    turns = assign_turns(counts, 4)
    assert max(t for ts in turns.values() for t in ts) + 1 == 7       # 4 + 3 buckets at rank 0


def _unequal_domains_plan():
    """8 sources (TP8, one domain) -> TP2 x DP6 in domains of 8 and 4 destinations: each domain
    takes one copy over the network, so the 4 ranks of the small one receive twice as much."""
    dst = Layout(Mesh(np.arange(12).reshape(6, 2).tolist()), [Replicate(), Shard(0)])
    specs = {f"w{i}": TensorSpec((256 + 64 * i, 32), F32, Layout.sharded(list(range(8)), 0), dst)
             for i in range(6)}
    return plan(specs, src_domains=["s"] * 8, dst_domains=["a"] * 8 + ["b"] * 4)


def test_schedule_puts_network_buckets_in_turns():
    p = _unequal_domains_plan()
    bucket = 4096
    counts = network_bucket_counts(p, bucket)
    sched = p.schedule(bucket)
    net = [t for t in sched.transfers if t.path == NETWORK]
    assert Counter((t.src.rank, t.dst) for t in net) == counts
    entries = {(ti, m.src.rank, m.dst) for ti, tp in enumerate(p.tensor_plans) for m in tp.moves
               if m.path == NETWORK and m.src.side == "src"}
    assert network_entries(p) == len(entries)
    n_rot = 12
    turns = p.network_turns(bucket)
    per_turn_src, per_turn_dst = Counter(), Counter()
    for t in net:
        turn = t.key[0] * n_rot + t.key[2]
        assert turn in turns[(t.src.rank, t.dst)]
        per_turn_src[(turn, t.src.rank)] += 1
        per_turn_dst[(turn, t.dst)] += 1
    assert max(per_turn_src.values()) == 1 and max(per_turn_dst.values()) == 1
    # the busiest rank's buckets take about as many turns as it has buckets
    per_src, per_dst = Counter(), Counter()
    for (s, d), c in counts.items():
        per_src[s] += c
        per_dst[d] += c
    busiest = max(max(per_src.values()), max(per_dst.values()))
    last = max(t for ts in turns.values() for t in ts)
    assert busiest <= last + 1 <= busiest + n_rot // 2
    # every process's share agrees with the schedule; the turns travel with the plan
    back = pickle.loads(pickle.dumps(p))
    assert back.__dict__["_turns"][bucket] == turns and "_schedules" not in back.__dict__
    for ep in [Endpoint("src", 0), Endpoint("src", 7), Endpoint("dst", 3), Endpoint("dst", 9)]:
        assert build_share(back, [ep], bucket) == sched.for_endpoints([ep])


@pytest.mark.parametrize("window, round_len, span", [(4, 128, 2), (16, 4, 2), (16, 0, 8),
                                                     (1, 4, 0), (2, 1, 1), (8, 3, 1)])
def test_group_span(window, round_len, span):
    assert group_span(window, round_len) == span


def test_a_plan_too_large_to_count_keeps_the_rotation_schedule(monkeypatch):
    """Above TURNS_MAX_ENTRIES (tensor, network pair) entries the network buckets keep the
    rotation schedule: bucket k of (s, d) in round k at rotation (d - s) mod n."""
    import sys

    plan_module = sys.modules["ray_reshard.planning.schedule"]

    p = _unequal_domains_plan()
    bucket = 4096
    assert plan_module.network_entries(p) > 1
    monkeypatch.setattr(plan_module, "TURNS_MAX_ENTRIES", 1)
    assert p.network_turns(bucket) is None
    sched = p.schedule(bucket)
    seen = Counter()
    for t in sched.transfers:
        if t.path == NETWORK:
            s, d = t.src.rank, t.dst
            assert t.key[:3] == (seen[(s, d)], 0, (d - s) % 12)
            seen[(s, d)] += 1
    assert seen == network_bucket_counts(p, bucket)
    for ep in [Endpoint("src", 2), Endpoint("dst", 10)]:
        assert build_share(p, [ep], bucket) == sched.for_endpoints([ep])


def test_alike_pairs_keep_the_rotation_schedule_where_turns_gain_nothing():
    """TP4 -> TP4 by columns across domains: every pair has as many buckets, so turns would take
    as many positions as the rotation schedule occupies, and the plan keeps it."""
    specs = {f"w{i}": TensorSpec((64, 64), F32, Layout.sharded([0, 1, 2, 3], 0),
                                 Layout.sharded([0, 1, 2, 3], 1)) for i in range(4)}
    p = plan(specs, src_domains=list("abcd"), dst_domains=list("efgh"))
    assert set(network_bucket_counts(p, 1024).values()) == {4}
    assert p.network_turns(1024) is None
    assert _unequal_domains_plan().network_turns(4096) is not None
