"""Which local tensors share memory: a tensor with itself (through strides), or two tensors.

A strided tensor's bytes are a set of contiguous runs: the innermost dims that are dense make one
run, every other dim repeats it. Overlap questions are answered exactly on those runs (sorted run
starts, one vectorised sweep); tensors too fragmented to list (more than `MAX_RUNS` runs) are
answered conservatively ("may overlap").
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

MAX_RUNS = 1 << 22


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that `t` touches (empty tensors: an empty range)."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    es = t.element_size()
    return lo, lo + es + sum((n - 1) * st * es for n, st in zip(t.shape, t.stride()))


def _runs(t: torch.Tensor) -> Optional[tuple[np.ndarray, int]]:
    """(sorted byte starts of the contiguous runs, run length in bytes), or None when too many."""
    es = t.element_size()
    dims = sorted((st * es, n) for n, st in zip(t.shape, t.stride()) if n != 1)
    run, i = es, 0
    while i < len(dims) and dims[i][0] == run:
        run *= dims[i][1]
        i += 1
    outer = dims[i:]
    count = 1
    for _, n in outer:
        count *= n
    if count > MAX_RUNS:
        return None
    starts = np.array([t.data_ptr()], dtype=np.int64)
    for st, n in outer:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * st).ravel()
    starts.sort()
    return starts, run


def _nested(t: torch.Tensor) -> bool:
    """True when each stride exceeds everything the inner dims span: no element repeats."""
    span = 0
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if st <= span:
            return False
        span += (n - 1) * st
    return True


def overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of `t` share memory (or that cannot be ruled out)."""
    if t.numel() <= 1 or _nested(t):
        return False
    runs = _runs(t)
    if runs is None:
        return True
    starts, run = runs
    return bool(np.any(starts[1:] < starts[:-1] + run))


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `a` and `b` share at least one byte (or that cannot be ruled out)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (alo, ahi), (blo, bhi) = byte_range(a), byte_range(b)
    if ahi <= blo or bhi <= alo:
        return False
    if alo == blo:
        return True
    ra, rb = _runs(a), _runs(b)
    if ra is None or rb is None:
        return True
    (sa, la), (sb, lb) = ra, rb
    # For each run of b: the last run of a starting at or before it, and the first after it.
    i = np.searchsorted(sa, sb, side="right")
    before = i > 0
    if np.any(sa[np.maximum(i - 1, 0)][before] + la > sb[before]):
        return True
    after = i < len(sa)
    return bool(np.any(sa[np.minimum(i, len(sa) - 1)][after] < sb[after] + lb))


def overlapping_pairs(first: Sequence[torch.Tensor],
                      second: Optional[Sequence[torch.Tensor]] = None) -> list[tuple[int, int]]:
    """Index pairs (i, j) with first[i] and second[j] sharing memory; without `second`, pairs
    i < j within `first`. A sweep over byte ranges finds candidates in O(n log n); only those
    are checked exactly."""
    one = second is None
    second = first if one else second
    events = [(*byte_range(t), 0, i) for i, t in enumerate(first) if t.numel()]
    if not one:
        events += [(*byte_range(t), 1, j) for j, t in enumerate(second) if t.numel()]
    events.sort()
    out = []
    open_: list = []            # (end, which list, index) of ranges still open
    for lo, hi, which, idx in events:
        open_ = [o for o in open_ if o[0] > lo]
        for end, w, k in open_:
            if one or w != which:
                i, j = (k, idx) if (one or w == 0) else (idx, k)
                ti, tj = first[i], second[j]
                if ti.device == tj.device and overlap(ti, tj):
                    out.append((min(i, j), max(i, j)) if one else (i, j))
        open_.append((hi, which, idx))
    return sorted(set(out))
