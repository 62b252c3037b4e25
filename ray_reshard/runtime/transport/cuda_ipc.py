"""The CUDA IPC ring: a ring (`segment.py`) whose slots live in GPU memory shared between two
processes on one node.

The header is an ordinary shared-memory segment (anyone creates it, e.g. the node helper, which
needs no GPU); the slots are one GPU buffer owned by the receiver, which allocates it on first
use and publishes its IPC handle in the header's metadata (JSON, no pickle). The sender opens
it (on its own device when the receiver's GPU is invisible to it, see `devices.py`) and packs
straight into the receiver's memory. Slots are published and freed only once the copies into
and out of them are done on the GPU (CUDA events). The receiver must outlive the sender's use.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

import torch

from ...errors import TransportError
from .devices import expandable_segments, ipc_open_device
from .segment import OFF_META_LEN, RingSegment, round_up

__all__ = ["CudaIpcRing", "StreamMarker"]

_ALIGN = 512                    # slot alignment in the GPU buffer (any dtype, vector loads)


def _device_uuid(index: int) -> Optional[str]:
    try:
        u = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None
    return u if u.startswith(("GPU-", "MIG-")) else f"GPU-{u}"


def _open_index(uuid: Optional[str]) -> int:
    """The local device to open a buffer on GPU `uuid` on (`devices.ipc_open_device`)."""
    visible = [_device_uuid(i) for i in range(torch.cuda.device_count())]
    return ipc_open_device(uuid, visible, torch.cuda.current_device())


@contextlib.contextmanager
def _no_expandable_segments():
    """Allocate inside without expandable segments (restored after) when they are on: their
    memory would be shared through file descriptors that need ptrace rights between the
    processes, not through the IPC handle a ring publishes."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if not expandable_segments(conf):
        yield
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        torch.cuda.memory._set_allocator_settings
    try:
        setter("expandable_segments:False")
    except Exception:           # cannot switch: allocate as configured (shared by fd then)
        yield
        return
    try:
        yield
    finally:
        setter("expandable_segments:True")


def _hex(b) -> Optional[str]:
    return None if b is None else bytes(b).hex()


def _unhex(s) -> Optional[bytes]:
    return None if s is None else bytes.fromhex(s)


class StreamMarker:
    """Events recorded now on `streams`: done once every stream has reached this point."""

    __slots__ = ("events",)

    def __init__(self, streams):
        self.events = []
        for st in streams:
            e = torch.cuda.Event()
            e.record(st)
            self.events.append(e)

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


