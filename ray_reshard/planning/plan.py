"""The Plan: every tensor's moves and the statistics; `plan()` builds it from a spec set."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from functools import cached_property
from array import array
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from .._gc import gc_paused
from ..layout.slots import pack_slot_tables, unpack_slot_tables
from ..layout.spec import TensorSpec
from .canonical import plan_tensor
from .moves import Endpoint, Move, PlanError, Topology
from .tensor_plan import TensorPlan
from .schedule import (DEADLINE_EVERY, Schedule, build_schedule, check_deadline,
                       network_turns)

DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class PlanStats:
    """Byte counts of a whole plan (destination dtype)."""

    total_bytes: int                 # bytes of all logical tensors (one copy)
    network_bytes: int               # crossing between domains
    domain_bytes: int                # inside a domain, between devices (NVLink / shared memory)
    local_bytes: int                 # same device or process
    min_network_bytes: int           # the lower bound, computed independently of the plan
    gather_broadcast_bytes: int      # bytes received under all-gather + broadcast
    max_send_bytes: int              # network bytes sent by the busiest source rank
    max_recv_bytes: int              # network bytes received by the busiest destination rank
    n_tensors: int
    n_moves: int
    n_signatures: int

    def summary(self) -> str:
        gb = lambda b: f"{b / 1e9:.3f} GB"
        ratio = (self.gather_broadcast_bytes / self.network_bytes) if self.network_bytes else float("inf")
        return "\n".join([
            f"tensors {self.n_tensors} ({self.n_signatures} distinct plans), "
            f"{gb(self.total_bytes)} of weights, {self.n_moves} moves",
            f"network {gb(self.network_bytes)} (lower bound {gb(self.min_network_bytes)}), "
            f"domain {gb(self.domain_bytes)}, local {gb(self.local_bytes)}",
            f"busiest source sends {gb(self.max_send_bytes)}, "
            f"busiest destination receives {gb(self.max_recv_bytes)}",
            f"gather-broadcast would move {gb(self.gather_broadcast_bytes)} "
            f"({ratio:.1f}x the network bytes)",
        ])

    def to_dict(self) -> dict:
        return asdict(self)

    def to_arrow(self):
        """`to_dict()` as a one-row pyarrow Table."""
        import pyarrow as pa
        return pa.Table.from_pylist([self.to_dict()])


class Plan:
    """A validated refit plan over named tensors. Build it with `plan()`."""

    def __init__(self, specs: Mapping[str, TensorSpec], topology: Topology,
                 tensor_plans: Sequence[TensorPlan]):
        self.names: tuple[str, ...] = tuple(specs)
        self._specs: tuple[TensorSpec, ...] = tuple(specs[n] for n in self.names)
        self.topology = topology
        self.tensor_plans: tuple[TensorPlan, ...] = tuple(tensor_plans)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The TensorSpecs, in `names` order."""
        sp = self.__dict__.get("_specs")
        if sp is None:
            with gc_paused(keep=True):        # tens of thousands of acyclic objects
                sp = self._specs = _unpack_specs(self.__dict__.pop("_spec_columns"))
        return sp

    def localize(self, endpoints: Iterable[Endpoint]) -> None:
        """Prepare a shipped plan for a process that holds only `endpoints` (unpacks the specs;
        slot tables stay compact, so every rank's share is as cheap as one rank's). No effect
        on a plan whose specs are unpacked."""
        self.specs

    @cached_property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @cached_property
    def distinct_plans(self) -> list[tuple[TensorPlan, int, int]]:
        """Each distinct TensorPlan, the number of tensors that use it and the first of them."""
        counts: dict[int, list] = {}
        for ti, tp in enumerate(self.tensor_plans):
            c = counts.get(id(tp))
            if c is None:
                counts[id(tp)] = [tp, 1, ti]
            else:
                c[1] += 1
        return [(tp, n, first) for tp, n, first in counts.values()]

    @cached_property
    def stats(self) -> PlanStats:
        tot = defaultdict(int)
        distinct = self.distinct_plans
        for tp, n, _ in distinct:
            s = tp.totals
            numel = 1
            for d in tp.shape:
                numel *= d
            tot["total"] += n * numel * tp.itemsize
            tot["network"] += n * s.network_bytes
            tot["domain"] += n * s.domain_bytes
            tot["local"] += n * s.local_bytes
            tot["min"] += n * s.min_network_bytes
            tot["gb"] += n * s.gather_broadcast_bytes
            tot["moves"] += n * tp.n_moves
        send, recv = self.send_bytes_by_rank, self.recv_bytes_by_rank
        return PlanStats(
            total_bytes=tot["total"], network_bytes=tot["network"], domain_bytes=tot["domain"],
            local_bytes=tot["local"], min_network_bytes=tot["min"],
            gather_broadcast_bytes=tot["gb"], max_send_bytes=max(send.values(), default=0),
            max_recv_bytes=max(recv.values(), default=0), n_tensors=len(self.names),
            n_moves=tot["moves"], n_signatures=len(distinct))

    @cached_property
    def send_bytes_by_rank(self) -> dict[int, int]:
        return self._network_bytes_by_rank(0, self.topology.n_src)

    @cached_property
    def recv_bytes_by_rank(self) -> dict[int, int]:
        return self._network_bytes_by_rank(1, self.topology.n_dst)

    def _network_bytes_by_rank(self, which: int, n: int) -> dict[int, int]:
        """rank -> network bytes it sends (which=0) or receives (which=1), ranks with some."""
        out = np.zeros(n, dtype=np.int64)
        for tp, count, _ in self.distinct_plans:
            ranks, nbytes = tp.network_bytes_arrays()[which]
            np.add.at(out, ranks, nbytes * count)
        return {int(r): int(out[r]) for r in np.flatnonzero(out)}

    def for_rank(self, side: str, rank: int) -> dict[str, tuple[Move, ...]]:
        """The moves (by tensor name) that rank `rank` of `side` sends or receives."""
        ep = Endpoint(side, rank)
        out = {}
        for name, tp in zip(self.names, self.tensor_plans):
            ms = tp.moves_for(ep)
            if ms:
                out[name] = ms
        return out

    def summary(self) -> str:
        return self.stats.summary()

    def __repr__(self) -> str:
        s = self.stats
        return (f"<Plan {s.n_tensors} tensors, network {s.network_bytes} B "
                f"(bound {s.min_network_bytes} B), domain {s.domain_bytes} B, "
                f"local {s.local_bytes} B>")

    def __getstate__(self):
        # Schedules are caches, often far larger than the plan: rebuild them where needed.
        # Network turns are small and need the whole plan's pairs: they travel along.
        # Specs travel as columns (see `_pack_specs`).
        state = {k: v for k, v in self.__dict__.items()
                 if k in ("names", "topology", "tensor_plans", "_turns")}
        if "_spec_columns" in self.__dict__:     # shipped on without being unpacked
            state["spec_columns"] = self.__dict__["_spec_columns"]
            return state
        state["spec_columns"] = _pack_specs(self.specs)
        return state

    def __reduce__(self):
        # The state goes to the caller's pickler (Ray's cloudpickle ships classes defined in
        # a driver script or test module by value; a plain inner pickle would not). Callers
        # shipping a large plan pause the cyclic collector around it (`gc_paused`).
        return (_load_plan, (self.__getstate__(),))

    def __setstate__(self, state):
        # Specs are unpacked on first use (all ranks' slots) or by localize() (this process's).
        self._spec_columns = state.pop("spec_columns")
        self.__dict__.update(state)

    def network_turns(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      deadline: Optional[float] = None) -> Optional[dict]:
        """{(source rank, destination rank): the turns of that network pair's buckets} for
        buckets of `bucket_bytes`, or None (see `schedule.network_turns`); cached, and shipped
        with the plan once computed, so the processes compiling their shares do not each
        compute it. Past `deadline` it stops with PlanTimeout."""
        cache = self.__dict__.setdefault("_turns", {})
        if bucket_bytes not in cache:
            cache[bucket_bytes] = network_turns(self, bucket_bytes, deadline)
        return cache[bucket_bytes]

    def schedule(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> "Schedule":
        """Buckets of at most `bucket_bytes` in one deadlock-free global order (cached)."""
        cache = self.__dict__.setdefault("_schedules", {})
        if bucket_bytes not in cache:
            cache[bucket_bytes] = build_schedule(self, bucket_bytes)
        return cache[bucket_bytes]


def _load_plan(state: dict) -> "Plan":
    p = Plan.__new__(Plan)
    p.__setstate__(state)
    return p


def _pack_specs(specs: Sequence[TensorSpec]) -> tuple:
    """Specs as columns: each distinct (shape, dtype, layouts, source dtype, quant) once, and per
    spec its index, and the slot tables (see `pack_slot_tables`)."""
    kinds: dict = {}
    kind_of, src_slots, dst_slots = [], [], []
    for sp in specs:
        k = (sp.shape, sp.dtype, id(sp.src), id(sp.dst), sp.src_dtype, sp.quant)
        i = kinds.get(k)
        if i is None:
            i = kinds[k] = len(kinds)
        kind_of.append(i)
        src_slots.append(sp.src_slots)
        dst_slots.append(sp.dst_slots)
    by_id = {id(sp.src): sp.src for sp in specs}
    by_id.update((id(sp.dst), sp.dst) for sp in specs)
    table = [(shape, dtype, by_id[s], by_id[d], sdt, q) for (shape, dtype, s, d, sdt, q) in kinds]
    return table, array("I", kind_of), pack_slot_tables(src_slots), pack_slot_tables(dst_slots)


_new = object.__new__


def _unpack_specs(columns) -> tuple[TensorSpec, ...]:
    """TensorSpecs from `_pack_specs` columns, built from validated fields (no re-validation:
    they were checked when planned)."""
    table, kind_of, src_slots, dst_slots = columns
    src_slots, dst_slots = unpack_slot_tables(src_slots), unpack_slot_tables(dst_slots)
    # per kind, its fields (in declaration order): each spec copies them, then sets its tables
    kinds = [dict(shape=shape, dtype=dtype, src=src, dst=dst, src_dtype=sdt, src_slots=None,
                  dst_slots=None, quant=quant)
             for shape, dtype, src, dst, sdt, quant in table]
    out = []
    append = out.append
    for k, ss, ds in zip(kind_of, src_slots, dst_slots):
        sp = _new(TensorSpec)
        d = sp.__dict__
        d.update(kinds[k])
        d["src_slots"] = ss
        d["dst_slots"] = ds
        append(sp)
    return tuple(out)


def plan(specs: Mapping[str, TensorSpec], src_domains: Optional[Sequence[Any]] = None,
         dst_domains: Optional[Sequence[Any]] = None, *, src_devices: Optional[Sequence[Any]] = None,
         dst_devices: Optional[Sequence[Any]] = None, n_src: Optional[int] = None,
         n_dst: Optional[int] = None, deadline: Optional[float] = None) -> Plan:
    """Plan a refit of `specs` (name -> TensorSpec).

    `src_domains[i]` / `dst_domains[j]` name the NVLink domain of source rank i / destination
    rank j (equal ids on both sides = one domain); without them every rank is its own domain.
    `*_devices` name devices the same way (equal ids = same device: a local copy). The number of
    ranks per side comes from the domain lists, else from `n_src`/`n_dst`, else the meshes.
    Past `deadline` (a `time.monotonic()` value) planning stops with PlanTimeout.
    """
    check_spec_set(specs)
    src_domains, dst_domains, src_devices, dst_devices = (
        None if v is None else tuple(v) for v in (src_domains, dst_domains, src_devices, dst_devices))
    n_src = _side_size("src", specs, src_domains, src_devices, n_src)
    n_dst = _side_size("dst", specs, dst_domains, dst_devices, n_dst)
    topo = Topology.make(n_src, n_dst, src_domains, dst_domains, src_devices, dst_devices)
    # Specs usually share their layout objects: remember what was planned per (shape, dtype,
    # layout objects, slot tables' ranks) so that each tensor costs a dict lookup. The specs
    # stay alive during the loop, so the ids are not reused; slot tables are keyed by their
    # rank tuples' identity (hashing them per tensor dominated planning at scale; recipes give
    # each tensor its own table but share the rank tuples). Where a slot sits matters to a
    # quantised spec's validation only, which is checked for every such spec.
    seen: dict = {}
    checked: set = set()                 # layouts and slot tables found valid (by identity)
    tensor_plans = []
    turns: dict = defaultdict(int)       # src layout -> tensors given a rotation so far
    # Planning allocates only acyclic objects (hundreds of thousands of moves at scale): the
    # cyclic collector would rescan the growing heap again and again for nothing.
    with gc_paused(keep=True):
        for i, (name, spec) in enumerate(specs.items()):
            if deadline is not None and not i % DEADLINE_EVERY:
                check_deadline(deadline, f"planning ({i} of {len(specs)} tensors planned)")
            ss, ds, quant = spec.src_slots, spec.dst_slots, spec.quant
            key = (spec.shape, spec.dtype, id(spec.src), id(spec.dst),
                   None if ss is None else id(ss.ranks), None if ds is None else id(ds.ranks),
                   quant and (quant, spec.source_dtype))
            tp = seen.get(key)
            try:
                if tp is None:
                    spec.validate(name, checked)
                    tp = seen[key] = plan_tensor(spec.signature, topo)
                elif quant is not None:
                    spec.validate(name, checked)      # where its slots sit
                if tp.rotations > 1:
                    # Small tensors leave some source replicas idle: rotate which ones work
                    # across the tensors sharing the source layout.
                    turn = turns[spec.src]
                    turns[spec.src] = turn + 1
                    if turn % tp.rotations:
                        tp = plan_tensor(spec.signature, topo, turn % tp.rotations)
            except PlanError as e:
                raise PlanError(f"{name!r}: {e}") from None
            tensor_plans.append(tp)
    return Plan(specs, topo, tensor_plans)


def check_spec_set(specs: Mapping[str, TensorSpec]) -> None:
    """Raise unless `specs` is a non-empty mapping of non-empty names to TensorSpecs."""
    if not isinstance(specs, Mapping):
        raise TypeError(f"specs must be a mapping of name -> TensorSpec, got {type(specs).__name__}")
    if not specs:
        raise ValueError("empty spec set: nothing to refit")
    for name, spec in specs.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"{name!r}: expected a TensorSpec, got {type(spec).__name__}")


def _side_size(side, specs, domains, devices, n) -> int:
    top = -1
    seen_layouts = set()
    for name, spec in specs.items():
        lay = spec.src if side == "src" else spec.dst
        if id(lay) in seen_layouts:
            continue
        seen_layouts.add(id(lay))
        r = max(lay.mesh.ranks)
        if r > top:
            top, top_name = r, name
    n_from = f"n_{side}={n}"
    for given, what in ((domains, f"{side}_domains"), (devices, f"{side}_devices")):
        if given is not None:
            if n is not None and len(given) != n:
                raise ValueError(f"{what} has {len(given)} entries but {n_from}: give one entry "
                                 f"per {side} rank")
            n = len(given)
            n_from = f"{what} has {n}"
    if n is None:
        return top + 1
    if top >= n:
        raise ValueError(f"{top_name!r}: the {side} mesh uses rank {top}, but the {side} side "
                         f"has only {n} ranks (0..{n - 1})")
    return n
