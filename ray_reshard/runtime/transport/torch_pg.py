"""Network transport: a torch.distributed process group registered as a Ray collective backend.

Ray 2.60's built-in "GLOO" backend initialises torch's *default* process group, one per process,
so a trainer that already runs torch.distributed (or an actor in two reshard groups) cannot use
it; its NCCL backend builds a two-rank communicator per peer pair for send/recv. We register our
own backends instead ("RR_GLOO", "RR_NCCL"): each group is a standalone, non-default
ProcessGroupGloo / ProcessGroupNCCL over its own TCPStore, rendezvoused through Ray's internal KV,
so any number of groups coexist in one process next to the user's own torch.distributed state.
"""
from __future__ import annotations

import datetime
import time
from typing import Optional

import torch
import torch.distributed as dist

import ray
from ray.util.collective.backend_registry import _global_registry, register_collective_backend
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from ...errors import TransportError, TransportTimeout

_KV_PREFIX = "ray_reshard_store:"
DEFAULT_OP_TIMEOUT_S = 1800.0
# Bound on joining a group (store connection, first barrier); the executor sets it per group.
RENDEZVOUS_TIMEOUT_S = 120.0


def _kv():
    import ray.experimental.internal_kv as kv
    return kv


class TorchPGGroup(BaseGroup):
    """A non-default torch process group; the transport of one ReshardGroup in one process."""

    pg_backend = "gloo"

    def __init__(self, world_size: int, rank: int, group_name: str,
                 timeout_s: float = DEFAULT_OP_TIMEOUT_S,
                 rendezvous_timeout_s: Optional[float] = None):
        super().__init__(world_size, rank, group_name)
        if rendezvous_timeout_s is None:
            rendezvous_timeout_s = RENDEZVOUS_TIMEOUT_S
        key = _KV_PREFIX + group_name
        kv = _kv()
        if rank == 0:
            host = ray.util.get_node_ip_address()
            self._store = dist.TCPStore(host, 0, world_size, is_master=True,
                                        timeout=datetime.timedelta(seconds=rendezvous_timeout_s),
                                        wait_for_workers=False)
            kv._internal_kv_put(key, f"{host}:{self._store.port}", overwrite=True)
        else:
            deadline = time.monotonic() + rendezvous_timeout_s
            while True:
                addr = kv._internal_kv_get(key)
                if addr is not None:
                    break
                if time.monotonic() > deadline:
                    raise TransportTimeout(f"group {group_name!r}: rank 0 never published its "
                                           f"store address ({rendezvous_timeout_s:.0f} s)")
                time.sleep(0.02)
            host, port = addr.decode().rsplit(":", 1)
            self._store = dist.TCPStore(host, int(port), world_size, is_master=False,
                                        timeout=datetime.timedelta(seconds=rendezvous_timeout_s))
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = self._make_pg(dist.PrefixStore(group_name + "/", self._store), rank, world_size)
        self._subgroups: dict = {}
        # Everyone has connected once this returns; the KV entry is no longer needed. A member
        # that died during set-up fails the others here within the rendezvous timeout.
        self.pg.barrier().wait(datetime.timedelta(seconds=rendezvous_timeout_s))
        if rank == 0:
            kv._internal_kv_del(key)

    def _make_pg(self, store, rank, size):
        return dist.ProcessGroupGloo(store, rank, size, self._timeout)

    @classmethod
    def backend(cls):
        return "RR_" + cls.pg_backend.upper()

    @classmethod
    def check_backend_availability(cls) -> bool:
        return dist.is_available() and (cls.pg_backend != "nccl" or torch.cuda.is_available())

    # Point-to-point, asynchronous: the executor keeps a bounded window of these in flight.
    def isend(self, tensor: torch.Tensor, peer: int):
        return self.pg.send([tensor], peer, 0)

    def irecv(self, tensor: torch.Tensor, peer: int):
        return self.pg.recv([tensor], peer, 0)

    def subgroup(self, ranks: tuple[int, ...]):
        """A process group over `ranks` (group ranks); every member must ask for it in the same
        order. Used by the gather-broadcast baseline's collectives."""
        ranks = tuple(ranks)
        if ranks not in self._subgroups:
            tag = "sub" + "-".join(map(str, ranks)) + "/"
            store = dist.PrefixStore(self.group_name + "/" + tag, self._store)
            self._subgroups[ranks] = self._make_pg(store, ranks.index(self.rank), len(ranks))
        return self._subgroups[ranks]

    def abort(self) -> None:
        """Break any pending operation so blocked ranks fail fast; the group is unusable after."""
        for pg in [self.pg, *self._subgroups.values()]:
            try:
                pg.abort()
            except Exception:
                pass

    def destroy_group(self):
        for pg in [*self._subgroups.values(), self.pg]:
            try:
                pg.shutdown()
            except Exception:
                pass
        self._subgroups.clear()
        self._store = None

    # BaseGroup's collective API, for completeness (Ray's helpers call these).
    def send(self, tensor, send_options):
        self.isend(tensor, send_options.dst_rank).wait()

    def recv(self, tensor, recv_options):
        self.irecv(tensor, recv_options.src_rank).wait()

    def barrier(self, barrier_options=None):
        self.pg.barrier().wait()

    def broadcast(self, tensor, broadcast_options=None):
        opts = dist.BroadcastOptions()
        opts.rootRank = broadcast_options.root_rank if broadcast_options else 0
        self.pg.broadcast([tensor], opts).wait()

    def allgather(self, tensor_list, tensor, allgather_options=None):
        self.pg.allgather([tensor_list], [tensor]).wait()

    def allreduce(self, tensor, allreduce_options=None):
        self.pg.allreduce([tensor]).wait()

    def reduce(self, tensor, reduce_options=None):
        raise NotImplementedError("reduce is not used by ray-reshard")

    def reducescatter(self, tensor, tensor_list, reducescatter_options=None):
        raise NotImplementedError("reducescatter is not used by ray-reshard")


class TorchNCCLGroup(TorchPGGroup):
    """The GPU variant: ProcessGroupNCCL, one communicator for all peers of the group."""

    pg_backend = "nccl"

    def _make_pg(self, store, rank, size):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)


def ensure_registered() -> None:
    """Register our backends in this process (driver and each actor must do it)."""
    for cls in (TorchPGGroup, TorchNCCLGroup):
        if not _global_registry.is_registered(cls.backend()):
            register_collective_backend(cls.backend(), cls)


def backend_name(kind: str) -> str:
    return {"gloo": TorchPGGroup.backend(), "nccl": TorchNCCLGroup.backend()}[kind]


def wait(work, deadline: float, what: str) -> None:
    """Wait for a torch Work until `deadline` (time.monotonic()); raise TransportTimeout/Error."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeout(f"{what}: deadline passed")
    try:
        ok = work.wait(datetime.timedelta(seconds=left))
    except RuntimeError as e:
        msg = str(e)
        if "Timed out" in msg or "timeout" in msg.lower():
            raise TransportTimeout(f"{what}: timed out") from None
        raise TransportError(f"{what}: {msg.splitlines()[0] if msg else type(e).__name__}") from None
    if ok is False:
        raise TransportTimeout(f"{what}: timed out")
