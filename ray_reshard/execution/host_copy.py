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

    @property
    def loaded(self) -> bool:
        """Whether the compiled pass is loaded in this process (built or found in the cache)."""
        return self._rows is not None

    def upload(self, tables: list, device: torch.device) -> None:
        for t in tables:
            reg = t.regions
            if len(reg) and (reg[:, 3:6] != 1).any():
                raise ValueError("a memmove table holds one row per region: a strided region "
                                 "was put on it")
            t.device_data = (reg[:, 0].copy(), reg[:, 1].copy(), reg[:, 2] * reg[:, 12], {})

    def copy(self, table: Table, wire: Optional[torch.Tensor], to_wire: bool) -> None:
        """Side A to side B when `to_wire`, else B to A (see `regions.HostCopy.copy`)."""
        a, b, nbytes, kept = table.device_data
        base = wire_base(table, wire)
        run = kept.get((base, to_wire))
        if run is None:
            if len(kept) >= _CALLS_KEPT:
                kept.pop(next(iter(kept)))
            at = b + base
            run = kept[(base, to_wire)] = self._pass(*((at, a) if to_wire else (a, at)), nbytes)
        run()

    def _pass(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray):
        """One pass copying nbytes[i] bytes from src[i] to dst[i], as a call without arguments."""
        rows = self.kernel()
        if rows is not None:
            return lambda: rows(len(dst), dst.ctypes.data, src.ctypes.data, nbytes.ctypes.data)
        calls = list(zip(dst.tolist(), src.tolist(), nbytes.tolist()))
        return lambda: deque(starmap(ctypes.memmove, calls), 0)


_ENGINE = HostMemmove()


def engine() -> HostMemmove:
    """The process's host copy engine."""
    return _ENGINE


def why_not() -> Optional[str]:
    """Why the compiled pass is not available here (None: it is; the engine then makes one
    `ctypes.memmove` call per region)."""
    _ENGINE.kernel()
    return _ENGINE.why_not
