"""The executor's message groups under NCCL's semantics, on CPU: every process's compiled program
runs in its own thread over in-memory channels that behave like NCCL (a process's groups run one
after another, a group completes only when all its messages did, a pair's messages match in
posting order) and rings like the shared-memory ones (blocking, two slots). Results must be
bit-exact and no layout may deadlock, whatever the window."""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import pytest
import torch

import ray_reshard as rr
from ray_reshard.execution.pack import shard_view
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.planning.moves import Endpoint
from ray_reshard.execution.program import SEND, compile_program
from ray_reshard.errors import TransportTimeout
from ray_reshard.planning.moves import NETWORK
from ray_reshard.runtime.channel import Channel, RingChannel
from ray_reshard.runtime.transport.shm import ShmRing
from ray_reshard.runtime.executor import Transports, run_program

STALL_S = 20.0


class Group:
    """Posted messages that complete together (identity comparison only)."""

    def __init__(self):
        self.ops, self.done = [], 0


class Fabric:
    """Point-to-point matching shared by all processes (NCCL-like when `serial`)."""

    def __init__(self, serial: bool):
        self.serial = serial
        self.cond = threading.Condition()
        self.queues = defaultdict(deque)        # (sender, receiver, "s"/"r") -> ops
        self.streams = defaultdict(deque)       # process -> its groups, oldest first
        self.groups_posted = 0

    def post(self, proc, ops):
        group = Group()
        with self.cond:
            for peer, tensor, sending in ops:
                op = {"group": group, "tensor": tensor, "done": False}
                group.ops.append(op)
                pair = (proc, peer, "s") if sending else (peer, proc, "r")
                self.queues[pair].append(op)
            self.streams[proc].append(group)
            self.groups_posted += 1
            self._match()
        return group

    def _active(self, op, proc):
        return not self.serial or self.streams[proc][0] is op["group"]

    def _match(self):
        progress = True
        while progress:
            progress = False
            for (a, b, kind), q in list(self.queues.items()):
                if kind != "s" or not q:
                    continue
                rq = self.queues[(a, b, "r")]
                while q and rq and self._active(q[0], a) and self._active(rq[0], b):
                    s, r = q.popleft(), rq.popleft()
                    assert s["tensor"].numel() == r["tensor"].numel()
                    r["tensor"].copy_(s["tensor"])
                    for op, proc in ((s, a), (r, b)):
                        op["done"] = True
                        g = op["group"]
                        g.done += 1
                        if g.done == len(g.ops):
                            stream = self.streams[proc]
                            assert stream[0] is g or not self.serial
                            del stream[next(i for i, x in enumerate(stream) if x is g)]
                    progress = True
            self.cond.notify_all()

    def wait(self, group, deadline):
        with self.cond:
            while group.done < len(group.ops):
                if not self.cond.wait(timeout=max(0.0, min(deadline, time.monotonic() + 1.0)
                                                  - time.monotonic())):
                    if time.monotonic() >= deadline:
                        raise TransportTimeout("stalled")


class FakeNet(Channel):
    def __init__(self, fabric, proc, polls=False):
        self.fabric, self.proc, self.polls = fabric, proc, polls

    def done(self, handle):
        with self.fabric.cond:
            return handle.done == len(handle.ops)

    def post(self, peer, tensor, sending):
        return self.fabric.post(self.proc, [(peer, tensor, sending)])

    def post_group(self, ops):
        return self.fabric.post(self.proc, ops)

    def complete(self, handle, deadline, what):
        self.fabric.wait(handle, deadline)


class FakeRings:
    """Blocking two-slot rings between every pair of processes that asks for one (and a
    readiness check that never blocks)."""

    slots = 2

    def __init__(self, shared, proc):
        self.shared, self.proc = shared, proc

    def has(self, peer, sending):
        return True

    def poll(self):                 # a post here is complete when it returns
        pass

    def flush(self):
        pass

    listed_bytes = 0                # bytes always travel in the slots here

    def drain(self, deadline):
        pass

    def post_part(self, peer, part, sending, nbytes, deadline):
        self.post(peer, part.pack if sending else part.unpack, sending, nbytes, deadline)

    def ready(self, peer, sending):
        key = (self.proc, peer) if sending else (peer, self.proc)
        cond, q = self.shared.setdefault(key, (threading.Condition(), deque()))
        with cond:
            return len(q) < self.slots if sending else bool(q)

    def post(self, peer, fn, sending, nbytes=0, deadline=0.0):
        key = (self.proc, peer) if sending else (peer, self.proc)
        cond, q = self.shared.setdefault(key, (threading.Condition(), deque()))
        with cond:
            while (len(q) >= self.slots) if sending else not q:
                if not cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TransportTimeout("ring stalled")
            if sending:
                slot = torch.empty(nbytes, dtype=torch.uint8)
                fn(slot)
                q.append(slot)
            else:
                fn(q.popleft())
            cond.notify_all()


