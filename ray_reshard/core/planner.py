"""The refit planner: exact intersections, replica choice, domain de-duplication.

`plan()` turns named TensorSpecs plus the NVLink domain (and device) of every rank into a
`Plan`. Per tensor the plan is a list of `Move`s: a global box that goes from one endpoint to a
destination rank over one path. Tensors with equal signatures share one cached `TensorPlan`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Hashable, Mapping, Optional, Sequence

from .box import Box
from .spec import TensorSpec

LOCAL, DOMAIN, NETWORK = "local", "domain", "network"
PATHS = (LOCAL, DOMAIN, NETWORK)

# Pieces at least this large are split over several source replicas to spread the send load.
SPLIT_OVER_REPLICAS_BYTES = 256 * 1024


@dataclass(frozen=True)
class Endpoint:
    """One rank on one side: side is "src" or "dst"."""

    side: str
    rank: int

    def __repr__(self):
        return f"{self.side}{self.rank}"


@dataclass(frozen=True)
class Move:
    """`box` (global coordinates) goes from `src` to destination rank `dst` over `path`.

    `src` is a source rank, or a destination rank forwarding a piece it received over the network
    to the other replicas of its domain (`src.side == "dst"`).
    """

    src: Endpoint
    dst: int
    box: Box
    path: str


@dataclass(frozen=True)
class Topology:
    """Domain (NVLink island) and device of every rank on both sides.

    Equal domain ids on the two sides mean the same domain; equal device ids mean the same
    device (a move between them is a local copy).
    """

    src_domains: tuple
    dst_domains: tuple
    src_devices: tuple
    dst_devices: tuple

    @classmethod
    def make(cls, n_src: int, n_dst: int, src_domains=None, dst_domains=None,
             src_devices=None, dst_devices=None) -> "Topology":
        def fill(vals, n, default, what):
            if vals is None:
                return tuple(default(i) for i in range(n))
            vals = tuple(vals)
            if len(vals) != n:
                raise ValueError(f"{what} has {len(vals)} entries for {n} ranks")
            for v in vals:
                if not isinstance(v, Hashable):
                    raise TypeError(f"{what} entries must be hashable, got {v!r}")
            return vals
        return cls(fill(src_domains, n_src, lambda i: ("src", i), "src_domains"),
                   fill(dst_domains, n_dst, lambda i: ("dst", i), "dst_domains"),
                   fill(src_devices, n_src, lambda i: ("src", i), "src_devices"),
                   fill(dst_devices, n_dst, lambda i: ("dst", i), "dst_devices"))

    @property
    def n_src(self) -> int:
        return len(self.src_domains)

    @property
    def n_dst(self) -> int:
        return len(self.dst_domains)


@dataclass(frozen=True)
class TensorStats:
    """Bytes of one tensor's plan; all figures in destination-dtype bytes."""

    network_bytes: int
    domain_bytes: int
    local_bytes: int
    min_network_bytes: int
    gather_broadcast_bytes: int
    send_bytes: tuple[tuple[int, int], ...]      # (src rank, network bytes it sends)
    recv_bytes: tuple[tuple[int, int], ...]      # (dst rank, network bytes it receives)


@dataclass(frozen=True)
class TensorPlan:
    """The moves of one tensor signature under one topology."""

    shape: tuple[int, ...]
    itemsize: int
    moves: tuple[Move, ...]
    stats: TensorStats

    def moves_for(self, ep: Endpoint) -> tuple[Move, ...]:
        """Moves that `ep` sends or receives (cached per endpoint)."""
        idx = self.__dict__.get("_by_ep")
        if idx is None:
            idx = defaultdict(list)
            for m in self.moves:
                idx[m.src].append(m)
                if m.src != Endpoint("dst", m.dst):
                    idx[Endpoint("dst", m.dst)].append(m)
            idx = {k: tuple(v) for k, v in idx.items()}
            object.__setattr__(self, "_by_ep", idx)
        return idx.get(ep, ())


def _classes(boxes: Mapping[int, Box]) -> list[tuple[Box, tuple[int, ...]]]:
    """Group ranks holding the same box; drop empty boxes. Deterministic order."""
    groups: dict[Box, list[int]] = {}
    for r in sorted(boxes):
        b = boxes[r]
        if b.empty:
            continue
        groups.setdefault(b, []).append(r)
    return [(b, tuple(rs)) for b, rs in groups.items()]


