"""Delta encoding of a bucket: the bytes that changed since a baseline, exactly.

A bucket's bytes are compared with the baseline in granules and travel as SAME, MASK, INDEX or
DENSE, whichever is smallest, with a checksum of the new bytes the receiver checks after
applying. `HostCodec`, `delta_cuda.CudaCodec` and `TorchCodec` keep this contract (`codecs`
picks one by device); `encoded_bytes` is the size model of the plan report and the simulator.
Wire format and checksum: docs/delta.md (How it works).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

SAME, MASK, INDEX, DENSE = 0, 1, 2, 3
KINDS = {SAME: "same", MASK: "mask", INDEX: "index", DENSE: "dense"}
INDEX_BYTES = 4

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_U64 = 1 << 64

# A bucket found mostly changed early travels DENSE without comparing the rest (a sparse
# payload would save little and cost decoding): checked after every CHUNK granules from the
# first eighth of the bucket or MOSTLY_AFTER_CHUNKS chunks, whichever comes first.
MOSTLY_CHANGED = 0.8
MOSTLY_AFTER_CHUNKS = 4
CHUNK = 1 << 18


@lru_cache(maxsize=None)
def _bits(device: torch.device) -> torch.Tensor:
    """Each bit of a byte as a uint8 on `device` (made once per device, not per bucket)."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def granule(nbytes: int, smallest_item_bytes: int) -> int:
    """Bytes compared as one unit: the smallest element size of a bucket's items (1, 2, 4 or
    8), halved until it divides the bucket."""
    g = min(max(int(smallest_item_bytes), 1), 8)
    while g & (g - 1):
        g &= g - 1
    while nbytes % g:
        g //= 2
    return g


