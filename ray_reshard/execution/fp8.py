"""Block-FP8 arithmetic at run time: quantising regions of whole blocks bit for bit as vLLM
does (`quantize`, `reference_quantize`), an item's wire bytes (`pack`, `unpack`, `copy`) and the
destination shards quantised once all their pieces arrived (`Finisher`)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..layout.box import Box
from ..layout.quant import (AMAX_MIN, FP8, FP8_MAX, SCALE, SCALE_BYTES, WIDE, block_box,
                            element_box, grid_shape, on_grid)


def reference_quantize(x: torch.Tensor, block: Sequence[int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, one block at a time over the last two dims: (FP8 tensor, float32 scales
    of shape scale_shape). Slow; for tests and benchmarks."""
    x = x.to(torch.float32)
    bn, bk = block
    q = torch.empty(x.shape, dtype=FP8)
    scales = torch.empty(x.shape[:-2] + grid_shape(x.shape[-2:], block), dtype=torch.float32)
    lead = x.reshape(-1, *x.shape[-2:])
    ql = q.view(-1, *x.shape[-2:])
    sl = scales.view(-1, *scales.shape[-2:])
    for t in range(lead.shape[0]):
        for i in range(sl.shape[1]):
            for j in range(sl.shape[2]):
                blk = lead[t, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                amax = blk.abs().amax().clamp(min=AMAX_MIN)
                scale = amax / FP8_MAX
                ql[t, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk * (1.0 / scale)).to(FP8)
                sl[t, i, j] = scale
    return q, scales


# Elements quantised per pass on CPU: a float32 slab of this size stays in cache (large tensors
# quantised in one pass ran 3x slower). Devices quantise a region in one pass.
SLAB = 1 << 20


def quantize(x: torch.Tensor, block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a region of whole blocks (the last ones may be short at the tensor's edge):
    (FP8 tensor of x's shape, float32 scales of shape grid_shape(x.shape, block)). `block`
    covers every dim of x (leading dims: 1). Bit-exact with `reference_quantize`."""
    shape = tuple(x.shape)
    grid = grid_shape(shape, block)
    bn, bk = block[-2:]
    rows, cols = shape[-2:]
    step = max(1, SLAB // max(1, bn * cols)) * bn            # whole block rows per slab
    if x.device.type != "cpu":
        step = max(rows, 1)
    if len(shape) == 2 and rows <= step:
        return _quantize2d(x, bn, bk)
    q = torch.empty(shape, dtype=FP8, device=x.device)
    scales = torch.empty(grid, dtype=torch.float32, device=x.device)
    for lead in itertools.product(*(range(n) for n in shape[:-2])):
        xs, qs, ss = x[lead], q[lead], scales[lead]
        for r in range(0, rows, step):
            a, b = _quantize2d(xs[r:r + step], bn, bk)
            qs[r:r + step] = a
            ss[r // bn:(r + step) // bn] = b
    return q, scales


def _quantize2d(x: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    gr, gc = -(-rows // bn), -(-cols // bk)
    if (gr * bn, gc * bk) == (rows, cols):
        xf = torch.empty(rows, cols, dtype=torch.float32, device=x.device).copy_(x)
    else:                            # zeros leave every block's amax unchanged
        xf = torch.zeros(gr * bn, gc * bk, dtype=torch.float32, device=x.device)
        xf[:rows, :cols] = x
    xb = xf.view(gr, bn, gc, bk)
    # max |x| = max(max x, -min x): no |x| tensor
    amax = torch.maximum(xb.amax(dim=(1, 3), keepdim=True),
                         xb.amin(dim=(1, 3), keepdim=True).neg_())
    scale = amax.clamp_(min=AMAX_MIN).div_(FP8_MAX)
    q = xb.mul_(torch.reciprocal(scale)).to(FP8).view(gr * bn, gc * bk)
    if (gr * bn, gc * bk) != (rows, cols):
        q = q[:rows, :cols]
    return q, scale.view(gr, gc)


# ---------------------------------------------------------------------------- compiled items
@dataclass(frozen=True)
class QuantItem:
    """One item of blocks as one process packs or unpacks it."""

    quantise: bool                # this end holds source-dtype elements and quantises them
    block: tuple                  # the block over every dim of the tensor
    grid: tuple                   # the item's size in blocks
    shape: tuple                  # its size in elements
    scale_held: int               # held index of the scales (-1: none, a quantising sender)
    scale_slices: tuple           # the item's scales inside the shard's scales


class ItemContext:
    """What compiling one process's items of one quantised tensor needs (program.py)."""

    def __init__(self, spec, side: str, rank: int, tensor: int):
        self.spec, self.side, self.rank = spec, side, rank
        self.block = spec.quant.full_block(len(spec.shape))
        self.grid = on_grid(spec)
        self.box = spec.layout(side).box(rank, spec.shape)
        self.quantise = side == "src"
        # the held key of the destination's scales; the caller sets their held index
        self.scale_key = (side, rank, tensor, SCALE) if self.grid and side == "dst" else None
        self.scale_held = -1
        self.wire_dtype = FP8 if self.grid else spec.source_dtype
        self.block_origin = block_box(self.box, self.block, spec.shape).offsets if self.grid \
            else None

        # a destination shard of a tensor whose sources cut blocks: see Finisher
        self.finisher = Finisher(spec, rank, tensor) if not self.grid and side == "dst" \
            else None

    def item(self, box: Box):
        """(the QuantItem, Widen or None, its element box) of an item's box (blocks on the
        grid)."""
        if not self.grid:
            return (None if self.finisher is None else Widen(self.finisher)), box
        ebox = element_box(box, self.block, self.spec.shape)
        slices = tuple(slice(a - o, a - o + n)
                       for a, o, n in zip(box.offsets, self.block_origin, box.sizes))
        return QuantItem(self.quantise, self.block, box.sizes, ebox.sizes, self.scale_held,
                         slices), ebox


def _item_bytes(qi: QuantItem) -> tuple[int, int]:
    return math.prod(qi.grid) * SCALE_BYTES, math.prod(qi.shape)


def pack(qi: QuantItem, region: torch.Tensor, scales: Optional[torch.Tensor],
         buf: torch.Tensor) -> None:
    """Write an item's wire bytes into `buf` (uint8): its scales, then its FP8 elements."""
    sb, n = _item_bytes(qi)
    if qi.quantise:
        region, scales = quantize(region, qi.block)
    buf[:sb].view(torch.float32).view(qi.grid).copy_(scales)
    buf[sb:sb + n].view(FP8).view(qi.shape).copy_(region)


def unpack(qi: QuantItem, region: torch.Tensor, scales: torch.Tensor, buf: torch.Tensor) -> None:
    sb, n = _item_bytes(qi)
    scales.copy_(buf[:sb].view(torch.float32).view(qi.grid))
    region.copy_(buf[sb:sb + n].view(FP8).view(qi.shape))


def copy(src: QuantItem, src_region: torch.Tensor, src_scales: Optional[torch.Tensor],
         region: torch.Tensor, scales: torch.Tensor) -> None:
    """A local copy of an item (the sender's end `src` quantising when it holds the source)."""
    if src.quantise:
        src_region, src_scales = quantize(src_region, src.block)
    region.copy_(src_region)
    scales.copy_(src_scales)



class Finisher:
    """A destination shard of a tensor whose sources cut blocks: its pieces arrive in the source
    dtype into a buffer of the shard (kept across refits); once all its elements arrived this
    refit, the shard is quantised into the FP8 storage and its scales."""

    def __init__(self, spec, rank: int, tensor: int):
        self.block = spec.quant.full_block(len(spec.shape))
        self.dtype = spec.source_dtype
        self.total = spec.dst.box(rank, spec.shape).numel
        self.keys = (("dst", rank, tensor), ("dst", rank, tensor, SCALE),
                     ("dst", rank, tensor, WIDE))
        self.held = [-1, -1, -1]      # held indices of the keys (set by the compiler)
        self.buffer = None
        self.views = None
        self.received = 0

    def bind(self, views: list) -> None:
        """Put the buffer at its held index of `views` (indexed like Program.held); start a
        refit's count."""
        weights = views[self.held[0]]
        buf = self.buffer
        if buf is None or buf.shape != weights.shape or buf.device != weights.device:
            buf = self.buffer = torch.empty(weights.shape, dtype=self.dtype,
                                            device=weights.device)
        views[self.held[2]] = buf
        self.views = (weights, views[self.held[1]])
        self.received = 0

    def add(self, n: int) -> None:
        self.received += n
        if self.received == self.total:
            q, s = quantize(self.buffer, self.block)
            self.views[0].copy_(q)
            self.views[1].copy_(s)


@dataclass(frozen=True)
class Widen:
    """Marks an item received into a fallback shard's buffer (see Finisher)."""

    finisher: Finisher
