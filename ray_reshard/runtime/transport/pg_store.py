"""A process group's store: rendezvous, barriers, votes and the abort key, as one member sees it.

Process 0 hosts the group's TCPStore and publishes its address in Ray's internal KV; the others
read it there. Barriers and votes are store keys only (no collective, whatever the backend).
The abort reason lives under one key that every member's watcher polls. A store host that stops
answering must not hold a member past its deadline: its operations run in helper threads with
bounded waits (`GroupStore.bounded`). Nothing here posts a message or knows a tensor.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

import ray

from ...errors import TransportError, TransportTimeout
from .pg_errors import cause

__all__ = ["GroupStore", "store_barrier", "watch_aborts", "ABORT_KEY", "ABORT_POLL_S",
           "STORE_OP_TIMEOUT_S", "LATE_STORE_CHECK_S"]

_KV_PREFIX = "ray_reshard_store:"
# How often every process looks for an abort written by another one.
ABORT_POLL_S = 0.2
# Bound on one store operation of the abort path: a frozen store host (process 0 stopped, not
# dead) must not hold a failing process past its deadline. The store is served by a thread of
# its own in process 0: a live host answers in milliseconds. A TCPStore client whose server
# stopped answering blocks in most operations whatever its timeout, so every store operation
# of a member's own thread runs in a helper thread it waits for at most this long (or until
# the refit's deadline, for a vote); see `GroupStore.bounded`.
STORE_OP_TIMEOUT_S = 2.0
# Once a wait's deadline passed, how long a member still asks the store for an abort another
# member wrote (a frozen host makes this the moment it reports the store silent).
LATE_STORE_CHECK_S = 0.5
ABORT_KEY = "rr_abort"


def _kv():
    import ray.experimental.internal_kv as kv
    return kv


class GroupStore:
    """One member's connections to its group's store (hosted by process 0).

    `keys` is the group's key space (set-up, barriers, the process groups' own keys); aborts,
    votes and the watcher each use a connection of their own with short timeouts, opened by
    `open_side_connections` once the group is set up."""

    def __init__(self, group_name: str, rank: int, world_size: int, rendezvous_s: float):
        self.group_name, self.rank, self.world_size = group_name, rank, world_size
        key = _KV_PREFIX + group_name
        kv = _kv()
        timeout = datetime.timedelta(seconds=rendezvous_s)
        if rank == 0:
            host = ray.util.get_node_ip_address()
            self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout,
                                       wait_for_workers=False)
            kv._internal_kv_put(key, f"{host}:{self.store.port}", overwrite=True)
        else:
            deadline = time.monotonic() + rendezvous_s
            while True:
                addr = kv._internal_kv_get(key)
                if addr is not None:
                    break
                if time.monotonic() > deadline:
                    raise TransportTimeout(f"group {group_name!r}: rank 0 never published its "
                                           f"store address ({rendezvous_s:.0f} s)")
                time.sleep(0.02)
            host, port = addr.decode().rsplit(":", 1)
            self.store = dist.TCPStore(host, int(port), world_size, is_master=False,
                                       timeout=timeout)
        self.keys = dist.PrefixStore(group_name + "/", self.store)
        # Once one store operation did not answer in time, this says why, and no store
        # operation of this member is tried again (the helper thread of the one that did not
        # answer may still hold its connection).
        self.silent: Optional[str] = None
        self._abort_keys = self._vote_keys = None
        self._last_vote: Optional[str] = None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the store."""
        return self.store.host, self.store.port

    def open_side_connections(self):
        """Everyone has joined: forget the published address (process 0) and open the abort
        and vote connections; returns the watcher's own connection."""
        if self.rank == 0:
            _kv()._internal_kv_del(_KV_PREFIX + self.group_name)
        self._abort_keys = self._short()
        watch_keys = self._short()
        self._vote_keys = self._short()
        return watch_keys

    def _short(self):
        client = self.store.clone()
        client.set_timeout(datetime.timedelta(seconds=STORE_OP_TIMEOUT_S))
        return dist.PrefixStore(self.group_name + "/", client)

    def bounded(self, fn: Callable, deadline: float, what: str):
        """fn() (a store operation) run in a helper thread, waited for until `deadline`: a
        store whose host stopped answering raises TransportTimeout naming process 0 then,
        and every later store operation of this member at once."""
        if self.silent is not None:
            raise TransportTimeout(f"{what}: {self.silent}")
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
            self.silent = ("the group's store did not answer: process 0 (its host) "
                           "stopped answering")
            raise TransportTimeout(f"{what}: {self.silent}")
        error = out.pop("error", None)
        if error is not None:
            try:
                raise error
            finally:        # no cycle through this frame: the caller's frames die with it
                error = None
        return out.get("value")

    def write_abort(self, reason: str) -> str:
        """Write `reason` under the abort key unless one is there; the reason that stands."""
        first = self.bounded(lambda: self._abort_keys.compare_set(ABORT_KEY, "", reason),
                             time.monotonic() + STORE_OP_TIMEOUT_S, "abort")
        return bytes(first).decode(errors="replace") or reason

    def read_abort(self, seconds: float) -> Optional[str]:
        """The abort reason another member wrote, or None; waits at most `seconds` (a store
        that does not answer raises TransportTimeout)."""
        def read():
            if self._abort_keys.check([ABORT_KEY]):
                return self._abort_keys.get(ABORT_KEY).decode(errors="replace")
            return None
        return self.bounded(read, time.monotonic() + seconds, "abort check")

    def vote(self, name: str, ok: bool, deadline: float, check: Callable[[str], None]) -> int:
        """See `TorchPGGroup.vote`; `check(what)` raises once the group was aborted."""
        store = self._vote_keys
        what = f"refit check ({name})"
        # A little past the deadline: the barrier itself raises at the deadline, naming the
        # ranks that did not vote, when the store answers.
        late = deadline + ABORT_POLL_S + 0.5
        try:
            if not ok:
                self.bounded(lambda: store.add(f"{name}/no", 1), deadline, what)
            self.bounded(lambda: store_barrier(store, name, self.rank, self.world_size,
                                               deadline, what, check),
                         late, what)
            refused = self.bounded(lambda: store.add(f"{name}/no", 0), late, what)
        except TransportError:
            raise
        except Exception as e:            # the store's host (process 0) is gone
            check(what)
            raise TransportError(f"{what}: the group's store (hosted by process 0) did not "
                                 f"answer before the deadline: process 0 stopped answering "
                                 f"({cause(e)})") from None
        last, self._last_vote = self._last_vote, name
        if last is not None:
            def clear():
                store.delete_key(f"{last}/{self.rank}")
                if self.rank == 0:
                    store.delete_key(f"{last}/no")
            try:
                self.bounded(clear, time.monotonic() + STORE_OP_TIMEOUT_S, what)
            except Exception:
                pass
        return refused


def watch_aborts(keys, on_abort: Callable[[str], None], stop: threading.Event) -> None:
    """Poll the abort key through `keys` every ABORT_POLL_S until `stop`; call `on_abort` with
    the reason found, or with the store's loss (two failed polls in a row), and return."""
    misses = 0
    while not stop.wait(ABORT_POLL_S):
        try:
            if keys.check([ABORT_KEY]):
                on_abort(keys.get(ABORT_KEY).decode(errors="replace"))
                return
            misses = 0
        except Exception as e:
            misses += 1
            if misses >= 2 and not stop.is_set():
                on_abort(f"the group's store (hosted by process 0) is unreachable: "
                         f"{type(e).__name__}")
                return


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
