"""A group's programs: plans cached per spec set, installed in every process, and the
shared-memory rings their schedules use between processes of one node (driver side)."""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Mapping, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from .._gc import gc_paused
from ..errors import RefitError
from ..layout.slots import Slot
from ..layout.spec import TensorSpec
from ..planning.plan import Plan, check_spec_set, plan as make_plan
from ..planning.schedule import PlanTimeout
from . import membership, worker

# Spec sets whose plans and programs a group keeps (least recently used beyond that go).
DEFAULT_MAX_PROGRAMS = 8


class ProgramCache:
    """The part of a ReshardGroup that keeps its programs (a mix-in of ReshardGroup). It owns
    `_plans`, `_installed`, `_program_bytes`, `_ring_users`, `_rings` and `_delta_ready`, which
    `_reset_programs` empties for each new membership."""

    def _reset_programs(self) -> None:
        # spec items -> (program id, plan); least recently used first
        self._plans: OrderedDict = OrderedDict()
        self._installed: set = set()
        self._program_bytes: dict = {}  # program id -> its memory over all processes (measured)
        self._ring_users: dict = {}     # ring pair -> program ids whose schedule uses it
        self._rings: dict = {}          # (sender pid, receiver pid) -> (ring name, slot bytes)
        self._delta_ready = False       # every process built its delta codec (prepare_delta)

    def plan(self, specs: Mapping[str, TensorSpec]) -> Plan:
        """The plan for `specs` on this group's topology (computed once per spec set)."""
        with self._lock:
            return self._cached_plan(specs)[1]

    def _cached_plan(self, specs: Mapping[str, TensorSpec],
                     deadline_of: Optional[Callable[[], float]] = None) -> tuple[int, Plan, bool]:
        """(program id, plan, whether it was planned now). Spec sets are compared whole, so
        two different sets never share a program; the least recently used beyond
        `max_programs` are evicted, in the actors too. A new spec set is checked entry by entry
        and sized against what the sources hold; with `deadline_of` (the refit's deadline,
        asked for only then), planning is bounded by it (RefitError)."""
        try:
            items = SpecSet(specs)
        except Exception:
            check_spec_set(specs)               # names the entry that is not a spec
            raise
        hit = self._plans.get(items)
        if hit is not None:
            self._plans.move_to_end(items)
            return hit[0], hit[1], False
        check_spec_set(specs)
        deadline = deadline_of() if deadline_of is not None else None
        if deadline is not None:
            self._check_sources_hold(specs, deadline)
        try:
            p = make_plan(specs, self.src_domains, self.dst_domains, src_devices=self.src_devices,
                          dst_devices=self.dst_devices, deadline=deadline)
            if deadline is not None:
                self._strategy.prepare(p, self.bucket_bytes, deadline)
        except PlanTimeout as e:
            raise RefitError(f"refit failed before moving any byte: {e} (the refit's deadline; "
                             f"pass a larger timeout_s for a first refit of this many tensors)"
                             ) from None
        check_bucket(p, self.bucket_bytes)
        self._plans[items] = (next(self._program_ids), p)
        while len(self._plans) > self.max_programs:
            self._evict(self._plans.popitem(last=False)[1][0])
        return self._plans[items][0], p, True

    def _check_sources_hold(self, specs: Mapping[str, TensorSpec], deadline: float) -> None:
        """Refuse specs describing more bytes than the sources hold in all (an absurd shape
        would otherwise cost the driver its memory while cutting buckets)."""
        need = {name: s.source_nbytes for name, s in specs.items()}
        # a tensor sent to several destination groups in several dtypes is several specs
        # reading one source: count its bytes once
        total = sum({_source_key(name, s): need[name] for name, s in specs.items()}.values())
        holders = self.members.procs_of("src")
        held = self._collect([self._procs[q].__ray_call__.remote(worker.held_bytes,
                                                                 self.group_id)
                              for q in holders],
                             max(deadline - time.monotonic(), 0.0), "preflight", holders)
        if any(h is None for h in held) or total <= sum(held):
            return
        largest = sorted(need, key=need.get, reverse=True)[:3]
        raise ValueError(
            f"refit refused before moving any byte: the specs describe {total} bytes of source "
            f"tensors, but the source processes hold {sum(held)} bytes in all; largest: "
            + ", ".join(f"{n!r} {specs[n].shape} {specs[n].source_dtype} ({need[n]} bytes)"
                        for n in largest))

    def _evict(self, key: int) -> None:
        """Drop an evicted program in every actor, and the rings only it used."""
        if key not in self._installed:
            return
        self._installed.discard(key)
        self._program_bytes.pop(key, None)
        unused = []
        for pair, users in list(self._ring_users.items()):
            users.discard(key)
            if not users:
                unused.append(pair)
                del self._ring_users[pair]
                self._rings.pop(pair, None)
        per_proc: dict = {p: [] for p in range(len(self._procs))}
        for s, d in unused:
            per_proc[s].append((d, True))
            per_proc[d].append((s, False))
        for p, a in enumerate(self._procs):       # ordered before any later call to the actor
            a.__ray_call__.remote(worker.uninstall, self.group_id, [key], per_proc[p])

    def _install(self, key, p: Plan, timeout: Optional[float] = None) -> None:
        if key in self._installed:
            return
        deadline = time.monotonic() + (timeout or self.setup_timeout_s)
        # The plan goes to the object store once; every process compiles its own share from
        # it (nothing here grows with the number of processes but the calls themselves) and
        # reports the largest bucket it sends each peer outside the network, to size rings.
        self._strategy.prepare(p, self.bucket_bytes)     # computed once, shipped with the plan
        with gc_paused():
            plan_ref = ray.put(p)
        refs = [a.__ray_call__.remote(worker.install, self.group_id, key, plan_ref, None,
                                      self.strategy)
                for pid, a in enumerate(self._procs)]
        sends = self._collect(refs, max(deadline - time.monotonic(), 0.0), "install")
        if self._strategy.rings:
            pairs = {(s, d): n for s, peers in enumerate(sends) for d, n in peers.items()
                     if d != s and self.proc_nodes[s] == self.proc_nodes[d]}
            self._ensure_rings(pairs, deadline)
            for pair in pairs:
                self._ring_users.setdefault(pair, set()).add(key)
        self._installed.add(key)

    def _ensure_rings(self, pairs: dict, deadline: float) -> None:
        """Rings for intra-node pairs, slots sized to the pair's largest bucket (a pair that a
        later plan sends more gets a new, larger ring). Node helpers must answer within the
        deadline: one that does not fails the refit as a RefitError naming its node."""
        missing = sorted(k for k, n in pairs.items() if self._rings.get(k, ("", 0))[1] < n)
        if not missing:
            return
        by_size: dict = {}
        for s, d in missing:
            by_size.setdefault((self.proc_nodes[s], pairs[(s, d)]), []).append((s, d))
        for (node, size), ps in by_size.items():
            def create():
                return self._helper_call(node, deadline, "create_rings", self.group_id, len(ps),
                                         size, 2, gpu=self._gpu)
            try:
                names = create()
            except RayActorError:      # the helper died since set-up (a user's ray.kill): replace it
                self._helpers.update(membership.node_helpers([node], self.setup_timeout_s))
                names = create()
            self._rings.update((k, (n, size)) for k, n in zip(ps, names))
        by_node = {node for node, _ in by_size}
        out: dict = {}
        inn: dict = {}
        for (s, d) in missing:
            out.setdefault(s, {})[d] = self._rings[(s, d)][0]
            inn.setdefault(d, {})[s] = self._rings[(s, d)][0]
        pids = sorted(set(out) | set(inn))
        self._collect([self._procs[p].__ray_call__.remote(worker.attach_rings, self.group_id,
                                                          out.get(p, {}), inn.get(p, {}), self._gpu)
                       for p in pids], max(deadline - time.monotonic(), 0.0), "attach", pids)
        # Every end is mapped: drop the names so no segment can outlive its processes.
        for n in by_node:
            self._helper_call(n, deadline, "seal", self.group_id)

    def _helper_call(self, node, deadline: float, method: str, *args, **kwargs):
        """Call a node helper, bounded by `deadline`; a stuck helper is a RefitError."""
        ref = getattr(self._helpers[node], method).remote(*args, **kwargs)
        left = max(deadline - time.monotonic(), 0.0)
        try:
            return ray.get(ref, timeout=left)
        except GetTimeoutError:
            ray.cancel(ref, force=False)
            self._broken = f"the node helper on node {node[:12]} did not answer {method}"
            raise RefitError(f"refit failed in set-up: the node helper on node {node[:12]} did "
                             f"not answer {method}() within {left:.1f} s (stopped or overloaded)"
                             ) from None


class SpecSet:
    """A spec set as a cache key: compared whole (two different sets never share a program),
    hashed once."""

    __slots__ = ("items", "hash")

    def __init__(self, specs: Mapping[str, TensorSpec]):
        with gc_paused(keep=True):  # tens of thousands of pairs: no collector pass meanwhile
            self.items = tuple(specs.items())
        self.hash = hash(self.items)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return isinstance(other, SpecSet) and self.items == other.items


def check_bucket(p: Plan, bucket_bytes: int) -> None:
    """Every element must fit in a bucket (items are cut on element boundaries)."""
    widest = max(range(len(p.specs)), key=lambda i: p.specs[i].itemsize)
    size = p.specs[widest].itemsize
    if bucket_bytes < size:
        raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than one element of "
                         f"{p.names[widest]!r} ({p.specs[widest].dtype}, {size} bytes)")


def _source_key(name: str, spec: TensorSpec) -> tuple:
    """What a spec's sources read: equal keys read the same bytes."""
    if spec.src_slots is None:                   # its sources keep it whole under its name
        return (Slot(name), spec.source_nbytes)
    slot = spec.src_slots.uniform
    return (slot if slot is not None else tuple(spec.src_slots), spec.source_nbytes)
