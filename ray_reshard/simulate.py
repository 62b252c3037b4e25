"""Run a plan in one process over per-rank storage dicts: the reference executor.

Tests and tools use it to check plans end to end without Ray; it runs the same schedule and the
same pack/unpack code as the actor runtime.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .core.pack import pack, shard_view, unpack
from .core.plan import DEFAULT_BUCKET_BYTES, Plan


def simulate_refit(plan: Plan, src_storage: Sequence[Mapping[str, torch.Tensor]],
                   dst_storage: Sequence[Mapping[str, torch.Tensor]],
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Execute `plan` writing into `dst_storage` in place; returns counts of bytes per path."""
    storages = {"src": src_storage, "dst": dst_storage}

    def lookup(side: str, rank: int, tensor: int) -> torch.Tensor:
        return shard_view(plan, side, rank, tensor, storages[side][rank])

    moved = {"network": 0, "domain": 0, "local": 0}
    for t in plan.schedule(bucket_bytes).transfers:
        buf = pack(plan, t, lookup)
        unpack(plan, t, buf, lookup)
        moved[t.path] += t.nbytes
    return moved
