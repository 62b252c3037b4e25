"""The baseline: all-gather each tensor on the sources, broadcast it whole, keep the slice.

The usual refit of RL frameworks, implemented honestly so benchmarks compare against a fair
version: tensors are bucketed (up to bucket_bytes of whole tensors per collective), all-gather
runs among one replica of each source shard, and broadcast runs from one source to every
destination rank that holds any of the tensor. Every destination materialises whole tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planning.plan import Plan
from ..planning.planner import Endpoint
from .transport import torch_pg


@dataclass(frozen=True)
class Step:
    tensors: tuple[int, ...]
    gather: tuple[int, ...]       # process ranks all-gathering (root first)
    bcast: tuple[int, ...]        # root then destination process ranks
    nbytes: int

    @property
    def groups(self):
        return (self.gather, self.bcast)


def _aligned(n: int) -> int:
    """Byte offsets inside a bucket stay 16-aligned so every dtype can be viewed in place."""
    return (n + 15) // 16 * 16


def _groups(plan: Plan, ti: int, ep_pid: dict) -> tuple[tuple, tuple]:
    spec = plan.specs[ti]
    first_of_box = {}
    for r, b in sorted(spec.src.boxes(spec.shape).items()):
        if not b.empty:
            first_of_box.setdefault(b, ep_pid[Endpoint("src", r)])
    gather = tuple(dict.fromkeys(first_of_box.values()))
    dsts = [ep_pid[Endpoint("dst", r)] for r, b in sorted(spec.dst.boxes(spec.shape).items())
            if not b.empty]
    bcast = (gather[0],) + tuple(sorted(set(dsts) - {gather[0]}))
    return gather, bcast


def build_steps(plan: Plan, ep_pid: dict, pid: int, bucket_bytes: int) -> list[Step]:
    """Steps in one order shared by every process (each runs the steps it belongs to)."""
    steps, cur, cur_key, cur_bytes = [], [], None, 0
    for ti, spec in enumerate(plan.specs):
        if spec.quant is not None:
            raise ValueError(f"{plan.names[ti]!r}: block-FP8 destinations (quant=) need the "
                             f"reshard strategy; gather_broadcast moves whole unquantised tensors")
        if spec.numel == 0:           # nothing to gather or send
            continue
        key = _groups(plan, ti, ep_pid)
        if cur and (key != cur_key or cur_bytes + _aligned(spec.nbytes) > bucket_bytes):
            steps.append(Step(tuple(cur), cur_key[0], cur_key[1], cur_bytes))
            cur, cur_bytes = [], 0
        cur.append(ti)
        cur_key = key
        cur_bytes += _aligned(spec.nbytes)
    if cur:
        steps.append(Step(tuple(cur), cur_key[0], cur_key[1], cur_bytes))
    return steps


def execute(wg, prog, views: dict, deadline: float) -> dict:
    plan: Plan = prog.plan
    my_eps = wg.endpoints
    peak = 0
    moved = 0
    for step in prog.gb_steps:
        in_gather, in_bcast = wg.pid in step.gather, wg.pid in step.bcast
        if not (in_gather or in_bcast):
            continue
        full = None
        if in_gather:
            full = _all_gather(wg, plan, step, views, deadline)
            peak = max(peak, 2 * step.nbytes)
        if in_bcast:
            root = wg.pid == step.bcast[0]
            if not root:
                full = torch.empty(step.nbytes, dtype=torch.uint8, device=wg.device)
            _broadcast(wg, step, full, deadline)
            moved += 0 if root else step.nbytes
            peak = max(peak, step.nbytes)
            off = 0
            for ti in step.tensors:
                spec = plan.specs[ti]
                whole = full[off:off + spec.nbytes].view(spec.dtype).view(spec.shape)
                for ep in my_eps:
                    if ep.side == "dst" and ("dst", ep.rank, ti) in views:
                        box = spec.dst.box(ep.rank, spec.shape)
                        views[("dst", ep.rank, ti)].copy_(whole[box.slices()])
                off += _aligned(spec.nbytes)
    if wg.device.type == "cuda":
        torch.cuda.synchronize(wg.device)
    return {"bytes_by_path": {"network": moved, "domain": 0, "local": 0}, "recv_bytes": moved,
            "sent_bytes": 0, "peak_staging_bytes": peak, "transfers": len(prog.gb_steps)}


def _all_gather(wg, plan: Plan, step: Step, views: dict, deadline: float) -> torch.Tensor:
    """Every gather member ends with the step's whole tensors (destination dtype), flat."""
    me = step.gather.index(wg.pid)
    # An actor appears at most once per side: its process rank names its source rank.
    src_rank = {p: ep.rank for ep, p in wg.ep_pid.items() if ep.side == "src"}
    chunks = []          # per tensor: (max shard bytes, boxes by member)
    for ti in step.tensors:
        spec = plan.specs[ti]
        boxes = [(src_rank[p], spec.src.box(src_rank[p], spec.shape)) for p in step.gather]
        chunks.append((_aligned(max(b.numel for _, b in boxes) * spec.itemsize), boxes))
    width = sum(c[0] for c in chunks)
    mine = torch.zeros(width, dtype=torch.uint8, device=wg.device)
    off = 0
    for ti, (w, boxes) in zip(step.tensors, chunks):
        spec = plan.specs[ti]
        r, box = boxes[me]
        n = box.numel * spec.itemsize
        mine[off:off + n].view(spec.dtype).view(box.sizes).copy_(views[("src", r, ti)])
        off += w
    if len(step.gather) > 1:
        outs = [torch.empty_like(mine) for _ in step.gather]
        work = wg.pg.subgroup(step.gather).allgather([outs], [mine])
        torch_pg.wait(work, deadline, "all-gather")
    else:
        outs = [mine]
    full = torch.empty(step.nbytes, dtype=torch.uint8, device=wg.device)
    off = goff = 0
    for ti, (w, boxes) in zip(step.tensors, chunks):
        spec = plan.specs[ti]
        whole = full[off:off + spec.nbytes].view(spec.dtype).view(spec.shape)
        for m, (r, box) in enumerate(boxes):
            n = box.numel * spec.itemsize
            whole[box.slices()].copy_(outs[m][goff:goff + n].view(spec.dtype).view(box.sizes))
        off += _aligned(spec.nbytes)
        goff += w
    return full


def _broadcast(wg, step: Step, full: torch.Tensor, deadline: float) -> None:
    if len(step.bcast) == 1:
        return
    pg = wg.pg.subgroup(step.bcast)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for start in range(0, step.nbytes, wg.bucket_bytes):
        part = full[start:start + wg.bucket_bytes]
        torch_pg.wait(pg.broadcast([part], opts), deadline, "broadcast")