def run_threads(p, src_store, dst_store, bucket_bytes, window, serial, per_item_bytes):
    topo = p.topology
    eps = [Endpoint("src", r) for r in range(topo.n_src)] + \
          [Endpoint("dst", r) for r in range(topo.n_dst)]
    stores = {"src": src_store, "dst": dst_store}
    fabric, rings = Fabric(serial), {}
    errors, threads = [], []

    def one(proc, ep):
        try:
            prog = compile_program(p, [ep], bucket_bytes, per_item_bytes=per_item_bytes)
            views = {k: shard_view(p, k[0], k[1], k[2], stores[k[0]][k[1]])
                     for k in prog.held}
            # NCCL-like: its waits can be sliced, so runs leave late ring receives behind
            tr = Transports(FakeNet(fabric, proc, polls=serial), FakeRings(rings, proc),
                            torch.device("cpu"), window)
            run_program(prog, views, tr, time.monotonic() + STALL_S)
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append((ep, e))

    for proc, ep in enumerate(eps):
        t = threading.Thread(target=one, args=(proc, ep), daemon=True)
        threads.append(t)
        t.start()
    for t in threads:
        t.join(STALL_S + 10)
    assert not errors, errors
    return fabric


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


def layouts():
    tp4 = L([0, 1, 2, 3], Shard(0))
    yield "tp4 -> tp2xdp2", tp4, L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    yield "rows x cols -> cols", L([[0, 1], [2, 3]], Shard(0), Shard(1)), \
        L([0, 1, 2, 3], Shard(1))
    yield "tp4 -> dp4", tp4, L([0, 1, 2, 3], Replicate())
    yield "pp2 -> tp2xdp2", L([0, 1], Shard(0)), \
        L([[0, 1], [2, 3]], Replicate(), Shard(1), names=("dp", "tp"))


@pytest.mark.parametrize("dst_domain", [2, 4])
@pytest.mark.parametrize("serial", [True, False], ids=["nccl-like", "independent"])
@pytest.mark.parametrize("window", [1, 2, 4, 8])
@pytest.mark.parametrize("per_item", [None, 2048], ids=["packed", "per-item"])
def test_groups_match_and_never_deadlock(serial, window, per_item, dst_domain):
    for name, src, dst in layouts():
        specs, fulls = {}, {}
        g = torch.Generator().manual_seed(window)
        for i, shape in enumerate([(64, 48), (48, 64), (7, 5), (128, 32)]):
            specs[f"{name}.{i}"] = rr.TensorSpec(shape, torch.float32, src, dst)
            fulls[f"{name}.{i}"] = torch.randn(shape, generator=g)
        n_src, n_dst = src.mesh.size, dst.mesh.size
        # Destination domains of `dst_domain` ranks: network buckets, then forwards inside.
        p = rr.plan(specs, src_domains=["s"] * n_src,
                    dst_domains=[f"d{j // dst_domain}" for j in range(n_dst)])
        src_store = [{n: rr.shard_tensor(f, s.src, r) for n, (f, s) in
                      ((n, (fulls[n], specs[n])) for n in specs) if s.src.box(r, s.shape)}
                     for r in range(n_src)]
        dst_store = [{n: torch.full(s.dst.local_shape(r, s.shape), -1.0) for n, s in specs.items()
                      if s.dst.box(r, s.shape)} for r in range(n_dst)]
        fabric = run_threads(p, src_store, dst_store, 4096, window, serial, per_item)
        for n, s in specs.items():
            for r in range(n_dst):
                if s.dst.box(r, s.shape):
                    assert torch.equal(dst_store[r][n], rr.shard_tensor(fulls[n], s.dst, r)), \
                        (name, n, r)
        assert fabric.groups_posted > 0


@pytest.mark.parametrize("window", [2, 8])
def test_forward_segments_never_deadlock(window):
    """A 32-rank destination domain (TP2 x DP16): forwards are merged per segment of a round's
    rotations and sent during the next segment (two segments here), with network groups of one
    or four rotations. Bit-exact, no deadlock, under NCCL's rules."""
    from ray_reshard.planning.schedule import forward_segments

    src = L([0, 1, 2, 3], Shard(0))
    dst = L(torch.arange(32).reshape(16, 2).tolist(), Replicate(), Shard(0), names=("dp", "tp"))
    specs, fulls = {}, {}
    g = torch.Generator().manual_seed(window)
    for i, shape in enumerate([(64, 48), (32, 64), (8, 4)]):
        specs[f"w{i}"] = rr.TensorSpec(shape, torch.float32, src, dst)
        fulls[f"w{i}"] = torch.randn(shape, generator=g)
    p = rr.plan(specs, src_domains=["s"] * 4, dst_domains=["d"] * 32)
    assert forward_segments(4, 32) == 2
    assert any(t.src.side == "dst" and t.key[0] == p.schedule(2048).transfers[0].key[0]
               for t in p.schedule(2048).transfers), "a forward inside the first round"
    src_store = [{n: rr.shard_tensor(fulls[n], s.src, r) for n, s in specs.items()}
                 for r in range(4)]
    dst_store = [{n: torch.full(s.dst.local_shape(r, s.shape), -1.0) for n, s in specs.items()}
                 for r in range(32)]
    run_threads(p, src_store, dst_store, 2048, window, True, None)
    for n, s in specs.items():
        for r in range(32):
            assert torch.equal(dst_store[r][n], rr.shard_tensor(fulls[n], s.dst, r)), (n, r)


