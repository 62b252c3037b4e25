"""Meshes: a grid of rank indices into one side's actor list."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np


@dataclass(frozen=True, init=False)
class Mesh:
    """An n-d grid of distinct ranks (indices into a side's actor list).

    A mesh may cover any subset of the ranks in any order: a pipeline stage is a mesh over its
    stage's ranks only, and a rank outside the mesh holds nothing of the tensors laid out on it.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]          # row-major flattening of the grid
    dim_names: tuple[str, ...]

    def __init__(self, ranks: Any, dim_names: Optional[Sequence[str]] = None):
        arr = np.asarray(ranks, dtype=object)
        if arr.ndim == 0:
            raise ValueError(f"Mesh needs at least one dim, got the scalar {ranks!r}")
        if arr.size == 0:
            raise ValueError("Mesh must hold at least one rank")
        flat = []
        for r in arr.reshape(-1):
            if isinstance(r, (list, tuple, np.ndarray)):
                raise ValueError(f"Mesh must be a rectangular grid of ranks (rows of equal "
                                 f"length), got {ranks!r}")
            if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)):
                raise ValueError(f"Mesh entries must be non-negative ints, got {r!r}")
            if r < 0:
                raise ValueError(f"Mesh entries must be non-negative ints, got {r!r}")
            flat.append(int(r))
        seen = set()
        for r in flat:
            if r in seen:
                raise ValueError(f"rank {r} appears twice in mesh {arr.tolist()}")
            seen.add(r)
        if dim_names is None:
            dim_names = tuple(f"d{i}" for i in range(arr.ndim))
        dim_names = tuple(dim_names)
        if len(dim_names) != arr.ndim:
            raise ValueError(f"Mesh of {arr.ndim} dims {arr.shape} got {len(dim_names)} dim_names "
                             f"{dim_names}")
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"Mesh dim_names must be distinct, got {dim_names}")
        object.__setattr__(self, "shape", tuple(int(s) for s in arr.shape))
        object.__setattr__(self, "ranks", tuple(flat))
        object.__setattr__(self, "dim_names", dim_names)

    @classmethod
    def from_shape(cls, shape: Sequence[int], dim_names=None, start: int = 0) -> "Mesh":
        """A mesh over the contiguous ranks start .. start+prod(shape)-1 in row-major order."""
        n = int(np.prod(shape))
        return cls(np.arange(start, start + n).reshape(tuple(shape)).tolist(), dim_names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank_set(self) -> frozenset:
        """The ranks as a set (cached)."""
        rs = self.__dict__.get("_rank_set")
        if rs is None:
            rs = frozenset(self.ranks)
            object.__setattr__(self, "_rank_set", rs)
        return rs

    @property
    def in_order(self) -> bool:
        """Whether its ranks are 0, 1, ..., size - 1 in mesh order (cached)."""
        got = self.__dict__.get("_in_order")
        if got is None:
            r = self.ranks
            got = r[0] == 0 and r[-1] == len(r) - 1 and r == tuple(range(len(r)))
            object.__setattr__(self, "_in_order", got)
        return got

    def coords(self, rank: int) -> Optional[tuple[int, ...]]:
        """Grid coordinates of `rank`, or None when the rank is not in this mesh."""
        at = self.__dict__.get("_coords")
        if at is None:       # made on first use, never shipped: a mesh of 1,024 ranks
            at = dict(zip(self.ranks, itertools.product(*[range(k) for k in self.shape])))
            object.__setattr__(self, "_coords", at)
        return at.get(rank)

    def dim_index(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if dim not in self.dim_names:
                raise KeyError(f"mesh has no dim named {dim!r}; dims are {self.dim_names}")
            return self.dim_names.index(dim)
        return dim

    def __hash__(self):
        # Cached: meshes key the planner's caches, and hashing hundreds of ranks adds up.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.ranks, self.dim_names))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other):
        if self is other:
            return True
        return (isinstance(other, Mesh) and self.shape == other.shape and self.ranks == other.ranks
                and self.dim_names == other.dim_names)

    def __getstate__(self):
        # String hashes differ between processes: never ship a cached hash.
        state = dict(self.__dict__)
        state.pop("_hash", None)
        state.pop("_rank_set", None)
        state.pop("_in_order", None)
        state.pop("_coords", None)
        return state

    def __repr__(self) -> str:
        grid = np.asarray(self.ranks).reshape(self.shape).tolist()
        return f"Mesh({grid}, dim_names={self.dim_names})"
