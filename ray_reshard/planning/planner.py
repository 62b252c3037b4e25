"""The refit planner: exact intersections, replica choice, domain de-duplication.

`plan()` turns named TensorSpecs plus the NVLink domain (and device) of every rank into a
`Plan`. Per tensor the plan is a list of `Move`s: a global box that goes from one endpoint to a
destination rank over one path. Tensors with equal signatures share one cached `TensorPlan`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ..layout.box import Box
from ..layout.layout import Layout, LayoutUnion, rank_boxes
from ..layout.mesh import Mesh

LOCAL, DOMAIN, NETWORK = "local", "domain", "network"
PATHS = (LOCAL, DOMAIN, NETWORK)

# Pieces at least this large are split over several source replicas to spread the send load.
SPLIT_OVER_REPLICAS_BYTES = 256 * 1024
# A region smaller than this crosses into a domain whole, to one of the ranks there that need
# it (which one rotates across the tensors laid out alike), instead of split over all of them:
# splitting over k ranks costs k network items and k * (k - 1) forwarded ones per region, and
# at model scale those items, not the bytes, set the time.
WHOLE_BELOW_BYTES = 4 << 20


@dataclass(frozen=True)
class Endpoint:
    """One rank on one side: side is "src" or "dst"."""

    side: str
    rank: int

    def __repr__(self):
        return f"{self.side}{self.rank}"


@dataclass(frozen=True, slots=True)
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
        topo = cls(fill(src_domains, n_src, lambda i: ("src", i), "src_domains"),
                   fill(dst_domains, n_dst, lambda i: ("dst", i), "dst_domains"),
                   fill(src_devices, n_src, lambda i: ("src", i), "src_devices"),
                   fill(dst_devices, n_dst, lambda i: ("dst", i), "dst_devices"))
        # Reuse an equal topology made before: the plan cache then compares keys by identity
        # instead of comparing four tuples of every rank's ids on each lookup.
        known = _TOPOLOGIES.get(topo)
        if known is not None:
            return known
        if len(_TOPOLOGIES) >= 64:
            _TOPOLOGIES.clear()
        _TOPOLOGIES[topo] = topo
        return topo

    def __hash__(self):
        # Cached: the topology keys the per-tensor plan cache once per tensor.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.src_domains, self.dst_domains, self.src_devices, self.dst_devices))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, Topology):
            return NotImplemented
        return (self.src_domains == other.src_domains and self.dst_domains == other.dst_domains
                and self.src_devices == other.src_devices
                and self.dst_devices == other.dst_devices)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @property
    def n_src(self) -> int:
        return len(self.src_domains)

    @property
    def n_dst(self) -> int:
        return len(self.dst_domains)


_TOPOLOGIES: dict = {}


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


class TensorPlan:
    """The moves of one tensor signature under one topology.

    A plan renamed from a canonical one (see `plan_tensor`) keeps that plan and the two rank
    tuples and builds its own `moves` and `stats` only when asked: pipeline stages and expert
    owners share one canonical plan, and most renamed plans are shipped, not walked. A process
    takes its share of the moves with `touching` / `into`, renaming only those.
    """

    __slots__ = ("shape", "itemsize", "_moves", "_stats", "_rotations", "_canon", "_sranks",
                 "_dranks", "_by_ep", "_compact", "_index", "_arrays", "_pieces", "_n_pairs")

    def __init__(self, shape: tuple[int, ...], itemsize: int, moves: tuple[Move, ...],
                 stats: TensorStats, rotations: int = 1):
        self.shape = shape
        self.itemsize = itemsize
        self._moves = moves
        self._stats = stats
        self._rotations = rotations
        self._canon = self._sranks = self._dranks = None
        self._by_ep = self._compact = self._index = self._arrays = self._pieces = None
        self._n_pairs = None

    @classmethod
    def renamed(cls, canon: "TensorPlan", sranks: tuple, dranks: tuple) -> "TensorPlan":
        """`canon` with mesh position i renamed to the rank at that position, on each side."""
        tp = cls(canon.shape, canon.itemsize, None, None, canon._rotations)
        tp._canon, tp._sranks, tp._dranks = canon, sranks, dranks
        return tp

    @property
    def moves(self) -> tuple[Move, ...]:
        moves = self._moves
        if moves is None:
            if self._canon is None:          # shipped as columns
                senders, sidx, dsts, boxes, paths = self._compact
                moves = tuple(map(_move, map(senders.__getitem__, sidx), dsts, boxes, paths))
            else:
                senders, sidx, dsts, boxes, paths = self._canon.compact
                real = [self._rename_sender(e) for e in senders]
                moves = tuple(map(_move, map(real.__getitem__, sidx),
                                  map(self._dranks.__getitem__, dsts), boxes, paths))
            self._moves = moves
        return moves

    @property
    def stats(self) -> TensorStats:
        st = self._stats
        if st is None:
            c = self._canon.stats
            send, recv = self.network_bytes_by_rank()
            st = self._stats = TensorStats(
                network_bytes=c.network_bytes, domain_bytes=c.domain_bytes,
                local_bytes=c.local_bytes, min_network_bytes=c.min_network_bytes,
                gather_broadcast_bytes=c.gather_broadcast_bytes,
                send_bytes=tuple(sorted(send)), recv_bytes=tuple(sorted(recv)))
        return st

    def network_bytes_by_rank(self) -> tuple[list, list]:
        """((src rank, network bytes it sends), ...) and ((dst rank, bytes it receives), ...),
        in no particular order."""
        if self._canon is None:
            return self._stats.send_bytes, self._stats.recv_bytes
        c, s, d = self._canon.stats, self._sranks, self._dranks
        return [(s[i], b) for i, b in c.send_bytes], [(d[i], b) for i, b in c.recv_bytes]

    def network_bytes_arrays(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """`network_bytes_by_rank` as ((src ranks, bytes), (dst ranks, bytes)) int64 arrays."""
        if self._canon is None:
            arrays = self._arrays
            if arrays is None:
                st = self.stats
                arrays = self._arrays = tuple(
                    (np.array([r for r, _ in t], dtype=np.int64),
                     np.array([b for _, b in t], dtype=np.int64))
                    for t in (st.send_bytes, st.recv_bytes))
            return arrays
        (sp, sb), (dp, db) = self._canon.network_bytes_arrays()
        return (_rank_array(self._sranks)[sp], sb), (_rank_array(self._dranks)[dp], db)

    def n_network_pairs(self) -> int:
        """How many network pairs a source rank sends in (those of `network_pieces`)."""
        canon = self._canon if self._canon is not None else self
        if canon._n_pairs is None:
            senders, sidx, dsts, _, paths = canon.compact
            net = {j for j, e in enumerate(senders) if e.side == "src"}
            canon._n_pairs = len({(j, d) for j, d, path in zip(sidx, dsts, paths)
                                  if path == NETWORK and j in net})
        return canon._n_pairs

    def network_pieces(self, max_numel: int, itemsize: int) -> list[tuple[int, int, tuple]]:
        """Per network pair a source rank sends: (source rank, destination rank, the byte
        sizes of its moves' pieces), pieces as the schedule cuts them (a box over `max_numel`
        elements into `Box.chunks`), in move order; pairs in order of their first move."""
        canon = self._canon if self._canon is not None else self
        cache = canon._pieces
        if cache is None:
            cache = canon._pieces = {}
        pieces = cache.get((max_numel, itemsize))
        if pieces is None:
            senders, sidx, dsts, boxes, paths = canon.compact
            by_pair: dict = {}
            for j, d, box, path in zip(sidx, dsts, boxes, paths):
                e = senders[j]
                if path != NETWORK or e.side != "src":
                    continue
                n = box.numel
                sizes = by_pair.setdefault((e.rank, d), [])
                if n <= max_numel:
                    sizes.append(n * itemsize)
                else:
                    sizes += [c.numel * itemsize for c in box.chunks(max_numel)]
            pieces = cache[(max_numel, itemsize)] = [(s, d, tuple(v))
                                                     for (s, d), v in by_pair.items()]
        if self._canon is None:
            return pieces
        sr, dr = self._sranks, self._dranks
        return [(sr[s], dr[d], sizes) for s, d, sizes in pieces]

    @property
    def totals(self) -> TensorStats:
        """Statistics whose byte totals are this plan's (for a renamed plan, its canonical
        plan's, with per-rank figures by mesh position): cheaper than `stats`."""
        return self._stats if self._canon is None else self._canon.stats

    @property
    def n_moves(self) -> int:
        if self._moves is not None:
            return len(self._moves)
        return self._canon.n_moves if self._canon is not None else len(self._compact[1])

    @property
    def rotations(self) -> int:
        """How many rotations give different choices of source replica or receiving rank (1: no
        choice left)."""
        return self._rotations

    @property
    def compact(self) -> tuple:
        """The moves as columns (see `_compact`); cached."""
        c = self._compact
        if c is None:
            c = self._compact = _compact(self.moves)
        return c

    def _rename_sender(self, e: Endpoint) -> Endpoint:
        return _endpoint(e.side, (self._sranks if e.side == "src" else self._dranks)[e.rank])

    def _move_index(self) -> tuple[dict, dict]:
        """Move positions by sender and by receiving destination rank (of this plan's own
        moves; for a renamed plan, of its canonical plan's)."""
        idx = self._index
        if idx is None:
            senders, sidx, dsts, _, _ = self.compact
            by_sender: dict = defaultdict(list)
            by_dst: dict = defaultdict(list)
            for i, (s, d) in enumerate(zip(sidx, dsts)):
                by_sender[senders[s]].append(i)
                by_dst[d].append(i)
            idx = self._index = (dict(by_sender), dict(by_dst))
        return idx

    def _select(self, src_ranks, dst_ranks, senders_too: bool) -> list[Move]:
        """Moves into `dst_ranks` (and with `senders_too`, moves sent by `src_ranks` or
        forwarded by `dst_ranks`), in move order, renamed."""
        canon = self._canon if self._canon is not None else self
        if self._canon is None:
            spos, dpos = src_ranks, dst_ranks
        else:
            sp, dp = _positions(self._sranks), _positions(self._dranks)
            spos = [sp[r] for r in src_ranks if r in sp]
            dpos = [dp[r] for r in dst_ranks if r in dp]
        by_sender, by_dst = canon._move_index()
        picked: list = []
        for p in dpos:
            picked += by_dst.get(p, ())
        if senders_too:
            for side, ps in (("src", spos), ("dst", dpos)):
                for p in ps:
                    picked += by_sender.get(_endpoint(side, p), ())
        if not picked:
            return []
        picked = sorted(set(picked))
        if self._moves is not None:
            moves = self._moves
            return [moves[i] for i in picked]
        senders, sidx, dsts, boxes, paths = canon.compact
        if self._canon is None:
            return [_move(senders[sidx[i]], dsts[i], boxes[i], paths[i]) for i in picked]
        real: dict = {}
        for i in picked:
            j = sidx[i]
            if j not in real:
                real[j] = self._rename_sender(senders[j])
        dr = self._dranks
        return [_move(real[sidx[i]], dr[dsts[i]], boxes[i], paths[i]) for i in picked]

    def touching(self, src_ranks, dst_ranks) -> list[Move]:
        """The moves, in order, that a process holding source ranks `src_ranks` and
        destination ranks `dst_ranks` sends, forwards or receives."""
        return self._select(src_ranks, dst_ranks, True)

    def into(self, dst_ranks) -> list[Move]:
        """The moves, in order, that destination ranks `dst_ranks` receive."""
        return self._select((), dst_ranks, False)

    def moves_for(self, ep: Endpoint) -> tuple[Move, ...]:
        """Moves that `ep` sends or receives (cached per endpoint)."""
        idx = self._by_ep
        if idx is None:
            idx = defaultdict(list)
            for m in self.moves:
                idx[m.src].append(m)
                if m.src != Endpoint("dst", m.dst):
                    idx[Endpoint("dst", m.dst)].append(m)
            idx = self._by_ep = {k: tuple(v) for k, v in idx.items()}
        return idx.get(ep, ())

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, TensorPlan):
            return NotImplemented
        return (self.shape == other.shape and self.itemsize == other.itemsize
                and self.stats == other.stats and self.moves == other.moves)

    def __hash__(self):
        return hash((self.shape, self.itemsize, self.stats))

    def __repr__(self) -> str:
        return (f"TensorPlan(shape={self.shape}, itemsize={self.itemsize}, "
                f"{len(self.moves)} moves, {self.stats})")

    def __reduce__(self):
        # A renamed plan ships as its canonical plan (pickled once per plan: the pickler's
        # memo) and two rank tuples. A canonical plan ships its moves as columns instead of one
        # object per move.
        if self._canon is not None and self._moves is None:
            return (TensorPlan.renamed, (self._canon, self._sranks, self._dranks))
        senders, sidx, dsts, boxes, paths = self.compact
        if isinstance(boxes, _Boxes):
            offsets, sizes = boxes.offsets, boxes.sizes
        else:
            offsets = tuple([b.offsets for b in boxes])
            sizes = tuple([b.sizes for b in boxes])
        return (_restore_plan, (self.shape, self.itemsize, senders, sidx, dsts, offsets, sizes,
                                paths, self.stats, self.rotations))


