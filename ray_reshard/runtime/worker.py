"""Code that runs inside user actors (shipped with `actor.__ray_call__`; nobody subclasses).

Each function takes the actor instance first. Per-group state lives in `_GROUPS` in the actor's
process: the collective group, shared-memory rings to peers on the node, and installed programs
(this process's part of a plan, shipped once and reused by every later refit of that plan).
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..core.overlap import overlapping_pairs, overlaps_itself
from ..core.pack import copy_direct, pack, region, unpack
from ..core.plan import Plan, Transfer, parent_key
from ..core.planner import NETWORK, Endpoint
from ..errors import GroupStateLost
from .transport import torch_pg

_GROUPS: dict[str, "_WorkerGroup"] = {}


def _group(group_id: str) -> "_WorkerGroup":
    wg = _GROUPS.get(group_id)
    if wg is None:
        raise GroupStateLost(
            f"process {os.getpid()} holds no state for reshard group {group_id[:12]}: the actor "
            f"restarted (Ray max_restarts) or left the group, and lost its collective group and "
            f"programs; call ReshardGroup.update() (same or replacement actors) to rebuild them")
    return wg


@dataclass
class _Program:
    plan: Plan
    transfers: list[Transfer]
    held: list[tuple[str, int, int]]      # (side, rank, tensor) shards this process holds
    strategy: str = "reshard"
    gb_steps: list = field(default_factory=list)


@dataclass
class _WorkerGroup:
    group_id: str
    group_name: str
    pid: int
    endpoints: frozenset
    ep_pid: dict
    device: torch.device
    tensors_fn: Optional[Callable]
    bucket_bytes: int
    pg: Any = None
    rings_out: dict = field(default_factory=dict)
    rings_in: dict = field(default_factory=dict)
    programs: dict = field(default_factory=dict)
    version: int = 0
    staged: Any = None                # (version, [(destination view, staged copy)]) until commit
    # After an atomic commit, until the driver confirms every destination committed: the
    # version before it and the (destination view, its old contents) pairs to roll back to.
    undo: Any = None
    captured: Any = None              # (program key, {source key: copy}) for an overlapped refit


def probe(actor) -> dict:
    """Where this actor runs: node, process, device."""
    from .node_helper import discover_actor_info
    return discover_actor_info()


def setup(actor, group_id: str, group_name: str, world: int, pid: int, backend: str,
          ep_pid: dict, device: str, tensors_fn, bucket_bytes: int, timeout_s: float,
          version: int = 0) -> dict:
    """Join the group's collective group (blocks until all members joined, at most
    `timeout_s`). `version` is the group's current version (kept across update()).
    Returns this process's index and the address of the group's store."""
    from ray.util.collective import collective as col

    torch_pg.ensure_registered()
    # Ray's init_collective_group passes no timeout to a registered backend: hand it over here.
    torch_pg.RENDEZVOUS_TIMEOUT_S = timeout_s
    col.init_collective_group(world, pid, backend=torch_pg.backend_name(backend),
                              group_name=group_name)
    pg = col.get_group_handle(group_name)
    eps = frozenset(ep for ep, p in ep_pid.items() if p == pid)
    _GROUPS[group_id] = _WorkerGroup(group_id, group_name, pid, eps, dict(ep_pid),
                                     torch.device(device), tensors_fn, bucket_bytes, pg,
                                     version=version)
    return {"proc": pid, "store": pg.store_address}


def attach_rings(actor, group_id: str, out: dict, inn: dict, gpu: bool = False) -> None:
    """Map the rings the node helper created: out[peer pid] / inn[peer pid] -> segment name."""
    if gpu:
        from .transport.cuda_ipc import CudaIpcRing as Ring
    else:
        from .transport.shm import ShmRing as Ring
    wg = _group(group_id)
    for rings, names, receiving in ((wg.rings_out, out, False), (wg.rings_in, inn, True)):
        for peer, name in names.items():
            old = rings.get(peer)
            if old is not None and old.name == name:
                continue
            if old is not None:        # replaced by a larger ring
                old.close()
            rings[peer] = Ring.attach(name)
            if gpu and receiving:      # the receiver owns the GPU slots: publish them first
                rings[peer].prepare_recv(wg.device)


def install(actor, group_id: str, key, plan: Plan, transfers: list, strategy: str) -> None:
    """Cache this process's program for plan `key`."""
    wg = _group(group_id)
    held = []
    for ep in sorted(wg.endpoints, key=lambda e: (e.side, e.rank)):
        for ti, spec in enumerate(plan.specs):
            box = spec.layout(ep.side).box(ep.rank, spec.shape)
            if box is not None:
                held.append((ep.side, ep.rank, ti))
    prog = _Program(plan, transfers, held, strategy)
    if strategy == "gather_broadcast":
        from .gather_broadcast import build_steps
        prog.gb_steps = build_steps(plan, wg.ep_pid, wg.pid, wg.bucket_bytes)
        for ranks in sorted({g for s in prog.gb_steps for g in s.groups}):
            if wg.pid in ranks and len(ranks) > 1:
                wg.pg.subgroup(ranks)
    wg.programs[key] = prog


