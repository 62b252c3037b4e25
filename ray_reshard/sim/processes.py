"""The replay of every process's program on a described cluster (`ProcessReplay`): clocks per
process, network groups, rings and their slots, NVLink ports (`Link`). The order it walks is
`ray_reshard.planning.schedule`'s run order (see its docstring); what each step costs comes from
the cluster and the rows (`messages.Messages`).
"""
from __future__ import annotations

import bisect
from collections import defaultdict, deque

import numpy as np

from ..planning.moves import DOMAIN
from ..planning.schedule import forward_segment, group_span, segment_rotations
from .cluster import Cluster
from .messages import FORWARD_ORDER, PATH_CODE, Messages

# How a process takes its ring (domain) buckets: "runs", as the executor does (within a run of
# consecutive ring steps, whichever is ready first); "in_order", strictly in key order;
# "as_ready", a what-if: whenever they arrive, without holding up the rest of its program.
RING_RECV = ("runs", "in_order", "as_ready")


class Link:
    """One direction of a GPU's NVLink port: its busy intervals, sorted and disjoint. A transfer
    takes the earliest gap long enough at or after it is ready (a link carries whatever is
    ready; the replay's order reserves nothing)."""

    __slots__ = ("starts", "ends")

    def __init__(self):
        self.starts: list = []
        self.ends: list = []

    def free_from(self, t: float, d: float) -> float:
        starts, ends = self.starts, self.ends
        i = bisect.bisect_right(ends, t)
        while i < len(starts) and starts[i] < t + d:
            t = max(t, ends[i])
            i += 1
        return t

    def book(self, t: float, d: float) -> None:
        e = t + d
        starts, ends = self.starts, self.ends
        i = bisect.bisect_left(starts, t)
        if i > 0 and ends[i - 1] >= t - 1e-12:         # joins the interval before
            i -= 1
            t, e = starts[i], max(e, ends[i])
            del starts[i], ends[i]
        if i < len(starts) and starts[i] <= e + 1e-12:  # and the one after
            e = max(e, ends[i])
            del starts[i], ends[i]
        starts.insert(i, t)
        ends.insert(i, e)


def earliest_free(a: Link, b: Link, t: float, d: float) -> float:
    """The earliest time at or after `t` when both links are free for `d`."""
    while True:
        ta = a.free_from(t, d)
        tb = b.free_from(ta, d)
        if tb == ta:
            return ta
        t = tb


