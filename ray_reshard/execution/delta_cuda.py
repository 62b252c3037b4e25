"""The delta codec on CUDA: one kernel launch encodes a bucket (compare, compaction, checksum,
the baseline kept), one applies a mask payload with the checksum; the same contract as the host
kernel (`delta_host`, see `delta` for the format). Built with cupy (the `gpu` extra);
`codec()` is None where it cannot run, and GPUs then use `delta.TorchCodec`. The kernels'
source (and how blocks find where their values go) is `delta_cuda.cu` beside this module.
"""
from __future__ import annotations

import importlib.resources
import warnings
from typing import Optional

import torch

from . import delta

THREADS = 256
GPT = 32                                   # granules per thread: one word of change bits

# The kernels' CUDA source, shipped beside this module (package data).
SOURCE = (importlib.resources.files(__package__) / "delta_cuda.cu").read_text()

_CODEC: Optional["CudaCodec"] = None
_FAILED: Optional[str] = None

# bits set in each byte value (the apply's count check, before anything is written)
_POPCOUNT = [bin(i).count("1") for i in range(256)]


class CudaCodec:
    """`delta.HostCodec`'s contract on CUDA buckets (packed), one launch per bucket and pass:
    encode, and apply of a mask payload; index payloads and checksums of unchanged buckets are
    a few torch ops (they are small, or a plain sum)."""

    name = "cuda"

    def __init__(self, launch=None, threads: int = THREADS):
        """`launch(kernel name, blocks, threads, args)` runs a kernel (default: cupy's launch
        of this source on torch's current stream; the tests pass one that runs the same
        source compiled for the host, with fewer `threads` per block)."""
        self._launch_fn, self.threads = launch, threads
        if launch is None:
            import cupy
            self._cupy = cupy
            self._module = cupy.RawModule(code=SOURCE)
            for g in (1, 2, 4, 8):          # compiled now, not in the middle of a refit
                self._module.get_function(f"delta_encode_{g}")
            self._functions: dict = {}
            self._streams: dict = {}
        self._pop: dict = {}

    def _blocks(self, n: int) -> int:
        return max(1, -(-n // (self.threads * GPT)))

    def _launch(self, name: str, n: int, args: tuple, device: torch.device) -> None:
        blocks = self._blocks(n)
        if self._launch_fn is not None:
            self._launch_fn(name, blocks, self.threads, args)
            return
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._module.get_function(name)
        dev = device.index if device.index is not None else torch.cuda.current_device()
        current = torch.cuda.current_stream(dev)
        stream = self._streams.get((dev, current.cuda_stream))
        if stream is None:
            cuda = self._cupy.cuda
            stream = self._streams[(dev, current.cuda_stream)] = (
                cuda.Stream.from_external(current) if hasattr(cuda.Stream, "from_external")
                else cuda.ExternalStream(current.cuda_stream, dev))
        with self._cupy.cuda.Device(dev):
            fn((blocks,), (self.threads,), args, stream=stream)

    def encode(self, new: torch.Tensor, base: torch.Tensor, out: torch.Tensor, g: int,
               probe: bool = False) -> delta.Encoded:
        """As `delta.HostCodec.encode`, on a packed CUDA bucket (`probe` is not supported: a
        bucket is compared whole)."""
        nbytes, n = new.numel(), new.numel() // g
        head = (n + 7) // 8
        vo = delta.round_up(head, g)
        cap = (head + g) // delta.INDEX_BYTES + 1
        state = torch.zeros(3 + self._blocks(n), dtype=torch.int64, device=new.device)
        idx = torch.empty(cap, dtype=torch.int32, device=new.device)
        self._launch(f"delta_encode_{g}", n, (
            new.data_ptr(), base.data_ptr(), out.data_ptr(), n, vo, (out.numel() - vo) // g,
            idx.data_ptr(), cap, state.data_ptr()), new.device)
        check, changed = (int(x) for x in state[1:3].tolist())
        if changed > delta.dense_after(nbytes, g):
            return delta.Encoded(delta.DENSE, nbytes, changed)
        if changed == 0:
            return delta.Encoded(delta.SAME, 0, 0, delta.as_signed64(check))
        kind, size = delta.encoded_bytes(nbytes, g, changed)
        if kind == delta.INDEX:
            vals = out[vo:vo + changed * g].clone()
            at = changed * delta.INDEX_BYTES
            out[:at].copy_(idx[:changed].view(torch.uint8))
            out[at:delta.round_up(at, g)].zero_()
            out[delta.round_up(at, g):size].copy_(vals)
        return delta.Encoded(kind, size, changed, delta.as_signed64(check), out[:size])

    def apply(self, kind: int, payload: Optional[torch.Tensor], into: torch.Tensor,
              g: int) -> int:
        """As `delta.HostCodec.apply`, on a packed CUDA bucket."""
        if kind != delta.MASK:
            return delta.TorchCodec().apply(kind, payload, into, g)
        n = into.numel() // g
        head = (n + 7) // 8
        vo = delta.round_up(head, g)
        if payload.numel() < vo or (payload.numel() - vo) % g:
            raise ValueError(f"a mask delta payload of {payload.numel()} bytes does not fit a "
                             f"{into.numel()}-byte bucket of {g}-byte granules")
        n_vals = (payload.numel() - vo) // g
        table = self._pop.get(into.device)
        if table is None:
            table = self._pop[into.device] = torch.tensor(_POPCOUNT, device=into.device)
        bits = payload[:head].long()
        if n % 8:
            bits[-1] &= (1 << (n % 8)) - 1
        placed = int(table[bits].sum())
        if placed != n_vals:
            raise ValueError(f"delta payload holds {n_vals} values, its mask {placed}")
        state = torch.zeros(3 + self._blocks(n), dtype=torch.int64, device=into.device)
        self._launch(f"delta_apply_{g}", n, (into.data_ptr(), payload.data_ptr(), n, vo,
                                             n_vals, state.data_ptr()), into.device)
        return delta.as_signed64(int(state[1]))


def codec() -> Optional[CudaCodec]:
    """The process's CUDA codec, or None (no CUDA, no cupy, or the kernel does not compile
    here: see `why_not`; GPUs then use torch ops, and a warning says why once)."""
    global _CODEC, _FAILED
    if _CODEC is None and _FAILED is None:
        if not torch.cuda.is_available():
            _FAILED = "CUDA is not available"
        else:
            try:
                _CODEC = CudaCodec()
            except ImportError as e:
                _FAILED = f"cupy is not installed (the gpu extra): {e}"
            except Exception as e:
                _FAILED = f"the delta kernel does not compile here: {type(e).__name__}: {e}"
            if _FAILED is not None:
                warnings.warn(f"ray_reshard: the delta codec runs torch ops on the GPU: "
                              f"{_FAILED}", RuntimeWarning, stacklevel=2)
    return _CODEC


def why_not() -> Optional[str]:
    codec()
    return _FAILED
