"""Device rules of the GPU paths, as plain functions (no CUDA needed, so tested anywhere).

- Which collective backend a group uses, given where each process runs.
- Which local device a process opens a peer's CUDA IPC buffer on. Ray gives each GPU actor
  CUDA_VISIBLE_DEVICES with only its own GPU, so the peer's GPU is usually invisible. CUDA maps
  IPC memory of an invisible device into the *current* device's address space through peer access
  (supported since CUDA 10.1; NCCL's P2P transport relies on it), so such a buffer is opened on
  the process's own device and reads and writes go over NVLink / PCIe.
- Whether torch's caching allocator runs with expandable segments (their memory is not shareable
  through the legacy CUDA IPC handles a ring publishes).
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["choose_backend", "shared_gpus", "ipc_open_device", "expandable_segments"]


def shared_gpus(proc_gpus: Sequence[Optional[str]]) -> dict:
    """GPU UUID -> the processes (indices) that share it, for GPUs with more than one."""
    by_gpu: dict = {}
    for p, g in enumerate(proc_gpus):
        if g is not None:
            by_gpu.setdefault(g, []).append(p)
    return {g: ps for g, ps in by_gpu.items() if len(ps) > 1}


def choose_backend(requested: str, proc_gpus: Sequence[Optional[str]],
                   on_gpu: Optional[Sequence[bool]] = None) -> str:
    """The collective backend of a group: "gloo" or "nccl".

    proc_gpus: per process, the UUID of its GPU (None: no GPU, or unknown). on_gpu: per process,
    whether its tensors are on a GPU (default: it has a GPU UUID).

    "auto" picks NCCL only when every process is on a GPU of its own; processes that share a GPU
    (fractional num_gpus) exchange through CUDA IPC on their node, and what crosses nodes goes
    over gloo, staged through pinned host memory. NCCL needs one rank per GPU: asking for it with
    a shared GPU, or with a process on CPU, is refused here, naming the processes.
    """
    on_gpu = [g is not None for g in proc_gpus] if on_gpu is None else list(on_gpu)
    shared = shared_gpus(proc_gpus)
    if requested == "auto":
        return "nccl" if on_gpu and all(on_gpu) and not shared else "gloo"
    if requested == "nccl":
        cpu = [p for p, g in enumerate(on_gpu) if not g]
        if cpu:
            raise ValueError(f"backend='nccl' needs every actor on a GPU; processes {cpu} have "
                             f"none")
        if shared:
            detail = "; ".join(f"processes {ps} share GPU {g}" for g, ps in shared.items())
            raise ValueError(f"backend='nccl' needs one process per GPU (NCCL refuses two ranks "
                             f"on one GPU): {detail}. Use backend='auto' or 'gloo': processes "
                             f"sharing a GPU exchange through CUDA IPC, other moves go over gloo")
        return "nccl"
    if requested == "gloo":
        return "gloo"
    raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {requested!r}")


def ipc_open_device(buffer_uuid: Optional[str], visible_uuids: Sequence[Optional[str]],
                    current: int) -> int:
    """The local device index to open a peer's CUDA IPC buffer on: the buffer's own GPU when this
    process sees it, else the current device (peer mapping of an invisible device)."""
    if buffer_uuid is not None:
        for i, u in enumerate(visible_uuids):
            if u == buffer_uuid:
                return i
    return current


def expandable_segments(conf: Optional[str]) -> bool:
    """Whether a PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF value turns expandable segments on
    (the last setting wins, as in torch's parser)."""
    on = False
    for part in (conf or "").split(","):
        key, _, value = part.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip().lower() == "true"
    return on
