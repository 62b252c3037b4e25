"""Copy tables: all the regions of a packed bucket, or of a local copy, copied in one launch.

A table describes every region of a part (an item's strided view of a local shard beside its
bytes in the bucket, or a local copy's source and destination regions) as rows of contiguous
bytes, so one launch (`cuda_copy`) copies them all whatever their count. `HostCopy` runs a
table with `ctypes.memmove` per row piece: the reference the kernel's indexing is tested
against. Entries, units and the table's columns: docs/architecture.md (Copy tables).
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
REGION_COLS = 13
CHUNK_COLS = 5


def joint_rows(shape: Sequence[int], itemsize: int, strides_a: Sequence[int],
               strides_b: Sequence[int]) -> Optional[tuple[int, list, list, list]]:
    """(row bytes, outer sizes, side A's and side B's outer byte strides; the outermost first)
    of two strided layouts (element strides) of one shape, or None when they need more than
    `MAX_OUTER` outer dims."""
    merged: list = []                      # [size, stride A, stride B] in bytes, innermost first
    for n, sa, sb in zip(reversed(shape), reversed(strides_a), reversed(strides_b)):
        if n == 1:
            continue
        sa, sb = sa * itemsize, sb * itemsize
        if merged:
            m = merged[-1]
            if m[1] * m[0] == sa and m[2] * m[0] == sb:
                m[0] *= n
                continue
        merged.append([n, sa, sb])
    if merged and merged[0][1] == itemsize and merged[0][2] == itemsize:
        row = merged[0][0] * itemsize
        outer = merged[1:]
    else:
        row = itemsize
        outer = merged
    if len(outer) > MAX_OUTER:
        return None
    outer = outer[::-1]
    return row, [m[0] for m in outer], [m[1] for m in outer], [m[2] for m in outer]


def dense_strides(shape: Sequence[int]) -> list:
    """Element strides of a row-major (contiguous) layout of `shape`."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def rows_of(t: torch.Tensor) -> Optional[tuple[int, list[int], list[int]]]:
    """(row bytes, outer sizes, outer byte strides; the outermost first) of a strided view
    copied to or from its row-major bytes, or None when it needs more than `MAX_OUTER` outer
    dims."""
    got = joint_rows(t.shape, t.element_size(), t.stride(), dense_strides(t.shape))
    return None if got is None else got[:3]


@dataclass
class Table:
    """A part's copy table (columns: docs/architecture.md, Copy tables) and what it covers."""

    regions: np.ndarray        # int64 (n_entries, REGION_COLS)
    chunks: np.ndarray         # int64 (n_chunks, CHUNK_COLS)
    nbytes: int                # bytes the table copies
    covered: list              # indices (in what was given to `build`) the table copies
    wire: bool = True          # side B is a bucket (offsets), else source regions (addresses)
    device_data: object = None  # the engine's copy of the table (on the device)


def build(regions: Sequence[torch.Tensor], wire_offsets: Sequence[int]) -> Table:
    """The copy table between `regions` and a bucket holding each row-major at its wire offset
    (side B), for the regions it can describe; `Table.covered` lists their indices."""
    return _build([(r.data_ptr(), off, r.shape, r.element_size(), r.stride(),
                    dense_strides(r.shape), r.numel())
                   for r, off in zip(regions, wire_offsets)], True)


def build_pairs(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Table:
    """The copy table of local copies `src[i]` -> `dst[i]` (same shapes; side A the
    destinations), for the pairs it can describe; `Table.covered` lists their indices."""
    return _build([(d.data_ptr(), s.data_ptr(), d.shape, d.element_size(), d.stride(),
                    s.stride(), d.numel()) for d, s in zip(dst, src)], False)


def _build(entries: list, wire: bool) -> Table:
    reg = np.zeros((len(entries), REGION_COLS), dtype=np.int64)
    chunks, covered = [], []
    total = 0
    for j, (addr_a, addr_b, shape, es, st_a, st_b, numel) in enumerate(entries):
        got = joint_rows(shape, es, st_a, st_b) if numel else None
        if got is None:
            continue
        k = len(covered)
        covered.append(j)
        row, sizes, outer_a, outer_b = got
        vec = WIRE_ALIGN
        for x in (addr_a, addr_b, row, *outer_a, *outer_b):
            vec = math.gcd(vec, x) if x else vec
        pad = MAX_OUTER - len(sizes)
        sizes = [1] * pad + sizes
        outer_a = [0] * pad + outer_a
        outer_b = [0] * pad + outer_b
        upr = row // vec
        reg[k] = (addr_a, addr_b, upr, *sizes, *outer_a, *outer_b, vec)
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
                 total, covered, wire)


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


def wire_base(table: Table, wire: Optional[torch.Tensor]) -> int:
    """What side B's addresses are relative to: the bucket's base (checked aligned), or 0."""
    if not table.wire:
        return 0
    base = wire.data_ptr()
    if base % WIRE_ALIGN:
        raise ValueError(f"bucket at {base:#x} is not {WIRE_ALIGN}-byte aligned")
    return base


def _row_offsets(reg: np.ndarray, row: int) -> tuple[int, int]:
    n1, n2 = int(reg[4]), int(reg[5])
    i0, rem = divmod(row, n1 * n2)
    i1, i2 = divmod(rem, n2)
    return (i0 * int(reg[6]) + i1 * int(reg[7]) + i2 * int(reg[8]),
            i0 * int(reg[9]) + i1 * int(reg[10]) + i2 * int(reg[11]))


class HostCopy:
    """Runs a table on host memory, row piece by row piece (the reference for the kernel)."""

    name = "host"
    strided = True       # regions of any strides (see `MAX_OUTER`)

    def upload(self, tables: list, device: torch.device) -> None:
        for t in tables:
            t.device_data = t

    def copy(self, table: Table, wire: Optional[torch.Tensor], to_wire: bool) -> None:
        """Side A to side B when `to_wire`, else B to A; `wire` is the bucket (None for a
        table of local copies, which always copies its sources, side B, into side A)."""
        base = wire_base(table, wire)
        for k, row0, n_rows, u0, n_units in table.chunks.tolist():
            reg = table.regions[k]
            vec = int(reg[12])
            a0, b0 = int(reg[0]), base + int(reg[1])
            for i in range(row0, row0 + n_rows):
                oa, ob = _row_offsets(reg, i)
                a, b = a0 + oa + u0 * vec, b0 + ob + u0 * vec
                if to_wire:
                    ctypes.memmove(b, a, n_units * vec)
                else:
                    ctypes.memmove(a, b, n_units * vec)
