"""Several destination groups in one refit.

`combine_destinations` joins the spec sets of several destination groups (prefill engines in
TP8, decode engines in TP2, engines of another version...), each written over its own ranks
0..n-1, into one spec set over their concatenated ranks: group g's rank r becomes
`offset[g] + r`, where the offsets add up the groups' sizes in order, so the destination actors
are the groups' actor lists concatenated in the same order.

A tensor the groups receive alike (same dtype and quantisation) becomes one spec whose `dst` is a
`LayoutUnion` of the groups' layouts: the planner then sends each region into an NVLink domain
once for all groups together, and the plan's lower bound counts all of them. A tensor the groups
receive differently (BF16 in one, FP8 in another: different bytes) stays one spec per kind, the
later ones named `<name>#<group>`, with explicit slots so every rank still finds its storage under
the tensor's own name.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from .layout import Layout, LayoutUnion
from .mesh import Mesh
from .spec import Slot, Slots, TensorSpec


def combine_destinations(groups, sizes: Optional[Sequence[int]] = None) -> dict[str, TensorSpec]:
    """One spec set for several destination groups fed from the same sources in one refit.

    `groups`: a mapping group label -> {name: TensorSpec}, or a sequence of spec sets (labelled
    "0", "1", ...). Every group's specs use the same sources: a name in several groups must have
    the same shape, source layout, source dtype and source slots in each. `sizes`: each group's
    number of destination actors (default: its highest destination rank + 1).
    """
    if isinstance(groups, Mapping):
        labels = [str(k) for k in groups]
        sets = list(groups.values())
    else:
        sets = list(groups)
        labels = [str(i) for i in range(len(sets))]
    if not sets:
        raise ValueError("combine_destinations needs at least one group of specs")
    for label, specs in zip(labels, sets):
        if not isinstance(specs, Mapping):
            raise TypeError(f"group {label!r} must be a mapping name -> TensorSpec, got "
                            f"{type(specs).__name__}")
        for name, spec in specs.items():
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"group {label!r}: {name!r} must be a TensorSpec, got "
                                f"{type(spec).__name__}")
            if isinstance(spec.dst, LayoutUnion):
                raise ValueError(f"group {label!r}: {name!r} already has several destination "
                                 f"groups (a LayoutUnion); give each group's own specs")
    offsets = _offsets(labels, sets, sizes)

    by_name: dict[str, list[int]] = {}
    for g, specs in enumerate(sets):
        for name in specs:
            by_name.setdefault(name, []).append(g)
    shifted: dict = {}
    out: dict[str, TensorSpec] = {}
    renamed: list[tuple[str, str]] = []
    for name, gs in by_name.items():
        first = sets[gs[0]][name]
        for g in gs[1:]:
            _check_same_source(name, labels[gs[0]], first, labels[g], sets[g][name])
        kinds: dict[tuple, list[int]] = {}
        for g in gs:
            s = sets[g][name]
            kinds.setdefault((s.dtype, s.quant), []).append(g)
        for k, members in enumerate(kinds.values()):
            key = name if k == 0 else f"{name}#{'+'.join(labels[g] for g in members)}"
            out[key] = _joined(name, [sets[g][name] for g in members],
                               [offsets[g] for g in members], shifted, explicit=k > 0)
            if k > 0:
                renamed.append((key, name))
    for key, name in renamed:
        if key in by_name:
            raise ValueError(f"{name!r} travels in several kinds, and its second kind's name "
                             f"{key!r} is already a tensor of the spec sets; rename one")
    return out


def _offsets(labels, sets, sizes) -> list[int]:
    highest = []
    for specs in sets:
        top = -1
        seen: set = set()
        for spec in specs.values():
            if id(spec.dst) not in seen:
                seen.add(id(spec.dst))
                top = max(top, max(spec.dst.mesh.ranks))
        highest.append(top)
    if sizes is None:
        sizes = [h + 1 for h in highest]
    sizes = list(sizes)
    if len(sizes) != len(sets):
        raise ValueError(f"sizes has {len(sizes)} entries for {len(sets)} groups {labels}")
    offsets, at = [], 0
    for label, n, top in zip(labels, sizes, highest):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"size of group {label!r} must be a non-negative int, got {n!r}")
        if top >= n:
            raise ValueError(f"group {label!r} has {n} destination actors (sizes), but its specs "
                             f"use rank {top}")
        offsets.append(at)
        at += n
    return offsets


def _check_same_source(name, la, a: TensorSpec, lb, b: TensorSpec) -> None:
    for field, x, y in (("shape", a.shape, b.shape), ("source layout", a.src, b.src),
                        ("source dtype", a.source_dtype, b.source_dtype),
                        ("source slots", a.src_slots, b.src_slots)):
        if x != y:
            raise ValueError(f"{name!r}: groups {la!r} and {lb!r} give it different {field}s "
                             f"({x} vs {y}); groups fed in one refit share their sources")


def _joined(name: str, specs: list[TensorSpec], offsets: list[int], shifted: dict,
            explicit: bool) -> TensorSpec:
    """One spec for `specs` (one per group, alike but for their destinations)."""
    parts = [_shift(s.dst, off, shifted) for s, off in zip(specs, offsets)]
    dst = parts[0] if len(parts) == 1 else _union(parts, shifted)
    pairs: list = []
    for s, off, lay in zip(specs, offsets, parts):
        have = {} if s.dst_slots is None else {r + off: slot for r, slot in s.dst_slots}
        if explicit:            # renamed: every rank names its storage
            for r in lay.mesh.ranks:
                have.setdefault(r, Slot(name))
        pairs += have.items()
    s0 = specs[0]
    src_slots = s0.src_slots
    if explicit:
        have = {} if src_slots is None else dict(src_slots)
        for r in s0.src.mesh.ranks:
            have.setdefault(r, Slot(name))
        src_slots = Slots.from_pairs(have)
    dst_slots = Slots.from_pairs(pairs) if pairs else None   # one Slot for all when alike
    return TensorSpec(s0.shape, s0.dtype, s0.src, dst, src_dtype=s0.src_dtype,
                      src_slots=src_slots, dst_slots=dst_slots, quant=s0.quant)


def _shift(layout: Layout, offset: int, cache: dict) -> Layout:
    if offset == 0:
        return layout
    key = (layout, offset)
    got = cache.get(key)
    if got is None:
        grid = (np.asarray(layout.mesh.ranks, dtype=np.int64) + offset).reshape(layout.mesh.shape)
        got = cache[key] = Layout(Mesh(grid.tolist(), layout.mesh.dim_names), layout.placements)
    return got


def _union(parts: list[Layout], cache: dict) -> LayoutUnion:
    key = ("union", tuple(parts))
    got = cache.get(key)
    if got is None:
        got = cache[key] = LayoutUnion(parts)
    return got