class CudaIpcRing(RingSegment):
    """SPSC ring with GPU slots (receiver-owned buffer shared by CUDA IPC)."""

    def __init__(self, name, mm, owner_created: bool):
        super().__init__(name, mm, owner_created)
        self._gstride = round_up(max(self.slot_bytes, 1), _ALIGN)
        self._buf: Optional[torch.Tensor] = None
        self._owner = False

    # create() makes only the header segment (no GPU needed); the receiver allocates the GPU
    # buffer on first use.
    _DATA_IN_SEGMENT = False

    # -- the GPU buffer
    @property
    def device(self) -> Optional[torch.device]:
        return None if self._buf is None else self._buf.device

    def prepare_recv(self, device=None) -> None:
        """Allocate the slot buffer on `device` (default: current CUDA device) and publish its IPC
        handle. The receiver calls it (recv_slot does on first use); idempotent."""
        self._check_open()
        if self._buf is not None:
            return
        if self._load(OFF_META_LEN) > 0:
            raise TransportError(f"ring {self.name!r} already has a GPU buffer owned by another "
                                 f"process (only the receiver allocates)")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        with _no_expandable_segments():
            buf = torch.zeros(self.slots * self._gstride, dtype=torch.uint8, device=dev)
        storage = buf.untyped_storage()
        (s_dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset, ev_handle,
         ev_sync) = storage._share_cuda_()
        meta = {
            "v": 1, "pid": os.getpid(), "uuid": _device_uuid(dev.index), "device": int(s_dev),
            "handle": _hex(handle), "size": int(size_bytes), "offset": int(offset_bytes),
            "ref_handle": _hex(ref_handle), "ref_offset": int(ref_offset),
            # synchronised below, before publishing: no IPC event to open
            "event": "", "event_sync": False,
            "nbytes": int(buf.numel()),
        }
        torch.cuda.synchronize(dev)          # zeroed before anyone maps it
        self._buf, self._owner = buf, True
        self._set_meta(json.dumps(meta).encode())

    def _open_buffer(self, deadline: Optional[float]) -> None:
        if self._buf is not None:
            return
        self._wait(lambda: self._load(OFF_META_LEN) > 0, deadline, "the receiver's GPU buffer")
        meta = json.loads(self.meta.decode())
        if meta.get("pid") == os.getpid():
            raise TransportError("sender and receiver of a CudaIpcRing must be different processes")
        torch.cuda._lazy_init()
        dev = _open_index(meta.get("uuid"))
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                dev, _unhex(meta["handle"]), meta["size"], meta["offset"],
                _unhex(meta["ref_handle"]), meta["ref_offset"], _unhex(meta["event"]),
                bool(meta["event_sync"]))
        except RuntimeError as e:
            raise TransportError(
                f"ring {self.name!r}: cannot open the receiver's GPU buffer "
                f"(GPU {meta.get('uuid')}, "
                f"process {meta.get('pid')}) on local device {dev} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; CUDA IPC needs peer "
                f"access between the two GPUs") from None
        buf = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", dev))
        buf.set_(storage, 0, (int(meta["nbytes"]),), (1,))
        self._buf = buf

    def _view(self, idx: int, nbytes: int) -> torch.Tensor:
        off = idx * self._gstride
        return self._buf[off:off + nbytes]

    def _streams(self, stream) -> list:
        if stream is not None:
            return [stream]
        devs = {self._buf.device.index, torch.cuda.current_device()}
        return [torch.cuda.current_stream(d) for d in devs]

    # -- ring interface
    def ready(self, sending: bool) -> bool:
        """As `RingSegment.ready`, and False until the GPU buffer is open on this side (opening
        it may wait)."""
        return self._buf is not None and super().ready(sending)

    def send_slot(self, nbytes: int, deadline: float) -> torch.Tensor:
        """Wait for the receiver's buffer and a free slot; a uint8 GPU view of `nbytes` bytes."""
        self._check_open()
        self._check_abort()
        if int(nbytes) < 0 or int(nbytes) > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        self._register("producer")
        self._open_buffer(deadline)
        return self._view(self._acquire_send(nbytes, deadline), int(nbytes))

    def commit_send(self, stream: Optional[torch.cuda.Stream] = None,
                    defer: bool = False) -> None:
        """Publish the slot once the copies into it (current streams, or `stream`) are done:
        wait for them now, or with `defer` publish at a later `poll` or `flush` (slots are
        published in order)."""
        self._check_open()
        if self._send_idx is None:
            raise RuntimeError("commit_send without a preceding send_slot")
        self._commit(StreamMarker(self._streams(stream)))
        if not defer:
            self.flush()

    def recv_slot(self, deadline: float) -> torch.Tensor:
        """Wait for the next published slot; a uint8 GPU view of its bytes (valid until
        release_recv)."""
        self._check_open()
        self._check_abort()
        self._register("consumer")
        if self._buf is None:
            self.prepare_recv()
        idx, n = self._acquire_recv(deadline)
        return self._view(idx, n)

    def release_recv(self, stream: Optional[torch.cuda.Stream] = None,
                     defer: bool = False) -> None:
        """Free the slot once the reads of it (current streams, or `stream`) are done: wait for
        them now, or with `defer` free it at a later `poll` or `flush`."""
        self._check_open()
        if self._recv_idx is None:
            raise RuntimeError("release_recv without a preceding recv_slot")
        self._finish_recv(StreamMarker(self._streams(stream)))
        if not defer:
            self.flush()

    def _drop_views(self) -> None:
        self._buf = None
