"""The Plan: every tensor's moves, the statistics, and the per-rank schedule of buckets."""
from __future__ import annotations

import gc
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping, Optional, Sequence

from .box import Box
from .planner import (DOMAIN, LOCAL, NETWORK, Endpoint, Move, PlanError, TensorPlan, Topology,
                      plan_tensor)
from .spec import TensorSpec

DEFAULT_BUCKET_BYTES = 64 << 20


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
        self.specs: tuple[TensorSpec, ...] = tuple(specs[n] for n in self.names)
        self.topology = topology
        self.tensor_plans: tuple[TensorPlan, ...] = tuple(tensor_plans)

    def __len__(self) -> int:
        return len(self.names)

    @cached_property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @cached_property
    def _distinct(self) -> list[tuple[TensorPlan, int]]:
        """Each distinct TensorPlan with the number of tensors that use it."""
        counts: dict[int, list] = {}
        for tp in self.tensor_plans:
            c = counts.get(id(tp))
            if c is None:
                counts[id(tp)] = [tp, 1]
            else:
                c[1] += 1
        return [(tp, n) for tp, n in counts.values()]

    @cached_property
    def stats(self) -> PlanStats:
        tot = defaultdict(int)
        distinct = self._distinct
        for tp, n in distinct:
            s = tp.stats
            numel = 1
            for d in tp.shape:
                numel *= d
            tot["total"] += n * numel * tp.itemsize
            tot["network"] += n * s.network_bytes
            tot["domain"] += n * s.domain_bytes
            tot["local"] += n * s.local_bytes
            tot["min"] += n * s.min_network_bytes
            tot["gb"] += n * s.gather_broadcast_bytes
            tot["moves"] += n * len(tp.moves)
        send, recv = self.send_bytes_by_rank, self.recv_bytes_by_rank
        return PlanStats(
            total_bytes=tot["total"], network_bytes=tot["network"], domain_bytes=tot["domain"],
            local_bytes=tot["local"], min_network_bytes=tot["min"],
            gather_broadcast_bytes=tot["gb"], max_send_bytes=max(send.values(), default=0),
            max_recv_bytes=max(recv.values(), default=0), n_tensors=len(self.names),
            n_moves=tot["moves"], n_signatures=len(distinct))

    @cached_property
    def send_bytes_by_rank(self) -> dict[int, int]:
        out = defaultdict(int)
        for tp, n in self._distinct:
            for r, b in tp.stats.send_bytes:
                out[r] += n * b
        return dict(out)

    @cached_property
    def recv_bytes_by_rank(self) -> dict[int, int]:
        out = defaultdict(int)
        for tp, n in self._distinct:
            for r, b in tp.stats.recv_bytes:
                out[r] += n * b
        return dict(out)

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

    def schedule(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> "Schedule":
        """Buckets of at most `bucket_bytes` in one deadlock-free global order (cached)."""
        cache = self.__dict__.setdefault("_schedules", {})
        if bucket_bytes not in cache:
            cache[bucket_bytes] = build_schedule(self, bucket_bytes)
        return cache[bucket_bytes]


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

    A forwarded piece (a destination passing a network piece on inside its domain) is packed
    into a bucket that sorts right after the network bucket that delivered it, so the domain
    exchange of bucket k overlaps the network transfer of bucket k+1.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    topo = plan.topology
    n_src = topo.n_src
    world = n_src + topo.n_dst

    def gid(ep: Endpoint) -> int:
        return ep.rank if ep.side == "src" else n_src + ep.rank

    pair_items: dict[tuple, list[Item]] = defaultdict(list)
    # (receiver dst rank, tensor) -> forwarded moves of pieces it received over the network
    forwards: dict[tuple, list[Move]] = defaultdict(list)
    for ti, (spec, tp) in enumerate(zip(plan.specs, plan.tensor_plans)):
        max_numel = max(1, bucket_bytes // spec.itemsize)
        for m in tp.moves:
            if m.src.side == "dst":
                forwards[(m.src.rank, ti)].append(m)
                continue
            for chunk in m.box.chunks(max_numel):
                pair_items[(m.src, m.dst, m.path)].append(Item(ti, chunk))

    transfers: list[Transfer] = []
    for (src, dst, path), items in pair_items.items():
        rot = (gid(Endpoint("dst", dst)) - gid(src)) % world
        for k, bucket in enumerate(_pack(plan, items, bucket_bytes)):
            key = (k, _PATH_ORDER[path], rot, gid(src), dst, 0, -1)
            transfers.append(_transfer(plan, key, src, dst, path, bucket))
            if path != NETWORK:
                continue
            fwd: dict[tuple, list[Item]] = defaultdict(list)
            for it in bucket:
                for f in _forwards_of(plan, forwards, dst, it):
                    fwd[(f.dst, f.path)].append(Item(it.tensor, f.box))
            for (target, fpath), fitems in sorted(fwd.items()):
                fkey = key[:5] + (1, target)
                transfers.append(_transfer(plan, fkey, Endpoint("dst", dst), target, fpath,
                                           tuple(fitems)))
    return Schedule(transfers, bucket_bytes)


def _forwards_of(plan: Plan, forwards, receiver: int, item: Item) -> list[Move]:
    """Forwarded moves covering `item` (a chunk of a network piece into `receiver`)."""
    return [Move(m.src, m.dst, item.box, m.path)
            for m in forwards.get((receiver, item.tensor), ()) if m.box.contains(item.box)]


def _pack(plan: Plan, items: list[Item], bucket_bytes: int) -> list[tuple[Item, ...]]:
    buckets, cur, cur_bytes = [], [], 0
    for it in items:
        nb = it.box.numel * plan.specs[it.tensor].itemsize
        if cur and cur_bytes + nb > bucket_bytes:
            buckets.append(tuple(cur))
            cur, cur_bytes = [], 0
        cur.append(it)
        cur_bytes += nb
    if cur:
        buckets.append(tuple(cur))
    return buckets


def _transfer(plan, key, src, dst, path, items) -> Transfer:
    # Items sit back to back in the flat buffer. Largest element size first keeps every item's
    # byte offset a multiple of its element size (sizes are powers of two), as viewing a byte
    # buffer as a wider dtype requires: an fp32 item after a bf16 one could start at byte 2.
    specs = plan.specs
    if len({specs[it.tensor].itemsize for it in items}) > 1:
        items = sorted(items, key=lambda it: -specs[it.tensor].itemsize)
    nbytes = sum(it.box.numel * specs[it.tensor].itemsize for it in items)
    return Transfer(key, src, dst, path, tuple(items), nbytes)


def plan(specs: Mapping[str, TensorSpec], src_domains: Optional[Sequence[Any]] = None,
         dst_domains: Optional[Sequence[Any]] = None, *, src_devices: Optional[Sequence[Any]] = None,
         dst_devices: Optional[Sequence[Any]] = None, n_src: Optional[int] = None,
         n_dst: Optional[int] = None) -> Plan:
    """Plan a refit of `specs` (name -> TensorSpec).

    `src_domains[i]` / `dst_domains[j]` name the NVLink domain of source rank i / destination
    rank j (equal ids on both sides = one domain); without them every rank is its own domain.
    `*_devices` name devices the same way (equal ids = same device: a local copy). The number of
    ranks per side comes from the domain lists, else from `n_src`/`n_dst`, else the meshes.
    """
    if not isinstance(specs, Mapping):
        raise TypeError(f"specs must be a mapping of name -> TensorSpec, got {type(specs).__name__}")
    if not specs:
        raise ValueError("empty spec set: nothing to refit")
    for name, spec in specs.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"{name!r}: expected a TensorSpec, got {type(spec).__name__}")
    src_domains, dst_domains, src_devices, dst_devices = (
        None if v is None else tuple(v) for v in (src_domains, dst_domains, src_devices, dst_devices))
    n_src = _side_size("src", specs, src_domains, src_devices, n_src)
    n_dst = _side_size("dst", specs, dst_domains, dst_devices, n_dst)
    topo = Topology.make(n_src, n_dst, src_domains, dst_domains, src_devices, dst_devices)
    # Specs usually share their layout objects: remember what was planned per (shape, dtype,
    # layout objects, slots) so that each tensor costs a dict lookup. The specs stay alive
    # during the loop, so the ids are not reused.
    seen: dict = {}
    tensor_plans = []
    turns: dict = defaultdict(int)       # src layout -> tensors given a rotation so far
    # Planning allocates only acyclic objects (hundreds of thousands of moves at scale): the
    # cyclic collector would rescan the growing heap again and again for nothing.
    with _gc_paused():
        for name, spec in specs.items():
            key = (spec.shape, spec.dtype, id(spec.src), id(spec.dst), spec.src_slots,
                   spec.dst_slots)
            tp = seen.get(key)
            try:
                if tp is None:
                    spec.validate(name)
                    tp = seen[key] = plan_tensor(spec.signature, topo)
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


@contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
