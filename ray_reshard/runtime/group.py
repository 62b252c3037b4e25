"""ReshardGroup: the driver side of a refit between two lists of Ray actors."""
from __future__ import annotations

import itertools
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from .._gc import gc_paused
from ..planning.plan import (DEFAULT_BUCKET_BYTES, Plan, PlanStats, check_spec_set,
                             plan as make_plan)
from ..planning.schedule import DEFAULT_STAGING_BYTES, MAX_WINDOW, PlanTimeout, default_window
from ..planning.planner import Endpoint
from ..layout.spec import TensorSpec
from ..errors import GroupStateLost, RefitError, TransportError
from . import membership, metrics, worker
from .delta import BASELINE_PLACES, request as delta_request, summarize as delta_summary
from .membership import Members, actor_key
from .transport import torch_pg
from .transport.devices import choose_backend

STRATEGIES = ("reshard", "gather_broadcast")
# Largest bucket a group accepts: staging buffers are allocated whole, and transports handle
# messages below 2 GiB best (32-bit byte counts in some of them).
MAX_BUCKET_BYTES = 1 << 30
# Spec sets whose plans and programs a group keeps (least recently used beyond that go).
DEFAULT_MAX_PROGRAMS = 8


@dataclass
class RefitResult:
    """What one refit did. Bytes are destination-dtype bytes."""

    version: int
    seconds: float
    strategy: str
    bytes_by_path: dict            # bytes moved: network / domain / local
    network_gbps: float            # network bytes / seconds
    peak_staging_bytes: int        # the largest staging memory any rank held
    extra_bytes: int               # the largest atomic/snapshot/aliasing copy any rank held
    plan_stats: PlanStats
    planned: bool                  # False when the plan came from the cache
    per_process: list = field(default_factory=list)
    # Things that did not stop the refit but need attention (e.g. a source process that died
    # after its data moved: the group needs update() before the next refit).
    warnings: list = field(default_factory=list)
    # A delta refit's figures (see `delta.summarize`), None for a dense one.
    delta: Optional[dict] = None

    def summary(self) -> str:
        b = self.bytes_by_path
        if b["network"]:
            rate = f"network {self.network_gbps:.2f} GB/s"
        else:                   # one domain: what moved went over shared memory or copies
            moved = sum(b.values())
            rate = (f"no network bytes (one domain), "
                    f"{moved / self.seconds / 1e9 if self.seconds > 0 else 0.0:.2f} GB/s moved")
        return (f"refit v{self.version} [{self.strategy}] {self.seconds:.3f} s: "
                f"network {b['network'] / 1e6:.1f} MB (bound {self.plan_stats.min_network_bytes / 1e6:.1f} MB), "
                f"domain {b['domain'] / 1e6:.1f} MB, local {b['local'] / 1e6:.1f} MB, "
                f"{rate}, peak staging {self.peak_staging_bytes / 1e6:.1f} MB/rank")

    def to_dict(self) -> dict:
        """Flat figures for experiment trackers (see `metrics.refit_dict`)."""
        return metrics.refit_dict(self)

    def to_arrow(self):
        """`to_dict()` as a one-row pyarrow Table."""
        return metrics.to_arrow(self.to_dict())


