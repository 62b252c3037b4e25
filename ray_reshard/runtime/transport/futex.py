"""Words of shared memory that two processes synchronise on: 64-bit atomics and futexes.

`shared_atomics()` gives sequentially consistent 64-bit loads, stores and fetch-adds through
libatomic (None members where it is missing: plain aligned accesses are then correct on x86
only); `shared_futex()` sleeps on and wakes a 32-bit word (`ok` False off Linux on x86-64 or
aarch64). Both are made once per process; `RAY_RESHARD_SHM_NO_ATOMICS` and
`RAY_RESHARD_SHM_NO_FUTEX` switch them off. Nothing here knows about rings.
"""
from __future__ import annotations

import ctypes
import ctypes.util as ctypes_util
import os
import platform
import sys
from typing import Callable, Optional

__all__ = ["Atomics", "Futex", "shared_atomics", "shared_futex"]

_SEQ_CST = 5


class Atomics:
    """Sequentially consistent 64-bit loads/stores/fetch-adds on raw addresses (libatomic)."""

    def __init__(self):
        self.load: Optional[Callable[[int], int]] = None
        self.store: Optional[Callable[[int, int], None]] = None
        self.fetch_add: Optional[Callable[[int, int], int]] = None
        if os.environ.get("RAY_RESHARD_SHM_NO_ATOMICS"):
            return
        lib = None
        for cand in ("libatomic.so.1", "libatomic.so"):
            try:
                lib = ctypes.CDLL(cand)
                break
            except OSError:
                continue
        if lib is None:
            try:
                path = ctypes_util.find_library("atomic")
                lib = ctypes.CDLL(path) if path else None
            except Exception:
                lib = None
        if lib is None:
            return
        try:
            load = getattr(lib, "__atomic_load_8")
            store = getattr(lib, "__atomic_store_8")
            fadd = getattr(lib, "__atomic_fetch_add_8")
        except AttributeError:
            return
        load.argtypes = [ctypes.c_void_p, ctypes.c_int]
        load.restype = ctypes.c_int64
        store.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        store.restype = None
        fadd.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        fadd.restype = ctypes.c_int64
        self.load = lambda addr: load(addr, _SEQ_CST)
        self.store = lambda addr, v: store(addr, v, _SEQ_CST)
        self.fetch_add = lambda addr, v: fadd(addr, v, _SEQ_CST)


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word of shared memory (process-shared: no
    FUTEX_PRIVATE_FLAG), through libc's syscall(); `ok` is False where unavailable."""

    _WAIT, _WAKE = 0, 1
    _NR = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self):
        self.ok = False
        nr = self._NR.get(platform.machine().lower())
        if nr is None or not sys.platform.startswith("linux") or \
                os.environ.get("RAY_RESHARD_SHM_NO_FUTEX"):
            return
        try:
            self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            return
        self._nr = ctypes.c_long(nr)
        self.ok = True

    def wait(self, addr: int, expected: int, timeout_s: float) -> None:
        """Sleep while the word at `addr` equals `expected` (low 32 bits), at most `timeout_s`;
        returns early on a wake-up, a signal, or a changed word."""
        ts = self._Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        self._syscall(self._nr, ctypes.c_void_p(addr), ctypes.c_int(self._WAIT),
                      ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts),
                      ctypes.c_void_p(None), ctypes.c_int(0))

    def wake(self, addr: int) -> None:
        self._syscall(self._nr, ctypes.c_void_p(addr), ctypes.c_int(self._WAKE),
                      ctypes.c_int(0x7FFFFFFF), ctypes.c_void_p(None), ctypes.c_void_p(None),
                      ctypes.c_int(0))


_futex: Optional[Futex] = None
_atomics: Optional[Atomics] = None


def shared_futex() -> Futex:
    """The process's Futex (made on first use)."""
    global _futex
    if _futex is None:
        _futex = Futex()
    return _futex


def shared_atomics() -> Atomics:
    """The process's Atomics (made on first use)."""
    global _atomics
    if _atomics is None:
        _atomics = Atomics()
    return _atomics
