"""Delta encoding of a bucket: the bytes that changed since a baseline, exactly.

A bucket's bytes (its wire format, see `program`) are compared with the bytes sent last time
(the baseline) in granules of `granule(...)` bytes (the smallest element size of its items), and
travel as whichever is smallest:

- SAME: nothing changed, nothing travels;
- MASK: a bit per granule (1 = changed, little-endian bit order within a byte), then the changed
  granules' bytes in order;
- INDEX: the changed granules' indices (int32), then their bytes in order;

(the values start at the next multiple of the granule after the mask or the indices)
- DENSE: the bucket's bytes.

A receiver rebuilds the bucket from its own copy of the baseline (its destination regions,
packed) and the payload, and checks the result against the sender's `checksum` of the bucket
(a SAME bucket too), so a destination changed outside refits is caught, not silently mixed.
Everything here is a short sequence of torch ops over the bytes (the same on CPU and GPU);
`encoded_bytes` is the size model the plan report and the simulator use.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

SAME, MASK, INDEX, DENSE = 0, 1, 2, 3
KINDS = {SAME: "same", MASK: "mask", INDEX: "index", DENSE: "dense"}
INDEX_BYTES = 4

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    options = [(nbytes, DENSE), (_up((n + 7) // 8, g) + changed * g, MASK),
               (_up(changed * INDEX_BYTES, g) + changed * g, INDEX)]
    size, kind = min(options)
    return kind, size


def _up(x: int, g: int) -> int:
    return -(-x // g) * g


def expected_encoding(nbytes: int, g: int, fraction: float) -> tuple:
    """(kind, payload bytes) of a bucket whose granules changed with probability `fraction`
    (a prediction: changes spread evenly over buckets)."""
    return encoded_bytes(nbytes, g, int(round(fraction * (nbytes // g))))


def expected_bytes(nbytes: int, g: int, fraction: float) -> int:
    """`expected_encoding`'s payload bytes."""
    return expected_encoding(nbytes, g, fraction)[1]


def checksum(buf: torch.Tensor) -> int:
    """A 64-bit sum of a bucket's bytes (as int64 words where they divide it, wrapping)."""
    n = buf.numel()
    for size in (8, 4, 2, 1):
        if n % size == 0:
            break
    words = buf.view(_INT[size])
    if size == 8:
        return int(words.sum())
    return int(words.sum(dtype=torch.int64))


@dataclass
class Encoded:
    """One bucket's delta: `kind`, the payload to send (uint8; None when SAME), how many
    granules changed (at least; a bucket found mostly changed early stops counting), and the
    checksum of the new bytes (not for DENSE)."""

    kind: int
    payload: object
    changed: int
    check: int = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.payload is None else self.payload.numel()


# A host bucket whose first eighth (or first `MOSTLY_AFTER_CHUNKS` chunks, if fewer) changed in
# more than this share of its granules travels DENSE without comparing the rest (a sparse
# payload would save little and cost decoding).
MOSTLY_CHANGED = 0.8
MOSTLY_AFTER_CHUNKS = 4
# Host buckets are compared and compacted in chunks of this many granules, so each chunk's mask
# stays in cache (on GPUs the bucket is one chunk: launches cost more than the memory traffic).
CHUNK = 1 << 18