@lru_cache(maxsize=1 << 12)
def _rank_array(ranks: tuple) -> np.ndarray:
    return np.asarray(ranks, dtype=np.int64)


@lru_cache(maxsize=1 << 12)
def _positions(ranks: tuple) -> dict:
    """rank -> its position in `ranks`."""
    return {r: i for i, r in enumerate(ranks)}


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


@lru_cache(maxsize=1 << 14)
def plan_tensor(spec_signature: tuple, topo: Topology, rotation: int = 0) -> TensorPlan:
    """Plan one tensor signature (see TensorSpec.signature) on a topology. Cached.

    The plan depends on the ranks only through their mesh positions and the equalities between
    their domains and devices. So the planning itself runs once per *canonical* problem (ranks
    renamed to mesh positions, domains and devices to first-appearance numbers), and the result
    is renamed back. Pipeline stages or expert owners that differ only by which ranks they use
    share one canonical plan.

    `rotation` shifts which source replica wins a tie in load. When a tensor has fewer pieces
    than source replicas, some replicas send nothing; `plan()` then gives the tensors laid out
    alike successive rotations (see `TensorPlan.rotations`) so the load spreads across tensors.
    """
    shape, itemsize, src_layout, dst_layout = spec_signature
    sranks, dranks = src_layout.mesh.ranks, dst_layout.mesh.ranks
    canon_topo = _canonical_topology(src_layout.mesh, dst_layout.mesh, topo)
    canon = _canonical_plan(shape, itemsize, *_layout_key(src_layout), *_layout_key(dst_layout),
                            canon_topo,
                            rotation % _rotations_of(shape, itemsize, src_layout, dst_layout,
                                                     canon_topo) if rotation else 0)
    return _rename(canon, sranks, dranks)


