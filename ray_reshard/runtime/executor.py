"""Running one process's compiled program (execution/program.py) over its channels
(channel.py): the steps in the order `ray_reshard.planning.schedule` defines (run order, network
groups, the staging window: its docstring), network buckets posted in groups, ring steps in runs,
delta refits group by group as runtime/delta.py describes. It never plans, compiles or chooses
an order; the reshard strategy (strategies.py) runs its programs with `run_program`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..errors import TransportTimeout
from .._gc import gc_paused
from ..planning.schedule import default_window, group_span
from ..planning.moves import NETWORK
from ..execution.program import COPY, SEND, Program
from .channel import Channel, NetChannel, RingChannel
from .delta import HEADER
from ..execution.delta import DENSE as DELTA_DENSE, SAME as DELTA_SAME

now = time.perf_counter


class Staging:
    """`window` staging buffers used in rotation (kept across refits, so the wire views cached
    on them stay valid); a buffer is reused only once the message that held it completed."""

    def __init__(self, window: int, nbytes: int, device: torch.device):
        self.window, self.nbytes, self.device = window, nbytes, device
        self.buffers: list = []
        self.busy: list = []
        self.next = 0

    def acquire(self, wait_one: Callable[[], None]) -> int:
        i = self.next
        self.next = (i + 1) % self.window
        if i == len(self.buffers):
            self.buffers.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
            self.busy.append(False)
        while self.busy[i]:
            wait_one()
        self.busy[i] = True
        return i

    def release(self, i: int) -> None:
        self.busy[i] = False


@dataclass
class Transports:
    """What a process's program runs over."""

    net: Channel
    rings: Optional[RingChannel] = None
    device: torch.device = torch.device("cpu")
    window: int = 2


def run_program(prog: Program, views: dict, tr: Transports, deadline: float,
                token: Any = None, delta=None) -> dict:
    """Run `prog` with the validated shard views `views[(side, rank, tensor)]`; returns stats.
    `token` names exactly these view objects (see `Program.bind`): the same token as the last
    run skips re-checking them. With `delta` (a `delta.DeltaRun`) network buckets travel as
    deltas (every process of the refit must pass one). The cyclic garbage collector is paused
    meanwhile: it would rescan the program's many objects for the small acyclic ones each step
    allocates."""
    with gc_paused():
        return ProcessRun(prog, views, tr, deadline, token, delta).run()


