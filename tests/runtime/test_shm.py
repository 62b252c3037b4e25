"""ShmRing: real processes exchanging buckets through one shared-memory segment."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import stat
import time

import pytest
import torch

from ray_reshard.errors import TransportError, TransportTimeout
from ray_reshard.runtime.transport.segment import SHM_DIR, segment_exists
from ray_reshard.runtime.transport.shm import ShmRing

CTX = mp.get_context("spawn")
JOIN_S = 60


def _bucket(seed: int, i: int, slot_bytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    # sizes cover 0, 1, the full slot, and random sizes in between
    special = {0: 0, 1: 1, 2: slot_bytes, 3: slot_bytes - 1}
    n = special.get(i, int(torch.randint(0, slot_bytes + 1, (1,), generator=g)))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _producer(name, seed, count, q):
    try:
        ring = ShmRing.attach(name)
        for i in range(count):
            data = _bucket(seed, i, ring.slot_bytes)
            view = ring.send_slot(data.numel(), time.monotonic() + 30)
            view.copy_(data)
            ring.commit_send()
        q.put(("producer", "ok", count))
        ring.close()
    except BaseException as e:  # report everything to the parent
        q.put(("producer", "error", repr(e)))


def _consumer(name, seed, count, q):
    try:
        ring = ShmRing.attach(name)
        bad = []
        for i in range(count):
            view = ring.recv_slot(time.monotonic() + 30)
            want = _bucket(seed, i, ring.slot_bytes)
            if view.numel() != want.numel() or not torch.equal(view, want):
                bad.append(i)
            ring.release_recv()
        q.put(("consumer", "ok", bad))
        ring.close()
    except BaseException as e:
        q.put(("consumer", "error", repr(e)))


def _consume_here(ring: ShmRing, seed: int, count: int):
    bad = []
    for i in range(count):
        view = ring.recv_slot(time.monotonic() + 30)
        want = _bucket(seed, i, ring.slot_bytes)
        if view.numel() != want.numel() or not torch.equal(view, want):
            bad.append(i)
        ring.release_recv()
    return bad


def _produce_here(ring: ShmRing, seed: int, count: int):
    for i in range(count):
        data = _bucket(seed, i, ring.slot_bytes)
        ring.send_slot(data.numel(), time.monotonic() + 30).copy_(data)
        ring.commit_send()
    return count


def _run_pair(ring: ShmRing, seed: int, count: int, unlink_after_attach: bool,
              consumer_in_parent: bool):
    """One side in a spawned child process, the other in this process."""
    q = CTX.Queue()
    child = CTX.Process(target=_producer if consumer_in_parent else _consumer,
                        args=(ring.name, seed, count, q))
    child.start()
    if unlink_after_attach:
        deadline = time.monotonic() + JOIN_S
        while ring.attached < 2 and time.monotonic() < deadline:   # this process + the child
            time.sleep(0.01)
        assert ring.attached == 2
        ShmRing.unlink(ring.name)
        assert not segment_exists(ring.name)
    results = {}
    if consumer_in_parent:
        results["consumer"] = ("ok", _consume_here(ring, seed, count))
    else:
        results["producer"] = ("ok", _produce_here(ring, seed, count))
    role, status, payload = q.get(timeout=JOIN_S)
    results[role] = (status, payload)
    child.join(JOIN_S)
    assert child.exitcode == 0
    return results


@pytest.fixture
def ring_factory():
    made = []

    def make(*args, **kwargs):
        r = ShmRing.create(*args, **kwargs)
        made.append(r)
        return r

    yield make
    for r in made:
        ShmRing.unlink(r.name)
        r.close()


@pytest.mark.parametrize("slots,unlink_early,consumer_in_parent",
                         [(2, True, False), (3, False, True), (1, True, True), (2, False, False)])
def test_two_processes_random_buckets_bit_exact(ring_factory, slots, unlink_early,
                                                consumer_in_parent):
    ring = ring_factory(64 * 1024 + 3, slots=slots)   # odd size: exercises the slot stride
    ring.close()                                        # the children attach by name
    ring = ShmRing.attach(ring.name)
    count = 80
    res = _run_pair(ring, seed=slots, count=count, unlink_after_attach=unlink_early,
                    consumer_in_parent=consumer_in_parent)
    assert res["producer"] == ("ok", count)
    assert res["consumer"] == ("ok", [])
    assert ring.pending() == 0
    ring.close()


def test_recv_deadline_when_peer_never_comes(ring_factory):
    ring = ring_factory(4096)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        ring.recv_slot(t0 + 0.2)
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < 2.0


def test_send_deadline_when_ring_full(ring_factory):
    ring = ring_factory(4096, slots=2)
    for _ in range(2):
        ring.send_slot(10, time.monotonic() + 1)
        ring.commit_send()
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        ring.send_slot(10, t0 + 0.2)
    assert time.monotonic() - t0 < 2.0
    # a timed-out send leaves no half-acquired slot behind: after a release it works again
    peer = ShmRing.attach(ring.name)
    peer.recv_slot(time.monotonic() + 1)
    peer.release_recv()
    ring.send_slot(10, time.monotonic() + 1)
    ring.commit_send()
    peer.close()


def test_timeout_is_transport_error_and_timeout_error():
    assert issubclass(TransportTimeout, TransportError)
    assert issubclass(TransportTimeout, TimeoutError)


def _blocked_receiver(name, q):
    ring = ShmRing.attach(name)
    q.put("ready")
    t0 = time.monotonic()
    try:
        ring.recv_slot(time.monotonic() + 30)
        q.put(("returned", 0.0, ""))
    except TransportTimeout as e:
        q.put(("timeout", time.monotonic() - t0, str(e)))
    except TransportError as e:
        q.put(("aborted", time.monotonic() - t0, str(e)))


def _blocked_sender(name, q):
    ring = ShmRing.attach(name)
    for _ in range(ring.slots):
        ring.send_slot(1, time.monotonic() + 5)
        ring.commit_send()
    q.put("ready")
    t0 = time.monotonic()
    try:
        ring.send_slot(1, time.monotonic() + 30)
        q.put(("returned", 0.0, ""))
    except TransportTimeout as e:
        q.put(("timeout", time.monotonic() - t0, str(e)))
    except TransportError as e:
        q.put(("aborted", time.monotonic() - t0, str(e)))


@pytest.mark.parametrize("target", [_blocked_receiver, _blocked_sender])
def test_abort_wakes_blocked_peer(ring_factory, target):
    ring = ring_factory(4096)
    q = CTX.Queue()
    p = CTX.Process(target=target, args=(ring.name, q))
    p.start()
    assert q.get(timeout=JOIN_S) == "ready"
    time.sleep(0.3)
    ring.abort("trainer rank 3 failed")
    kind, waited, msg = q.get(timeout=10)
    p.join(JOIN_S)
    assert kind == "aborted"
    assert "trainer rank 3 failed" in msg
    assert waited < 5
    code, pid, reason = ring.abort_reason()
    assert (pid, reason) == (os.getpid(), "trainer rank 3 failed")
    # the aborting side fails too
    with pytest.raises(TransportError):
        ring.send_slot(1, time.monotonic() + 1)


def _send_one_and_exit(name):
    ring = ShmRing.attach(name)
    ring.send_slot(3, time.monotonic() + 5).fill_(7)
    ring.commit_send()


def test_peer_exit_is_detected_before_deadline(ring_factory):
    ring = ring_factory(4096)
    p = CTX.Process(target=_send_one_and_exit, args=(ring.name,))
    p.start()
    p.join(JOIN_S)
    assert p.exitcode == 0
    view = ring.recv_slot(time.monotonic() + 5)       # published data survives the producer
    assert view.tolist() == [7, 7, 7]
    ring.release_recv()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="exited"):
        ring.recv_slot(time.monotonic() + 30)
    assert time.monotonic() - t0 < 5


def test_unlink_removes_name_but_mapping_works(ring_factory):
    ring = ring_factory(1 << 16)
    peer = ShmRing.attach(ring.name)
    path = os.path.join(SHM_DIR, ring.name)
    assert os.path.exists(path)
    ShmRing.unlink(ring.name)
    ShmRing.unlink(ring.name)          # idempotent
    assert not os.path.exists(path)
    assert ring.name not in os.listdir(SHM_DIR)
    data = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
    ring.send_slot(data.numel(), time.monotonic() + 1).copy_(data)
    ring.commit_send()
    got = peer.recv_slot(time.monotonic() + 1)
    assert torch.equal(got, data)
    peer.release_recv()
    with pytest.raises(TransportError, match="does not exist"):
        ShmRing.attach(ring.name)
    peer.close()


def test_permissions_and_unguessable_names(ring_factory):
    names = set()
    for _ in range(20):
        ring = ring_factory(128)
        st = os.stat(os.path.join(SHM_DIR, ring.name))
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
        assert re.fullmatch(r"rr-[0-9a-f]{32}", ring.name)
        names.add(ring.name)
    assert len(names) == 20


def test_create_with_existing_name_fails(ring_factory):
    ring = ring_factory(128)
    with pytest.raises(FileExistsError):
        ShmRing.create(128, name=ring.name)
    for bad in ("../etc/passwd", "a/b", "", ".hidden"):
        with pytest.raises(ValueError):
            ShmRing.create(128, name=bad)


def test_close_idempotent_and_views_stay_valid(ring_factory):
    ring = ring_factory(4096)
    view = ring.send_slot(100, time.monotonic() + 1)
    view.fill_(5)
    ring.commit_send()
    ring.close()
    ring.close()
    assert ring.closed
    assert int(view.sum()) == 500          # the view keeps the mapping alive
    with pytest.raises(TransportError, match="closed"):
        ring.send_slot(1, time.monotonic() + 1)
    ring.abort("after close")              # harmless
    del view                               # the mapping goes with the last view


def test_misuse_errors(ring_factory):
    ring = ring_factory(64)
    with pytest.raises(ValueError):
        ring.send_slot(65, time.monotonic() + 1)
    with pytest.raises(ValueError):
        ring.send_slot(-1, time.monotonic() + 1)
    with pytest.raises(RuntimeError):
        ring.commit_send()
    with pytest.raises(RuntimeError):
        ring.release_recv()
    ring.send_slot(64, time.monotonic() + 1)
    with pytest.raises(RuntimeError):
        ring.send_slot(1, time.monotonic() + 1)
    ring.commit_send()
    with pytest.raises(ValueError):
        ShmRing.create(0, slots=0)


def test_slot_views_are_aligned_for_any_dtype(ring_factory):
    ring = ring_factory(1000, slots=3)
    peer = ShmRing.attach(ring.name)
    for i in range(6):
        v = ring.send_slot(8 * 100, time.monotonic() + 1)
        assert v.data_ptr() % 4096 == 0
        v.view(torch.float64).copy_(torch.full((100,), float(i), dtype=torch.float64))
        ring.commit_send()
        r = peer.recv_slot(time.monotonic() + 1)
        assert r.data_ptr() % 4096 == 0
        assert torch.equal(r.view(torch.float64), torch.full((100,), float(i), dtype=torch.float64))
        peer.release_recv()
    peer.close()


def test_pickle_attaches_by_name(ring_factory):
    ring = ring_factory(256)
    clone = pickle.loads(pickle.dumps(ring))
    assert (clone.name, clone.slot_bytes, clone.slots) == (ring.name, 256, 2)
    ring.send_slot(4, time.monotonic() + 1).fill_(9)
    ring.commit_send()
    assert clone.recv_slot(time.monotonic() + 1).tolist() == [9] * 4
    clone.release_recv()
    clone.close()


# ---- throughput: ring vs a multiprocessing pipe --------------------------------------------------

_MB = 1 << 20


def _tp_ring_producer(name, n, start):
    ring = ShmRing.attach(name)
    src = torch.empty((ring.slot_bytes,), dtype=torch.uint8)
    start.set()
    for i in range(n):
        src.fill_(i % 251)                   # each bucket its own byte: order and content
        ring.send_slot(src.numel(), time.monotonic() + 60).copy_(src)
        ring.commit_send()


def _tp_ring_consume(ring, n, start):
    dst = torch.empty(ring.slot_bytes, dtype=torch.uint8)
    dst.fill_(0)
    assert start.wait(120)
    t0 = time.perf_counter()
    marks = []
    for _ in range(n):
        dst.copy_(ring.recv_slot(time.monotonic() + 60))
        ring.release_recv()
        marks.append((int(dst[0]), int(dst[dst.numel() // 2]), int(dst[-1])))
    dt = time.perf_counter() - t0
    assert marks == [(i % 251,) * 3 for i in range(n)], marks
    return dt


def _tp_pipe_producer(conn, nbytes, n, start):
    src = torch.empty((nbytes,), dtype=torch.uint8)
    start.set()
    for i in range(n):
        src.fill_(i % 251)
        conn.send_bytes(src.numpy())


def _tp_pipe_consume(conn, nbytes, n, start):
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)
    buf = dst.numpy()
    assert start.wait(120)
    t0 = time.perf_counter()
    marks = []
    for _ in range(n):
        conn.recv_bytes_into(buf)
        marks.append((int(dst[0]), int(dst[-1])))
    dt = time.perf_counter() - t0
    assert marks == [(i % 251,) * 2 for i in range(n)], marks
    return dt


def _timed(proc, consume):
    """Start the producer child; this process consumes. The child sets the start event once it
    is set up, so its spawn time is not measured."""
    proc.start()
    dt = consume()
    proc.join(120)
    assert proc.exitcode == 0
    return dt


@pytest.mark.slow
def test_throughput_ring_vs_pipe(ring_factory, record_property):
    """A benchmark (CI's slow run): prints both rates; every bucket arrives in order with its
    own contents on both paths."""
    slot = 64 * _MB
    n_ring, n_pipe = 16, 4               # 1 GiB through the ring, 256 MiB through the (slow) pipe
    ring = ring_factory(slot, slots=2)
    start = CTX.Event()
    dt_ring = _timed(CTX.Process(target=_tp_ring_producer, args=(ring.name, n_ring, start)),
                     lambda: _tp_ring_consume(ring, n_ring, start))
    rx, tx = CTX.Pipe(duplex=False)
    start = CTX.Event()
    dt_pipe = _timed(CTX.Process(target=_tp_pipe_producer, args=(tx, slot, n_pipe, start)),
                     lambda: _tp_pipe_consume(rx, slot, n_pipe, start))
    ring_gib_s = slot * n_ring / (1 << 30) / dt_ring
    pipe_gib_s = slot * n_pipe / (1 << 30) / dt_pipe
    print(f"\n[throughput] 64 MiB buckets, producer child -> consumer parent: "
          f"ShmRing (2 slots) {ring_gib_s:.2f} GiB/s, multiprocessing pipe {pipe_gib_s:.2f} GiB/s "
          f"({ring_gib_s / pipe_gib_s:.1f}x)")
    record_property("shm_ring_gib_s", ring_gib_s)
    record_property("mp_pipe_gib_s", pipe_gib_s)


class LateMarker:
    """A stand-in for a CUDA event of a copy still running: done at its `after`-th query, or
    once waited for."""

    def __init__(self, after: int = 2):
        self.left = after

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def synchronize(self) -> None:
        self.left = 0


def test_deferred_commits_and_releases_keep_order_and_count_as_used(ring_factory):
    ring = ring_factory(16, slots=3)
    peer = ShmRing.attach(ring.name)
    first, second = LateMarker(100), LateMarker(1)
    ring.send_slot(1, time.monotonic() + 1).fill_(1)
    ring.commit_send(first)
    ring.send_slot(1, time.monotonic() + 1).fill_(2)
    ring.commit_send(second)                # done, but published only after the first
    assert ring.deferred == 2 and ring.pending() == 0
    assert not peer.ready(False)
    assert ring.ready(True)                 # one slot of three left
    ring.send_slot(1, time.monotonic() + 1).fill_(3)
    ring.commit_send()                      # no marker: still behind the deferred ones
    assert not ring.ready(True) and ring.deferred == 3
    assert ring.poll() and ring.pending() == 0
    first.left = 1                          # the first copy finishes
    assert not ring.poll() and ring.pending() == 3 and ring.deferred == 0
    got = []
    for _ in range(3):
        got.append(int(peer.recv_slot(time.monotonic() + 1)[0]))
        peer.release_recv(LateMarker(5))
    assert got == [1, 2, 3]
    assert peer.deferred == 3 and not ring.ready(True)     # taken, not yet freed
    peer.flush()
    assert peer.deferred == 0 and ring.ready(True) and ring.pending() == 0
    peer.close()


def test_a_waiting_side_flushes_its_own_deferred_slots(ring_factory):
    """A side about to wait for its peer first publishes (frees) its own deferred slots, so it
    never waits on a slot it holds itself."""
    ring = ring_factory(16, slots=2)
    peer = ShmRing.attach(ring.name)
    for v in (1, 2):
        ring.send_slot(1, time.monotonic() + 1).fill_(v)
        ring.commit_send(LateMarker(100))
    assert not ring.ready(True) and ring.pending() == 0
    with pytest.raises(TransportTimeout):       # flushed both, then waited for the consumer
        ring.send_slot(1, time.monotonic() + 0.2)
    assert ring.pending() == 2 and ring.deferred == 0
    for v in (1, 2):
        assert int(peer.recv_slot(time.monotonic() + 1)[0]) == v
        peer.release_recv(LateMarker(100))
    assert not ring.ready(True)
    with pytest.raises(TransportTimeout):       # freed both, then waited for the producer
        peer.recv_slot(time.monotonic() + 0.2)
    assert ring.ready(True) and ring.pending() == 0
    peer.close()


def test_abort_drops_deferred_slots(ring_factory):
    ring = ring_factory(16, slots=2)
    peer = ShmRing.attach(ring.name)
    ring.send_slot(1, time.monotonic() + 1)
    ring.commit_send(LateMarker(100))
    peer.abort("test")
    assert not ring.poll() and ring.deferred == 0 and ring.pending() == 0
    peer.close()
