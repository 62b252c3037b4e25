"""Placements: how one mesh dimension lays a tensor out (shard a tensor dim, or replicate)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Placement:
    """Base of the placement values; use `Shard` or `Replicate`."""

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Split tensor dim `dim` over the mesh dimension.

    Default split follows `torch.chunk`: blocks of ceil(n/k) elements, the last ones possibly
    short or empty. `block` fixes the block size instead (e.g. vLLM's padded vocabulary: blocks of
    padded_vocab/tp rows, clipped at the real size).
    """

    dim: int
    block: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"Shard dim must be a non-negative int, got {self.dim!r}")
        if self.block is not None and (not isinstance(self.block, int) or self.block <= 0):
            raise ValueError(f"Shard block must be a positive int, got {self.block!r}")

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return dim is None or dim == self.dim

    def split(self, size: int, parts: int, index: int) -> tuple[int, int]:
        """(offset, length) of part `index` of `size` elements split into `parts`."""
        block = self.block if self.block is not None else -(-size // parts) if parts else 0
        start = min(index * block, size)
        stop = min(start + block, size)
        return start, stop - start

    def __repr__(self) -> str:
        return f"Shard({self.dim})" if self.block is None else f"Shard({self.dim}, block={self.block})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank along the mesh dimension holds the same data."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


def as_placement(p: Any) -> Placement:
    """Convert our placements or torch.distributed.tensor's Shard/Replicate; refuse Partial."""
    if isinstance(p, Placement):
        return p
    name = type(p).__name__
    if name == "Shard" and hasattr(p, "dim"):
        return Shard(int(p.dim))
    if name == "Replicate":
        return Replicate()
    if name in ("Partial", "_Partial") or (hasattr(p, "is_partial") and p.is_partial()):
        raise ValueError(
            "Partial placements cannot be resharded: the tensor is a pending reduction. "
            "Reduce it first (e.g. dtensor.redistribute(placements=[Replicate()]))"
        )
    raise TypeError(f"Unsupported placement {p!r}: expected Shard(dim) or Replicate()")
