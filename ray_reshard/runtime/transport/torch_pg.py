"""Network transport: a torch.distributed process group registered as a Ray collective backend.

Our backends ("RR_GLOO", "RR_NCCL") are standalone, non-default ProcessGroupGloo /
ProcessGroupNCCL objects over the group's own store (`pg_store.py`), so any number of groups
live in one process beside the user's own torch.distributed state. An abort anywhere breaks
every member's pending operations within about a second; waits honour the caller's deadline.
NCCL groups abort their communicators on an error instead of ending the process. It knows
nothing of plans or programs: it moves tensors between group ranks.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ray.util.collective.backend_registry import _global_registry, register_collective_backend
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from ...errors import TransportError, TransportTimeout
from .pg_errors import cause, gpu_name, transport_error
from .pg_store import (ABORT_KEY, LATE_STORE_CHECK_S, STORE_OP_TIMEOUT_S, GroupStore,
                       store_barrier, watch_aborts)

__all__ = ["TorchPGGroup", "TorchNCCLGroup", "Pending", "wait", "abort_group", "ensure_registered",
           "backend_name", "NCCL_GROUP_ENV", "RENDEZVOUS_TIMEOUT_S"]

DEFAULT_OP_TIMEOUT_S = 1800.0
# Bound on joining a group (store connection, barrier, NCCL connect); the worker sets it per group.
RENDEZVOUS_TIMEOUT_S = 120.0
_BREAK_TAG = 0x5252_0000          # a gloo tag no message uses: the watcher's 1 ms receive
# Set while our ProcessGroupNCCL objects are built (torch reads them in the constructor):
# abort the communicators on an error and keep the process, no heartbeat monitor.
NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _env(values: dict):
    with _ENV_LOCK:
        old = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class Pending:
    """One posted operation of a group: ``wait(deadline, what)`` or the module's :func:`wait`.

    `after` runs once the operation completed (e.g. copying a staged receive to the device);
    `keep` holds buffers alive until then."""

    __slots__ = ("group", "work", "after", "keep", "done")

    def __init__(self, group: "TorchPGGroup", work, after: Optional[Callable] = None, keep=None):
        self.group, self.work, self.after, self.keep = group, work, after, keep
        self.done = False

    def wait(self, deadline=None, what: str = "operation") -> None:
        """Wait until `deadline` (time.monotonic(); a timedelta is read as time from now; None:
        the group's operation timeout). Waiting again after it completed returns at once (a
        gloo work must be waited once only: each wait takes one completion)."""
        if self.done:
            return
        if deadline is None:
            deadline = self.group._forever()
        elif isinstance(deadline, datetime.timedelta):
            deadline = time.monotonic() + deadline.total_seconds()
        self.group._wait_work(self.work, deadline, what)
        self.done = True
        if self.after is not None:
            after, self.after = self.after, None
            after()
        self.keep = None

    def is_completed(self) -> bool:
        """Whether it completed (NCCL: on the GPU; gloo reports completion only through a
        wait, so this stays False there until waited for)."""
        return self.done or (self.after is None and self.keep is None and
                             self.work.is_completed())


class PendingGroup:
    """Several posted operations waited for as one (in posting order; waiting again after they
    completed returns at once)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list):
        self.parts = parts

    def wait(self, deadline=None, what: str = "operation") -> None:
        for p in self.parts:
            p.wait(deadline, what)

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self.parts)


