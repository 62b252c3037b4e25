"""Filling new destination ranks from a replica that already holds the weights.

A new inference engine (or one that restarted) can take the current version from a replica of
the same weights instead of from the trainers: the replica's ranks act as the sources of a
refit whose destinations are the new ranks, so adding engines does not touch the trainers.
`replica_specs` turns a refit's specs into such a refit's specs; `ReshardGroup.join` runs
that refit and copies only from a replica that holds the group's version.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Union

from .layout import Layout
from .mesh import Mesh
from .spec import TensorSpec

DstLayouts = Union[None, Layout, Mapping[str, Layout], Callable[[str, TensorSpec], Layout]]


def replica_specs(specs: Mapping[str, TensorSpec], which: Mapping[Any, int],
                  dst: DstLayouts = None) -> tuple[dict, list[int]]:
    """Specs of a refit from one replica of `specs`' destinations to new destination ranks.

    `which` picks the replica: a position on each replicated mesh dim of the destination
    layouts, e.g. ``{"dp": 1}``. Returns (specs, ranks): source rank i of the new specs is
    destination rank `ranks[i]` of `specs` (pass those actors as the sources). Destinations:
    by default the new ranks mirror the replica (new rank i holds what `ranks[i]` holds, in the
    same local storages); or give `dst`, a Layout for every tensor, a mapping name -> Layout,
    or a function (name, spec) -> Layout over the new ranks 0..n-1. Sources hold, and
    destinations receive, the destination dtype of `specs`.
    """
    replicas = {}
    for name, spec in specs.items():
        if spec.quant is not None:
            raise ValueError(f"{name!r}: quantised destinations ({spec.quant!r}) cannot be "
                             f"copied from a replica yet; refit them from the sources")
        try:
            replicas[name] = spec.dst.replica(which)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{name!r}: destination layout {spec.dst}: {e}") from None
    ranks = sorted({r for lay in replicas.values() for r in lay.mesh.ranks})
    index = {r: i for i, r in enumerate(ranks)}
    out = {}
    for name, spec in specs.items():
        rep = replicas[name]
        grid = _remap(rep.mesh, index)
        src = Layout(Mesh(grid, rep.mesh.dim_names), rep.placements)
        src_slots = None
        if spec.dst_slots:
            src_slots = {index[r]: sl for r, sl in spec.dst_slots if r in index}
        if dst is None:
            dst_lay, dst_slots = src, src_slots
        else:
            dst_lay = dst if isinstance(dst, Layout) else \
                dst[name] if isinstance(dst, Mapping) else dst(name, spec)
            dst_slots = None
        out[name] = TensorSpec(spec.shape, spec.dtype, src, dst_lay, src_slots=src_slots or None,
                               dst_slots=dst_slots or None)
    return out, ranks


def _remap(mesh: Mesh, index: dict) -> list:
    import numpy as np
    grid = np.asarray([index[r] for r in mesh.ranks], dtype=object).reshape(mesh.shape)
    return grid.tolist()
