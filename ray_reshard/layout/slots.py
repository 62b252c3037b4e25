"""Where each rank keeps its shard of a logical tensor: a `Slot` inside a local storage tensor,
and `Slots`, a spec's frozen rank -> Slot table (also shipped as columns)."""
from __future__ import annotations

import numbers
from array import array
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from typing import Mapping, Optional, Sequence

import torch


@dataclass(frozen=True, init=False)
class Slot:
    """Where a rank keeps its shard of a logical tensor inside a local storage tensor.

    The shard is `storage[index].narrow(dim, offset, shard.shape[dim])`: `index` picks leading
    positions (a stacked expert), `dim`/`offset` place it in a concatenation (fused QKV, gate/up).
    With `dim=None` the shard is all of `storage[index]`.
    """

    storage: str
    index: tuple[int, ...] = ()
    dim: Optional[int] = None
    offset: int = 0

    def __init__(self, storage: str, index: tuple[int, ...] = (), dim: Optional[int] = None,
                 offset: int = 0):
        # One dict update instead of a frozen dataclass's setattr per field: model recipes
        # build one Slot per tensor and side (tens of thousands).
        self.__dict__.update(storage=storage, index=index, dim=dim, offset=offset)

    def view(self, storage: torch.Tensor, shard_shape: Sequence[int]) -> torch.Tensor:
        t = storage
        for i in self.index:
            t = t[i]
        if self.dim is not None:
            t = t.narrow(self.dim, self.offset, shard_shape[self.dim])
        return t


class Slots:
    """The frozen rank -> Slot table of a TensorSpec (`src_slots` / `dst_slots`).

    Iterates as the (rank, Slot) pairs, sorted by rank, that it stands for, and compares equal
    to the tuple of those pairs. A table whose ranks all use one Slot keeps that Slot once:
    model recipes place most tensors alike on hundreds of ranks, and a tuple of pairs per
    tensor dominated building, hashing and shipping their spec sets. Tables shipped as columns
    (see `pack_slot_tables`) build their Slot on first use.
    """

    __slots__ = ("_ranks", "_slot", "_slots", "_hash", "_at", "_columns", "_row")

    def __init__(self, ranks: Sequence[int], slot: Optional[Slot] = None,
                 slots: Optional[Sequence[Slot]] = None):
        """Ranks in increasing order, and either one `slot` for all or one per rank."""
        self._ranks = ranks if type(ranks) is tuple else tuple(ranks)
        self._slot = slot
        self._slots = None if slots is None else tuple(slots)
        self._hash = self._at = self._columns = None

    @classmethod
    def same(cls, ranks: Sequence[int], slot: Slot) -> "Slots":
        """Every rank of `ranks` (increasing) keeps its shard in `slot`."""
        return cls(ranks, slot)

    @classmethod
    def from_pairs(cls, pairs) -> "Slots":
        """From (rank, Slot) pairs (any order; ranks distinct) or a mapping rank -> Slot."""
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        out = []
        for r, s in items:
            if not isinstance(s, Slot):
                raise TypeError(f"slot for rank {r} must be a Slot, got {type(s).__name__}")
            if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                raise TypeError(f"slot ranks must be ints, got {r!r}")
            out.append((int(r), s))
        out.sort(key=lambda rs: rs[0])
        ranks = tuple([r for r, _ in out])
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"slot table names a rank twice: {list(ranks)}")
        slots = [s for _, s in out]
        if slots and all(s is slots[0] or s == slots[0] for s in slots):
            return cls(ranks, slots[0])
        return cls(ranks, None, slots)

    def _load(self) -> None:
        (columns, positions), i = self._columns, self._row
        self._columns = None
        k = columns[3][i]
        self._ranks = columns[0][k]
        self._slot = _slot_from_columns(columns, i)
        self._slots = None
        # rank -> position, once per distinct rank tuple of the columns (not hashed per table)
        at = positions[k]
        if at is None:
            at = positions[k] = _rank_positions(self._ranks)
        self._at = at

    @property
    def ranks(self) -> tuple[int, ...]:
        if self._columns is not None:
            self._load()
        return self._ranks

    @property
    def uniform(self) -> Optional[Slot]:
        """The one Slot every rank uses, or None when they differ (or there are no ranks)."""
        if self._columns is not None:
            self._load()
        return self._slot

    def get(self, rank: int, default=None):
        """The Slot of `rank`, or `default`."""
        if self._columns is not None:
            self._load()
        at = self._at
        if at is None:
            at = self._at = _rank_positions(self._ranks)
        i = at.get(rank)
        if i is None:
            return default
        return self._slot if self._slots is None else self._slots[i]

    def items(self):
        return iter(self)

    def __iter__(self):
        if self._columns is not None:
            self._load()
        if self._slots is None:
            return zip(self._ranks, repeat(self._slot, len(self._ranks)))
        return zip(self._ranks, self._slots)

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        return (self.ranks[i], self._slot if self._slots is None else self._slots[i])

    def __eq__(self, other):
        if self is other:
            return True
        if isinstance(other, Slots):
            return (self.ranks == other.ranks and self._slot == other.uniform
                    and self._slots == other._slots)
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self):
        # The rank count and end ranks, not every rank: equal tables still hash alike, and
        # hashing hundreds of ranks per table dominated looking up a spec set.
        h = self._hash
        if h is None:
            r = self.ranks
            n = len(r)
            first, last = (r[0], r[-1]) if n else (-1, -1)
            slot = self._slot
            if slot is None:
                h = hash((n, first, last, self._slots))
            else:           # the Slot's fields: one tuple, no call to the Slot's own hash
                d = slot.__dict__
                h = hash((n, first, last, d["storage"], d["index"], d["dim"], d["offset"]))
            self._hash = h
        return h

    def __reduce__(self):
        return (Slots, (self.ranks, self._slot, self._slots))

    def __repr__(self) -> str:
        if self.uniform is not None:
            return f"Slots(ranks {list(self._ranks)}: {self._slot})"
        return f"Slots({dict(self)})"


