"""A network lower bound from the layouts alone, computed without the planner.

Ranks fill NVLink domains in order on each side (rank r in domain r // gpus_per_domain), and
training and inference ranks are different GPUs, each with its own NIC. Then, whatever a plan
does:

* destination domain D needs every element any of its ranks holds; none is inside D before the
  refit, so D's distinct needed bytes enter over D's own NICs at least once:
  `needed[D] / (ranks of D * nic)`;
* source domain S holds some needed elements that no other source domain holds; those leave S
  over S's own NICs at least once: `only_here[S] / (ranks of S * nic)`; and every destination
  domain's needed bytes leave some source NIC: `sum(needed) / (all source ranks * nic)`.

The bound is the largest of these. `check_plan` compares a plan's network bytes into each
destination domain with `needed` (a plan can never move less); the simulator's own bound
(busiest NIC of the plan's moves) is a property of the plan, this one of the layouts.

Union volumes are exact: per tensor, the boxes' cut points split every dimension into
intervals, and each box marks a block of that (small) grid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np


@dataclass
class LayoutBound:
    """Bytes each domain must move over its NICs and the resulting seconds."""

    gpus_per_domain: int
    nic_Bps: float
    needed: list             # per destination domain: distinct bytes needed from outside
    only_here: list          # per source domain: needed bytes no other source domain holds
    dst_ranks: list          # ranks per destination domain
    src_ranks: list          # ranks per source domain
    n_src: int
    dst_s: float = 0.0       # the busiest destination domain's needed bytes over its NICs
    src_s: float = 0.0       # the same for the source side (forced or spread over all)
    bound_s: float = 0.0
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"bound_s": self.bound_s, "dst_s": self.dst_s, "src_s": self.src_s,
                "needed_bytes": int(sum(self.needed)),
                "busiest_dst_domain_bytes": int(max(self.needed, default=0)),
                "busiest_src_domain_only_here_bytes": int(max(self.only_here, default=0)),
                "gpus_per_domain": self.gpus_per_domain, "nic_Bps": self.nic_Bps}


def _grid(boxes: list) -> tuple:
    """Per dimension, the sorted cut points of `boxes` and the width of each interval."""
    nd = len(boxes[0].sizes)
    cuts = []
    for d in range(nd):
        pts = sorted({b.offsets[d] for b in boxes} | {b.offsets[d] + b.sizes[d] for b in boxes})
        cuts.append(np.asarray(pts, dtype=np.int64))
    return cuts


def _block(cuts: list, box) -> tuple:
    """The grid block (a tuple of slices) a box covers."""
    return tuple(slice(int(np.searchsorted(c, o)), int(np.searchsorted(c, o + s)))
                 for c, o, s in zip(cuts, box.offsets, box.sizes))


def tensor_needs(src_boxes: dict, dst_boxes: dict, n_src_dom: int, n_dst_dom: int, g: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Elements of one tensor: (needed per destination domain, needed and held by no other
    source domain per source domain). `*_boxes`: {rank: Box} of the ranks holding a part."""
    needed = np.zeros(n_dst_dom, dtype=np.int64)
    only = np.zeros(n_src_dom, dtype=np.int64)
    dst = {r: b for r, b in dst_boxes.items() if b is not None and b.numel > 0}
    src = {r: b for r, b in src_boxes.items() if b is not None and b.numel > 0}
    if not dst:
        return needed, only
    some = next(iter(dst.values()))
    if not some.sizes:                         # a 0-d tensor: one element
        for r in dst:
            needed[r // g] = 1
        doms = {r // g for r in src}
        if len(doms) == 1:
            only[doms.pop()] = 1
        return needed, only
    cuts = _grid(list(dst.values()) + list(src.values()))
    widths = [np.diff(c) for c in cuts]
    vol = widths[0]
    for w in widths[1:]:
        vol = np.multiply.outer(vol, w)
    shape = vol.shape
    any_needed = np.zeros(shape, dtype=bool)
    per_dom: dict = {}
    for r, b in dst.items():
        m = per_dom.setdefault(r // g, np.zeros(shape, dtype=bool))
        m[_block(cuts, b)] = True
    for d, m in per_dom.items():
        needed[d] = int(vol[m].sum())
        any_needed |= m
    holders = np.zeros(shape, dtype=np.int32)
    owner = np.full(shape, -1, dtype=np.int32)
    src_dom: dict = {}
    for r, b in src.items():
        m = src_dom.setdefault(r // g, np.zeros(shape, dtype=bool))
        m[_block(cuts, b)] = True
    for d, m in src_dom.items():
        holders += m
        owner[m] = d
    alone = any_needed & (holders == 1)
    if alone.any():
        np.add.at(only, owner[alone], vol[alone])
    return needed, only


def layout_bound(specs: Iterable, n_src: int, n_dst: int, gpus_per_domain: int,
                 nic_Bps: float, progress=None) -> LayoutBound:
    """The network lower bound of refitting `specs` (TensorSpecs) from `n_src` to `n_dst`
    ranks, `gpus_per_domain` ranks per NVLink domain on each side, `nic_Bps` per NIC."""
    g = gpus_per_domain
    n_sd, n_dd = -(-n_src // g), -(-n_dst // g)
    needed = np.zeros(n_dd, dtype=np.int64)
    only = np.zeros(n_sd, dtype=np.int64)
    cache: dict = {}
    specs = list(specs)
    for i, spec in enumerate(specs):
        key = (spec.src, spec.dst, tuple(spec.shape))
        got = cache.get(key)
        if got is None:
            got = cache[key] = tensor_needs(
                {r: b for r, b in spec.src.boxes(spec.shape).items() if r < n_src},
                {r: b for r, b in spec.dst.boxes(spec.shape).items() if r < n_dst},
                n_sd, n_dd, g)
        needed += got[0] * spec.itemsize
        only += got[1] * spec.itemsize
        if progress is not None and i % 4096 == 0:
            progress(i, len(specs))
    dst_ranks = [min(g, n_dst - d * g) for d in range(n_dd)]
    src_ranks = [min(g, n_src - s * g) for s in range(n_sd)]
    out = LayoutBound(g, nic_Bps, needed.tolist(), only.tolist(), dst_ranks, src_ranks, n_src)
    out.dst_s = float(max((n / (k * nic_Bps) for n, k in zip(needed, dst_ranks)), default=0.0))
    forced = float(max((n / (k * nic_Bps) for n, k in zip(only, src_ranks)), default=0.0))
    out.src_s = float(max(forced, float(needed.sum()) / (n_src * nic_Bps) if n_src else 0.0))
    out.bound_s = max(out.dst_s, out.src_s)
    return out


def check_plan(bound: LayoutBound, recv_bytes_by_rank: dict) -> Optional[str]:
    """None when the plan's network bytes into every destination domain are at least what
    that domain needs from outside; else what fell short (a planner bug)."""
    g = bound.gpus_per_domain
    got = [0] * len(bound.needed)
    for r, n in recv_bytes_by_rank.items():
        got[r // g] += int(n)
    short = [(d, got[d], need) for d, need in enumerate(bound.needed) if got[d] < need]
    if not short:
        return None
    d, have, need = short[0]
    return (f"the plan moves {have} B into destination domain {d}, which needs {need} B from "
            f"outside ({len(short)} domains short)")
