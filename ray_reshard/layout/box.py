"""Boxes: axis-aligned regions of a tensor (offsets and sizes per dim)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Box:
    """A region `[offsets[d], offsets[d] + sizes[d])` in every dim d. 0-d tensors have ((), ())."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def full(shape) -> "Box":
        return Box((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @property
    def empty(self) -> bool:
        return 0 in self.sizes

    def intersect(self, other: "Box") -> Optional["Box"]:
        """The common region, or None when it is empty."""
        offs, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: "Box") -> bool:
        return all(a <= b and b + m <= a + n
                   for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes))

    def relative_to(self, origin: "Box") -> "Box":
        """This box in the coordinates of `origin` (which must contain it)."""
        return Box(tuple(a - o for a, o in zip(self.offsets, origin.offsets)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(self.offsets, self.sizes))

    def split(self, parts: int) -> list["Box"]:
        """Split into at most `parts` near-equal non-empty boxes.

        Along the outermost dim that splits evenly or into 8+ slabs per part (so pieces of a
        contiguous region stay contiguous and move without packing), else the longest dim.
        """
        if parts <= 1 or self.ndim == 0:
            return [self]
        d = next((i for i in range(self.ndim)
                  if self.sizes[i] >= parts and (self.sizes[i] % parts == 0
                                                 or self.sizes[i] >= 8 * parts)),
                 max(range(self.ndim), key=lambda i: (self.sizes[i], -i)))
        n = self.sizes[d]
        parts = min(parts, n)
        base, extra = divmod(n, parts)
        out, start = [], self.offsets[d]
        for i in range(parts):
            length = base + (1 if i < extra else 0)
            offs = self.offsets[:d] + (start,) + self.offsets[d + 1:]
            sizes = self.sizes[:d] + (length,) + self.sizes[d + 1:]
            out.append(Box(offs, sizes))
            start += length
        return out

    def chunks(self, max_numel: int) -> list["Box"]:
        """Cut into boxes of at most `max_numel` elements, keeping each a box (row-major order),
        as few as that allows along the dim that is cut, of about equal length."""
        if self.numel <= max_numel or self.ndim == 0:
            return [self]
        # Find the outermost dim d such that a block of the trailing dims fits.
        inner = 1
        for d in range(self.ndim - 1, -1, -1):
            if inner * self.sizes[d] > max_numel:
                break
            inner *= self.sizes[d]
        n = self.sizes[d]
        pieces = -(-n // max(1, max_numel // inner))
        cuts = [n * i // pieces for i in range(pieces + 1)]
        out = []
        for lead in _iter_prefix(self, d):
            for start, end in zip(cuts, cuts[1:]):
                length = end - start
                offs = lead + (self.offsets[d] + start,) + self.offsets[d + 1:]
                sizes = (1,) * len(lead) + (length,) + self.sizes[d + 1:]
                out.append(Box(offs, sizes))
        return out

    def __repr__(self) -> str:
        return "Box[" + ", ".join(f"{a}:{a + n}" for a, n in zip(self.offsets, self.sizes)) + "]"


def _iter_prefix(box: Box, d: int):
    """All index tuples over dims [0, d) of `box`."""
    if d == 0:
        yield ()
        return
    for head in _iter_prefix(box, d - 1):
        for i in range(box.sizes[d - 1]):
            yield head + (box.offsets[d - 1] + i,)
