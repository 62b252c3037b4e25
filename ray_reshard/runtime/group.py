"""ReshardGroup: the driver side of a refit between two lists of Ray actors."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from ..core.plan import DEFAULT_BUCKET_BYTES, Plan, PlanStats, plan as make_plan
from ..core.planner import Endpoint
from ..core.spec import TensorSpec
from ..errors import RefitError, TransportError
from . import worker
from .transport import torch_pg

STRATEGIES = ("reshard", "gather_broadcast")


@dataclass
class RefitResult:
    """What one refit did. Bytes are destination-dtype bytes."""

    version: int
    seconds: float
    strategy: str
    bytes_by_path: dict            # bytes moved: network / domain / local
    network_gbps: float            # network bytes / seconds
    peak_staging_bytes: int        # the largest staging memory any rank held
    extra_bytes: int               # the largest atomic/snapshot copy any rank held
    plan_stats: PlanStats
    planned: bool                  # False when the plan came from the cache
    per_process: list = field(default_factory=list)

    def summary(self) -> str:
        b = self.bytes_by_path
        return (f"refit v{self.version} [{self.strategy}] {self.seconds:.3f} s: "
                f"network {b['network'] / 1e6:.1f} MB (bound {self.plan_stats.min_network_bytes / 1e6:.1f} MB), "
                f"domain {b['domain'] / 1e6:.1f} MB, local {b['local'] / 1e6:.1f} MB, "
                f"{self.network_gbps:.2f} GB/s, peak staging {self.peak_staging_bytes / 1e6:.1f} MB/rank")


def _actor_key(a) -> Any:
    try:
        return a._actor_id
    except AttributeError:
        raise TypeError(f"expected a Ray actor handle, got {type(a).__name__}") from None


class ReshardGroup:
    """Moves tensors from `src_actors` to `dst_actors` (refit), reusing groups and plans.

    Library code runs inside the actors through `actor.__ray_call__`. Each actor's tensors come
    from `tensors(actor) -> {name: tensor}` or, by default, its `reshard_tensors()` method, and
    are looked up anew at every refit. The same actor may appear on both sides (colocated).
    """

    def __init__(self, src_actors: Sequence[Any], dst_actors: Sequence[Any], *,
                 backend: str = "auto", tensors: Optional[Callable] = None,
                 strategy: str = "reshard", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: Optional[float] = None, setup_timeout_s: float = 120.0,
                 src_domains: Optional[Sequence[Any]] = None,
                 dst_domains: Optional[Sequence[Any]] = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        _check_timeout(timeout_s)
        self.strategy, self.bucket_bytes, self.timeout_s = strategy, bucket_bytes, timeout_s
        self.setup_timeout_s = setup_timeout_s
        self._tensors_fn = tensors
        self._backend_arg = backend
        self._domains_arg = (src_domains, dst_domains)
        self._closed = False
        self._version = 0
        self._infos: dict = {}          # actor id -> where it runs (kept across update())
        self._helpers: dict = {}
        self._procs: list = []
        self.group_id = None
        try:
            self._bind(src_actors, dst_actors)
            self._setup()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- set-up
    def _bind(self, src_actors, dst_actors) -> None:
        """Take new actor lists: process numbering, fresh group id and per-group caches."""
        src_actors, dst_actors = list(src_actors), list(dst_actors)
        if not src_actors or not dst_actors:
            raise ValueError(f"need at least one source and one destination actor, got "
                             f"{len(src_actors)} and {len(dst_actors)}")
        for side, actors in (("src", src_actors), ("dst", dst_actors)):
            seen = {}
            for i, a in enumerate(actors):
                k = _actor_key(a)
                if k in seen:
                    raise ValueError(f"{side} actor {i} is the same actor as {side} actor "
                                     f"{seen[k]}: each actor may appear once per side")
                seen[k] = i
        self.src_actors, self.dst_actors = src_actors, dst_actors
        self.group_id = uuid.uuid4().hex
        self._broken: Optional[str] = None
        self._hung: set = set()         # processes that missed a deadline (maybe still busy)
        self._plans: dict = {}
        self._installed: set = set()
        self._rings: dict = {}          # (sender pid, receiver pid) -> (ring name, slot bytes)
        self._procs, self._ep_pid, pid_of = [], {}, {}
        for side, actors in (("src", src_actors), ("dst", dst_actors)):
            for i, a in enumerate(actors):
                k = _actor_key(a)
                if k not in pid_of:
                    pid_of[k] = len(self._procs)
                    self._procs.append(a)
                self._ep_pid[Endpoint(side, i)] = pid_of[k]

    def _call_all(self, fn, *args, timeout: Optional[float] = None, actors=None):
        actors = self._procs if actors is None else actors
        refs = [a.__ray_call__.remote(fn, *args) for a in actors]
        return ray.get(refs, timeout=timeout or self.setup_timeout_s)

    def _setup(self) -> None:
        """Probe the actors, find domains, and build the collective group."""
        # Every member answers first (new ones say where they run): a dead or stuck member fails
        # here, named, before any live one starts joining a collective group that could never
        # complete (and would hold that actor until the transport's own timeout).
        probes = self._collect([a.__ray_call__.remote(worker.probe) for a in self._procs],
                               self.setup_timeout_s, "setup")
        for a, info in zip(self._procs, probes):
            self._infos.setdefault(_actor_key(a), info)
        infos = [self._infos[_actor_key(a)] for a in self._procs]
        nodes = list(dict.fromkeys(i["node_id"] for i in infos))
        self._helpers = _node_helpers(nodes, self.setup_timeout_s)
        topo = dict(zip(nodes, ray.get([self._helpers[n].topology.remote() for n in nodes],
                                       timeout=self.setup_timeout_s)))
        proc_domain, proc_device = [], []
        for info in infos:
            t = topo[info["node_id"]]
            dom = t["domain"]
            if info.get("gpu_uuid"):
                dom = next((g["domain"] for g in t.get("gpus", ()) if g["uuid"] == info["gpu_uuid"]),
                           dom)
                proc_device.append(("gpu", info["gpu_uuid"]))
            else:
                proc_device.append(("proc", info["node_id"], info["pid"]))
            proc_domain.append(dom)
        self.proc_nodes = [i["node_id"] for i in infos]
        n_src, n_dst = len(self.src_actors), len(self.dst_actors)
        pid = lambda side, i: self._ep_pid[Endpoint(side, i)]
        src_domains, dst_domains = self._domains_arg
        self.src_domains = list(src_domains) if src_domains is not None else \
            [proc_domain[pid("src", i)] for i in range(n_src)]
        self.dst_domains = list(dst_domains) if dst_domains is not None else \
            [proc_domain[pid("dst", j)] for j in range(n_dst)]
        self.src_devices = [proc_device[pid("src", i)] for i in range(n_src)]
        self.dst_devices = [proc_device[pid("dst", j)] for j in range(n_dst)]
        on_gpu = [i["device"].startswith("cuda") for i in infos]
        backend = self._backend_arg
        if backend == "auto":
            backend = "nccl" if all(on_gpu) else "gloo"
        if backend == "nccl" and not all(on_gpu):
            raise ValueError("backend='nccl' needs every actor on a GPU; processes "
                             f"{[k for k, g in enumerate(on_gpu) if not g]} have none")
        self.backend = backend
        self._gpu = backend == "nccl"
        torch_pg.ensure_registered()
        self.group_name = f"rr-{self.group_id[:16]}"
        world = len(self._procs)
        refs = [a.__ray_call__.remote(worker.setup, self.group_id, self.group_name, world, p,
                                      backend, self._ep_pid, infos[p]["device"], self._tensors_fn,
                                      self.bucket_bytes, self.setup_timeout_s, self._version)
                for p, a in enumerate(self._procs)]
        ray.get(refs, timeout=self.setup_timeout_s)

    def update(self, src_actors: Optional[Sequence[Any]] = None,
               dst_actors: Optional[Sequence[Any]] = None) -> float:
        """Change membership between refits (replace, add or remove actors); returns seconds.

        Works after a failed refit too. What is kept: node helpers, where each known actor runs
        (every member answers a probe first: a dead one fails the update at once, as a RefitError
        naming it), and the planner's per-signature cache. What is rebuilt:
        the collective group (torch process groups cannot shrink or grow) and the programs.
        """
        if self._closed:
            raise RuntimeError("this ReshardGroup is closed")
        t0 = time.perf_counter()
        # Each actor runs its calls in order: the old group's teardown is queued before the
        # new set-up, so there is no need to wait for it.
        self._leave(wait=False)
        self._bind(self.src_actors if src_actors is None else src_actors,
                   self.dst_actors if dst_actors is None else dst_actors)
        live = {_actor_key(a) for a in self._procs}
        self._infos = {k: v for k, v in self._infos.items() if k in live}
        self._setup()
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- planning
    def plan(self, specs: Mapping[str, TensorSpec]) -> Plan:
        """The plan for `specs` on this group's topology (computed once per spec set)."""
        return self._cached_plan(specs)[1]

    def _cached_plan(self, specs: Mapping[str, TensorSpec]) -> tuple[str, Plan, bool]:
        """(program key, plan, whether it was planned now); the spec set is hashed once."""
        items = tuple(specs.items())
        h = hash(items)
        key = f"{h & 0xFFFFFFFFFFFF:x}"
        hit = self._plans.get(h)
        if hit is not None and hit[0] == items:
            return key, hit[1], False
        p = make_plan(specs, self.src_domains, self.dst_domains, src_devices=self.src_devices,
                      dst_devices=self.dst_devices)
        self._plans[h] = (items, p)
        return key, p, True

    def _install(self, key, p: Plan, timeout: Optional[float] = None) -> None:
        if key in self._installed:
            return
        # The plan goes to the object store once; every process compiles its own share from
        # it (nothing here grows with the number of processes but the calls themselves) and
        # reports the largest bucket it sends each peer outside the network, to size rings.
        plan_ref = ray.put(p)
        refs = [a.__ray_call__.remote(worker.install, self.group_id, key, plan_ref, None,
                                      self.strategy)
                for pid, a in enumerate(self._procs)]
        sends = self._collect(refs, timeout or self.setup_timeout_s, "install")
        if self.strategy == "reshard":
            pairs = {(s, d): n for s, peers in enumerate(sends) for d, n in peers.items()
                     if d != s and self.proc_nodes[s] == self.proc_nodes[d]}
            self._ensure_rings(pairs, timeout)
        self._installed.add(key)

    def _ensure_rings(self, pairs: dict, timeout: Optional[float] = None) -> None:
        """Rings for intra-node pairs, slots sized to the pair's largest bucket (a pair that a
        later plan sends more gets a new, larger ring)."""
        missing = sorted(k for k, n in pairs.items() if self._rings.get(k, ("", 0))[1] < n)
        if not missing:
            return
        by_size: dict = {}
        for s, d in missing:
            by_size.setdefault((self.proc_nodes[s], pairs[(s, d)]), []).append((s, d))
        for (node, size), ps in by_size.items():
            def create():
                return ray.get(self._helpers[node].create_rings.remote(
                    self.group_id, len(ps), size, 2, gpu=self._gpu), timeout=self.setup_timeout_s)
            try:
                names = create()
            except RayActorError:      # the helper died since set-up (a user's ray.kill): replace it
                self._helpers.update(_node_helpers([node], self.setup_timeout_s))
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
                       for p in pids], timeout or self.setup_timeout_s, "attach", pids)
        # Every end is mapped: drop the names so no segment can outlive its processes.
        ray.get([self._helpers[n].seal.remote(self.group_id) for n in by_node],
                timeout=self.setup_timeout_s)

    # ---------------------------------------------------------------- refit
    def refit(self, specs: Mapping[str, TensorSpec], *, atomic: bool = False,
              snapshot: bool = False, timeout_s: Optional[float] = None) -> RefitResult:
        """Write every destination's shards of `specs` in place from the sources' shards.

        Default (atomic=False): destinations are written as bytes arrive, so a refit that fails
        may leave them mixed (some tensors new, some old); `version` does not advance. With
        atomic=True destinations receive into staging copies of their shards (extra memory = the
        size of each destination's shards, reported as `extra_bytes`) and commit only once every
        rank has received everything: a failed refit leaves every destination as it was.
        Sources are read while the refit runs: no optimizer step may touch them until refit
        returns, or pass snapshot=True to copy them first (extra memory = source shards).
        """
        if self._closed:
            raise RuntimeError("this ReshardGroup is closed")
        if self._broken:
            raise RefitError(f"this ReshardGroup failed earlier ({self._broken}); call update() "
                             f"(same or replacement actors) or build a new one")
        if not isinstance(specs, Mapping):
            raise TypeError(f"specs must be a mapping of name -> TensorSpec, got "
                            f"{type(specs).__name__}")
        _check_timeout(timeout_s)
        key, p, planned = self._cached_plan(specs)
        # One deadline for the whole refit: installing programs (first refit of a spec set),
        # checking local tensors, and running. A dead or stuck rank fails it in time, named.
        timeout = timeout_s or self.timeout_s or default_timeout_s(p.stats.total_bytes)
        deadline = time.monotonic() + timeout
        self._install(key, p, timeout)
        errors = self._collect([a.__ray_call__.remote(worker.prepare, self.group_id, key)
                                for a in self._procs], max(deadline - time.monotonic(), 0.0),
                               "prepare")
        problems = [e for errs in errors for e in errs]
        if problems:
            raise ValueError("refit refused before moving any byte:\n  " + "\n  ".join(problems))
        version = self._version + 1
        t0 = time.perf_counter()
        left = max(deadline - time.monotonic(), 0.001)
        refs = [a.__ray_call__.remote(worker.run, self.group_id, key, left, version, atomic,
                                      snapshot)
                for a in self._procs]
        try:
            per = self._collect(refs, left)
        except RefitError:
            for a in self._procs:
                a.__ray_call__.remote(worker.discard, self.group_id)
            raise
        # Every rank has everything: commit (atomic: write staged shards back) and take the
        # version. Only now does any rank report the new version.
        self._collect([a.__ray_call__.remote(worker.commit, self.group_id, version)
                       for a in self._procs], timeout)
        seconds = time.perf_counter() - t0
        self._version = version
        moved = {"network": 0, "domain": 0, "local": 0}
        for st in per:
            for k, v in st["bytes_by_path"].items():
                moved[k] += v
        return RefitResult(version, seconds, self.strategy, moved,
                           moved["network"] / seconds / 1e9 if seconds > 0 else 0.0,
                           max(st["peak_staging_bytes"] for st in per),
                           max(st["extra_bytes"] for st in per), p.stats, planned, per)

    def _collect(self, refs, timeout: float, phase: str = "run", pids=None) -> list:
        """Results of one call per process (`pids[i]` made `refs[i]`; default: all, in order).

        Waits `timeout` plus a grace period; a process that died, raised or did not answer in
        time fails the refit: RefitError naming its ranks, and the group is marked broken.
        """
        pids = list(range(len(refs))) if pids is None else list(pids)
        grace = 5.0
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout + grace)
        not_ready = set(not_ready)
        results, failed, messages = {}, [], []
        waiting, waiting_msgs = [], []        # failed only because a peer did (transport errors)
        for i, r in enumerate(refs):
            if r in not_ready:
                continue
            try:
                results[i] = ray.get(r)
            except RayActorError as e:
                failed.append(pids[i])
                messages.append(f"process {pids[i]} died ({type(e).__name__})")
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                text = f"process {pids[i]}: {type(cause).__name__}: " \
                       f"{(str(cause).splitlines() or [''])[0]}"
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
        raise RefitError(f"refit failed in {phase} on "
                         f"{', '.join(f'{s} rank {r}' for s, r in ranks)}: "
                         + "; ".join(messages), ranks)

    def _ranks_of(self, pids):
        return [(ep.side, ep.rank) for ep, p in sorted(self._ep_pid.items(),
                                                      key=lambda kv: (kv[0].side != "src", kv[0].rank))
                if p in set(pids)]

    def raw_bandwidth(self, nbytes_per_pair: int, pairs=None) -> float:
        """Aggregate GB/s of plain sends over this group's network transport.

        By default source i sends `nbytes_per_pair` to destination i (all pairs at once): the
        ceiling a refit of the same actors can reach, measured the same way.
        """
        if pairs is None:
            pairs = [(self._ep_pid[Endpoint("src", i)], self._ep_pid[Endpoint("dst", i)])
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

    def versions(self) -> list[int]:
        """The version each process reports holding."""
        return self._call_all(worker.version, self.group_id)

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Leave the collective group in every live actor and free this group's segments."""
        if self._closed:
            return
        self._closed = True
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
            if not self._closed and ray.is_initialized():
                self.close()
        except Exception:
            pass


_HELPERS: dict = {}      # (cluster session, node id) -> NodeHelper, shared by this driver's groups


def _session() -> tuple:
    """Helpers live as long as the driver's job: key them by cluster session and job."""
    try:
        session = ray._private.worker._global_node.session_name
    except AttributeError:
        session = None
    return session, ray.get_runtime_context().get_job_id()


def _node_helpers(nodes, timeout: float) -> dict:
    """One helper per node, started once per driver and reused (starting one costs seconds)."""
    from .node_helper import start_node_helpers

    session = _session()
    have = {n: _HELPERS[(session, n)] for n in nodes if (session, n) in _HELPERS}
    pings = {n: h.ping.remote() for n, h in have.items()}
    ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout)
    for n, ref in pings.items():      # drop helpers that died (node loss, a user's ray.kill)
        try:
            ray.get(ref, timeout=0)
        except Exception:
            _HELPERS.pop((session, n), None)
            del have[n]
    missing = [n for n in nodes if n not in have]
    if missing:
        started = start_node_helpers(missing)
        for n, h in started.items():
            _HELPERS[(session, n)] = h
            have[n] = h
    return {n: have[n] for n in nodes}


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
