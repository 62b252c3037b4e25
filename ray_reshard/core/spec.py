"""TensorSpec: one logical tensor, its layout on each side, and where each rank stores it."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from .layout import Layout


@dataclass(frozen=True)
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

    def view(self, storage: torch.Tensor, shard_shape: Sequence[int]) -> torch.Tensor:
        t = storage
        for i in self.index:
            t = t[i]
        if self.dim is not None:
            t = t.narrow(self.dim, self.offset, shard_shape[self.dim])
        return t


def _freeze_slots(slots: Optional[Mapping[int, Slot]]) -> Optional[tuple[tuple[int, Slot], ...]]:
    if slots is None:
        return None
    if isinstance(slots, tuple):
        return slots
    out = []
    for r, s in sorted(dict(slots).items()):
        if not isinstance(s, Slot):
            raise TypeError(f"slot for rank {r} must be a Slot, got {type(s).__name__}")
        out.append((int(r), s))
    return tuple(out)


@dataclass(frozen=True)
class TensorSpec:
    """A logical tensor: global `shape`, destination `dtype`, and its source/destination layouts.

    `src_dtype` is the dtype the sources hold (default: `dtype`); senders convert, so only
    destination-dtype bytes move. `src_slots` / `dst_slots` map a rank to a `Slot` when the rank
    stores its shard inside a larger (fused or stacked) local tensor; without them a rank's
    local tensor is the one named like the logical tensor. `quant` (a `BlockFP8`, with
    `dtype=torch.float8_e4m3fn`) asks for block FP8 on the destination, quantised by the
    senders, with float32 scales beside the weights (see `ray_reshard.core.quant`).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    src: Layout
    dst: Layout
    src_dtype: Optional[torch.dtype] = None
    src_slots: Optional[tuple[tuple[int, Slot], ...]] = field(default=None)
    dst_slots: Optional[tuple[tuple[int, Slot], ...]] = field(default=None)
    quant: Optional[Any] = None

    def __post_init__(self):
        shape = self.shape
        if isinstance(shape, torch.Size):
            shape = tuple(shape)
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"shape must be a tuple of ints, got {shape!r}")
        for s in shape:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
                raise ValueError(f"shape {tuple(shape)} must hold non-negative ints, got {s!r}")
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.src_dtype is not None and not isinstance(self.src_dtype, torch.dtype):
            raise TypeError(f"src_dtype must be a torch.dtype, got {self.src_dtype!r}")
        if not _copyable(self.source_dtype, self.dtype):
            what = (f"from {self.source_dtype} to {self.dtype}" if self.source_dtype != self.dtype
                    else f"of {self.dtype}")
            raise ValueError(f"torch cannot copy tensors {what} (no copy kernel), so no refit "
                             f"can move them; use a dtype torch converts (e.g. convert on the "
                             f"trainer first)")
        for side in ("src", "dst"):
            if not isinstance(getattr(self, side), Layout):
                raise TypeError(f"{side} must be a Layout, got {type(getattr(self, side)).__name__}")
        object.__setattr__(self, "src_slots", _freeze_slots(self.src_slots))
        object.__setattr__(self, "dst_slots", _freeze_slots(self.dst_slots))
        if self.quant is not None:
            _quant().check_spec(self)

    @property
    def source_dtype(self) -> torch.dtype:
        return self.src_dtype if self.src_dtype is not None else self.dtype

    @property
    def itemsize(self) -> int:
        """Bytes per planned element (quantised specs: see quant.wire_itemsize)."""
        if self.quant is not None:
            return _quant().wire_itemsize(self)
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
            return _quant().wire_nbytes(self)
        return self.numel * self.itemsize

    @property
    def signature(self) -> tuple:
        """What the plan's shape depends on: tensors with equal signatures share one plan."""
        if self.quant is not None:
            return _quant().signature(self)
        return (self.shape, self.itemsize, self.src, self.dst)

    def layout(self, side: str) -> Layout:
        return self.src if side == "src" else self.dst

    def slot(self, side: str, rank: int, name: str) -> Slot:
        slots = self.src_slots if side == "src" else self.dst_slots
        if slots:
            for r, s in slots:
                if r == rank:
                    return s
        return Slot(name)

    def validate(self, name: str) -> None:
        """Raise a ValueError naming `name` when the layouts cannot hold this tensor."""
        for side in ("src", "dst"):
            self.layout(side).validate_for(self.shape, f"{name!r} ({side} layout)")
            slots = self.src_slots if side == "src" else self.dst_slots
            if slots:
                mesh_ranks = set(self.layout(side).mesh.ranks)
                for r, _ in slots:
                    if r not in mesh_ranks:
                        raise ValueError(f"{name!r}: {side}_slots names rank {r}, which is not in "
                                         f"the {side} mesh {sorted(mesh_ranks)}")
        if self.quant is not None:
            _quant().validate(self, name)


def _quant():
    from . import quant
    return quant


_ITEMSIZE: dict = {}
_COPYABLE: dict = {}


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
