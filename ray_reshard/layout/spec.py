"""TensorSpec: one logical tensor, its layout on each side, and where each rank stores it."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import quant as _quant
from .layout import Layout, LayoutUnion
from .slots import Slot, Slots, freeze_slots


@dataclass(frozen=True, init=False)
class TensorSpec:
    """A logical tensor: global `shape`, destination `dtype`, and its source/destination layouts
    (`dst` may be a `LayoutUnion`: several destination groups, each with its own layout).

    `src_dtype` is the dtype the sources hold (default: `dtype`); senders convert, so only
    destination-dtype bytes move. `src_slots` / `dst_slots` map a rank to a `Slot` when the rank
    stores its shard inside a larger (fused or stacked) local tensor; without them a rank's
    local tensor is the one named like the logical tensor (a mapping rank -> Slot, or (rank,
    Slot) pairs, is kept as `Slots`). `quant` (a `BlockFP8`, with `dtype=torch.float8_e4m3fn`)
    asks for block FP8 on the destination, quantised by the senders, with float32 scales beside
    the weights (see `ray_reshard.layout.quant`).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    src: Layout
    dst: Layout | LayoutUnion
    src_dtype: Optional[torch.dtype] = None
    src_slots: Optional[Slots] = field(default=None)
    dst_slots: Optional[Slots] = field(default=None)
    quant: Optional[Any] = None

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, src: Layout,
                 dst: Layout | LayoutUnion, src_dtype: Optional[torch.dtype] = None,
                 src_slots: Optional[Slots] = None, dst_slots: Optional[Slots] = None,
                 quant: Optional[Any] = None):
        # One dict update instead of a frozen dataclass's setattr per field: model recipes
        # build tens of thousands of specs.
        d = self.__dict__
        d.update(shape=shape, dtype=dtype, src=src, dst=dst, src_dtype=src_dtype,
                 src_slots=src_slots, dst_slots=dst_slots, quant=quant)
        if type(shape) is not tuple or not all([type(s) is int and s >= 0 for s in shape]):
            self._check_shape()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if src_dtype is not None and not isinstance(src_dtype, torch.dtype):
            raise TypeError(f"src_dtype must be a torch.dtype, got {src_dtype!r}")
        source = dtype if src_dtype is None else src_dtype
        if not _copyable(source, dtype):
            what = (f"from {source} to {dtype}" if source != dtype else f"of {dtype}")
            raise ValueError(f"torch cannot copy tensors {what} (no copy kernel), so no refit "
                             f"can move them; use a dtype torch converts (e.g. convert on the "
                             f"trainer first)")
        if not isinstance(src, Layout):
            hint = (" (several destination groups take a LayoutUnion as dst; sources take one "
                    "Layout)" if isinstance(src, LayoutUnion) else "")
            raise TypeError(f"src must be a Layout, got {type(src).__name__}{hint}")
        if not isinstance(dst, (Layout, LayoutUnion)):
            raise TypeError(f"dst must be a Layout or LayoutUnion, got {type(dst).__name__}")
        if src_slots is not None and type(src_slots) is not Slots:
            d["src_slots"] = freeze_slots(src_slots)
        if dst_slots is not None and type(dst_slots) is not Slots:
            d["dst_slots"] = freeze_slots(dst_slots)
        if quant is not None:
            _quant.check_spec(self)
        try:
            hash(self)    # cached now: computing it later, at a refit, allocates per spec
        except TypeError:
            pass          # an unhashable field (e.g. a list as Slot index): fails when hashed

    def sibling(self, src: Layout, dst: Layout | LayoutUnion, src_slots: Optional[Slots],
                dst_slots: Optional[Slots]) -> "TensorSpec":
        """This spec (shape, dtypes, no `quant`) with other layouts and slot tables: only what
        differs is checked. Model recipes build thousands of expert specs alike this way."""
        if self.quant is not None:
            raise ValueError("sibling() keeps no quant format; build quantised specs whole")
        if not isinstance(src, Layout) or not isinstance(dst, (Layout, LayoutUnion)) or \
                type(src_slots) not in (Slots, type(None)) or \
                type(dst_slots) not in (Slots, type(None)):
            # the constructor's errors, or its freezing of slot tables given as pairs
            return TensorSpec(self.shape, self.dtype, src, dst, self.src_dtype, src_slots,
                              dst_slots)
        spec = _new(TensorSpec)
        d = spec.__dict__
        d.update(shape=self.shape, dtype=self.dtype, src=src, dst=dst, src_dtype=self.src_dtype,
                 src_slots=src_slots, dst_slots=dst_slots, quant=None)
        try:
            hash(spec)    # cached now, as the constructor does
        except TypeError:
            pass
        return spec

    def _check_shape(self) -> None:
        """Raise unless `shape` is a sequence of non-negative ints; keep it as a tuple."""
        shape = self.shape
        if isinstance(shape, torch.Size):
            shape = tuple(shape)
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"shape must be a tuple of ints, got {shape!r}")
        for s in shape:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
                raise ValueError(f"shape {tuple(shape)} must hold non-negative ints, "
                                 f"got {s!r}")
        self.__dict__["shape"] = tuple(int(s) for s in shape)

    @property
    def source_dtype(self) -> torch.dtype:
        return self.src_dtype if self.src_dtype is not None else self.dtype

    @property
    def itemsize(self) -> int:
        """Bytes per planned element (quantised specs: see quant.wire_itemsize)."""
        if self.quant is not None:
            return _quant.wire_itemsize(self)
        return _itemsize(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        if self.quant is not None:
            return _quant.wire_nbytes(self)
        return self.numel * self.itemsize

    @property
    def on_block_grid(self) -> bool:
        """A quantised spec: whether it is planned on its block grid (every source holds whole
        blocks; see layout.quant). Computed once."""
        got = self.__dict__.get("_on_grid")
        if got is None:
            got = _quant.sources_hold_whole_blocks(self)
            object.__setattr__(self, "_on_grid", got)
        return got

    @property
    def source_nbytes(self) -> int:
        """Bytes of all its elements in the source dtype (what the sources hold of it, once)."""
        return self.numel * _itemsize(self.source_dtype)

    @property
    def signature(self) -> tuple:
        """What the plan's shape depends on: tensors with equal signatures share one plan."""
        if self.quant is not None:
            return _quant.signature(self)
        return (self.shape, self.itemsize, self.src, self.dst)

    def layout(self, side: str) -> Layout:
        return self.src if side == "src" else self.dst

    def slot(self, side: str, rank: int, name: str) -> Slot:
        slots = self.src_slots if side == "src" else self.dst_slots
        if slots is not None:
            s = slots.get(rank)
            if s is not None:
                return s
        return Slot(name)

    def __hash__(self):
        # Cached: spec sets are looked up whole (the plan cache) at every refit. The slot
        # tables are left out (equal specs still hash alike): hashing two tables per spec was
        # a third of building a model's specs, and specs differing only there (the experts of
        # one layer) are told apart by their names wherever a set of them is a key.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.dtype, self.src, self.dst, self.src_dtype, self.quant))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):
        # String hashes differ between processes: never ship a cached hash.
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def validate(self, name: str, checked: Optional[set] = None) -> None:
        """Raise a ValueError naming `name` when the layouts cannot hold this tensor.

        `checked` (optional, owned by the caller) remembers by identity the (shape, layouts,
        slot rank tables) found valid, so specs sharing them are checked once; it is valid
        only while the specs it saw are alive. Where each slot sits (its offset, which block
        FP8 scales depend on) is not part of that key: it is checked for every spec, so a set
        of specs is refused whenever one of its members alone would be, with the same error.
        """
        if checked is not None:
            ss, ds = self.src_slots, self.dst_slots
            key = (self.shape, id(self.src), id(self.dst), None if ss is None else id(ss.ranks),
                   None if ds is None else id(ds.ranks), self.quant, self.dtype)
            if key not in checked:
                self._validate_layouts(name, checked)
                checked.add(key)
        else:
            self._validate_layouts(name)
        if self.quant is not None:
            _quant.validate_slots(self, name)

    def _validate_layouts(self, name: str, checked: Optional[set] = None) -> None:
        """Every check of `validate` but where the slots sit (`checked`: as in `validate`; it
        also remembers which slot rank tables were found inside which mesh)."""
        width = max(_itemsize(self.dtype), _itemsize(self.source_dtype))
        if self.numel * width >= MAX_TENSOR_BYTES:
            raise ValueError(f"{name!r}: shape {self.shape} holds {self.numel} elements "
                             f"({self.numel * width} bytes of {self.source_dtype}): more than "
                             f"any tensor can (2**63 bytes)")
        for side in ("src", "dst"):
            lay = self.layout(side)
            lay.validate_for(self.shape, f"{name!r} ({side} layout)")
            slots = self.src_slots if side == "src" else self.dst_slots
            if slots:
                mesh_ranks = lay.mesh.rank_set
                inside = None if checked is None else ("slots", id(slots.ranks), id(mesh_ranks))
                if inside is not None and inside in checked:
                    continue
                if not mesh_ranks.issuperset(slots.ranks):
                    r = next(r for r in slots.ranks if r not in mesh_ranks)
                    raise ValueError(f"{name!r}: {side}_slots names rank {r}, which is not in "
                                     f"the {side} mesh {sorted(mesh_ranks)}")
                if inside is not None:
                    checked.add(inside)
        if self.quant is not None:
            _quant.validate(self, name)


_new = object.__new__
_ITEMSIZE: dict = {}
_COPYABLE: dict = {}
# torch indexes a tensor's bytes with 64-bit signed integers
MAX_TENSOR_BYTES = 1 << 63


def _copyable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether torch copies (and converts) `src` elements into `dst` tensors."""
    ok = _COPYABLE.get((src, dst))
    if ok is None:
        try:
            torch.empty(2, dtype=dst).copy_(torch.empty(2, dtype=src))
            ok = True
        except Exception:
            ok = False
        _COPYABLE[(src, dst)] = ok
    return ok


def _itemsize(dtype: torch.dtype) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n
