"""`plan_tensor`: one tensor's plan, planned once per canonical problem and cached.

A plan depends on the ranks only through their mesh positions and the equalities between their
domains and devices, so it is planned over mesh positions (domains and devices numbered by first
appearance) and renamed back: pipeline stages or expert owners that differ only by their ranks
share one canonical plan. `plan_tensor_direct` is the straightforward reference. Never imports
Ray or the runtime.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from ..layout.layout import Layout, LayoutUnion
from ..layout.mesh import Mesh
from .bound import tensor_stats
from .moves import PlanError, Topology, forget_interned
from .planner import plan_moves, verify_cover
from .tensor_plan import TensorPlan, clear_rank_caches

__all__ = ["plan_tensor", "plan_tensor_direct", "canonical_plan", "clear_caches"]


@lru_cache(maxsize=1 << 14)
def plan_tensor(spec_signature: tuple, topo: Topology, rotation: int = 0) -> TensorPlan:
    """Plan one tensor signature (see TensorSpec.signature) on a topology. Cached.

    The plan depends on the ranks only through their mesh positions and the equalities between
    their domains and devices. So the planning itself runs once per *canonical* problem (ranks
    renamed to mesh positions, domains and devices to first-appearance numbers), and the result
    is renamed back. Pipeline stages or expert owners that differ only by which ranks they use
    share one canonical plan.

    `rotation` shifts which source replica wins a tie in load. When a tensor has fewer pieces
    than source replicas, some replicas send nothing; `plan()` then gives the tensors laid out
    alike successive rotations (see `TensorPlan.rotations`) so the load spreads across tensors.
    """
    shape, itemsize, src_layout, dst_layout = spec_signature
    sranks, dranks = src_layout.mesh.ranks, dst_layout.mesh.ranks
    canon_topo = _canonical_topology(src_layout.mesh, dst_layout.mesh, topo)
    canon = canonical_plan(shape, itemsize, *_layout_key(src_layout), *_layout_key(dst_layout),
                            canon_topo,
                            rotation % _rotations_of(shape, itemsize, src_layout, dst_layout,
                                                     canon_topo) if rotation else 0)
    if src_layout.mesh.in_order and dst_layout.mesh.in_order:
        return canon
    return TensorPlan.renamed(canon, sranks, dranks)


def _layout_key(layout) -> tuple:
    """(mesh shape, placements) of a layout, rank ids left out; for a LayoutUnion, each
    part's, tagged "union" (its canonical parts take consecutive positions, part by part)."""
    if type(layout) is LayoutUnion:
        return (("union",) + tuple([p.mesh.shape for p in layout.parts]),
                tuple([p.placements for p in layout.parts]))
    return layout.mesh.shape, layout.placements


def plan_tensor_direct(spec_signature: tuple, topo: Topology, rotation: int = 0) -> TensorPlan:
    """What `plan_tensor` computes, the straightforward way: planned on the signature's own
    ranks and topology (no canonical problem, no renaming, no caches), its cover verified and
    its statistics computed from these moves. The reference the shared path is checked
    against; for meshes that list their ranks in increasing order the two are identical (tie
    breaks follow rank order here and mesh order there)."""
    shape, itemsize, src_layout, dst_layout = spec_signature
    _check_ranks("src", src_layout.mesh.ranks, topo.n_src)
    _check_ranks("dst", dst_layout.mesh.ranks, topo.n_dst)
    moves, rotations = plan_moves(shape, itemsize, src_layout, dst_layout, topo, 0)
    if rotation % rotations:
        moves, _ = plan_moves(shape, itemsize, src_layout, dst_layout, topo,
                               rotation % rotations)
    verify_cover(shape, dst_layout, moves)
    return TensorPlan(shape, itemsize, moves,
                      tensor_stats(shape, itemsize, src_layout, dst_layout, topo, moves), rotations)


def _rotations_of(shape, itemsize, src_layout, dst_layout, canon_topo) -> int:
    return canonical_plan(shape, itemsize, *_layout_key(src_layout), *_layout_key(dst_layout),
                           canon_topo, 0).rotations


