"""Which delta codec runs where (the host kernel in host memory, the CUDA kernel on CUDA
devices, torch ops where neither can run), and encoding or applying one bucket through the codec
of its device. The format itself is `delta`'s."""
from __future__ import annotations

from typing import Optional

import torch

from . import delta, delta_cuda, delta_host

TORCH = delta.TorchCodec()
_HOST: Optional[delta.HostCodec] = None


def host_codec() -> Optional[delta.HostCodec]:
    """The host kernel's codec, or None where it cannot be built (see `delta_host.why_not`)."""
    global _HOST
    if _HOST is None:
        k = delta_host.kernel()
        if k is not None:
            _HOST = delta.HostCodec(k)
    return _HOST


def codec_for(device: torch.device):
    """The codec for buckets on `device`: the host kernel in host memory, the CUDA kernel
    (`delta_cuda`) on CUDA devices, torch ops where they cannot run."""
    if device.type == "cpu":
        return host_codec() or TORCH
    if device.type == "cuda":
        return delta_cuda.codec() or TORCH
    return TORCH


def encode(new: torch.Tensor, base: torch.Tensor, g: int) -> delta.Encoded:
    """Encode `new` against `base` (uint8, one bucket each) with the codec of their device,
    into a new output buffer; `base` then holds the new bytes."""
    codec = codec_for(new.device)
    out = torch.empty(new.numel(), dtype=torch.uint8, device=new.device)
    return codec.encode(new, base, out, g, probe=new.device.type == "cpu")


def decode(kind: int, payload: Optional[torch.Tensor], into: torch.Tensor, g: int) -> int:
    """Apply a payload onto `into` (the baseline's bytes, uint8) in place with the codec of
    its device; returns the checksum of the result."""
    return codec_for(into.device).apply(kind, payload, into, g)
