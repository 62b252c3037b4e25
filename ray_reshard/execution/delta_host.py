"""The delta codec's host kernel: compare, compact and checksum a bucket in one pass, and apply
a payload straight into the destination's regions with its checksum (see `delta` for the
format). C++ built with the host's compiler on first use (`native`); `why_not()` says why it
is not there. The kernel's source (and what it does, pass by pass) is `delta_host.cpp` beside
this module.
"""
from __future__ import annotations

import ctypes
import importlib.resources
import threading
import warnings
from typing import Optional

from . import native

# The kernel's C++ source, shipped beside this module (package data).
SOURCE = (importlib.resources.files(__package__) / "delta_host.cpp").read_text()

_LOCK = threading.Lock()
_KERNEL = None
_FAILED: Optional[str] = None


class HostKernel:
    """The compiled kernel's two entry points (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._encode = lib.rr_delta_encode
        self._encode.restype = i64
        self._encode.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                                 ctypes.c_double, ptr]
        self._copy_rest = lib.rr_delta_copy_rest
        self._copy_rest.restype = None
        self._copy_rest.argtypes = [ptr, i64, ptr, i64, i64]
        self._to_index = lib.rr_delta_bits_to_index
        self._to_index.restype = i64
        self._to_index.argtypes = [ptr, i64, ptr, i64]
        self._apply = lib.rr_delta_apply
        self._apply.restype = i64
        self._apply.argtypes = [i64, ptr, i64, ptr, i64, i64, i64, ptr]

    def encode(self, rows, base: int, out: int, out_bytes: int, g: int, n: int, dense_at: int,
               probe_every: int, probe_from: int, mostly: float, defer: bool = False
               ) -> tuple[int, int, Optional[int]]:
        """(checksum as unsigned, granules changed, None or, stopped dense, the granule it
        stopped at) of rows `rows` ((k, 2) int64, C order) against the baseline at address
        `base`; with `defer`, the baseline's rest after a dense stop is left to `copy_rest`."""
        import numpy as np
        res = np.zeros(4, dtype=np.uint64)
        code = self._encode(rows.ctypes.data, len(rows), base, out, out_bytes, g, n, int(defer),
                            dense_at, probe_every, probe_from, mostly, res.ctypes.data)
        if code < 0:
            raise ValueError(f"delta kernel: granule {g} is not 1, 2, 4 or 8")
        return int(res[0]), int(res[1]), (int(res[3]) if code else None)

    def copy_rest(self, rows, base: int, g: int, start: int) -> None:
        """The baseline at `base` takes the rows' granules from `start` on."""
        self._copy_rest(rows.ctypes.data, len(rows), base, g, start)

    def bits_to_index(self, bits: int, n: int, idx: int, cap: int) -> int:
        """Write the indices of the set bits among the first `n` at `bits` to `idx` (int32, at
        most `cap`); returns how many."""
        return self._to_index(bits, n, idx, cap)

    def apply(self, kind: int, rows, payload: int, size: int, g: int, n: int) -> Optional[int]:
        """The checksum (unsigned) of the rows after applying the payload (kind 0: nothing to
        apply, 1: mask, 2: index), or None when the payload does not fit the bucket (nothing
        written then)."""
        import numpy as np
        res = np.zeros(2, dtype=np.uint64)
        code = self._apply(kind, rows.ctypes.data, len(rows), payload, size, g, n,
                           res.ctypes.data)
        if code == -2:
            raise ValueError(f"delta kernel: kind {kind} or granule {g} unknown")
        return None if code else int(res[0])


def build(flags=native.FLAGS, source: str = SOURCE) -> HostKernel:
    """Compile `source` with `flags` (or load it from the cache) and load it; raises on a
    missing compiler or a failed build (its output in the message)."""
    return HostKernel(*native.load("delta", source, flags))


def kernel() -> Optional[HostKernel]:
    """The process's host kernel, built on first use, or None where it cannot be (see
    `why_not`; the codec then runs torch ops, and a warning says why once)."""
    global _KERNEL, _FAILED
    if _KERNEL is None and _FAILED is None:
        with _LOCK:
            if _KERNEL is None and _FAILED is None:
                try:
                    _KERNEL = HostKernel(*native.load_any("delta", SOURCE))
                except Exception as e:
                    _FAILED = f"{type(e).__name__}: {e}"
                    warnings.warn(f"ray_reshard: the delta codec's host kernel is not available "
                                  f"({_FAILED}); host buckets are encoded with torch ops, "
                                  f"several times slower", RuntimeWarning, stacklevel=2)
    return _KERNEL


def loaded() -> bool:
    """Whether this process holds the built kernel already (builds nothing)."""
    return _KERNEL is not None


def why_not() -> Optional[str]:
    """Why the host kernel is not available here (None: it is)."""
    kernel()
    return _FAILED
