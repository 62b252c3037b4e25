"""Which peer sends each member of gather-broadcast's collectives its bytes: what the strategy
reports as network or domain bytes (the wire check itself is in test_shaped_cluster.py)."""
from __future__ import annotations

import math

from ray_reshard.runtime.gather_broadcast import (binomial_parent, broadcast_parent,
                                                  gather_sender)


def gloo_broadcast_senders(size: int) -> dict:
    """vrank -> the vrank it receives from, by the loop of gloo/broadcast.cc (root 0)."""
    dim = math.ceil(math.log2(size)) if size > 1 else 0
    got = {}
    for v in range(size):
        mask = (1 << dim) - 1
        for i in range(dim):
            mask ^= 1 << i
            if v & mask:
                continue
            peer = v ^ (1 << i)
            if peer < size and v & (1 << i):
                got[v] = peer
    return got


def test_binomial_parent_is_gloos_tree():
    for size in range(2, 130):
        want = gloo_broadcast_senders(size)
        assert {v: binomial_parent(v, size) for v in range(1, size)} == want, size


def test_broadcast_parent_counts_one_relay_inside_the_receiving_domain():
    # root (process 0) on node a; destinations 4-7 on node b: gloo's tree has the root send
    # to 4, 5 and 7 and 4 relay to 6, so 3 copies cross between the nodes
    members = (0, 4, 5, 6, 7)
    dom = {0: "a", 4: "b", 5: "b", 6: "b", 7: "b"}
    senders = {p: broadcast_parent(members, p, dom, ring=False) for p in members[1:]}
    assert senders == {4: 0, 5: 0, 6: 4, 7: 0}
    assert sum(dom[s] != dom[p] for p, s in senders.items()) == 3
    # a ring visiting each domain's members together enters node b once
    ring = {p: broadcast_parent(members, p, dom, ring=True) for p in members[1:]}
    assert sum(dom[s] != dom[p] for p, s in ring.items()) == 1


def test_gather_sender_is_the_left_neighbour():
    members = (0, 1, 2, 3)
    dom = {0: "a", 1: "b", 2: "a", 3: "b"}
    assert [gather_sender(members, p, dom, ring=False) for p in members] == [3, 0, 1, 2]
    # NCCL's ring keeps each domain's members together: two edges cross between domains
    ring = {p: gather_sender(members, p, dom, ring=True) for p in members}
    assert sum(dom[s] != dom[p] for p, s in ring.items()) == 2