def _layout_key(layout) -> tuple:
    """(mesh shape, placements) of a layout, rank ids left out; for a LayoutUnion, each
    part's, tagged "union" (its canonical parts take consecutive positions, part by part)."""
    if type(layout) is LayoutUnion:
        return (("union",) + tuple([p.mesh.shape for p in layout.parts]),
                tuple([p.placements for p in layout.parts]))
    return layout.mesh.shape, layout.placements


def plan_tensor_direct(spec_signature: tuple, topo: Topology, rotation: int = 0) -> TensorPlan:
    """What `plan_tensor` computes, the straightforward way: planned on the signature's own
    ranks and topology (no canonical problem, no renaming, no caches), its cover verified and
    its statistics computed from these moves. The reference the shared path is checked
    against; for meshes that list their ranks in increasing order the two are identical (tie
    breaks follow rank order here and mesh order there)."""
    shape, itemsize, src_layout, dst_layout = spec_signature
    _check_ranks("src", src_layout.mesh.ranks, topo.n_src)
    _check_ranks("dst", dst_layout.mesh.ranks, topo.n_dst)
    moves, rotations = _plan_moves(shape, itemsize, src_layout, dst_layout, topo, 0)
    if rotation % rotations:
        moves, _ = _plan_moves(shape, itemsize, src_layout, dst_layout, topo,
                               rotation % rotations)
    _verify_cover(shape, dst_layout, moves)
    return TensorPlan(shape, itemsize, moves,
                      _stats(shape, itemsize, src_layout, dst_layout, topo, moves), rotations)


