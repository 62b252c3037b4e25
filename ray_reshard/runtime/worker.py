"""Code that runs inside user actors (shipped with `actor.__ray_call__`; nobody subclasses).

Each function takes the actor instance first. Per-group state lives in `GROUPS` in the actor's
process: the collective group, shared-memory rings to peers on the node, and installed programs
(this process's part of a plan, shipped once and reused by every later refit of that plan).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

import torch

from .._gc import gc_paused
from ..execution import codecs, host_copy
from ..planning.plan import Plan
from . import strategies
from .local_check import check_tensors, local_tensors
from .process_state import (GROUPS, InstalledProgram, ProcessGroup, Shard, group_state,
                            program_bytes)
from .transport import torch_pg

def probe(actor) -> dict:
    """Where this actor runs: node, process, device."""
    from .node_helper import discover_actor_info
    return discover_actor_info()


def setup(actor, group_id: str, group_name: str, world: int, pid: int, backend: str,
          ep_pid: dict, device: str, tensors_fn, bucket_bytes: int, timeout_s: float,
          version: int = 0, window: Optional[int] = None) -> dict:
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
    GROUPS[group_id] = ProcessGroup(group_id, group_name, pid, eps, dict(ep_pid),
                                     torch.device(device), tensors_fn, bucket_bytes, pg,
                                     version=version, window=window)
    if torch.device(device).type == "cpu":
        # Build (or load the host's cached build of) the host copy kernel now, so a first
        # refit's deadline never pays for a compiler run.
        host_copy.engine().kernel()
    return {"proc": pid, "store": pg.store_address}


def prepare_delta(actor, group_id: str) -> None:
    """Build (or load the host's cached build of) the delta codec for this process's device:
    the driver asks before a membership's first delta refit, so its deadline never pays for a
    compiler run."""
    codecs.codec_for(group_state(group_id).device)


def attach_rings(actor, group_id: str, out: dict, inn: dict, gpu: bool = False) -> None:
    """Map the rings the node helper created: out[peer pid] / inn[peer pid] -> segment name."""
    if gpu:
        from .transport.cuda_ipc import CudaIpcRing as Ring
    else:
        from .transport.shm import ShmRing as Ring
    wg = group_state(group_id)
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


def install(actor, group_id: str, key, plan: Plan, transfers: Optional[list],
            strategy: str) -> dict:
    """Compile and cache this process's program for plan `key` from the plan alone (or from
    `transfers`, this process's share, when given). Returns {peer process: largest bucket this
    process sends it outside the network}, for sizing shared-memory rings."""
    wg = group_state(group_id)
    # The specs, one shard per held tensor and the compiled program are acyclic objects (tens
    # of thousands at scale): one collector pass once they are built, not passes rescanning
    # them while they grow.
    with gc_paused(keep=True):
        plan.localize(wg.endpoints)
        specs, plan_names = plan.specs, plan.names
        held, shards = [], []
        src_names, dst_names, scales = [], [], []  # local tensor names; block FP8 scales
        for ep in sorted(wg.endpoints, key=lambda e: (e.side, e.rank)):
            side, rank = ep.side, ep.rank
            is_src = side == "src"
            on_side = src_names if is_src else dst_names
            layout_boxes: dict = {}
            for ti, spec in enumerate(specs):
                lay = spec.src if is_src else spec.dst
                k = (id(lay), spec.shape)
                box = layout_boxes.get(k, False)
                if box is False:
                    box = layout_boxes[k] = lay.box(rank, spec.shape)
                if box is not None:
                    shard = (side, rank, ti)
                    held.append(shard)
                    name = plan_names[ti]
                    slot = spec.slot(side, rank, name)
                    on_side.append(slot.storage)
                    if is_src:
                        dtype = spec.source_dtype
                    else:
                        dtype = spec.dtype
                        if spec.quant is not None:
                            scales.append(spec.quant.scale_storage(slot.storage))
                    shards.append(Shard(shard, name, spec, slot, box.sizes, dtype))
        names = dst_names + src_names + scales
        dst_names += scales
        strat = strategies.STRATEGIES[strategy]
        prog = InstalledProgram(plan, held, strat, shards=shards,
                        storages=tuple(dict.fromkeys(names)),
                        dst_storages=tuple(dict.fromkeys(dst_names)))
        prog.compiled = strat.install(plan, wg, transfers)
        ring = strat.ring_bytes(prog.compiled)
    wg.programs[key] = prog
    return ring



# Destinations may be parameters that require grad, or inference tensors (engines allocate
# under torch.inference_mode()): both are written in place under inference mode, where every
# view we make and write through is made too.
@torch.inference_mode()
def run(actor, group_id: str, key, timeout_s: float, version: int, atomic: bool = False,
        snapshot: bool = False, vote: Optional[str] = None,
        committed: Optional[int] = None, delta=None) -> dict:
    """Check this process's local tensors, agree with every member, then execute this
    process's program; returns its statistics.

    One call per refit. Every member checks its tensors and votes through the group's store
    (`vote` names the ballot): when any member found a problem, none moves a byte and each
    returns {"refused": its problems}. `committed` is the group's version now (the driver's
    word that the previous refit finished everywhere).

    With `atomic`, destination shards are received into staging copies that only `commit`
    writes back, so a refit that fails anywhere leaves the old weights. With `snapshot`,
    source shards are copied first and sent from the copies. Source shards that share memory
    with this process's destination shards (colocated refits) are copied first in any case
    (unless `atomic` already keeps destinations apart), so no byte is read after it was
    overwritten. With `delta` (a `delta.DeltaRequest`) network buckets travel as deltas
    (see delta.py). Any failure here aborts this process's channels, so peers
    fail at once.
    """
    wg = group_state(group_id)
    _settle_version(wg, committed)
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    wg.staged = None
    wg.undo = None
    captured, wg.captured = wg.captured, None
    try:
        # Cyclic collections would rescan the programs' many objects again and again, for
        # the small acyclic ones checking and running allocate. What stays (a first refit's
        # bound regions) is kept for the program's life.
        with gc_paused(keep=True):
            prog = wg.programs[key]
            if captured is not None and captured[0] != key:
                raise RuntimeError(f"process {wg.pid} captured sources of another refit")
            # Captured sources are sent from their copies: the live ones are not looked at.
            views, errors, aliased, token, fault = check_tensors(actor, wg, prog, captured is None)
            t_checked = time.perf_counter()
            clock = {"check": t_checked - t0}
            if vote is not None:
                refused = wg.pg.vote(vote, not errors and fault is None, deadline)
                clock["vote"] = time.perf_counter() - t_checked
                if refused:
                    return {"refused": errors, "fault": fault, "pid": wg.pid}
            elif fault is not None:
                raise fault["error"]
            elif errors:
                raise ValueError("; ".join(errors))
            extra = aliased_bytes = 0
            if captured is not None:          # an overlapped refit: send what capture() copied
                views.update(captured[1])
                extra = sum(v.numel() * v.element_size() for v in captured[1].values())
                snapshot = True
            copy_first = [] if captured is not None else \
                [k for k in views if k[0] == "src"] if snapshot else \
                ([] if atomic else aliased)
            if captured is not None or copy_first or atomic:
                token = None              # some views are copies made for this refit only
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
                        # a delta applies onto what the destination holds: stage a copy of it
                        views[k] = v.clone() if delta else torch.empty_like(v)
                        extra += v.numel() * v.element_size()
            run_delta = None
            if delta:
                run_delta = _delta_run(wg, prog, delta, version)
            if not atomic:
                wg.held = None            # written in place from here on
            stats = prog.strategy.execute(wg, prog.compiled, views, deadline, token,
                                          run_delta)
    except BaseException as e:
        _abort_channels(wg, f"{type(e).__name__}: {e}")
        raise
    if stats.get("delta", {}).get("mismatches"):
        wg.held = None      # written outside refits: this refit fails, the group stays usable
    elif atomic:
        wg.staged = (version, [(targets[k], views[k]) for k in targets])
    else:
        wg.done = version
    stats["seconds"] = time.perf_counter() - t0
    stats["pid"] = wg.pid
    stats["extra_bytes"] = extra
    stats["aliased_bytes"] = aliased_bytes
    stats.setdefault("clock", {}).update(clock)
    return stats


def _delta_run(wg: ProcessGroup, prog: InstalledProgram, req, version: int):
    from .delta import run_for
    return run_for(prog, req, version, wg.held, wg.device, wg.pid)


def _settle_version(wg: ProcessGroup, committed: Optional[int]) -> None:
    """Take the driver's word on the last refit: finished everywhere (`committed` is its
    version) or not (the data stays, the version does not move). Delta baselines written by
    that refit hold from now on, or not at all."""
    if committed is None:
        return
    if wg.done is not None:
        if wg.done == committed:
            wg.version = wg.held = committed
        wg.done = None
    for prog in wg.programs.values():
        if prog.baselines is not None:
            prog.baselines.settle(committed)


@torch.inference_mode()
def capture(actor, group_id: str, key, committed: Optional[int] = None) -> dict:
    """Copy this process's source shards of program `key` for the run that follows (an
    overlapped refit: the trainer may change its tensors once every process captured).
    Returns {} or, when nothing was copied, {"refused": problems, "fault": a fault or None}.
    `committed`: the group's version, as for `run`."""
    wg = group_state(group_id)
    _settle_version(wg, committed)
    views, errors, _, _, fault = check_tensors(actor, wg, wg.programs[key])
    if errors or fault is not None:
        return {"refused": errors, "fault": fault, "pid": wg.pid}
    copies = {k: v.clone() for k, v in views.items() if k[0] == "src"}
    wg.captured = (key, copies)
    return {}


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
    wg = group_state(group_id)
    if wg.staged is None or wg.staged[0] != version:
        raise RuntimeError(f"process {wg.pid} has no completed refit v{version} to commit")
    pairs = wg.staged[1]
    for target, staged in pairs:
        _swap(target, staged)
    if wg.device.type == "cuda":
        torch.cuda.synchronize(wg.device)
    wg.undo = (wg.version, wg.held, pairs)
    wg.staged = None
    wg.version = wg.held = version
    return version