class SlowCopy:
    """A stand-in for the CUDA event after a ring copy still running: every other one done at
    its third query, the others only once waited for (`synchronize`)."""

    made = 0

    def __init__(self):
        SlowCopy.made += 1
        self.left = 3 if SlowCopy.made % 2 else 1 << 60

    def query(self):
        self.left -= 1
        return self.left <= 0

    def synchronize(self):
        self.left = 0


class DeferringRing(ShmRing):
    """A shared-memory ring whose commits and releases are deferred as CUDA IPC rings' are."""

    def commit_send(self, done=None, defer=False):
        super().commit_send(SlowCopy() if defer else done)

    def release_recv(self, done=None, defer=False):
        super().release_recv(SlowCopy() if defer else done)


def run_deferring(p, src_store, dst_store, bucket_bytes, window, polls=False):
    """`run_threads` with real shared-memory rings whose commits and releases are deferred,
    behind the real RingChannel: the executor must poll and flush them itself. With `polls`
    the network answers `done` and short waits (NCCL), so runs leave late receives behind."""
    topo = p.topology
    eps = [Endpoint("src", r) for r in range(topo.n_src)] + \
          [Endpoint("dst", r) for r in range(topo.n_dst)]
    stores = {"src": src_store, "dst": dst_store}
    progs = [compile_program(p, [ep], bucket_bytes) for ep in eps]
    rings = {}
    for proc, prog in enumerate(progs):
        for st in prog.steps:
            if st.kind == SEND and st.path != NETWORK and (proc, st.peer) not in rings:
                rings[(proc, st.peer)] = DeferringRing.create(bucket_bytes, slots=2)
    fabric, errors, threads, left_behind = Fabric(True), [], [], []

    def one(proc, ep, prog):
        try:
            views = {k: shard_view(p, k[0], k[1], k[2], stores[k[0]][k[1]]) for k in prog.held}
            chan = RingChannel({b: DeferringRing.attach(r.name)
                                for (a, b), r in rings.items() if a == proc},
                               {a: DeferringRing.attach(r.name)
                                for (a, b), r in rings.items() if b == proc})
            stats = run_program(prog, views, Transports(FakeNet(fabric, proc, polls), chan,
                                                        torch.device("cpu"), window),
                                time.monotonic() + STALL_S)
            left_behind.append(stats["ring_recvs_left_behind"])
            assert not chan.waiting
            for ring in [*chan.rings_out.values(), *chan.rings_in.values()]:
                assert ring.deferred == 0
                ring.close()
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append((ep, e))

    try:
        for proc, (ep, prog) in enumerate(zip(eps, progs)):
            t = threading.Thread(target=one, args=(proc, ep, prog), daemon=True)
            threads.append(t)
            t.start()
        for t in threads:
            t.join(STALL_S + 10)
        assert not errors, errors
        assert all(r.pending() == 0 for r in rings.values())
    finally:
        for r in rings.values():
            ShmRing.unlink(r.name)
            r.close()
    return len(rings), sum(left_behind)


@pytest.mark.parametrize("polls", [False, True], ids=["gloo-like", "nccl-like"])
@pytest.mark.parametrize("window", [2, 8])
def test_deferred_ring_commits_never_deadlock(window, polls):
    """Ring copies that finish after the host moved on (CUDA IPC rings: events, not waits):
    bit-exact and no deadlock, the executor publishing and freeing slots as they finish; with
    a network whose waits can be sliced, ring receives not there yet are left behind by their
    run and taken later."""
    src = L([0, 1, 2, 3], Shard(0))
    dst = L(torch.arange(16).reshape(4, 4).tolist(), Replicate(), Shard(1), names=("dp", "tp"))
    specs, fulls = {}, {}
    g = torch.Generator().manual_seed(window)
    for i, shape in enumerate([(64, 48), (32, 64), (8, 4), (128, 16)]):
        specs[f"w{i}"] = rr.TensorSpec(shape, torch.float32, src, dst)
        fulls[f"w{i}"] = torch.randn(shape, generator=g)
    p = rr.plan(specs, src_domains=["s"] * 4, dst_domains=[f"d{j // 8}" for j in range(16)])
    src_store = [{n: rr.shard_tensor(fulls[n], s.src, r) for n, s in specs.items()}
                 for r in range(4)]
    dst_store = [{n: torch.full(s.dst.local_shape(r, s.shape), -1.0) for n, s in specs.items()
                  if s.dst.box(r, s.shape)} for r in range(16)]
    made = SlowCopy.made
    n_rings, left_behind = run_deferring(p, src_store, dst_store, 2048, window, polls)
    assert n_rings > 0 and SlowCopy.made > made
    assert (left_behind > 0) == polls
    for n, s in specs.items():
        for r in range(16):
            if s.dst.box(r, s.shape):
                assert torch.equal(dst_store[r][n], rr.shard_tensor(fulls[n], s.dst, r)), (n, r)
