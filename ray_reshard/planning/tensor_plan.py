"""The moves of one tensor, as a value: `TensorPlan` and its byte statistics `TensorStats`.

A plan renamed from a canonical one keeps that plan and two rank tuples and builds its own moves
only when asked; a process takes just its share (`touching`, `into`); a canonical plan ships
its moves as columns. Nothing here chooses a move (see `planner.py`). Never imports Ray.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..layout.box import Box
from .moves import NETWORK, Endpoint, Move, endpoint, new_move

__all__ = ["TensorPlan", "TensorStats", "clear_rank_caches"]


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
                moves = tuple(map(new_move, map(senders.__getitem__, sidx), dsts, boxes, paths))
            else:
                senders, sidx, dsts, boxes, paths = self._canon.compact
                real = [self._rename_sender(e) for e in senders]
                moves = tuple(map(new_move, map(real.__getitem__, sidx),
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
        return endpoint(e.side, (self._sranks if e.side == "src" else self._dranks)[e.rank])

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
                    picked += by_sender.get(endpoint(side, p), ())
        if not picked:
            return []
        picked = sorted(set(picked))
        if self._moves is not None:
            moves = self._moves
            return [moves[i] for i in picked]
        senders, sidx, dsts, boxes, paths = canon.compact
        if self._canon is None:
            return [new_move(senders[sidx[i]], dsts[i], boxes[i], paths[i]) for i in picked]
        real: dict = {}
        for i in picked:
            j = sidx[i]
            if j not in real:
                real[j] = self._rename_sender(senders[j])
        dr = self._dranks
        return [new_move(real[sidx[i]], dr[dsts[i]], boxes[i], paths[i]) for i in picked]

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


def _per_object(build):
    """`build(ranks)` cached per tuple object, not per value: hashing a mesh's rank tuple (a
    thousand ranks) costs more than what is built from it, and a plan's rank tuples are shared
    objects. An entry keeps its tuple alive, so its id is not reused while cached."""
    cache: dict = {}

    def get(ranks: tuple):
        hit = cache.get(id(ranks))
        if hit is not None and hit[0] is ranks:
            return hit[1]
        if len(cache) >= 1 << 12:
            cache.clear()
        value = build(ranks)
        cache[id(ranks)] = (ranks, value)
        return value

    get.cache_clear = cache.clear
    return get


@_per_object
def _rank_array(ranks: tuple) -> np.ndarray:
    return np.asarray(ranks, dtype=np.int64)


@_per_object
def _positions(ranks: tuple) -> dict:
    """rank -> its position in `ranks`."""
    return {r: i for i, r in enumerate(ranks)}


def _compact(moves: tuple[Move, ...]) -> tuple:
    """Moves as columns: distinct senders, sender index, receiver, box and path of each move."""
    senders = tuple(dict.fromkeys(m.src for m in moves))
    index = {e: i for i, e in enumerate(senders)}
    return (senders, tuple([index[m.src] for m in moves]), tuple([m.dst for m in moves]),
            tuple([m.box for m in moves]), tuple([m.path for m in moves]))


_new = object.__new__


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


def clear_rank_caches() -> None:
    """Forget the cached rank arrays and positions (for benchmarks and tests)."""
    _positions.cache_clear()
    _rank_array.cache_clear()
