"""A process's share of the schedule: the buckets one process sends or receives, built from
the plan without the whole schedule (each process compiles its own; see `schedule`)."""
from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from typing import TYPE_CHECKING, Iterable

from .._gc import gc_paused
from .moves import NETWORK, Endpoint
from .schedule import (Transfer, forward_transfers, items_of, pack_entries, make_transfer, bucket_keys, bucket_starts,
                       forward_segment)

if TYPE_CHECKING:
    from .plan import Plan


def build_share(plan: Plan, endpoints: Iterable[Endpoint], bucket_bytes: int) -> list[Transfer]:
    """The transfers of `build_schedule(plan, bucket_bytes)` that send from or deliver to one
    of `endpoints` (one process's share), in the same global key order, from the plan alone.

    Both ends of a (sender, receiver, path) pair see that pair's moves in the same order (tensor
    order, then move order), so they cut the same buckets with the same keys. A destination that
    receives forwarded pieces also replays the network pairs into its forwarders to learn which
    network bucket each forward follows. Time: linear in the moves of these endpoints (plus the
    network moves into forwarders that forward to them), and one lookup per tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    # The work's temporaries are freed when _share returns, before the collector runs again.
    with gc_paused():
        return _share(plan, frozenset(endpoints), bucket_bytes)


def _share(plan: Plan, mine: frozenset, bucket_bytes: int) -> list[Transfer]:
    return _Share(plan, mine, bucket_bytes).build()


def _cut(box, size: int, max_numel: int) -> list:
    """(piece, its bytes, the move's box) of a move's box as the schedule cuts it."""
    n = box.numel
    if n <= max_numel:
        return [(box, n * size, box)]
    return [(c, c.numel * size, box) for c in box.chunks(max_numel)]


class _Share:
    """Building one process's share (see `build_share`): its pairs' pieces in tensor order,
    the network pairs into other forwarders replayed only to key their forwards to it, then
    every pair's buckets at their keys, and the forwards."""

    def __init__(self, plan: Plan, mine: frozenset, bucket_bytes: int):
        self.plan, self.bucket_bytes = plan, bucket_bytes
        self.my_dst = {e.rank for e in mine if e.side == "dst"}
        self.my_src = {e.rank for e in mine if e.side == "src"}
        self.n_src, self.n_dst = plan.topology.n_src, plan.topology.n_dst
        # a tensor plan's element size is its spec's (both from the spec's signature)
        self.isz = [tp.itemsize for tp in plan.tensor_plans]
        # per tensor: {forwarder dst rank: [(box, (target, path)), ...]} (shared per plan)
        self.forwards: list = [None] * len(plan.tensor_plans)
        self.transfers: list[Transfer] = []
        self.pair_keys: list[tuple] = []          # (sender, receiver, path, ours)
        self.pair_lists: list[list] = []
        self.pair_slot: dict[tuple, int] = {}
        self.digests: dict = {}
        self.replay_sizes: dict[int, list] = {}
        self.replay_marks: dict[int, list] = {}

    def build(self) -> list[Transfer]:
        forwarders = self.collect_pairs()
        if forwarders:
            self.replay(frozenset(forwarders))
        self.emit_pairs()
        self.transfers.sort(key=lambda t: t.key)
        return self.transfers

    # ---------------------------------------------------------------- our pairs' pieces
    def slot(self, pair: tuple, ours: bool = True) -> int:
        i = self.pair_slot.get(pair)
        if i is None:
            i = self.pair_slot[pair] = len(self.pair_keys)
            self.pair_keys.append(pair + (ours,))
            self.pair_lists.append([])
        return i

    def digest(self, tp, size: int):
        """Our pairs' pieces and the forwards we take part in, for one distinct tensor plan."""
        max_numel = max(1, self.bucket_bytes // size)
        pairs: dict[tuple, list] = defaultdict(list)
        fwds: dict[int, list] = {}
        for m in tp.touching(self.my_src, self.my_dst):     # sent, forwarded or received here
            src, dst = m.src, m.dst
            if src.side == "dst":
                fwds.setdefault(src.rank, []).append((m.box, (dst, m.path)))
            else:
                pairs[self.slot((src, dst, m.path))] += _cut(m.box, size, max_numel)
        return [(self.pair_lists[i], pieces) for i, pieces in pairs.items()], fwds or None

    def collect_pairs(self) -> set:
        """Every pair's pieces in tensor order; returns the destination ranks, not ours, that
        forward to ours."""
        forwarders: set = set()
        for ti, tp in enumerate(self.plan.tensor_plans):
            d = self.digests.get(id(tp))
            if d is None:
                d = self.digests[id(tp)] = self.digest(tp, self.isz[ti])
                if d[1]:
                    forwarders.update(f for f in d[1] if f not in self.my_dst)
            for into, pieces in d[0]:
                into.extend([(nb, ti, box, parent) for box, nb, parent in pieces])
            self.forwards[ti] = d[1]
        return forwarders

    # ---------------------------------------------------------------- replayed pairs
    def replay_digest(self, tp, size: int, fset: frozenset) -> list:
        """Network pieces into forwarders (not ours) from sources (not ours)."""
        max_numel = max(1, self.bucket_bytes // size)
        pairs: dict[tuple, list] = defaultdict(list)
        for m in tp.into(fset):
            if (m.path == NETWORK and m.src.side == "src"
                    and m.src.rank not in self.my_src):   # our own sends are cut above
                pairs[self.slot((m.src, m.dst, NETWORK), False)] += _cut(m.box, size, max_numel)
        return [(i, tuple([nb for _, nb, _ in pieces]), pieces) for i, pieces in pairs.items()]

    def replay(self, fset: frozenset) -> None:
        """Network pairs into forwarders that are not ours: only to key their forwards to us."""
        # Per distinct tensor plan, its replayed pairs: (pair, sizes, pieces, whether the
        # plan's tensors have pieces forwarded here from that pair's forwarder).
        rows: dict = {}
        for ti, tp in enumerate(self.plan.tensor_plans):
            ck = id(tp)
            if ck not in rows:
                fw = self.digests[ck][1]
                rows[ck] = [(i, sizes, pieces, bool(fw) and self.pair_keys[i][1] in fw)
                            for i, sizes, pieces in self.replay_digest(tp, self.isz[ti], fset)]
        # Only pairs that bring pieces here need their bucket cuts (most replayed pairs of a
        # large plan bring none): per plan, those pairs' sizes list and marks list (or None).
        needed = {i for r in rows.values() for i, _, _, marked in r if marked}
        cache = {ck: [(self.replay_sizes.setdefault(i, []), sizes,
                       self.replay_marks.setdefault(i, []) if marked else None, pieces)
                      for i, sizes, pieces, marked in r if i in needed]
                 for ck, r in rows.items()}
        for ti, tp in enumerate(self.plan.tensor_plans):
            for lst, sizes, marks, pieces in cache[id(tp)]:
                # Only the sizes decide the buckets; only pieces forwarded here are kept.
                if marks is not None:
                    pos = len(lst)
                    marks.extend([(pos + j, (nb, ti, box, parent))
                                  for j, (box, nb, parent) in enumerate(pieces)])
                lst.extend(sizes)

    # ---------------------------------------------------------------- buckets and keys
    def buckets(self, i: int, entries: list):
        """(how many buckets pair i has, its (k, entries)): our pairs' buckets, or a replayed
        pair's buckets that hold pieces forwarded to us (found from the piece sizes alone)."""
        if self.pair_keys[i][3]:
            packed = pack_entries(entries, self.bucket_bytes, size_at=0)
            return len(packed), enumerate(packed)
        marks = self.replay_marks.get(i)
        if not marks:
            return 0, ()
        starts = bucket_starts(self.replay_sizes[i], self.bucket_bytes)
        by_k: dict[int, list] = {}
        for pos, entry in marks:
            by_k.setdefault(bisect_right(starts, pos), []).append(entry)
        return len(starts) + 1, by_k.items()

    def emit(self, key, src, dst, path, entries) -> None:
        self.transfers.append(make_transfer(self.isz, key, src, dst, path, items_of(entries),
                                            sum([e[0] for e in entries])))

    def emit_pairs(self) -> None:
        """Every pair's buckets at their keys (ours emitted), and the forwards of network
        buckets that reach us."""
        n_src, n_dst, my_dst = self.n_src, self.n_dst, self.my_dst
        any_forwards = any(f is not None for f in self.forwards)
        fwd_into: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
        turns = self.plan.network_turns(self.bucket_bytes) if self.pair_keys else {}
        for i, (src, dst, path, ours) in enumerate(self.pair_keys):
            gsrc = src.rank if src.side == "src" else n_src + src.rank
            forwarder_mine = dst in my_dst
            n, pair_buckets = self.buckets(i, self.pair_lists[i])
            if not n:
                continue
            keys = bucket_keys(n, src.rank, gsrc, dst, path, turns, n_src, n_dst)
            for k, bucket in pair_buckets:
                key = keys[k]
                if ours:
                    self.emit(key, src, dst, path, bucket)
                if path != NETWORK or not any_forwards:
                    continue
                seg = forward_segment(key[2], n_src, n_dst)
                for entry in bucket:
                    fw = self.forwards[entry[1]]
                    fs = None if fw is None else fw.get(dst)
                    if fs is None:
                        continue
                    parent = entry[3]
                    for box, (target, fpath) in fs:
                        if box == parent and (forwarder_mine or target in my_dst):
                            fwd_into[(dst, target, fpath, key[0], seg)][key].append(entry)
        for fkey, f, target, fpath, fentries in forward_transfers(fwd_into, self.bucket_bytes, 0,
                                                                  n_src, n_dst):
            self.emit(fkey, Endpoint("dst", f), target, fpath, fentries)
