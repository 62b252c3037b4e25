"""Cut a rank's shard out of a full tensor, and put full tensors back together (for tests,
examples, and users who start from a full state dict)."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from .layout import Layout


def shard_tensor(full: torch.Tensor, layout: Layout, rank: int) -> Optional[torch.Tensor]:
    """A contiguous copy of the shard `rank` holds, or None when the rank is not in the mesh."""
    box = layout.box(rank, tuple(full.shape))
    if box is None:
        return None
    return full[box.slices()].clone().contiguous()


def assemble(shards: Mapping[int, torch.Tensor], layout: Layout, shape, dtype=None,
             check_replicas: bool = True) -> torch.Tensor:
    """Rebuild the full tensor from rank -> shard; raise when a region is missing or replicas
    disagree."""
    shape = tuple(shape)
    dtype = dtype or next(iter(shards.values())).dtype
    out = torch.empty(shape, dtype=dtype)
    filled = torch.zeros(shape, dtype=torch.bool)
    for r, box in layout.boxes(shape).items():
        if r not in shards:
            continue
        t = shards[r]
        if tuple(t.shape) != box.sizes:
            raise ValueError(f"rank {r}: shard shape {tuple(t.shape)} != expected {box.sizes}")
        region = out[box.slices()]
        seen = filled[box.slices()]
        if check_replicas and seen.any() and not torch.equal(region[seen], t[seen]):
            raise ValueError(f"rank {r}: replica disagrees with another replica in {box}")
        region.copy_(t)
        seen.fill_(True)
    if not bool(filled.all()):
        raise ValueError("assemble: some elements are held by none of the given shards")
    return out
