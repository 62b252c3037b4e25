"""The baseline: all-gather each tensor on the sources, broadcast it whole, keep the slice.

The usual refit of RL frameworks, implemented honestly so benchmarks compare against a fair
version: tensors are bucketed (up to bucket_bytes of whole tensors per collective), all-gather
runs among one replica of each source shard, and broadcast runs from one source to every
destination rank that holds any of the tensor. Every destination materialises whole tensors.

Bytes are reported as the collectives move them: each process counts what it receives, from
the peer that sends it, as network bytes where that peer is in another domain and as domain
bytes where it is in the same one. gloo's all-gather is a ring in group order (each member
receives the others' padded chunks from its left neighbour) and its broadcast a binomial tree
rooted at the source (a receiver may relay to a peer of its own domain); NCCL's collectives are
counted as rings that visit each domain's ranks together.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planning.plan import Plan
from ..planning.moves import Endpoint
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


def binomial_parent(vrank: int, size: int) -> int:
    """The member that sends to `vrank` in gloo's binomial-tree broadcast of `size` members
    rooted at 0 (gloo/broadcast.cc): the rank with `vrank`'s highest set bit cleared."""
    if not 0 < vrank < size:
        raise ValueError(f"vrank must be in 1..{size - 1}, got {vrank}")
    return vrank ^ (1 << (vrank.bit_length() - 1))


def broadcast_parent(members: tuple, me: int, domain_of: dict, ring: bool) -> int:
    """Which member sends the broadcast's bytes to member `me` (`members[0]` the root):
    gloo's binomial tree, or (`ring`, NCCL) a chain that visits each domain's members together,
    the root's domain first."""
    if not ring:
        return members[binomial_parent(members.index(me), len(members))]
    doms = list(dict.fromkeys(domain_of[p] for p in members))
    order = [members[0]] + [p for d in doms for p in members[1:] if domain_of[p] == d]
    return order[order.index(me) - 1]


def gather_sender(members: tuple, me: int, domain_of: dict, ring: bool) -> int:
    """Which member sends member `me` the all-gather's chunks: its left neighbour in the ring
    (gloo: group order; NCCL: each domain's members together)."""
    order = members
    if ring:
        doms = list(dict.fromkeys(domain_of[p] for p in members))
        order = tuple(p for d in doms for p in members if domain_of[p] == d)
    return order[order.index(me) - 1]


def process_domains(plan: Plan, ep_pid: dict) -> dict:
    """Process index -> its domain (the plan's domain of any endpoint it holds)."""
    doms = {}
    for ep, p in ep_pid.items():
        table = plan.topology.src_domains if ep.side == "src" else plan.topology.dst_domains
        doms.setdefault(p, table[ep.rank])
    return doms


def execute(wg, prog, views: dict, deadline: float) -> dict:
    plan: Plan = prog.plan
    my_eps = wg.endpoints
    peak = 0
    moved = {"network": 0, "domain": 0, "local": 0}
    domain_of = process_domains(plan, wg.ep_pid)
    ring = getattr(wg.pg, "pg_backend", "gloo") == "nccl"

    def path_from(sender: int) -> str:
        return "domain" if domain_of[sender] == domain_of[wg.pid] else "network"

    for step in prog.gb_steps:
        in_gather, in_bcast = wg.pid in step.gather, wg.pid in step.bcast
        if not (in_gather or in_bcast):
            continue
        full = None
        if in_gather:
            full, width = _all_gather(wg, plan, step, views, deadline)
            if len(step.gather) > 1:
                moved[path_from(gather_sender(step.gather, wg.pid, domain_of, ring))] += \
                    (len(step.gather) - 1) * width
            peak = max(peak, 2 * step.nbytes)
        if in_bcast:
            root = wg.pid == step.bcast[0]
            if not root:
                full = torch.empty(step.nbytes, dtype=torch.uint8, device=wg.device)
            _broadcast(wg, step, full, deadline)
            if not root:
                moved[path_from(broadcast_parent(step.bcast, wg.pid, domain_of, ring))] += \
                    step.nbytes
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
    return {"bytes_by_path": moved, "recv_bytes": moved["network"] + moved["domain"],
            "sent_bytes": 0, "peak_staging_bytes": peak, "transfers": len(prog.gb_steps)}


def _all_gather(wg, plan: Plan, step: Step, views: dict, deadline: float
                ) -> tuple[torch.Tensor, int]:
    """Every gather member ends with the step's whole tensors (destination dtype), flat; also
    returns the bytes of each member's (padded) chunk."""
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
    return full, width


def _broadcast(wg, step: Step, full: torch.Tensor, deadline: float) -> None:
    if len(step.bcast) == 1:
        return
    pg = wg.pg.subgroup(step.bcast)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for start in range(0, step.nbytes, wg.bucket_bytes):
        part = full[start:start + wg.bucket_bytes]
        torch_pg.wait(pg.broadcast([part], opts), deadline, "broadcast")