class _BoundPG:
    """A torch process group whose operations return :class:`Pending` of the owning group."""

    def __init__(self, group: "TorchPGGroup", pg):
        self._group, self._pg = group, pg

    def __getattr__(self, name):
        attr = getattr(self._pg, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            return Pending(self._group, out) if isinstance(out, dist.Work) else out
        return call


class TorchPGGroup(BaseGroup):
    """A non-default torch process group; the transport of one ReshardGroup in one process."""

    pg_backend = "gloo"

    def __init__(self, world_size: int, rank: int, group_name: str,
                 timeout_s: float = DEFAULT_OP_TIMEOUT_S,
                 rendezvous_timeout_s: Optional[float] = None):
        super().__init__(world_size, rank, group_name)
        if rendezvous_timeout_s is None:
            rendezvous_timeout_s = RENDEZVOUS_TIMEOUT_S
        self._rendezvous_s = rendezvous_timeout_s
        self.store = GroupStore(group_name, rank, world_size, rendezvous_timeout_s)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._subgroups: dict = {}
        self._barriers = 0
        self._lock = threading.Lock()
        self._aborted: Optional[str] = None
        self._stop = threading.Event()
        self.device = self._device()
        self.pg = self._make_pg(self.store.keys, rank, world_size)
        # Everyone has built its process group once this returns (store keys only: no
        # collective, whatever the backend). A member that died during set-up fails the others
        # here within the rendezvous timeout.
        store_barrier(self.store.keys, "rr_ready", rank, world_size,
                      time.monotonic() + rendezvous_timeout_s, f"group {group_name!r} set-up")
        self._connect()
        # Aborts, votes and the watcher thread go through connections of their own with short
        # timeouts, so that a frozen store host cannot hold a failing process.
        watch_keys = self.store.open_side_connections()
        self._watcher = threading.Thread(target=watch_aborts,
                                         args=(watch_keys, self._abort_local, self._stop),
                                         name=f"rr-abort-{group_name}", daemon=True)
        self._watcher.start()

    @property
    def store_address(self) -> tuple[str, int]:
        """(host, port) of the group's store, for :func:`abort_group` from another process."""
        return self.store.address

    # -- backend specifics (overridden by the NCCL variant)
    def _device(self) -> Optional[torch.device]:
        return None

    def _make_pg(self, store, rank, size):
        # gloo connects every pair in its constructor, bounded by the timeout it is given: the
        # rendezvous bound there, the operations' default after.
        pg = dist.ProcessGroupGloo(store, rank, size,
                                   datetime.timedelta(seconds=self._rendezvous_s))
        pg._set_default_timeout(self._timeout)
        return pg

    def _connect(self) -> None:
        """gloo connected every pair in its constructor."""

    @classmethod
    def backend(cls):
        return "RR_" + cls.pg_backend.upper()

    @classmethod
    def check_backend_availability(cls) -> bool:
        return dist.is_available() and (cls.pg_backend != "nccl" or torch.cuda.is_available())

    # -- point-to-point, asynchronous: the executor keeps a bounded window of these in flight
    def isend(self, tensor: torch.Tensor, peer: int) -> Pending:
        if tensor.is_cuda:            # gloo reads host memory only: stage in pinned memory
            host = _host_like(tensor)
            host.copy_(tensor)
            return Pending(self, self._post(self.pg.send, host, peer, "send"), keep=host)
        return Pending(self, self._post(self.pg.send, tensor, peer, "send"))

    def irecv(self, tensor: torch.Tensor, peer: int) -> Pending:
        if tensor.is_cuda:
            host = _host_like(tensor)
            return Pending(self, self._post(self.pg.recv, host, peer, "recv"),
                           after=lambda: tensor.copy_(host), keep=host)
        return Pending(self, self._post(self.pg.recv, tensor, peer, "recv"))

    def _post(self, op, tensor, peer: int, kind: str):
        """Post one operation; a peer already gone (gloo refuses at once) is a TransportError."""
        what = f"{kind} {'to' if kind == 'send' else 'from'} process {peer}"
        self._raise_if_aborted(what)
        try:
            return op([tensor], peer, 0)
        except RuntimeError as e:
            self._check_store()
            self._raise_if_aborted(what)
            raise transport_error(what, e) from None

    def post_group(self, ops: list) -> "PendingGroup":
        """Sends and receives `ops` = [(peer, tensor, sending)] posted together; one handle
        waits for all (gloo runs them independently; the NCCL variant launches one group)."""
        return PendingGroup([self.isend(t, peer) if sending else self.irecv(t, peer)
                             for peer, t, sending in ops])

    def subgroup(self, ranks: tuple[int, ...]):
        """A process group over `ranks` (group ranks); every member must ask for it in the same
        order. Used by the gather-broadcast baseline's collectives; its operations return
        :class:`Pending` (aborted with the group)."""
        ranks = tuple(ranks)
        if ranks not in self._subgroups:
            tag = "sub" + "-".join(map(str, ranks)) + "/"
            store = dist.PrefixStore(tag, self.store.keys)
            self._subgroups[ranks] = (self._make_pg(store, ranks.index(self.rank), len(ranks)),
                                      ranks)
        return _BoundPG(self, self._subgroups[ranks][0])

    # -- agreement
    def vote(self, name: str, ok: bool, deadline: float) -> int:
        """Every member says whether it can go on; returns how many said no (every member
        gets the same count). Store keys only (no collective, whatever the backend); waits
        until `deadline` at most, and an abort from any member ends the wait at once.
        Ballots must be cast in the same order everywhere; each member clears its key of the
        previous ballot (every member has passed it by the time this one completes)."""
        return self.store.vote(name, ok, deadline, self._raise_if_aborted)

    # -- abort
    @property
    def aborted(self) -> Optional[str]:
        """The reason this group was aborted (here or by any member), or None."""
        return self._aborted

    def abort(self, reason: Optional[str] = None) -> None:
        """Fail every pending and later operation of the group, in every process: the reason
        goes to the group's store (the first one wins) and this process's operations are broken
        at once; the other members' watchers break theirs within ABORT_POLL_S."""
        reason = (reason or f"process {self.rank} aborted the group")[:500]
        try:
            reason = self.store.write_abort(reason)
        except Exception:
            pass                        # the store is gone: the others' watchers notice that
        self._abort_local(reason)

    def _abort_local(self, reason: str) -> None:
        with self._lock:
            if self._aborted is not None:
                return
            self._aborted = reason
        self._break()

    def _break(self) -> None:
        """Make every pending operation of this process fail now. gloo cannot cancel a posted
        operation, but a timed-out wait closes every connection of its context, which fails
        every pending operation of the process at once (its direct peers see the connections
        close): a 1 ms wait on a receive nobody sends provokes that."""
        pgs = [(self.pg, tuple(range(self.world_size))), *list(self._subgroups.values())]
        for pg, ranks in pgs:
            if len(ranks) < 2:
                continue
            me = ranks.index(self.rank)
            try:
                work = pg.recv([torch.empty(1, dtype=torch.uint8)], (me + 1) % len(ranks),
                               _BREAK_TAG)
                work.wait(datetime.timedelta(milliseconds=1))
            except Exception:
                pass

    # -- waits
    def _wait_work(self, work, deadline: float, what: str) -> None:
        self._raise_if_aborted(what)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout(f"{what}: deadline passed")
        try:
            # At least 1 ms: a zero timedelta means "no timeout" to Work.wait.
            ok = work.wait(datetime.timedelta(seconds=max(left, 0.001)))
        except RuntimeError as e:
            # A peer that aborted closed its connections first: read its reason (briefly once
            # the deadline passed: the timeout is then the error, and the caller's deadline
            # is not to be stretched by a store that does not answer).
            self._check_store(LATE_STORE_CHECK_S if time.monotonic() >= deadline
                              else STORE_OP_TIMEOUT_S)
            self._raise_if_aborted(what)
            raise transport_error(what, e) from None
        self._raise_if_aborted(what)
        if ok is False:
            raise TransportTimeout(f"{what}: timed out")

    def _check_store(self, seconds: float = STORE_OP_TIMEOUT_S) -> None:
        """Read an abort another process wrote, now (instead of at the watcher's next poll),
        waiting at most `seconds` for the store."""
        if self._aborted is not None:
            return
        try:
            reason = self.store.read_abort(seconds)
        except TransportTimeout as e:   # the store's host stopped answering: that is the cause
            self._abort_local(str(e))
            return
        except Exception:
            return
        if reason is not None:
            self._abort_local(reason)

    def _raise_if_aborted(self, what: str) -> None:
        if self._aborted is not None:
            raise TransportError(f"{what}: group aborted: {self._aborted}")

    def destroy_group(self):
        self._stop.set()
        for pg, _ in [*self._subgroups.values(), (self.pg, None)]:
            try:
                pg.shutdown()
            except Exception:
                pass
        self._subgroups.clear()

    # BaseGroup's collective API, for completeness (Ray's helpers call these).
    def _forever(self):
        return time.monotonic() + self._timeout.total_seconds()

    def send(self, tensor, send_options):
        self.isend(tensor, send_options.dst_rank).wait(self._forever(), "send")

    def recv(self, tensor, recv_options):
        self.irecv(tensor, recv_options.src_rank).wait(self._forever(), "recv")

    def barrier(self, barrier_options=None):
        self._barriers += 1             # every rank counts its barriers alike: same key
        store_barrier(self.store.keys, f"rr_barrier{self._barriers}", self.rank,
                      self.world_size, self._forever(), "barrier")

    def broadcast(self, tensor, broadcast_options=None):
        opts = dist.BroadcastOptions()
        opts.rootRank = broadcast_options.root_rank if broadcast_options else 0
        self._wait_work(self.pg.broadcast([tensor], opts), self._forever(), "broadcast")

    def allgather(self, tensor_list, tensor, allgather_options=None):
        self._wait_work(self.pg.allgather([tensor_list], [tensor]), self._forever(), "allgather")

    def allreduce(self, tensor, allreduce_options=None):
        self._wait_work(self.pg.allreduce([tensor]), self._forever(), "allreduce")

    def reduce(self, tensor, reduce_options=None):
        raise NotImplementedError("reduce is not used by ray-reshard")

    def reducescatter(self, tensor, tensor_list, reducescatter_options=None):
        raise NotImplementedError("reducescatter is not used by ray-reshard")


class TorchNCCLGroup(TorchPGGroup):
    """The GPU variant: ProcessGroupNCCL with one communicator (all ranks) on this actor's
    device, connected at set-up; point-to-point operations are issued as coalesced groups of one
    so that they use it."""

    pg_backend = "nccl"

    def _device(self) -> torch.device:
        # Ray gives a GPU actor CUDA_VISIBLE_DEVICES with its own GPU(s): the current device.
        return torch.device("cuda", torch.cuda.current_device())

    def _make_pg(self, store, rank, size):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        with _env(NCCL_GROUP_ENV):
            return dist.ProcessGroupNCCL(store, rank, size, opts)

    def _connect(self) -> None:
        try:
            self.pg.eager_connect_single_device(self.device)
        except Exception as e:
            raise TransportError(
                f"group {self.group_name!r}: NCCL could not connect rank {self.rank} on "
                f"{self.device} ({gpu_name(self.device)}): {cause(e)}") from None

    def isend(self, tensor: torch.Tensor, peer: int) -> Pending:
        return self._p2p(self.pg.send, tensor, peer)

    def irecv(self, tensor: torch.Tensor, peer: int) -> Pending:
        return self._p2p(self.pg.recv, tensor, peer)

    def _p2p(self, op, tensor, peer) -> Pending:
        return self._group_p2p([(op, tensor, peer)])

    def post_group(self, ops: list) -> Pending:
        """Sends and receives `ops` = [(peer, tensor, sending)] as one NCCL group: one launch,
        one handle (what `torch.distributed.batch_isend_irecv` does). Every member must group
        the same operations."""
        return self._group_p2p([(self.pg.send if sending else self.pg.recv, t, peer)
                                for peer, t, sending in ops])

    def _group_p2p(self, ops) -> Pending:
        # Point-to-point operations inside a coalescing group run on the group's one
        # communicator over all ranks (outside one, NCCL makes a 2-rank communicator per pair).
        if self._aborted is not None:
            raise TransportError(f"group aborted: {self._aborted}")
        for _, t, _ in ops:
            if not t.is_cuda:
                raise TransportError(f"NCCL moves CUDA tensors only, got one on {t.device}")
        self.pg._start_coalescing(self.device)
        try:
            for op, t, peer in ops:
                op([t], peer, 0)
        finally:
            work = self.pg._end_coalescing(self.device)
        return Pending(self, work)

    def _break(self) -> None:
        for pg, _ in [(self.pg, None), *self._subgroups.values()]:
            try:
                pg.abort()
            except Exception:
                pass

    def _wait_work(self, work, deadline: float, what: str) -> None:
        # NCCL work completes on the GPU: poll it, so the deadline and aborts are seen at once.
        pause = 0.0001
        while True:
            self._raise_if_aborted(what)
            try:
                if work.is_completed():
                    work.wait()            # orders the current stream after it; raises its error
                    break
            except RuntimeError as e:
                self._check_store()
                self._raise_if_aborted(what)
                raise transport_error(what, e) from None
            if time.monotonic() >= deadline:
                raise TransportTimeout(f"{what}: deadline passed")
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
        self._raise_if_aborted(what)


def abort_group(address: tuple[str, int], group_name: str, reason: str,
                timeout_s: float = 2.0) -> bool:
    """Abort group `group_name` from a process outside it (the driver, when a member died):
    write the abort reason in its store, where every member's watcher finds it. Returns
    whether the store took it (False when it is gone: its host died, which members see too)."""
    out: dict = {}

    def write():                # in a thread: a frozen store host would block it for ever
        try:
            client = dist.TCPStore(address[0], address[1], is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
            dist.PrefixStore(group_name + "/", client).compare_set(ABORT_KEY, "",
                                                                   reason[:500])
            out["ok"] = True
        except Exception:
            pass
    t = threading.Thread(target=write, name="rr-abort-group", daemon=True)
    t.start()
    t.join(timeout_s + 0.5)
    return out.get("ok", False)



def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())



def ensure_registered() -> None:
    """Register our backends in this process (driver and each actor must do it)."""
    for cls in (TorchPGGroup, TorchNCCLGroup):
        if not _global_registry.is_registered(cls.backend()):
            register_collective_backend(cls.backend(), cls)


def backend_name(kind: str) -> str:
    return {"gloo": TorchPGGroup.backend(), "nccl": TorchNCCLGroup.backend()}[kind]


def wait(work, deadline: float, what: str) -> None:
    """Wait for a posted operation until `deadline` (time.monotonic()); raise TransportTimeout
    when it passes (at once when none is left) or TransportError (peer gone, group aborted)."""
    if isinstance(work, (Pending, PendingGroup)):
        work.wait(deadline, what)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeout(f"{what}: deadline passed")
    try:
        ok = work.wait(datetime.timedelta(seconds=max(left, 0.001)))
    except RuntimeError as e:
        raise transport_error(what, e) from None
    if ok is False:
        raise TransportTimeout(f"{what}: timed out")
