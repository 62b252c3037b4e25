"""Single-copy forwards: cross-memory reads, and shared-memory slots that list the producer's
bytes for the consumer to copy itself, between real processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from ray_reshard.errors import TransportError
from ray_reshard.runtime.transport import cma
from ray_reshard.runtime.transport.shm import ShmRing

CTX = mp.get_context("spawn")
pytestmark = pytest.mark.skipif(not cma.available(), reason="Linux only: process_vm_readv")


def _rows(t: torch.Tensor, pieces) -> np.ndarray:
    base, size = t.data_ptr(), t.element_size()
    return np.array([(base + a * size, (b - a) * size) for a, b in pieces], dtype=np.int64)


def test_read_pairs_rows_cut_in_different_places():
    src = torch.arange(5000, dtype=torch.int32)
    dst = torch.zeros(5000, dtype=torch.int32)
    # 2500 two-element rows there (more than one call's IOV_MAX), three rows here
    remote = _rows(src, [(i, i + 2) for i in range(0, 5000, 2)])
    local = _rows(dst, [(0, 7), (7, 4001), (4001, 5000)])
    assert cma.read(os.getpid(), local, remote) == 5000 * 4
    assert torch.equal(src, dst)
    with pytest.raises(TransportError, match="listed there"):
        cma.read(os.getpid(), local[:1], remote)
    assert cma.probe(os.getpid(), src.data_ptr(), bytes(src[:2].numpy())) is None
    assert "other bytes" in cma.probe(os.getpid(), src.data_ptr(), b"\xff" * 8)


@pytest.mark.parametrize("seed", range(6))
def test_read_any_rows_adjacent_or_not_cut_anywhere(seed):
    """Random rows on both sides: runs that continue one another in memory (read as one row),
    gaps, empty rows, more than IOV_MAX rows on one side or both, cut in different places:
    every listed byte lands where it is listed here, nothing else is written."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6000))
    src = torch.from_numpy(rng.integers(0, 255, 3 * n + 100, dtype=np.uint8))
    dst = torch.zeros(3 * n + 100, dtype=torch.uint8)

    def cut(total_pieces: int):
        # pieces of [0, n): each piece a row, some followed by a gap in memory
        bounds = np.sort(rng.choice(np.arange(1, n), size=min(total_pieces, n - 1),
                                    replace=False)) if n > 1 else np.array([], dtype=int)
        edges = np.concatenate(([0], bounds, [n]))
        gaps = np.cumsum(rng.integers(0, 2, len(edges) - 1) * rng.integers(1, 3, len(edges) - 1))
        return [(a + g, b + g) for a, b, g in zip(edges[:-1], edges[1:], gaps)]

    here = cut(int(rng.integers(1, 2500)))
    there = cut(int(rng.integers(1, 2500)))
    assert cma.read(os.getpid(), _rows(dst, here + [(0, 0)]), _rows(src, there)) == n
    want = torch.zeros_like(dst)
    want[torch.cat([torch.arange(a, b) for a, b in here])] = \
        src[torch.cat([torch.arange(a, b) for a, b in there])]
    assert torch.equal(dst, want)


def test_read_from_a_process_that_is_gone_is_a_transport_error():
    p = CTX.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(TransportError, match=f"process {p.pid}"):
        cma.read(p.pid, _rows(buf, [(0, 8)]), np.array([[0x10000, 8]], dtype=np.int64))


def _producer(name: str, q) -> None:
    try:
        ring = ShmRing.attach(name)
        deadline = time.monotonic() + 30
        ring.send_slot(1, deadline).fill_(7)         # the consumer probes at this receive
        ring.commit_send()
        while not ring.reads_direct() and time.monotonic() < deadline - 25:
            time.sleep(0.01)
        data = torch.arange(1000, dtype=torch.float64)
        if ring.reads_direct():                      # two rows with a gap between them
            ring.send_rows(_rows(data, [(0, 300), (500, 1000)]), deadline)
        else:
            packed = torch.cat([data[:300], data[500:]])
            ring.send_slot(packed.numel() * 8, deadline).copy_(packed.view(torch.uint8))
            ring.commit_send()
        ring.drain(deadline)
        data.fill_(-1)                               # after drain: the consumer is done
        q.put(("ok", ring.reads_direct()))
        ring.close()
    except BaseException as e:
        q.put(("error", repr(e)))


@pytest.mark.parametrize("allowed", [True, False])
def test_slots_list_the_producers_bytes_once_the_consumer_may_read_them(allowed, monkeypatch):
    if not allowed:
        monkeypatch.setenv("RAY_RESHARD_SINGLE_COPY", "0")
    ring = ShmRing.create(1 << 16, slots=2)
    q = CTX.Queue()
    child = CTX.Process(target=_producer, args=(ring.name, q))
    child.start()
    try:
        deadline = time.monotonic() + 30
        first = ring.recv_slot(deadline)
        assert not ring.listed and int(first[0]) == 7
        ring.release_recv()
        assert ring.direct_refused == ("" if allowed else "RAY_RESHARD_SINGLE_COPY=0")
        slot = ring.recv_slot(deadline)
        got = torch.zeros(800, dtype=torch.float64)
        assert ring.listed == allowed
        if allowed:
            assert slot.numel() == 2 * 16                # two rows listed, no bytes
            ring.read_listed(slot, _rows(got, [(0, 800)]))
        else:
            got.view(torch.uint8).copy_(slot)
        ring.release_recv()
        want = torch.cat([torch.arange(300.0), torch.arange(500.0, 1000.0)]).double()
        assert torch.equal(got, want)
        assert q.get(timeout=30) == ("ok", allowed)
    finally:
        child.join(30)
        ShmRing.unlink(ring.name)
        ring.close()
    assert child.exitcode == 0
