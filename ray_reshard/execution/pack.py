"""Where a rank's shard of a tensor lives in its local storage tensors.

Packing and unpacking bucket items is compiled per process: see `program.py`.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..planning.plan import Plan


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