class ProcessRun:
    """One run of one process's program: its steps in run order, its staging window and
    channels, the messages in flight (`pending`: (handle, step, is_recv, staging index or -1,
    what to do once complete)) and what they completed, the ring receives left behind, the
    delta run, and the figures it reports."""

    def __init__(self, prog: Program, views: dict, tr: Transports, deadline: float,
                 token: Any, delta):
        t_bind = now()
        self.rebuilt = prog.bind(views, token)
        self.clock = {"pack": 0.0, "unpack": 0.0, "wait": 0.0, "bind": now() - t_bind}
        self.prog, self.deadline, self.delta = prog, deadline, delta
        self.net, self.rings, self.device = tr.net, tr.rings, tr.device
        self.max_in_flight = 4 * tr.window
        staging = getattr(prog, "staging", None)
        if staging is None or staging.window != tr.window or staging.device != tr.device:
            size = max([s.nbytes for s in prog.steps if s.kind != COPY], default=1)
            staging = prog.staging = Staging(tr.window, min(size, prog.bucket_bytes), tr.device)
        staging.next = 0          # same buffer per step every refit: cached wire views hold
        self.staging = staging
        self.staged = self.peak_staged = 0
        self.pending: deque = deque()
        self.left: dict = {}      # key -> messages of a network step not yet complete
        self.done: set = set()    # keys of network receives fully complete
        self.moved = {"network": 0, "domain": 0, "local": 0}
        self.sent = self.recv = 0
        # Ring receives a run left behind (not there yet), per (peer, False): taken whenever
        # ready from then on; only where network waits can be sliced (NCCL).
        self.carried: dict = {}
        self.may_carry = self.rings is not None and self.net.polls
        self.left_behind = 0      # ring receives runs left behind (counted per run)
        self.early: dict = {}     # delta: network receive key -> its header, received ahead
        self.early_groups: dict = {}  # delta: first key of a group -> those receives' handle
        # Network groups: rounds of the schedule cut into spans of `span` positions, the same
        # cut on every process (see the schedule), each at most `span` sends and receives.
        self.span = group_span(tr.window, prog.round_len)
        self.steps = prog.ordered(self.span)
        self.following: dict = {}  # delta: a network group's start -> the next group's steps

    def run(self) -> dict:
        """Every step, then what is still in flight; returns the run's figures."""
        if self.delta is not None:  # versions before any bucket moves (see delta.py)
            self.delta.start(self.prog.steps, self.net, self.deadline)
            self.following = self._following()
        i, n = 0, len(self.steps)
        while i < n:
            i = self._advance(i)
        self._finish()
        return self._stats()

    def _advance(self, i: int) -> int:
        """Run step `i` with the steps that go with it (its ring run or its network group);
        returns the index after them."""
        s = self.steps[i]
        if s.kind == COPY:
            t0 = now()
            s.recv.copy_from(s.send)
            self.clock["unpack"] += now() - t0
            self.moved["local"] += s.nbytes
            return i + 1
        if s.after is not None:
            # A forwarded piece must have arrived: complete messages up to its network bucket.
            while s.after not in self.done and self.pending:
                self.wait_one()
        if _on_ring(s, self.rings):
            return self._ring_run(i)
        if self.carried:          # network steps: first what arrived of the receives left behind
            self.take_carried()
        if s.per_item and self.delta is None:
            self._post_items_step(s)
            batch, j = (s,), i + 1
        else:
            j = self._group_end(i)
            batch = self.steps[i:j]
            if self.delta is not None and s.path == NETWORK:
                self._delta_group(batch, self.following.get(i))
            else:
                self._post_packed(batch)
        self._count(batch)
        return j

    def _count(self, batch) -> None:
        delta = self.delta
        for st in batch:
            nbytes = st.nbytes if delta is None or st.path != NETWORK else delta.wire_bytes(st)
            if st.kind == SEND:
                self.sent += nbytes
            else:
                self.recv += nbytes
                self.moved[st.path] += nbytes

    def _finish(self) -> None:
        """Complete what is in flight, the ring receives left behind, the delta checks left
        for the end, and the rings' deferred commits."""
        while self.pending:
            self.wait_one()
        rings = self.rings
        if self.carried:
            _run_rings([], rings, self.ring_step, self.carried, False)
        if self.delta is not None:
            t0 = now()
            self.delta.run_checks()
            self.clock["unpack"] += now() - t0
        if rings is not None:
            rings.flush()
            rings.drain(self.deadline)  # bytes listed for a peer to copy stay put until it has
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stats(self) -> dict:
        rings = self.rings
        stats = {"bytes_by_path": self.moved, "sent_bytes": self.sent, "recv_bytes": self.recv,
                 "peak_staging_bytes": self.peak_staged * self.staging.nbytes,
                 "transfers": len(self.prog.steps), "parts_rebuilt": self.rebuilt,
                 "clock": self.clock, "ring_recvs_left_behind": self.left_behind,
                 "single_copy_bytes": rings.listed_bytes if rings is not None else 0}
        if self.delta is not None:
            stats["delta"] = self.delta.stats()
        return stats

    # ---------------------------------------------------------------- messages in flight
    def wait_one(self) -> None:
        """Complete the oldest message in flight and do what its completion allows."""
        handle, s, is_recv, si, after = self.pending.popleft()
        t0 = now()
        if s is None:             # a delta group's header sends
            self.net_wait(handle, "delta: headers")
            self.clock["wait"] += now() - t0
            return
        if handle is _UNSENT:     # a delta bucket that did not change: nothing travelled
            if is_recv:           # complete in order (a forward waits on its last bucket)
                after()           # its check (see delta.DeltaRun.check_later)
                self.clock["unpack"] += now() - t0
                self.done.add(s.key)
            return
        self.net_wait(handle, f"{'recv from' if is_recv else 'send to'} process {s.peer}")
        t1 = now()
        self.clock["wait"] += t1 - t0
        if after is not None:
            after()
            self.clock["unpack"] += now() - t1
        if si >= 0:
            self.unstage(si)
        n = self.left[s.key] - 1
        self.left[s.key] = n
        if n == 0 and is_recv:
            self.done.add(s.key)

    def net_wait(self, handle, what: str) -> None:
        """Wait for a network handle. Where rings run, no peer may wait meanwhile on a ring
        slot this process holds back (flushed first) nor on a ring receive it left behind
        (taken as they arrive, between short slices of the wait)."""
        net, rings, deadline = self.net, self.rings, self.deadline
        if self.carried:
            self.take_carried()
        if rings is not None and not net.done(handle):
            rings.flush()
            while self.carried:
                self.take_carried()
                try:
                    net.complete(handle, min(deadline, time.monotonic() + 1e-3), what)
                    break
                except TransportTimeout:
                    if time.monotonic() >= deadline:
                        raise
        net.complete(handle, deadline, what)

    def wait_for_room(self) -> None:
        while len(self.pending) >= self.max_in_flight:
            self.wait_one()

    def stage(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A staging buffer for a bucket of `nbytes`, once the window has room for it."""
        self.wait_for_room()
        si = self.staging.acquire(self.wait_one)
        self.staged += 1
        self.peak_staged = max(self.peak_staged, self.staged)
        return si, self.staging.buffers[si][:nbytes]

    def unstage(self, si: int) -> None:
        self.staging.release(si)
        self.staged -= 1

    # ---------------------------------------------------------------- dense network steps
    def _group_end(self, i: int) -> int:
        """The end of the group of network steps starting at `i` (its round and span)."""
        steps, span, j = self.steps, self.span, i + 1
        if span and steps[i].path == NETWORK:
            g = (steps[i].key[0], steps[i].key[2] // span)
            while j < len(steps) and _packed_network(steps[j], self.delta) and \
                    (steps[j].key[0], steps[j].key[2] // span) == g:
                j += 1
        return j

    def _post_packed(self, batch) -> None:
        """A group of packed buckets (one staging buffer each) as one post."""
        self.wait_for_room()
        ops, entries = [], []
        for st in batch:
            sending = st.kind == SEND
            self.left[st.key] = 1
            si, buf = self.stage(st.nbytes)
            part = st.send if sending else st.recv
            if sending:
                t0 = now()
                part.pack(buf)
                self.clock["pack"] += now() - t0
                entries.append((st, si, None))
            else:
                entries.append((st, si, lambda buf=buf, part=part: part.unpack(buf)))
            ops.append((st.peer, buf, sending))
        net = self.net
        handle = net.post(*ops[0]) if len(ops) == 1 else net.post_group(ops)
        for st, si, after in entries:
            self.pending.append((handle, st, st.kind != SEND, si, after))

    def _post_items_step(self, s) -> None:
        """A step whose items travel as their own messages, posted as one group (both ends
        group the same step's messages)."""
        sending = s.kind == SEND
        ops, si, after = self.item_messages(s, sending)
        self.wait_for_room()
        self.left[s.key] = 1
        handle = self.net.post_group(ops)
        self.pending.append((handle, s, not sending, si, after))

    def item_messages(self, st, sending: bool, msgs=None) -> tuple[list, int, Any]:
        """A step's items as their own messages: the regions themselves where they can be
        (`msgs`: given, else the part's), the others through one staging buffer at their
        offsets in the bucket; returns (ops, staging index or -1, what to do once received)."""
        part = st.send if sending else st.recv
        if msgs is None:
            msgs = part.messages(sending)
        staged = [k for k, m in enumerate(msgs) if m is None]
        si, buf = self.stage(st.nbytes) if staged else (-1, None)
        after = None
        if buf is not None:
            slots = {k: buf[part.offsets[k]:part.offsets[k] + part.item_bytes[k]]
                     for k in staged}
            if sending:
                t0 = now()
                for k in staged:
                    part.pack_item(k, slots[k])
                self.clock["pack"] += now() - t0
            else:
                after = lambda part=part, slots=slots: [part.unpack_item(k, b)
                                                        for k, b in slots.items()]
            msgs = [m if m is not None else slots[k] for k, m in enumerate(msgs)]
        return [(st.peer, m, sending) for m in msgs], si, after

    # ---------------------------------------------------------------- rings
    def _ring_run(self, i: int) -> int:
        """A run of consecutive ring steps from `i`, once the network buckets its forwards
        pass on are complete (see `_run_rings`); returns the index after it."""
        steps, j = self.steps, i + 1
        while j < len(steps) and _on_ring(steps[j], self.rings):
            j += 1
        run = steps[i:j]
        afters = {st.after for st in run if st.after is not None}
        while self.pending and not afters <= self.done:
            self.wait_one()
        _run_rings([(i + k, st) for k, st in enumerate(run)], self.rings, self.ring_step,
                   self.carried, self.may_carry)
        self.left_behind += sum(len(q) for q in self.carried.values())
        return j

    def ring_step(self, st) -> None:
        t0 = now()
        if st.kind == SEND:
            self.rings.post_part(st.peer, st.send, True, st.nbytes, self.deadline)
            self.clock["pack"] += now() - t0
        else:
            self.rings.post_part(st.peer, st.recv, False, st.nbytes, self.deadline)
            self.clock["unpack"] += now() - t0
            self.moved[st.path] += st.nbytes

    def take_carried(self) -> None:
        """Take the ring receives left behind that are there now."""
        carried, rings = self.carried, self.rings
        for key in list(carried):
            q = carried[key]
            while q and rings.ready(*key):
                self.ring_step(q.popleft()[1])
            if not q:
                del carried[key]
        rings.poll()

    # ---------------------------------------------------------------- delta network groups
    def _following(self) -> dict:
        """Each network group's start -> the steps of the next network group."""
        steps, following = self.steps, {}
        last, i = None, 0
        while i < len(steps):
            if _packed_network(steps[i], self.delta):
                j = self._group_end(i)
                if last is not None:
                    following[last] = steps[i:j]
                last, i = i, j
            else:
                i += 1
        return following

    def _delta_group(self, batch, nxt) -> None:
        """A network group of a delta refit (see delta.py): this group's sends encoded (while
        the groups before it move), one header per bucket exchanged, the payloads posted as one
        group; then the next group's headers are received ahead (`nxt`: its steps, where this
        process only receives in it) and the receives of earlier groups applied while this
        one moves. A process that only sends never waits for headers. Both ends cut the same
        header and payload groups in the same order."""
        outs = self._delta_headers(batch)
        self.wait_for_room()
        self._delta_payloads(batch, outs)
        self.delta.finish()       # baselines of dense buckets sent in place, while they move
        if nxt and all(st.kind != SEND for st in nxt):
            got = []
            for st in nxt:
                self.early[st.key] = torch.empty(HEADER, dtype=torch.int64, device=self.device)
                got.append((st.peer, self.early[st.key], False))
            self.early_groups[nxt[0].key] = self.net.post_group(got)
        mine = {st.key for st in batch}
        while any(e[2] and e[1].key not in mine for e in self.pending):
            self.wait_one()

    def _delta_headers(self, batch) -> dict:
        """Encode the group's sends and exchange its headers (a receiver waits for its own);
        returns each send's (staging index or -1, encoded buffer)."""
        delta, device = self.delta, self.device
        heads, outs, hdr_ops = {}, {}, []
        recvs = [st for st in batch if st.kind != SEND]
        for st in batch:
            if st.kind == SEND:
                si, out = self.stage(st.nbytes)
                head = delta.encode(st, out)
                if not delta.send(st)[3]:       # nothing travels out of `out`
                    self.unstage(si)
                    si = -1
                outs[st.key] = (si, out)
                hdr_ops.append((st.peer, torch.tensor(head, dtype=torch.int64, device=device),
                                True))
            elif st.key in self.early:
                heads[st.key] = self.early.pop(st.key)
            else:
                heads[st.key] = torch.empty(HEADER, dtype=torch.int64, device=device)
                hdr_ops.append((st.peer, heads[st.key], False))
        ahead = self.early_groups.pop(batch[0].key, None)
        handle = self.net.post_group(hdr_ops) if hdr_ops else None
        if recvs:
            t0 = now()
            for h in (ahead, handle):
                if h is not None:
                    self.net_wait(h, "delta: headers")
            delta.clock["headers"] += now() - t0
            for st in recvs:
                delta.take_header(st, heads[st.key].tolist())
        elif handle is not None:
            self.pending.append((handle, None, False, -1, None))
        return outs

    def _delta_payloads(self, batch, outs: dict) -> None:
        """Post the group's payloads as one group: a mask or index one from its buffer, a
        dense one as a dense refit sends it, a same one not at all (its receiver checks it at
        the end)."""
        delta = self.delta
        ops, entries = [], []
        for st in batch:
            if st.kind == SEND:
                kind, size, dense, _ = delta.send(st)
                si, out = outs[st.key]
                if kind == DELTA_SAME:
                    continue
                if kind != DELTA_DENSE:
                    ops.append((st.peer, out[:size], True))
                elif st.per_item:               # as a dense refit sends it: items in place
                    part = st.send
                    msgs = None if dense is None else [
                        m if m is not None else
                        dense[part.offsets[k]:part.offsets[k] + part.item_bytes[k]]
                        for k, m in enumerate(part.messages(True))]
                    got, si, _ = self.item_messages(st, True, msgs)
                    ops += got
                else:
                    ops.append((st.peer, dense, True))
                self.left[st.key] = 1
                entries.append((st, si, None))
                continue
            kind, size, _ = delta.header(st)
            if kind == DELTA_SAME:
                entries.append((st, -1, lambda st=st: delta.check_later(st), "unsent"))
                continue
            self.left[st.key] = 1
            if kind != DELTA_DENSE:
                si, buf = self.stage(size)
                ops.append((st.peer, buf, False))
                entries.append((st, si, lambda st=st, buf=buf: delta.apply(st, buf)))
            elif st.per_item:
                got, si, after = self.item_messages(st, False)
                ops += got
                entries.append((st, si, after))
            else:
                si, buf = self.stage(st.nbytes)
                ops.append((st.peer, buf, False))
                entries.append((st, si, lambda part=st.recv, buf=buf: part.unpack(buf)))
        handle = self.net.post_group(ops) if ops else None
        for st, si, after, *unsent in entries:
            self.pending.append((_UNSENT if unsent else handle, st, st.kind != SEND, si, after))


_UNSENT = object()          # the handle of a delta bucket that did not travel


def _on_ring(s, rings) -> bool:
    return (s.kind != COPY and s.path != NETWORK and rings is not None
            and rings.has(s.peer, s.kind == SEND))


def _run_rings(run: list, rings: RingChannel, do: Callable, carried: dict,
               may_carry: bool) -> None:
    """Do a run of ring steps, `run` = [(index in the program, step)], after the receives
    `carried` over from earlier runs ({(peer, False): deque of the same}, taken first on their
    ring): each (peer, direction) in program order, and any whose ring is ready first; when
    none is, the earliest step left, waiting for it, unless `may_carry` and only receives are
    left: those stay in `carried` for later. Deadlock-free as the strict order is: the
    earliest unfinished ring transfer of the whole group is, on both of its ends, either
    ready, the earliest step a run waits for, or a carried receive that the process takes as
    soon as it is ready (between network posts and while waiting for them). Deferred
    commits and releases (CUDA IPC) are polled after each pass and flushed before waiting."""
    queues = dict(carried)
    carried.clear()
    for idx, st in run:
        queues.setdefault((st.peer, st.kind == SEND), deque()).append((idx, st))
    while queues:
        progressed = False
        for key in list(queues):
            q = queues[key]
            while q and rings.ready(*key):
                do(q.popleft()[1])
                progressed = True
            if not q:
                del queues[key]
        rings.poll()
        if not progressed and queues:
            if may_carry and not any(sending for _, sending in queues):
                carried.update(queues)
                return
            rings.flush()       # nothing ready: publish ours before waiting on a peer
            if any(rings.ready(*k) for k in queues):
                continue
            key = min(queues, key=lambda k: queues[k][0][0])
            q = queues[key]
            do(q.popleft()[1])
            if not q:
                del queues[key]


def _packed_network(s, delta=None) -> bool:
    return s.path == NETWORK and s.kind != COPY and (not s.per_item or delta is not None)


def transports(wg, window: Optional[int] = None) -> Transports:
    """The channels of a process's group membership (process group, rings, device)."""
    return Transports(NetChannel(wg.pg), RingChannel(wg.rings_out, wg.rings_in), wg.device,
                      window or wg.window or default_window(wg.bucket_bytes))