class ProcessReplay:
    """Every process's program, rows in run order, walked once.

    Per process: a host clock (`cpu`), a stream clock (`gpu`: with `host_overlap` the host pays
    a bucket end's step and queues its copy on the stream; without, the copies are host work
    and the two are one), when its last ring copy is done (`ev`, its event), when its previous
    network group ends (`nccl`: one NCCL stream), its network groups in flight and the staging
    buffers and messages they hold, and the ring buckets it has not taken yet. Each process
    starts once it has checked its local tensors and view table (`prep`). `run` returns each
    process's finishing time and, for process `watch`, per round: (first start, last end,
    [NIC out, NIC in, NVLink out, NVLink in] bytes, CPU work, link seconds).
    """

    def __init__(self, msgs: Messages, cluster: Cluster, W: int, world: int, base, send_copy,
                 recv_copy, prep, watch: int, ring_recv: str = "runs", n_src: int = 0):
        self.world, self.n_src, self.n_dst, self.watch = world, n_src, world - n_src, watch
        self.W, self.max_msgs = W, 4 * W
        self.span = group_span(W, max(n_src, world - n_src))
        self.nic, self.nvl, self.lat = cluster.nic_Bps, cluster.nvlink_Bps, cluster.latency_s
        self.ring_lat = cluster.ring_latency_s
        self.overlap = cluster.host_overlap
        self.carry = cluster.ring_carry and ring_recv == "runs"
        self.over_link = cluster.pack_over_link
        self.rings_in_order = ring_recv == "in_order"
        self.in_runs = ring_recv == "runs"
        self.slots = cluster.ring_slots or None        # slots per ring (None: no limit)
        # per process
        self.cpu = [float(x) for x in prep]
        self.gpu = list(self.cpu)
        self.ev = [0.0] * world
        self.nccl = [0.0] * world
        self.nv_s, self.nv_r = [Link() for _ in range(world)], [Link() for _ in range(world)]
        # (end, buffers, messages, rows received, (round, slot), seq)
        self.inflight = [deque() for _ in range(world)]
        self.used_buf, self.used_msg = [0] * world, [0] * world
        self.seq_next, self.seq_done = [0] * world, [-1] * world
        self.arrived = [0.0] * world                   # ring buckets taken as ready: last unpacked
        self.deferred = [[] for _ in range(world)]     # runs: (arrival, row) not yet taken
        # per row
        self.rnd, self.order = msgs.round.tolist(), msgs.order.tolist()
        self.path = msgs.path.tolist()
        self.snd, self.rcv = msgs.sender.tolist(), msgs.receiver.tolist()
        self.nbytes, self.items = msgs.nbytes.tolist(), msgs.items.tolist()
        self.parent = msgs.parent.tolist()
        self.slot = msgs.slot.tolist() if msgs.slot is not None else [0] * len(self.rnd)
        self.per_item = msgs.per_item.tolist()
        self.staged_s = (msgs.strided_send + msgs.contig_send).tolist()
        self.staged_r = (msgs.strided_recv + msgs.contig_recv).tolist()
        self.bs, self.sc, self.rc = base.tolist(), send_copy.tolist(), recv_copy.tolist()
        # A delta refit (sim.delta): a receiver posts a group's payloads once its headers
        # arrived (one latency after its senders posted), and then applies what earlier groups
        # brought; it checks the buckets that did not change at the end of its program (`later`).
        self.delta = msgs.encode_bytes is not None
        self.later = [0.0] * world
        self.recv_seq = [-1] * len(self.rnd)
        slots = self.slots
        # (sender, receiver): its last slots + 1 ring rows
        self.ring_rows = defaultdict(lambda: deque(maxlen=slots + 1))
        self.freed: dict = {}                          # ring row: when its slot was freed
        self.rows: dict = {}                           # process `watch`'s rounds

    def run(self) -> tuple[np.ndarray, dict]:
        i, n = 0, len(self.rnd)
        path, order = self.path, self.order
        while i < n:
            if path[i] == 0:
                i = self.network_group(i)
                continue
            if order[i] == FORWARD_ORDER:
                self.forward_waits(i)
            if path[i] == PATH_CODE[DOMAIN]:
                self.ring_bucket(i)
            else:
                self.local_copy(i)
            i += 1
        for p in range(self.world):
            self.end_run(p)
            while self.inflight[p]:
                self.pop(p)
            if self.later[p]:
                self.work(p, 0.0, self.later[p])
        return (np.maximum(np.maximum(np.array(self.cpu), np.array(self.gpu)),
                           np.array(self.arrived)), self.rows)

    # ---------------------------------------------------------------- clocks
    def work(self, p: int, step: float, copy: float, ring: bool = False) -> None:
        """The host's step, then the copy (on the stream with overlap)."""
        cpu, gpu = self.cpu, self.gpu
        if self.overlap:
            cpu[p] += step
            gpu[p] = max(gpu[p], cpu[p]) + copy
            if ring:
                self.ev[p] = gpu[p]
        else:
            cpu[p] += step + copy
            gpu[p] = cpu[p]

    def block(self, p: int, t: float) -> None:
        """The host waits for `t`, first for its ring copies' events (the executor flushes
        them before it waits)."""
        if t > self.cpu[p]:
            self.cpu[p] = max(self.ev[p], t)

    def note(self, i: int, start: float, end: float, kind: int, own_work: float,
             link_s: float) -> None:
        """Row `i` in process `watch`'s rounds (`kind`: its NIC out, NIC in, NVLink out, in)."""
        row = self.rows.get(self.rnd[i])
        if row is None:
            row = self.rows[self.rnd[i]] = [start, end, [0, 0, 0, 0], 0.0, 0.0]
        row[0], row[1] = min(row[0], start), max(row[1], end)
        row[2][kind] += self.nbytes[i]
        row[3] += own_work
        row[4] += link_s

    # ---------------------------------------------------------------- network groups
    def group_key(self, i: int):
        if self.path[i] != 0 or self.per_item[i] or not self.span:
            return None
        return (self.rnd[i], self.slot[i] // self.span)

    def network_group(self, i: int) -> int:
        """The network group starting at row `i` (a run of rows with the same round and span
        of positions; a bucket whose items travel as their own messages is its own group);
        returns the row after it. Each process first makes room in its window (`W` staging
        buffers, `4 * W` messages: it completes its oldest groups and unpacks them), packs its
        sends, and posts; the group starts no sooner than the stream work queued before it
        (NCCL waits for the current stream) and the process's previous group's end."""
        j = i + 1
        gk = self.group_key(i)
        if gk is not None:
            group_key, n = self.group_key, len(self.rnd)
            while j < n and group_key(j) == gk:
                j += 1
        parts = self._group_parts(i, j)
        inflight, used_buf, used_msg = self.inflight, self.used_buf, self.used_msg
        cpu, gpu, nccl, seq_next = self.cpu, self.gpu, self.nccl, self.seq_next
        bs, sc, W, max_msgs = self.bs, self.sc, self.W, self.max_msgs
        pop, work = self.pop, self.work
        ready = self.take_ready if self.carry else self.end_run
        start = {}
        for p, (buf, cnt, sent, _) in parts.items():
            ready(p)
            while inflight[p] and (used_buf[p] + buf > W or used_msg[p] + cnt > max_msgs):
                pop(p)
            for m in sent:
                work(p, bs[m], sc[m])
            start[p] = max(cpu[p], gpu[p], nccl[p])
        end = self._move_group(i, j, start, parts)
        lat, key = self.lat, (self.rnd[i], self.slot[i])
        for p, (buf, cnt, _, received) in parts.items():
            ge = nccl[p] = end[p] + lat
            inflight[p].append((ge, buf, cnt, received, key, seq_next[p]))
            used_buf[p] += buf
            used_msg[p] += cnt
            seq_next[p] += 1
        rcv, recv_seq = self.rcv, self.recv_seq
        for m in range(i, j):
            recv_seq[m] = seq_next[rcv[m]] - 1
        if self.delta:
            for p in parts:
                q = inflight[p]
                while len(q) > 1 and any(e[3] for e in list(q)[:-1]):
                    pop(p)
        return j

    def _group_parts(self, i: int, j: int) -> dict:
        """Per process of the group of rows i..j: [staging buffers, messages, rows it sends,
        rows it receives]."""
        parts: dict = {}
        snd, rcv, per_item, items = self.snd, self.rcv, self.per_item, self.items
        staged_s, staged_r = self.staged_s, self.staged_r
        for m in range(i, j):
            for p, sending in ((snd[m], True), (rcv[m], False)):
                e = parts.get(p)
                if e is None:
                    e = parts[p] = [0, 0, [], []]
                staged = staged_s[m] if sending else staged_r[m]
                e[0] += 1 if (not per_item[m] or staged) else 0
                e[1] += items[m] if per_item[m] else 1
                e[2 if sending else 3].append(m)
        return parts

    def _move_group(self, i: int, j: int, start: dict, parts: dict) -> dict:
        """A group's messages progress together, sharing each NIC direction: a message ends
        once both its ends are posted and its own bytes have moved, and no sooner than its
        sender's and its receiver's bytes of the group could have (in a delta refit a
        receiver's payloads wait one latency for their headers). Returns each process's last
        message end; a group ends one latency after it."""
        snd, rcv, nbytes, bs = self.snd, self.rcv, self.nbytes, self.bs
        nic, lat, watch = self.nic, self.lat, self.watch
        out_load, in_load = defaultdict(int), defaultdict(int)
        for m in range(i, j):
            out_load[snd[m]] += nbytes[m]
            in_load[rcv[m]] += nbytes[m]
        end = dict.fromkeys(parts, 0.0)
        for m in range(i, j):
            s, r = snd[m], rcv[m]
            t0 = max(start[s] + (lat if self.delta else 0.0), start[r])
            t1 = max(t0 + nbytes[m] / nic, start[s] + out_load[s] / nic,
                     start[r] + in_load[r] / nic)
            end[s], end[r] = max(end[s], t1), max(end[r], t1)
            if s == watch:
                self.note(m, t0, t1 + lat, 0, bs[m] + self.sc[m], t1 - t0)
            if r == watch:
                self.note(m, t0, t1 + lat, 1, bs[m] + self.rc[m], t1 - t0)
        return end

    def pop(self, p: int) -> None:
        """Complete process `p`'s oldest group and unpack what it received (a same bucket of
        a delta refit: checked at the end). With `ring_carry`, while it waits it takes the ring
        receives left behind as they arrive."""
        cpu = self.cpu
        end, buf, n, received, _, seq = self.inflight[p].popleft()
        if self.carry:
            self.take_ready(p)
            if self.deferred[p] and end > cpu[p]:
                cpu[p] = max(cpu[p], self.ev[p])
                keep = []
                for a, m in sorted(self.deferred[p]):
                    if a <= end:
                        cpu[p] = max(cpu[p], a)
                        self.take(p, m)
                    else:
                        keep.append((a, m))
                self.deferred[p] = keep
        self.block(p, end)
        bs, rc, work = self.bs, self.rc, self.work
        if self.delta:
            nbytes = self.nbytes
            for m in received:
                if nbytes[m] == 0:
                    self.later[p] += bs[m] + rc[m]
                else:
                    work(p, bs[m], rc[m])
        else:
            for m in received:
                work(p, bs[m], rc[m])
        self.used_buf[p] -= buf
        self.used_msg[p] -= n
        self.seq_done[p] = seq

    def forward_waits(self, i: int) -> None:
        """A forwarded bucket's forwarder first completes its groups up to the network bucket
        that brought the data (aggregate rows: the groups of the earlier segments)."""
        s, q = self.snd[i], self.parent[i]
        inflight = self.inflight[s]
        if q >= 0:
            while inflight and self.seq_done[s] < self.recv_seq[q]:
                self.pop(s)
        else:
            seg = forward_segment(self.slot[i], self.n_src, self.n_dst)
            before = (self.rnd[i], segment_rotations(seg, self.n_src, self.n_dst)[0])
            while inflight and inflight[0][4] < before:
                self.pop(s)

    # ---------------------------------------------------------------- rings and copies
    def ring_bucket(self, i: int) -> None:
        """A ring bucket: the sender packs into the receiver's slot once it is free (a slot per
        `ring_slots` buckets of that ring), taking the earliest time both NVLink ports are free
        for long enough; with `pack_over_link` the packing is the transfer, else it comes
        first; the sender waits for it unless `host_overlap`. It arrives `ring_latency_s`
        after, and the receiver takes it as `ring_recv` says (`take_ring`)."""
        s, r = self.snd[i], self.rcv[i]
        bs, sc, cpu, gpu = self.bs, self.sc, self.cpu, self.gpu
        if self.in_runs:
            self.take_ready(s)
        self.block(s, self.slot_free(s, r, i))
        if self.over_link:
            cpu[s] += bs[i]
            ready = max(cpu[s], gpu[s])
            d = max(self.nbytes[i] / self.nvl, sc[i])
        else:
            self.work(s, bs[i], sc[i])
            ready = gpu[s]
            d = self.nbytes[i] / self.nvl
        if self.over_link and self.overlap:     # published at the sender's poll of its event
            t0 = self.on_links(s, r, ready, d)
            gpu[s] = self.ev[s] = t1 = t0 + d
            t1 += self.ring_lat
        else:                                   # the sender waits for its stream, then publishes
            t0 = self.on_links(s, r, ready, d + self.ring_lat)
            cpu[s] = gpu[s] = t1 = t0 + d + self.ring_lat
        if s == self.watch:
            self.note(i, t0, t1, 2, bs[i] + sc[i], t1 - t0)
        self.take_ring(i, r, t1)
        if r == self.watch:
            self.note(i, t0, max(cpu[r], gpu[r], t1 + self.rc[i]), 3, bs[i] + self.rc[i],
                      t1 - t0)

    def take_ring(self, i: int, r: int, t1: float) -> None:
        """Receiver `r` takes ring bucket `i` (there at `t1`): "runs", as the executor's runs of
        ring steps, now if it is there, else once the process's other ready work of the run is
        done (`end_run`); "in_order", waiting for it; "as_ready", whenever it is there."""
        if self.in_runs:
            self.take_ready(r)
            if t1 <= self.cpu[r]:
                self.take(r, i)
            else:
                self.deferred[r].append((t1, i))
        elif self.rings_in_order:
            self.block(r, t1)
            self.take(r, i)
        else:
            self.take(r, i)
            self.freed[i] = max(self.freed[i], t1 + self.bs[i] + self.rc[i])
            self.arrived[r] = max(self.arrived[r], t1 + self.bs[i] + self.rc[i])

    def on_links(self, s: int, r: int, t: float, d: float) -> float:
        """The earliest start at or after `t` with both NVLink ports free for `d`, taken."""
        t0 = earliest_free(self.nv_s[s], self.nv_r[r], t, d)
        self.nv_s[s].book(t0, d)
        self.nv_r[r].book(t0, d)
        return t0

    def take(self, p: int, m: int) -> None:
        """Unpack ring bucket m; its slot is free once the unpack's event is done."""
        self.work(p, self.bs[m], self.rc[m], True)
        self.freed[m] = self.gpu[p]

    def take_ready(self, p: int) -> None:
        """Runs: take the ring buckets that arrived by the process's clock."""
        d = self.deferred[p]
        if d:
            keep = []
            for a, m in d:
                if a <= self.cpu[p]:
                    self.take(p, m)
                else:
                    keep.append((a, m))
            self.deferred[p] = keep

    def end_run(self, p: int) -> None:
        """Runs: the run ends once every ring bucket it takes has arrived and is unpacked."""
        d = self.deferred[p]
        if d:
            for a, m in sorted(d):
                self.block(p, a)
                self.take(p, m)
            d.clear()

    def slot_free(self, s: int, r: int, m: int) -> float:
        """When the slot ring bucket m of (s, r) is packed into is free: `slots` buckets
        earlier on that ring released; a receiver that left that one behind takes it now."""
        slots = self.slots
        if slots is None:
            return 0.0
        sent = self.ring_rows[(s, r)]
        sent.append(m)
        if len(sent) <= slots:
            return 0.0
        old = sent[0]
        if old not in self.freed:
            d = self.deferred[r]
            for j, (a, q) in enumerate(d):
                if q == old:
                    del d[j]
                    if self.overlap:
                        # its host takes it once it is there (between the slices of its
                        # waits), without waiting for it; the unpack queues on its stream
                        self.cpu[r] += self.bs[old]
                        self.gpu[r] = self.ev[r] = max(self.gpu[r], a + self.bs[old]) \
                            + self.rc[old]
                        self.freed[old] = self.gpu[r]
                    else:
                        self.block(r, a)
                        self.take(r, old)
                    break
        return self.freed[old]

    def local_copy(self, i: int) -> None:
        """A local copy: the sender's copy, then the receiver's once it is done."""
        s, r = self.snd[i], self.rcv[i]
        if not self.carry:
            self.end_run(s)
            self.end_run(r)
        self.work(s, self.bs[i], self.sc[i])
        self.block(r, self.gpu[s])
        self.work(r, self.bs[i], self.rc[i])
