"""Network transport: a torch.distributed process group registered as a Ray collective backend.

Ray 2.60's built-in "GLOO" backend initialises torch's *default* process group, one per process,
so a trainer that already runs torch.distributed (or an actor in two reshard groups) cannot use
it; its NCCL backend builds a two-rank communicator per peer pair for send/recv. We register our
own backends instead ("RR_GLOO", "RR_NCCL"): each group is a standalone, non-default
ProcessGroupGloo / ProcessGroupNCCL over its own TCPStore, rendezvoused through Ray's internal KV,
so any number of groups coexist in one process next to the user's own torch.distributed state.

Protocol of one group:

- Set-up. Rank 0 hosts the TCPStore and publishes its address in Ray's KV. Every rank builds the
  process group, then meets the others at a barrier made of store keys (``rr_ready/<rank>``): no
  collective runs at set-up, so the barrier works on any backend and any device sharing. NCCL
  then connects *eagerly* on the actor's own device: one communicator over all ranks, which every
  point-to-point operation uses (each send/recv is issued as a coalesced group of one, so torch
  never builds a two-rank communicator per peer pair).
- Abort. :meth:`TorchPGGroup.abort` writes ``rr_abort`` (first reason wins) in the group's store
  and breaks this process's pending operations. A watcher thread in every process polls that key
  every ``ABORT_POLL_S`` and breaks its own pending operations when it appears, so a failure
  anywhere ends every wait within about a second. Breaking: gloo cannot cancel a posted
  operation, but a *timed-out* wait closes every connection of the gloo context, which fails
  every pending operation of the process at once (and its direct peers see the connection
  close); the watcher provokes that with a 1 ms wait on a receive nobody sends. NCCL: the
  communicators are aborted (ncclCommAbort). Losing the store (rank 0's process died) counts as
  an abort too.
- Waits (:func:`wait`) honour what is left of the caller's deadline, including none (an
  immediate TransportTimeout), and raise TransportError naming the abort reason.
- NCCL errors. The group's ProcessGroupNCCL is built with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
  (abort the communicators, keep the process) and the heartbeat monitor off, for this group only:
  torch's default tears down the whole process (the user's trainer or engine) when an operation
  fails or times out. Our own deadlines come long before NCCL's.
- gloo with CUDA tensors: gloo's TCP transport reads host memory only, so point-to-point messages
  of CUDA tensors are staged through pinned host buffers (the receive copies back to the device
  when it completes).
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

import ray
from ray.util.collective.backend_registry import _global_registry, register_collective_backend
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from ...errors import TransportError, TransportTimeout

__all__ = ["TorchPGGroup", "TorchNCCLGroup", "Pending", "wait", "abort_group", "ensure_registered",
           "backend_name", "ABORT_POLL_S", "LATE_STORE_CHECK_S", "NCCL_GROUP_ENV"]

_KV_PREFIX = "ray_reshard_store:"
DEFAULT_OP_TIMEOUT_S = 1800.0
# Bound on joining a group (store connection, barrier, NCCL connect); the worker sets it per group.
RENDEZVOUS_TIMEOUT_S = 120.0
# How often every process looks for an abort written by another one.
ABORT_POLL_S = 0.2
# Bound on one store operation of the abort path: a frozen store host (process 0 stopped, not
# dead) must not hold a failing process past its deadline. The store is served by a thread of
# its own in process 0: a live host answers in milliseconds. A TCPStore client whose server
# stopped answering blocks in most operations whatever its timeout, so every store operation
# of a member's own thread runs in a helper thread it waits for at most this long (or until
# the refit's deadline, for a vote); see `TorchPGGroup._bounded`.
STORE_OP_TIMEOUT_S = 2.0
# Once a wait's deadline passed, how long a member still asks the store for an abort another
# member wrote (a frozen host makes this the moment it reports the store silent).
LATE_STORE_CHECK_S = 0.5
_ABORT_KEY = "rr_abort"
_BREAK_TAG = 0x5252_0000          # a gloo tag no message uses: the watcher's 1 ms receive
# Set while our ProcessGroupNCCL objects are built (torch reads them in the constructor).
NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
_ENV_LOCK = threading.Lock()


def _kv():
    import ray.experimental.internal_kv as kv
    return kv


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
        self._gstore = dist.PrefixStore(group_name + "/", self._store)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._subgroups: dict = {}
        self._barriers = 0
        self._lock = threading.Lock()
        self._aborted: Optional[str] = None
        self._stop = threading.Event()
        self.device = self._device()
        self.pg = self._make_pg(self._gstore, rank, world_size)
        # Everyone has built its process group once this returns (store keys only: no
        # collective, whatever the backend); the KV entry is then no longer needed. A member
        # that died during set-up fails the others here within the rendezvous timeout.
        store_barrier(self._gstore, "rr_ready", rank, world_size,
                      time.monotonic() + rendezvous_timeout_s, f"group {group_name!r} set-up")
        self._connect()
        if rank == 0:
            kv._internal_kv_del(key)
        # Aborts go through connections of their own with short timeouts, so that a frozen
        # store host cannot hold a failing process (the watcher thread has another one).
        self._abort_store = self._short_store()
        watch_store = self._short_store()
        # Votes go through a connection of their own. Once one store operation did not answer
        # in time, this says why, and no store operation of this member is tried again (the
        # helper thread of the one that did not answer may still hold its connection).
        self._vote_store = self._short_store()
        self._store_silent: Optional[str] = None
        self._watcher = threading.Thread(target=self._watch, args=(watch_store,),
                                         name=f"rr-abort-{group_name}", daemon=True)
        self._watcher.start()

    @property
    def store_address(self) -> tuple[str, int]:
        """(host, port) of the group's store, for :func:`abort_group` from another process."""
        return self._store.host, self._store.port

    def _short_store(self):
        client = self._store.clone()
        client.set_timeout(datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
        return dist.PrefixStore(self.group_name + "/", client)

    def _bounded(self, fn: Callable, deadline: float, what: str):
        """fn() (a store operation) run in a helper thread, waited for until `deadline`: a
        store whose host stopped answering raises TransportTimeout naming process 0 then,
        and every later store operation of this member at once."""
        if self._store_silent is not None:
            raise TransportTimeout(f"{what}: {self._store_silent}")
        out: dict = {}

        def call():
            try:
                out["value"] = fn()
            except BaseException as e:      # handed to the waiting thread
                out["error"] = e
        t = threading.Thread(target=call, name=f"rr-store-{self.group_name}", daemon=True)
        t.start()
        t.join(max(deadline - time.monotonic(), 0.05))
        if t.is_alive():
            self._store_silent = (f"the group's store did not answer: process 0 (its host) "
                                  f"stopped answering")
            raise TransportTimeout(f"{what}: {self._store_silent}")
        error = out.pop("error", None)
        if error is not None:
            try:
                raise error
            finally:        # no cycle through this frame: the caller's frames die with it
                error = None
        return out.get("value")

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
            raise _transport_error(what, e) from None

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
            store = dist.PrefixStore(tag, self._gstore)
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
        store = self._vote_store
        what = f"refit check ({name})"
        # A little past the deadline: the barrier itself raises at the deadline, naming the
        # ranks that did not vote, when the store answers.
        late = deadline + ABORT_POLL_S + 0.5
        try:
            if not ok:
                self._bounded(lambda: store.add(f"{name}/no", 1), deadline, what)
            self._bounded(lambda: store_barrier(store, name, self.rank, self.world_size,
                                                deadline, what, self._raise_if_aborted),
                          late, what)
            refused = self._bounded(lambda: store.add(f"{name}/no", 0), late, what)
        except TransportError:
            raise
        except Exception as e:            # the store's host (process 0) is gone
            self._raise_if_aborted(what)
            raise TransportError(f"{what}: the group's store (hosted by process 0) did not "
                                 f"answer before the deadline: process 0 stopped answering "
                                 f"({_cause(e)})") from None
        last, self._last_vote = getattr(self, "_last_vote", None), name
        if last is not None:
            def clear():
                store.delete_key(f"{last}/{self.rank}")
                if self.rank == 0:
                    store.delete_key(f"{last}/no")
            try:
                self._bounded(clear, time.monotonic() + STORE_OP_TIMEOUT_S, what)
            except Exception:
                pass
        return refused

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
            first = self._bounded(lambda: self._abort_store.compare_set(_ABORT_KEY, "", reason),
                                  time.monotonic() + STORE_OP_TIMEOUT_S, "abort")
            reason = bytes(first).decode(errors="replace") or reason
        except Exception:
            pass                        # the store is gone: the others' watchers notice that
        self._abort_local(reason)

    def _watch(self, store) -> None:
        misses = 0
        while not self._stop.wait(ABORT_POLL_S):
            try:
                if store.check([_ABORT_KEY]):
                    self._abort_local(store.get(_ABORT_KEY).decode(errors="replace"))
                    return
                misses = 0
            except Exception as e:
                misses += 1
                if misses >= 2 and not self._stop.is_set():
                    self._abort_local(f"the group's store (hosted by process 0) is unreachable: "
                                      f"{type(e).__name__}")
                    return

    def _abort_local(self, reason: str) -> None:
        with self._lock:
            if self._aborted is not None:
                return
            self._aborted = reason
        self._break()

    def _break(self) -> None:
        """Make every pending operation of this process fail now (see the module docstring)."""
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
            raise _transport_error(what, e) from None
        self._raise_if_aborted(what)
        if ok is False:
            raise TransportTimeout(f"{what}: timed out")

    def _check_store(self, seconds: float = STORE_OP_TIMEOUT_S) -> None:
        """Read an abort another process wrote, now (instead of at the watcher's next poll),
        waiting at most `seconds` for the store."""
        if self._aborted is not None:
            return

        def read():
            if self._abort_store.check([_ABORT_KEY]):
                return self._abort_store.get(_ABORT_KEY).decode(errors="replace")
            return None
        try:
            reason = self._bounded(read, time.monotonic() + seconds, "abort check")
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
        store_barrier(self._gstore, f"rr_barrier{self._barriers}", self.rank,
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
                f"{self.device} ({_gpu_name(self.device)}): {_cause(e)}") from None

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
                raise _transport_error(what, e) from None
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
            dist.PrefixStore(group_name + "/", client).compare_set(_ABORT_KEY, "",
                                                                   reason[:500])
            out["ok"] = True
        except Exception:
            pass
    t = threading.Thread(target=write, name="rr-abort-group", daemon=True)
    t.start()
    t.join(timeout_s + 0.5)
    return out.get("ok", False)


def store_barrier(store, name: str, rank: int, world: int, deadline: float, what: str,
                  check: Optional[Callable[[str], None]] = None) -> None:
    """Wait until every rank set `name/<rank>` in `store` (or raise TransportTimeout naming the
    missing ranks at `deadline`). `check(what)` runs between short waits (it raises to stop
    waiting, e.g. when the group was aborted)."""
    store.set(f"{name}/{rank}", b"1")
    keys = [f"{name}/{r}" for r in range(world)]
    step = 1.0 if check is None else ABORT_POLL_S
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, datetime.timedelta(seconds=max(min(left, step), 0.001)))
            return
        except Exception:
            # A wait shorter than a round trip to the store times out even once every key is
            # there (a link with a few hundred ms of delay): ask whether they are.
            if _has(store, keys):
                return
            if check is not None:
                check(what)
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not _has(store, k)]
                raise TransportTimeout(f"{what}: ranks {missing} did not arrive") from None


