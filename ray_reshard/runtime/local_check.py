"""Checking a process's local tensors against its installed program: every shard's view,
every problem named (nothing written), reused while the tensors keep their memory."""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch

from ..execution.overlap import overlapping_pairs, overlaps_itself
from ..layout import quant
from .process_state import InstalledProgram, ProcessGroup


class UserCodeFailed(Exception):
    """The user's tensor lookup (`tensors(actor)` or `actor.reshard_tensors()`) raised: a fault
    of that process (OOM, a bug, a lost device), not a spec that does not match its tensors.
    The exception it raised is the `__cause__`."""

    def __init__(self, what: str, error: BaseException):
        super().__init__(f"{what} raised {type(error).__name__}: {error}")
        self.what = what


def local_tensors(actor, wg: ProcessGroup) -> dict:
    """The actor's local tensors, looked up anew (trainers rebind parameter storage)."""
    if wg.tensors_fn is not None:
        call, what = (lambda: wg.tensors_fn(actor)), "tensors(actor)"
    elif hasattr(actor, "reshard_tensors"):
        call, what = actor.reshard_tensors, f"{type(actor).__name__}.reshard_tensors()"
    else:
        raise TypeError(f"{type(actor).__name__} has no reshard_tensors() method and the group "
                        f"was built without tensors=")
    try:
        got = call()
    except Exception as e:
        raise UserCodeFailed(what, e) from e
    if not isinstance(got, dict):
        raise TypeError(f"tensors of {type(actor).__name__} must be a dict name -> tensor, "
                        f"got {type(got).__name__}")
    return got


try:        # torch's own C++ check of tensors' metadata (written for compiled graphs' guards)
    from torch._C._dynamo.guards import TensorGuards
except ImportError:                                   # pragma: no cover - older or other builds
    TensorGuards = None


class StorageSignature:
    """What the local tensors `names` of a storage dict looked like: their memory (addresses)
    and layout (dtype, device, sizes, strides). A signature that still matches means the shard
    views cut from them last time are the same memory, so a refit's check costs one match per
    local tensor (and a copy of the view table).

    Addresses alone tell memory apart: torch resizes a storage by allocating the new memory
    before it frees the old (and leaves none behind a storage resized to 0), so a storage that
    shrank, grew or was freed no longer has the address it had."""

    __slots__ = ("names", "pick", "guards", "layout", "memory")

    def __init__(self, storage: dict, names: tuple):
        self.names = names
        # one C call for the lookup; a missing name raises KeyError (a mismatch)
        self.pick = (operator.itemgetter(*names) if len(names) > 1 else
                     lambda st: tuple(st[n] for n in names))
        tensors = [storage.get(n) for n in names]
        self.guards = None
        if TensorGuards is not None and all(isinstance(x, torch.Tensor) for x in tensors):
            try:
                self.guards = TensorGuards(*tensors, dynamic_dims_sizes=None,
                                           dynamic_dims_strides=None)
            except Exception:                 # pragma: no cover - another torch's signature
                self.guards = None
        if self.guards is not None:
            self.layout, self.memory = None, memory_of(tensors)
        else:
            self.layout, self.memory = described(tensors), None

    def matches(self, storage: dict) -> bool:
        try:
            tensors = self.pick(storage)
            if self.guards is None:
                return described(tensors) == self.layout
            # the guards check each is a tensor of the same type, dtype, device, sizes, strides
            return self.guards.check(*tensors) and memory_of(tensors) == self.memory
        except Exception:                     # a name gone, or not a tensor: look again
            return False


def memory_of(tensors) -> tuple:
    """The tensors' addresses (see `StorageSignature`)."""
    return tuple(map(torch.Tensor.data_ptr, tensors))


def described(tensors) -> list:
    """Everything a signature compares, in Python (where torch's guards are not available)."""
    return [(x.data_ptr(), x.dtype, x.device, x.shape, x.stride())
            if isinstance(x, torch.Tensor) else type(x) for x in tensors]


