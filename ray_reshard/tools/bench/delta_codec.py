"""The delta codec alone, on one thread of this machine as a refit runs it: encoding a bucket
straight from the tensors it is cut from, and applying its payload straight into destination
tensors (what the simulator's local preset charges per bucket byte)."""
from __future__ import annotations

import statistics
import time

import torch

from .harness import MiB

GOAL_ENCODE_GBPS = 4.0       # the codec on one thread, 10% changed: bucket GB/s encoded
GOAL_DECODE_GBPS = 6.0       # ... and decoded (applied, checksummed)
CODEC_FRACTIONS = (0.0, 0.001, 0.01, 0.1, 1.0)


def codec_rates(fraction: float = 0.1, nbytes: int = 16 * MiB, repeats: int = 9,
                regions: int = 8) -> dict:
    """The delta codec (`execution.codecs.codec_for` host memory: the compiled kernel where it
    builds) on one thread of this machine, a bf16 bucket of `nbytes` with `fraction` of its
    elements changed, read from `regions` separate tensors as a refit reads its source shards
    in place: GB/s of bucket bytes encoded (compare, compaction, checksum, the baseline kept)
    and decoded (applied straight into `regions` destination tensors, with the checksum);
    medians of `repeats`, each on fresh copies."""
    import numpy as np

    from ...execution import codecs, delta as codec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c = codecs.codec_for(torch.device("cpu"))
        g = torch.Generator().manual_seed(7)
        old = (torch.randn(nbytes // 2, generator=g) * 0.02).to(torch.bfloat16)
        new = old.clone()
        mask = torch.rand(new.numel(), generator=g) < fraction
        new.view(torch.int16)[mask] ^= 1
        ob, nb = old.view(torch.uint8), new.view(torch.uint8)
        cut = [len(x) for x in np.array_split(np.arange(nbytes // 2), regions)]
        src = [t.clone() for t in torch.split(nb, [2 * k for k in cut])]
        rows = np.array([[t.data_ptr(), t.numel()] for t in src], dtype=np.int64)
        out = torch.empty(nbytes, dtype=torch.uint8)
        enc_s, dec_s = [], []
        for _ in range(repeats):
            base = ob.clone()
            t0 = time.perf_counter()
            enc = c.encode(rows if c.name == "host" else nb, base, out, 2, probe=True)
            enc_s.append(time.perf_counter() - t0)
            dst = [t.clone() for t in torch.split(ob, [2 * k for k in cut])]
            drows = np.array([[t.data_ptr(), t.numel()] for t in dst], dtype=np.int64)
            t0 = time.perf_counter()
            if enc.kind != codec.DENSE:
                check = c.apply(enc.kind, enc.payload, drows if c.name == "host" else dst[0], 2)
                if check != enc.check:
                    raise RuntimeError("codec benchmark: the decoded bucket's checksum differs")
            dec_s.append(time.perf_counter() - t0)
            if enc.kind != codec.DENSE and not torch.equal(torch.cat(dst), nb):
                raise RuntimeError("codec benchmark: the decoded bucket is not the new one")
    finally:
        torch.set_num_threads(threads)
    return {"fraction": fraction, "bucket_bytes": nbytes, "encoding": codec.KINDS[enc.kind],
            "codec": c.name, "regions": regions, "repeats": repeats,
            "encode_GBps": nbytes / statistics.median(enc_s) / 1e9,
            "decode_GBps": (nbytes / statistics.median(dec_s) / 1e9
                            if enc.kind != codec.DENSE else None),
            "encode_s": enc_s, "decode_s": dec_s}


def codec_table(fractions=CODEC_FRACTIONS, nbytes: int = 16 * MiB, repeats: int = 9) -> list:
    """`codec_rates` at each of `fractions`."""
    return [codec_rates(f, nbytes, repeats) for f in fractions]


def render_codec(rows: list) -> str:
    lines = [f"codec on one thread of this machine ({rows[0]['codec']} codec, "
             f"{rows[0]['bucket_bytes'] // MiB} MiB bf16 buckets read from "
             f"{rows[0]['regions']} tensors, medians of {rows[0]['repeats']}):",
             f"{'changed':>9} {'encoding':>9} {'encode GB/s':>12} {'decode GB/s':>12}"]
    for r in rows:
        dec = "-" if r["decode_GBps"] is None else f"{r['decode_GBps']:.2f}"
        lines.append(f"{r['fraction']:>9g} {r['encoding']:>9} {r['encode_GBps']:>12.2f} "
                     f"{dec:>12}")
    at10 = next((r for r in rows if r["fraction"] == 0.1), None)
    if at10 is not None:
        for what, goal in (("encode", GOAL_ENCODE_GBPS), ("decode", GOAL_DECODE_GBPS)):
            got = at10[f"{what}_GBps"]
            lines.append(f"  goal: {what} >= {goal:g} GB/s per thread at 10% changed: "
                         f"{got:.2f}  {'met' if got >= goal else 'NOT met'}")
    return "\n".join(lines)
