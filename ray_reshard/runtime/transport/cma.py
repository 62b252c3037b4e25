"""Single-copy reads from another process on this node: Linux's cross-memory attach.

`read(pid, local, remote)` copies the bytes that `remote` lists in process `pid` (rows of
(address, length) in that process) into the bytes `local` lists in this one, in order, with
`process_vm_readv`: the kernel copies straight between the two address spaces, so a forward
through a shared-memory ring costs one copy instead of two (into the slot, out of it).
The two lists need not cut the bytes in the same places; rows that continue one another in
memory are read as one, and each call takes at most `IOV_MAX` rows of each.

The kernel allows it where this process may ptrace the other (same user and, under Yama's
`ptrace_scope` 1 or above, a ptrace relationship or CAP_SYS_PTRACE): `shm.ShmRing` probes that
once per ring and falls back to copying through its slots where it is refused.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

import numpy as np

from ...errors import TransportError

__all__ = ["available", "read", "IOV_MAX"]

IOV_MAX = 1024

_fn = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _fn = _libc.process_vm_readv
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                        ctypes.c_ulong, ctypes.c_ulong]
    except (OSError, AttributeError):
        _fn = None


def available() -> bool:
    """Whether this platform has `process_vm_readv` at all (not whether a peer allows it)."""
    return _fn is not None


def _merged(rows: np.ndarray) -> np.ndarray:
    """`rows` with each run of rows that continue one another in memory as one row (a fused
    tensor's items, consecutive experts): the kernel pays per row it pins, not per byte."""
    if len(rows) < 2:
        return rows
    starts = np.ones(len(rows), dtype=bool)
    starts[1:] = rows[1:, 0] != rows[:-1, 0] + rows[:-1, 1]
    at = np.flatnonzero(starts)
    if len(at) == len(rows):
        return rows
    out = np.empty((len(at), 2), dtype=np.int64)
    out[:, 0] = rows[at, 0]
    out[:, 1] = np.add.reduceat(rows[:, 1], at)
    return out


def _window(rows: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The rows that cover bytes [lo, hi) of `rows`' stream (`ends`: its cumulative lengths),
    the first and last trimmed to that range."""
    i = int(np.searchsorted(ends, lo, side="right"))
    k = int(np.searchsorted(ends, hi, side="left"))
    out = rows[i:k + 1].copy()
    skip = lo - (int(ends[i]) - int(rows[i, 1]))
    out[0, 0] += skip
    out[0, 1] -= skip
    out[-1, 1] -= int(ends[k]) - hi
    return out


def read(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """Copy the bytes `remote` lists in process `pid` into those `local` lists here (each an
    (n, 2) int64 array of address, length, the same total); returns the bytes copied. A refusal
    or a short copy is a TransportError naming the process and the reason."""
    if _fn is None:
        raise TransportError("process_vm_readv is not available on this platform")
    local = _merged(np.ascontiguousarray(local[local[:, 1] > 0], dtype=np.int64))
    remote = _merged(np.ascontiguousarray(remote[remote[:, 1] > 0], dtype=np.int64))
    total = int(local[:, 1].sum())
    if total != int(remote[:, 1].sum()):
        raise TransportError(f"cross-memory read from process {pid}: {total} bytes here, "
                             f"{int(remote[:, 1].sum())} listed there")
    if len(local) <= IOV_MAX and len(remote) <= IOV_MAX:
        calls = [(local, remote, total)] if total else []
    else:    # each call at most IOV_MAX rows a side: cut both where the shorter reach ends
        lend, rend = np.cumsum(local[:, 1]), np.cumsum(remote[:, 1])
        calls, pos, i, j = [], 0, 0, 0
        while pos < total:
            i = int(np.searchsorted(lend, pos, side="right"))
            j = int(np.searchsorted(rend, pos, side="right"))
            end = min(int(lend[min(i + IOV_MAX, len(lend)) - 1]),
                      int(rend[min(j + IOV_MAX, len(rend)) - 1]))
            calls.append((_window(local, lend, pos, end), _window(remote, rend, pos, end),
                          end - pos))
            pos = end
    done = 0
    for lo, re_, want in calls:
        got = _fn(pid, lo.ctypes.data, len(lo), re_.ctypes.data, len(re_), 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            why = os.strerror(err) if err else f"{got} of {want} bytes"
            raise TransportError(f"cross-memory read from process {pid} failed: {why}")
        done += got
    return done


def probe(pid: int, address: int, expect: bytes) -> Optional[str]:
    """None when `len(expect)` bytes at `address` in process `pid` read back as `expect`,
    else why not (refused, no such process, other bytes there)."""
    if _fn is None:
        return "process_vm_readv is not available on this platform"
    buf = np.zeros(len(expect), dtype=np.uint8)
    try:
        read(pid, np.array([[buf.ctypes.data, len(expect)]], dtype=np.int64),
             np.array([[address, len(expect)]], dtype=np.int64))
    except TransportError as e:
        return str(e)
    return None if buf.tobytes() == expect else f"other bytes at {address:#x} in process {pid}"
