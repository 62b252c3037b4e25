"""Packing and unpacking bucket items between local storage tensors and flat byte buffers.

Shared by the in-process simulator and the actor runtime, so both move bytes the same way.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from .plan import Item, Plan, Transfer

# (side, rank, tensor index) -> the rank's view of its shard of that tensor
ShardLookup = Callable[[str, int, int], torch.Tensor]


def shard_view(plan: Plan, side: str, rank: int, tensor: int,
               storage: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The view of `rank`'s shard of tensor `tensor` inside its local storage tensors."""
    name = plan.names[tensor]
    spec = plan.specs[tensor]
    box = spec.layout(side).box(rank, spec.shape)
    slot = spec.slot(side, rank, name)
    try:
        base = storage[slot.storage]
    except KeyError:
        raise KeyError(f"{side} rank {rank} has no local tensor {slot.storage!r} "
                       f"(needed for {name!r})") from None
    return slot.view(base, box.sizes)


def region(plan: Plan, side: str, rank: int, item: Item, shard: torch.Tensor) -> torch.Tensor:
    """The part of `shard` (rank's shard of item.tensor) that `item.box` covers."""
    spec = plan.specs[item.tensor]
    origin = spec.layout(side).box(rank, spec.shape)
    return shard[item.box.relative_to(origin).slices()]


def item_nbytes(plan: Plan, item: Item) -> int:
    return item.box.numel * plan.specs[item.tensor].itemsize


def pack(plan: Plan, transfer: Transfer, lookup: ShardLookup,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Copy the transfer's items from the sender's shards into one flat uint8 buffer."""
    ep = transfer.src
    if out is None:
        out = torch.empty(transfer.nbytes, dtype=torch.uint8)
    off = 0
    for it in transfer.items:
        spec = plan.specs[it.tensor]
        n = item_nbytes(plan, it)
        src = region(plan, ep.side, ep.rank, it, lookup(ep.side, ep.rank, it.tensor))
        dst = out[off:off + n].view(spec.dtype).view(it.box.sizes)
        dst.copy_(src)      # converts source dtype to destination dtype on the sender
        off += n
    return out


def unpack(plan: Plan, transfer: Transfer, buf: torch.Tensor, lookup: ShardLookup) -> None:
    """Copy a received flat buffer into the receiver's shards."""
    off = 0
    for it in transfer.items:
        spec = plan.specs[it.tensor]
        n = item_nbytes(plan, it)
        dst = region(plan, "dst", transfer.dst, it, lookup("dst", transfer.dst, it.tensor))
        dst.copy_(buf[off:off + n].view(spec.dtype).view(it.box.sizes))
        off += n


def copy_direct(plan: Plan, transfer: Transfer, lookup: ShardLookup) -> None:
    """Move a transfer's items without a staging buffer (sender and receiver in one process)."""
    ep = transfer.src
    for it in transfer.items:
        src = region(plan, ep.side, ep.rank, it, lookup(ep.side, ep.rank, it.tensor))
        dst = region(plan, "dst", transfer.dst, it, lookup("dst", transfer.dst, it.tensor))
        dst.copy_(src)
