"""Copy tables: all the regions of a packed bucket, copied in one launch.

A packed bucket is its items back to back (see `program`'s wire format); packing copies each
item's region (a strided view of a local shard) into the bucket, unpacking copies back. On a
GPU a `copy_` per region is a kernel launch per region, thousands per bucket at real-model
scale, and the host's time launching them exceeds the transfer. A copy table describes every
region of a part at once, so one launch (`cuda_copy`) copies them all whatever their count.

Rows. A region is cut into rows of contiguous bytes: its dims are coalesced (a dim whose
stride spans the dims inside it merges with them); the innermost dense dims make one row, and
at most three outer dims repeat it (a region with more, or an empty one, is left out of the
table; the caller copies it, and any region whose dtype differs from the wire's: a
conversion, not a copy). The region's rows land back to back
in the bucket from its wire offset, row-major, as the wire format says.

Units. Rows are copied in units of `vec` bytes: the largest of 16, 8, 4, 2, 1 dividing the
region's address, its wire offset, its row length and its outer strides (a bucket's base is
16-aligned, which `copy` checks).

Table, int64:
* `regions`, one row per region: address, wire offset, units per row, outer sizes (3, the
  outermost first, padded with 1), outer strides in bytes (3), vec;
* `chunks`, one row per launch block: region, first row, number of rows, first unit in the
  row, units per row taken (a wide row is cut into several chunks, narrow rows share one), so
  every chunk moves about `CHUNK_BYTES`.

`HostCopy` runs a table with `ctypes.memmove` per row piece: the reference the tests check the
kernel's indexing against, on CPU tensors.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

CHUNK_BYTES = 32 << 10
WIRE_ALIGN = 16
MAX_OUTER = 3
REGION_COLS = 10
CHUNK_COLS = 5


def rows_of(t: torch.Tensor) -> Optional[tuple[int, list[int], list[int]]]:
    """(row bytes, outer sizes, outer byte strides; the outermost first) of a strided view, or
    None when it needs more than `MAX_OUTER` outer dims."""
    es = t.element_size()
    merged: list = []                      # (size, byte stride), innermost first
    for n, st in zip(reversed(t.shape), reversed(t.stride())):
        if n == 1:
            continue
        if merged and merged[-1][1] * merged[-1][0] == st * es:
            merged[-1] = (merged[-1][0] * n, merged[-1][1])
        else:
            merged.append((n, st * es))
    if merged and merged[0][1] == es:
        row = merged[0][0] * es
        outer = merged[1:]
    else:
        row = es
        outer = merged
    if len(outer) > MAX_OUTER:
        return None
    outer = outer[::-1]
    return row, [n for n, _ in outer], [s for _, s in outer]


@dataclass
class Table:
    """A part's copy table (see the module docstring) and what it covers."""

    regions: np.ndarray        # int64 (n_regions, REGION_COLS)
    chunks: np.ndarray         # int64 (n_chunks, CHUNK_COLS)
    nbytes: int                # bytes the table copies
    covered: list              # indices (in the regions given to `build`) the table copies
    device_data: object = None  # the engine's copy of the table (on the device)

    @property
    def n_regions(self) -> int:
        return len(self.regions)


def build(regions: Sequence[torch.Tensor], wire_offsets: Sequence[int]) -> Table:
    """The copy table of the `regions` it can describe (see `rows_of`), each laid out row-major
    in the bucket from its wire offset; `Table.covered` lists their indices."""
    reg = np.zeros((len(regions), REGION_COLS), dtype=np.int64)
    chunks, covered = [], []
    total = 0
    for j, (r, off) in enumerate(zip(regions, wire_offsets)):
        got = rows_of(r) if r.numel() else None
        if got is None:
            continue
        k = len(covered)
        covered.append(j)
        row, sizes, strides = got
        addr = r.data_ptr()
        vec = WIRE_ALIGN
        for x in (addr, off, row, *strides):
            vec = math.gcd(vec, x) if x else vec
        sizes = [1] * (MAX_OUTER - len(sizes)) + sizes
        strides = [0] * (MAX_OUTER - len(strides)) + strides
        upr = row // vec
        reg[k] = (addr, off, upr, *sizes, *strides, vec)
        n_rows = sizes[0] * sizes[1] * sizes[2]
        total += n_rows * row
        per_chunk = max(1, CHUNK_BYTES // vec)
        if upr >= per_chunk:               # wide rows: each cut in pieces
            for i in range(n_rows):
                for u in range(0, upr, per_chunk):
                    chunks.append((k, i, 1, u, min(per_chunk, upr - u)))
        else:                              # narrow rows: several per chunk
            step = max(1, per_chunk // upr)
            for i in range(0, n_rows, step):
                chunks.append((k, i, min(step, n_rows - i), 0, upr))
    return Table(reg[:len(covered)], np.array(chunks, dtype=np.int64).reshape(-1, CHUNK_COLS),
                 total, covered)


def upload(tables: Sequence[Table], device: torch.device) -> None:
    """Copy `tables` to `device` in one transfer, into one buffer they share: each table's
    `device_data` becomes (the buffer, its regions' address, its chunks' address)."""
    if not tables:
        return
    flat = np.concatenate([a.ravel() for t in tables for a in (t.regions, t.chunks)])
    data = torch.from_numpy(flat).to(device)
    at = data.data_ptr()
    for t in tables:
        chunks_at = at + t.regions.size * 8
        t.device_data = (data, at, chunks_at)
        at = chunks_at + t.chunks.size * 8


def _row_address(reg: np.ndarray, row: int) -> int:
    n1, n2 = int(reg[4]), int(reg[5])
    i0, rem = divmod(row, n1 * n2)
    i1, i2 = divmod(rem, n2)
    return int(reg[0]) + i0 * int(reg[6]) + i1 * int(reg[7]) + i2 * int(reg[8])


class HostCopy:
    """Runs a table on host memory, row piece by row piece (the reference for the kernel)."""

    name = "host"

    def upload(self, tables: list, device: torch.device) -> None:
        for t in tables:
            t.device_data = t

    def copy(self, table: Table, wire: torch.Tensor, to_wire: bool) -> None:
        if wire.data_ptr() % WIRE_ALIGN:
            raise ValueError(f"bucket at {wire.data_ptr():#x} is not {WIRE_ALIGN}-byte aligned")
        base = wire.data_ptr()
        for k, row0, n_rows, u0, n_units in table.chunks.tolist():
            reg = table.regions[k]
            upr, vec = int(reg[2]), int(reg[9])
            for i in range(row0, row0 + n_rows):
                a = _row_address(reg, i) + u0 * vec
                w = base + int(reg[1]) + (i * upr + u0) * vec
                if to_wire:
                    ctypes.memmove(w, a, n_units * vec)
                else:
                    ctypes.memmove(a, w, n_units * vec)
