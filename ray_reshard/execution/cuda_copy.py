"""One CUDA kernel launch per copy table (see `regions`): a bucket's regions packed or
unpacked together, or a local copy's pairs of regions, on the caller's current torch stream
(so it is ordered with the NCCL operations and the ring handshakes around it, as
`torch.Tensor.copy_` would be).

Each block of 256 threads takes one chunk of the table; thread k of a chunk of `n_rows` rows
and `n_units` units per row copies unit `k % n_units` of row `k // n_units` between the two
sides of its entry, stepping by the block size, `vec` bytes at a time. Built with cupy (the `gpu` extra); `available()` says
whether it can run here.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from .regions import CHUNK_COLS, REGION_COLS, Table, upload, wire_base

THREADS = 256

SOURCE = r"""
#define REGION_COLS %(region_cols)d
#define CHUNK_COLS %(chunk_cols)d

template <typename V>
__device__ void copy_chunk(const long long* r, const long long* c, long long wire, bool a_to_b) {
    const long long n1 = r[4], n2 = r[5];
    const bool flat = r[3] * n1 == 1;          // at most one outer dim: row i at i * stride
    const long long row0 = c[1], u0 = c[3];
    const int n_units = (int) c[4];
    const int total = (int) c[2] * n_units;
    for (int k = threadIdx.x; k < total; k += blockDim.x) {
        const int rl = k / n_units;
        const long long col = u0 + (k - rl * n_units);
        const long long row = row0 + rl;
        long long off_a, off_b;
        if (flat) {
            off_a = row * r[8];
            off_b = row * r[11];
        } else {
            const long long i0 = row / (n1 * n2);
            const long long rem = row - i0 * n1 * n2;
            const long long i1 = rem / n2;
            const long long i2 = rem - i1 * n2;
            off_a = i0 * r[6] + i1 * r[7] + i2 * r[8];
            off_b = i0 * r[9] + i1 * r[10] + i2 * r[11];
        }
        V* a = (V*) (r[0] + off_a) + col;
        V* b = (V*) (wire + r[1] + off_b) + col;
        if (a_to_b) {
            *b = *a;
        } else {
            *a = *b;
        }
    }
}

extern "C" __global__ void copy_table(const long long* regions, const long long* chunks,
                                      long long wire, long long a_to_b) {
    const long long* c = chunks + CHUNK_COLS * (long long) blockIdx.x;
    const long long* r = regions + REGION_COLS * c[0];
    switch (r[12]) {
        case 16: copy_chunk<uint4>(r, c, wire, a_to_b); break;
        case 8: copy_chunk<unsigned long long>(r, c, wire, a_to_b); break;
        case 4: copy_chunk<unsigned int>(r, c, wire, a_to_b); break;
        case 2: copy_chunk<unsigned short>(r, c, wire, a_to_b); break;
        default: copy_chunk<unsigned char>(r, c, wire, a_to_b); break;
    }
}
""" % {"region_cols": REGION_COLS, "chunk_cols": CHUNK_COLS}

_ENGINE: Optional["CudaCopy"] = None
_FAILED: Optional[str] = None


def available() -> bool:
    """True when CUDA and cupy are both here."""
    return engine() is not None


def engine() -> Optional["CudaCopy"]:
    """The process's CUDA copy engine, or None (no CUDA, no cupy, or the kernel does not
    compile here: see `why_not`; parts then copy with foreach, and a warning says why once)."""
    global _ENGINE, _FAILED
    if _ENGINE is None and _FAILED is None:
        if not torch.cuda.is_available():
            _FAILED = "CUDA is not available"
        else:
            try:
                _ENGINE = CudaCopy()
            except ImportError as e:
                _FAILED = f"cupy is not installed (the gpu extra): {e}"
            except Exception as e:
                _FAILED = f"the copy kernel does not compile here: {type(e).__name__}: {e}"
            if _FAILED is not None:
                warnings.warn(f"ray_reshard: copy tables off, regions copied one by one on the "
                              f"GPU: {_FAILED}", RuntimeWarning, stacklevel=2)
    return _ENGINE


def why_not() -> Optional[str]:
    engine()
    return _FAILED


class CudaCopy:
    """Launches `copy_table` for a table uploaded to the device."""

    name = "cuda"
    strided = True

    def __init__(self):
        import cupy
        self._cupy = cupy
        self._kernel = cupy.RawKernel(SOURCE, "copy_table")
        self._kernel.compile()           # now, not in the middle of a refit
        self._streams: dict = {}

    def _wrap(self, stream: torch.cuda.Stream, dev: int):
        """torch's stream as a cupy stream (cupy >= 14 through the CUDA stream protocol)."""
        cuda = self._cupy.cuda
        if hasattr(cuda.Stream, "from_external"):
            return cuda.Stream.from_external(stream)
        return cuda.ExternalStream(stream.cuda_stream, dev)

    def upload(self, tables: list, device: torch.device) -> None:
        upload(tables, device)

    def copy(self, table: Table, wire: Optional[torch.Tensor], to_wire: bool) -> None:
        """Side A to side B when `to_wire`, else B to A (see `regions.HostCopy.copy`)."""
        n = len(table.chunks)
        if not n:
            return
        ptr = wire_base(table, wire)
        data = table.device_data[0]
        dev = data.device.index if data.device.index is not None else torch.cuda.current_device()
        current = torch.cuda.current_stream(dev)
        stream = self._streams.get((dev, current.cuda_stream))
        if stream is None:
            stream = self._streams[(dev, current.cuda_stream)] = self._wrap(current, dev)
        _, regions_ptr, chunks_ptr = table.device_data
        with self._cupy.cuda.Device(dev):
            self._kernel((n,), (THREADS,), (regions_ptr, chunks_ptr, ptr, int(to_wire)),
                         stream=stream)