class ReshardGroup:
    """Moves tensors from `src_actors` to `dst_actors` (refit), reusing groups and plans.

    Library code runs inside the actors through `actor.__ray_call__`. Each actor's tensors come
    from `tensors(actor) -> {name: tensor}` or, by default, its `reshard_tensors()` method, and
    are looked up anew at every refit. The same actor may appear on both sides (colocated).

    Plans and installed programs are kept for the `max_programs` spec sets used most recently.
    Calls on one group are serialised (a refit from another thread waits for the running one).
    Each process keeps up to `window` network buckets in flight (its staging memory is at most
    `window * bucket_bytes`; default: as many as fit in 128 MiB, 2 to 16).
    """

    def __init__(self, src_actors: Sequence[Any], dst_actors: Sequence[Any], *,
                 backend: str = "auto", tensors: Optional[Callable] = None,
                 strategy: str = "reshard", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: Optional[float] = None, setup_timeout_s: float = 120.0,
                 src_domains: Optional[Sequence[Any]] = None,
                 dst_domains: Optional[Sequence[Any]] = None,
                 max_programs: int = DEFAULT_MAX_PROGRAMS, window: Optional[int] = None,
                 delta_baseline: str = "device"):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or \
                not 0 < bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes must be an int in 1..{MAX_BUCKET_BYTES} "
                             f"({MAX_BUCKET_BYTES >> 20} MiB), got {bucket_bytes!r}")
        if not isinstance(max_programs, int) or isinstance(max_programs, bool) or max_programs < 1:
            raise ValueError(f"max_programs must be a positive int, got {max_programs!r}")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or
                                   not 1 <= window <= MAX_WINDOW):
            raise ValueError(f"window must be an int in 1..{MAX_WINDOW} (or None: as many "
                             f"buckets as fit in {DEFAULT_STAGING_BYTES >> 20} MiB, at least "
                             f"2), got {window!r}")
        _check_timeout(timeout_s)
        if delta_baseline not in BASELINE_PLACES:
            raise ValueError(f"delta_baseline must be one of {BASELINE_PLACES} (where senders "
                             f"keep the bytes they sent last), got {delta_baseline!r}")
        self.delta_baseline = delta_baseline
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call ray.init() before building a "
                               "ReshardGroup")
        self._ray_session = membership.session()[0]
        self.strategy, self.bucket_bytes, self.timeout_s = strategy, bucket_bytes, timeout_s
        self.max_programs = max_programs
        # Network buckets in flight per process (staging memory: window x bucket_bytes).
        self.window = window or default_window(bucket_bytes)
        self._lock = threading.RLock()      # one refit / update / close at a time
        self._pending: Optional[PendingRefit] = None
        self._program_ids = itertools.count()
        self._ballots = itertools.count()
        self.setup_timeout_s = setup_timeout_s
        self._tensors_fn = tensors
        self._backend_arg = backend
        self._domains_arg = (src_domains, dst_domains)
        self._closed = False
        self._version = 0
        self._infos: dict = {}          # actor id -> where it runs (kept across update())
        # Destination actors that do not hold the group's version, by actor id -> why (a
        # refit failed part-way in them, or update() added them and no refit reached them
        # yet); kept across update(), cleared by the next refit that completes.
        self._unsure: dict = {}
        self._helpers: dict = {}
        self.members: Optional[Members] = None
        self.group_id = None
        try:
            self._bind(src_actors, dst_actors)
            self._setup()
        except BaseException:
            self.close()
            raise

    @property
    def _procs(self) -> tuple:
        """Process index -> its actor (see `membership.Members`)."""
        return self.members.procs if self.members is not None else ()

    # ---------------------------------------------------------------- set-up
    def _bind(self, src_actors, dst_actors) -> None:
        """Take new actor lists: process numbering, fresh group id and per-group caches."""
        self.members = Members.of(src_actors, dst_actors)
        self.src_actors, self.dst_actors = list(src_actors), list(dst_actors)
        self.group_id = uuid.uuid4().hex
        self._broken: Optional[str] = None
        self._recoverable = False       # no member died or lost its state in that failure
        self._hung: set = set()         # processes that missed a deadline (maybe still busy)
        # spec items -> (program id, plan, its ring pairs); least recently used first
        self._plans: OrderedDict = OrderedDict()
        self._installed: set = set()
        self._program_bytes: dict = {}  # program id -> its memory over all processes (measured)
        self._ring_users: dict = {}     # ring pair -> program ids whose schedule uses it
        self._rings: dict = {}          # (sender pid, receiver pid) -> (ring name, slot bytes)

    def _call_all(self, fn, *args, timeout: Optional[float] = None, actors=None):
        actors = self._procs if actors is None else actors
        refs = [a.__ray_call__.remote(fn, *args) for a in actors]
        return ray.get(refs, timeout=timeout or self.setup_timeout_s)

    def _setup(self) -> None:
        """Probe the actors, find domains, and build the collective group."""
        src_domains, dst_domains = self._domains_arg
        topo = membership.probe(self.members, self._infos, self._collect, self.setup_timeout_s,
                                src_domains, dst_domains)
        self._helpers, self.proc_nodes = topo.helpers, topo.proc_nodes
        self.src_domains, self.dst_domains = topo.src_domains, topo.dst_domains
        self.src_devices, self.dst_devices = topo.src_devices, topo.dst_devices
        infos, on_gpu = topo.infos, topo.on_gpu
        # NCCL only with one process per GPU; processes sharing a GPU (fractional num_gpus) use
        # CUDA IPC rings on their node whatever the network backend.
        backend = choose_backend(self._backend_arg,
                                 [i.get("gpu_uuid") if g else None for i, g in zip(infos, on_gpu)],
                                 on_gpu)
        self.backend = backend
        self._gpu = all(on_gpu)
        torch_pg.ensure_registered()
        self.group_name = f"rr-{self.group_id[:16]}"
        world = len(self._procs)
        refs = [a.__ray_call__.remote(worker.setup, self.group_id, self.group_name, world, p,
                                      backend, self.members.proc_of, infos[p]["device"], self._tensors_fn,
                                      self.bucket_bytes, self.setup_timeout_s, self._version,
                                      self.window)
                for p, a in enumerate(self._procs)]
        joined = self._collect(refs, self.setup_timeout_s, "setup")
        self._store_address = joined[0]["store"]

    def update(self, src_actors: Optional[Sequence[Any]] = None,
               dst_actors: Optional[Sequence[Any]] = None) -> float:
        """Change membership between refits (replace, add or remove actors); returns seconds.

        Works after a failed refit too, and for actors Ray restarted (same handles). What is
        kept: node helpers and the planner's per-signature cache. Every member answers a probe
        first (a dead one fails the update at once, as a RefitError naming it; one that Ray
        restarted elsewhere is found where it runs now). What is rebuilt: the collective group
        (torch process groups cannot shrink or grow) and the programs.
        """
        with self._lock:
            self._settle()
            self._check_usable()
            t0 = time.perf_counter()
            # Each actor runs its calls in order: the old group's teardown is queued before the
            # new set-up, so there is no need to wait for it.
            self._leave(wait=False)
            had = {actor_key(a) for a in self.dst_actors}
            self._bind(self.src_actors if src_actors is None else src_actors,
                       self.dst_actors if dst_actors is None else dst_actors)
            if self._version:
                for a in self.dst_actors:
                    if actor_key(a) not in had:
                        self._unsure[actor_key(a)] = (
                            f"update() added it after v{self._version} and no refit has "
                            f"reached it since")
            live = {actor_key(a) for a in self._procs}
            self._infos = {k: v for k, v in self._infos.items() if k in live}
            self._setup()
            return time.perf_counter() - t0

    # ---------------------------------------------------------------- planning
    def plan(self, specs: Mapping[str, TensorSpec]) -> Plan:
        """The plan for `specs` on this group's topology (computed once per spec set)."""
        with self._lock:
            return self._cached_plan(specs)[1]

    def _cached_plan(self, specs: Mapping[str, TensorSpec], deadline: Optional[float] = None
                     ) -> tuple[int, Plan, bool]:
        """(program id, plan, whether it was planned now). Spec sets are compared whole, so
        two different sets never share a program; the least recently used beyond
        `max_programs` are evicted, in the actors too. A new spec set is first sized against
        what the sources hold; with a `deadline`, planning is bounded by it (RefitError)."""
        items = _SpecSet(specs)
        hit = self._plans.get(items)
        if hit is not None:
            self._plans.move_to_end(items)
            return hit[0], hit[1], False
        if deadline is not None:
            self._check_sources_hold(specs, deadline)
        try:
            p = make_plan(specs, self.src_domains, self.dst_domains, src_devices=self.src_devices,
                          dst_devices=self.dst_devices, deadline=deadline)
            if deadline is not None and self.strategy == "reshard":
                p.network_turns(self.bucket_bytes, deadline)     # computed once, shipped
        except PlanTimeout as e:
            raise RefitError(f"refit failed before moving any byte: {e} (the refit's deadline; "
                             f"pass a larger timeout_s for a first refit of this many tensors)"
                             ) from None
        _check_bucket(p, self.bucket_bytes)
        self._plans[items] = (next(self._program_ids), p)
        while len(self._plans) > self.max_programs:
            self._evict(self._plans.popitem(last=False)[1][0])
        return self._plans[items][0], p, True

    def _check_sources_hold(self, specs: Mapping[str, TensorSpec], deadline: float) -> None:
        """Refuse specs describing more bytes than the sources hold in all (an absurd shape
        would otherwise cost the driver its memory while cutting buckets)."""
        need = {name: s.source_nbytes for name, s in specs.items()}
        total = sum(need.values())
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
        if self.strategy == "reshard":
            p.network_turns(self.bucket_bytes)    # computed once, shipped with the plan
        with gc_paused():
            plan_ref = ray.put(p)
        refs = [a.__ray_call__.remote(worker.install, self.group_id, key, plan_ref, None,
                                      self.strategy)
                for pid, a in enumerate(self._procs)]
        sends = self._collect(refs, max(deadline - time.monotonic(), 0.0), "install")
        if self.strategy == "reshard":
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

    # ---------------------------------------------------------------- refit
    @metrics.observe_refit
    def refit(self, specs: Mapping[str, TensorSpec], *, atomic: bool = False,
              snapshot: bool = False, timeout_s: Optional[float] = None,
              delta: bool = False) -> RefitResult:
        """Write every destination's shards of `specs` in place from the sources' shards.

        Default (atomic=False): destinations are written as bytes arrive, so a refit that fails
        may leave them mixed (some tensors new, some old); `version` does not advance. With
        atomic=True destinations receive into staging copies of their shards (extra memory = the
        size of each destination's shards, reported as `extra_bytes`) and commit only once every
        rank has received everything: a failed refit, including one whose destination fails
        while committing, leaves every surviving destination as it was.
        Sources are read while the refit runs: no optimizer step may touch them until refit
        returns, or pass snapshot=True to copy them first (extra memory = source shards).
        Colocated refits (an actor on both sides whose source and destination tensors share
        memory) copy the shared source shards first (reported in `extra_bytes`).
        Refits on one group run one at a time: a call from another thread waits its turn.

        With delta=True each network bucket travels as the bytes that changed since this spec
        set's last delta refit (see docs/delta.md): senders keep what they sent (memory = their
        network bytes, in `delta_baseline` memory, reported in `result.delta`), and send dense
        where a receiver may not hold it (the first delta refit, after a failed or refused refit,
        update(), a dense refit of any spec set in between): `result.delta["fallbacks"]` names
        those. Destinations end bit-identical to a dense refit; one whose shards changed outside
        refits is caught (checksum) and the refit fails, naming it (the group stays usable).
        `delta` may instead name the specs sent as deltas (e.g. the parameters an engine reads
        in place): buckets holding any other tensor travel dense and keep no baseline.
        """
        with self._lock:
            return self._refit(specs, atomic, snapshot, timeout_s, delta)

    def refit_async(self, specs: Mapping[str, TensorSpec], *, atomic: bool = False,
                    timeout_s: Optional[float] = None, delta: bool = False) -> "PendingRefit":
        """An overlapped refit: returns as soon as every source's shards are captured (copied:
        extra memory = the source shards), while the bytes move; the trainer may take its next
        optimizer step at once. `PendingRefit.wait()` returns the RefitResult; its `version` is
        known now. Any other call on the group first waits for it.

        For the step to run while the bytes move, the trainer actors must accept concurrent
        calls (`max_concurrency >= 2`): a Ray actor otherwise runs one call at a time, and the
        step waits behind the send. What is sent is the captured copy either way.
        """
        with self._lock:
            self._settle()
            running = self._start(specs, atomic, False, timeout_s, capture=True, delta=delta)
            self._pending = PendingRefit(self, running)
            return self._pending

    def _recover(self, timeout: Optional[float]) -> str:
        """A refit failed earlier. Where no member died or lost its state in it and every
        member answers within RECOVER_PROBE_S (the network is back, a busy member is free),
        re-form the collective group and programs with the same actors, as update() does, and
        return a note for the result's warnings; otherwise refuse, naming the failure."""
        refuse = RefitError(f"this ReshardGroup failed earlier ({self._broken}); call update() "
                            f"(same or replacement actors) or build a new one")
        if not self._recoverable:
            raise refuse
        refs = [a.__ray_call__.remote(worker.probe) for a in self._procs]
        ready, _ = ray.wait(refs, num_returns=len(refs),
                            timeout=min(RECOVER_PROBE_S, timeout or RECOVER_PROBE_S))
        if len(ready) < len(refs):
            raise refuse
        try:
            pids = [info["pid"] for info in ray.get(refs)]
        except Exception:       # noqa: BLE001  (died since: the refusal names the failure)
            raise refuse from None
        if any(pid != self._infos.get(actor_key(a), {}).get("pid")
               for a, pid in zip(self._procs, pids)):
            raise refuse        # restarted by Ray: its shards and group state are gone
        why, t0 = self._broken, time.perf_counter()
        self.update()
        return (f"the collective group was re-formed with the same actors "
                f"({time.perf_counter() - t0:.2f} s) after a refit failed: {why[:300]}")

    def _settle(self) -> None:
        """Finish an overlapped refit still in flight (its errors stay with its handle)."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            try:
                pending.wait()
            except Exception:
                pass

    def _refit(self, specs, atomic, snapshot, timeout_s, delta=False) -> RefitResult:
        self._settle()
        return self._finish(self._start(specs, atomic, snapshot, timeout_s, delta=delta))

    def _start(self, specs, atomic, snapshot, timeout_s, capture: bool = False,
               delta: bool = False) -> dict:
        """Plan, install, validate, (capture,) and start every process's run."""
        self._check_usable()
        recovered = self._recover(timeout_s or self.timeout_s) if self._broken else None
        check_spec_set(specs)
        _check_timeout(timeout_s)
        delta = delta_request(delta, specs, self.delta_baseline)
        if delta is not None and self.strategy != "reshard":
            raise ValueError(f"delta refits need the reshard strategy (this group uses "
                             f"{self.strategy!r}, which sends whole tensors)")
        # One deadline for the whole refit: sizing and planning a new spec set, installing its
        # programs, checking local tensors, and running. A dead or stuck rank fails it in
        # time, named. Without a timeout it follows the payload: the plan's, once known.
        t_start = time.monotonic()
        timeout = timeout_s or self.timeout_s
        key, p, planned = self._cached_plan(specs, t_start + (
            timeout or default_timeout_s(sum(s.source_nbytes for s in specs.values()))))
        timeout = timeout or default_timeout_s(p.stats.total_bytes)
        deadline = t_start + timeout
        self._install(key, p, timeout)
        version = self._version + 1
        t0 = time.perf_counter()
        if capture:
            holders = self.members.procs_of("src")
            try:
                errors = self._collect([self._procs[q].__ray_call__.remote(
                    worker.capture, self.group_id, key, self._version) for q in holders],
                    max(deadline - time.monotonic(), 0.0), "capture", holders)
            except RefitError:
                self._discard_all()
                raise
            if any(errors):
                self._discard_all()
                self._refuse(errors)
        left = max(deadline - time.monotonic(), 0.001)
        # One call per process: it checks its tensors, votes with the others through the
        # group's store (nobody moves a byte unless everyone's tensors are right), and runs.
        ballot = f"refit{next(self._ballots)}"
        refs = [a.__ray_call__.remote(worker.run, self.group_id, key, left, version, atomic,
                                      snapshot, ballot, self._version, delta)
                for a in self._procs]
        return {"refs": refs, "left": left, "version": version, "timeout": timeout, "t0": t0,
                "plan": p, "planned": planned, "atomic": atomic, "recovered": recovered}

    def _finish(self, running: dict) -> RefitResult:
        """Wait for every process's run, commit, and report."""
        try:
            per = self._collect(running["refs"], running["left"])
        except RefitError:
            self._discard_all()
            if not running["atomic"]:           # destinations may hold a mix of versions
                for a in self.dst_actors:
                    self._unsure.setdefault(actor_key(a), (
                        f"refit v{running['version']} failed part-way (not atomic): it may "
                        f"hold a mix of v{self._version} and v{running['version']}"))
            raise
        version, p = running["version"], running["plan"]
        if any("refused" in st for st in per):
            self._discard_all()
            self._refuse(per)
        if any(st.get("delta", {}).get("mismatches") for st in per):
            self._delta_mismatch(running, per)
        if running["atomic"]:
            result_warnings = self._commit(version, running["timeout"])
        else:                  # every process finished: each takes the version at its next call
            self._version, result_warnings = version, []
        for a in self.dst_actors:
            self._unsure.pop(actor_key(a), None)
        if running.get("recovered"):
            result_warnings = [running["recovered"], *result_warnings]
        seconds = time.perf_counter() - running["t0"]
        moved = {"network": 0, "domain": 0, "local": 0}
        for st in per:
            for k, v in st["bytes_by_path"].items():
                moved[k] += v
        return RefitResult(version, seconds, self.strategy, moved,
                           moved["network"] / seconds / 1e9 if seconds > 0 else 0.0,
                           max(st["peak_staging_bytes"] for st in per),
                           max(st["extra_bytes"] for st in per), p.stats, running["planned"],
                           per, result_warnings, delta_summary(per))

    def _refuse(self, per: list) -> None:
        """Raise for a refit every process refused before moving any byte (`per`: what each
        reported): a RefitError naming the ranks whose own code raised (the first exception
        its cause), else a ValueError listing every problem found."""
        faults = [st for st in per if st and st.get("fault")]
        if faults:
            ranks = self._ranks_of([st["pid"] for st in faults])
            raise RefitError(
                "refit refused before moving any byte: a fault in the actors' code on "
                f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: "
                + "; ".join(st["fault"]["text"] for st in faults)
                + "; every destination is as it was, and the group stays usable",
                ranks) from faults[0]["fault"]["error"]
        _refuse([st.get("refused", []) for st in per if st])

    def _delta_mismatch(self, running: dict, per: list) -> None:
        """Raise for a delta refit whose bytes did not match on some receivers (their
        destinations were written outside refits). Every process finished, nothing is broken:
        the group stays usable; the destinations' bytes are unknown until the next refit, which
        sends dense to them (the refit's baselines are not confirmed)."""
        self._discard_all()
        bad = [st for st in per if st.get("delta", {}).get("mismatches")]
        for st in (per if not running["atomic"] else bad):
            for side, r in self._ranks_of([st["pid"]]):
                if side == "dst":
                    self._unsure[actor_key(self.dst_actors[r])] = (
                        f"delta refit v{running['version']} did not match on a receiver "
                        f"(destination shards written outside refits): its bytes are unknown "
                        f"until the next refit")
        ranks = self._ranks_of([st["pid"] for st in bad])
        raise RefitError(
            f"delta refit v{running['version']} failed on "
            f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: "
            + "; ".join(m for st in bad for m in st["delta"]["mismatches"])
            + f"; the group stays usable at v{self._version}: the next refit sends dense "
              f"where a receiver's bytes are unknown", ranks)

    def _discard_all(self) -> None:
        if not self._ray_alive():       # nothing left to tell: the actors went with Ray
            return
        for a in self._procs:
            a.__ray_call__.remote(worker.discard, self.group_id, self._version)

    def _commit(self, version: int, timeout: float) -> list:
        """Every rank has everything: make `version` every process's, one truth for all.

        What matters is the destinations: when every process holding a destination commits,
        the refit is done and the group's version advances (a source-only process that died
        after its data moved only needs update() before the next refit: a warning). When a
        destination fails here, the others roll back (atomic: old weights back) and the group
        keeps its version.
        """
        dst_procs = set(self.members.procs_of("dst"))
        refs = [a.__ray_call__.remote(worker.commit, self.group_id, version)
                for a in self._procs]
        grace = 5.0
        ready, _ = self._wait(refs, len(refs), timeout + grace)
        ready = set(ready)
        failed, texts = [], []
        for proc, r in enumerate(refs):
            if r not in ready:
                failed.append(proc)
                self._hung.add(proc)
                texts.append(f"process {proc} did not finish within {timeout:.1f} s (commit)")
                continue
            try:
                self._get(r)
            except (RayActorError, RayTaskError) as e:
                failed.append(proc)
                texts.append(_describe(proc, e))
        bad_dst = [p for p in failed if p in dst_procs]
        if bad_dst:
            survivors = [p for p in range(len(self._procs)) if p not in failed]
            ray.wait([self._procs[p].__ray_call__.remote(worker.rollback, self.group_id)
                      for p in survivors], num_returns=len(survivors), timeout=timeout + grace)
            self._broken = "; ".join(texts)
            ranks = self._ranks_of(failed)
            raise RefitError(f"refit failed in commit on "
                             f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: {'; '.join(texts)}"
                             f"; every other process rolled back to v{self._version}", ranks)
        for p in range(len(self._procs)):
            if p not in failed:
                self._procs[p].__ray_call__.remote(worker.release, self.group_id)
        self._version = version
        if not failed:
            return []
        self._broken = "; ".join(texts)
        note = (f"refit v{version} is complete on every destination, but "
                f"{', '.join(f'{s} rank {r}' for s, r in self._ranks_of(failed))} failed after "
                f"its data moved ({'; '.join(texts)}): call update() before the next refit")
        warnings.warn(note, RuntimeWarning, stacklevel=4)
        return [note]

    def _collect(self, refs, timeout: float, phase: str = "run", pids=None) -> list:
        """Results of one call per process (`pids[i]` made `refs[i]`; default: all, in order).

        Waits `timeout` plus a grace period; a process that died, raised or did not answer in
        time fails the refit: RefitError naming its ranks, and the group is marked broken.
        Once one process failed, the others get `SETTLE_S` to report (a failing process aborts
        its channels, which wakes its peers at once); any still busy then count as hung.
        """
        pids = list(range(len(refs))) if pids is None else list(pids)
        grace = 5.0
        t_deadline = time.monotonic() + timeout
        t_end = t_deadline + grace
        index = {r: i for i, r in enumerate(refs)}
        outcome: dict = {}                    # i -> (True, result) or (False, error)
        not_ready = list(refs)
        while not_ready:
            left = t_end - time.monotonic()
            if left <= 0:
                break
            ready, not_ready = self._wait(not_ready, 1, left)
            if not ready:
                continue
            i = index[ready[0]]
            try:
                outcome[i] = (True, self._get(ready[0]))
                continue
            except RefitError:
                raise
            except Exception as e:
                outcome[i] = (False, e)
            now = time.monotonic()
            # Past the deadline, whoever has not answered is hung: no need to settle long.
            t_end = min(t_end, now + (SETTLE_S if now < t_deadline else LATE_SETTLE_S))
            error = outcome[i][1]
            died = isinstance(error, RayActorError)
            if not_ready and pids[i] != 0 and (
                    died or isinstance(getattr(error, "cause", None), GroupStateLost)):
                # A dead process (or one that lost its group state) aborts nothing itself:
                # wake the live ones blocked on it (process 0 hosts the store: its members
                # notice that loss themselves).
                self._abort_members(f"process {pids[i]} "
                                    f"{'died' if died else 'lost its group state'} during {phase}")
        not_ready = set(not_ready)
        results, failed, messages = {}, [], []
        waiting, waiting_msgs = [], []        # failed only because a peer did (transport errors)
        for i, (ok, value) in outcome.items():
            if ok:
                results[i] = value
            elif isinstance(value, RayActorError):
                failed.append(pids[i])
                messages.append(_describe(pids[i], value))
            else:
                cause = value.cause if getattr(value, "cause", None) is not None else value
                text = _describe(pids[i], value)
                if isinstance(cause, TransportError):
                    waiting.append(pids[i])
                    waiting_msgs.append(text)
                else:
                    failed.append(pids[i])
                    messages.append(text)
        if not not_ready and not failed and not waiting:
            return [results[i] for i in range(len(refs))]
        hung = [pids[i] for i, r in enumerate(refs) if r in not_ready]
        self._hung.update(hung)
        if failed:
            # Others failed on their own first: the unfinished ones are blocked on them (woken
            # late, or stuck in a transport), not at fault.
            waiting_msgs += [f"process {p} still blocked when the refit ended" for p in hung]
            hung = []
        for p in hung:
            messages.append(f"process {p} did not finish within {timeout:.1f} s ({phase})")
        # The ranks at fault: those that died, hung or raised on their own. Ranks whose transfers
        # failed (peer gone, channel aborted, timed out) are named as at fault only when nothing
        # else explains the failure.
        if failed or hung:
            ranks = self._ranks_of(failed + hung)
            if waiting_msgs:
                messages.append("then, waiting on them: " + "; ".join(waiting_msgs))
        else:
            ranks = self._ranks_of(waiting)
            messages = waiting_msgs
        self._broken = "; ".join(messages)
        # Nobody died or lost its group state (a network fault, a member busy past the
        # deadline): the next refit may re-form the group once everyone answers (`_recover`).
        self._recoverable = not any(
            isinstance(v, RayActorError) or isinstance(getattr(v, "cause", None), GroupStateLost)
            for ok, v in outcome.values() if not ok)
        raise RefitError(f"refit failed in {phase} on "
                         f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: "
                         + "; ".join(messages), ranks)

    def _wait(self, refs, num_returns: int, timeout: float):
        """ray.wait in slices of at most a second, ending in a RefitError as soon as the
        group's Ray instance is gone (ray.shutdown() in another thread, a lost connection)."""
        t_end = time.monotonic() + timeout
        while True:
            left = t_end - time.monotonic()
            try:
                if not self._ray_alive():
                    raise SystemExit
                ready, not_ready = ray.wait(refs, num_returns=num_returns,
                                            timeout=max(min(left, 1.0), 0.0))
            except (SystemExit, Exception) as e:
                if self._ray_alive():
                    raise
                raise self._ray_gone() from (None if isinstance(e, SystemExit) else e)
            if len(ready) >= num_returns or left <= 1.0:
                return ready, not_ready

    def _get(self, ref):
        """ray.get of a ready result; a RefitError when the group's Ray instance is gone."""
        try:
            return ray.get(ref)
        except SystemExit:
            if self._ray_alive():
                raise
            raise self._ray_gone() from None

    def _ray_gone(self) -> RefitError:
        self._broken = "its Ray instance went away during a refit"
        return RefitError("the refit was cut short: the Ray instance this group was built on "
                          "went away (ray.shutdown() in another thread, or the driver lost its "
                          "connection); build a new ReshardGroup after ray.init()",
                          [(s, r) for s in ("src", "dst")
                           for r in range(len(self.src_actors if s == "src"
                                              else self.dst_actors))])

    def _abort_members(self, reason: str) -> None:
        """Wake every member blocked in this group's transport (through the group's store)."""
        address = getattr(self, "_store_address", None)
        if address is not None:
            torch_pg.abort_group(address, self.group_name, reason)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this ReshardGroup is closed")
        if not self._ray_alive():
            raise RuntimeError("the Ray instance this ReshardGroup was built on is gone "
                               "(ray.shutdown() or a new ray.init()); build a new ReshardGroup")

    def _ray_alive(self) -> bool:
        """Whether the driver is still connected to the Ray instance the group was built on
        (never start or attach to another one by calling into it)."""
        return ray.is_initialized() and membership.session()[0] == self._ray_session

    def _ranks_of(self, pids):
        return self.members.ranks_of(pids)

    def raw_bandwidth(self, nbytes_per_pair: int, pairs=None) -> float:
        """Aggregate GB/s of plain sends over this group's network transport.

        By default source i sends `nbytes_per_pair` to destination i (all pairs at once): the
        ceiling a refit of the same actors can reach, measured the same way.
        """
        if pairs is None:
            proc_of = self.members.proc_of
            pairs = [(proc_of[Endpoint("src", i)], proc_of[Endpoint("dst", i)])
                     for i in range(min(len(self.src_actors), len(self.dst_actors)))]
            pairs = [(s, d) for s, d in pairs if s != d]
        sends: dict = {}
        recvs: dict = {}
        for s, d in pairs:
            sends.setdefault(s, {})[d] = 1
            recvs.setdefault(d, {})[s] = 1
        pids = sorted(set(sends) | set(recvs))
        timeout = default_timeout_s(nbytes_per_pair * len(pairs))
        secs = ray.get([self._procs[p].__ray_call__.remote(
            worker.raw_transfer, self.group_id, sends.get(p, {}), recvs.get(p, {}),
            nbytes_per_pair, timeout) for p in pids])
        return nbytes_per_pair * len(pairs) / max(secs) / 1e9

    @property
    def version(self) -> int:
        """Version of the last refit that completed on every rank."""
        return self._version

    def stale_destinations(self, check: bool = False) -> dict:
        """Destination ranks that may not hold the group's version -> why: a refit failed
        part-way in them (not atomic), update() added them and no refit reached them yet, or
        Ray restarted them (they lost their group state and the weights they held). Empty
        after a refit that completed. Read on the driver; with `check`, every destination is
        asked first which version it holds (a remote call each)."""
        if check:
            with self._lock:
                self._settle()
                self._check_usable()
                self._held_versions(range(len(self.dst_actors)))
        out = {}
        for r, a in enumerate(self.dst_actors):
            why = self._unsure.get(actor_key(a))
            if why is not None:
                out[r] = why
        return out

    def _held_versions(self, ranks) -> dict:
        """{destination rank: the version it holds}; a rank that cannot say (Ray restarted it,
        it died, it did not answer in time) is left out and recorded as stale, with why."""
        ranks = list(ranks)
        refs = [self.dst_actors[r].__ray_call__.remote(worker.version, self.group_id,
                                                       self._version) for r in ranks]
        ready, _ = self._wait(refs, len(refs), self.setup_timeout_s)
        ready = set(ready)
        out = {}
        for r, ref in zip(ranks, refs):
            why = None
            if ref not in ready:
                why = f"it did not say which version it holds within {self.setup_timeout_s} s"
            else:
                try:
                    out[r] = self._get(ref)
                except RayActorError as e:
                    why = _describe(self.members.proc_of[Endpoint("dst", r)], e)
                except RayTaskError as e:
                    if not isinstance(e.cause, GroupStateLost):
                        raise
                    why = ("Ray restarted it: it lost its group state and the weights it held; "
                           "call update(), then refit")
            if why is not None:
                self._unsure[actor_key(self.dst_actors[r])] = why
        return out

    def join(self, specs: Mapping[str, TensorSpec], which: Mapping[Any, int],
             new_actors: Sequence[Any], *, dst=None, allow_stale: bool = False,
             atomic: bool = False, timeout_s: Optional[float] = None) -> RefitResult:
        """Fill `new_actors` from one replica of this group's destinations (see
        `ray_reshard.replica_specs` for `which` and `dst`), without the sources; returns the
        copy's RefitResult, whose `version` is the version the new actors now hold.

        Copies only from a replica at the group's version: one with a rank that may hold
        another (see `stale_destinations`) is refused with a RefitError naming those ranks,
        unless `allow_stale` (the result then carries a warning and version -1: unknown).
        """
        from ..layout.replica import replica_specs
        with self._lock:
            self._settle()
            self._check_usable()
            join_specs, ranks = replica_specs(specs, which, dst)
            if len(new_actors) < max(max(s.dst.mesh.ranks) for s in join_specs.values()) + 1:
                raise ValueError(f"the copy's destination layouts need "
                                 f"{max(max(s.dst.mesh.ranks) for s in join_specs.values()) + 1}"
                                 f" new actors, got {len(new_actors)}")
            held = self._held_versions(ranks)
            stale = {r: why for r, why in self.stale_destinations().items() if r in ranks}
            for r, v in held.items():
                if v != self._version and r not in stale:
                    stale[r] = f"it holds v{v}, the group v{self._version}"
            warns = []
            if stale:
                text = "; ".join(f"dst rank {r}: {why}" for r, why in sorted(stale.items()))
                if not allow_stale:
                    raise RefitError(
                        f"replica {dict(which)} does not hold the group's version "
                        f"v{self._version} ({text}): copy from another replica, refit first, "
                        f"or pass allow_stale=True", [("dst", r) for r in sorted(stale)])
                warns.append(f"copied from a replica that may not hold v{self._version}: "
                             f"{text}")
            with ReshardGroup([self.dst_actors[r] for r in ranks], list(new_actors),
                              backend=self._backend_arg, tensors=self._tensors_fn,
                              bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s,
                              setup_timeout_s=self.setup_timeout_s) as copier:
                res = copier.refit(join_specs, atomic=atomic, timeout_s=timeout_s)
            res.version = -1 if stale else self._version
            res.warnings = list(res.warnings) + warns
            for w in warns:
                warnings.warn(w, RuntimeWarning, stacklevel=2)
            return res

    def versions(self) -> list[int]:
        """The version each process reports holding."""
        with self._lock:
            self._settle()
            self._check_usable()
            return self._call_all(worker.version, self.group_id, self._version)

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Leave the collective group in every live actor and free this group's segments.

        After ray.shutdown() there is nothing left to free (the actors and helpers went with
        the Ray instance): close() then only marks the group closed."""
        with self._lock:
            if self._closed:
                return
            if self._ray_alive():
                self._settle()
            self._closed = True
            if self._ray_alive():
                self._leave()
            self._helpers = {}

    def _leave(self, wait: bool = True) -> None:
        if self.group_id is None:
            return
        refs = []
        if self._procs:
            calls = [a.__ray_call__.remote(worker.teardown, self.group_id) for a in self._procs]
            # A process that missed a deadline may still be stuck: its teardown stays queued
            # and runs when it frees up; waiting for it would only delay the rebuild.
            refs = [r for p, r in enumerate(calls) if p not in self._hung]
        # Helpers are shared by the driver's groups; only this group's segments go.
        refs += [h.destroy_group.remote(self.group_id) for h in self._helpers.values()]
        if refs and wait:
            ray.wait(refs, num_returns=len(refs), timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    def resources(self, measure: bool = False) -> dict:
        """What this group holds now (read on the driver, no remote call unless `measure`), for
        leak checks.

        `segments`: names of its shared-memory ring segments (unlinked from /dev/shm once both
        ends mapped them); `helpers`: node id -> that node's helper actor (shared by this
        driver's groups; `helper.segments.remote(group_id)` lists what it still holds for this
        group); `programs`: spec sets installed on the actors; `program_bytes`: program id ->
        the memory its installed program holds, summed over the processes (each process holds
        the plan it compiled from, its compiled steps and buffers): measured by every process
        when `measure` (once per program: about as long as installing it took), else as last
        measured; `plans`: plans cached; `processes`: member processes. Programs beyond
        `max_programs` are evicted in every process, so what programs hold stays proportional
        to the programs cached.
        """
        if measure:
            with self._lock:
                self._settle()
                self._check_usable()
                per = self._call_all(worker.held_resources, self.group_id)
                self._program_bytes = {k: sum(h["program_bytes"].get(k, 0) for h in per)
                                       for k in self._installed}
        return {"group_id": self.group_id,
                "segments": sorted(name for name, _ in self._rings.values()),
                "helpers": dict(self._helpers), "programs": len(self._installed),
                "program_bytes": {k: n for k, n in self._program_bytes.items()
                                  if k in self._installed},
                "plans": len(self._plans), "processes": len(self._procs)}


class PendingRefit:
    """An overlapped refit in flight (see `ReshardGroup.refit_async`): the sources' shards are
    captured; `wait()` returns the RefitResult (or raises what the refit raised)."""

    def __init__(self, group: ReshardGroup, running: dict):
        self.group, self.version = group, running["version"]
        self._running, self._result, self._error = running, None, None

    def done(self) -> bool:
        """Whether every process finished its part (wait() then returns without blocking on
        the transfer)."""
        if self._running is None:
            return True
        refs = self._running["refs"]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def wait(self) -> RefitResult:
        with self.group._lock:
            if self._running is not None:
                running, self._running = self._running, None
                if self.group._pending is self:
                    self.group._pending = None
                try:
                    self._result = self.group._finish(running)
                    metrics.record_refit(self._result)
                except Exception as e:
                    self._error = e
        if self._error is not None:
            raise self._error
        return self._result


# After a process failed, how long the others get to report before they count as hung
# (LATE_SETTLE_S once the refit's deadline passed: those still busy then are hung). Members
# reach their own deadlines a little apart and then spend up to LATE_STORE_CHECK_S asking the
# store for an abort (a frozen store host answers nothing): the late window covers that, with
# a second of scheduling slack, so a member blocked on a frozen peer is not named hung itself.
SETTLE_S = 3.0
# How long a refit after a failed one waits for every member to answer before it re-forms
# the group (`ReshardGroup._recover`).
RECOVER_PROBE_S = 2.0
LATE_SETTLE_S = torch_pg.LATE_STORE_CHECK_S + 1.0


def _describe(proc: int, e: Exception) -> str:
    """One process's failure, with the cause's own text (several lines kept: NCCL and torch
    put the reason after the first line)."""
    if isinstance(e, ActorUnavailableError):
        return (f"process {proc} is unavailable (Ray is restarting it, or cannot reach it); "
                f"a restarted actor loses its group state: call update()")
    if isinstance(e, RayActorError):
        return f"process {proc} died ({type(e).__name__})"
    cause = e.cause if getattr(e, "cause", None) is not None else e
    lines = [ln for ln in str(cause).splitlines() if ln.strip()][:6]
    text = " | ".join(lines)
    if len(text) > 800:
        text = text[:800] + " ..."
    return f"process {proc}: {type(cause).__name__}: {text}"


class _SpecSet:
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
        return isinstance(other, _SpecSet) and self.items == other.items


def _refuse(problems_per_process) -> None:
    problems = [e for errs in problems_per_process for e in errs]
    raise ValueError("refit refused before moving any byte:\n  " + "\n  ".join(problems))


def _check_bucket(p: Plan, bucket_bytes: int) -> None:
    """Every element must fit in a bucket (items are cut on element boundaries)."""
    widest = max(range(len(p.specs)), key=lambda i: p.specs[i].itemsize)
    size = p.specs[widest].itemsize
    if bucket_bytes < size:
        raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than one element of "
                         f"{p.names[widest]!r} ({p.specs[widest].dtype}, {size} bytes)")


def _check_timeout(timeout_s) -> None:
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a positive number of seconds (or None for the "
                         f"default), got {timeout_s!r}")


def default_timeout_s(total_bytes: int) -> float:
    """A refit deadline from its payload: 60 s plus 20 s per GB (a floor of 50 MB/s)."""
    return 60.0 + 20.0 * total_bytes / 1e9
