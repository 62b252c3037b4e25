"""ReshardGroup: the driver side of a refit between two lists of Ray actors."""
from __future__ import annotations

import itertools
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from ..errors import GroupStateLost, RefitError
from ..layout.spec import TensorSpec
from ..planning.plan import DEFAULT_BUCKET_BYTES
from ..planning.moves import Endpoint
from ..planning.schedule import DEFAULT_STAGING_BYTES, MAX_WINDOW, default_window
from . import membership, metrics, worker
from .delta import BASELINE_PLACES
from .membership import Members, actor_key
from .programs import DEFAULT_MAX_PROGRAMS, ProgramCache
from .protocol import RefitProtocol, check_timeout, describe_failure
from .result import RefitResult
from .strategies import STRATEGIES
from .transport import torch_pg
from .transport.devices import choose_backend

# Largest bucket a group accepts: staging buffers are allocated whole, and transports handle
# messages below 2 GiB best (32-bit byte counts in some of them).
MAX_BUCKET_BYTES = 1 << 30


class ReshardGroup(ProgramCache, RefitProtocol):
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
            raise ValueError(f"strategy must be one of {tuple(STRATEGIES)}, got {strategy!r}")
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
        check_timeout(timeout_s)
        if delta_baseline not in BASELINE_PLACES:
            raise ValueError(f"delta_baseline must be one of {BASELINE_PLACES} (where senders "
                             f"keep the bytes they sent last), got {delta_baseline!r}")
        self.delta_baseline = delta_baseline
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call ray.init() before building a "
                               "ReshardGroup")
        self._ray_session = membership.session()[0]
        self.strategy, self.bucket_bytes, self.timeout_s = strategy, bucket_bytes, timeout_s
        self._strategy = STRATEGIES[strategy]
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
        self._reset_programs()

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
                    why = describe_failure(self.members.proc_of[Endpoint("dst", r)], e)
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