def _storage(actor, wg: _WorkerGroup) -> dict:
    """The actor's local tensors, looked up anew (trainers rebind parameter storage)."""
    if wg.tensors_fn is not None:
        got = wg.tensors_fn(actor)
    elif hasattr(actor, "reshard_tensors"):
        got = actor.reshard_tensors()
    else:
        raise TypeError(f"{type(actor).__name__} has no reshard_tensors() method and the group "
                        f"was built without tensors=")
    if not isinstance(got, dict):
        raise TypeError(f"tensors of {type(actor).__name__} must be a dict name -> tensor, "
                        f"got {type(got).__name__}")
    return got


def _views(actor, wg: _WorkerGroup, prog: _Program) -> tuple[dict, list[str]]:
    """(side, rank, tensor) -> shard view, plus every problem found (nothing is written)."""
    storage = _storage(actor, wg)
    views, errors = {}, []
    plan = prog.plan
    for side, rank, ti in prog.held:
        name, spec = plan.names[ti], plan.specs[ti]
        box = spec.layout(side).box(rank, spec.shape)
        slot = spec.slot(side, rank, name)
        where = f"{name!r} on {side} rank {rank}"
        base = storage.get(slot.storage)
        if base is None:
            errors.append(f"{where}: no local tensor {slot.storage!r}")
            continue
        if not isinstance(base, torch.Tensor):
            errors.append(f"{where}: local {slot.storage!r} is a {type(base).__name__}, not a tensor")
            continue
        want = spec.source_dtype if side == "src" else spec.dtype
        if base.dtype != want:
            errors.append(f"{where}: local {slot.storage!r} has dtype {base.dtype}, expected {want}")
            continue
        if base.device.type != wg.device.type:
            errors.append(f"{where}: local {slot.storage!r} is on {base.device}, expected {wg.device}")
            continue
        try:
            view = slot.view(base, box.sizes)
        except (IndexError, RuntimeError) as e:
            errors.append(f"{where}: cannot place shard {box.sizes} in local {slot.storage!r} of "
                          f"shape {tuple(base.shape)} at {slot}: {e}")
            continue
        if tuple(view.shape) != box.sizes:
            errors.append(f"{where}: local shard has shape {tuple(view.shape)}, expected "
                          f"{box.sizes} (global {spec.shape}, box {box})")
            continue
        if side == "dst" and overlaps_itself(view):
            errors.append(f"{where}: its shard in local {slot.storage!r} (shape "
                          f"{tuple(view.shape)}, strides {tuple(view.stride())}) overlaps itself "
                          f"(elements share memory), so it cannot be written")
            continue
        views[(side, rank, ti)] = view
    dst_keys = [k for k in views if k[0] == "dst"]
    if len(dst_keys) > 1:
        for i, j in overlapping_pairs([views[k] for k in dst_keys]):
            (_, ra, ta), (_, _, tb) = dst_keys[i], dst_keys[j]
            errors.append(f"{plan.names[ta]!r} and {plan.names[tb]!r} on dst rank {ra}: their "
                          f"local shards share memory, so one would overwrite the other")
    return views, errors