def _rotations_of(shape, itemsize, src_layout, dst_layout, canon_topo) -> int:
    return _canonical_plan(shape, itemsize, *_layout_key(src_layout), *_layout_key(dst_layout),
                           canon_topo, 0).rotations


def _canonical_topology(src_mesh: Mesh, dst_mesh: Mesh, topo: Topology) -> Topology:
    """Domains and devices of the two meshes' ranks (in mesh order), as canonical labels.

    Each side numbers its domain (device) ids 0, 1, ... by first appearance in mesh order; a
    destination id that is not also a source id becomes -1, -2, ... instead, and one that is a
    source id takes that id's label. Equal problems up to renaming get equal topologies.
    """
    sdom, sdev, sdom_of, sdev_of = _side_labels(src_mesh, topo, "src")
    ddom, ddev, ddom_of, ddev_of = _side_labels(dst_mesh, topo, "dst")
    return Topology(sdom, _link(ddom, ddom_of, sdom_of), sdev, _link(ddev, ddev_of, sdev_of))


def _link(labels: tuple, own: dict, other: dict) -> tuple:
    """Destination labels: -(first-appearance number + 1), or the source label of the same id."""
    shared = own.keys() & other.keys()
    if not shared:
        return labels
    remap = {own[v]: other[v] for v in shared}
    return tuple([remap.get(x, x) for x in labels])


