"""Copy tables on host memory: a table's regions copied with one `memmove` each, in one pass.

On CPU a foreach copy runs a `copy_` per region, with its own dispatch besides the bytes, so
a part with thousands of small items pays that cost thousands of times. This engine takes only
regions that are one contiguous row on both sides (`strided` False: parts put only those on
its tables; strided regions stay with foreach, whose inner loop copies strided rows faster
than a call per row would). Its calls, (destination, source, bytes) per region, are made once
per table and bucket address and run by `itertools.starmap`, so a pass costs one C call per
region and no Python per region.
"""
from __future__ import annotations

import ctypes
from collections import deque
from itertools import starmap
from typing import Optional

import torch

from .regions import Table, wire_base

_CALLS_KEPT = 8      # bucket addresses per table whose calls are kept (staging buffers, slots)


class HostMemmove:
    """Runs a table of single-row regions on host memory (see the module docstring)."""

    name = "memmove"
    strided = False      # only regions that are one contiguous row on both sides

    def upload(self, tables: list, device: torch.device) -> None:
        for t in tables:
            reg = t.regions
            if len(reg) and (reg[:, 3:6] != 1).any():
                raise ValueError("a memmove table holds one row per region: a strided region "
                                 "was put on it")
            t.device_data = (reg[:, 0].tolist(), reg[:, 1].tolist(),
                             (reg[:, 2] * reg[:, 12]).tolist(), {})

    def copy(self, table: Table, wire: Optional[torch.Tensor], to_wire: bool) -> None:
        """Side A to side B when `to_wire`, else B to A (see `regions.HostCopy.copy`)."""
        a, b, nbytes, kept = table.device_data
        base = wire_base(table, wire)
        calls = kept.get((base, to_wire))
        if calls is None:
            if len(kept) >= _CALLS_KEPT:
                kept.pop(next(iter(kept)))
            at = [base + x for x in b] if base else b
            calls = kept[(base, to_wire)] = list(zip(at, a, nbytes) if to_wire
                                                 else zip(a, at, nbytes))
        deque(starmap(ctypes.memmove, calls), 0)


_ENGINE = HostMemmove()


def engine() -> HostMemmove:
    """The process's host copy engine."""
    return _ENGINE
