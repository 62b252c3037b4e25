"""A shared-memory ring: a single-producer single-consumer channel between two processes on one node.

One POSIX shared-memory segment (a plain file under /dev/shm, mode 0600, name
``rr-<32 hex chars>``) holds a header followed by ``slots`` slots of ``slot_bytes`` each::

    [ header (counters, per-slot lengths, abort flag, metadata) | slot 0 | slot 1 | ... ]

The producer asks for a slot with :meth:`ShmRing.send_slot` and gets a ``uint8`` tensor that views
the shared memory directly, packs into it, and publishes it with :meth:`ShmRing.commit_send`. The
consumer gets the next published slot with :meth:`ShmRing.recv_slot`, unpacks it, and frees it with
:meth:`ShmRing.release_recv`. Slots are used in order, so ``slots`` buffers pipeline packing on one
side with unpacking on the other.

A commit or a release may be deferred: ``commit_send(done)`` / ``release_recv(done)`` with a marker
that has ``query()`` and ``synchronize()`` (a CUDA event; see cuda_ipc.py) keeps the slot counted
as used and publishes (frees) it at the first ``poll()`` that finds it done, or at ``flush()``,
which waits for it; slots are published and freed in order. A side about to wait for its peer
flushes its own pending slots first.

Synchronisation is two monotonically increasing 64-bit sequence counters (``produced`` and
``consumed``, each on its own cache line). Only the producer writes ``produced`` and only the
consumer writes ``consumed``. The producer writes the payload first, then the slot's length, then
bumps ``produced``; the consumer reads ``produced`` before it reads the length and the payload. The
counter stores and loads go through libatomic with sequentially consistent ordering when libatomic
is present (so the ordering also holds on weakly ordered CPUs such as aarch64); without libatomic
they are plain aligned 8-byte stores and loads, which is correct on x86 (TSO).

A blocked side spins briefly, then sleeps on a futex on the counter it waits for (the low 32 bits
of ``produced`` or ``consumed``: the kernel sleeps only while that word still holds the value the
waiter last saw, so a bump between the check and the sleep is never missed); each side wakes the
other's futex after bumping its counter, and :meth:`ShmRing.abort` wakes both. Where futexes are
not available (not Linux on x86-64 or aarch64) it sleeps with exponential back-off capped at 1 ms
instead. A waiter also wakes every 0.1 s to check that the peer process is alive, and gives up with
:class:`TransportTimeout` at its deadline, or with :class:`TransportError` when either side called
:meth:`ShmRing.abort` or the peer process is gone.

Single-copy slots: where the consumer may read the producer's memory (Linux cross-memory attach,
see cma.py; the consumer probes it at its first receive by reading the ring's random nonce
through the producer's own mapping, and records the answer in the header), the producer may
publish a slot that lists (address, length) rows of its own memory instead of holding the bytes
(:meth:`ShmRing.send_rows`; a flag bit in the slot's length says so). The consumer copies them
straight into place (:meth:`ShmRing.read_listed`): one copy per byte instead of two. The listed
bytes must stay as they are until the consumer released the slot (:meth:`ShmRing.drain`).
``RAY_RESHARD_SINGLE_COPY=0`` in the consumer's environment turns it off.

Lifetime: :meth:`ShmRing.unlink` removes the name; existing mappings stay valid, so a segment can be
unlinked as soon as both sides have attached, after which nothing can leak even if the processes
die. The mapping itself is released by :meth:`ShmRing.close`, or, when tensor views into the slots
are still alive at that point, when the last of them is garbage collected.
"""
from __future__ import annotations

import ctypes
import ctypes.util as ctypes_util
import fcntl
import mmap
import os
import platform
import re
import secrets
import sys
import time
from collections import deque
from typing import Callable, Optional

import numpy as np
import torch

from ...errors import TransportError, TransportTimeout
from . import cma

__all__ = ["ShmRing", "SHM_DIR", "new_segment_name", "segment_path", "segment_exists"]

