"""Host C++ built on first use: a source shipped beside these modules compiled with the host's
compiler, cached on disk (one file per source, flags, compiler and CPU; one process of a host
builds it, the others wait and load it) and loaded with ctypes."""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

FLAGS = ("-O3", "-march=native")          # the host's own instruction set (cached per CPU)


def compiler():
    """The C++ compiler sources are built with ($CXX, else g++ or c++ on PATH), or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def load(name: str, source: str, flags=FLAGS) -> tuple[ctypes.CDLL, str]:
    """(the library, its path): `source` compiled with `flags`, or the cached build of it;
    raises RuntimeError on a missing compiler or a failed build (its output in the message)."""
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
        path = os.path.join(d, f"{name}_{key}.so")
        if not os.path.exists(path):
            try:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, f"{name}_{key}.lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)      # one process of the host builds it
                    if not os.path.exists(path):
                        _compile(cxx, flags, source, d, path)
            except OSError as e:
                errors.append(f"{d}: {e}")
                continue
        return ctypes.CDLL(path), path
    raise RuntimeError("no writable directory for the compiled library: " + "; ".join(errors))


def load_any(name: str, source: str) -> tuple[ctypes.CDLL, str]:
    """`load` with the host's own instruction set, else with plain -O3 (a compiler that
    does not know -march=native)."""
    try:
        return load(name, source)
    except RuntimeError:
        if compiler() is None:
            raise
        return load(name, source, ("-O3",))


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
