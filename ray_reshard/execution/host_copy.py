"""Copy tables on host memory: a table's regions copied in one pass, one `memmove` each.

On CPU a foreach copy runs a `copy_` per region, with its own dispatch besides the bytes, so
a part with thousands of small items pays that cost thousands of times. This engine takes only
regions that are one contiguous row on both sides (`strided` False: parts put only those on
its tables; strided regions stay with foreach, whose inner loop copies strided rows faster
than a call per row would). A pass is one call into `host_copy.cpp` (built on first use, see
`native`) over the table's address arrays, made once per table and bucket address; where it
cannot be built, `ctypes.memmove` per region through `itertools.starmap` (one C call per
region, no Python per region) and `why_not()` says why.
"""
from __future__ import annotations

import ctypes
import importlib.resources
import threading
import warnings
from collections import deque
from itertools import starmap
from typing import Optional

import numpy as np
import torch

from . import native
from .regions import Table, wire_base

_CALLS_KEPT = 8      # bucket addresses per table whose calls are kept (staging buffers, slots)
SOURCE = (importlib.resources.files(__package__) / "host_copy.cpp").read_text()


class HostMemmove:
    """Runs a table of single-row regions on host memory (see the module docstring)."""

    name = "memmove"
    strided = False      # only regions that are one contiguous row on both sides

    def __init__(self):
        self._lock = threading.Lock()
        self._rows = None            # the compiled rr_copy_rows, once looked for
        self.why_not: Optional[str] = None

    def kernel(self):
        """The compiled pass over a table, or None where it cannot be built (`why_not`)."""
        if self._rows is None and self.why_not is None:
            with self._lock:
                if self._rows is None and self.why_not is None:
                    try:
                        lib, _ = native.load_any("host_copy", SOURCE)
                        f = lib.rr_copy_rows
                        f.restype = None
                        f.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3
                        self._rows = f
                    except Exception as e:
                        self.why_not = f"{type(e).__name__}: {e}"
                        warnings.warn(f"ray_reshard: host copy tables run one ctypes.memmove "
                                      f"call per region ({self.why_not}); small items cost "
                                      f"more", RuntimeWarning, stacklevel=2)
        return self._rows

    def upload(self, tables: list, device: torch.device) -> None:
        compiled = self.kernel() is not None
        for t in tables:
            reg = t.regions
            if len(reg) and (reg[:, 3:6] != 1).any():
                raise ValueError("a memmove table holds one row per region: a strided region "
                                 "was put on it")
            a, b = reg[:, 0].copy(), reg[:, 1].copy()
            nbytes = reg[:, 2] * reg[:, 12]
            if not compiled:
                a, b, nbytes = a.tolist(), b.tolist(), nbytes.tolist()
            t.device_data = (a, b, np.ascontiguousarray(nbytes) if compiled else nbytes, {})

    def copy(self, table: Table, wire: Optional[torch.Tensor], to_wire: bool) -> None:
        """Side A to side B when `to_wire`, else B to A (see `regions.HostCopy.copy`)."""
        a, b, nbytes, kept = table.device_data
        base = wire_base(table, wire)
        calls = kept.get((base, to_wire))
        if calls is None:
            if len(kept) >= _CALLS_KEPT:
                kept.pop(next(iter(kept)))
            calls = kept[(base, to_wire)] = self._calls(a, b, nbytes, base, to_wire)
        if isinstance(calls, tuple):
            self._rows(*calls[0])
        else:
            deque(starmap(ctypes.memmove, calls), 0)

    def _calls(self, a, b, nbytes, base: int, to_wire: bool):
        if isinstance(a, np.ndarray):
            at = b + base if base else b
            dst, src = (at, a) if to_wire else (a, at)
            # the arrays stay referenced beside the addresses the call is given
            return ((len(a), dst.ctypes.data, src.ctypes.data, nbytes.ctypes.data),
                    (dst, src, nbytes))
        at = [base + x for x in b] if base else b
        return list(zip(at, a, nbytes) if to_wire else zip(a, at, nbytes))


_ENGINE = HostMemmove()


def engine() -> HostMemmove:
    """The process's host copy engine."""
    return _ENGINE


def why_not() -> Optional[str]:
    """Why the compiled pass is not available here (None: it is; the engine then makes one
    `ctypes.memmove` call per region)."""
    _ENGINE.kernel()
    return _ENGINE.why_not