@lru_cache(maxsize=1 << 10)
def _rank_positions(ranks: tuple) -> dict:
    return {r: i for i, r in enumerate(ranks)}


_new = object.__new__


def _slot_from_columns(columns, i: int) -> Slot:
    slot = _new(Slot)
    d = slot.__dict__
    d["storage"] = columns[1][columns[4][i]]
    d["index"] = columns[2][columns[5][i]]
    dim = columns[6][i]
    d["dim"] = None if dim < 0 else dim
    d["offset"] = columns[7][i]
    return slot


def pack_slot_tables(tables: Sequence[Optional[Slots]]) -> tuple:
    """Slot tables as columns, for shipping many of them: distinct rank tuples, storage names
    and index tuples once, per table their positions and each uniform Slot's dim and offset;
    tables without one uniform Slot are kept whole."""
    ranks_at: dict = {}
    names_at: dict = {}
    index_at: dict = {}
    rk, st, ix, dm, off = array("i"), array("i"), array("i"), array("i"), array("q")
    whole: dict = {}
    # bound methods and plain attribute reads: this runs once per tensor and side
    rk_add, st_add, ix_add, dm_add, off_add = rk.append, st.append, ix.append, dm.append, \
        off.append
    ranks_get, names_get, index_get = ranks_at.get, names_at.get, index_at.get
    for i, t in enumerate(tables):
        if t is None:
            slot = None
        else:
            if t._columns is not None:
                t._load()
            slot = t._slot
        if slot is None:
            if t is not None:
                whole[i] = t
            rk_add(-1), st_add(0), ix_add(0), dm_add(-1), off_add(0)
            continue
        ranks = t._ranks
        r = ranks_get(id(ranks))
        if r is None:
            r = ranks_at[id(ranks)] = (len(ranks_at), ranks)
        rk_add(r[0])
        name, index, dim = slot.storage, slot.index, slot.dim
        n = names_get(name)
        if n is None:
            n = names_at[name] = len(names_at)
        st_add(n)
        n = index_get(index)
        if n is None:
            n = index_at[index] = len(index_at)
        ix_add(n)
        dm_add(-1 if dim is None else dim)
        off_add(slot.offset)
    return ([r for _, r in ranks_at.values()], list(names_at), list(index_at), rk, st, ix, dm,
            off, whole)


def unpack_slot_tables(columns) -> list[Optional[Slots]]:
    """The tables of `pack_slot_tables` (each uniform one builds its Slot on first use)."""
    rk, whole = columns[3], columns[8]
    lazy = (columns, [None] * len(columns[0]))    # and each rank tuple's positions, once built
    out = []
    append = out.append
    for i, r in enumerate(rk):
        if r < 0:
            append(whole.get(i))
            continue
        t = _new(Slots)
        t._columns = lazy
        t._row = i
        t._hash = t._at = None
        append(t)
    return out


def freeze_slots(slots) -> Optional[Slots]:
    if slots is None or isinstance(slots, Slots):
        return slots
    return Slots.from_pairs(slots)