@lru_cache(maxsize=1 << 12)
def _side_labels(mesh: Mesh, topo: Topology, side: str):
    """First-appearance labels of the domains and devices of `mesh`'s ranks on `side`."""
    ranks = mesh.ranks
    _check_ranks(side, ranks, topo.n_src if side == "src" else topo.n_dst)
    domains = topo.src_domains if side == "src" else topo.dst_domains
    devices = topo.src_devices if side == "src" else topo.dst_devices
    dom_of: dict = {}
    dev_of: dict = {}
    if side == "src":
        dom = tuple([dom_of.setdefault(domains[r], len(dom_of)) for r in ranks])
        dev = tuple([dev_of.setdefault(devices[r], len(dev_of)) for r in ranks])
    else:
        dom = tuple([dom_of.setdefault(domains[r], -1 - len(dom_of)) for r in ranks])
        dev = tuple([dev_of.setdefault(devices[r], -1 - len(dev_of)) for r in ranks])
    return dom, dev, dom_of, dev_of


def _check_ranks(side: str, ranks: Sequence[int], n: int) -> None:
    top = max(ranks)
    if top >= n:
        raise PlanError(f"the {side} mesh uses rank {top}, but the topology has only {n} {side} "
                        f"ranks (0..{n - 1})")


@lru_cache(maxsize=256)
def _canonical_layout(mesh_shape: tuple, placements: tuple):
    if mesh_shape and mesh_shape[0] == "union":
        parts, start = [], 0
        for shape, pls in zip(mesh_shape[1:], placements):
            parts.append(Layout(Mesh.from_shape(shape, start=start), pls))
            start += parts[-1].mesh.size
        return LayoutUnion(parts)
    return Layout(Mesh.from_shape(mesh_shape), placements)