@lru_cache(maxsize=1 << 14)
def plan_tensor(spec_signature: tuple, topo: Topology) -> TensorPlan:
    """Plan one tensor signature (see TensorSpec.signature) on a topology. Cached."""
    shape, itemsize, src_layout, dst_layout = spec_signature
    src_classes = _classes(src_layout.boxes(shape))
    dst_classes = _classes(dst_layout.boxes(shape))
    sdom, ddom, sdev, ddev = topo.src_domains, topo.dst_domains, topo.src_devices, topo.dst_devices
    load: dict[int, int] = defaultdict(int)
    moves: list[Move] = []

    def pick(holders: Sequence[int]) -> int:
        return min(holders, key=lambda h: (load[h], h))

    for dbox, replicas in dst_classes:
        by_domain: dict[Any, list[int]] = {}
        for r in replicas:
            by_domain.setdefault(ddom[r], []).append(r)
        for sbox, holders in src_classes:
            x = dbox.intersect(sbox)
            if x is None:
                continue
            xbytes = x.numel * itemsize
            far_domains = []
            for dom, rs in by_domain.items():
                near = [h for h in holders if sdom[h] == dom]
                if not near:
                    far_domains.append(rs)
                    continue
                for r in rs:
                    same = [h for h in near if sdev[h] == ddev[r]]
                    if same:
                        moves.append(Move(Endpoint("src", same[0]), r, x, LOCAL))
                    else:
                        h = pick(near)
                        load[h] += xbytes
                        moves.append(Move(Endpoint("src", h), r, x, DOMAIN))
            if not far_domains:
                continue
            splits = [x.split(len(rs)) for rs in far_domains]
            n_pieces = sum(len(s) for s in splits)
            for rs, pieces in zip(far_domains, splits):
                for receiver, piece in zip(rs, pieces):
                    pbytes = piece.numel * itemsize
                    fan = len(holders) // n_pieces if pbytes >= SPLIT_OVER_REPLICAS_BYTES else 1
                    for sub in piece.split(max(1, fan)):
                        h = pick(holders)
                        load[h] += sub.numel * itemsize
                        moves.append(Move(Endpoint("src", h), receiver, sub, NETWORK))
                        for other in rs:
                            if other != receiver:
                                path = LOCAL if ddev[other] == ddev[receiver] else DOMAIN
                                moves.append(Move(Endpoint("dst", receiver), other, sub, path))
    moves_t = tuple(moves)
    _verify_cover(shape, dst_layout, moves_t)
    return TensorPlan(shape, itemsize, moves_t,
                      _stats(shape, itemsize, src_layout, dst_layout, topo, moves_t))


class PlanError(ValueError):
    """The planner found the plan inconsistent (a bug or an impossible layout)."""


def _verify_cover(shape, dst_layout, moves: Sequence[Move]) -> None:
    """Check that the moves into every destination rank tile its box exactly once."""
    into: dict[int, list[Box]] = defaultdict(list)
    for m in moves:
        into[m.dst].append(m.box)
    for r, box in dst_layout.boxes(shape).items():
        got = into.pop(r, [])
        if box.empty:
            if got:
                raise PlanError(f"destination rank {r} holds nothing but is sent {got}")
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


def _stats(shape, itemsize, src_layout, dst_layout, topo: Topology,
           moves: Sequence[Move]) -> TensorStats:
    by_path = defaultdict(int)
    send = defaultdict(int)
    recv = defaultdict(int)
    for m in moves:
        nb = m.box.numel * itemsize
        by_path[m.path] += nb
        if m.path == NETWORK:
            send[m.src.rank] += nb
            recv[m.dst] += nb
    full = 1
    for s in shape:
        full *= s
    full *= itemsize
    src_boxes = src_layout.boxes(shape)
    gather = sum(full - b.numel * itemsize for b in src_boxes.values())
    n_dst_holding = sum(1 for b in dst_layout.boxes(shape).values() if not b.empty)
    return TensorStats(
        network_bytes=by_path[NETWORK], domain_bytes=by_path[DOMAIN], local_bytes=by_path[LOCAL],
        min_network_bytes=min_network_bytes(shape, itemsize, src_layout, dst_layout, topo),
        gather_broadcast_bytes=gather + n_dst_holding * full,
        send_bytes=tuple(sorted(send.items())), recv_bytes=tuple(sorted(recv.items())))


def min_network_bytes(shape, itemsize, src_layout, dst_layout, topo: Topology) -> int:
    """Lower bound, computed on the grid of all shard boundaries, independently of any plan.

    For each grid cell: its bytes times the number of destination domains that need the cell
    and hold no source copy of it.
    """
    import numpy as np

    if len(shape) == 0:
        cells_lo = np.zeros((1, 0), dtype=np.int64)
        cell_bytes = np.array([itemsize], dtype=np.int64)
    else:
        cuts = []
        for d, n in enumerate(shape):
            c = {0, n}
            for lay in (src_layout, dst_layout):
                for b in lay.boxes(shape).values():
                    c.add(b.offsets[d])
                    c.add(b.offsets[d] + b.sizes[d])
            cuts.append(np.array(sorted(c), dtype=np.int64))
        los = np.meshgrid(*[c[:-1] for c in cuts], indexing="ij")
        lens = np.meshgrid(*[np.diff(c) for c in cuts], indexing="ij")
        cells_lo = np.stack([a.reshape(-1) for a in los], axis=1)
        cell_bytes = np.prod(np.stack([a.reshape(-1) for a in lens], axis=1), axis=1) * itemsize

    def holders(layout, domains):
        """(cells x domains) bool: the domain has a rank whose box contains the cell."""
        dom_ids = {d: i for i, d in enumerate(dict.fromkeys(domains))}
        out = np.zeros((len(cells_lo), len(dom_ids)), dtype=bool)
        for r, b in layout.boxes(shape).items():
            if b.empty:
                continue
            lo = np.array(b.offsets, dtype=np.int64)
            hi = lo + np.array(b.sizes, dtype=np.int64)
            inside = np.all((cells_lo >= lo) & (cells_lo < hi), axis=1)
            out[:, dom_ids[domains[r]]] |= inside
        return out, dom_ids

    need, need_ids = holders(dst_layout, topo.dst_domains)
    have, have_ids = holders(src_layout, topo.src_domains)
    total = 0
    for dom, j in need_ids.items():
        missing = need[:, j].copy()
        if dom in have_ids:
            missing &= ~have[:, have_ids[dom]]
        total += int(cell_bytes[missing].sum())
    return total