@lru_cache(maxsize=1 << 12)
def _canonical_topology(src_mesh: Mesh, dst_mesh: Mesh, topo: Topology) -> Topology:
    """Domains and devices of the two meshes' ranks (in mesh order), as canonical labels.

    Each side numbers its domain (device) ids 0, 1, ... by first appearance in mesh order; a
    destination id that is not also a source id becomes -1, -2, ... instead, and one that is a
    source id takes that id's label. Equal problems up to renaming get the same topology object
    (the plan cache then finds it by identity, not by comparing every rank's labels).
    """
    sdom, sdev, sdom_of, sdev_of = _side_labels(src_mesh, topo, "src")
    ddom, ddev, ddom_of, ddev_of = _side_labels(dst_mesh, topo, "dst")
    parts = (sdom, _link(ddom, ddom_of, sdom_of), sdev, _link(ddev, ddev_of, sdev_of))
    # Label tuples are interned, so equal topologies have the very same parts: look them up
    # by identity instead of hashing every rank's labels for each mesh pair.
    key = tuple(map(id, parts))
    known = _BY_LABEL_IDS.get(key)
    if known is None:
        if len(_BY_LABEL_IDS) >= 1 << 12:
            _BY_LABEL_IDS.clear()
        known = _BY_LABEL_IDS[key] = (Topology(*parts), parts)    # the parts kept alive
    return known[0]


_BY_LABEL_IDS: dict = {}   # ids of the four label tuples -> (their Topology, the tuples)


@lru_cache(maxsize=1 << 12)
def _labels(labels: tuple) -> tuple:
    """The first tuple seen equal to `labels`."""
    return labels


def _link(labels: tuple, own: dict, other: dict) -> tuple:
    """Destination labels: -(first-appearance number + 1), or the source label of the same id."""
    shared = own.keys() & other.keys()
    if not shared:
        return labels
    remap = {own[v]: other[v] for v in shared}
    return _labels(tuple([remap.get(x, x) for x in labels]))


@lru_cache(maxsize=1 << 12)
def _side_labels(mesh: Mesh, topo: Topology, side: str):
    """First-appearance labels of the domains and devices of `mesh`'s ranks on `side`
    (interned tuples)."""
    ranks = mesh.ranks
    _check_ranks(side, ranks, topo.n_src if side == "src" else topo.n_dst)
    domains = topo.src_domains if side == "src" else topo.dst_domains
    devices = topo.src_devices if side == "src" else topo.dst_devices
    dom_of: dict = {}
    dev_of: dict = {}
    if side == "src":
        dom = tuple([dom_of.setdefault(domains[r], len(dom_of)) for r in ranks])
        dev = tuple([dev_of.setdefault(devices[r], len(dev_of)) for r in ranks])
    else:
        dom = tuple([dom_of.setdefault(domains[r], -1 - len(dom_of)) for r in ranks])
        dev = tuple([dev_of.setdefault(devices[r], -1 - len(dev_of)) for r in ranks])
    return _labels(dom), _labels(dev), dom_of, dev_of


def _check_ranks(side: str, ranks: Sequence[int], n: int) -> None:
    top = max(ranks)
    if top >= n:
        raise PlanError(f"the {side} mesh uses rank {top}, but the topology has only {n} {side} "
                        f"ranks (0..{n - 1})")


@lru_cache(maxsize=256)
def _canonical_layout(mesh_shape: tuple, placements: tuple):
    if mesh_shape and mesh_shape[0] == "union":
        parts, start = [], 0
        for shape, pls in zip(mesh_shape[1:], placements):
            parts.append(Layout(Mesh.from_shape(shape, start=start), pls))
            start += parts[-1].mesh.size
        return LayoutUnion(parts)
    return Layout(Mesh.from_shape(mesh_shape), placements)


@lru_cache(maxsize=1 << 12)
def canonical_plan(shape, itemsize, src_mesh_shape, src_placements, dst_mesh_shape,
                    dst_placements, topo: Topology, rotation: int) -> TensorPlan:
    """The plan over ranks 0..n-1 (mesh positions), verified."""
    src_layout = _canonical_layout(src_mesh_shape, src_placements)
    dst_layout = _canonical_layout(dst_mesh_shape, dst_placements)
    moves, rotations = plan_moves(shape, itemsize, src_layout, dst_layout, topo, rotation)
    verify_cover(shape, dst_layout, moves)
    return TensorPlan(shape, itemsize, moves,
                      tensor_stats(shape, itemsize, src_layout, dst_layout, topo, moves), rotations)


def clear_caches() -> None:
    """Forget every cached plan, box and interned object (for benchmarks and tests)."""
    from ..layout.layout import rank_box, rank_boxes

    plan_tensor.cache_clear()
    canonical_plan.cache_clear()
    _canonical_layout.cache_clear()
    _side_labels.cache_clear()
    _canonical_topology.cache_clear()
    _labels.cache_clear()
    _BY_LABEL_IDS.clear()
    rank_boxes.cache_clear()
    rank_box.cache_clear()
    clear_rank_caches()
    forget_interned()
