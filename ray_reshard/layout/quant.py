"""Block FP8 as a destination keeps it (DeepSeek-style `float8_e4m3fn` weights, one float32
scale per block): the format, its block grid and how a quantised tensor is planned. The
arithmetic is `ray_reshard.execution.fp8`; the design is in docs/engines.md (FP8 refits)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import torch

from .box import Box
from .layout import Layout, LayoutUnion
from .placement import Shard
from .slots import Slot

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_MIN = 1e-4
SCALE_BYTES = 4
SCALE = "scale"               # the 4th field of a held key ("dst", rank, tensor, SCALE)
WIDE = "wide"                 # the 4th field of the held key of a fallback shard's float buffer


@dataclass(frozen=True)
class BlockFP8:
    """DeepSeek-style block FP8 on the destination: blocks of `block` over the last two dims."""

    block: tuple[int, int] = (128, 128)
    scale_suffix: str = "_scale_inv"

    def __post_init__(self):
        b = tuple(self.block) if isinstance(self.block, (tuple, list)) else self.block
        if (not isinstance(b, tuple) or len(b) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b)):
            raise ValueError(f"BlockFP8 block must be two positive ints (rows, cols), got "
                             f"{self.block!r}")
        if (b[0] * b[1]) % SCALE_BYTES:
            raise ValueError(f"BlockFP8 block {b}: rows * cols must be a multiple of 4 (each "
                             f"block's float32 scale travels aligned after whole blocks)")
        if not isinstance(self.scale_suffix, str) or not self.scale_suffix:
            raise ValueError(f"BlockFP8 scale_suffix must be a non-empty string, got "
                             f"{self.scale_suffix!r}")
        object.__setattr__(self, "block", b)

    def full_block(self, ndim: int) -> tuple[int, ...]:
        """The block over all `ndim` dims (leading dims: blocks of one)."""
        return (1,) * (ndim - 2) + self.block

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return grid_shape(shape, self.full_block(len(shape)))

    @property
    def wire_itemsize(self) -> int:
        """Bytes of one block on the wire: the FP8 block and its float32 scale."""
        return self.block[0] * self.block[1] + SCALE_BYTES

    def scale_storage(self, storage: str) -> str:
        return storage + self.scale_suffix

    def scale_slot(self, slot, ndim: int):
        """The Slot of a shard's scales, given the Slot of its weights in a tensor of `ndim`
        dims (the offset in whole blocks)."""
        if slot.dim is None:
            return Slot(self.scale_storage(slot.storage), slot.index)
        return Slot(self.scale_storage(slot.storage), slot.index, slot.dim,
                    slot.offset // self.full_block(ndim)[slot.dim])

    def __repr__(self) -> str:
        return f"BlockFP8({self.block[0]}x{self.block[1]})"


def grid_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-n // b) for n, b in zip(shape, block))


def element_box(bbox: Box, block: Sequence[int], shape: Sequence[int]) -> Box:
    """The elements of a box of blocks (clipped to the tensor's edge)."""
    offs = tuple(o * b for o, b in zip(bbox.offsets, block))
    ends = tuple(min((o + s) * b, n) for o, s, b, n in zip(bbox.offsets, bbox.sizes, block, shape))
    return Box(offs, tuple(e - o for o, e in zip(offs, ends)))


def _aligned(box: Box, block, shape) -> bool:
    return all(o % b == 0 and (s == 0 or (o + s) % b == 0 or o + s == n)
               for o, s, b, n in zip(box.offsets, box.sizes, block, shape))


def block_box(box: Box, block, shape) -> Box:
    """The blocks of a block-aligned box."""
    offs = tuple(o // b for o, b in zip(box.offsets, block))
    return Box(offs, tuple(-(-(o + s) // b) - ob if s else 0
                           for o, s, b, ob in zip(box.offsets, box.sizes, block, offs)))


def misaligned(layout: Layout, shape, block) -> Optional[tuple[int, Box]]:
    """(rank, box) of the first rank whose shard is not a union of whole blocks, or None."""
    for r, b in layout.boxes(shape).items():
        if not b.empty and not _aligned(b, block, shape):
            return r, b
    return None


@lru_cache(maxsize=1 << 10)
def block_layout(layout: Layout, shape: tuple, block: tuple) -> Optional[Layout]:
    """`layout` in block units (every rank holds the blocks of its shard), or None when some
    rank's shard is not a union of whole blocks (or block units cannot express the layout)."""
    if type(layout) is LayoutUnion:
        parts = [block_layout(p, shape, block) for p in layout.parts]
        return None if None in parts else LayoutUnion(parts)
    if misaligned(layout, shape, block) is not None:
        return None
    pls = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.block is not None:
            b = block[p.dim]
            if p.block % b:
                return None
            p = Shard(p.dim, block=p.block // b)
        pls.append(p)
    grid = grid_shape(shape, block)
    out = Layout(layout.mesh, tuple(pls))
    # torch.chunk splits of the block counts match the element splits when the element
    # chunks are whole blocks; check every rank rather than trust it.
    for r, b in layout.boxes(shape).items():
        got = out.box(r, grid)
        if b.empty:
            if not got.empty:
                return None
        elif got != block_box(b, block, shape):
            return None
    return out


def on_grid(spec) -> bool:
    """Whether a quantised spec is planned on its block grid (sources hold whole blocks)."""
    return spec.on_block_grid


def sources_hold_whole_blocks(spec) -> bool:
    """`on_grid`, computed (TensorSpec.on_block_grid keeps it)."""
    return block_layout(spec.src, spec.shape, spec.quant.full_block(len(spec.shape))) is not None


def signature(spec) -> tuple:
    """The planning signature of a quantised spec (see TensorSpec.signature)."""
    q = spec.quant
    block = q.full_block(len(spec.shape))
    if on_grid(spec):
        return (grid_shape(spec.shape, block), q.wire_itemsize,
                block_layout(spec.src, spec.shape, block),
                block_layout(spec.dst, spec.shape, block))
    return (spec.shape, wire_itemsize(spec), spec.src, spec.dst)


def wire_itemsize(spec) -> int:
    """Bytes per planning element: a block (on the grid) or a source-dtype element."""
    if on_grid(spec):
        return spec.quant.wire_itemsize
    return torch.empty((), dtype=spec.source_dtype).element_size()


def wire_nbytes(spec) -> int:
    """Bytes of the whole tensor as it travels (one copy)."""
    shape = signature(spec)[0]
    return math.prod(shape) * wire_itemsize(spec)


def check_spec(spec) -> None:
    """Field checks at construction (TensorSpec.__init__)."""
    q = spec.quant
    if not isinstance(q, BlockFP8):
        raise TypeError(f"quant must be a BlockFP8, got {type(q).__name__}")
    if spec.dtype != FP8:
        raise ValueError(f"quant={q!r} needs dtype {FP8} (what the destination holds), got "
                         f"{spec.dtype}")
    if spec.source_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quant={q!r}: sources must hold bfloat16, float16 or float32, got "
                         f"{spec.source_dtype}")
    if len(spec.shape) < 2:
        raise ValueError(f"quant={q!r} needs a tensor of at least 2 dims (blocks over the last "
                         f"two), got shape {spec.shape}")


def validate(spec, name: str) -> None:
    """Raise a ValueError naming `name` and the rank when the destination keeps blocks apart
    or puts a shard where its scales would not start at a whole block."""
    validate_blocks(spec, name)
    validate_slots(spec, name)


def validate_blocks(spec, name: str) -> None:
    """`validate`'s checks of the layouts (they depend on shape, layouts and block only)."""
    q = spec.quant
    block = q.full_block(len(spec.shape))
    bad = misaligned(spec.dst, spec.shape, block)
    if bad is not None:
        r, b = bad
        raise ValueError(
            f"{name!r}: destination rank {r} holds {b} of shape {spec.shape}, which cuts "
            f"{q!r} blocks; FP8 destinations must hold whole blocks (vLLM requires each "
            f"rank's shard to be a multiple of the block size)")
    if on_grid(spec) and block_layout(spec.dst, spec.shape, block) is None:
        raise ValueError(f"{name!r}: the destination layout {spec.dst} cannot be expressed in "
                         f"{q!r} blocks")


def validate_slots(spec, name: str) -> None:
    """`validate`'s check of where each destination rank keeps its shard: at an offset of
    whole blocks (its scales start at a whole block; a shard starting inside a block would
    share that block's scale with whatever else lies in it)."""
    slots = spec.dst_slots
    if not slots:
        return
    block = spec.quant.full_block(len(spec.shape))
    one = slots.uniform
    for r, slot in ((slots.ranks[0], one),) if one is not None else slots:
        if slot.dim is not None and slot.offset % block[slot.dim]:
            raise ValueError(
                f"{name!r}: destination rank {r} keeps it at offset {slot.offset} of dim "
                f"{slot.dim} of {slot.storage!r}, not a multiple of the block size "
                f"{block[slot.dim]}: its scales would not start at a whole block")


# ---------------------------------------------------------------------------- destination views
def scale_view(spec, name: str, rank: int, storage, device_type: Optional[str] = None
               ) -> tuple[Optional[torch.Tensor], str]:
    """(view of destination rank `rank`'s scales of a quantised spec in `storage`, "") or
    (None, the problem). `device_type`: where they must be."""
    q = spec.quant
    box = spec.dst.box(rank, spec.shape)
    block = q.full_block(len(spec.shape))
    sbox = block_box(box, block, spec.shape)
    wslot = spec.slot("dst", rank, name)
    slot = q.scale_slot(wslot, len(spec.shape))
    base = storage.get(slot.storage)
    if base is None:
        return None, f"no local tensor {slot.storage!r} for its {q!r} scales"
    if not isinstance(base, torch.Tensor):
        return None, f"local {slot.storage!r} is a {type(base).__name__}, not a tensor"
    if base.dtype != torch.float32:
        return None, f"local {slot.storage!r} (its scales) has dtype {base.dtype}, expected " \
                     f"torch.float32"
    if device_type is not None and base.device.type != device_type:
        return None, f"local {slot.storage!r} (its scales) is on {base.device}, expected " \
                     f"{device_type}"
    try:
        view = slot.view(base, sbox.sizes)
    except (IndexError, RuntimeError) as e:
        return None, f"cannot place scales {sbox.sizes} in local {slot.storage!r} of shape " \
                     f"{tuple(base.shape)} at {slot}: {e}"
    if tuple(view.shape) != sbox.sizes:
        return None, f"local scales in {slot.storage!r} have shape {tuple(view.shape)}, " \
                     f"expected {sbox.sizes} ({q!r} blocks of its shard {box})"
    return view, ""
