"""Single-copy reads from another process on this node: Linux's cross-memory attach.

`read(pid, local, remote)` copies the bytes that `remote` lists in process `pid` (rows of
(address, length) in that process) into the bytes `local` lists in this one, in order, with
`process_vm_readv`: the kernel copies straight between the two address spaces, so a forward
through a shared-memory ring costs one copy instead of two (into the slot, out of it).
The two lists need not cut the bytes in the same places; each call takes at most `IOV_MAX`
rows of each.

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


def _split(rows: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """`rows` ((address, length) int64) cut at the byte positions `cuts` of its stream."""
    ends = np.cumsum(rows[:, 1])
    starts = ends - rows[:, 1]
    seg_starts = cuts[:-1]
    k = np.searchsorted(ends, seg_starts, side="right")
    out = np.empty((len(seg_starts), 2), dtype=np.int64)
    out[:, 0] = rows[k, 0] + (seg_starts - starts[k])
    out[:, 1] = np.diff(cuts)
    return out


def read(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """Copy the bytes `remote` lists in process `pid` into those `local` lists here (each an
    (n, 2) int64 array of address, length, the same total); returns the bytes copied. A refusal
    or a short copy is a TransportError naming the process and the reason."""
    if _fn is None:
        raise TransportError("process_vm_readv is not available on this platform")
    local = np.ascontiguousarray(local[local[:, 1] > 0], dtype=np.int64)
    remote = np.ascontiguousarray(remote[remote[:, 1] > 0], dtype=np.int64)
    total = int(local[:, 1].sum())
    if total != int(remote[:, 1].sum()):
        raise TransportError(f"cross-memory read from process {pid}: {total} bytes here, "
                             f"{int(remote[:, 1].sum())} listed there")
    if total == 0:
        return 0
    same = (len(local) == len(remote)
            and np.array_equal(local[:, 1], remote[:, 1]))
    if not same:
        cuts = np.union1d(np.concatenate(([0], np.cumsum(local[:, 1]))),
                          np.cumsum(remote[:, 1]))
        local, remote = _split(local, cuts), _split(remote, cuts)
    done = 0
    for i in range(0, len(local), IOV_MAX):
        lo, re_ = local[i:i + IOV_MAX], remote[i:i + IOV_MAX]
        want = int(lo[:, 1].sum())
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
