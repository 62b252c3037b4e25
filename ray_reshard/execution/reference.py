"""Run a plan in one process over per-rank storage dicts: the reference executor.

Tests and tools use it to check plans end to end without Ray. It runs what the actor runtime
runs: every rank compiles its own program from the plan (`compile_program`), binds it to its
shard views, and buckets travel in the runtime's wire format (`Part.pack` / `Part.unpack`),
handed from sender to receiver in the global key order.
"""
from __future__ import annotations

import heapq
from typing import Mapping, Optional, Sequence

import torch

from .pack import shard_view
from ..planning.plan import DEFAULT_BUCKET_BYTES, Plan
from ..planning.moves import Endpoint
from .program import COPY, SEND, compile_program
from ..layout.quant import WIDE, scale_view


def simulate_refit(plan: Plan, src_storage: Sequence[Mapping[str, torch.Tensor]],
                   dst_storage: Sequence[Mapping[str, torch.Tensor]],
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, engine="auto",
                   processes: Optional[Sequence[Sequence[Endpoint]]] = None) -> dict:
    """Execute `plan` writing into `dst_storage` in place; returns counts of bytes per path.
    `engine`: how parts copy their regions (see `Program.bind`). `processes`: the endpoints
    each process holds (default: every endpoint its own process); a process holding both ends
    of a transfer copies it locally."""
    storages = {"src": src_storage, "dst": dst_storage}
    topo = plan.topology
    if processes is None:
        processes = [[Endpoint("src", r)] for r in range(topo.n_src)] + [
            [Endpoint("dst", r)] for r in range(topo.n_dst)]
    proc_of = {ep: i for i, eps in enumerate(processes) for ep in eps}
    programs = []
    for eps in processes:
        prog = compile_program(plan, eps, bucket_bytes, proc_of)
        views = {k: _view(plan, k, storages[k[0]][k[1]]) for k in prog.held
                 if len(k) == 3 or k[3] != WIDE}
        prog.bind(views, engine=engine)
        programs.append(prog)
    moved = {"network": 0, "domain": 0, "local": 0}
    packed: dict = {}            # key -> bucket bytes sent, not yet received
    waiting: dict = {}           # key -> receiving part whose sender comes later in the merge
    steps = heapq.merge(*[[(s.key, i, s) for i, s in enumerate(p.steps)] for p in programs],
                        key=lambda x: x[0])
    for key, _, s in steps:
        if s.kind == COPY:
            s.recv.copy_from(s.send)
            moved[s.path] += s.nbytes
            continue
        if s.kind == SEND:
            buf = torch.empty(s.nbytes, dtype=torch.uint8, device=s.send.region(0).device)
            s.send.pack(buf, cache=False)
            recv = waiting.pop(key, None)
            if recv is None:
                packed[key] = buf
                continue
        else:
            buf = packed.pop(key, None)
            if buf is None:
                waiting[key] = s.recv
                continue
            recv = s.recv
        recv.unpack(buf, cache=False)
        moved[s.path] += s.nbytes
    if packed or waiting:
        raise RuntimeError(f"programs disagree: {len(packed)} buckets sent and never received, "
                           f"{len(waiting)} expected and never sent")
    return moved


def _view(plan: Plan, key: tuple, storage: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The local view of a held key: a shard, or (4-field keys) a block-FP8 shard's scales."""
    side, rank, tensor = key[:3]
    if len(key) == 3:
        return shard_view(plan, side, rank, tensor, storage)
    view, problem = scale_view(plan.specs[tensor], plan.names[tensor], rank, storage)
    if view is None:
        raise ValueError(f"{plan.names[tensor]!r} on {side} rank {rank}: {problem}")
    return view