def release(actor, group_id: str) -> None:
    """Every destination committed: drop what a rollback would have needed."""
    wg = GROUPS.get(group_id)
    if wg is not None:
        wg.undo = None


@torch.inference_mode()
def rollback(actor, group_id: str) -> int:
    """A destination failed during commit: undo this process's commit (old weights and version
    back). Returns the version it holds now."""
    wg = GROUPS.get(group_id)
    if wg is None:
        return -1
    wg.staged = None
    if wg.undo is not None:
        old_version, old_held, pairs = wg.undo
        for target, saved in pairs:
            _swap(target, saved)
        if wg.device.type == "cuda":
            torch.cuda.synchronize(wg.device)
        wg.version, wg.held = old_version, old_held
        wg.undo = None
    return wg.version


def discard(actor, group_id: str, committed: Optional[int] = None) -> None:
    """Drop staged data of a refit that failed elsewhere (the old weights stay). `committed`:
    the group's version, as for `run` (a refit refused before its run leaves the previous
    one's version standing)."""
    wg = GROUPS.get(group_id)
    if wg is not None:
        _settle_version(wg, committed)
        wg.staged = None
        wg.undo = None
        wg.captured = None
        wg.done = None


def uninstall(actor, group_id: str, keys: list, rings: list = ()) -> None:
    """Forget programs evicted from the driver's cache, and close rings only they used
    (`rings`: (peer process, this end sends) pairs)."""
    wg = GROUPS.get(group_id)
    if wg is None:
        return
    for k in keys:
        wg.programs.pop(k, None)
    for peer, sending in rings:
        ring = (wg.rings_out if sending else wg.rings_in).pop(peer, None)
        if ring is not None:
            ring.close()