def shard_views(actor, wg: ProcessGroup, prog: InstalledProgram, sources: bool = True
           ) -> tuple[dict, list[str], list, Any]:
    """(side, rank, tensor) -> shard view, every problem found (nothing is written), the
    source shards that share memory with a destination shard of this process, and a token
    naming these view objects (the same while they are reused). Validation runs in full only
    when a local tensor changed memory or layout since the last one that passed. With
    `sources` False only destination shards are looked at (an overlapped refit sends the
    sources' captured copies)."""
    shards = prog.shards if sources else [sh for sh in prog.shards if sh.key[0] == "dst"]
    if not shards:                    # sources captured, no destination here: nothing live
        return {}, [], [], None
    storage = local_tensors(actor, wg)
    checked = prog.checked if sources else prog.checked_dst
    if checked is not None and checked[0].matches(storage):
        return dict(checked[1]), [], checked[2], checked[3]
    views, errors = {}, []
    plan = prog.plan
    for sh in shards:
        side, rank, ti = sh.key
        slot, spec = sh.slot, sh.spec
        where = f"{sh.name!r} on {side} rank {rank}"
        base = storage.get(slot.storage)
        if base is None:
            errors.append(f"{where}: no local tensor {slot.storage!r}")
            continue
        if not isinstance(base, torch.Tensor):
            errors.append(f"{where}: local {slot.storage!r} is a {type(base).__name__}, not a tensor")
            continue
        if base.dtype != sh.dtype:
            errors.append(f"{where}: local {slot.storage!r} has dtype {base.dtype}, expected "
                          f"{sh.dtype}")
            continue
        if base.device.type != wg.device.type:
            errors.append(f"{where}: local {slot.storage!r} is on {base.device}, expected {wg.device}")
            continue
        try:
            view = slot.view(base, sh.sizes)
        except (IndexError, RuntimeError) as e:
            errors.append(f"{where}: cannot place shard {sh.sizes} in local {slot.storage!r} of "
                          f"shape {tuple(base.shape)} at {slot}: {e}")
            continue
        if tuple(view.shape) != sh.sizes:
            box = spec.layout(side).box(rank, spec.shape)
            errors.append(f"{where}: local shard has shape {tuple(view.shape)}, expected "
                          f"{sh.sizes} (global {spec.shape}, box {box})")
            continue
        freed = memory_problem(view)
        if freed:
            errors.append(f"{where}: local {slot.storage!r} {freed}")
            continue
        if side == "dst" and overlaps_itself(view):
            errors.append(f"{where}: its shard in local {slot.storage!r} (shape "
                          f"{tuple(view.shape)}, strides {tuple(view.stride())}) overlaps itself "
                          f"(elements share memory), so it cannot be written")
            continue
        views[sh.key] = view
        if side == "dst" and spec.quant is not None:       # block FP8: the scales beside it
            scales, problem = quant.scale_view(spec, sh.name, rank, storage, wg.device.type)
            if scales is None:
                errors.append(f"{where}: {problem}")
                continue
            freed = memory_problem(scales)
            if freed:
                errors.append(f"{where}: the local tensor of its {spec.quant!r} scales {freed}")
                continue
            views[(side, rank, ti, quant.SCALE)] = scales
    dst_keys = [k for k in views if k[0] == "dst"]
    if len(dst_keys) > 1:
        for i, j in overlapping_pairs([views[k] for k in dst_keys]):
            (ra, ta), tb = dst_keys[i][1:3], dst_keys[j][2]
            errors.append(f"{plan.names[ta]!r} and {plan.names[tb]!r} on dst rank {ra}: their "
                          f"local shards share memory, so one would overwrite the other")
    if errors:
        return views, errors, [], None
    aliased = aliased_sources(views)
    token = object()
    sig = StorageSignature(storage, prog.storages if sources else prog.dst_storages)
    if sources:
        prog.checked = (sig, dict(views), aliased, token)
    else:
        prog.checked_dst = (sig, dict(views), aliased, token)
    return views, errors, aliased, token


def memory_problem(view: torch.Tensor) -> str:
    """What is missing behind `view` ("" when its memory is all there): a tensor whose
    storage was freed or shrunk (`untyped_storage().resize_(0)`, as FSDP frees unsharded
    parameters) keeps its shape, but reading or writing it fails part-way through a refit."""
    if view.numel() == 0:
        return ""
    last = view.storage_offset() + sum((n - 1) * st for n, st in zip(view.shape, view.stride()))
    need = (last + 1) * view.element_size()
    have = view.untyped_storage().nbytes()
    if have >= need:
        return ""
    return (f"has no memory behind its shard: its storage holds {have} bytes, the shard needs "
            f"{need} (freed, e.g. by untyped_storage().resize_(0) as FSDP frees unsharded "
            f"parameters; reallocate it before the refit)")


def check_tensors(actor, wg: ProcessGroup, prog: InstalledProgram, sources: bool = True
           ) -> tuple[dict, list[str], list, Any, Optional[dict]]:
    """`_views`, plus the fault of a user's lookup that raised (None if none): a lookup that
    returns something unusable is a problem like any other, one that raises is a fault."""
    ranks = ", ".join(f"{ep.side} rank {ep.rank}"
                      for ep in sorted(wg.endpoints, key=lambda ep: (ep.side != "src", ep.rank)))
    try:
        return (*shard_views(actor, wg, prog, sources), None)
    except UserCodeFailed as e:
        return {}, [], [], None, fault_of(e.__cause__, f"process {wg.pid} ({ranks}): {e}")
    except Exception as e:
        return {}, [f"process {wg.pid} ({ranks}): looking up local tensors failed: "
                    f"{type(e).__name__}: {e}"], [], None, None


def fault_of(error: BaseException, text: str) -> dict:
    """A fault as the driver gets it: its text, and the exception itself when it pickles (else
    a RuntimeError with its type, text and traceback)."""
    import traceback

    from ray import cloudpickle
    try:
        cloudpickle.loads(cloudpickle.dumps(error))
        shipped = error
    except Exception:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        shipped = RuntimeError(f"{type(error).__name__}: {error}\n{tb}")
    return {"text": text, "error": shipped}


def aliased_sources(views: dict) -> list:
    """Keys of source shards that share memory with a destination shard of this process
    (colocated refits: the same actor on both sides, writing where it reads)."""
    src_keys = [k for k in views if k[0] == "src"]
    dst_keys = [k for k in views if k[0] == "dst"]
    if not src_keys or not dst_keys:
        return []
    pairs = overlapping_pairs([views[k] for k in src_keys], [views[k] for k in dst_keys])
    return sorted({src_keys[i] for i, _ in pairs})

