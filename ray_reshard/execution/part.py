"""A compiled program's `Part`: the items of one transfer on one side, resolved against this
process's shards, and the copies that pack them into a bucket and unpack them out of one.

Binding builds each item's region view once and keeps it while the shard's storage stays the
same; adjacent contiguous regions of one storage merge into one copy. A part copies its regions
with one copy table launch (`regions`: cupy on CUDA, memmoves in host memory) or one
`torch._foreach_copy_` call. Block-FP8 items are blocks (`fp8`): quantised by the sender,
never merged, never sent as messages of their own. It never plans or moves a message.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from . import fp8 as _fp8
from . import regions as _regions

__all__ = ["Part", "UNALIGNED"]

_WIRE_CACHE = 4          # staging buffers per part whose wire views are kept


# A plain item after FP8 blocks at an offset its dtype cannot be viewed at: copied as bytes.
UNALIGNED = "unaligned"


def _blocks(qi) -> bool:
    """An item of whole FP8 blocks (quantised by its sender), not plain or widened elements."""
    return type(qi) is _fp8.QuantItem


class Part:
    """The items of one transfer on one side, resolved against this process's shards."""

    __slots__ = ("held", "slices", "shapes", "numels", "wire", "offsets", "nbytes", "item_bytes",
                 "quant", "_regions", "_runs", "_loose", "_table", "_engine", "_wires", "_msgs",
                 "_scales", "_pair", "_table_dev", "_rows")

    def __init__(self, held, slices, shapes, numels, wire, offsets, item_bytes, nbytes,
                 quant=None):
        self.held = held              # per item: index into Program.held
        self.slices = slices          # per item: slices of the item inside its shard
        self.shapes = shapes          # per item: the item's shape
        self.numels = numels
        self.wire = wire              # per item: wire (destination) dtype
        self.offsets = offsets        # per item: byte offset in the bucket
        self.item_bytes = item_bytes
        self.nbytes = nbytes
        self.quant = quant            # None, or per item: an fp8.QuantItem or None
        self._scales = None           # per quantised item holding scales: their region (bound)
        self._regions = None          # per item: region view in the local shard (bound)
        self._runs = None             # merged copy runs (see bind)
        self._loose = None            # the runs not on the copy table (copied with foreach)
        self._table = None            # copy table of the other runs (see regions), or None
        self._engine = None           # what runs the table (host_copy, cuda_copy)
        self._pair = None             # local copies into this part: (table, engine, the rest)
        self._table_dev = -1          # the device the regions (and the table) are on
        self._wires: dict = {}        # staging buffer data pointer -> wire views of loose runs
        self._msgs = None             # per item: bytes of the region itself, or None (staged)
        self._rows = None             # see byte_rows (False: it has none)

    def __len__(self) -> int:
        return len(self.held)

    # ------------------------------------------------------------------ binding
    def unbind(self) -> None:
        self._regions = self._runs = self._msgs = self._scales = None
        self._loose = self._table = self._engine = self._pair = self._rows = None
        self._wires = {}

    def holds(self) -> set:
        """Held indices this part reads or writes (a quantised item's scales too)."""
        got = set(self.held)
        if self.quant:
            got.update(qi.scale_held for qi in self.quant if _blocks(qi) and qi.scale_held >= 0)
        return got

    def bind(self, views: Sequence[torch.Tensor], engine=None) -> None:
        """Resolve every item's region in `views` (indexed like Program.held) and merge runs.
        With a copy `engine` (see `regions`), the runs it can copy go on one copy table
        (`table`), which the caller uploads (`Program.bind`: all of a program's at once)."""
        regions = [views[h][s] for h, s in zip(self.held, self.slices)]
        # A run: (first item, last item + 1, wire dtype, local region of the whole run, flat).
        runs = []
        quant = self.quant
        if quant:
            self._scales = [views[qi.scale_held][qi.scale_slices]
                            if _blocks(qi) and qi.scale_held >= 0 else None for qi in quant]
        for i, r in enumerate(regions):
            if quant and (_blocks(quant[i]) or quant[i] is UNALIGNED):
                continue
            flat = r.is_contiguous()
            if flat and runs:
                a, b, wd, prev, pflat = runs[-1]
                if (pflat and wd == self.wire[i] and prev.dtype == r.dtype
                        and prev.device == r.device
                        and prev.untyped_storage().data_ptr() == r.untyped_storage().data_ptr()
                        and prev.storage_offset() + prev.numel() == r.storage_offset()):
                    merged = torch.as_strided(prev, (prev.numel() + r.numel(),), (1,),
                                              prev.storage_offset())
                    runs[-1] = (a, i + 1, wd, merged, True)
                    continue
            runs.append((i, i + 1, self.wire[i], r.reshape(-1) if flat else r, flat))
        self._regions = regions
        self._runs = runs
        self._loose, self._table, self._engine, self._pair = runs, None, None, None
        self._rows = None
        if engine is not None:
            same = [k for k, run in enumerate(runs)
                    if run[3].dtype == run[2] and (run[4] or engine.strided)]
            if len(same) > 1:
                table = _regions.build([runs[k][3] for k in same],
                                       [self.offsets[runs[k][0]] for k in same])
                if len(table.covered) > 1:
                    on = {same[c] for c in table.covered}
                    self._table, self._engine = table, engine
                    self._table_dev = runs[same[0]][3].get_device()
                    self._loose = [run for k, run in enumerate(runs) if k not in on]
        self._wires = {}
        self._msgs = None

    @property
    def n_runs(self) -> int:
        """Regions copied per pack/unpack once bound (adjacent contiguous items merged)."""
        return len(self._runs)

    @property
    def table(self):
        """The copy table once bound with an engine (see `regions`), or None."""
        return self._table

    @property
    def bound(self) -> bool:
        return self._runs is not None

    def region(self, i: int) -> torch.Tensor:
        return self._regions[i]

    # ------------------------------------------------------------------ wire views
    def _wire_views(self, buf: torch.Tensor, cache: bool, runs=None) -> list:
        key = buf.data_ptr()
        got = self._wires.get(key) if cache else None
        if got is not None:
            return got
        out = []
        for a, b, wd, region, flat in (self._loose if runs is None else runs):
            start = self.offsets[a]
            end = self.offsets[b - 1] + self.item_bytes[b - 1]
            w = buf[start:end].view(wd)
            out.append(w if flat else w.view(self.shapes[a]))
        if cache:
            if len(self._wires) >= _WIRE_CACHE:
                self._wires.pop(next(iter(self._wires)))
            self._wires[key] = out
        return out

    def _copy(self, buf: torch.Tensor, cache: bool, to_wire: bool) -> None:
        """Copy the runs between the local shards and `buf`: the copy table in one launch,
        the rest with one foreach call (all of them so when `buf` is not aligned for the table,
        or is on another device: a ring slot on a peer GPU, which torch copies to)."""
        runs = self._loose
        if self._table is not None:
            if buf.data_ptr() % _regions.WIRE_ALIGN or buf.get_device() != self._table_dev:
                runs, cache = self._runs, False
            else:
                self._engine.copy(self._table, buf, to_wire)
        if runs:
            wires = self._wire_views(buf, cache, runs)
            regions = [r[3] for r in runs]
            if to_wire:
                torch._foreach_copy_(wires, regions)
            else:
                torch._foreach_copy_(regions, wires)

    def pack(self, buf: torch.Tensor, cache: bool = True) -> None:
        """Copy the items from the local shards into `buf` (uint8, the bucket's bytes)."""
        if self._runs:
            self._copy(buf, cache, True)
        if self.quant:
            for i, qi in enumerate(self.quant):
                if _blocks(qi) or qi is UNALIGNED:
                    self.pack_item(i, buf[self.offsets[i]:self.offsets[i] + self.item_bytes[i]])

    def unpack(self, buf: torch.Tensor, cache: bool = True) -> None:
        """Copy a bucket's bytes from `buf` into the local shards."""
        if self._runs:
            self._copy(buf, cache, False)
        if self.quant:
            for i, qi in enumerate(self.quant):
                if _blocks(qi) or qi is UNALIGNED:
                    self.unpack_item(i, buf[self.offsets[i]:self.offsets[i] + self.item_bytes[i]])
                elif qi is not None:
                    qi.finisher.add(self.numels[i])

    def byte_rows(self):
        """The bucket's bytes where they lie in this process, once bound: (n, 2) int64 rows of
        (address, length), in bucket order, when every item is plain bytes of host memory in
        its wire dtype (no conversion, no quantisation, each run contiguous), else None. A
        ring forward lists these instead of packing them (see shm.ShmRing.send_rows)."""
        if self._rows is None:
            runs = self._runs
            ok = runs is not None and not (self.quant and any(q is not None for q in self.quant))
            ok = ok and all(flat and r.dtype == wd and r.device.type == "cpu"
                            for _, _, wd, r, flat in runs)
            rows = None
            if ok:
                rows = np.array([(r.data_ptr(), r.numel() * r.element_size())
                                 for _, _, _, r, _ in runs], dtype=np.int64).reshape(-1, 2)
                ok = int(rows[:, 1].sum()) == sum(self.item_bytes)
            self._rows = rows if ok else False
        return self._rows if self._rows is not False else None

    def item_rows(self, buf: torch.Tensor):
        """(n, 2) int64 rows (address, length) of each item's bytes in `buf`, a bucket."""
        base = buf.data_ptr()
        return np.array([(base + o, n) for o, n in zip(self.offsets, self.item_bytes)],
                        dtype=np.int64).reshape(-1, 2)

    def messages(self, sending: bool) -> list:
        """Per item (one message each): the region's own bytes when it is contiguous (and, to
        send, already in the wire dtype), else None: that item goes through a staging buffer."""
        if self._msgs is None:
            quant = self.quant or [None] * len(self._regions)
            self._msgs = [r.reshape(-1).view(torch.uint8)
                          if (qi is None or qi is UNALIGNED or (sending and not _blocks(qi)))
                          and r.is_contiguous() and (not sending or r.dtype == w)
                          else None
                          for r, w, qi in zip(self._regions, self.wire, quant)]
        return self._msgs

    def pack_item(self, i: int, buf: torch.Tensor) -> None:
        qi = self.quant[i] if self.quant else None
        if _blocks(qi):
            _fp8.pack(qi, self._regions[i], self._scales[i], buf)
        elif qi is UNALIGNED:
            buf[:self.item_bytes[i]].copy_(
                self._regions[i].to(self.wire[i]).contiguous().reshape(-1).view(torch.uint8))
        else:
            buf.view(self.wire[i]).view(self.shapes[i]).copy_(self._regions[i])

    def unpack_item(self, i: int, buf: torch.Tensor) -> None:
        qi = self.quant[i] if self.quant else None
        if _blocks(qi):
            _fp8.unpack(qi, self._regions[i], self._scales[i], buf)
            return
        if qi is UNALIGNED:
            buf = buf[:self.item_bytes[i]].clone()
        self._regions[i].copy_(buf.view(self.wire[i]).view(self.shapes[i]))
        if qi is not None and qi is not UNALIGNED:
            qi.finisher.add(self.numels[i])

    def pair_with(self, other: "Part", engine) -> Optional[_regions.Table]:
        """Put the local copies from `other` (same items, same order) whose dtypes match on one
        copy table run by `engine` (both parts bound); returns it, not uploaded, or None."""
        self._pair = None
        if engine is None:
            return None
        items = self._plain()
        mine, theirs = self._regions, other._regions
        plain = [i for i in items if mine[i].dtype == theirs[i].dtype and (
            engine.strided or (mine[i].is_contiguous() and theirs[i].is_contiguous()))]
        if len(plain) < 2:
            return None
        table = _regions.build_pairs([self._regions[i] for i in plain],
                                     [other._regions[i] for i in plain])
        if len(table.covered) < 2:
            return None
        on = {plain[c] for c in table.covered}
        rest = [i for i in items if i not in on]
        self._pair = (table, engine, rest)
        return table

    def _plain(self) -> list:
        """Items copied as elements (not FP8 blocks)."""
        if not self.quant:
            return list(range(len(self.held)))
        return [i for i, qi in enumerate(self.quant) if not _blocks(qi)]

    def copy_from(self, other: "Part") -> None:
        """Local copy: this part's regions take `other`'s (same items, same order): the copy
        table (see `pair_with`) in one launch, the rest with one foreach call."""
        if self._pair is not None:
            table, engine, plain = self._pair
            engine.copy(table, None, False)
        elif not self.quant:
            torch._foreach_copy_(self._regions, other._regions)
            return
        else:
            plain = self._plain()
        if plain:
            torch._foreach_copy_([self._regions[i] for i in plain],
                                 [other._regions[i] for i in plain])
        if not self.quant:
            return
        for i, qi in enumerate(self.quant):
            if _blocks(qi):
                _fp8.copy(other.quant[i], other._regions[i], other._scales[i],
                            self._regions[i], self._scales[i])
            elif qi is not None and qi is not UNALIGNED:
                qi.finisher.add(self.numels[i])