@lru_cache(maxsize=1 << 12)
def _canonical_plan(shape, itemsize, src_mesh_shape, src_placements, dst_mesh_shape,
                    dst_placements, topo: Topology, rotation: int) -> TensorPlan:
    """The plan over ranks 0..n-1 (mesh positions), verified."""
    src_layout = _canonical_layout(src_mesh_shape, src_placements)
    dst_layout = _canonical_layout(dst_mesh_shape, dst_placements)
    moves, rotations = _plan_moves(shape, itemsize, src_layout, dst_layout, topo, rotation)
    _verify_cover(shape, dst_layout, moves)
    return TensorPlan(shape, itemsize, moves,
                      _stats(shape, itemsize, src_layout, dst_layout, topo, moves), rotations)


_new = object.__new__


_set_src, _set_dst = Move.src.__set__, Move.dst.__set__
_set_box, _set_path = Move.box.__set__, Move.path.__set__


def _move(src: Endpoint, dst: int, box: Box, path: str) -> Move:
    """Move(src, dst, box, path) without the frozen-dataclass __init__ (hot path)."""
    m = _new(Move)
    _set_src(m, src)
    _set_dst(m, dst)
    _set_box(m, box)
    _set_path(m, path)
    return m


_ENDPOINTS: dict = {}


def _endpoint(side: str, rank: int) -> Endpoint:
    """A shared Endpoint instance (renaming creates hundreds of thousands of moves)."""
    e = _ENDPOINTS.get((side, rank))
    if e is None:
        e = _ENDPOINTS[(side, rank)] = Endpoint(side, rank)
    return e


def _compact(moves: tuple[Move, ...]) -> tuple:
    """Moves as columns: distinct senders, sender index, receiver, box and path of each move."""
    senders = tuple(dict.fromkeys(m.src for m in moves))
    index = {e: i for i, e in enumerate(senders)}
    return (senders, tuple([index[m.src] for m in moves]), tuple([m.dst for m in moves]),
            tuple([m.box for m in moves]), tuple([m.path for m in moves]))


def _rename(canon: TensorPlan, sranks: tuple, dranks: tuple) -> TensorPlan:
    """`canon` with mesh position i renamed to the rank at that position, on each side."""
    if _is_identity(dranks) and _is_identity(sranks):
        return canon
    return TensorPlan.renamed(canon, sranks, dranks)


def _box(offsets: tuple, sizes: tuple) -> Box:
    b = _new(Box)
    b.__dict__.update(offsets=offsets, sizes=sizes)
    return b


class _Boxes:
    """Boxes given as offset and size columns, each built on first use (a shipped canonical
    plan's moves: a process looks at the few its share touches)."""

    __slots__ = ("offsets", "sizes", "_built")

    def __init__(self, offsets: tuple, sizes: tuple):
        self.offsets, self.sizes = offsets, sizes
        self._built = [None] * len(offsets)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> Box:
        b = self._built[i]
        if b is None:
            b = self._built[i] = _box(self.offsets[i], self.sizes[i])
        return b

    def __iter__(self):
        return map(self.__getitem__, range(len(self.offsets)))


def _restore_plan(shape, itemsize, senders, sidx, dsts, offsets, sizes, paths, stats,
                  rotations) -> TensorPlan:
    tp = TensorPlan(shape, itemsize, None, stats, rotations)
    tp._compact = (senders, sidx, dsts, _Boxes(offsets, sizes), paths)
    return tp