def encode(new: torch.Tensor, base: torch.Tensor, g: int) -> Encoded:
    """The smallest encoding of `new` against `base` (uint8, same size, `g`-byte granules).
    A DENSE payload is `new` itself (not copied)."""
    a, b = new.view(_INT[g]), base.view(_INT[g])
    n = a.numel()
    dense_at = (new.numel() - _up((n + 7) // 8, g)) // g   # past this many DENSE is smallest
    heads, values, where, changed, stopped = [], [], [], 0, False
    if new.device.type == "cpu":       # numpy's compare, count and compaction are the fastest
        import numpy as np
        an, bn = a.numpy(), b.numpy()
        mask = np.empty(min(CHUNK, n), dtype=bool)
        for s in range(0, n, CHUNK):
            m = mask[:min(CHUNK, n - s)]
            np.not_equal(an[s:s + CHUNK], bn[s:s + CHUNK], out=m)
            c = int(np.count_nonzero(m))
            changed += c
            seen = s + m.size
            if changed > dense_at or (changed > MOSTLY_CHANGED * seen and
                                      (seen * 8 >= n or seen >= MOSTLY_AFTER_CHUNKS * CHUNK)):
                stopped = True
                break
            heads.append(np.packbits(m, bitorder="little"))
            idx = np.flatnonzero(m) if c else np.empty(0, dtype=np.int64)
            values.append(an[s:s + CHUNK].take(idx))
            where.append((s, idx))
        heads = [torch.from_numpy(h) for h in heads]
        values = [torch.from_numpy(v) for v in values]
        where = [torch.from_numpy(idx.astype(np.int32) + np.int32(s)) for s, idx in where] \
            if encoded_bytes(new.numel(), g, changed)[0] == INDEX else None
    else:
        mask = a != b
        heads, values = [_pack_bits(mask)], [a[mask]]
        changed = values[0].numel()
        where = None
    kind, size = encoded_bytes(new.numel(), g, changed)
    if kind == SAME:
        return Encoded(SAME, None, 0, checksum(new))
    if kind == DENSE or stopped:
        return Encoded(DENSE, new, changed)
    vals = torch.cat(values).view(torch.uint8)
    if kind == MASK:
        head = torch.cat(heads)
    else:
        head = (torch.cat(where) if where is not None else
                mask.nonzero().view(-1).to(torch.int32)).view(torch.uint8)
    pad = head.new_zeros(_up(head.numel(), g) - head.numel())
    return Encoded(kind, torch.cat([head, pad, vals]), changed, checksum(new))


def decode(kind: int, payload: torch.Tensor, into: torch.Tensor, g: int) -> None:
    """Apply a MASK or INDEX payload onto `into` (the baseline's bytes, uint8) in place."""
    target = into.view(_INT[g])
    n = target.numel()
    if kind == MASK:
        head = (n + 7) // 8
        values = payload[_up(head, g):].view(_INT[g])
        if into.device.type == "cpu":    # numpy's place is several times torch's scatter here
            import numpy as np
            tn, vn, bits = target.numpy(), values.numpy(), payload[:head].numpy()
            pos = 0
            for s in range(0, n, CHUNK):
                k = min(CHUNK, n - s)
                m = np.unpackbits(bits[s // 8:(s + k + 7) // 8], count=k,
                                  bitorder="little").view(bool)
                c = int(np.count_nonzero(m))
                if c:
                    if pos + c > vn.size:
                        break
                    np.place(tn[s:s + k], m, vn[pos:pos + c])
                    pos += c
        else:
            m = _unpack_bits(payload[:head], n)
            pos = int(torch.count_nonzero(m))
            if pos == values.numel():
                target.masked_scatter_(m, values)
        if pos != values.numel():
            raise ValueError(f"delta payload holds {values.numel()} values, its mask more or "
                             f"fewer ({pos} placed)")
    elif kind == INDEX:
        count = payload.numel() // (INDEX_BYTES + g)       # padding is less than one granule
        idx = payload[:count * INDEX_BYTES].view(torch.int32).long()
        target.index_copy_(0, idx, payload[_up(count * INDEX_BYTES, g):].view(_INT[g]))
    else:
        raise ValueError(f"decode takes a MASK or INDEX payload, got {KINDS.get(kind, kind)}")


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    if mask.device.type == "cpu":
        import numpy as np
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    pad = (-n) % 8
    m = torch.nn.functional.pad(mask.view(torch.uint8), (0, pad)).view(-1, 8)
    return (m * _bits(mask.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    if bits.device.type == "cpu":
        import numpy as np
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little")
                                .view(bool))
    m = (bits.unsqueeze(1) & _bits(bits.device)) != 0
    return m.view(-1)[:n]