SHM_DIR = os.environ.get("RAY_RESHARD_SHM_DIR", "/dev/shm")
NAME_PREFIX = "rr-"

_MAGIC = b"RRSHMv01"
_PAGE = mmap.PAGESIZE
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")

# ---- header layout (byte offsets; every counter is an aligned int64) ----------------------------
_OFF_MAGIC = 0
_OFF_HEADER_BYTES = 8
_OFF_SLOTS = 16
_OFF_SLOT_BYTES = 24
_OFF_SLOT_STRIDE = 32
_OFF_DATA_BYTES = 40        # bytes of slot data stored in this segment (0: data lives elsewhere)
_OFF_TOTAL_BYTES = 48
_OFF_META_LEN = 56
_OFF_PRODUCED = 64          # own cache line
_OFF_PRODUCER_MAP = 72      # the producer's address of this mapping (written once)
_OFF_NONCE = 80             # random at creation: what a cross-memory probe reads back
_OFF_CONSUMED = 128         # own cache line
_OFF_DIRECT = 136           # consumer: 1 reads the producer's memory itself, -1 cannot
_OFF_ABORT = 192            # abort reason code (0: not aborted)
_OFF_ABORT_PID = 200
_OFF_ATTACHED = 208         # number of attach() calls so far (incremented under flock)
_OFF_PRODUCER_PID = 216
_OFF_CONSUMER_PID = 224
_OFF_PIDNS = 232            # inode of the creator's pid namespace (peer liveness checks)
_OFF_REASON = 256           # abort reason text, utf-8, NUL padded
_REASON_BYTES = 256
_OFF_META = 512             # opaque metadata (e.g. a CUDA IPC handle)
META_BYTES = 4096
_OFF_LENGTHS = _OFF_META + META_BYTES

_LISTED = 1 << 62            # a slot length's flag: the slot lists the producer's memory (rows)

# abort reason codes
ABORT_NONE = 0
ABORT_REQUESTED = 1         # a side called abort()

_SPIN_S = 50e-6             # busy-poll this long before sleeping
_MIN_SLEEP_S = 5e-6
_MAX_SLEEP_S = 1e-3
_PEER_CHECK_S = 0.1         # how often a waiter checks that the peer process is alive


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def new_segment_name() -> str:
    """An unguessable segment name: ``rr-`` and 128 random bits in hex."""
    return NAME_PREFIX + secrets.token_hex(16)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return name


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, _check_name(name))


def segment_exists(name: str) -> bool:
    return os.path.exists(segment_path(name))


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


# ---- 64-bit atomics ----------------------------------------------------------------------------

_SEQ_CST = 5


class _Atomics:
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


_atomics: Optional[_Atomics] = None


class _Futex:
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


_futex: Optional[_Futex] = None


def _get_futex() -> _Futex:
    global _futex
    if _futex is None:
        _futex = _Futex()
    return _futex


def _get_atomics() -> _Atomics:
    global _atomics
    if _atomics is None:
        _atomics = _Atomics()
    return _atomics


# ---- the segment --------------------------------------------------------------------------------

