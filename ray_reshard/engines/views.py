"""Reaching an inference engine's worker processes from Ray, without importing the engine.

A ReshardGroup moves bytes between Ray actors, but an engine's workers are not always Ray
actors: vLLM's multiprocessing executor runs them as child processes of the engine (the `LLM`
actor), and on CPU that is the only executor vLLM offers. For such a worker, a `WorkerView`
actor on the worker's node maps the worker's tensors into its own address space and stands in
for the worker in the group: bytes written through the view land in the worker's memory.

* CPU: the worker moves each exported tensor's storage into shared memory in place
  (``UntypedStorage._share_fd_cpu_``, the mechanism of ``torch.multiprocessing``: every tensor
  and view on that storage keeps its identity and follows it) and reports the file descriptor;
  the view opens it through ``/proc/<pid>/fd/<fd>`` and maps it shared. Nothing is left in
  ``/dev/shm``: the memory goes when the last process mapping it does.
* CUDA: ``torch.multiprocessing.reductions.reduce_tensor`` (CUDA IPC handles), rebuilt in the
  view. Not yet run on a GPU.

Also the per-process registry of transfers (`entry`, `local_tensors`): what each process
(trainer rank, engine worker, or view) holds under a transfer's key.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Mapping

import ray
import torch

# key -> {"tensors": callable (trainer storages), "engine": worker engine, "view": {name: t},
#         "rounds": {n: Event}, "errors": {n: str}}
_REGISTRY: dict[str, dict] = {}
_LOCK = threading.Lock()


def entry(key: str) -> dict:
    """This process's record of transfer `key` (created on first use)."""
    with _LOCK:
        return _REGISTRY.setdefault(key, {"rounds": {}, "errors": {}})


def lookup(key: str) -> dict:
    ent = _REGISTRY.get(key)
    if ent is None:
        raise RuntimeError(f"no ray_reshard weight transfer {key!r} in this process "
                           f"(pid {os.getpid()})")
    return ent


def local_tensors(key: str, actor=None) -> dict:
    """The tensors this process holds for transfer `key`: trainer storages, an engine worker's
    parameters and staging tensors, or the worker tensors a `WorkerView` maps. The `tensors`
    callable of the transfer's ReshardGroup."""
    ent = lookup(key)
    out: dict = {}
    if "tensors" in ent:
        out.update(ent["tensors"]())
    if "engine" in ent:
        out.update(ent["engine"].tensors(key))
    if "view" in ent:
        ent["view_check"]()
        out.update(ent["view"])
    return out


def forget(key: str, part: str) -> None:
    ent = _REGISTRY.get(key)
    if ent is not None:
        ent.pop(part, None)


# ------------------------------------------------------------------------ export and import
def export_tensors(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Descriptors from which another process on this node maps `tensors` (name -> tensor).
    CPU storages move into shared memory in place (see the module docstring)."""
    out = {}
    pid = os.getpid()
    for name, t in tensors.items():
        if t.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor
            out[name] = ("cuda", reduce_tensor(t)[1], pid)
            continue
        if t.device.type != "cpu":
            raise ValueError(f"{name}: cannot share a tensor on {t.device} with another process")
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            out[name] = ("empty", tuple(t.shape), str(t.dtype))
            continue
        fd, nbytes = storage._share_fd_cpu_()
        out[name] = ("cpu", pid, int(fd), int(nbytes), t.storage_offset(), tuple(t.shape),
                     tuple(t.stride()), str(t.dtype))
    return out


def exporter_pids(exported: Mapping[str, tuple]) -> set:
    """The processes whose memory `export_tensors` described."""
    return {d[1] if d[0] == "cpu" else d[2] for d in exported.values() if d[0] in ("cpu", "cuda")}


def process_start(pid: int):
    """The start time of process `pid` (clock ticks since boot), or None when it is gone or a
    zombie: with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):          # state: killed, not yet reaped
        return None
    return int(fields[19])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def import_tensors(exported: Mapping[str, tuple], _storages: dict | None = None) -> dict:
    """The tensors `export_tensors` described, mapped into this process (same memory)."""
    storages = {} if _storages is None else _storages
    out = {}
    for name, desc in exported.items():
        kind = desc[0]
        if kind == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor
            out[name] = rebuild_cuda_tensor(*desc[1])      # desc[2]: the exporting process
        elif kind == "empty":
            out[name] = torch.empty(desc[1], dtype=_dtype(desc[2]))
        elif kind == "cpu":
            _, pid, fd, nbytes, offset, shape, stride, dt = desc
            st = storages.get((pid, fd))
            if st is None:
                st = torch.UntypedStorage.from_file(f"/proc/{pid}/fd/{fd}", shared=True,
                                                    nbytes=nbytes)
                storages[(pid, fd)] = st
            out[name] = torch.empty(0, dtype=_dtype(dt)).set_(st, offset, shape, stride)
        else:
            raise ValueError(f"{name}: unknown tensor descriptor {kind!r}")
    return out


@ray.remote(num_cpus=0)
class WorkerView:
    """Stands in, in a ReshardGroup, for an engine worker that is not a Ray actor: it maps the
    worker's exported tensors (same memory) and offers them under the transfer's key."""

    def __init__(self, key: str, rank: int, exported: Mapping[str, tuple]):
        self.key, self.rank = key, rank
        self._storages: dict = {}
        self._owners: dict = {}
        self.tensors = import_tensors(exported, self._storages)
        self._watch(exported)
        ent = entry(key)
        ent["view"], ent["view_check"] = self.tensors, self.check

    def _watch(self, exported: Mapping[str, tuple]) -> None:
        for pid in exporter_pids(exported):
            self._owners.setdefault(pid, process_start(pid))

    def add(self, exported: Mapping[str, tuple]) -> None:
        """Map more of the worker's tensors (its staging tensors, once allocated)."""
        self.tensors.update(import_tensors(exported, self._storages))
        self._watch(exported)

    def check(self) -> None:
        """Raise unless every process whose memory this view maps is the one that exported it
        and still runs: writes into a dead worker's memory would reach nobody."""
        for pid, start in self._owners.items():
            if start is None or process_start(pid) != start:
                raise RuntimeError(f"engine worker {self.rank} (process {pid}) is gone: this "
                                   f"view maps memory no engine reads any more")

    def where(self) -> tuple:
        return ray.get_runtime_context().get_node_id(), os.getpid()


def current_actor_id() -> Any:
    """The id of the Ray actor this code runs in, or None outside one (or outside Ray)."""
    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_actor_id()
    except Exception:       # a process Ray does not run as a worker
        return None