def _aliased_sources(views: dict) -> list:
    """Keys of source shards that share memory with a destination shard of this process
    (colocated refits: the same actor on both sides, writing where it reads)."""
    src_keys = [k for k in views if k[0] == "src"]
    dst_keys = [k for k in views if k[0] == "dst"]
    if not src_keys or not dst_keys:
        return []
    pairs = overlapping_pairs([views[k] for k in src_keys], [views[k] for k in dst_keys])
    return sorted({src_keys[i] for i, _ in pairs})


@torch.inference_mode()
def prepare(actor, group_id: str, key) -> list[str]:
    """Check every local tensor this process would read or write; returns problems found."""
    wg = _group(group_id)
    try:
        return _views(actor, wg, wg.programs[key])[1]
    except Exception as e:        # a broken tensors() callable is bad input too
        ranks = ", ".join(f"{ep.side} rank {ep.rank}"
                          for ep in sorted(wg.endpoints, key=lambda ep: (ep.side != "src", ep.rank)))
        return [f"process {wg.pid} ({ranks}): looking up local tensors failed: "
                f"{type(e).__name__}: {e}"]


class _Pool:
    """Staging buffers of one bucket each; counts the peak bytes held."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes, self.device = nbytes, device
        self.free: list[torch.Tensor] = []
        self.lent: dict = {}          # data_ptr of a lent slice -> its whole buffer
        self.live = 0
        self.peak = 0

    def get(self, n: int) -> torch.Tensor:
        buf = self.free.pop() if self.free else torch.empty(self.nbytes, dtype=torch.uint8,
                                                            device=self.device)
        self.live += 1
        self.peak = max(self.peak, self.live)
        # Not `slice._base`: inference mode (where the executor runs) tracks no view bases.
        self.lent[buf.data_ptr()] = buf
        return buf[:n]

    def put(self, buf: torch.Tensor) -> None:
        self.live -= 1
        self.free.append(self.lent.pop(buf.data_ptr()))


# Destinations may be parameters that require grad, or inference tensors (engines allocate
# under torch.inference_mode()): both are written in place under inference mode, where every
# view we make and write through is made too.
@torch.inference_mode()
def run(actor, group_id: str, key, timeout_s: float, version: int,
        atomic: bool = False, snapshot: bool = False) -> dict:
    """Execute this process's program; returns its statistics.

    With `atomic`, destination shards are received into staging copies that only `commit`
    writes back, so a refit that fails anywhere leaves the old weights. With `snapshot`,
    source shards are copied first and sent from the copies. Source shards that share memory
    with this process's destination shards (colocated refits) are copied first in any case
    (unless `atomic` already keeps destinations apart), so no byte is read after it was
    overwritten. Any failure here aborts this process's channels, so peers fail at once.
    """
    wg = _group(group_id)
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    wg.staged = None
    wg.undo = None
    captured, wg.captured = wg.captured, None
    try:
        prog = wg.programs[key]
        views, errors = _views(actor, wg, prog)
        if errors:
            raise ValueError("; ".join(errors))
        extra = aliased_bytes = 0
        if captured is not None:          # an overlapped refit: send what capture() copied
            if captured[0] != key:
                raise RuntimeError(f"process {wg.pid} captured sources of another refit")
            views.update(captured[1])
            extra = sum(v.numel() * v.element_size() for v in captured[1].values())
            snapshot = True
        copy_first = [] if captured is not None else \
            [k for k in views if k[0] == "src"] if snapshot else \
            ([] if atomic else _aliased_sources(views))
        for k in copy_first:
            v = views[k]
            views[k] = v.clone()
            extra += v.numel() * v.element_size()
        if not snapshot:
            aliased_bytes = extra
        targets = {}
        if atomic:
            for k, v in views.items():
                if k[0] == "dst":
                    targets[k] = v
                    views[k] = torch.empty_like(v)
                    extra += v.numel() * v.element_size()
        if prog.strategy == "gather_broadcast":
            from .gather_broadcast import execute
            stats = execute(wg, prog, views, deadline)
        else:
            stats = _execute(wg, prog, views, deadline)
    except BaseException as e:
        _abort_channels(wg, f"{type(e).__name__}: {e}")
        raise
    wg.staged = (version, [(targets[k], views[k]) for k in targets] if atomic else [])
    stats["seconds"] = time.perf_counter() - t0
    stats["pid"] = wg.pid
    stats["extra_bytes"] = extra
    stats["aliased_bytes"] = aliased_bytes
    return stats


@torch.inference_mode()
def capture(actor, group_id: str, key) -> int:
    """Copy this process's source shards of program `key` for the run that follows (an
    overlapped refit: the trainer may change its tensors once every process captured).
    Returns the bytes copied."""
    wg = _group(group_id)
    views, errors = _views(actor, wg, wg.programs[key])
    if errors:
        raise ValueError("; ".join(errors))
    copies = {k: v.clone() for k, v in views.items() if k[0] == "src"}
    wg.captured = (key, copies)
    return sum(v.numel() * v.element_size() for v in copies.values())


# Atomic commits swap staged and live contents in slices of at most this many bytes, so the
# old weights stay available for a rollback without a second full copy.
_SWAP_BYTES = 16 << 20


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two tensors of one shape, in bounded slices."""
    if a.dim() == 0 or a.numel() == 0:
        tmp = a.clone()
        a.copy_(b)
        b.copy_(tmp)
        return
    row = max(1, a[0].numel() * a.element_size())
    step = max(1, _SWAP_BYTES // row)
    for i in range(0, a.shape[0], step):
        x, y = a[i:i + step], b[i:i + step]
        tmp = x.clone()
        x.copy_(y)
        y.copy_(tmp)


@torch.inference_mode()
def commit(actor, group_id: str, version: int) -> int:
    """Second phase: every rank has everything; make `version` this process's.

    Atomic refits swap the staged shards into place and keep the old contents until the driver
    confirms that every destination committed (`release`) or asks for them back (`rollback`).
    """
    wg = _group(group_id)
    if wg.staged is None or wg.staged[0] != version:
        raise RuntimeError(f"process {wg.pid} has no completed refit v{version} to commit")
    pairs = wg.staged[1]
    for target, staged in pairs:
        _swap(target, staged)
    if wg.device.type == "cuda":
        torch.cuda.synchronize(wg.device)
    wg.undo = (wg.version, pairs)
    wg.staged = None
    wg.version = version
    return version


def release(actor, group_id: str) -> None:
    """Every destination committed: drop what a rollback would have needed."""
    wg = _GROUPS.get(group_id)
    if wg is not None:
        wg.undo = None


@torch.inference_mode()
def rollback(actor, group_id: str) -> int:
    """A destination failed during commit: undo this process's commit (old weights and version
    back). Returns the version it holds now."""
    wg = _GROUPS.get(group_id)
    if wg is None:
        return -1
    wg.staged = None
    if wg.undo is not None:
        old_version, pairs = wg.undo
        for target, saved in pairs:
            _swap(target, saved)
        if wg.device.type == "cuda":
            torch.cuda.synchronize(wg.device)
        wg.version = old_version
        wg.undo = None
    return wg.version


def discard(actor, group_id: str) -> None:
    """Drop staged data of a refit that failed elsewhere (the old weights stay)."""
    wg = _GROUPS.get(group_id)
    if wg is not None:
        wg.staged = None
        wg.undo = None
        wg.captured = None


def uninstall(actor, group_id: str, keys: list, rings: list = ()) -> None:
    """Forget programs evicted from the driver's cache, and close rings only they used
    (`rings`: (peer process, this end sends) pairs)."""
    wg = _GROUPS.get(group_id)
    if wg is None:
        return
    for k in keys:
        wg.programs.pop(k, None)
    for peer, sending in rings:
        ring = (wg.rings_out if sending else wg.rings_in).pop(peer, None)
        if ring is not None:
            ring.close()


# Network buckets whose items are all at least this large travel as one message per item:
# each end sends from / receives into its own tensor when that region is contiguous (and, on
# the sender, already of the wire dtype), and stages only the items where it is not.
PER_ITEM_MIN_BYTES = 64 << 10


def per_item(plan: Plan, t: Transfer) -> bool:
    """Wire format of a network bucket, decided from the plan alone so both ends agree:
    True = one message per item, False = one packed message for the whole bucket."""
    return all(it.box.numel * plan.specs[it.tensor].itemsize >= PER_ITEM_MIN_BYTES
               for it in t.items)


def _execute(wg: _WorkerGroup, prog: _Program, views: dict, deadline: float) -> dict:
    plan = prog.plan
    lookup = lambda side, rank, ti: views[(side, rank, ti)]
    pool = _Pool(wg.bucket_bytes, wg.device)
    # Network messages in flight, oldest first: (work, transfer, is_recv, staging buffer or
    # None, what to do once it completed or None).
    pending: deque = deque()
    window = 2                        # double buffering: at most two staging buckets live
    max_in_flight = 8                 # in-place messages need no staging; still bounded
    left: dict = {}                   # transfer key -> messages not yet complete
    done: set = set()                 # keys of network transfers fully received
    moved = {"network": 0, "domain": 0, "local": 0}
    sent = recv = 0
    clock = {"pack": 0.0, "unpack": 0.0, "wait": 0.0}
    now = time.perf_counter

    def complete():
        work, t, is_recv, buf, after = pending.popleft()
        t0 = now()
        peer = wg.ep_pid[t.src] if is_recv else wg.ep_pid[Endpoint("dst", t.dst)]
        torch_pg.wait(work, deadline, f"{'recv from' if is_recv else 'send to'} process {peer}")
        t1 = now()
        clock["wait"] += t1 - t0
        if after is not None:
            after()
            clock["unpack"] += now() - t1
        if buf is not None:
            pool.put(buf)
        left[t.key] -= 1
        if left[t.key] == 0 and is_recv:
            done.add(t.key)

    def post(t, peer, sending: bool, tensor, buf=None, after=None):
        work = wg.pg.isend(tensor, peer) if sending else wg.pg.irecv(tensor, peer)
        pending.append((work, t, not sending, buf, after))

    def staged_count():
        return sum(1 for op in pending if op[3] is not None)

    def network(t, peer, sending: bool):
        if per_item(plan, t):
            left[t.key] = len(t.items)
            side, rank = (t.src.side, t.src.rank) if sending else ("dst", t.dst)
            for it in t.items:
                v = region(plan, side, rank, it, lookup(side, rank, it.tensor))
                wire = plan.specs[it.tensor].dtype
                if v.is_contiguous() and (not sending or v.dtype == wire):
                    while len(pending) >= max_in_flight:
                        complete()
                    post(t, peer, sending, v.reshape(-1).view(torch.uint8))
                    continue
                # Strided region (or a dtype to convert): stage this item in a pool buffer.
                while staged_count() >= window or len(pending) >= max_in_flight:
                    complete()
                n = it.box.numel * plan.specs[it.tensor].itemsize
                buf = pool.get(n)
                staged = buf.view(wire).view(it.box.sizes)
                if sending:
                    t0 = now()
                    staged.copy_(v)
                    clock["pack"] += now() - t0
                    post(t, peer, True, buf, buf)
                else:
                    post(t, peer, False, buf, buf, after=lambda v=v, staged=staged: v.copy_(staged))
            return
        left[t.key] = 1
        while staged_count() >= window or len(pending) >= max_in_flight:
            complete()
        buf = pool.get(t.nbytes)
        if sending:
            t0 = now()
            pack(plan, t, lookup, out=buf)
            clock["pack"] += now() - t0
            post(t, peer, True, buf, buf)
        else:
            post(t, peer, False, buf, buf, after=lambda: unpack(plan, t, buf, lookup))

    for t in prog.transfers:
        dst_ep = Endpoint("dst", t.dst)
        here_send, here_recv = t.src in wg.endpoints, dst_ep in wg.endpoints
        if here_send and t.src.side == "dst":
            # A forwarded piece must have arrived: complete in-flight messages up to the
            # network bucket that delivered it (forwards sort after it).
            parent = parent_key(t)
            while parent not in done and pending:
                complete()
        if here_send and here_recv:
            copy_direct(plan, t, lookup)
            moved["local"] += t.nbytes
            continue
        peer = wg.ep_pid[dst_ep] if here_send else wg.ep_pid[t.src]
        ring = (wg.rings_out if here_send else wg.rings_in).get(peer)
        if t.path != NETWORK and ring is not None:
            t0 = now()
            if here_send:
                slot = ring.send_slot(t.nbytes, deadline)
                t1 = now()
                pack(plan, t, lookup, out=slot)
                ring.commit_send()
                clock["pack"] += now() - t1
            else:
                slot = ring.recv_slot(deadline)
                t1 = now()
                unpack(plan, t, slot, lookup)
                ring.release_recv()
                clock["unpack"] += now() - t1
                moved[t.path] += t.nbytes
            clock["wait"] += t1 - t0
            continue
        network(t, peer, here_send)
        if here_send:
            sent += t.nbytes
        else:
            recv += t.nbytes
            moved[t.path] += t.nbytes
    while pending:
        complete()
    if wg.device.type == "cuda":
        torch.cuda.synchronize(wg.device)
    return {"bytes_by_path": moved, "sent_bytes": sent, "recv_bytes": recv,
            "peak_staging_bytes": pool.peak * wg.bucket_bytes, "transfers": len(prog.transfers),
            "clock": clock}


def _abort_channels(wg: _WorkerGroup, reason: str) -> None:
    """Fail fast everywhere: peers blocked on this process get an error, not a hang."""
    for ring in [*wg.rings_out.values(), *wg.rings_in.values()]:
        try:
            ring.abort(reason[:200])
        except Exception:
            pass
    try:
        wg.pg.abort(f"process {wg.pid}: {reason}"[:500])
    except Exception:
        pass


def held_resources(actor, group_id: str) -> dict:
    """What this process holds for a group: installed programs and mapped rings by peer."""
    wg = _GROUPS.get(group_id)
    if wg is None:
        return {"member": False, "programs": 0, "rings_out": {}, "rings_in": {}}
    return {"member": True, "programs": len(wg.programs),
            "rings_out": {p: r.name for p, r in wg.rings_out.items()},
            "rings_in": {p: r.name for p, r in wg.rings_in.items()}}


def version(actor, group_id: str) -> int:
    return _group(group_id).version


def teardown(actor, group_id: str) -> None:
    """Leave the group: close rings and destroy the collective group (idempotent)."""
    from ray.util.collective import collective as col

    wg = _GROUPS.pop(group_id, None)
    if wg is None:
        return
    for ring in [*wg.rings_out.values(), *wg.rings_in.values()]:
        try:
            ring.close()
        except Exception:
            pass
    try:
        col.destroy_collective_group(wg.group_name)
    except Exception:
        pass


def raw_transfer(actor, group_id: str, sends: dict, recvs: dict, nbytes: int,
                 timeout_s: float) -> float:
    """Send `nbytes` to each peer in `sends` and receive as much from each in `recvs` over the
    network transport, in bucket-sized messages with the executor's window; returns seconds.
    A baseline for the refit's achieved bandwidth (no packing, no planning)."""
    wg = _group(group_id)
    deadline = time.monotonic() + timeout_s
    buf = torch.zeros(min(nbytes, wg.bucket_bytes), dtype=torch.uint8, device=wg.device)
    rbufs = [torch.empty_like(buf) for _ in range(2)]
    ops = raw_ops(wg.pid, sends, recvs, nbytes, buf.numel())
    t0 = time.perf_counter()
    pending: deque = deque()
    for i, (kind, peer, n) in enumerate(ops):
        while len(pending) >= 2:
            torch_pg.wait(pending.popleft(), deadline, "raw transfer")
        work = wg.pg.isend(buf[:n], peer) if kind == "s" else wg.pg.irecv(rbufs[i % 2][:n], peer)
        pending.append(work)
    while pending:
        torch_pg.wait(pending.popleft(), deadline, "raw transfer")
    if wg.device.type == "cuda":
        torch.cuda.synchronize(wg.device)
    return time.perf_counter() - t0


def raw_ops(proc: int, sends, recvs, nbytes: int, chunk: int) -> list:
    """raw_transfer's messages in posting order: ("s" or "r", peer, bytes). Per peer, the lower
    process sends first and the higher receives first, so both ends post matching operations in
    the same order (lock-step transports such as NCCL run a pair's operations in that order)."""
    ops = [("s", peer, min(chunk, nbytes - off)) for peer in sends
           for off in range(0, nbytes, chunk)]
    ops += [("r", peer, min(chunk, nbytes - off)) for peer in recvs
            for off in range(0, nbytes, chunk)]
    ops.sort(key=lambda o: (o[1], (o[0] == "s") != (proc < o[1])))
    return ops
