"""A ring segment: the shared header two processes synchronise through, and its protocol.

One file under /dev/shm (mode 0600, name ``rr-<32 hex chars>``) holds the header (sequence
counters, slot lengths, abort flag, metadata) and, for a `ShmRing`, the slots. `RingSegment`
creates, attaches, waits, aborts and closes; subclasses map slot indices to buffers (`shm.py`:
in this segment, `cuda_ipc.py`: on a GPU). It never touches slot bytes.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import secrets
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from ...errors import TransportError, TransportTimeout
from .futex import shared_atomics, shared_futex

__all__ = ["RingSegment", "SHM_DIR", "META_BYTES", "new_segment_name", "segment_path",
           "segment_exists", "round_up"]

SHM_DIR = os.environ.get("RAY_RESHARD_SHM_DIR", "/dev/shm")
NAME_PREFIX = "rr-"

_MAGIC = b"RRSHMv01"
_PAGE = mmap.PAGESIZE
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")

# ---- header layout (byte offsets; every counter is an aligned int64) ----------------------------
OFF_MAGIC = 0
OFF_HEADER_BYTES = 8
OFF_SLOTS = 16
OFF_SLOT_BYTES = 24
OFF_SLOT_STRIDE = 32
OFF_DATA_BYTES = 40        # bytes of slot data stored in this segment (0: data lives elsewhere)
OFF_TOTAL_BYTES = 48
OFF_META_LEN = 56
OFF_PRODUCED = 64          # own cache line
OFF_PRODUCER_MAP = 72      # the producer's address of this mapping (written once)
OFF_NONCE = 80             # random at creation: what a cross-memory probe reads back
OFF_CONSUMED = 128         # own cache line
OFF_DIRECT = 136           # consumer: 1 reads the producer's memory itself, -1 cannot
OFF_ABORT = 192            # abort reason code (0: not aborted)
OFF_ABORT_PID = 200
OFF_ATTACHED = 208         # number of attach() calls so far (incremented under flock)
OFF_PRODUCER_PID = 216
OFF_CONSUMER_PID = 224
OFF_PIDNS = 232            # inode of the creator's pid namespace (peer liveness checks)
OFF_REASON = 256           # abort reason text, utf-8, NUL padded
_REASON_BYTES = 256
OFF_META = 512             # opaque metadata (e.g. a CUDA IPC handle)
META_BYTES = 4096
OFF_LENGTHS = OFF_META + META_BYTES

# abort reason codes
ABORT_NONE = 0
ABORT_REQUESTED = 1         # a side called abort()

_SPIN_S = 50e-6             # busy-poll this long before sleeping
_MIN_SLEEP_S = 5e-6
_MAX_SLEEP_S = 1e-3
_PEER_CHECK_S = 0.1         # how often a waiter checks that the peer process is alive


def round_up(n: int, m: int) -> int:
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


class RingSegment:
    """A mapped ring segment: header access, counters, waiting, abort. No slot data handling.

    Two increasing 64-bit counters, ``produced`` (written by the producer only) and
    ``consumed`` (by the consumer only), each on its own cache line; slots are used in order.
    A commit or release may be deferred behind a marker with ``query()`` / ``synchronize()``
    (a CUDA event): the slot is published (freed) at the first `poll` that finds it done, or at
    `flush`. A side about to wait for its peer flushes its own pending slots first. A waiter
    spins briefly, then sleeps on the futex of the counter it waits for, checks every 0.1 s that
    the peer process lives, and raises at its deadline or on an abort from either side.
    """

    def __init__(self, name: str, mm: mmap.mmap, owner_created: bool):
        self.name = name
        self._mm: Optional[mmap.mmap] = mm
        self._closed = False
        self._hdr = np.frombuffer(mm, dtype=np.int64, count=OFF_LENGTHS // 8, offset=0)
        slots = int(self._hdr[OFF_SLOTS // 8])
        self.slots = slots
        self.slot_bytes = int(self._hdr[OFF_SLOT_BYTES // 8])
        self._stride = int(self._hdr[OFF_SLOT_STRIDE // 8])
        self._lengths = np.frombuffer(mm, dtype=np.int64, count=slots, offset=OFF_LENGTHS)
        self._anchor = ctypes.c_char.from_buffer(mm)   # pins the buffer; gives the base address
        self._base = ctypes.addressof(self._anchor)
        self._atomic = shared_atomics()
        self._futex = shared_futex()
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
        # Without libatomic: a plain aligned 8-byte access, ordered on x86 (TSO) only.
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
        header = round_up(OFF_LENGTHS + 8 * slots, _PAGE)
        stride = round_up(max(slot_bytes, 1), _PAGE) if data else 0
        return header, stride, header + stride * slots

    _DATA_IN_SEGMENT = True          # slots live in the segment (CudaIpcRing: on the GPU)

    @classmethod
    def create(cls, slot_bytes: int, slots: int = 2, name: Optional[str] = None) -> "RingSegment":
        """Create a new segment (name ``rr-<random>`` unless given) and map it."""
        name, mm = cls._create_mapping(slot_bytes, slots, name, data=cls._DATA_IN_SEGMENT)
        try:
            return cls(name, mm, owner_created=True)
        except BaseException:
            cls.unlink(name)
            raise

    @classmethod
    def attach(cls, name: str) -> "RingSegment":
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
        hdr = np.frombuffer(mm, dtype=np.int64, count=OFF_LENGTHS // 8)
        hdr[OFF_HEADER_BYTES // 8] = header
        hdr[OFF_SLOTS // 8] = slots
        hdr[OFF_SLOT_BYTES // 8] = slot_bytes
        hdr[OFF_SLOT_STRIDE // 8] = stride
        hdr[OFF_DATA_BYTES // 8] = stride * slots
        hdr[OFF_TOTAL_BYTES // 8] = total
        hdr[OFF_PIDNS // 8] = _pidns()
        hdr[OFF_NONCE // 8] = int.from_bytes(secrets.token_bytes(8), "little", signed=True)
        if meta:
            mm[OFF_META:OFF_META + len(meta)] = meta
            hdr[OFF_META_LEN // 8] = len(meta)
        del hdr
        mm[OFF_MAGIC:OFF_MAGIC + 8] = _MAGIC     # written last: marks the header complete
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
                if mm[OFF_MAGIC:OFF_MAGIC + 8] != _MAGIC:
                    mm.close()
                    raise TransportError(f"{name!r} is not a ray-reshard ring (bad magic)")
                hdr = np.frombuffer(mm, dtype=np.int64, count=OFF_LENGTHS // 8)
                if int(hdr[OFF_TOTAL_BYTES // 8]) != size:
                    del hdr
                    mm.close()
                    raise TransportError(f"ring {name!r}: header/file size mismatch")
                hdr[OFF_ATTACHED // 8] += 1      # serialised by the flock
                del hdr
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return mm

    # -- public bits shared by the ring types
    # Single-copy slots (a slot listing the producer's memory, see shm.ShmRing): a ring that
    # has them overrides these.
    listed = False               # consumer: whether the slot taken last lists the bytes

    def reads_direct(self) -> bool:
        """Producer: whether the consumer copies listed bytes out of this process itself."""
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def attached(self) -> int:
        """How many times the segment has been attached (by any process)."""
        self._check_open()
        return self._load(OFF_ATTACHED)

    @property
    def meta(self) -> bytes:
        self._check_open()
        n = int(self._hdr[OFF_META_LEN // 8])
        return bytes(self._mm[OFF_META:OFF_META + n])

    def _set_meta(self, meta: bytes) -> None:
        if len(meta) > META_BYTES:
            raise ValueError(f"metadata of {len(meta)} bytes exceeds {META_BYTES}")
        self._mm[OFF_META:OFF_META + len(meta)] = meta
        self._store(OFF_META_LEN, len(meta))

    def abort_reason(self) -> Optional[tuple]:
        """None, or (code, pid of the aborting process, reason text)."""
        self._check_open()
        code = self._load(OFF_ABORT)
        if code == ABORT_NONE:
            return None
        raw = bytes(self._mm[OFF_REASON:OFF_REASON + _REASON_BYTES]).rstrip(b"\0")
        return code, self._load(OFF_ABORT_PID), raw.decode("utf-8", "replace")

    def abort(self, reason: str = "") -> None:
        """Mark the ring aborted: every blocked or later call on either side raises
        TransportError."""
        if self._closed:
            return
        if self._load(OFF_ABORT) != ABORT_NONE:
            return
        raw = reason.encode("utf-8", "replace")[:_REASON_BYTES - 1]
        self._mm[OFF_REASON:OFF_REASON + _REASON_BYTES] = raw.ljust(_REASON_BYTES, b"\0")
        self._store(OFF_ABORT_PID, os.getpid())
        self._store(OFF_ABORT, ABORT_REQUESTED)
        self._drop_pending()
        self._wake(OFF_PRODUCED)
        self._wake(OFF_CONSUMED)

    def _wake(self, off: int) -> None:
        if self._futex.ok:
            self._futex.wake(self._base + off)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"ring {self.name!r} is closed")

    def _check_abort(self) -> None:
        if self._load(OFF_ABORT) != ABORT_NONE:
            info = self.abort_reason()
            who = "this process" if info[1] == os.getpid() else f"process {info[1]}"
            raise TransportError(f"ring {self.name!r} aborted by {who}: "
                                 f"{info[2] or 'no reason given'}")

    def _register(self, role: str) -> None:
        if self._role == role:
            return
        self._role = role
        if role == "producer":
            self._store(OFF_PRODUCER_MAP, self._base)
        self._store(OFF_PRODUCER_PID if role == "producer" else OFF_CONSUMER_PID, os.getpid())

    def _peer_gone(self, role: str) -> Optional[int]:
        if self._pidns == 0 or self._load(OFF_PIDNS) != self._pidns:
            return None         # peer may live in another pid namespace: cannot tell
        pid = self._load(OFF_CONSUMER_PID if role == "producer" else OFF_PRODUCER_PID)
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
        ahead = self._load(OFF_PRODUCED) + len(self._unpublished)
        slots = self.slots
        self._wait(lambda: ahead - self._load(OFF_CONSUMED) < slots, deadline, "a free slot",
                   OFF_CONSUMED)
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
        # Payload, then length, then the counter: the consumer reads them in the reverse order.
        self._store(OFF_LENGTHS + 8 * idx, n)
        self._store(OFF_PRODUCED, self._load(OFF_PRODUCED) + 1)
        self._wake(OFF_PRODUCED)

    def _acquire_recv(self, deadline: float):
        self._check_open()
        self._check_abort()
        if self._recv_idx is not None:
            raise RuntimeError("recv_slot called again before release_recv")
        self._register("consumer")
        if not self.ready(False):
            self.flush()            # a producer may wait for the slots we hold
        taken = self._load(OFF_CONSUMED) + len(self._unreleased)
        self._wait(lambda: self._load(OFF_PRODUCED) > taken, deadline, "a published slot",
                   OFF_PRODUCED)
        idx = taken % self.slots
        n = self._load(OFF_LENGTHS + 8 * idx)
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
        self._store(OFF_CONSUMED, self._load(OFF_CONSUMED) + 1)
        self._wake(OFF_CONSUMED)

    def poll(self) -> bool:
        """Publish committed sends and free taken receives whose markers are done, in order;
        never blocks. Whether any are still waiting."""
        if self._closed:
            return False
        if self._load(OFF_ABORT) != ABORT_NONE:
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
        produced, consumed = self._load(OFF_PRODUCED), self._load(OFF_CONSUMED)
        if sending:
            return produced + len(self._unpublished) - consumed < self.slots
        return produced > consumed + len(self._unreleased)

    def pending(self) -> int:
        """Published slots not yet released by the consumer."""
        self._check_open()
        return self._load(OFF_PRODUCED) - self._load(OFF_CONSUMED)

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
        """Remove the segment's name (idempotent). Existing mappings stay valid, so a segment
        unlinked once both sides attached cannot leak even if the processes die."""
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