def encoded_bytes(nbytes: int, g: int, changed: int) -> tuple:
    """(kind, payload bytes) of the smallest encoding of a bucket of `nbytes` in granules of
    `g` bytes with `changed` granules changed."""
    if changed == 0:
        return SAME, 0
    n = nbytes // g
    options = [(nbytes, DENSE), (round_up((n + 7) // 8, g) + changed * g, MASK),
               (round_up(changed * INDEX_BYTES, g) + changed * g, INDEX)]
    size, kind = min(options)
    return kind, size


def round_up(x: int, g: int) -> int:
    """`x` rounded up to a multiple of `g`."""
    return -(-x // g) * g


def dense_after(nbytes: int, g: int) -> int:
    """Changed granules past which DENSE is the smallest encoding."""
    return (nbytes - round_up((nbytes // g + 7) // 8, g)) // g


def probe_from(n: int) -> int:
    """Granules compared before a bucket of `n` granules may be found mostly changed."""
    return min(-(-n // 8), MOSTLY_AFTER_CHUNKS * CHUNK)


def expected_encoding(nbytes: int, g: int, fraction: float) -> tuple:
    """(kind, payload bytes) of a bucket whose granules changed with probability `fraction`
    (a prediction: changes spread evenly over buckets)."""
    return encoded_bytes(nbytes, g, int(round(fraction * (nbytes // g))))


def expected_bytes(nbytes: int, g: int, fraction: float) -> int:
    """`expected_encoding`'s payload bytes."""
    return expected_encoding(nbytes, g, fraction)[1]


def as_signed64(x: int) -> int:
    """`x` modulo 2**64, as a signed int64 (a checksum's form)."""
    x %= _U64
    return x - _U64 if x >> 63 else x


def _sum(words: torch.Tensor, g: int) -> int:
    """The checksum of `words` (a bucket viewed as `_INT[g]`)."""
    if g == 1:
        return as_signed64(int(words.sum(dtype=torch.int64)))
    if g in (2, 4):
        return as_signed64(int((words.to(torch.int64) & ((1 << 8 * g) - 1)).sum()))
    lo = int((words & 0xFFFFFFFF).sum())
    hi = int(((words >> 32) & 0xFFFFFFFF).sum())
    return as_signed64(lo + (hi << 32))


def checksum(buf: torch.Tensor, g: int) -> int:
    """The checksum of a bucket's bytes `buf` (uint8) in granules of `g` bytes."""
    return _sum(buf.view(_INT[g]), g)


@dataclass
class Encoded:
    """One bucket's delta: `kind`, its payload's bytes (`nbytes`; the payload, uint8, None when
    SAME or DENSE: a DENSE bucket's bytes are the new bytes, now also the baseline's), how many
    granules changed (at least: a bucket found DENSE early stops counting), and the checksum of
    the new bytes (0 for DENSE)."""

    kind: int
    nbytes: int
    changed: int
    check: int = 0
    payload: Optional[torch.Tensor] = None
    rest: object = None           # a DENSE one's baseline left to finish (see HostCodec.encode)


def _rows(src) -> np.ndarray:
    """(k, 2) int64 rows (address, bytes) of a host tensor or of rows."""
    if isinstance(src, torch.Tensor):
        if src.device.type != "cpu" or not src.is_contiguous():
            raise ValueError("the host codec takes contiguous host memory")
        return np.array([[src.data_ptr(), src.numel() * src.element_size()]], dtype=np.int64)
    return np.ascontiguousarray(src, dtype=np.int64).reshape(-1, 2)


class HostCodec:
    """The compiled host kernel (`delta_host`): one pass per end over rows of host memory (a
    part's regions in bucket order, each a whole number of granules) or a packed bucket."""

    name = "host"

    def __init__(self, kernel):
        self.kernel = kernel
        self._local = threading.local()           # per thread: the index scratch

    def encode(self, new, base: torch.Tensor, out: torch.Tensor, g: int,
               probe: bool = True, defer: bool = False) -> Encoded:
        """Encode `new` (a packed bucket, uint8, or its rows) against `base` (uint8, the
        bucket's size, host memory) into `out` (at least the bucket's size); `base` then
        holds the new bytes. With `defer`, a bucket found mostly changed leaves the rest of
        its bytes out of `base` until `finish(encoded)` (e.g. after posting its send)."""
        rows = _rows(new)
        nbytes = int(rows[:, 1].sum())
        if base.numel() != nbytes or out.numel() < nbytes or nbytes % g:
            raise ValueError(f"delta encode: {nbytes}-byte bucket, granule {g}, baseline "
                             f"{base.numel()} bytes, output {out.numel()} bytes")
        n = nbytes // g
        check, changed, stopped = self.kernel.encode(
            rows, base.data_ptr(), out.data_ptr(), out.numel(), g, n, dense_after(nbytes, g),
            CHUNK if probe else 0, probe_from(n), MOSTLY_CHANGED, defer)
        if stopped is not None:
            e = Encoded(DENSE, nbytes, changed)
            if defer:
                e.rest = (rows, base, g, stopped)
            return e
        if changed == 0:
            return Encoded(SAME, 0, 0, as_signed64(check))
        kind, size = encoded_bytes(nbytes, g, changed)
        if kind == INDEX:               # few changed: their indices from the bits, then moved
            index = getattr(self._local, "index", None)
            if index is None or index.numel() < changed:
                index = self._local.index = torch.empty(max(changed, 1 << 16),
                                                        dtype=torch.int32)
            self.kernel.bits_to_index(out.data_ptr(), n, index.data_ptr(), changed)
            head = (n + 7) // 8
            vals = out[round_up(head, g):round_up(head, g) + changed * g].clone()
            at = changed * INDEX_BYTES
            out[:at].copy_(index[:changed].view(torch.uint8))
            out[at:round_up(at, g)].zero_()
            out[round_up(at, g):size].copy_(vals)
        return Encoded(kind, size, changed, as_signed64(check), out[:size])

    def finish(self, e: Encoded) -> None:
        """Complete the baseline of a bucket encoded with `defer` (nothing if none is left)."""
        if e.rest is not None:
            rows, base, g, start = e.rest
            self.kernel.copy_rest(rows, base.data_ptr(), g, start)
            e.rest = None

    def apply(self, kind: int, payload: Optional[torch.Tensor], into, g: int) -> int:
        """Apply a MASK or INDEX payload onto `into` (the baseline's bytes: a packed bucket or
        its rows) in place, or nothing (SAME); returns the checksum of the result. A payload
        that does not fit the bucket raises ValueError, nothing written."""
        rows = _rows(into)
        nbytes = int(rows[:, 1].sum())
        if kind == SAME:
            got = self.kernel.apply(0, rows, 0, 0, g, nbytes // g)
        elif kind in (MASK, INDEX):
            if payload.device.type != "cpu" or not payload.is_contiguous():
                raise ValueError("the host codec takes a contiguous host payload")
            got = self.kernel.apply(kind, rows, payload.data_ptr(), payload.numel(), g,
                                    nbytes // g)
        else:
            raise ValueError(f"apply takes a SAME, MASK or INDEX bucket, got "
                             f"{KINDS.get(kind, kind)}")
        if got is None:
            raise ValueError(f"a {KINDS[kind]} delta payload of {payload.numel()} bytes does not "
                             f"fit a {nbytes}-byte bucket of {g}-byte granules")
        return as_signed64(got)


class TorchCodec:
    """The same contract as `HostCodec` in torch ops over a packed bucket, on any device."""

    name = "torch"

    def encode(self, new: torch.Tensor, base: torch.Tensor, out: torch.Tensor, g: int,
               probe: bool = False) -> Encoded:
        """As `HostCodec.encode` (`probe`: stop early as the host codec does)."""
        a, b = new.view(_INT[g]), base.view(_INT[g])
        nbytes, n = new.numel(), a.numel()
        m = a != b
        changed = int(torch.count_nonzero(m))
        stop = changed > dense_after(nbytes, g)
        if not stop and probe and changed and n >= CHUNK:
            k = n // CHUNK
            counts = m[:k * CHUNK].view(k, CHUNK).sum(1).cumsum(0)
            seen = torch.arange(1, k + 1, device=m.device, dtype=torch.float64) * CHUNK
            stop = bool(((seen >= probe_from(n)) & (counts > MOSTLY_CHANGED * seen)).any())
        if stop:
            base.copy_(new)
            return Encoded(DENSE, nbytes, changed)
        check = _sum(a, g)
        if changed == 0:
            return Encoded(SAME, 0, 0, check)
        kind, size = encoded_bytes(nbytes, g, changed)
        vals = a[m]
        if kind == MASK:
            head = (n + 7) // 8
            out[:head].copy_(_pack_bits(m))
            at = head
        else:
            at = changed * INDEX_BYTES
            out[:at].copy_(m.nonzero().view(-1).to(torch.int32).view(torch.uint8))
        out[at:round_up(at, g)].zero_()
        out[round_up(at, g):size].copy_(vals.view(torch.uint8))
        b.copy_(a)
        return Encoded(kind, size, changed, check, out[:size])

    def apply(self, kind: int, payload: Optional[torch.Tensor], into: torch.Tensor,
              g: int) -> int:
        """As `HostCodec.apply`, on a packed bucket."""
        target = into.view(_INT[g])
        n = target.numel()
        if kind == MASK:
            head = (n + 7) // 8
            if payload.numel() < round_up(head, g) or (payload.numel() - round_up(head, g)) % g:
                raise ValueError(f"a mask delta payload of {payload.numel()} bytes does not fit "
                                 f"a {into.numel()}-byte bucket of {g}-byte granules")
            values = payload[round_up(head, g):].view(_INT[g])
            m = _unpack_bits(payload[:head], n)
            placed = int(torch.count_nonzero(m))
            if placed != values.numel():
                raise ValueError(f"delta payload holds {values.numel()} values, its mask "
                                 f"{placed}")
            target.masked_scatter_(m, values)
        elif kind == INDEX:
            count = payload.numel() // (INDEX_BYTES + g)       # padding is under one granule
            at = round_up(count * INDEX_BYTES, g)
            if at + count * g != payload.numel():
                raise ValueError(f"an index delta payload of {payload.numel()} bytes does not "
                                 f"fit {g}-byte granules")
            idx = payload[:count * INDEX_BYTES].view(torch.int32).long()
            if count and (bool((idx[1:] <= idx[:-1]).any()) or int(idx[0]) < 0
                          or int(idx[-1]) >= n):
                raise ValueError("an index delta payload's indices are not increasing inside "
                                 "the bucket")
            target.index_copy_(0, idx, payload[at:].view(_INT[g]))
        elif kind != SAME:
            raise ValueError(f"apply takes a SAME, MASK or INDEX bucket, got "
                             f"{KINDS.get(kind, kind)}")
        return _sum(target, g)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    pad = (-n) % 8
    m = torch.nn.functional.pad(mask.view(torch.uint8), (0, pad)).view(-1, 8)
    return (m * _bits(mask.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little")
                                .view(bool))
    m = (bits.unsqueeze(1) & _bits(bits.device)) != 0
    return m.view(-1)[:n]

