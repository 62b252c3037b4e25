"""The delta codec's host kernel: compare, compact and checksum a bucket in one pass, and apply
a payload straight into the destination's regions with its checksum (see `delta` for the
format). C++ built with the host's compiler on first use (cached on disk per source, flags and
CPU), loaded with ctypes; `why_not()` says why it is not there. The kernel's source (and what
it does, pass by pass) is `delta_host.cpp` beside this module.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Optional

# The kernel's C++ source, shipped beside this module (package data).
SOURCE = (importlib.resources.files(__package__) / "delta_host.cpp").read_text()

_LOCK = threading.Lock()
_KERNEL = None
_FAILED: Optional[str] = None
FLAGS = ("-O3", "-march=native")          # the host's own instruction set (cached per CPU)


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


def _cache_dirs() -> list:
    dirs = []
    if os.environ.get("RAY_RESHARD_KERNEL_CACHE"):
        dirs.append(os.environ["RAY_RESHARD_KERNEL_CACHE"])
    dirs.append(os.path.join(os.environ.get("XDG_CACHE_HOME") or
                             os.path.join(os.path.expanduser("~"), ".cache"), "ray_reshard"))
    dirs.append(os.path.join(tempfile.gettempdir(), f"ray_reshard-{os.getuid()}"))
    return dirs


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags."""
    sig = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    sig.append(line.strip())
                if len(sig) > 3:
                    break
    except OSError:
        pass
    return "\n".join(sig)


def compiler() -> Optional[str]:
    """The C++ compiler the kernel is built with ($CXX, else g++ or c++ on PATH)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(flags=FLAGS, source: str = SOURCE) -> HostKernel:
    """Compile `source` with `flags` (or load it from the cache) and load it; raises on a
    missing compiler or a failed build (its output in the message)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++ on PATH, or $CXX)")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cxx} does not run: {e}") from e
    key = hashlib.sha256("\0".join([source, " ".join(flags), cxx, *version,
                                    _cpu_signature()]).encode()).hexdigest()[:20]
    errors = []
    for d in _cache_dirs():
        path = os.path.join(d, f"delta_{key}.so")
        if not os.path.exists(path):
            try:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"delta_{key}.lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)      # one process of the host builds it
                    if not os.path.exists(path):
                        _compile(cxx, flags, source, d, path)
            except OSError as e:
                errors.append(f"{d}: {e}")
                continue
        return HostKernel(ctypes.CDLL(path), path)
    raise RuntimeError("no writable directory for the compiled kernel: " + "; ".join(errors))


def _compile(cxx: str, flags, source: str, d: str, path: str) -> None:
    fd, src = tempfile.mkstemp(suffix=".cpp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        tmp = src[:-4] + ".so"
        p = subprocess.run([cxx, *flags, "-shared", "-fPIC", "-o", tmp, src],
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"{cxx} {' '.join(flags)} failed: "
                               f"{(p.stderr or p.stdout)[-2000:]}")
        os.replace(tmp, path)             # whole or not at all
    finally:
        os.unlink(src)


def kernel() -> Optional[HostKernel]:
    """The process's host kernel, built on first use, or None where it cannot be (see
    `why_not`; the codec then runs torch ops, and a warning says why once)."""
    global _KERNEL, _FAILED
    if _KERNEL is None and _FAILED is None:
        with _LOCK:
            if _KERNEL is None and _FAILED is None:
                try:
                    try:
                        _KERNEL = build()
                    except RuntimeError:
                        if compiler() is None:
                            raise
                        _KERNEL = build(("-O3",))       # a compiler without -march=native
                except Exception as e:
                    _FAILED = f"{type(e).__name__}: {e}"
                    warnings.warn(f"ray_reshard: the delta codec's host kernel is not available "
                                  f"({_FAILED}); host buckets are encoded with torch ops, "
                                  f"several times slower", RuntimeWarning, stacklevel=2)
    return _KERNEL


def why_not() -> Optional[str]:
    """Why the host kernel is not available here (None: it is)."""
    kernel()
    return _FAILED