def _is_identity(ranks: tuple) -> bool:
    return ranks[0] == 0 and ranks[-1] == len(ranks) - 1 and ranks == tuple(range(len(ranks)))


def _plan_moves(shape, itemsize, src_layout: Layout, dst_layout: Layout, topo: Topology,
                rotation: int = 0) -> tuple[tuple[Move, ...], int]:
    """The moves: exact intersections, balanced replica choice, one network copy per domain.

    Also returns how many rotations give different plans: the tie-break among source replicas
    (1 when every replica of every source class that sends anything sends some of it) and,
    for regions that cross into a domain whole, which of its ranks receives them.
    """
    src_classes = _classes(rank_boxes(src_layout, shape))
    dst_classes = _classes(rank_boxes(dst_layout, shape))
    # Domains whose ranks hold different but overlapping boxes (only destination groups of a
    # LayoutUnion do): planned cell by cell after the others, below.
    mixed = (_mixed_domains(dst_classes, topo.dst_domains)
             if type(dst_layout) is LayoutUnion else {})
    sdom, ddom, sdev, ddev = topo.src_domains, topo.dst_domains, topo.src_devices, topo.dst_devices
    load: dict[int, int] = defaultdict(int)
    moves: list[Move] = []

    def sep(h: int) -> Endpoint:
        return _endpoint("src", h)

    def dep(r: int) -> Endpoint:
        return _endpoint("dst", r)

    picked: set = set()

    def pick(holders: Sequence[int]) -> int:
        """The least loaded holder; on a tie, the first from position `rotation` on (mod n):
        the least (load, (i - rotation) % n)."""
        loads = [load[h] for h in holders]
        least = min(loads)
        try:
            i = loads.index(least, rotation % len(holders))
        except ValueError:
            i = loads.index(least)
        best = holders[i]
        picked.add(best)
        return best

    # Per source class: its holders grouped by domain.
    src_by_domain = []
    for sbox, holders in src_classes:
        near: dict[Any, list[int]] = {}
        for h in holders:
            near.setdefault(sdom[h], []).append(h)
        src_by_domain.append(near)

    whole_at: set = set()       # sizes of the rank lists that took a region whole

    def pieces(rs: list, x: Box) -> list:
        """(receiver, piece) pairs of `x` into one far domain whose ranks `rs` all need it."""
        if len(rs) > 1 and x.numel * itemsize < WHOLE_BELOW_BYTES:
            whole_at.add(len(rs))
            return [(rs[rotation % len(rs)], x)]
        return list(zip(rs, x.split(len(rs))))

    def far(rs: list, cut: list, holders: Sequence[int], n_pieces: int) -> None:
        """A region into one far domain whose ranks `rs` all need it, cut as `pieces` cuts it:
        each piece to one of them over the network (several source replicas share a large
        piece), which forwards it to the rest."""
        for receiver, piece in cut:
            pbytes = piece.numel * itemsize
            fan = len(holders) // n_pieces if pbytes >= SPLIT_OVER_REPLICAS_BYTES else 1
            for sub in piece.split(max(1, fan)):
                h = pick(holders)
                load[h] += sub.numel * itemsize
                moves.append(_move(sep(h), receiver, sub, NETWORK))
                rep = dep(receiver)
                for other in rs:
                    if other != receiver:
                        path = LOCAL if ddev[other] == ddev[receiver] else DOMAIN
                        moves.append(_move(rep, other, sub, path))

    for dbox, replicas in dst_classes:
        by_domain: dict[Any, list[int]] = {}
        for r in replicas:
            by_domain.setdefault(ddom[r], []).append(r)
        for (sbox, holders), near_of in zip(src_classes, src_by_domain):
            x = dbox.intersect(sbox)
            if x is None:
                continue
            xbytes = x.numel * itemsize
            far_domains = []
            for dom, rs in by_domain.items():
                near = near_of.get(dom)
                if not near:
                    if dom not in mixed:
                        far_domains.append(rs)
                    continue
                for r in rs:
                    same = [h for h in near if sdev[h] == ddev[r]]
                    if same:
                        moves.append(_move(sep(same[0]), r, x, LOCAL))
                    else:
                        h = pick(near)
                        load[h] += xbytes
                        moves.append(_move(sep(h), r, x, DOMAIN))
            if not far_domains:
                continue
            cuts = [(rs, pieces(rs, x)) for rs in far_domains]
            n_pieces = sum(len(cut) for _, cut in cuts)
            for rs, cut in cuts:
                far(rs, cut, holders, n_pieces)
    for dom, ranks in mixed.items():
        for (sbox, holders), near_of in zip(src_classes, src_by_domain):
            if near_of.get(dom):
                continue
            xs = [(r, x) for r, x in ((r, b.intersect(sbox)) for r, b in ranks) if x is not None]
            for cell in _cells([x for _, x in xs]):
                needers = [r for r, x in xs if x.contains(cell)]
                cut = pieces(needers, cell)
                far(needers, cut, holders, len(cut))
    rotations = 1
    for _, holders in src_classes:
        used = sum(1 for h in holders if h in picked)
        if 0 < used < len(holders):
            rotations = max(rotations, len(holders))
    for k in whole_at:
        rotations = math.lcm(rotations, k)
    return tuple(moves), rotations


