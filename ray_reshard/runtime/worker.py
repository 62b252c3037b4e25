"""Code that runs inside user actors (shipped with `actor.__ray_call__`; nobody subclasses).

Each function takes the actor instance first. Per-group state lives in `_GROUPS` in the actor's
process: the collective group, shared-memory rings to peers on the node, and installed programs
(this process's part of a plan, shipped once and reused by every later refit of that plan).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..core.plan import Plan
from . import executor
from .transport import torch_pg

_GROUPS: dict[str, "_WorkerGroup"] = {}


@dataclass
class _Program:
    plan: Plan
    held: list[tuple[str, int, int]]      # (side, rank, tensor) shards this process holds
    strategy: str = "reshard"
    gb_steps: list = field(default_factory=list)
    compiled: Any = None                  # reshard: this process's compiled Program


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


def probe(actor) -> dict:
    """Where this actor runs: node, process, device."""
    from .node_helper import discover_actor_info
    return discover_actor_info()


def setup(actor, group_id: str, group_name: str, world: int, pid: int, backend: str,
          ep_pid: dict, device: str, tensors_fn, bucket_bytes: int, timeout_s: float,
          version: int = 0) -> int:
    """Join the group's collective group (blocks until all members joined, at most
    `timeout_s`). `version` is the group's current version (kept across update())."""
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
    return pid


def attach_rings(actor, group_id: str, out: dict, inn: dict, gpu: bool = False) -> None:
    """Map the rings the node helper created: out[peer pid] / inn[peer pid] -> segment name."""
    if gpu:
        from .transport.cuda_ipc import CudaIpcRing as Ring
    else:
        from .transport.shm import ShmRing as Ring
    wg = _GROUPS[group_id]
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


def install(actor, group_id: str, key: str, plan: Plan, transfers: Optional[list],
            strategy: str) -> dict:
    """Compile and cache this process's program for plan `key` from the plan alone (or from
    `transfers`, this process's share, when given). Returns {peer process: largest bucket this
    process sends it outside the network}, for sizing shared-memory rings."""
    wg = _GROUPS[group_id]
    plan.localize(wg.endpoints)
    held = []
    for ep in sorted(wg.endpoints, key=lambda e: (e.side, e.rank)):
        layout_boxes: dict = {}
        for ti, spec in enumerate(plan.specs):
            lay = spec.layout(ep.side)
            k = (id(lay), spec.shape)
            box = layout_boxes.get(k, False)
            if box is False:
                box = layout_boxes[k] = lay.box(ep.rank, spec.shape)
            if box is not None:
                held.append((ep.side, ep.rank, ti))
    prog = _Program(plan, held, strategy)
    strat = executor.STRATEGIES[strategy]
    if strategy == "gather_broadcast":
        prog.gb_steps = strat.install(plan, wg.endpoints, wg.bucket_bytes, wg.ep_pid, wg.pg)
        ring = {}
    else:
        prog.compiled = strat.install(plan, wg.endpoints, wg.bucket_bytes, wg.ep_pid,
                                      transfers=transfers, device_type=wg.device.type)
        ring = dict(prog.compiled.max_ring_bytes)
    wg.programs[key] = prog
    return ring


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
        if side == "dst" and any(n > 1 and st == 0 for n, st in zip(view.shape, view.stride())):
            errors.append(f"{where}: local {slot.storage!r} has overlapping memory (stride 0: an "
                          f"expanded view), so its shard cannot be written")
            continue
        views[(side, rank, ti)] = view
    return views, errors


def prepare(actor, group_id: str, key: str) -> list[str]:
    """Check every local tensor this process would read or write; returns problems found."""
    wg = _GROUPS[group_id]
    try:
        return _views(actor, wg, wg.programs[key])[1]
    except Exception as e:        # a broken tensors() callable is bad input too
        ranks = ", ".join(f"{ep.side} rank {ep.rank}"
                          for ep in sorted(wg.endpoints, key=lambda ep: (ep.side != "src", ep.rank)))
        return [f"process {wg.pid} ({ranks}): looking up local tensors failed: "
                f"{type(e).__name__}: {e}"]


