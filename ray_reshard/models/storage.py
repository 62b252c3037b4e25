"""What every engine module shares: the description of an engine's storage and the placement
machinery.

An engine module (`megatron`, `vllm`) describes one rank's storage as *stores*: for each role a
piece can play (``"qkv_w"``, ``"fc1"``, ``("e_fc1", 3)``, ``"embed"``...) the storage tensor's
name and shape, declared once in ``layer_stores`` / ``global_stores``. Placement looks names up
by role, and ``storages(rank)`` lists the same declarations, so a storage name is written in one
place per engine.

A side answers three questions about a piece (see `pieces`): does it hold it (`holds`), where
(`place`: its Layout over the side's ranks and, per rank, a Slot in a store), and what each rank
allocates (`storages`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import numpy as np

from ..layout.layout import Layout
from ..layout.mesh import Mesh
from ..layout.placement import Replicate, Shard
from ..layout.slots import Slot, Slots
from .config import ModelDims
from .pieces import Piece


@dataclass(frozen=True)
class StorageDecl:
    """One storage tensor a rank allocates."""

    shape: tuple[int, ...]
    fp32: bool = False          # kept in float32 whatever the model dtype (router bias)
    fp8: bool = False           # block-FP8 weights (float8_e4m3fn), scales in a fp32 store


Stores = dict  # role -> (storage name, StorageDecl)


def div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def check_pos(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def check_counts(given: Sequence[int], n: int, total: int, what: str) -> tuple[int, ...]:
    given = tuple(int(x) for x in given)
    if len(given) != n or sum(given) != total or any(x < 0 for x in given):
        raise ValueError(f"{what} {list(given)} must give {n} non-negative counts summing to "
                         f"{total}")
    return given


class EngineSide:
    """Placement and layout caching common to the engines; subclasses describe their stores."""

    name = "engine"
    needs_group_split = False
    needs_expert_split = False

    def __init__(self, dims: ModelDims):
        self.d = dims
        self._cache: dict[str, tuple[Layout, Slots]] = {}
        self._layouts: dict[tuple, Layout] = {}
        self._meshes: dict[tuple, Mesh] = {}            # (grid shape, grid bytes) -> its mesh
        self._by_grid: dict[tuple, Layout] = {}           # _rep/_shard: (kind, grid) -> layout
        self._grids: dict[Hashable, np.ndarray] = {}
        self._expert_layouts: dict[tuple, Layout] = {}    # experts' layouts, by grid position
        self._sorted: dict[int, tuple[int, ...]] = {}     # id(layout) -> sorted ranks
        self._names: dict[Optional[int], dict] = {}

    # --- what subclasses provide ---------------------------------------------------------
    @property
    def n_ranks(self) -> int:
        raise NotImplementedError

    def holds(self, pc: Piece) -> bool:
        """Whether this side keeps the piece at all (e.g. a vLLM main model has no MTP layer)."""
        return True

    def quant_of(self, pc: Piece):
        """The block-FP8 format this side keeps the piece in (a layout.quant.BlockFP8), or None."""
        return None

    def _place(self, pc: Piece):
        raise NotImplementedError

    def layers_of(self, rank: int) -> list[int]:
        """Layer indices (global, HF numbering) whose stores `rank` allocates."""
        raise NotImplementedError

    def global_stores(self, rank: Optional[int]) -> Stores:
        """Stores outside the layers (embedding, head, final norm) `rank` allocates; with
        rank=None every global store of the side (names only matter)."""
        raise NotImplementedError

    def layer_stores(self, layer: int, rank: Optional[int]) -> Stores:
        """Stores of one layer on `rank` (rank=None: any rank; names only matter)."""
        raise NotImplementedError

    # --- shared ----------------------------------------------------------------------------
    def store_name(self, role, layer: Optional[int] = None) -> str:
        """Name of the store playing `role` (in `layer`, or a global store)."""
        names = self._names.get(layer)
        if names is None:
            st = self.global_stores(None) if layer is None else self.layer_stores(layer, None)
            names = self._names[layer] = {r: n for r, (n, _) in st.items()}
        try:
            return names[role]
        except KeyError:
            where = "global stores" if layer is None else f"layer {layer}"
            raise ValueError(f"{self.name}: no store {role!r} in {where}") from None

    def storages(self, rank: int) -> dict[str, StorageDecl]:
        """Name -> declaration of every storage tensor `rank` allocates."""
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"{self.name} rank {rank} out of range 0..{self.n_ranks - 1}")
        out: dict[str, StorageDecl] = {}
        for l in self.layers_of(rank):
            out.update(self.layer_stores(l, rank).values())
        out.update(self.global_stores(rank).values())
        return out

    def _expert_rule(self, layer: int, kind: str):
        """expert index -> (layout, slots) of the per-expert pieces of `kind` in `layer`, with
        what they share worked out once; None where the side has no such rule."""
        return None

    def place_experts(self, pieces: Sequence[Piece]) -> list[tuple[Layout, Slots]]:
        """`place` of each of `pieces`: the per-expert pieces of one layer and kind (see
        `check_expert_group`), through the side's `_expert_rule` where it has one."""
        check_expert_group(pieces)
        one = self._expert_rule(pieces[0].layer, pieces[0].kind)
        if one is None:
            return [self.place(pc) for pc in pieces]
        return [one(pc.expert) for pc in pieces]

    def place(self, pc: Piece) -> tuple[Layout, Slots]:
        """The piece's layout on this side and the Slot of every rank holding part of it."""
        got = self._cache.get(pc.name)
        if got is None:
            got = self._cache[pc.name] = self._place(pc)
        return got

    # layouts (cached: the planner keys its caches on them, and meshes are not free to build)
    def _layout(self, grid: np.ndarray, placements) -> Layout:
        grid = np.asarray(grid)
        key = (grid.shape, grid.tobytes(),
               tuple((type(p).__name__, getattr(p, "dim", None), getattr(p, "block", None))
                     for p in placements))
        lay = self._layouts.get(key)
        if lay is None:
            # layouts on one grid share its Mesh: the planner's caches then find it by identity
            mesh = self._meshes.get(key[:2])
            if mesh is None:
                names = tuple(f"m{i}" for i in range(grid.ndim))
                mesh = self._meshes[key[:2]] = Mesh(grid.tolist(), names)
            lay = self._layouts[key] = Layout(mesh, tuple(placements))
        return lay

    def _rep(self, grid: np.ndarray) -> Layout:
        """Every rank of the grid holds the whole piece."""
        grid = np.asarray(grid)
        key = (grid.size, grid.tobytes())       # placements made only on a miss
        lay = self._by_grid.get(key)
        if lay is None:
            lay = self._by_grid[key] = self._layout(grid.reshape(-1), (Replicate(),))
        return lay

    def _shard(self, grid: np.ndarray, dim: int, block: Optional[int] = None) -> Layout:
        """grid [replicas, n]: replicate over rows, shard tensor dim `dim` over columns."""
        grid = np.asarray(grid)
        key = (dim, block, grid.shape, grid.tobytes())
        lay = self._by_grid.get(key)
        if lay is None:
            lay = self._by_grid[key] = self._layout(grid, (Replicate(), Shard(dim, block)))
        return lay

    def _same(self, layout: Layout, slot: Slot) -> tuple[Layout, Slots]:
        """Every rank of the layout keeps the piece in the same slot."""
        return layout, Slots(self._sorted_ranks(layout), slot)

    def _sorted_ranks(self, layout: Layout) -> tuple[int, ...]:
        ranks = self._sorted.get(id(layout))
        if ranks is None:
            ranks = self._sorted[id(layout)] = tuple(sorted(layout.mesh.ranks))
        return ranks

    @staticmethod
    def _table(slots: dict) -> Slots:
        return Slots.from_pairs(slots)


EXPERT_KINDS = frozenset(("e_gate", "e_up", "e_down"))


def check_expert_group(pieces: Sequence[Piece]) -> None:
    """Raise unless `pieces` are per-expert pieces (an expert index each) of one layer and
    one kind, as `EngineSide.place_experts` takes them."""
    if not pieces:
        raise ValueError("an expert group needs at least one piece")
    layer, kind = pieces[0].layer, pieces[0].kind
    if kind not in EXPERT_KINDS or not all(
            [pc.layer == layer and pc.kind == kind and pc.expert is not None for pc in pieces]):
        raise ValueError(f"an expert group holds per-expert pieces of one layer and kind; got "
                         f"{[pc.name for pc in pieces][:4]}...")


def make_side(dims: ModelDims, parallel) -> EngineSide:
    """The engine side of a parallel configuration (Megatron(...), VLLM(...), FSDP(...))."""
    if isinstance(parallel, EngineSide):
        return parallel
    side = getattr(parallel, "side", None)
    if not callable(side):
        raise TypeError(f"parallel must be Megatron(...), VLLM(...) or FSDP(...), got "
                        f"{type(parallel).__name__}")
    return side(dims)
