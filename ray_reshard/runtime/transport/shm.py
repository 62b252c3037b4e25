"""The shared-memory ring: a single-producer single-consumer channel between two processes on
one node, its slots in the segment itself (CPU tensors that view the shared memory).

The producer packs into `send_slot()`'s view and publishes it with `commit_send()`; the consumer
unpacks `recv_slot()`'s view and frees it with `release_recv()` (the protocol: `segment.py`).
Where the consumer may read the producer's memory (cross-memory attach, see `cma.py`; probed at
its first receive, `RAY_RESHARD_SINGLE_COPY=0` turns it off), a slot may list (address, length)
rows of the producer's memory instead of holding the bytes: one copy per byte instead of two.
"""
from __future__ import annotations

import mmap
import os
from typing import Optional

import numpy as np
import torch

from ...errors import TransportError
from . import cma
from .segment import (OFF_CONSUMED, OFF_DATA_BYTES, OFF_DIRECT, OFF_HEADER_BYTES, OFF_NONCE,
                      OFF_PIDNS, OFF_PRODUCED, OFF_PRODUCER_MAP, OFF_PRODUCER_PID, RingSegment)

__all__ = ["ShmRing"]

_LISTED = 1 << 62            # a slot length's flag: the slot lists the producer's memory (rows)


class ShmRing(RingSegment):
    """SPSC ring whose slots live in the shared-memory segment (CPU tensors, zero-copy views)."""

    def __init__(self, name: str, mm: mmap.mmap, owner_created: bool):
        super().__init__(name, mm, owner_created)
        data_bytes = int(self._hdr[OFF_DATA_BYTES // 8])
        header = int(self._hdr[OFF_HEADER_BYTES // 8])
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
    #    the consumer copies them out of the producer's memory itself (`listed` after a
    #    receive says whether its slot lists them)
    def _probe_direct(self) -> None:
        """Consumer, once the producer has registered: read the ring's nonce through the
        producer's own mapping; record whether that works (`reads_direct` on the other side)."""
        pid, base = self._load(OFF_PRODUCER_PID), self._load(OFF_PRODUCER_MAP)
        if pid <= 0 or base == 0:
            return
        if os.environ.get("RAY_RESHARD_SINGLE_COPY", "1") == "0":
            why = "RAY_RESHARD_SINGLE_COPY=0"
        elif self._load(OFF_PIDNS) != self._pidns or self._pidns == 0:
            why = "the producer may live in another pid namespace"
        else:
            nonce = int(self._load(OFF_NONCE)).to_bytes(8, "little", signed=True)
            why = cma.probe(pid, base + OFF_NONCE, nonce) or ""
        self._direct, self.direct_refused = not why, why
        self._store(OFF_DIRECT, 1 if not why else -1)

    def reads_direct(self) -> bool:
        """Producer: whether the consumer copies listed bytes out of this process itself (it
        probed that it may); before its first receive it has not said yet."""
        return not self._closed and self._load(OFF_DIRECT) == 1

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
        cma.read(self._load(OFF_PRODUCER_PID), local, remote)

    def drain(self, deadline: float) -> None:
        """Producer: wait until the consumer has released every slot published so far (after
        `send_rows`: until it has copied the bytes they list)."""
        self.flush()
        target = self._load(OFF_PRODUCED)
        self._wait(lambda: self._load(OFF_CONSUMED) >= target, deadline,
                   "the consumer to take every slot", OFF_CONSUMED)

    def release_recv(self, done=None, defer: bool = False) -> None:
        """Free the slot returned by the last recv_slot (with `done`: once it is done; `defer`
        as in `commit_send`)."""
        self._finish_recv(done)

    def _drop_views(self) -> None:
        self._data = None