def _abort_channels(wg: ProcessGroup, reason: str) -> None:
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


def member_groups(actor) -> list:
    """Ids of the groups this process holds state for."""
    return sorted(GROUPS)


def held_resources(actor, group_id: str) -> dict:
    """What this process holds for a group: installed programs (and each one's memory, see
    `program_bytes`) and mapped rings by peer."""
    wg = GROUPS.get(group_id)
    if wg is None:
        return {"member": False, "programs": 0, "rings_out": {}, "rings_in": {},
                "program_bytes": {}}
    return {"member": True, "programs": len(wg.programs),
            "program_bytes": {k: program_bytes(p) for k, p in wg.programs.items()},
            "rings_out": {p: r.name for p, r in wg.rings_out.items()},
            "rings_in": {p: r.name for p, r in wg.rings_in.items()}}


def held_bytes(actor, group_id: str) -> Optional[int]:
    """Bytes of the tensors this process offers the group (each storage once), or None when
    they cannot be read now (the refit's own check then says why)."""
    wg = group_state(group_id)
    try:
        storage = local_tensors(actor, wg)
    except Exception:       # noqa: BLE001  (reported, with its rank, by the refit's check)
        return None
    sizes = {}
    for t in storage.values():
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            sizes[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(sizes.values())


def version(actor, group_id: str, committed: Optional[int] = None) -> int:
    """The version this process holds (`committed`: the group's, as for `run`)."""
    wg = group_state(group_id)
    _settle_version(wg, committed)
    return wg.version


def teardown(actor, group_id: str) -> None:
    """Leave the group: close rings and destroy the collective group (idempotent)."""
    from ray.util.collective import collective as col

    wg = GROUPS.pop(group_id, None)
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
    wg = group_state(group_id)
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


