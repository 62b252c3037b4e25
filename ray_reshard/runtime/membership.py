"""Who is in a reshard group and where each member runs (driver side).

Numbering. A group's members are its source and destination actor lists. Each distinct actor
is one *process* of the group, numbered in order of first appearance (sources first); an actor
on both sides (a colocated refit) is one process holding endpoints of both sides.
`Members.proc_of[Endpoint(side, rank)]` is that process's index.

Probing. Every process answers where it runs (node, OS process, device, GPU UUID). One node
helper per node (started once per driver and shared by its groups) answers that node's
topology: the NVLink domain of each GPU (NVL72 fabric cliques span nodes) or of the node.
From those come the domain and device of each rank, which the planner uses to send a byte into
each domain once and to tell local copies from transfers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import ray

from ..planning.moves import Endpoint
from . import worker


def actor_key(a) -> Any:
    """A Ray actor handle's identity (two handles of one actor have the same key)."""
    try:
        return a._actor_id
    except AttributeError:
        raise TypeError(f"expected a Ray actor handle, got {type(a).__name__}") from None


@dataclass(frozen=True)
class Members:
    """The actors of a group, numbered into processes (see the module docstring)."""

    src_actors: tuple
    dst_actors: tuple
    procs: tuple                  # process index -> its actor
    proc_of: dict                 # Endpoint(side, rank) -> process index

    @classmethod
    def of(cls, src_actors: Sequence[Any], dst_actors: Sequence[Any]) -> "Members":
        src_actors, dst_actors = tuple(src_actors), tuple(dst_actors)
        if not src_actors or not dst_actors:
            raise ValueError(f"need at least one source and one destination actor, got "
                             f"{len(src_actors)} and {len(dst_actors)}")
        procs, proc_of, index = [], {}, {}
        for side, actors in (("src", src_actors), ("dst", dst_actors)):
            seen = {}
            for i, a in enumerate(actors):
                k = actor_key(a)
                if k in seen:
                    raise ValueError(f"{side} actor {i} is the same actor as {side} actor "
                                     f"{seen[k]}: each actor may appear once per side")
                seen[k] = i
                if k not in index:
                    index[k] = len(procs)
                    procs.append(a)
                proc_of[Endpoint(side, i)] = index[k]
        return cls(src_actors, dst_actors, tuple(procs), proc_of)

    def procs_of(self, side: str) -> list[int]:
        """Processes holding at least one rank of `side`."""
        n = len(self.src_actors if side == "src" else self.dst_actors)
        return sorted({self.proc_of[Endpoint(side, i)] for i in range(n)})

    def ranks_of(self, procs) -> list[tuple[str, int]]:
        """(side, rank) of every endpoint the processes `procs` hold, sources first."""
        procs = set(procs)
        return [(ep.side, ep.rank)
                for ep, p in sorted(self.proc_of.items(),
                                    key=lambda kv: (kv[0].side != "src", kv[0].rank))
                if p in procs]


@dataclass
class Topology:
    """Where each process of a group runs, and what the planner needs from that."""

    infos: list                   # process -> probe answer (node_id, pid, device, gpu_uuid)
    proc_nodes: list              # process -> node id
    src_domains: list             # source rank -> NVLink domain
    dst_domains: list
    src_devices: list             # source rank -> ("gpu", uuid) or ("proc", node, pid)
    dst_devices: list
    helpers: dict                 # node id -> node helper actor

    @property
    def on_gpu(self) -> list[bool]:
        return [i["device"].startswith("cuda") for i in self.infos]


def probe(members: Members, known: dict, collect: Callable, timeout: float,
          src_domains: Optional[Sequence[Any]] = None,
          dst_domains: Optional[Sequence[Any]] = None) -> Topology:
    """Ask every process where it runs and every node helper for its topology.

    Every member answers first: a dead or stuck one fails here, named (through `collect`, the
    group's failure-naming wait), before any live one starts joining a collective group that
    could never complete. `known` (actor key -> probe answer) is updated with the fresh answers:
    an actor Ray restarted may now run elsewhere. Explicit `src_domains`/`dst_domains` override
    the discovered domains.
    """
    procs = members.procs
    answers = collect([a.__ray_call__.remote(worker.probe) for a in procs], timeout, "setup")
    for a, info in zip(procs, answers):
        known[actor_key(a)] = info
    infos = [known[actor_key(a)] for a in procs]
    nodes = list(dict.fromkeys(i["node_id"] for i in infos))
    helpers = node_helpers(nodes, timeout)
    topo = dict(zip(nodes, ray.get([helpers[n].topology.remote() for n in nodes],
                                   timeout=timeout)))
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
    n_src, n_dst = len(members.src_actors), len(members.dst_actors)
    proc = lambda side, i: members.proc_of[Endpoint(side, i)]
    return Topology(
        infos, [i["node_id"] for i in infos],
        list(src_domains) if src_domains is not None else
        [proc_domain[proc("src", i)] for i in range(n_src)],
        list(dst_domains) if dst_domains is not None else
        [proc_domain[proc("dst", j)] for j in range(n_dst)],
        [proc_device[proc("src", i)] for i in range(n_src)],
        [proc_device[proc("dst", j)] for j in range(n_dst)],
        helpers)


# (cluster session, job, node id) -> NodeHelper, shared by this driver's groups
_HELPERS: dict = {}


def session() -> tuple:
    """The Ray instance and job the driver is connected to: helpers live as long as the
    driver's job, and a group must not call into another instance."""
    try:
        name = ray._private.worker._global_node.session_name
    except AttributeError:
        name = None
    return name, ray.get_runtime_context().get_job_id()


def node_helpers(nodes, timeout: float) -> dict:
    """One helper per node, started once per driver and reused (starting one costs seconds);
    helpers that died (node loss, a user's ray.kill) are replaced."""
    from .node_helper import start_node_helpers

    here = session()
    have = {n: _HELPERS[(here, n)] for n in nodes if (here, n) in _HELPERS}
    pings = {n: h.ping.remote() for n, h in have.items()}
    ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout)
    for n, ref in pings.items():
        try:
            ray.get(ref, timeout=0)
        except Exception:
            _HELPERS.pop((here, n), None)
            del have[n]
    missing = [n for n in nodes if n not in have]
    if missing:
        for n, h in start_node_helpers(missing).items():
            _HELPERS[(here, n)] = h
            have[n] = h
    return {n: have[n] for n in nodes}


def current_actor() -> Any:
    """The handle of the Ray actor this code runs in (Ray raises RuntimeError outside one)."""
    return ray.get_runtime_context().current_actor


def train_worker_actors(group=None) -> list:
    """Handles of every worker of a trainer that runs torch.distributed (a Ray Train run), in
    its rank order; call it on every worker (a collective over `group`, default the default
    process group)."""
    import torch.distributed as dist

    me = current_actor()
    if not dist.is_available() or not dist.is_initialized():
        return [me]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, me, group=group)
    return out