class PlanError(ValueError):
    """The planner found the plan inconsistent (a bug or an impossible layout)."""


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
            now = tuple(i for i in inside
                        if boxes[i].offsets[d] <= lo and hi <= boxes[i].offsets[d] + boxes[i].sizes[d])
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


def _verify_cover(shape, dst_layout, moves: Sequence[Move]) -> None:
    """Check that the moves into every destination rank tile its box exactly once."""
    into: dict[int, list[Box]] = defaultdict(list)
    for m in moves:
        into[m.dst].append(m.box)
    checked: set = set()        # replicas often receive the very same pieces: check once
    for r, box in rank_boxes(dst_layout, tuple(shape)):
        got = into.pop(r, [])
        if box.empty:
            if got:
                raise PlanError(f"destination rank {r} holds nothing but is sent {got}")
            continue
        # A valid set has no duplicates: equal length and equal set mean the same pieces.
        key = (box, len(got), frozenset(got)) if len(got) > 1 else None
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
    shape = tuple(shape)
    gather = sum(full - b.numel * itemsize for _, b in rank_boxes(src_layout, shape))
    n_dst_holding = sum(1 for _, b in rank_boxes(dst_layout, shape) if not b.empty)
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
    cuts = []
    for d, n in enumerate(shape):
        c = {0, n}
        for _, b in src + dst:
            c.add(b.offsets[d])
            c.add(b.offsets[d] + b.sizes[d])
        cuts.append(sorted(c))
    pos = [{v: i for i, v in enumerate(c)} for c in cuts]

    def block(b: Box) -> tuple[tuple[int, int], ...]:
        return tuple((p[o], p[o + n]) for p, o, n in zip(pos, b.offsets, b.sizes))

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
            missing[tuple(slice(a, b) for a, b in blk)] = True
        for blk in held:
            missing[tuple(slice(a, b) for a, b in blk)] = False
        total += count * int(cell_bytes[missing].sum())
    return total


def clear_caches() -> None:
    """Forget every cached plan, box and interned object (for benchmarks and tests)."""
    from ..layout.layout import rank_box, rank_boxes

    plan_tensor.cache_clear()
    _canonical_plan.cache_clear()
    _canonical_layout.cache_clear()
    _side_labels.cache_clear()
    rank_boxes.cache_clear()
    rank_box.cache_clear()
    _positions.cache_clear()
    _rank_array.cache_clear()
    _ENDPOINTS.clear()
    _TOPOLOGIES.clear()
