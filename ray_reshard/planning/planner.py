"""The per-tensor planner: exact intersections, replica choice, domain de-duplication.

`plan_moves` cuts every destination box by the source boxes and chooses, per piece, a source
replica (least loaded) and a path (a local copy, the domain's own link, or the network, which
each byte crosses once per destination domain and is forwarded inside it). `verify_cover` checks
that the moves tile every destination shard exactly once. Pure: never imports Ray or the runtime.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import Any, Mapping, Sequence

from ..layout.box import Box
from ..layout.layout import Layout, LayoutUnion, rank_boxes
from .moves import (DOMAIN, LOCAL, NETWORK, Move, PlanError, Topology, endpoint, endpoints,
                    new_move)

__all__ = ["plan_moves", "verify_cover", "SPLIT_OVER_REPLICAS_BYTES", "WHOLE_BELOW_BYTES"]

# Pieces at least this large are split over several source replicas to spread the send load.
SPLIT_OVER_REPLICAS_BYTES = 256 * 1024
# A region smaller than this crosses into a domain whole, to one of the ranks there that need
# it (which one rotates across the tensors laid out alike), instead of split over all of them:
# splitting over k ranks costs k network items and k * (k - 1) forwarded ones per region, and
# at model scale those items, not the bytes, set the time.
WHOLE_BELOW_BYTES = 4 << 20


def plan_moves(shape, itemsize, src_layout: Layout, dst_layout: Layout, topo: Topology,
               rotation: int = 0) -> tuple[tuple[Move, ...], int]:
    """The moves: exact intersections, balanced replica choice, one network copy per domain.

    Also returns how many rotations give different plans: the tie-break among source replicas
    (1 when every replica of every source class that sends anything sends some of it) and,
    for regions that cross into a domain whole, which of its ranks receives them.
    """
    return _MovePlanner(shape, itemsize, src_layout, dst_layout, topo, rotation).run()


class _MovePlanner:
    """One tensor's moves as they are chosen: the source classes (ranks holding one box) and
    their holders by domain, the load of every source rank, the moves so far, which holders
    were picked, and the sizes of the rank lists that took a region whole."""

    def __init__(self, shape, itemsize, src_layout, dst_layout, topo: Topology, rotation: int):
        self.itemsize, self.rotation = itemsize, rotation
        self.sdev, self.ddev, self.ddom = topo.src_devices, topo.dst_devices, topo.dst_domains
        self.src_eps = endpoints("src", topo.n_src)
        self.src_classes = _classes(rank_boxes(src_layout, shape))
        self.dst_classes = _classes(rank_boxes(dst_layout, shape))
        # Domains whose ranks hold different but overlapping boxes (only destination groups
        # of a LayoutUnion do): planned cell by cell after the others (`place_mixed`).
        self.mixed = (_mixed_domains(self.dst_classes, topo.dst_domains)
                      if type(dst_layout) is LayoutUnion else {})
        # Per source class: its holders grouped by domain.
        sdom = topo.src_domains
        self.src_by_domain = []
        for sbox, holders in self.src_classes:
            near: dict[Any, list[int]] = {}
            for h in holders:
                near.setdefault(sdom[h], []).append(h)
            self.src_by_domain.append(near)
        self.load: dict[int, int] = defaultdict(int)
        self.moves: list[Move] = []
        self.picked: set = set()
        self.whole_at: set = set()
        self.heaps: dict = {}   # id(holder list) -> (its heap, the list) (see `pick`)

    def run(self) -> tuple[tuple[Move, ...], int]:
        for dbox, replicas in self.dst_classes:
            self.place(dbox, replicas)
        for dom, ranks in self.mixed.items():
            self.place_mixed(dom, ranks)
        rotations = 1
        for _, holders in self.src_classes:
            used = sum(1 for h in holders if h in self.picked)
            if 0 < used < len(holders):
                rotations = max(rotations, len(holders))
        for k in self.whole_at:
            rotations = math.lcm(rotations, k)
        return tuple(self.moves), rotations

    def pick(self, holders: Sequence[int]) -> int:
        """The least loaded holder; on a tie, the first from position `rotation` on (mod n):
        the least (load, (i - rotation) % n). Kept per holder list as a heap of (load then,
        tie order, holder); loads only grow, so an entry whose load is stale is pushed back
        with its load now until the top is current."""
        load = self.load
        kept = self.heaps.get(id(holders))
        if kept is None:
            n = len(holders)
            heap = [(load[h], (i - self.rotation) % n, h) for i, h in enumerate(holders)]
            heapq.heapify(heap)
            self.heaps[id(holders)] = (heap, holders)     # the list kept alive with its id
        else:
            heap = kept[0]
        while True:
            was, order, best = heap[0]
            now = load[best]
            if now == was:
                break
            heapq.heapreplace(heap, (now, order, best))
        self.picked.add(best)
        return best

    def pieces(self, rs: list, x: Box, splits: dict) -> list:
        """(receiver, piece) pairs of `x` into one far domain whose ranks `rs` all need it.
        `splits` keeps `x` split per rank count, for the other domains `x` goes to."""
        k = len(rs)
        if k > 1 and x.numel * self.itemsize < WHOLE_BELOW_BYTES:
            self.whole_at.add(k)
            return [(rs[self.rotation % k], x)]
        cut = splits.get(k)
        if cut is None:
            cut = splits[k] = x.split(k)
        return list(zip(rs, cut))

    def far(self, rs: list, cut: list, holders: Sequence[int], n_pieces: int,
            subs_of: dict) -> None:
        """A region into one far domain whose ranks `rs` all need it, cut as `pieces` cuts it:
        each piece to one of them over the network (several source replicas share a large
        piece), which forwards it to the rest. `subs_of` keeps each piece's share per source
        replica (by the piece's id; the pieces outlive it), for the other domains it goes to."""
        itemsize, load, moves, ddev = self.itemsize, self.load, self.moves, self.ddev
        src_eps = self.src_eps
        for receiver, piece in cut:
            subs = subs_of.get(id(piece))
            if subs is None:
                fan = (len(holders) // n_pieces
                       if piece.numel * itemsize >= SPLIT_OVER_REPLICAS_BYTES else 1)
                subs = subs_of[id(piece)] = [(sub, sub.numel * itemsize) for sub in
                                             (piece.split(fan) if fan > 1 else (piece,))]
            rep = endpoint("dst", receiver) if len(rs) > 1 else None
            for sub, nbytes in subs:
                h = self.pick(holders)
                load[h] += nbytes
                moves.append(new_move(src_eps[h], receiver, sub, NETWORK))
                if rep is None:
                    continue
                for other in rs:
                    if other != receiver:
                        path = LOCAL if ddev[other] == ddev[receiver] else DOMAIN
                        moves.append(new_move(rep, other, sub, path))

    def place(self, dbox: Box, replicas: tuple) -> None:
        """The moves into one destination class (ranks holding `dbox`): from a source in a
        rank's own domain (a local copy on its own device) where there is one, else into each
        far domain once."""
        itemsize, load, moves, sdev, ddev = (self.itemsize, self.load, self.moves, self.sdev,
                                             self.ddev)
        by_domain: dict[Any, list[int]] = {}
        for r in replicas:
            by_domain.setdefault(self.ddom[r], []).append(r)
        for (sbox, holders), near_of in zip(self.src_classes, self.src_by_domain):
            x = dbox.intersect(sbox)
            if x is None:
                continue
            xbytes = x.numel * itemsize
            far_domains = []
            for dom, rs in by_domain.items():
                near = near_of.get(dom)
                if not near:
                    if dom not in self.mixed:
                        far_domains.append(rs)
                    continue
                for r in rs:
                    same = [h for h in near if sdev[h] == ddev[r]]
                    if same:
                        moves.append(new_move(self.src_eps[same[0]], r, x, LOCAL))
                    else:
                        h = self.pick(near)
                        load[h] += xbytes
                        moves.append(new_move(self.src_eps[h], r, x, DOMAIN))
            if not far_domains:
                continue
            splits: dict = {}
            cuts = [(rs, self.pieces(rs, x, splits)) for rs in far_domains]
            n_pieces = sum(len(cut) for _, cut in cuts)
            subs_of: dict = {}
            for rs, cut in cuts:
                self.far(rs, cut, holders, n_pieces, subs_of)

    def place_mixed(self, dom, ranks: list) -> None:
        """The moves into a mixed domain (its ranks' boxes overlap): cell by cell of their
        union, from the source classes with no holder in that domain."""
        for (sbox, holders), near_of in zip(self.src_classes, self.src_by_domain):
            if near_of.get(dom):
                continue
            xs = [(r, x) for r, x in ((r, b.intersect(sbox)) for r, b in ranks) if x is not None]
            for cell in _cells([x for _, x in xs]):
                needers = [r for r, x in xs if x.contains(cell)]
                cut = self.pieces(needers, cell, {})
                self.far(needers, cut, holders, len(cut), {})


def _classes(boxes) -> list[tuple[Box, tuple[int, ...]]]:
    """Group ranks holding the same box; drop empty boxes. Deterministic order (by rank).

    `boxes` is a mapping rank -> box or an iterable of (rank, box) pairs.
    """
    items = boxes.items() if isinstance(boxes, Mapping) else boxes
    groups: dict[Box, list[int]] = {}
    for r, b in sorted(items, key=lambda rb: rb[0]):
        if b.empty:
            continue
        groups.setdefault(b, []).append(r)
    return [(b, tuple(rs)) for b, rs in groups.items()]


def _mixed_domains(dst_classes, ddom) -> dict:
    """Domain -> its ranks' (rank, box) pairs, for each domain where two ranks hold different
    boxes that overlap."""
    by_domain: dict = {}
    for box, ranks in dst_classes:
        for r in ranks:
            by_domain.setdefault(ddom[r], {}).setdefault(box, []).append(r)
    out = {}
    for dom, held in by_domain.items():
        boxes = list(held)
        if any(a.intersect(b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            out[dom] = sorted((r, b) for b, rs in held.items() for r in rs)
    return out


def _cells(boxes: Sequence[Box]) -> list[Box]:
    """The union of `boxes` cut on every box's boundaries: disjoint boxes, each inside every
    box it meets, merged along the last dim where they lie inside the same boxes."""
    if not boxes:
        return []
    ndim = boxes[0].ndim
    cuts = [sorted({v for b in boxes for v in (b.offsets[d], b.offsets[d] + b.sizes[d])})
            for d in range(ndim)]
    out: list[Box] = []

    def walk(d: int, offs: tuple, sizes: tuple, inside: tuple) -> None:
        if d == ndim:
            out.append(Box(offs, sizes))
            return
        run = None                   # a run of cells along dim d inside the same boxes
        for lo, hi in zip(cuts[d], cuts[d][1:]):
            now = tuple(i for i in inside if boxes[i].offsets[d] <= lo
                        and hi <= boxes[i].offsets[d] + boxes[i].sizes[d])
            if d < ndim - 1:
                if now:
                    walk(d + 1, offs + (lo,), sizes + (hi - lo,), now)
                continue
            if run is not None and run[2] == now and run[1] == lo:
                run = (run[0], hi, now)
                continue
            if run is not None and run[2]:
                out.append(Box(offs + (run[0],), sizes + (run[1] - run[0],)))
            run = (lo, hi, now)
        if run is not None and run[2]:
            out.append(Box(offs + (run[0],), sizes + (run[1] - run[0],)))

    walk(0, (), (), tuple(range(len(boxes))))
    return out


def verify_cover(shape, dst_layout, moves: Sequence[Move]) -> None:
    """Check that the moves into every destination rank tile its box exactly once."""
    into: dict[int, list[Box]] = defaultdict(list)
    for m in moves:
        into[m.dst].append(m.box)
    # Replicas often receive the very same piece objects (and share their Box): check a
    # (shard, pieces) combination once, told by identity (the moves keep the boxes alive).
    checked: set = set()
    for r, box in rank_boxes(dst_layout, tuple(shape)):
        got = into.pop(r, [])
        if box.empty:
            if got:
                raise PlanError(f"destination rank {r} holds nothing but is sent {got}")
            continue
        if len(got) == 1 and got[0] == box:     # the whole shard in one piece
            continue
        # Equal length and equal set of objects: the same pieces (a repeat changes the length).
        key = (id(box), len(got), frozenset(map(id, got))) if len(got) > 1 else None
        if key is not None and key in checked:
            continue
        total = 0
        for b in got:
            if not box.contains(b):
                raise PlanError(f"destination rank {r} is sent {b} outside its shard {box}")
            total += b.numel
        _check_disjoint(r, got)
        if total != box.numel:
            missing = box.numel - total
            raise PlanError(f"destination rank {r}: {missing} elements of its shard {box} "
                            f"are held by no source")
        if key is not None:
            checked.add(key)
    if into:
        raise PlanError(f"moves into ranks outside the destination mesh: {sorted(into)}")


def _check_disjoint(rank: int, boxes: list[Box]) -> None:
    """Sweep along dim 0 so only boxes overlapping in that dim are compared."""
    if not boxes or boxes[0].ndim == 0:
        if len(boxes) > 1:
            raise PlanError(f"destination rank {rank} receives its scalar {len(boxes)} times")
        return
    order = sorted(boxes, key=lambda b: b.offsets[0])
    active: list[Box] = []
    for b in order:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > b.offsets[0]]
        for a in active:
            if a.intersect(b) is not None:
                raise PlanError(f"destination rank {rank} receives {a.intersect(b)} twice")
        active.append(b)
