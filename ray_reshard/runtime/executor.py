"""Running one process's compiled program (see execution/program.py) over its channels.

Channels. Every transport is reached through one small interface, `channel.Channel`
(post / complete / abort); see `channel.py`.

Order. Steps run in the global key order every process agrees on (see `Schedule`), where network
groups span several positions of a round with the forwards sorting inside a group's positions
moved right after it (`plan.run_order`, the same for every process): a posted transfer
completes once both of its ends posted it, so the earliest unfinished transfer can always
finish.

Groups. Packed network buckets are posted in groups (`Channel.post_group`: one NCCL launch,
one handle). NCCL runs a process's groups one after another, and a group completes only when
all of its messages do, so every process must cut the same groups out of the global order: a
group is a run of keys with the same round and the same span of `plan.group_span` positions
(`window // 2`, at most half a round; a network bucket's key is (round, path, position, ...),
its turn), the same on every process whatever its share. In one turn a process sends at most
one network bucket and receives at most one, so a group needs at most `window` staging buffers;
the earliest unfinished group can always finish.
A step whose items travel as their own messages is its own group. Network messages stay in
flight (up to `window` staged buckets and `4 * window` messages); local copies run at once.

Rings. A run of consecutive ring (domain) steps runs as a unit once the network buckets its
forwards pass on have completed: each peer's buckets in program order (a ring is first in,
first out), but whichever peer's ring is ready first (a free slot to send into, a published
one to take), and only when none is, the earliest step left, waiting for it. So a destination
does not wait for one forwarder while another's bucket sits ready. On CUDA IPC rings a ring step
does not wait for its copy: the slot is published (freed) once the copy's events are done
(`RingChannel.poll` after each pass over a run's peers), and the process flushes them before it
waits for anything (a peer's ring, a network message, the end of the program), so the host
issues the next copy while the GPU runs this one and no peer waits on a slot held back. Where
network waits can be sliced (NCCL: `Channel.polls`), a run does not wait for ring receives
that are not there yet: once only those are left it goes on, and takes them as soon as they
are ready (before each network post, while it waits for network messages, in the next run,
at the latest at the end), so a late peer holds up neither this process's network transfers
nor its other peers. What a forwarder passes to
one target out of a segment of a round's rotations is merged into few buckets, sent only once
the network buckets that brought it in have completed; they sort into the next segment, spread
over its rotations (`plan.forward_key`), so its network receives are in flight meanwhile.

Delta refits (`delta.DeltaRun`). Each network group goes as: its sends encoded (the groups
before it on the wire meanwhile), one header per bucket (encoding, payload bytes, checksum)
posted as a group of its own, then the payloads as the group (a same bucket sends none, a dense
one goes as a dense refit sends it). A process that only sends posts both at once; one that
receives waits for the group's headers before posting its payload receives (it posts the next
group's header receives ahead, where it only receives in that group), then applies what earlier
groups brought while this one moves. Both ends cut the same header and payload groups in the
same order, so NCCL's rules hold as for dense refits.

Strategies (`reshard`, `gather_broadcast`) are objects in `strategies.py`; the reshard strategy
runs its programs with `run_program` here.
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
from ..planning.planner import NETWORK
from ..execution.program import COPY, SEND, Program
from .channel import Channel, NetChannel, RingChannel
from .delta import HEADER
from ..execution.delta import DENSE as DELTA_DENSE, SAME as DELTA_SAME


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
        return _run(prog, views, tr, deadline, token, delta)


def _run(prog: Program, views: dict, tr: Transports, deadline: float, token: Any,
         delta) -> dict:
    now = time.perf_counter
    t_bind = now()
    rebuilt = prog.bind(views, token)
    t_bind = now() - t_bind
    net, rings = tr.net, tr.rings
    window = tr.window
    max_in_flight = 4 * window
    staging = getattr(prog, "staging", None)
    if staging is None or staging.window != window or staging.device != tr.device:
        size = max([s.nbytes for s in prog.steps if s.kind != COPY], default=1)
        staging = prog.staging = Staging(window, min(size, prog.bucket_bytes), tr.device)
    staging.next = 0             # same buffer per step every refit: cached wire views hold
    pending: deque = deque()     # (handle, step, is_recv, staging index or -1, after)
    left: dict = {}              # key -> messages of a network step not yet complete
    done: set = set()            # keys of network receives fully complete
    moved = {"network": 0, "domain": 0, "local": 0}
    sent = recv = 0
    clock = {"pack": 0.0, "unpack": 0.0, "wait": 0.0, "bind": t_bind}
    peak_staged = [0, 0]         # now, peak
    # Ring receives a run left behind (not there yet), per (peer, False): taken whenever
    # ready from then on; only where network waits can be sliced (NCCL), see the docstring.
    carried: dict = {}
    may_carry = rings is not None and net.polls
    left_behind = 0              # ring receives runs left behind (counted per run)
    if delta is not None:        # versions before any bucket moves (see delta.py)
        delta.start(prog.steps, net, deadline)

    def take_carried():
        for key in list(carried):
            q = carried[key]
            while q and rings.ready(*key):
                ring_step(q.popleft()[1])
            if not q:
                del carried[key]
        rings.poll()

    def net_wait(handle, what):
        if carried:
            take_carried()
        if rings is not None and not net.done(handle):
            rings.flush()       # no peer may wait on a ring slot while this process waits
            while carried:      # nor on a ring receive left behind here
                take_carried()
                try:
                    net.complete(handle, min(deadline, time.monotonic() + 1e-3), what)
                    break
                except TransportTimeout:
                    if time.monotonic() >= deadline:
                        raise
        net.complete(handle, deadline, what)

    def wait_one():
        handle, s, is_recv, si, after = pending.popleft()
        t0 = now()
        if s is None:           # a delta group's header sends
            net_wait(handle, "delta: headers")
            clock["wait"] += now() - t0
            return
        if handle is _UNSENT:   # a delta bucket that did not change: nothing travelled
            if is_recv:         # complete in order (a forward waits on its last bucket)
                after()         # its check (see delta.DeltaRun.check_later)
                clock["unpack"] += now() - t0
                done.add(s.key)
            return
        net_wait(handle, f"{'recv from' if is_recv else 'send to'} process {s.peer}")
        t1 = now()
        clock["wait"] += t1 - t0
        if after is not None:
            after()
            clock["unpack"] += now() - t1
        if si >= 0:
            unstage(si)
        n = left[s.key] - 1
        left[s.key] = n
        if n == 0 and is_recv:
            done.add(s.key)

    def stage(nbytes):
        while len(pending) >= max_in_flight:
            wait_one()
        si = staging.acquire(wait_one)
        peak_staged[0] += 1
        peak_staged[1] = max(peak_staged[1], peak_staged[0])
        return si, staging.buffers[si][:nbytes]

    def unstage(si):
        staging.release(si)
        peak_staged[0] -= 1

    def post_per_item(st, sending, msgs=None):
        """A step's items as their own messages: the regions themselves where they can be
        (`msgs`: given, else the part's), the others through one staging buffer at their
        offsets in the bucket; returns (ops, staging index or -1, what to do once received)."""
        part = st.send if sending else st.recv
        if msgs is None:
            msgs = part.messages(sending)
        staged = [k for k, m in enumerate(msgs) if m is None]
        si, buf = stage(st.nbytes) if staged else (-1, None)
        after = None
        if buf is not None:
            slots = {k: buf[part.offsets[k]:part.offsets[k] + part.item_bytes[k]]
                     for k in staged}
            if sending:
                t0 = now()
                for k in staged:
                    part.pack_item(k, slots[k])
                clock["pack"] += now() - t0
            else:
                after = lambda part=part, slots=slots: [part.unpack_item(k, b)
                                                        for k, b in slots.items()]
            msgs = [m if m is not None else slots[k] for k, m in enumerate(msgs)]
        return [(st.peer, m, sending) for m in msgs], si, after

    early: dict = {}            # delta: network receive key -> its header, received ahead
    early_groups: dict = {}     # delta: first key of a group -> the handle of those receives

    def delta_group(batch, nxt):
        """A network group of a delta refit (see delta.py): this group's sends encoded (while
        the groups before it move), one header per bucket exchanged, the payloads posted as one
        group; then the next group's headers are received ahead (`nxt`: its steps, where this
        process only receives in it) and the receives of earlier groups applied while this
        one moves. A process that only sends never waits for headers."""
        heads, outs, hdr_ops = {}, {}, []
        recvs = [st for st in batch if st.kind != SEND]
        for st in batch:
            if st.kind == SEND:
                si, out = stage(st.nbytes)
                head = delta.encode(st, out)
                if not delta.send(st)[3]:       # nothing travels out of `out`
                    unstage(si)
                    si = -1
                outs[st.key] = (si, out)
                hdr_ops.append((st.peer, torch.tensor(head, dtype=torch.int64,
                                                      device=tr.device), True))
            elif st.key in early:
                heads[st.key] = early.pop(st.key)
            else:
                heads[st.key] = torch.empty(HEADER, dtype=torch.int64, device=tr.device)
                hdr_ops.append((st.peer, heads[st.key], False))
        ahead = early_groups.pop(batch[0].key, None)
        handle = net.post_group(hdr_ops) if hdr_ops else None
        if recvs:
            t0 = now()
            for h in (ahead, handle):
                if h is not None:
                    net_wait(h, "delta: headers")
            delta.clock["headers"] += now() - t0
            for st in recvs:
                delta.take_header(st, heads[st.key].tolist())
        elif handle is not None:
            pending.append((handle, None, False, -1, None))
        while len(pending) >= max_in_flight:
            wait_one()
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
                    got, si, _ = post_per_item(st, True, msgs)
                    ops += got
                else:
                    ops.append((st.peer, dense, True))
                left[st.key] = 1
                entries.append((st, si, None))
                continue
            kind, size, _ = delta.header(st)
            if kind == DELTA_SAME:
                entries.append((st, -1, lambda st=st: delta.check_later(st), "unsent"))
                continue
            left[st.key] = 1
            if kind != DELTA_DENSE:
                si, buf = stage(size)
                ops.append((st.peer, buf, False))
                entries.append((st, si, lambda st=st, buf=buf: delta.apply(st, buf)))
            elif st.per_item:
                got, si, after = post_per_item(st, False)
                ops += got
                entries.append((st, si, after))
            else:
                si, buf = stage(st.nbytes)
                ops.append((st.peer, buf, False))
                entries.append((st, si, lambda part=st.recv, buf=buf: part.unpack(buf)))
        handle = net.post_group(ops) if ops else None
        for st, si, after, *unsent in entries:
            pending.append((_UNSENT if unsent else handle, st, st.kind != SEND, si, after))
        delta.finish()          # baselines of dense buckets sent in place, while they move
        if nxt and all(st.kind != SEND for st in nxt):
            got = []
            for st in nxt:
                early[st.key] = torch.empty(HEADER, dtype=torch.int64, device=tr.device)
                got.append((st.peer, early[st.key], False))
            early_groups[nxt[0].key] = net.post_group(got)
        mine = {st.key for st in batch}
        while any(e[2] and e[1].key not in mine for e in pending):
            wait_one()

    def ring_step(st):
        t0 = now()
        if st.kind == SEND:
            rings.post_part(st.peer, st.send, True, st.nbytes, deadline)
            clock["pack"] += now() - t0
        else:
            rings.post_part(st.peer, st.recv, False, st.nbytes, deadline)
            clock["unpack"] += now() - t0
            moved[st.path] += st.nbytes

    # Packed network buckets are posted in groups (one NCCL launch each; see the module
    # docstring): rounds of the schedule cut into spans of `span` positions, the same cut on
    # every process, so each group holds at most `span` sends and `span` receives.
    span = group_span(window, prog.round_len)
    steps = prog.ordered(span)
    n_steps = len(steps)

    def batch_end(i):
        """The end of the group of network steps starting at `i` (its round and span)."""
        j = i + 1
        if span and steps[i].path == NETWORK:
            g = (steps[i].key[0], steps[i].key[2] // span)
            while j < n_steps and _packed_network(steps[j], delta) and \
                    (steps[j].key[0], steps[j].key[2] // span) == g:
                j += 1
        return j

    following: dict = {}        # delta: a network group's start -> the next group's steps
    if delta is not None:
        last, i = None, 0
        while i < n_steps:
            if _packed_network(steps[i], delta):
                j = batch_end(i)
                if last is not None:
                    following[last] = steps[i:j]
                last, i = i, j
            else:
                i += 1
    i = 0
    while i < n_steps:
        s = steps[i]
        kind = s.kind
        if kind == COPY:
            t0 = now()
            s.recv.copy_from(s.send)
            clock["unpack"] += now() - t0
            moved["local"] += s.nbytes
            i += 1
            continue
        sending = kind == SEND
        if s.after is not None:
            # A forwarded piece must have arrived: complete messages up to its network bucket.
            while s.after not in done and pending:
                wait_one()
        if _on_ring(s, rings):
            # A run of ring steps: each peer's in order, any ready peer first (see the module
            # docstring). Forwards in the run need their network buckets complete first.
            j = i + 1
            while j < n_steps and _on_ring(steps[j], rings):
                j += 1
            run = steps[i:j]
            afters = {st.after for st in run if st.after is not None}
            while pending and not afters <= done:
                wait_one()
            _run_rings([(i + k, st) for k, st in enumerate(run)], rings, ring_step, carried,
                       may_carry)
            left_behind += sum(len(q) for q in carried.values())
            i = j
            continue
        if carried:             # network steps: first what arrived of the receives left behind
            take_carried()
        if s.per_item and delta is None:
            # One message per item, posted as one group (both ends group the same step's
            # messages); items that cannot travel in place go through one staging buffer, at
            # their offsets in the bucket.
            ops, si, after = post_per_item(s, sending)
            while len(pending) >= max_in_flight:
                wait_one()
            left[s.key] = 1
            handle = net.post_group(ops)
            pending.append((handle, s, not sending, si, after))
            batch = (s,)
            i += 1
        else:
            j = batch_end(i)
            batch = steps[i:j]
            if delta is not None and s.path == NETWORK:
                delta_group(batch, following.get(i))
                i = j
            else:
                while len(pending) >= max_in_flight:
                    wait_one()
                ops, entries = [], []
                for st in batch:
                    st_sending = st.kind == SEND
                    left[st.key] = 1
                    si, buf = stage(st.nbytes)
                    part = st.send if st_sending else st.recv
                    if st_sending:
                        t0 = now()
                        part.pack(buf)
                        clock["pack"] += now() - t0
                        entries.append((st, si, None))
                    else:
                        entries.append((st, si, lambda buf=buf, part=part: part.unpack(buf)))
                    ops.append((st.peer, buf, st_sending))
                handle = net.post(*ops[0]) if len(ops) == 1 else net.post_group(ops)
                for st, si, after in entries:
                    pending.append((handle, st, st.kind != SEND, si, after))
                i = j
        for st in batch:
            nbytes = st.nbytes if delta is None or st.path != NETWORK else delta.wire_bytes(st)
            if st.kind == SEND:
                sent += nbytes
            else:
                recv += nbytes
                moved[st.path] += nbytes
    while pending:
        wait_one()
    if carried:
        _run_rings([], rings, ring_step, carried, False)
    if delta is not None:
        t0 = now()
        delta.run_checks()
        clock["unpack"] += now() - t0
    if rings is not None:
        rings.flush()
        rings.drain(deadline)   # bytes listed for a peer to copy stay put until it has
    if tr.device.type == "cuda":
        torch.cuda.synchronize(tr.device)
    stats = {"bytes_by_path": moved, "sent_bytes": sent, "recv_bytes": recv,
             "peak_staging_bytes": peak_staged[1] * staging.nbytes, "transfers": len(prog.steps),
             "parts_rebuilt": rebuilt, "clock": clock, "ring_recvs_left_behind": left_behind,
             "single_copy_bytes": rings.listed_bytes if rings is not None else 0}
    if delta is not None:
        stats["delta"] = delta.stats()
    return stats


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