class _Segment:
    """A mapped ring segment: header access, counters, waiting, abort. No slot data handling."""

    def __init__(self, name: str, mm: mmap.mmap, owner_created: bool):
        self.name = name
        self._mm: Optional[mmap.mmap] = mm
        self._closed = False
        self._hdr = np.frombuffer(mm, dtype=np.int64, count=_OFF_LENGTHS // 8, offset=0)
        slots = int(self._hdr[_OFF_SLOTS // 8])
        self.slots = slots
        self.slot_bytes = int(self._hdr[_OFF_SLOT_BYTES // 8])
        self._stride = int(self._hdr[_OFF_SLOT_STRIDE // 8])
        self._lengths = np.frombuffer(mm, dtype=np.int64, count=slots, offset=_OFF_LENGTHS)
        self._anchor = ctypes.c_char.from_buffer(mm)   # pins the buffer; gives the base address
        self._base = ctypes.addressof(self._anchor)
        self._atomic = _get_atomics()
        self._futex = _get_futex()
        self._pidns = _pidns()
        self._role: Optional[str] = None
        self._send_idx: Optional[int] = None
        self._send_n = 0
        self._recv_idx: Optional[int] = None
        self._unpublished: deque = deque()   # committed sends: (slot, length, done marker)
        self._unreleased: deque = deque()    # taken receives: done markers
        self.created = owner_created
        self._direct: Optional[bool] = None  # consumer: may it read the producer's memory
        self.direct_refused = ""             # consumer: why not, when it may not

    # -- raw header words
    def _load(self, off: int) -> int:
        if self._atomic.load is not None:
            return self._atomic.load(self._base + off)
        return int(self._hdr[off // 8])

    def _store(self, off: int, value: int) -> None:
        if self._atomic.store is not None:
            self._atomic.store(self._base + off, int(value))
        else:
            self._hdr[off // 8] = value

    # -- creation / attachment
    @staticmethod
    def _layout(slot_bytes: int, slots: int, data: bool):
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if slot_bytes < 0:
            raise ValueError("slot_bytes must be >= 0")
        header = _round_up(_OFF_LENGTHS + 8 * slots, _PAGE)
        stride = _round_up(max(slot_bytes, 1), _PAGE) if data else 0
        return header, stride, header + stride * slots

    _DATA_IN_SEGMENT = True          # slots live in the segment (CudaIpcRing: on the GPU)

    @classmethod
    def create(cls, slot_bytes: int, slots: int = 2, name: Optional[str] = None) -> "_Segment":
        """Create a new segment (name ``rr-<random>`` unless given) and map it."""
        name, mm = cls._create_mapping(slot_bytes, slots, name, data=cls._DATA_IN_SEGMENT)
        try:
            return cls(name, mm, owner_created=True)
        except BaseException:
            cls.unlink(name)
            raise

    @classmethod
    def attach(cls, name: str) -> "_Segment":
        """Map an existing segment; sizes come from its header."""
        return cls(name, cls._attach_mapping(name), owner_created=False)

    @classmethod
    def _create_mapping(cls, slot_bytes: int, slots: int, name: Optional[str], data: bool,
                        meta: bytes = b""):
        name = new_segment_name() if name is None else _check_name(name)
        header, stride, total = cls._layout(int(slot_bytes), int(slots), data)
        if len(meta) > META_BYTES:
            raise ValueError(f"metadata of {len(meta)} bytes exceeds {META_BYTES}")
        path = segment_path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.fchmod(fd, 0o600)
                os.ftruncate(fd, total)
                try:
                    # reserve the tmpfs pages now: ENOSPC here instead of SIGBUS on first touch
                    os.posix_fallocate(fd, 0, total)
                except (AttributeError, OSError) as e:
                    if isinstance(e, OSError) and e.errno == 28:  # ENOSPC
                        raise TransportError(
                            f"not enough space in {SHM_DIR} for a {total}-byte ring") from e
                mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except BaseException:
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        hdr = np.frombuffer(mm, dtype=np.int64, count=_OFF_LENGTHS // 8)
        hdr[_OFF_HEADER_BYTES // 8] = header
        hdr[_OFF_SLOTS // 8] = slots
        hdr[_OFF_SLOT_BYTES // 8] = slot_bytes
        hdr[_OFF_SLOT_STRIDE // 8] = stride
        hdr[_OFF_DATA_BYTES // 8] = stride * slots
        hdr[_OFF_TOTAL_BYTES // 8] = total
        hdr[_OFF_PIDNS // 8] = _pidns()
        hdr[_OFF_NONCE // 8] = int.from_bytes(secrets.token_bytes(8), "little", signed=True)
        if meta:
            mm[_OFF_META:_OFF_META + len(meta)] = meta
            hdr[_OFF_META_LEN // 8] = len(meta)
        del hdr
        mm[_OFF_MAGIC:_OFF_MAGIC + 8] = _MAGIC     # written last: marks the header complete
        return name, mm

    @staticmethod
    def _attach_mapping(name: str):
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TransportError(f"shared-memory ring {name!r} does not exist "
                                 f"(never created, or already unlinked)") from None
        try:
            size = os.fstat(fd).st_size
            if size < _PAGE:
                raise TransportError(f"shared-memory segment {name!r} is too small ({size} bytes)")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                if mm[_OFF_MAGIC:_OFF_MAGIC + 8] != _MAGIC:
                    mm.close()
                    raise TransportError(f"{name!r} is not a ray-reshard ring (bad magic)")
                hdr = np.frombuffer(mm, dtype=np.int64, count=_OFF_LENGTHS // 8)
                if int(hdr[_OFF_TOTAL_BYTES // 8]) != size:
                    del hdr
                    mm.close()
                    raise TransportError(f"ring {name!r}: header/file size mismatch")
                hdr[_OFF_ATTACHED // 8] += 1      # serialised by the flock
                del hdr
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return mm

    # -- public bits shared by the ring types
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def attached(self) -> int:
        """How many times the segment has been attached (by any process)."""
        self._check_open()
        return self._load(_OFF_ATTACHED)

    @property
    def meta(self) -> bytes:
        self._check_open()
        n = int(self._hdr[_OFF_META_LEN // 8])
        return bytes(self._mm[_OFF_META:_OFF_META + n])

    def _set_meta(self, meta: bytes) -> None:
        if len(meta) > META_BYTES:
            raise ValueError(f"metadata of {len(meta)} bytes exceeds {META_BYTES}")
        self._mm[_OFF_META:_OFF_META + len(meta)] = meta
        self._store(_OFF_META_LEN, len(meta))

    def abort_reason(self) -> Optional[tuple]:
        """None, or (code, pid of the aborting process, reason text)."""
        self._check_open()
        code = self._load(_OFF_ABORT)
        if code == ABORT_NONE:
            return None
        raw = bytes(self._mm[_OFF_REASON:_OFF_REASON + _REASON_BYTES]).rstrip(b"\0")
        return code, self._load(_OFF_ABORT_PID), raw.decode("utf-8", "replace")

    def abort(self, reason: str = "") -> None:
        """Mark the ring aborted: every blocked or later call on either side raises TransportError."""
        if self._closed:
            return
        if self._load(_OFF_ABORT) != ABORT_NONE:
            return
        raw = reason.encode("utf-8", "replace")[:_REASON_BYTES - 1]
        self._mm[_OFF_REASON:_OFF_REASON + _REASON_BYTES] = raw.ljust(_REASON_BYTES, b"\0")
        self._store(_OFF_ABORT_PID, os.getpid())
        self._store(_OFF_ABORT, ABORT_REQUESTED)
        self._drop_pending()
        self._wake(_OFF_PRODUCED)
        self._wake(_OFF_CONSUMED)

    def _wake(self, off: int) -> None:
        if self._futex.ok:
            self._futex.wake(self._base + off)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"ring {self.name!r} is closed")

    def _check_abort(self) -> None:
        if self._load(_OFF_ABORT) != ABORT_NONE:
            info = self.abort_reason()
            who = "this process" if info[1] == os.getpid() else f"process {info[1]}"
            raise TransportError(f"ring {self.name!r} aborted by {who}: {info[2] or 'no reason given'}")

    def _register(self, role: str) -> None:
        if self._role == role:
            return
        self._role = role
        if role == "producer":
            self._store(_OFF_PRODUCER_MAP, self._base)
        self._store(_OFF_PRODUCER_PID if role == "producer" else _OFF_CONSUMER_PID, os.getpid())

    def _peer_gone(self, role: str) -> Optional[int]:
        if self._pidns == 0 or self._load(_OFF_PIDNS) != self._pidns:
            return None         # peer may live in another pid namespace: cannot tell
        pid = self._load(_OFF_CONSUMER_PID if role == "producer" else _OFF_PRODUCER_PID)
        if pid <= 0 or pid == os.getpid():
            return None
        return None if _pid_alive(pid) else pid

    def _wait(self, ready: Callable[[], bool], deadline: Optional[float], what: str,
              word: Optional[int] = None) -> None:
        """Wait until `ready()`; `word` is the header offset of the counter whose change can
        make it so (a futex waits on it), or None (sleep with back-off)."""
        if deadline is None:
            deadline = float("inf")
        start = time.monotonic()
        next_peer_check = start + _PEER_CHECK_S
        delay = _MIN_SLEEP_S
        futex = self._futex if (word is not None and self._futex.ok) else None
        while True:
            self._check_abort()
            seen = self._load(word) if futex is not None else 0
            if ready():
                return
            now = time.monotonic()
            if now >= deadline:
                raise TransportTimeout(f"ring {self.name!r}: timed out waiting for {what}")
            if now - start < _SPIN_S:
                continue
            if now >= next_peer_check:
                next_peer_check = now + _PEER_CHECK_S
                gone = self._peer_gone(self._role)
                if gone is not None:
                    raise TransportError(f"ring {self.name!r}: peer process {gone} exited "
                                         f"while this side waited for {what}")
            if futex is not None:
                futex.wait(self._base + word, seen,
                           max(min(deadline, next_peer_check) - now, 1e-6))
                continue
            time.sleep(min(delay, max(deadline - now, 0.0)))
            delay = min(delay * 2, _MAX_SLEEP_S)

    # -- the protocol (indices only; subclasses map indices to buffers)
    def _acquire_send(self, nbytes: int, deadline: float) -> int:
        self._check_open()
        self._check_abort()
        if self._send_idx is not None:
            raise RuntimeError("send_slot called again before commit_send")
        nbytes = int(nbytes)
        if nbytes < 0 or nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        self._register("producer")
        if not self.ready(True):
            self.flush()            # our own unpublished slots must not be what we wait on
        ahead = self._load(_OFF_PRODUCED) + len(self._unpublished)
        slots = self.slots
        self._wait(lambda: ahead - self._load(_OFF_CONSUMED) < slots, deadline, "a free slot",
                   _OFF_CONSUMED)
        idx = ahead % slots
        self._send_idx, self._send_n = idx, nbytes
        return idx

    def _commit(self, done=None) -> None:
        """Commit the slot of the last send_slot: published now, or once `done` (an object with
        `query()` and `synchronize()`, e.g. a CUDA event) is, at `poll` or `flush`; slots are
        published in order."""
        self._check_open()
        if self._send_idx is None:
            raise RuntimeError("commit_send without a preceding send_slot")
        self._check_abort()
        self._unpublished.append((self._send_idx, self._send_n, done))
        self._send_idx = None
        self.poll()

    def _publish(self, idx: int, n: int) -> None:
        self._store(_OFF_LENGTHS + 8 * idx, n)
        self._store(_OFF_PRODUCED, self._load(_OFF_PRODUCED) + 1)
        self._wake(_OFF_PRODUCED)

    def _acquire_recv(self, deadline: float):
        self._check_open()
        self._check_abort()
        if self._recv_idx is not None:
            raise RuntimeError("recv_slot called again before release_recv")
        self._register("consumer")
        if not self.ready(False):
            self.flush()            # a producer may wait for the slots we hold
        taken = self._load(_OFF_CONSUMED) + len(self._unreleased)
        self._wait(lambda: self._load(_OFF_PRODUCED) > taken, deadline, "a published slot",
                   _OFF_PRODUCED)
        idx = taken % self.slots
        n = self._load(_OFF_LENGTHS + 8 * idx)
        self._recv_idx = idx
        return idx, n

    def _finish_recv(self, done=None) -> None:
        """Free the slot of the last recv_slot: now, or once `done` is (see `_commit`)."""
        self._check_open()
        if self._recv_idx is None:
            raise RuntimeError("release_recv without a preceding recv_slot")
        self._recv_idx = None
        self._unreleased.append(done)
        self.poll()

    def _release(self) -> None:
        self._store(_OFF_CONSUMED, self._load(_OFF_CONSUMED) + 1)
        self._wake(_OFF_CONSUMED)

    def poll(self) -> bool:
        """Publish committed sends and free taken receives whose markers are done, in order;
        never blocks. Whether any are still waiting."""
        if self._closed:
            return False
        if self._load(_OFF_ABORT) != ABORT_NONE:
            self._drop_pending()
            return False
        q = self._unpublished
        while q and (q[0][2] is None or q[0][2].query()):
            idx, n, _ = q.popleft()
            self._publish(idx, n)
        r = self._unreleased
        while r and (r[0] is None or r[0].query()):
            r.popleft()
            self._release()
        return bool(q or r)

    @property
    def deferred(self) -> int:
        """Committed sends and taken receives not yet published or freed."""
        return len(self._unpublished) + len(self._unreleased)

    def _drop_pending(self) -> None:
        self._unpublished.clear()
        self._unreleased.clear()

    def flush(self) -> None:
        """Wait for every marker still pending (`synchronize()`), then publish and free."""
        if self._closed:
            return
        for done in [e[2] for e in self._unpublished] + list(self._unreleased):
            if done is not None:
                done.synchronize()
        self.poll()

    def ready(self, sending: bool) -> bool:
        """Whether a send (a free slot) or a receive (a published slot) could start now, without
        waiting; never blocks (False when closed). Slots committed or taken but not yet
        published or freed count as used."""
        if self.closed:
            return False
        produced, consumed = self._load(_OFF_PRODUCED), self._load(_OFF_CONSUMED)
        if sending:
            return produced + len(self._unpublished) - consumed < self.slots
        return produced > consumed + len(self._unreleased)

    def pending(self) -> int:
        """Published slots not yet released by the consumer."""
        self._check_open()
        return self._load(_OFF_PRODUCED) - self._load(_OFF_CONSUMED)

    # -- teardown
    def _drop_views(self) -> None:
        pass

    def close(self) -> None:
        """Unmap (idempotent). Slot views still alive keep the mapping until they are collected."""
        if self._closed:
            return
        self._closed = True
        self._drop_pending()
        self._drop_views()
        self._hdr = None
        self._lengths = None
        self._anchor = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass            # live tensor views: the mmap is unmapped when they are gone

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @staticmethod
    def unlink(name: str) -> None:
        """Remove the segment's name (idempotent). Existing mappings stay valid."""
        try:
            os.unlink(segment_path(name))
        except FileNotFoundError:
            pass

    def __reduce__(self):
        # Pickling a ring hands over its name; the receiving process attaches to it.
        return (type(self).attach, (self.name,))

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"{type(self).__name__}(name={self.name!r}, slots={self.slots}, "
                f"slot_bytes={self.slot_bytes}, {state})")


class ShmRing(_Segment):
    """SPSC ring whose slots live in the shared-memory segment (CPU tensors, zero-copy views)."""

    def __init__(self, name: str, mm: mmap.mmap, owner_created: bool):
        super().__init__(name, mm, owner_created)
        data_bytes = int(self._hdr[_OFF_DATA_BYTES // 8])
        header = int(self._hdr[_OFF_HEADER_BYTES // 8])
        if self._stride <= 0 or data_bytes < self._stride * self.slots:
            self.close()
            raise TransportError(f"segment {name!r} holds no slot data (not a ShmRing: "
                                 f"a CudaIpcRing header?)")
        # numpy holds a buffer export of the mmap, and torch.from_numpy holds the array: as long
        # as any tensor view exists the mmap cannot be unmapped under it.
        arr = np.frombuffer(mm, dtype=np.uint8, count=data_bytes, offset=header)
        self._data: Optional[torch.Tensor] = torch.from_numpy(arr)


    def _view(self, idx: int, nbytes: int) -> torch.Tensor:
        off = idx * self._stride
        return self._data[off:off + nbytes]

    def send_slot(self, nbytes: int, deadline: float) -> torch.Tensor:
        """Wait for a free slot; return a uint8 view of its first ``nbytes`` bytes to pack into."""
        return self._view(self._acquire_send(nbytes, deadline), int(nbytes))

    def commit_send(self, done=None, defer: bool = False) -> None:
        """Publish the slot returned by the last send_slot (with `done`: once it is done, at
        `poll` or `flush`; see `_commit`). `defer` changes nothing here: a CPU copy into the
        slot is complete when it returns."""
        self._commit(done)

    def recv_slot(self, deadline: float) -> torch.Tensor:
        """Wait for the next published slot; return a uint8 view of its bytes (valid until
        release_recv). When `listed` is then true, the slot lists the producer's memory (see
        `send_rows`): `read_listed` copies it."""
        idx, n = self._acquire_recv(deadline)
        self.listed = bool(n & _LISTED)
        if self._direct is None:
            self._probe_direct()
        return self._view(idx, n & ~_LISTED)

    # -- single-copy forwards (cross-memory attach, see cma.py): the producer lists the bytes,
    #    the consumer copies them out of the producer's memory itself
    listed = False

    def _probe_direct(self) -> None:
        """Consumer, once the producer has registered: read the ring's nonce through the
        producer's own mapping; record whether that works (`reads_direct` on the other side)."""
        pid, base = self._load(_OFF_PRODUCER_PID), self._load(_OFF_PRODUCER_MAP)
        if pid <= 0 or base == 0:
            return
        if os.environ.get("RAY_RESHARD_SINGLE_COPY", "1") == "0":
            why = "RAY_RESHARD_SINGLE_COPY=0"
        elif self._load(_OFF_PIDNS) != self._pidns or self._pidns == 0:
            why = "the producer may live in another pid namespace"
        else:
            nonce = int(self._load(_OFF_NONCE)).to_bytes(8, "little", signed=True)
            why = cma.probe(pid, base + _OFF_NONCE, nonce) or ""
        self._direct, self.direct_refused = not why, why
        self._store(_OFF_DIRECT, 1 if not why else -1)

    def reads_direct(self) -> bool:
        """Producer: whether the consumer copies listed bytes out of this process itself (it
        probed that it may); before its first receive it has not said yet."""
        return not self._closed and self._load(_OFF_DIRECT) == 1

    def send_rows(self, rows: np.ndarray, deadline: float) -> None:
        """Producer: publish a slot listing `rows` ((n, 2) int64: address, length) of this
        process's memory for the consumer to copy (only where `reads_direct`). Those bytes must
        stay as they are until the consumer released the slot: `drain` waits for that."""
        nbytes = rows.nbytes
        view = self.send_slot(nbytes, deadline)
        view.copy_(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).view(torch.uint8)
                   .reshape(-1))
        self._send_n = nbytes | _LISTED
        self._commit(None)

    def read_listed(self, slot: torch.Tensor, local: np.ndarray) -> None:
        """Consumer: copy the bytes the taken slot lists out of the producer into the memory
        `local` lists ((n, 2) int64: address, length; the same total)."""
        remote = slot.numpy().view(np.int64).reshape(-1, 2)
        cma.read(self._load(_OFF_PRODUCER_PID), local, remote)

    def drain(self, deadline: float) -> None:
        """Producer: wait until the consumer has released every slot published so far (after
        `send_rows`: until it has copied the bytes they list)."""
        self.flush()
        target = self._load(_OFF_PRODUCED)
        self._wait(lambda: self._load(_OFF_CONSUMED) >= target, deadline,
                   "the consumer to take every slot", _OFF_CONSUMED)

    def release_recv(self, done=None, defer: bool = False) -> None:
        """Free the slot returned by the last recv_slot (with `done`: once it is done; `defer`
        as in `commit_send`)."""
        self._finish_recv(done)

    def _drop_views(self) -> None:
        self._data = None
