"""What a group leaves in each member's process: its collective group, rings, installed
programs (this process's part of a plan) and version, by group id (`GROUPS`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..errors import GroupStateLost
from ..planning.plan import Plan

GROUPS: dict[str, "ProcessGroup"] = {}


def group_state(group_id: str) -> "ProcessGroup":
    wg = GROUPS.get(group_id)
    if wg is None:
        raise GroupStateLost(
            f"process {os.getpid()} holds no state for reshard group {group_id[:12]}: the actor "
            f"restarted (Ray max_restarts) or left the group, and lost its collective group and "
            f"programs; call ReshardGroup.update() (same or replacement actors) to rebuild them")
    return wg


class Shard:
    """One shard this process holds in a program: where it lives and what it must look like
    (one per held tensor: tens of thousands at scale, hence slots and a plain constructor)."""

    __slots__ = ("key", "name", "spec", "slot", "sizes", "dtype")

    def __init__(self, key: tuple, name: str, spec: Any, slot: Any, sizes: tuple,
                 dtype: torch.dtype):
        self.key = key                    # (side, rank, tensor)
        self.name = name
        self.spec = spec
        self.slot = slot
        self.sizes = sizes
        self.dtype = dtype


@dataclass
class InstalledProgram:
    plan: Plan
    held: list[tuple[str, int, int]]      # (side, rank, tensor) shards this process holds
    strategy: Any = None                  # the strategy object (strategies.STRATEGIES)
    compiled: Any = None                  # what the strategy compiled for this process
    shards: list = field(default_factory=list)
    storages: tuple = ()                  # local tensor names the shards live in
    # The last validation that found no problem: (what the local tensors looked like, shard
    # views, aliased source keys). Reused while every local tensor keeps its memory and layout.
    checked: Any = None
    dst_storages: tuple = ()              # local tensor names the destination shards live in
    checked_dst: Any = None               # `checked` of the destination shards alone
    nbytes: int = 0                       # memory of its objects, once measured (program_bytes)
    baselines: Any = None                 # delta refits: what it sent last (delta.Baselines)


@dataclass
class ProcessGroup:
    group_id: str
    group_name: str
    pid: int
    endpoints: frozenset
    ep_pid: dict
    device: torch.device
    tensors_fn: Optional[Callable]
    bucket_bytes: int
    pg: Any = None
    window: Optional[int] = None      # network buckets in flight (None: from bucket_bytes)
    rings_out: dict = field(default_factory=dict)
    rings_in: dict = field(default_factory=dict)
    programs: dict = field(default_factory=dict)
    version: int = 0
    staged: Any = None                # (version, [(destination view, staged copy)]) until commit
    # After an atomic commit, until the driver confirms every destination committed: the
    # version before it and the (destination view, its old contents) pairs to roll back to.
    undo: Any = None
    captured: Any = None              # (program key, {source key: copy}) for an overlapped refit
    # A non-atomic refit this process finished: it becomes `version` once the driver says every
    # process finished it (the `committed` argument of the next call), so one call per refit.
    done: Optional[int] = None
    # The version whose bytes this process's destination shards hold, as far as delta refits
    # are concerned: None when not known (joined, a refit failed part-way or is running).
    held: Optional[int] = None


def object_bytes(root) -> int:
    """Bytes of the Python objects reachable from `root` (each counted once). Tensors count
    as objects only (their memory is the user's or counted apart); classes, modules, functions
    and the group's shared state (transports, the worker group) are not followed."""
    import gc
    import sys
    import types
    stop = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
            types.MethodType, ProcessGroup)
    seen, stack, total = set(), [root], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, stop):
            continue
        seen.add(id(o))
        mod = type(o).__module__ or ""
        if mod.startswith(__package__ + ".transport"):
            continue
        total += sys.getsizeof(o)
        if not isinstance(o, torch.Tensor):
            stack.extend(gc.get_referents(o))
    return total


def program_bytes(prog: InstalledProgram) -> int:
    """Memory one installed program holds in this process: its objects (the plan it was
    compiled from, the compiled steps, the shard table; measured once, a walk over them that
    costs about as much as compiling) and the buffers its runs allocated (block-FP8 shards
    quantised on arrival keep a source-dtype buffer)."""
    if not prog.nbytes:
        prog.nbytes = object_bytes(prog)
    finishers = getattr(prog.compiled, "finishers", None) or ()
    return prog.nbytes + sum(f.buffer.untyped_storage().nbytes() for f in finishers
                             if f.buffer is not None)


def hold_state(group_id: str, pid: int, ep_pid: dict, bucket_bytes: int,
               device: str = "cpu") -> None:
    """Hold a group's per-process state without joining a collective group: enough for
    `install` to run on its own in this process (benchmarks timing a first refit's install)."""
    eps = frozenset(ep for ep, p in ep_pid.items() if p == pid)
    GROUPS[group_id] = ProcessGroup(group_id, "", pid, eps, dict(ep_pid), torch.device(device),
                                     None, bucket_bytes)