def _has(store, keys) -> bool:
    """Whether `store` holds every key of `keys` (a key or a list of them)."""
    try:
        return store.check(keys if isinstance(keys, list) else [keys])
    except Exception:
        return False


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())


def _gpu_name(device) -> str:
    try:
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, uuid {p.uuid}"
    except Exception:
        return "unknown GPU"


def _cause(e: BaseException) -> str:
    """An exception's message on one line, with its most telling parts first: NCCL puts the
    reason after a "Last error:" line, which the first line alone would lose."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    picked = [lines[0]]
    for i, ln in enumerate(lines[1:], 1):
        if ln.lower().startswith("last error"):
            rest = ln.split(":", 1)[1].strip() if ":" in ln else ""
            picked.append(rest or (lines[i + 1] if i + 1 < len(lines) else ""))
        elif ln.lower().startswith(("nccl", "cuda error")):
            picked.append(ln)
    return " | ".join(p for p in picked if p)[:600]


def _transport_error(what: str, e: BaseException) -> TransportError:
    msg = str(e)
    if "Timed out" in msg or "timeout" in msg.lower():
        return TransportTimeout(f"{what}: timed out ({_cause(e)})")
    return TransportError(f"{what}: {_cause(e)}")


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
        raise _transport_error(what, e) from None
    if ok is False:
        raise TransportTimeout(f"{what}: timed out")
