"""The one interface the executor uses for every transport, and its implementations.

`post(peer, tensor, sending)` starts moving a tensor's bytes to or from a peer and returns a
handle, `complete(handle, deadline, what)` waits for it (`done(handle)` asks without waiting),
`abort(reason)` fails every peer
blocked on this process. `NetChannel` is the group's process group (gloo or NCCL: isend/irecv),
`RingChannel` the shared-memory or CUDA IPC rings to processes on the node (a ring's slot is
packed in place, so `post` on a ring takes a fill/drain function instead of a tensor and finishes
at once; `post_part` takes a program part and, where the peer may read this process's memory,
lists the part's bytes instead of packing them), `LoopbackChannel` moves nothing (benchmarks
replay one process's CPU work with it).
"""
from __future__ import annotations

from typing import Any

import torch

from .transport import torch_pg


class Channel:
    """post / complete / abort: the one interface the executor uses for every transport."""

    # Whether `done` answers and `complete` may be called with a short deadline and again
    # after it raised TransportTimeout (NCCL); else a wait is one blocking call (gloo).
    polls = False

    def post(self, peer: int, tensor: torch.Tensor, sending: bool) -> Any:
        raise NotImplementedError

    def post_group(self, ops: list) -> Any:
        """Post several messages, `ops` = [(peer, tensor, sending)], as one unit (one NCCL
        group): one handle completes when all of them did. Every process must group the same
        transfers (see executor.py)."""
        raise NotImplementedError

    def complete(self, handle: Any, deadline: float, what: str) -> None:
        raise NotImplementedError

    def done(self, handle: Any) -> bool:
        """Whether `complete(handle)` would return at once (never blocks; False when the
        transport cannot tell)."""
        return False

    def abort(self, reason: str) -> None:
        pass


class NetChannel(Channel):
    """The group's process group: isend/irecv, and groups of them (one NCCL group)."""

    def __init__(self, pg):
        self.pg = pg
        self.polls = getattr(pg, "pg_backend", "gloo") == "nccl"

    def post(self, peer, tensor, sending):
        return self.pg.isend(tensor, peer) if sending else self.pg.irecv(tensor, peer)

    def post_group(self, ops):
        return self.pg.post_group(ops)

    def complete(self, handle, deadline, what):
        torch_pg.wait(handle, deadline, what)

    def done(self, handle):
        return handle.is_completed()

    def abort(self, reason):
        self.pg.abort()


class RingChannel(Channel):
    """Shared-memory / CUDA IPC rings to processes on this node. A posted bucket is packed into
    (or unpacked from) the ring's slot in place: `tensor` is a function of the slot.

    On CUDA IPC rings a post does not wait for the GPU: the slot is published (freed) once the
    copy's events are done, at a later `poll` or `flush` (see cuda_ipc.py). The executor flushes
    before it waits for anything, so no peer waits on a slot this process holds unpublished."""

    def __init__(self, rings_out: dict, rings_in: dict):
        self.rings_out, self.rings_in = rings_out, rings_in
        self.waiting: set = set()      # rings with deferred commits or releases
        self.listed: set = set()       # rings whose consumer copies listed bytes out of here
        self.listed_bytes = 0          # bytes this process copied out of a peer that way

    def has(self, peer: int, sending: bool) -> bool:
        return peer in (self.rings_out if sending else self.rings_in)

    def ready(self, peer: int, sending: bool) -> bool:
        """Whether `post` to or from `peer` would run at once (never blocks)."""
        return (self.rings_out if sending else self.rings_in)[peer].ready(sending)

    def post(self, peer, tensor, sending, nbytes: int = 0, deadline: float = 0.0):
        if sending:
            ring = self.rings_out[peer]
            tensor(ring.send_slot(nbytes, deadline))
            ring.commit_send(defer=True)
        else:
            ring = self.rings_in[peer]
            tensor(ring.recv_slot(deadline))
            ring.release_recv(defer=True)
        if ring.deferred:
            self.waiting.add(ring)
        return None

    def post_part(self, peer: int, part, sending: bool, nbytes: int, deadline: float) -> None:
        """A ring step for a program part (see execution/program.py). Where the consumer copies
        out of the producer's memory itself (shared-memory rings that probed cross-memory
        attach, see shm.py) and the part's bytes are plain rows of host memory, the slot lists
        them instead of holding them: one copy per byte instead of two. The producer must
        `drain` before those bytes may change."""
        if sending:
            ring = self.rings_out[peer]
            if ring.reads_direct():
                rows = part.byte_rows()
                if rows is not None and rows.nbytes <= ring.slot_bytes:
                    ring.send_rows(rows, deadline)
                    self.listed.add(ring)
                    return
            self.post(peer, part.pack, True, nbytes, deadline)
            return
        ring = self.rings_in[peer]
        slot = ring.recv_slot(deadline)
        if ring.listed:
            rows = part.byte_rows()
            if rows is not None:
                ring.read_listed(slot, rows)
            else:                       # converted or strided here: copy in, then unpack
                buf = torch.empty(part.nbytes, dtype=torch.uint8)
                ring.read_listed(slot, part.item_rows(buf))
                part.unpack(buf, cache=False)
            self.listed_bytes += part.nbytes
        else:
            part.unpack(slot)
        ring.release_recv(defer=True)
        if ring.deferred:
            self.waiting.add(ring)

    def drain(self, deadline: float) -> None:
        """Wait until every consumer has copied what this process listed (see `post_part`)."""
        listed, self.listed = self.listed, set()
        for ring in listed:
            ring.drain(deadline)

    def poll(self) -> None:
        """Publish and free what the GPU has finished; never blocks."""
        if self.waiting:
            self.waiting = {ring for ring in self.waiting if ring.poll()}

    def flush(self) -> None:
        """Wait for every deferred commit and release, and publish and free them."""
        if self.waiting:
            waiting, self.waiting = self.waiting, set()
            for ring in waiting:
                ring.flush()

    def complete(self, handle, deadline, what):
        pass

    def abort(self, reason):
        self.waiting = set()
        self.listed = set()
        for ring in [*self.rings_out.values(), *self.rings_in.values()]:
            try:
                ring.abort(reason[:200])
            except Exception:
                pass


class LoopbackChannel(Channel):
    """Moves nothing: every message completes at once (a received buffer keeps its bytes)."""

    def post(self, peer, tensor, sending):
        self.messages = getattr(self, "messages", 0) + 1
        return None

    def post_group(self, ops):
        self.messages = getattr(self, "messages", 0) + len(ops)
        self.groups = getattr(self, "groups", 0) + 1
        return None

    def complete(self, handle, deadline, what):
        pass
