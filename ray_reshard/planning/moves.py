"""What a plan is made of: endpoints, moves, paths, and the topology of both sides.

Values only, no planning: `Endpoint` (one rank on one side), `Move` (a box going from an
endpoint to a destination rank over a path), `Topology` (every rank's domain and device).
`endpoint` and `new_move` make them on hot paths (shared endpoints, no dataclass __init__).
Never imports Ray or the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from ..layout.box import Box

__all__ = ["LOCAL", "DOMAIN", "NETWORK", "PATHS", "Endpoint", "Move", "Topology", "PlanError",
           "endpoint", "endpoints", "new_move", "forget_interned"]

LOCAL, DOMAIN, NETWORK = "local", "domain", "network"
PATHS = (LOCAL, DOMAIN, NETWORK)


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


class PlanError(ValueError):
    """The planner found the plan inconsistent (a bug or an impossible layout)."""


_ENDPOINTS: dict = {}


def endpoint(side: str, rank: int) -> Endpoint:
    """A shared Endpoint instance (renaming creates hundreds of thousands of moves)."""
    e = _ENDPOINTS.get((side, rank))
    if e is None:
        e = _ENDPOINTS[(side, rank)] = Endpoint(side, rank)
    return e


def endpoints(side: str, n: int) -> tuple[Endpoint, ...]:
    """The shared endpoints of ranks 0..n-1 of `side`, by rank."""
    got = _RANGES.get((side, n))
    if got is None:
        got = _RANGES[(side, n)] = tuple([endpoint(side, r) for r in range(n)])
    return got


_RANGES: dict = {}


_new = object.__new__
_set_src, _set_dst = Move.src.__set__, Move.dst.__set__
_set_box, _set_path = Move.box.__set__, Move.path.__set__


def new_move(src: Endpoint, dst: int, box: Box, path: str) -> Move:
    """Move(src, dst, box, path) without the frozen-dataclass __init__ (hot path)."""
    m = _new(Move)
    _set_src(m, src)
    _set_dst(m, dst)
    _set_box(m, box)
    _set_path(m, path)
    return m


def forget_interned() -> None:
    """Forget the shared endpoints and topologies (for benchmarks and tests)."""
    _ENDPOINTS.clear()
    _RANGES.clear()
    _TOPOLOGIES.clear()