@torch.no_grad()        # destinations may be parameters that require grad (written in place)
def run(actor, group_id: str, key: str, timeout_s: float, version: int,
        atomic: bool = False, snapshot: bool = False) -> dict:
    """Execute this process's program; returns its statistics.

    With `atomic`, destination shards are received into staging copies that only `commit`
    writes back, so a refit that fails anywhere leaves the old weights. With `snapshot`,
    source shards are copied first and sent from the copies.
    """
    wg = _GROUPS[group_id]
    prog = wg.programs[key]
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    wg.staged = None
    views, errors = _views(actor, wg, prog)
    if errors:
        raise ValueError("; ".join(errors))
    extra = 0
    if snapshot:
        for k, v in views.items():
            if k[0] == "src":
                views[k] = v.clone()
                extra += v.numel() * v.element_size()
    targets = {}
    if atomic:
        for k, v in views.items():
            if k[0] == "dst":
                targets[k] = v
                views[k] = torch.empty_like(v)
                extra += v.numel() * v.element_size()
    try:
        if prog.strategy == "gather_broadcast":
            from .gather_broadcast import execute
            stats = execute(wg, prog, views, deadline)
        else:
            stats = _execute(wg, prog, views, deadline)
    except BaseException as e:
        _abort_channels(wg, str(e))
        raise
    if atomic:
        wg.staged = (version, [(targets[k], views[k]) for k in targets])
    else:
        wg.staged = (version, [])
    stats["seconds"] = time.perf_counter() - t0
    stats["pid"] = wg.pid
    stats["extra_bytes"] = extra
    return stats


@torch.no_grad()
def commit(actor, group_id: str, version: int) -> int:
    """Second phase: every rank has everything; write staged shards back and take `version`."""
    wg = _GROUPS[group_id]
    if wg.staged is None or wg.staged[0] != version:
        raise RuntimeError(f"process {wg.pid} has no completed refit v{version} to commit")
    for target, staged in wg.staged[1]:
        target.copy_(staged)
    if wg.device.type == "cuda":
        torch.cuda.synchronize(wg.device)
    wg.staged = None
    wg.version = version
    return version


def discard(actor, group_id: str) -> None:
    """Drop staged data of a refit that failed elsewhere (the old weights stay)."""
    wg = _GROUPS.get(group_id)
    if wg is not None:
        wg.staged = None


def _execute(wg: _WorkerGroup, prog: _Program, views: dict, deadline: float) -> dict:
    """Run this process's program (its strategy's execute) with the validated shard views
    `views[(side, rank, tensor)]`; returns its statistics."""
    return executor.STRATEGIES[prog.strategy].execute(wg, prog, views, deadline)


def _abort_channels(wg: _WorkerGroup, reason: str) -> None:
    """Fail fast everywhere: peers blocked on this process get an error, not a hang."""
    for ring in [*wg.rings_out.values(), *wg.rings_in.values()]:
        try:
            ring.abort(reason[:200])
        except Exception:
            pass
    try:
        wg.pg.abort()
    except Exception:
        pass


def version(actor, group_id: str) -> int:
    return _GROUPS[group_id].version


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
    wg = _GROUPS[group_id]
    deadline = time.monotonic() + timeout_s
    buf = torch.zeros(min(nbytes, wg.bucket_bytes), dtype=torch.uint8, device=wg.device)
    rbufs = [torch.empty_like(buf) for _ in range(2)]
    ops = []
    for peer in sends:
        for off in range(0, nbytes, buf.numel()):
            ops.append(("s", peer, min(buf.numel(), nbytes - off)))
    for peer in recvs:
        for off in range(0, nbytes, buf.numel()):
            ops.append(("r", peer, min(buf.numel(), nbytes - off)))
    ops.sort(key=lambda o: (o[1], o[0]))
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
