"""The Plan: every tensor's moves, the statistics, and the per-rank schedule of buckets."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from functools import cached_property
from bisect import bisect_left, bisect_right
from itertools import accumulate
from array import array
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from .._gc import gc_paused
from ..layout.box import Box
from .planner import (DOMAIN, LOCAL, NETWORK, Endpoint, Move, PlanError, TensorPlan, Topology,
                      plan_tensor)
from ..layout.slots import pack_slot_tables, unpack_slot_tables
from ..layout.spec import TensorSpec

DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class PlanStats:
    """Byte counts of a whole plan (destination dtype)."""

    total_bytes: int                 # bytes of all logical tensors (one copy)
    network_bytes: int               # crossing between domains
    domain_bytes: int                # inside a domain, between devices (NVLink / shared memory)
    local_bytes: int                 # same device or process
    min_network_bytes: int           # the lower bound, computed independently of the plan
    gather_broadcast_bytes: int      # bytes received under all-gather + broadcast
    max_send_bytes: int              # network bytes sent by the busiest source rank
    max_recv_bytes: int              # network bytes received by the busiest destination rank
    n_tensors: int
    n_moves: int
    n_signatures: int

    def summary(self) -> str:
        gb = lambda b: f"{b / 1e9:.3f} GB"
        ratio = (self.gather_broadcast_bytes / self.network_bytes) if self.network_bytes else float("inf")
        return "\n".join([
            f"tensors {self.n_tensors} ({self.n_signatures} distinct plans), "
            f"{gb(self.total_bytes)} of weights, {self.n_moves} moves",
            f"network {gb(self.network_bytes)} (lower bound {gb(self.min_network_bytes)}), "
            f"domain {gb(self.domain_bytes)}, local {gb(self.local_bytes)}",
            f"busiest source sends {gb(self.max_send_bytes)}, "
            f"busiest destination receives {gb(self.max_recv_bytes)}",
            f"gather-broadcast would move {gb(self.gather_broadcast_bytes)} "
            f"({ratio:.1f}x the network bytes)",
        ])

    def to_dict(self) -> dict:
        return asdict(self)

    def to_arrow(self):
        """`to_dict()` as a one-row pyarrow Table."""
        import pyarrow as pa
        return pa.Table.from_pylist([self.to_dict()])


@dataclass(frozen=True)
class Item:
    """One box of one tensor inside a bucket. `tensor` indexes `Plan.names`."""

    tensor: int
    box: Box


@dataclass(frozen=True)
class Transfer:
    """One bucket from `src` to destination rank `dst` over `path`; executed in `key` order."""

    key: tuple
    src: Endpoint
    dst: int
    path: str
    items: tuple[Item, ...]
    nbytes: int


class Plan:
    """A validated refit plan over named tensors. Build it with `plan()`."""

    def __init__(self, specs: Mapping[str, TensorSpec], topology: Topology,
                 tensor_plans: Sequence[TensorPlan]):
        self.names: tuple[str, ...] = tuple(specs)
        self._specs: tuple[TensorSpec, ...] = tuple(specs[n] for n in self.names)
        self.topology = topology
        self.tensor_plans: tuple[TensorPlan, ...] = tuple(tensor_plans)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The TensorSpecs, in `names` order."""
        sp = self.__dict__.get("_specs")
        if sp is None:
            with gc_paused(keep=True):        # tens of thousands of acyclic objects
                sp = self._specs = _unpack_specs(self.__dict__.pop("_spec_columns"))
        return sp

    def localize(self, endpoints: Iterable[Endpoint]) -> None:
        """Prepare a shipped plan for a process that holds only `endpoints` (unpacks the specs;
        slot tables stay compact, so every rank's share is as cheap as one rank's). No effect
        on a plan whose specs are unpacked."""
        self.specs

    @cached_property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @cached_property
    def distinct_plans(self) -> list[tuple[TensorPlan, int, int]]:
        """Each distinct TensorPlan, the number of tensors that use it and the first of them."""
        counts: dict[int, list] = {}
        for ti, tp in enumerate(self.tensor_plans):
            c = counts.get(id(tp))
            if c is None:
                counts[id(tp)] = [tp, 1, ti]
            else:
                c[1] += 1
        return [(tp, n, first) for tp, n, first in counts.values()]

    @cached_property
    def stats(self) -> PlanStats:
        tot = defaultdict(int)
        distinct = self.distinct_plans
        for tp, n, _ in distinct:
            s = tp.totals
            numel = 1
            for d in tp.shape:
                numel *= d
            tot["total"] += n * numel * tp.itemsize
            tot["network"] += n * s.network_bytes
            tot["domain"] += n * s.domain_bytes
            tot["local"] += n * s.local_bytes
            tot["min"] += n * s.min_network_bytes
            tot["gb"] += n * s.gather_broadcast_bytes
            tot["moves"] += n * tp.n_moves
        send, recv = self.send_bytes_by_rank, self.recv_bytes_by_rank
        return PlanStats(
            total_bytes=tot["total"], network_bytes=tot["network"], domain_bytes=tot["domain"],
            local_bytes=tot["local"], min_network_bytes=tot["min"],
            gather_broadcast_bytes=tot["gb"], max_send_bytes=max(send.values(), default=0),
            max_recv_bytes=max(recv.values(), default=0), n_tensors=len(self.names),
            n_moves=tot["moves"], n_signatures=len(distinct))

    @cached_property
    def send_bytes_by_rank(self) -> dict[int, int]:
        return self._network_bytes_by_rank(0, self.topology.n_src)

    @cached_property
    def recv_bytes_by_rank(self) -> dict[int, int]:
        return self._network_bytes_by_rank(1, self.topology.n_dst)

    def _network_bytes_by_rank(self, which: int, n: int) -> dict[int, int]:
        """rank -> network bytes it sends (which=0) or receives (which=1), ranks with some."""
        out = np.zeros(n, dtype=np.int64)
        for tp, count, _ in self.distinct_plans:
            ranks, nbytes = tp.network_bytes_arrays()[which]
            np.add.at(out, ranks, nbytes * count)
        return {int(r): int(out[r]) for r in np.flatnonzero(out)}

    def for_rank(self, side: str, rank: int) -> dict[str, tuple[Move, ...]]:
        """The moves (by tensor name) that rank `rank` of `side` sends or receives."""
        ep = Endpoint(side, rank)
        out = {}
        for name, tp in zip(self.names, self.tensor_plans):
            ms = tp.moves_for(ep)
            if ms:
                out[name] = ms
        return out

    def summary(self) -> str:
        return self.stats.summary()

    def __repr__(self) -> str:
        s = self.stats
        return (f"<Plan {s.n_tensors} tensors, network {s.network_bytes} B "
                f"(bound {s.min_network_bytes} B), domain {s.domain_bytes} B, "
                f"local {s.local_bytes} B>")

    def __getstate__(self):
        # Schedules are caches, often far larger than the plan: rebuild them where needed.
        # Network turns are small and need the whole plan's pairs: they travel along.
        # Specs travel as columns (see `_pack_specs`).
        state = {k: v for k, v in self.__dict__.items()
                 if k in ("names", "topology", "tensor_plans", "_turns")}
        if "_spec_columns" in self.__dict__:     # shipped on without being unpacked
            state["spec_columns"] = self.__dict__["_spec_columns"]
            return state
        state["spec_columns"] = _pack_specs(self.specs)
        return state

    def __reduce__(self):
        # The state goes to the caller's pickler (Ray's cloudpickle ships classes defined in
        # a driver script or test module by value; a plain inner pickle would not). Callers
        # shipping a large plan pause the cyclic collector around it (`gc_paused`).
        return (_load_plan, (self.__getstate__(),))

    def __setstate__(self, state):
        # Specs are unpacked on first use (all ranks' slots) or by localize() (this process's).
        self._spec_columns = state.pop("spec_columns")
        self.__dict__.update(state)

    def network_turns(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      deadline: Optional[float] = None) -> Optional[dict]:
        """{(source rank, destination rank): the turns of that network pair's buckets} for
        buckets of `bucket_bytes` (see `assign_turns`; cached, and shipped with the plan once
        computed, so the processes compiling their shares do not each compute it).

        None where the network buckets keep the rotation schedule (bucket k of a pair in round
        k, at its rotation): where the plan has more than TURNS_MAX_ENTRIES (tensor, network
        pair) entries, or where turns would not take at least TURNS_MIN_GAIN fewer positions
        than the rotation schedule occupies (its (round, rotation) positions holding a bucket:
        a position one rank waits through for another costs about one bucket's time).
        Past `deadline` it stops with PlanTimeout."""
        cache = self.__dict__.setdefault("_turns", {})
        if bucket_bytes not in cache:
            turns = None
            if network_entries(self) <= TURNS_MAX_ENTRIES:
                pairs = _network_buckets(self, bucket_bytes, deadline)
                n_src, n_dst = self.topology.n_src, self.topology.n_dst
                turns = assign_turns({pair: n for pair, (n, _) in pairs.items()},
                                     max(n_src, n_dst),
                                     late={pair for pair, (n, nbytes) in pairs.items()
                                           if nbytes < n * (bucket_bytes // SMALL_BUCKET)})
                occupied = len({(k, rotation(s, d, n_src, n_dst))
                                for (s, d), (n, _) in pairs.items() for k in range(n)})
                used = 1 + max((ts[-1] for ts in turns.values()), default=-1)
                if used > (1 - TURNS_MIN_GAIN) * occupied:
                    turns = None
            cache[bucket_bytes] = turns
        return cache[bucket_bytes]

    def schedule(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> "Schedule":
        """Buckets of at most `bucket_bytes` in one deadlock-free global order (cached)."""
        cache = self.__dict__.setdefault("_schedules", {})
        if bucket_bytes not in cache:
            cache[bucket_bytes] = build_schedule(self, bucket_bytes)
        return cache[bucket_bytes]


def _load_plan(state: dict) -> "Plan":
    p = Plan.__new__(Plan)
    p.__setstate__(state)
    return p


def _pack_specs(specs: Sequence[TensorSpec]) -> tuple:
    """Specs as columns: each distinct (shape, dtype, layouts, source dtype, quant) once, and per
    spec its index, and the slot tables (see `pack_slot_tables`)."""
    kinds: dict = {}
    kind_of, src_slots, dst_slots = [], [], []
    for sp in specs:
        k = (sp.shape, sp.dtype, id(sp.src), id(sp.dst), sp.src_dtype, sp.quant)
        i = kinds.get(k)
        if i is None:
            i = kinds[k] = len(kinds)
        kind_of.append(i)
        src_slots.append(sp.src_slots)
        dst_slots.append(sp.dst_slots)
    by_id = {id(sp.src): sp.src for sp in specs}
    by_id.update((id(sp.dst), sp.dst) for sp in specs)
    table = [(shape, dtype, by_id[s], by_id[d], sdt, q) for (shape, dtype, s, d, sdt, q) in kinds]
    return table, array("I", kind_of), pack_slot_tables(src_slots), pack_slot_tables(dst_slots)


_new = object.__new__


def _unpack_specs(columns) -> tuple[TensorSpec, ...]:
    """TensorSpecs from `_pack_specs` columns, built from validated fields (no re-validation:
    they were checked when planned)."""
    table, kind_of, src_slots, dst_slots = columns
    src_slots, dst_slots = unpack_slot_tables(src_slots), unpack_slot_tables(dst_slots)
    # per kind, its fields (in declaration order): each spec copies them, then sets its tables
    kinds = [dict(shape=shape, dtype=dtype, src=src, dst=dst, src_dtype=sdt, src_slots=None,
                  dst_slots=None, quant=quant)
             for shape, dtype, src, dst, sdt, quant in table]
    out = []
    append = out.append
    for k, ss, ds in zip(kind_of, src_slots, dst_slots):
        sp = _new(TensorSpec)
        d = sp.__dict__
        d.update(kinds[k])
        d["src_slots"] = ss
        d["dst_slots"] = ds
        append(sp)
    return tuple(out)


class Schedule:
    """All transfers of a plan, sorted by a key every rank agrees on.

    Each process runs its own transfers in key order, sends and receives alike. Any total order
    shared by all ranks is deadlock-free when a posted transfer completes once both of its ends
    have posted it: the earliest unfinished transfer always has both ends posted.
    """

    def __init__(self, transfers: Sequence[Transfer], bucket_bytes: int):
        self.transfers = tuple(sorted(transfers, key=lambda t: t.key))
        self.bucket_bytes = bucket_bytes

    def for_endpoints(self, endpoints: Iterable[Endpoint]) -> list[Transfer]:
        eps = set(endpoints)
        return [t for t in self.transfers if t.src in eps or Endpoint("dst", t.dst) in eps]

    def __len__(self) -> int:
        return len(self.transfers)


_PATH_ORDER = {NETWORK: 0, DOMAIN: 1, LOCAL: 2}


def build_schedule(plan: Plan, bucket_bytes: int) -> Schedule:
    """Pack moves into buckets per (sender, receiver, path) and order them.

    A network pair's k-th bucket goes in the pair's k-th turn (`Plan.network_turns`): its key
    is (turn // n, network, turn % n, sender, receiver, ...), round and position in a round of
    n = max(n_src, n_dst) positions; in one turn a rank sends at most one network bucket and
    receives at most one. A domain or local pair's k-th bucket sorts at (k, path, rotation, ...),
    after the network buckets of round k.

    Forwarded pieces (a destination passing network pieces on inside its domain) are packed
    per (forwarder, target, path, segment of a round's rotations): what a forwarder passes to
    one target out of its network buckets of that segment, in their key order, into buckets
    that sort into the next segment (`forward_key`), so the domain exchange overlaps the next
    segment's network transfers and costs one ring transfer per target and segment, not one
    per network bucket and target.

    Linear in the number of moves (plus sorting the transfers).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    topo = plan.topology
    n_src = topo.n_src
    isz = [spec.itemsize for spec in plan.specs]

    def gid(ep: Endpoint) -> int:
        return ep.rank if ep.side == "src" else n_src + ep.rank

    # (sender, receiver, path) -> [(item, its bytes, the box of the move it was cut from)]
    pair_items: dict[tuple, list[tuple[Item, int, Box]]] = defaultdict(list)
    # (forwarder dst rank, tensor, box of the network move) -> [(target dst rank, path)]
    forwards: dict[tuple, list[tuple[int, str]]] = defaultdict(list)
    # (forwarder, target, path, round, segment) -> {network bucket key: its entries there}
    fwd_into: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    transfers: list[Transfer] = []
    with gc_paused():
        for ti, tp in enumerate(plan.tensor_plans):
            size = isz[ti]
            max_numel = max(1, bucket_bytes // size)
            for m in tp.moves:
                box = m.box
                if m.src.side == "dst":
                    forwards[(m.src.rank, ti, box)].append((m.dst, m.path))
                    continue
                entries = pair_items[(m.src, m.dst, m.path)]
                n = box.numel
                if n <= max_numel:
                    entries.append((Item(ti, box), n * size, box))
                else:
                    for chunk in box.chunks(max_numel):
                        entries.append((Item(ti, chunk), chunk.numel * size, box))

        turns = plan.network_turns(bucket_bytes) if pair_items else {}
        for (src, dst, path), entries in pair_items.items():
            packed = _pack(entries, bucket_bytes)
            keys = bucket_keys(len(packed), src.rank, gid(src), dst, path, turns, n_src,
                                topo.n_dst)
            for key, bucket in zip(keys, packed):
                transfers.append(_transfer(isz, key, src, dst, path, [e[0] for e in bucket],
                                           sum(e[1] for e in bucket)))
                if path != NETWORK:
                    continue
                seg = forward_segment(key[2], n_src, topo.n_dst)
                for entry in bucket:
                    item = entry[0]
                    for target, fpath in forwards.get((dst, item.tensor, entry[2]), ()):
                        fwd_into[(dst, target, fpath, key[0], seg)][key].append(entry)
        for fkey, f, target, fpath, fentries in _forwards(fwd_into, bucket_bytes, 1, n_src,
                                                          topo.n_dst):
            transfers.append(_transfer(isz, fkey, Endpoint("dst", f), target, fpath,
                                       [e[0] for e in fentries], sum(e[1] for e in fentries)))
        return Schedule(transfers, bucket_bytes)


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
    my_dst = {e.rank for e in mine if e.side == "dst"}
    n_src = plan.topology.n_src
    # a tensor plan's element size is its spec's (both from the spec's signature)
    isz = [tp.itemsize for tp in plan.tensor_plans]
    # per tensor: {forwarder dst rank: [(box, (target, path)), ...]} (shared per tensor plan)
    forwards: list = [None] * len(plan.tensor_plans)
    transfers: list[Transfer] = []

    def cut(box, size, max_numel):
        n = box.numel
        if n <= max_numel:
            return [(box, n * size, box)]
        return [(c, c.numel * size, box) for c in box.chunks(max_numel)]

    my_src = {e.rank for e in mine if e.side == "src"}

    def digest(tp, size):
        """Our pairs' pieces and the forwards we take part in, for one distinct tensor plan."""
        max_numel = max(1, bucket_bytes // size)
        pairs: dict[tuple, list] = defaultdict(list)
        fwds: dict[int, list] = {}
        for m in tp.touching(my_src, my_dst):       # sent, forwarded or received here
            src, dst = m.src, m.dst
            if src.side == "dst":
                fwds.setdefault(src.rank, []).append((m.box, (dst, m.path)))
            else:
                pairs[slot((src, dst, m.path))] += cut(m.box, size, max_numel)
        return [(pair_lists[i], pieces) for i, pieces in pairs.items()], fwds or None

    def replay_digest(tp, size, fset):
        """Network pieces into forwarders (not ours) from sources (not ours)."""
        max_numel = max(1, bucket_bytes // size)
        pairs: dict[tuple, list] = defaultdict(list)
        for m in tp.into(fset):
            if (m.path == NETWORK and m.src.side == "src"
                    and m.src.rank not in my_src):   # our own sends are cut above
                pairs[slot((m.src, m.dst, NETWORK), False)] += cut(m.box, size, max_numel)
        return [(i, tuple([nb for _, nb, _ in pieces]), pieces) for i, pieces in pairs.items()]

    pair_keys: list[tuple] = []          # (sender, receiver, path, ours)
    pair_lists: list[list] = []
    pair_slot: dict[tuple, int] = {}

    def slot(pair, ours=True):
        i = pair_slot.get(pair)
        if i is None:
            i = pair_slot[pair] = len(pair_keys)
            pair_keys.append(pair + (ours,))
            pair_lists.append([])
        return i

    def emit(key, src, dst, path, entries):
        transfers.append(_transfer(isz, key, src, dst, path, _items(entries),
                                   sum([e[0] for e in entries])))

    digests: dict = {}
    forwarders: set = set()          # destination ranks, not ours, forwarding to ours
    for ti, tp in enumerate(plan.tensor_plans):
        d = digests.get(id(tp))
        if d is None:
            d = digests[id(tp)] = digest(tp, isz[ti])
            if d[1]:
                forwarders.update(f for f in d[1] if f not in my_dst)
        for into, pieces in d[0]:
            into.extend([(nb, ti, box, parent) for box, nb, parent in pieces])
        forwards[ti] = d[1]
    # Network pairs into forwarders that are not ours: only to key their forwards to us.
    replay_sizes: dict[int, list] = {}
    replay_marks: dict[int, list] = {}
    if forwarders:
        fset = frozenset(forwarders)
        # Per distinct tensor plan, its replayed pairs: (pair, sizes, pieces, whether the plan's
        # tensors have pieces forwarded here from that pair's forwarder).
        rows: dict = {}
        for ti, tp in enumerate(plan.tensor_plans):
            ck = id(tp)
            if ck not in rows:
                fw = digests[ck][1]
                rows[ck] = [(i, sizes, pieces, bool(fw) and pair_keys[i][1] in fw)
                            for i, sizes, pieces in replay_digest(tp, isz[ti], fset)]
        # Only pairs that bring pieces here need their bucket cuts (most replayed pairs of a
        # large plan bring none): per plan, those pairs' sizes list and marks list (or None).
        needed = {i for r in rows.values() for i, _, _, marked in r if marked}
        cache = {ck: [(replay_sizes.setdefault(i, []), sizes,
                       replay_marks.setdefault(i, []) if marked else None, pieces)
                      for i, sizes, pieces, marked in r if i in needed]
                 for ck, r in rows.items()}
        for ti, tp in enumerate(plan.tensor_plans):
            for lst, sizes, marks, pieces in cache[id(tp)]:
                # Only the sizes decide the buckets; only pieces forwarded here are kept.
                if marks is not None:
                    pos = len(lst)
                    marks.extend([(pos + j, (nb, ti, box, parent))
                                  for j, (box, nb, parent) in enumerate(pieces)])
                lst.extend(sizes)

    def buckets(i, entries):
        """(how many buckets pair i has, its (k, entries)): our pairs' buckets, or a replayed
        pair's buckets that hold pieces forwarded to us (found from the piece sizes alone)."""
        if pair_keys[i][3]:
            packed = _pack(entries, bucket_bytes, size_at=0)
            return len(packed), enumerate(packed)
        marks = replay_marks.get(i)
        if not marks:
            return 0, ()
        starts = bucket_starts(replay_sizes[i], bucket_bytes)
        by_k: dict[int, list] = {}
        for pos, entry in replay_marks.get(i, ()):
            by_k.setdefault(bisect_right(starts, pos), []).append(entry)
        return len(starts) + 1, by_k.items()

    any_forwards = any(f is not None for f in forwards)
    fwd_into: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    n_dst = plan.topology.n_dst
    turns = plan.network_turns(bucket_bytes) if pair_keys else {}
    for i, (src, dst, path, ours) in enumerate(pair_keys):
        gsrc = src.rank if src.side == "src" else n_src + src.rank
        forwarder_mine = dst in my_dst
        n, pair_buckets = buckets(i, pair_lists[i])
        if not n:
            continue
        keys = bucket_keys(n, src.rank, gsrc, dst, path, turns, n_src, n_dst)
        for k, bucket in pair_buckets:
            key = keys[k]
            if ours:
                emit(key, src, dst, path, bucket)
            if path != NETWORK or not any_forwards:
                continue
            seg = forward_segment(key[2], n_src, n_dst)
            for entry in bucket:
                fw = forwards[entry[1]]
                fs = None if fw is None else fw.get(dst)
                if fs is None:
                    continue
                parent = entry[3]
                for box, (target, fpath) in fs:
                    if box == parent and (forwarder_mine or target in my_dst):
                        fwd_into[(dst, target, fpath, key[0], seg)][key].append(entry)
    for fkey, f, target, fpath, fentries in _forwards(fwd_into, bucket_bytes, 0, n_src,
                                                      plan.topology.n_dst):
        emit(fkey, Endpoint("dst", f), target, fpath, fentries)
    transfers.sort(key=lambda t: t.key)
    return transfers


def bucket_starts(sizes, bucket_bytes: int) -> list[int]:
    """Where a pair's buckets after the first start, for entries of these byte sizes.

    The pair's bytes go into n = ceil(total / bucket_bytes) buckets of about equal size: each
    bucket ends at the entry boundary nearest its share of the total, never past
    `bucket_bytes` (an entry larger than that goes alone; where entries do not fit n buckets
    there are more). Equal buckets keep the pairs of a turn (a round, in the rotation
    schedule) alike in size: one whose pairs are uneven runs at the pace of its largest."""
    if sum(sizes) <= bucket_bytes:          # one bucket (most pairs of a large plan)
        return []
    ends = list(accumulate(int(x) for x in sizes))
    n = len(ends)
    total = ends[-1]
    share = total / -(-total // bucket_bytes)
    starts = []
    pos, before, k = 0, 0, 1
    while True:
        # the first entry that would overflow a bucket opened at `pos`
        cap = max(bisect_right(ends, before + bucket_bytes), pos + 1)
        # the entry boundary nearest this bucket's share of the total
        q = k * share
        c = bisect_left(ends, q)
        if c < n and (c == 0 or ends[c] - q <= q - ends[c - 1]):
            c += 1
        nxt = min(cap, max(c, pos + 1))
        if nxt >= n:
            return starts
        starts.append(nxt)
        pos, before, k = nxt, ends[nxt - 1], k + 1


def _pack(entries: list, bucket_bytes: int, size_at: int = 1) -> list[list]:
    """`entries` cut into buckets where `bucket_starts` says; `entry[size_at]` is an entry's
    bytes ((item, nbytes, parent) entries by default)."""
    if not entries:
        return []
    cuts = [0, *bucket_starts([e[size_at] for e in entries], bucket_bytes), len(entries)]
    return [entries[a:b] for a, b in zip(cuts, cuts[1:])]


def bucket_count(sizes, bucket_bytes: int) -> int:
    """How many buckets `bucket_starts` cuts entries of these byte sizes into, mostly without
    cutting: n = ceil(total / bucket_bytes) wherever each bucket's share plus the largest entry
    fits a bucket (each bucket then ends within half an entry of its share)."""
    total = sum(sizes)
    if total <= bucket_bytes:
        return 1
    n = -(-total // bucket_bytes)
    if total / n + max(sizes) <= bucket_bytes:
        return n
    return len(bucket_starts(sizes, bucket_bytes)) + 1


# Counting every network pair's buckets exactly walks each (tensor, network pair) entry of the
# plan once, about 0.5 us each here: up to this many (a second or two, once per plan, on the
# driver) network buckets go in turns; larger plans keep the rotation schedule.
TURNS_MAX_ENTRIES = 2_000_000
# Turns replace the rotation schedule only where they take this much fewer positions.
TURNS_MIN_GAIN = 0.05


def network_entries(plan: "Plan") -> int:
    """How many (tensor, network pair) entries `network_bucket_counts` walks."""
    return sum(tp.n_network_pairs() for tp in plan.tensor_plans)


def network_bucket_counts(plan: "Plan", bucket_bytes: int) -> dict[tuple[int, int], int]:
    """{(source rank, destination rank): how many buckets of at most `bucket_bytes` the
    schedule cuts that network pair into}, from the whole plan's moves (per distinct tensor
    plan, renamed per tensor)."""
    return {pair: n for pair, (n, _) in _network_buckets(plan, bucket_bytes).items()}


def _network_buckets(plan: "Plan", bucket_bytes: int, deadline: Optional[float] = None
                     ) -> dict[tuple[int, int], tuple[int, int]]:
    """{network pair: (its buckets, its bytes)} (see `network_bucket_counts`)."""
    sizes: dict[tuple[int, int], list] = {}
    with gc_paused():
        for ti, tp in enumerate(plan.tensor_plans):
            if deadline is not None and not ti % DEADLINE_EVERY:
                check_deadline(deadline, "cutting network buckets")
            isz = plan.specs[ti].itemsize
            for s, d, piece_sizes in tp.network_pieces(max(1, bucket_bytes // isz), isz):
                got = sizes.get((s, d))
                if got is None:
                    sizes[(s, d)] = list(piece_sizes)
                else:
                    got += piece_sizes
        return {pair: (bucket_count(v, bucket_bytes), sum(v)) for pair, v in sizes.items()}


# A network pair whose buckets average under bucket_bytes / SMALL_BUCKET takes its turns after
# the others (see `assign_turns`).
SMALL_BUCKET = 4


def assign_turns(counts: Mapping[tuple[int, int], int], n_rot: int,
                 late: Iterable[tuple[int, int]] = ()) -> dict[tuple[int, int], tuple]:
    """The turn of every network bucket: {(source rank, destination rank): the turns of that
    pair's buckets, increasing}. In one turn a source sends at most one bucket and a
    destination receives at most one; a bucket's key is (turn // n_rot, ..., turn % n_rot):
    its round and its position in the round.

    First fit in the rotation schedule's order: bucket k of every pair, by k, then by rotation
    `(dst - src) mod n_rot`, takes the earliest turn after the pair's previous bucket where
    neither end is busy. Where every pair has as many buckets this is the rotation schedule
    (round k, position = rotation); where pairs differ, the buckets of busier ranks fill the
    turns lighter pairs leave free instead of trailing in sparse late rounds, so a rank's
    buckets take about as many turns as it has buckets (the most any schedule needs is the
    largest such count: each turn is a matching). Deterministic: every process computes the
    same turns from the same counts.

    The pairs in `late` (small buckets: a turn counts them as much as a full one, though they
    take little time) take their turns after all the others have theirs, in the gaps those
    leave or after them, so they do not push full buckets of the busiest ranks back."""
    late = frozenset(late)
    with gc_paused():
        busy_src: dict[int, int] = defaultdict(int)       # bit t set: busy in turn t
        busy_dst: dict[int, int] = defaultdict(int)
        out: dict[tuple[int, int], tuple] = {}
        for first in (True, False):
            out.update(_first_fit({pair: c for pair, c in counts.items()
                                   if (pair in late) != first}, n_rot, busy_src, busy_dst))
        return out


def _first_fit(counts: Mapping[tuple[int, int], int], n_rot: int, busy_src: dict,
               busy_dst: dict) -> dict:
    pairs = sorted(counts, key=lambda sd: ((sd[1] - sd[0]) % n_rot, sd))
    out: dict[tuple[int, int], list] = {pair: [] for pair in pairs}
    k = 0
    while pairs:
        for pair in pairs:
            s, d = pair
            got = out[pair]
            lo = got[-1] + 1 if got else 0
            free = ~(busy_src[s] | busy_dst[d]) >> lo
            t = lo + (free & -free).bit_length() - 1
            busy_src[s] |= 1 << t
            busy_dst[d] |= 1 << t
            got.append(t)
        k += 1
        pairs = [pair for pair in pairs if counts[pair] > k]
    return {pair: tuple(v) for pair, v in out.items()}


def bucket_keys(n: int, src_rank: int, gsrc: int, dst: int, path: str, turns: Optional[dict],
                 n_src: int, n_dst: int) -> list[tuple]:
    """The keys of a source-to-destination pair's n buckets (`gsrc`: the sender's number in
    the key, sources first): a network pair's at its turns
    (round, network, position in the round, ...), the others (and network pairs where `turns`
    is None) at (k, path, rotation, ...)."""
    if path != NETWORK or turns is None:
        rot = rotation(src_rank, dst, n_src, n_dst)
        return [(k, _PATH_ORDER[path], rot, gsrc, dst, 0, -1) for k in range(n)]
    pair_turns = turns.get((src_rank, dst), ())
    if len(pair_turns) != n:
        raise RuntimeError(f"network pair src {src_rank} -> dst {dst}: {n} buckets, but the "
                           f"plan's turn table has {len(pair_turns)} (planner bug)")
    n_rot = max(n_src, n_dst)
    return [(t // n_rot, _PATH_ORDER[NETWORK], t % n_rot, gsrc, dst, 0, -1) for t in pair_turns]


# Staging memory a process may hold for network buckets in flight, by default.
DEFAULT_STAGING_BYTES = 128 << 20
MAX_WINDOW = 16


def default_window(bucket_bytes: int, staging_bytes: int = DEFAULT_STAGING_BYTES) -> int:
    """Staged buckets in flight per process (the executor's window): as many as fit in
    `staging_bytes`, at least 2 (double buffering), at most MAX_WINDOW."""
    return max(2, min(MAX_WINDOW, staging_bytes // max(1, bucket_bytes)))


def group_span(window: int, round_len: int = 0) -> int:
    """How many positions of a round one network group spans (0: each bucket its own group):
    `window // 2`, so a group holds at most that many sends and as many receives, but at most
    half a round of `round_len` positions (0: no limit), so a round is at least two groups and
    one is in flight while the next is packed."""
    span = window // 2
    return min(span, max(1, round_len // 2)) if round_len else span


def rotation(src: int, dst: int, n_src: int, n_dst: int) -> int:
    """The rotation of the pair (source rank `src`, destination rank `dst`):
    `(dst - src) mod max(n_src, n_dst)`. In one rotation every source rank sends to at most
    one destination rank and every destination rank receives from at most one source rank, and
    the rotations are as few as that allows, so all pairs are met in max(n_src, n_dst) steps of
    disjoint pairs. It is the position of a domain or local pair's buckets in their rounds, and
    the order in which network buckets take their turns (`assign_turns`)."""
    return (dst - src) % max(n_src, n_dst)


# A forwarded bucket's key holds this where a network bucket's holds its sender: it sorts after
# the network buckets of its rotation.
FORWARDED = 1 << 40
# Forwards are merged per segment of a round's rotations and sent during the next segment: at
# most this many segments per round, each at least SEGMENT_ROTATIONS rotations wide (narrower
# segments put a ring run, which waits for its peers, between too few network buckets).
FORWARD_SEGMENTS = 4
SEGMENT_ROTATIONS = 16


def forward_segment(rotation_: int, n_src: int, n_dst: int) -> int:
    """The segment of a round that a network bucket at position `rotation_` falls in."""
    n_rot = max(n_src, n_dst)
    return rotation_ * forward_segments(n_src, n_dst) // n_rot


def forward_segments(n_src: int, n_dst: int) -> int:
    """How many segments each round's rotations are cut into (see `forward_segment`)."""
    return max(1, min(FORWARD_SEGMENTS, max(n_src, n_dst) // SEGMENT_ROTATIONS))


def segment_rotations(segment: int, n_src: int, n_dst: int) -> range:
    """The rotations of a round that segment `segment` holds."""
    n_rot, segments = max(n_src, n_dst), forward_segments(n_src, n_dst)
    return range(segment * n_rot // segments, (segment + 1) * n_rot // segments)


def forward_key(round_: int, segment: int, forwarder: int, target: int, path: str, chunk: int,
                parent: tuple, n_src: int, n_dst: int) -> tuple:
    """Order key of forwarded bucket `chunk` from `forwarder` to `target`: what the forwarder
    passes on to that target out of its network buckets of one segment of round `round_`,
    merged and cut into buckets. `parent` is the key of the last network bucket whose data it
    holds (a process's network buckets complete in key order, so the others have completed by
    then).

    The chunks go into the next segment (of this round, or the first of the next), spread over
    its rotations: chunk c of the pair at ring rotation j = (target - forwarder) mod n_dst sorts
    right after the network buckets of the segment's rotation (j + c) mod its width. So a
    forwarder passes a segment on while the next one's network receives are in flight, instead
    of all at once between two rounds, and what is left after the last network bucket is one
    segment's forwarding. Within a rotation, forwards go by ring rotation (each forwarder sends
    to one target and each target takes from one forwarder per ring rotation), then by
    descending forwarder: every forwarder but the few lowest sends before it receives, so the
    domain's forwards do not wait on each other in a chain."""
    segments = forward_segments(n_src, n_dst)
    nxt_round, nxt = divmod(round_ * segments + segment + 1, segments)
    rots = segment_rotations(nxt, n_src, n_dst)
    j = (target - forwarder) % n_dst
    return (nxt_round, _PATH_ORDER[NETWORK], rots[(j + chunk) % len(rots)], FORWARDED, j,
            -forwarder, target, _PATH_ORDER[path], chunk, parent[0], parent[2], parent[3])


def is_forward_key(key: tuple) -> bool:
    """True for the key of a forwarded bucket (see `forward_key`)."""
    return len(key) > 3 and key[3] == FORWARDED


def parent_key(forward: "Transfer") -> tuple:
    """Key of the last network bucket whose data a forwarded bucket passes on."""
    k = forward.key
    return (k[9], _PATH_ORDER[NETWORK], k[10], k[11], -k[5], 0, -1)


def run_order(key: tuple, span: int) -> tuple:
    """Where a step runs when network buckets are posted in groups of `span` rotations: the
    key order, except that forwarded buckets sorting inside a group's rotations run right after
    that group (so a group is never cut in two). Every process uses the same order."""
    if key[1] != _PATH_ORDER[NETWORK] or span <= 1:
        return key
    return (key[0], key[1], key[2] // span, key[3] == FORWARDED) + key[2:]


def _forwards(fwd_into: dict, bucket_bytes: int, size_at: int, n_src: int, n_dst: int):
    """(key, forwarder, target, path, entries) of every forwarded bucket, from `fwd_into`
    {(forwarder, target, path, round, segment): {network bucket key: entries}}."""
    for (f, target, fpath, k, seg), parts in fwd_into.items():
        for c, (parent, fentries) in enumerate(_forward_buckets(parts, bucket_bytes, size_at)):
            yield (forward_key(k, seg, f, target, fpath, c, parent, n_src, n_dst), f, target,
                   fpath, fentries)


def _forward_buckets(parts: dict, bucket_bytes: int, size_at: int) -> list[tuple]:
    """One (forwarder, target, path, round, segment)'s forwarded entries, `parts` {network key:
    entries}, in network key order cut into buckets of at most `bucket_bytes`:
    [(key of the last network bucket drawn from, entries)]."""
    out, cur, cur_bytes, last = [], [], 0, None
    for key in sorted(parts):
        for e in parts[key]:
            nb = e[size_at]
            if cur and cur_bytes + nb > bucket_bytes:
                out.append((last, cur))
                cur, cur_bytes = [], 0
            cur.append(e)
            cur_bytes += nb
            last = key
    if cur:
        out.append((last, cur))
    return out


def _items(entries) -> list[Item]:
    """Item(tensor, box) of each (nbytes, tensor, box, parent box) entry of a share, without
    the frozen-dataclass __init__ (one per piece)."""
    out = []
    append = out.append
    new = _new
    for _, tensor, box, _ in entries:
        it = new(Item)
        d = it.__dict__
        d["tensor"] = tensor
        d["box"] = box
        append(it)
    return out


def _transfer(isz, key, src, dst, path, items: list, nbytes: int) -> Transfer:
    # Items sit back to back in the flat buffer. Largest element size first keeps every item's
    # byte offset a multiple of its element size (sizes are powers of two), as viewing a byte
    # buffer as a wider dtype requires: an fp32 item after a bf16 one could start at byte 2.
    if len({isz[it.tensor] for it in items}) > 1:
        items.sort(key=lambda it: -isz[it.tensor])
    return Transfer(key, src, dst, path, tuple(items), nbytes)


def plan(specs: Mapping[str, TensorSpec], src_domains: Optional[Sequence[Any]] = None,
         dst_domains: Optional[Sequence[Any]] = None, *, src_devices: Optional[Sequence[Any]] = None,
         dst_devices: Optional[Sequence[Any]] = None, n_src: Optional[int] = None,
         n_dst: Optional[int] = None, deadline: Optional[float] = None) -> Plan:
    """Plan a refit of `specs` (name -> TensorSpec).

    `src_domains[i]` / `dst_domains[j]` name the NVLink domain of source rank i / destination
    rank j (equal ids on both sides = one domain); without them every rank is its own domain.
    `*_devices` name devices the same way (equal ids = same device: a local copy). The number of
    ranks per side comes from the domain lists, else from `n_src`/`n_dst`, else the meshes.
    Past `deadline` (a `time.monotonic()` value) planning stops with PlanTimeout.
    """
    check_spec_set(specs)
    src_domains, dst_domains, src_devices, dst_devices = (
        None if v is None else tuple(v) for v in (src_domains, dst_domains, src_devices, dst_devices))
    n_src = _side_size("src", specs, src_domains, src_devices, n_src)
    n_dst = _side_size("dst", specs, dst_domains, dst_devices, n_dst)
    topo = Topology.make(n_src, n_dst, src_domains, dst_domains, src_devices, dst_devices)
    # Specs usually share their layout objects: remember what was planned per (shape, dtype,
    # layout objects, slot tables' ranks) so that each tensor costs a dict lookup. The specs
    # stay alive during the loop, so the ids are not reused; slot tables are keyed by their
    # rank tuples' identity (hashing them per tensor dominated planning at scale; recipes give
    # each tensor its own table but share the rank tuples). Where a slot sits matters to a
    # quantised spec's validation only, which is checked for every such spec.
    seen: dict = {}
    checked: set = set()                 # layouts and slot tables found valid (by identity)
    tensor_plans = []
    turns: dict = defaultdict(int)       # src layout -> tensors given a rotation so far
    # Planning allocates only acyclic objects (hundreds of thousands of moves at scale): the
    # cyclic collector would rescan the growing heap again and again for nothing.
    with gc_paused(keep=True):
        for i, (name, spec) in enumerate(specs.items()):
            if deadline is not None and not i % DEADLINE_EVERY:
                check_deadline(deadline, f"planning ({i} of {len(specs)} tensors planned)")
            ss, ds, quant = spec.src_slots, spec.dst_slots, spec.quant
            key = (spec.shape, spec.dtype, id(spec.src), id(spec.dst),
                   None if ss is None else id(ss.ranks), None if ds is None else id(ds.ranks),
                   quant and (quant, spec.source_dtype))
            tp = seen.get(key)
            try:
                if tp is None:
                    spec.validate(name, checked)
                    tp = seen[key] = plan_tensor(spec.signature, topo)
                elif quant is not None:
                    spec.validate(name, checked)      # where its slots sit
                if tp.rotations > 1:
                    # Small tensors leave some source replicas idle: rotate which ones work
                    # across the tensors sharing the source layout.
                    turn = turns[spec.src]
                    turns[spec.src] = turn + 1
                    if turn % tp.rotations:
                        tp = plan_tensor(spec.signature, topo, turn % tp.rotations)
            except PlanError as e:
                raise PlanError(f"{name!r}: {e}") from None
            tensor_plans.append(tp)
    return Plan(specs, topo, tensor_plans)


def check_spec_set(specs: Mapping[str, TensorSpec]) -> None:
    """Raise unless `specs` is a non-empty mapping of non-empty names to TensorSpecs."""
    if not isinstance(specs, Mapping):
        raise TypeError(f"specs must be a mapping of name -> TensorSpec, got {type(specs).__name__}")
    if not specs:
        raise ValueError("empty spec set: nothing to refit")
    for name, spec in specs.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"{name!r}: expected a TensorSpec, got {type(spec).__name__}")


class PlanTimeout(TimeoutError):
    """Planning ran past the refit's deadline."""


# Planning loops look at the clock once per this many tensors.
DEADLINE_EVERY = 256


def check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise PlanTimeout(f"the refit's deadline passed during {what}")


def _side_size(side, specs, domains, devices, n) -> int:
    top = -1
    seen_layouts = set()
    for name, spec in specs.items():
        lay = spec.src if side == "src" else spec.dst
        if id(lay) in seen_layouts:
            continue
        seen_layouts.add(id(lay))
        r = max(lay.mesh.ranks)
        if r > top:
            top, top_name = r, name
    n_from = f"n_{side}={n}"
    for given, what in ((domains, f"{side}_domains"), (devices, f"{side}_devices")):
        if given is not None:
            if n is not None and len(given) != n:
                raise ValueError(f"{what} has {len(given)} entries but {n_from}: give one entry "
                                 f"per {side} rank")
            n = len(given)
            n_from = f"{what} has {n}"
    if n is None:
        return top + 1
    if top >= n:
        raise ValueError(f"{top_name!r}: the {side} mesh uses rank {top}, but the {side} side "
                         f"has only {n} ranks (0..{n - 1})")
    return n
