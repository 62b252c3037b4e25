"""CudaIpcRing: GPU slots shared by CUDA IPC. The exchange tests need CUDA (marked gpu, skipped
without it); the header/handshake parts run anywhere."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as tmp

from ray_reshard.errors import TransportError, TransportTimeout
from ray_reshard.runtime.transport.cuda_ipc import CudaIpcRing
from ray_reshard.runtime.transport.segment import segment_exists

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
JOIN_S = 120


@pytest.fixture
def ring():
    r = CudaIpcRing.create(1 << 20, slots=2)
    yield r
    CudaIpcRing.unlink(r.name)
    r.close()


# ---- anywhere -------------------------------------------------------------------------------------

def test_header_only_segment_and_attach(ring):
    assert segment_exists(ring.name)
    peer = CudaIpcRing.attach(ring.name)
    assert (peer.slot_bytes, peer.slots) == (1 << 20, 2)
    assert peer.device is None and ring.meta == b""
    peer.close()
    peer.close()


def test_sender_waits_for_receiver_buffer_until_deadline(ring):
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout, match="GPU buffer"):
        ring.send_slot(16, t0 + 0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(ValueError):
        ring.send_slot((1 << 20) + 1, time.monotonic() + 1)


def test_abort_wakes_sender_waiting_for_buffer(ring):
    peer = CudaIpcRing.attach(ring.name)
    peer.abort("receiver failed")
    with pytest.raises(TransportError, match="receiver failed"):
        ring.send_slot(16, time.monotonic() + 5)
    peer.close()


def test_misuse(ring):
    with pytest.raises(RuntimeError):
        ring.commit_send()
    with pytest.raises(RuntimeError):
        ring.release_recv()


# ---- GPU ------------------------------------------------------------------------------------------

def _bucket(seed: int, i: int, slot_bytes: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + i)
    special = {0: 0, 1: 1, 2: slot_bytes}
    n = special.get(i, int(torch.randint(0, slot_bytes + 1, (1,), generator=g)))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _gpu_producer(name, seed, count, use_stream, q, visible=None, defer=False):
    try:
        if visible is not None:          # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        torch.cuda.set_device(0)
        ring = CudaIpcRing.attach(name)
        stream = torch.cuda.Stream() if use_stream else None
        for i in range(count):
            data = _bucket(seed, i, ring.slot_bytes, "cuda")
            slot = ring.send_slot(data.numel(), time.monotonic() + 60)
            assert slot.is_cuda
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    slot.copy_(data)
                ring.commit_send(stream=stream, defer=defer)
            else:
                slot.copy_(data)
                ring.commit_send(defer=defer)
            ring.poll()
        # typed packing: a float32 view of a slot (slots are aligned)
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed)).cuda()
        slot = ring.send_slot(x.numel() * 4, time.monotonic() + 60)
        slot.view(torch.float32).copy_(x)
        ring.commit_send(defer=defer)
        ring.flush()
        assert ring.deferred == 0
        q.put(("producer", "ok", count + 1))
        ring.close()
    except BaseException as e:
        q.put(("producer", "error", repr(e)))


def _gpu_consumer(name, seed, count, q, visible=None, defer=False):
    try:
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        torch.cuda.set_device(0)
        ring = CudaIpcRing.attach(name)
        ring.prepare_recv()
        bad = []
        for i in range(count):
            view = ring.recv_slot(time.monotonic() + 60)
            want = _bucket(seed, i, ring.slot_bytes, "cuda")
            if view.numel() != want.numel() or not torch.equal(view, want):
                bad.append(i)
            ring.release_recv(defer=defer)
        view = ring.recv_slot(time.monotonic() + 60)
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed)).cuda()
        if not torch.equal(view.view(torch.float32), x):
            bad.append("float32")
        ring.release_recv(defer=defer)
        ring.flush()
        q.put(("consumer", "ok", bad))
        ring.close()
    except BaseException as e:
        q.put(("consumer", "error", repr(e)))


def _exchange(slots, use_stream, consumer_gpu=None, producer_gpu=None, defer=False):
    ctx = tmp.get_context("spawn")
    ring = CudaIpcRing.create(1 << 20, slots=slots)     # created without touching CUDA here
    try:
        count = 60
        q = ctx.Queue()
        procs = [ctx.Process(target=_gpu_consumer, args=(ring.name, slots, count, q,
                                                         consumer_gpu, defer)),
                 ctx.Process(target=_gpu_producer, args=(ring.name, slots, count, use_stream, q,
                                                         producer_gpu, defer))]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            role, status, payload = q.get(timeout=JOIN_S)
            results[role] = (status, payload)
        for p in procs:
            p.join(JOIN_S)
        assert results["producer"] == ("ok", count + 1), results
        assert results["consumer"] == ("ok", []), results
        assert ring.pending() == 0
    finally:
        CudaIpcRing.unlink(ring.name)
        ring.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("slots,use_stream,defer", [(2, False, False), (3, True, False),
                                                    (2, False, True), (3, True, True)])
def test_two_processes_exchange_buckets_bit_exact(slots, use_stream, defer):
    """With `defer`, slots are published and freed on CUDA events (poll / flush)."""
    _exchange(slots, use_stream, defer=defer)


@pytest.mark.gpu
@needs_cuda
def test_exchange_under_expandable_segments(monkeypatch):
    """The receiver's slots must be shareable by CUDA IPC whatever the allocator settings."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    _exchange(2, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two GPUs")
def test_exchange_between_gpus_invisible_to_each_other():
    """Ray's default: each process sees only its own GPU (CUDA_VISIBLE_DEVICES)."""
    _exchange(2, False, consumer_gpu="1", producer_gpu="0")


def _gpu_late_receiver(name, q):
    try:
        torch.cuda.set_device(0)
        ring = CudaIpcRing.attach(name)
        time.sleep(1.0)                       # the sender is already waiting for the buffer
        view = ring.recv_slot(time.monotonic() + 60)
        q.put(("consumer", "ok", view.cpu().tolist()))
        ring.release_recv()
        ring.close()
    except BaseException as e:
        q.put(("consumer", "error", repr(e)))


@pytest.mark.gpu
@needs_cuda
def test_sender_first_waits_for_receiver_buffer():
    ctx = tmp.get_context("spawn")
    ring = CudaIpcRing.create(4096)
    try:
        q = ctx.Queue()
        p = ctx.Process(target=_gpu_late_receiver, args=(ring.name, q))
        p.start()
        # this process is the sender: it opens the receiver's buffer once published
        torch.cuda.set_device(0)
        slot = ring.send_slot(4, time.monotonic() + 60)
        slot.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device="cuda"))
        ring.commit_send()
        assert q.get(timeout=JOIN_S) == ("consumer", "ok", [1, 2, 3, 4])
        p.join(JOIN_S)
        assert p.exitcode == 0
    finally:
        CudaIpcRing.unlink(ring.name)
        ring.close()
