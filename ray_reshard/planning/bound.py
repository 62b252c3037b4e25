"""What a tensor's moves cost: their byte statistics, and the network lower bound.

`min_network_bytes` is computed from the two layouts and the domains alone, independently of
any plan (the tests check every plan against it). Never imports Ray or the runtime.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from ..layout.box import Box
from ..layout.layout import rank_boxes
from .moves import DOMAIN, LOCAL, NETWORK, Move, Topology
from .tensor_plan import TensorStats

__all__ = ["tensor_stats", "min_network_bytes"]


def tensor_stats(shape, itemsize, src_layout, dst_layout, topo: Topology,
                 moves: Sequence[Move]) -> TensorStats:
    """The byte statistics of `moves`, one tensor's plan."""
    by_path = defaultdict(int)
    send = defaultdict(int)
    recv = defaultdict(int)
    numel: dict = {}         # id(box) -> its elements: moves share boxes (a piece, its forwards)

    def numel_of(b: Box) -> int:
        n = numel.get(id(b))
        if n is None:
            n = numel[id(b)] = b.numel
        return n

    for m in moves:
        nb = numel_of(m.box) * itemsize
        by_path[m.path] += nb
        if m.path == NETWORK:
            send[m.src.rank] += nb
            recv[m.dst] += nb
    full = 1
    for s in shape:
        full *= s
    full *= itemsize
    shape = tuple(shape)
    # replicas share one Box object
    gather = sum(full - numel_of(b) * itemsize for _, b in rank_boxes(src_layout, shape))
    n_dst_holding = sum(1 for _, b in rank_boxes(dst_layout, shape) if numel_of(b))
    return TensorStats(
        network_bytes=by_path[NETWORK], domain_bytes=by_path[DOMAIN], local_bytes=by_path[LOCAL],
        min_network_bytes=min_network_bytes(shape, itemsize, src_layout, dst_layout, topo),
        gather_broadcast_bytes=gather + n_dst_holding * full,
        send_bytes=tuple(sorted(send.items())), recv_bytes=tuple(sorted(recv.items())))


def min_network_bytes(shape, itemsize, src_layout, dst_layout, topo: Topology) -> int:
    """Lower bound, computed on the grid of all shard boundaries, independently of any plan.

    For each grid cell: its bytes times the number of destination domains that need the cell
    and hold no source copy of it. Every box is a block of whole grid cells, so a domain's
    needs (and holdings) are a union of blocks, painted on a boolean grid.
    """
    shape = tuple(shape)
    src = [(r, b) for r, b in rank_boxes(src_layout, shape) if not b.empty]
    dst = [(r, b) for r, b in rank_boxes(dst_layout, shape) if not b.empty]
    if not dst:
        return 0
    boxes = {id(b): b for _, b in src + dst}.values()       # replicas share one Box object
    cuts = []
    for d, n in enumerate(shape):
        c = {0, n}
        for b in boxes:
            c.add(b.offsets[d])
            c.add(b.offsets[d] + b.sizes[d])
        cuts.append(sorted(c))
    pos = [{v: i for i, v in enumerate(c)} for c in cuts]

    # Each distinct box's block on the grid, numbered: replicas share one Box object, so the
    # boxes are told apart by identity first, then by value (equal boxes, one block).
    by_id: dict = {}
    by_box: dict = {}
    cells: list = []

    def block(b: Box) -> int:
        got = by_id.get(id(b))
        if got is None:
            got = by_box.get(b)
            if got is None:
                got = by_box[b] = len(cells)
                cells.append(tuple([(p[o], p[o + n]) for p, o, n in zip(pos, b.offsets,
                                                                           b.sizes)]))
            by_id[id(b)] = got
        return got

    need: dict[Any, set] = defaultdict(set)
    have: dict[Any, set] = defaultdict(set)
    for r, b in dst:
        need[topo.dst_domains[r]].add(block(b))
    for r, b in src:
        have[topo.src_domains[r]].add(block(b))
    # Domains with the same needs and holdings cost the same: count each kind once.
    kinds: dict[tuple, int] = defaultdict(int)
    for dom, blocks in need.items():
        kinds[(frozenset(blocks), frozenset(have.get(dom, ())))] += 1
    cell_bytes = np.full((), itemsize, dtype=np.int64)
    for c in cuts:
        cell_bytes = np.multiply.outer(cell_bytes, np.diff(np.asarray(c, dtype=np.int64)))
    total = 0
    for (needed, held), count in kinds.items():
        missing = np.zeros(cell_bytes.shape, dtype=bool)
        for blk in needed:
            missing[tuple(slice(a, b) for a, b in cells[blk])] = True
        for blk in held:
            missing[tuple(slice(a, b) for a, b in cells[blk])] = False
        total += count * int(cell_bytes[missing].sum())
    return total
