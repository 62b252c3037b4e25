"""Torch's and NCCL's exceptions read as TransportError / TransportTimeout, with a one-line
cause that keeps NCCL's "Last error" (which the first line alone would lose)."""
from __future__ import annotations

import torch

from ...errors import TransportError, TransportTimeout

__all__ = ["cause", "transport_error", "gpu_name"]


def cause(e: BaseException) -> str:
    """An exception's message on one line, with its most telling parts first: NCCL puts the
    reason after a "Last error:" line, which the first line alone would lose."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    picked = [lines[0]]
    for i, ln in enumerate(lines[1:], 1):
        if ln.lower().startswith("last error"):
            rest = ln.split(":", 1)[1].strip() if ":" in ln else ""
            picked.append(rest or (lines[i + 1] if i + 1 < len(lines) else ""))
        elif ln.lower().startswith(("nccl", "cuda error")):
            picked.append(ln)
    return " | ".join(p for p in picked if p)[:600]


def transport_error(what: str, e: BaseException) -> TransportError:
    """`e` (a failed or timed-out operation) as the error to raise for `what`."""
    msg = str(e)
    if "Timed out" in msg or "timeout" in msg.lower():
        return TransportTimeout(f"{what}: timed out ({cause(e)})")
    return TransportError(f"{what}: {cause(e)}")


def gpu_name(device) -> str:
    """`device`'s name and uuid, for an error that names the GPU."""
    try:
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, uuid {p.uuid}"
    except Exception:
        return "unknown GPU"
