"""Block-FP8 quantisation on the sender (DeepSeek-style `float8_e4m3fn` weights, one float32
scale per block).

A TensorSpec with `quant=BlockFP8(block=(128, 128))` and `dtype=torch.float8_e4m3fn` asks for
the destination to hold the tensor as FP8 plus a float32 scale tensor of shape
`[..., ceil(N/bn), ceil(K/bk)]` (`scale_shape`), kept next to the weight's storage under the
name `<storage><scale_suffix>` ("weight" -> "weight_scale_inv", "w13_weight" ->
"w13_weight_scale_inv", as vLLM's FP8 linear and MoE methods name them), in the same slot with
the offset counted in blocks (vLLM's `adjust_block_scale_shard`). Each block is quantised as
vLLM quantises one (`per_block_cast_to_fp8` in vllm/utils/deep_gemm.py, vLLM 0.33), bit for bit:

    amax = x.abs().amax().clamp(min=1e-4); scale = amax / 448.0
    q = (x * (1.0 / scale)).to(torch.float8_e4m3fn); scale_inv = scale      (all in float32)

(a multiplication by the float32 reciprocal, not a division: the two round differently in
about 0.03% of elements). A block cut short by the tensor's edge is quantised as if padded
with zeros, which leave its amax unchanged.

Block-aligned sources (the common case). When every source rank's and every destination
rank's shard is a union of whole blocks (a shard may end at the tensor's edge with a short
block), the tensor is planned on its *block grid*: one planning element per block, of
`prod(block) + 4` bytes (the FP8 block, its float32 scale). Every cut the planner and the
bucket packer make is then a whole block, so the one source that sends a block quantises it
(exactly one sender per block and destination domain), and the block crosses the network once
per destination domain as FP8 bytes plus its scale. Plan statistics and the lower bound count
those bytes. An item's wire bytes are its blocks' scales (float32) followed by its FP8 elements
in row-major order; blocks cut short by the tensor's edge leave the rest of their
`prod(block)` bytes unused, so an item's size is its block count times `prod(block) + 4`.

Sources that cut a block (e.g. an uneven or fine Megatron TP split: no single source holds the
whole block). Such a tensor is planned element by element in the source dtype (its bytes cross
the network unquantised, once per destination domain, as any tensor), and each destination
rank quantises its own shard once the last piece of it arrived (`Finisher`: the receiving
parts write into a buffer of the shard in the source dtype, kept across refits, then the shard
is quantised into the FP8 storage and its scales). Destination shards must be whole blocks in
every case, as vLLM requires of its FP8 layers (`validate_fp8_block_shape`).

Local views. A compiled program (program.py) holds, besides `(side, rank, tensor)` shards, the
keys `("dst", rank, tensor, SCALE)` (a destination's scales: the runtime and the simulator look
them up with `scale_view`) and `("dst", rank, tensor, WIDE)` (a `Finisher`'s buffer, made by
the program itself).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import torch

from .box import Box
from .layout import Layout, LayoutUnion
from .placement import Shard

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_MIN = 1e-4
SCALE_BYTES = 4
SCALE = "scale"               # the 4th field of a held key ("dst", rank, tensor, SCALE)


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
        from .spec import Slot
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
    got = spec.__dict__.get("_q_grid")
    if got is None:
        block = spec.quant.full_block(len(spec.shape))
        got = block_layout(spec.src, spec.shape, block) is not None
        object.__setattr__(spec, "_q_grid", got)
    return got


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


# ---------------------------------------------------------------------------- the arithmetic
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


# ---------------------------------------------------------------------------- fallback
WIDE = "wide"                 # 4th field of the held key of a fallback shard's float buffer


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
