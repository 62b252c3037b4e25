"""Layouts: a mesh plus one placement per mesh dim, and the box each rank holds."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Sequence

import numpy as np

from .box import Box
from .mesh import Mesh
from .placement import Placement, Replicate, Shard, as_placement


class _Holdings:
    """What each rank of a layout holds (shared by Layout and LayoutUnion)."""

    __slots__ = ()

    def box(self, rank: int, shape: Sequence[int]) -> Optional[Box]:
        """The global box `rank` holds, or None when the rank is not in the mesh."""
        return rank_box(self, int(rank), tuple(shape))

    def local_shape(self, rank: int, shape: Sequence[int]) -> Optional[tuple[int, ...]]:
        b = self.box(rank, shape)
        return None if b is None else b.sizes

    def boxes(self, shape: Sequence[int]) -> dict[int, Box]:
        """Box of every rank in the mesh."""
        return dict(rank_boxes(self, tuple(shape)))

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.mesh.ranks


@dataclass(frozen=True, init=False)
class Layout(_Holdings):
    """How one side lays a tensor out: `placements[i]` says what mesh dim i does.

    Several mesh dims may shard the same tensor dim; they nest in mesh-dim order, as DTensor
    does (mesh dim 0 splits first, mesh dim 1 splits each of those parts, ...).
    """

    mesh: Mesh
    placements: tuple[Placement, ...]

    def __init__(self, mesh: Mesh, placements: Sequence[Any]):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Layout needs a ray_reshard Mesh, got {type(mesh).__name__}")
        if isinstance(placements, (Placement,)) or not isinstance(placements, (list, tuple)):
            placements = (placements,)
        pls = tuple(as_placement(p) for p in placements)
        if len(pls) != mesh.ndim:
            raise ValueError(
                f"Layout has {len(pls)} placements {pls} for a mesh of {mesh.ndim} dims "
                f"{dict(zip(mesh.dim_names, mesh.shape))}: give exactly one placement per mesh dim")
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", pls)

    @classmethod
    def replicated(cls, ranks: Sequence[int]) -> "Layout":
        """Every listed rank holds the whole tensor."""
        return cls(Mesh(list(ranks)), (Replicate(),))

    @classmethod
    def sharded(cls, ranks: Sequence[int], dim: int) -> "Layout":
        """The listed ranks split tensor dim `dim` in order (torch.chunk semantics)."""
        return cls(Mesh(list(ranks)), (Shard(dim),))

    @classmethod
    def from_device_mesh(cls, device_mesh: Any, placements: Sequence[Any],
                         rank_map: Optional[Any] = None) -> "Layout":
        """Build from a torch DeviceMesh; `rank_map` maps global process ranks to actor indices.

        Without `rank_map`, process rank r is actor index r.
        """
        grid = device_mesh.mesh.tolist()
        names = getattr(device_mesh, "mesh_dim_names", None)

        def remap(x):
            if isinstance(x, list):
                return [remap(y) for y in x]
            if rank_map is None:
                return int(x)
            try:
                return int(rank_map[int(x)])
            except (KeyError, IndexError):
                raise ValueError(f"rank_map has no actor index for process rank {int(x)}") from None

        return cls(Mesh(remap(grid), names), placements)

    @classmethod
    def from_dtensor(cls, dtensor: Any, rank_map: Optional[Any] = None) -> "Layout":
        """The layout of a DTensor (its device mesh and placements)."""
        return cls.from_device_mesh(dtensor.device_mesh, dtensor.placements, rank_map)

    def replica(self, which: Any) -> "Layout":
        """The layout of one replica: the sub-mesh at position `which[dim]` of each mesh dim
        named (or numbered) in `which`, each of which must be replicated. The remaining ranks
        keep their ids and hold the same boxes as here."""
        fixed = {}
        for dim, pos in dict(which).items():
            i = self.mesh.dim_index(dim)
            if not isinstance(self.placements[i], Replicate):
                raise ValueError(f"mesh dim {self.mesh.dim_names[i]!r} is {self.placements[i]}, "
                                 f"not Replicate: its positions are not replicas")
            if isinstance(pos, bool) or not isinstance(pos, int) or \
                    not 0 <= pos < self.mesh.shape[i]:
                raise ValueError(f"replica position {pos!r} on mesh dim "
                                 f"{self.mesh.dim_names[i]!r} must be an int in "
                                 f"0..{self.mesh.shape[i] - 1}")
            fixed[i] = pos
        if not fixed:
            raise ValueError("name at least one replicated mesh dim and its position")
        keep = [i for i in range(self.mesh.ndim) if i not in fixed]
        grid = np.asarray(self.mesh.ranks, dtype=object).reshape(self.mesh.shape)
        grid = grid[tuple(fixed.get(i, slice(None)) for i in range(self.mesh.ndim))]
        if not keep:                                  # one rank holds the whole replica
            return Layout(Mesh([int(grid)]), (Replicate(),))
        return Layout(Mesh(grid.tolist(), [self.mesh.dim_names[i] for i in keep]),
                      [self.placements[i] for i in keep])

    def validate_for(self, shape: Sequence[int], what: str = "tensor") -> None:
        """Raise if this layout cannot lay out a tensor of `shape`."""
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard) and p.dim >= len(shape):
                raise ValueError(
                    f"{what}: placement {p} on mesh dim {self.mesh.dim_names[i]!r} shards tensor "
                    f"dim {p.dim}, but the tensor has {len(shape)} dims (shape {tuple(shape)})")
            if isinstance(p, Shard) and p.block is not None:
                parts = self.mesh.shape[i]
                if p.block * parts < _extent_before(self, shape, i, p.dim):
                    raise ValueError(
                        f"{what}: {p} over mesh dim {self.mesh.dim_names[i]!r} of size {parts} "
                        f"covers {p.block * parts} of {shape[p.dim]} elements of dim {p.dim}")

    def __hash__(self):
        # Cached: layouts key the planner's caches (see Mesh.__hash__).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.mesh, self.placements))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return self.placements == other.placements and self.mesh == other.mesh

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def __repr__(self) -> str:
        pl = ", ".join(f"{n}={p}" for n, p in zip(self.mesh.dim_names, self.placements))
        return f"Layout({pl}; ranks {list(self.mesh.ranks)} as {self.mesh.shape})"


@dataclass(frozen=True, init=False)
class LayoutUnion(_Holdings):
    """One tensor laid out by several groups of ranks at once, each with its own `Layout`
    (prefill engines in TP8 on ranks 0-7 and decode engines in TP2 x DP4 on ranks 8-15).

    Destination side only. The parts cover disjoint ranks; every rank holds its part's box.
    The planner treats the union as one destination: a region crosses into an NVLink domain
    once for all the groups' ranks there. `mesh` is one dim over the parts' ranks, part by
    part, each in its own mesh order.
    """

    parts: tuple[Layout, ...]
    mesh: Mesh

    def __init__(self, parts: Sequence[Layout]):
        parts = tuple(parts)
        if not parts:
            raise ValueError("LayoutUnion needs at least one Layout")
        owner: dict[int, int] = {}
        for i, lay in enumerate(parts):
            if not isinstance(lay, Layout):
                raise TypeError(f"LayoutUnion part {i} must be a Layout, got "
                                f"{type(lay).__name__}")
            for r in lay.mesh.ranks:
                j = owner.setdefault(r, i)
                if j != i:
                    raise ValueError(f"LayoutUnion parts {j} and {i} both use rank {r}: each "
                                     f"group needs its own ranks (offset one group's ranks "
                                     f"past the other's)")
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "mesh", Mesh([r for lay in parts for r in lay.mesh.ranks],
                                              ("rank",)))
        object.__setattr__(self, "_part_of", owner)

    def part_of(self, rank: int) -> Optional[Layout]:
        """The part whose mesh holds `rank`, or None."""
        i = self._part_of.get(rank)
        return None if i is None else self.parts[i]

    def validate_for(self, shape: Sequence[int], what: str = "tensor") -> None:
        for i, lay in enumerate(self.parts):
            lay.validate_for(shape, f"{what}, group {i}")

    def replica(self, which: Any) -> Layout:
        raise ValueError("a LayoutUnion has no single replica structure: take the replica "
                         "from one of its parts (union.parts[i].replica(...))")

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(("union", self.parts))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, LayoutUnion):
            return NotImplemented
        return self.parts == other.parts

    def __getstate__(self):
        return {"parts": self.parts}

    def __setstate__(self, state):
        self.__init__(state["parts"])

    def __repr__(self) -> str:
        return "LayoutUnion(" + ", ".join(map(repr, self.parts)) + ")"


def _extent_before(layout: Layout, shape, mesh_dim: int, tdim: int) -> int:
    """Extent of tensor dim `tdim` left to split when mesh dim `mesh_dim` applies (upper bound)."""
    n = shape[tdim]
    for i in range(mesh_dim):
        p = layout.placements[i]
        if isinstance(p, Shard) and p.dim == tdim:
            n = max(p.split(n, layout.mesh.shape[i], j)[1] for j in range(layout.mesh.shape[i]))
    return n


@lru_cache(maxsize=1 << 12)
def rank_boxes(layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, Box], ...]:
    """(rank, box) of every rank of the mesh, in mesh order. Cached; do not mutate."""
    if type(layout) is LayoutUnion:
        return tuple(rb for part in layout.parts for rb in rank_boxes(part, shape))
    mesh = layout.mesh
    # A rank's box depends only on its coordinates along the sharding mesh dims: ranks that
    # differ only along replicating dims (replicas) share one Box, computed once.
    sharding = [i for i, p in enumerate(layout.placements) if isinstance(p, Shard)]
    memo: dict = {}
    out = []
    for r, coords in zip(mesh.ranks, itertools.product(*[range(k) for k in mesh.shape])):
        key = tuple([coords[i] for i in sharding])
        box = memo.get(key)
        if box is None:
            box = memo[key] = _box_at(layout, coords, shape)
        out.append((r, box))
    return tuple(out)


@lru_cache(maxsize=1 << 16)
def rank_box(layout: Layout, rank: int, shape: tuple[int, ...]) -> Optional[Box]:
    """The box rank `rank` holds (None: not in the mesh). Cached."""
    if type(layout) is LayoutUnion:
        part = layout.part_of(rank)
        return None if part is None else rank_box(part, rank, shape)
    coords = layout.mesh.coords(rank)
    if coords is None:
        return None
    return _box_at(layout, coords, shape)


def _box_at(layout: Layout, coords: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    """The box held at mesh coordinates `coords`."""
    offs = [0] * len(shape)
    sizes = list(shape)
    for c, k, p in zip(coords, layout.mesh.shape, layout.placements):
        if isinstance(p, Shard):
            start, length = p.split(sizes[p.dim], k, c)
            offs[p.dim] += start
            sizes[p.dim] = length
    return Box(tuple(offs), tuple(sizes))
