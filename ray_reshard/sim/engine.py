"""Replay a refit plan's schedule on a described cluster.

Model
-----
Every process runs its share of the schedule in the order the executor runs it (the global
key order, `plan.run_order` where network groups span several positions of a round); the
simulator walks that order once and keeps per process a host clock, a stream clock (with
`host_overlap`; else the host does the copies and the two are one), the end of its last
network group, and its network groups in flight:

* network buckets are posted in groups: a run of keys with the same round and the same span of
  `plan.group_span` positions (on a CPU cluster, a bucket whose items all travel as their own
  messages is its own group). Posting needs a staging buffer per packed bucket; with `window`
  buffers (or `4 * window` messages) in use the process first completes its oldest group, then
  unpacks it. Packing runs before the post, and the group starts no sooner than the stream
  work queued before it (NCCL waits for the current stream);
* a process's groups run one after another (one NCCL stream), a group starts once its process
  posted it and the previous one ended; its messages move together: each ends once both its
  ends' groups started and its bytes moved, no sooner than its sender's (receiver's) bytes of
  the group could leave (arrive) at the NIC's rate; a group ends with its last message plus
  one `latency_s`;
* a domain (ring) bucket is packed by its sender into the receiver's slot (the sender's host
  waits for it unless `host_overlap`; NVLink send and receive ports of both ends are busy
  meanwhile: it takes the earliest time both are free for long enough, gaps left between
  transfers replayed earlier included, and it arrives `ring_latency_s` after;
  with `pack_over_link`, GPU clusters, the packing copy is the link transfer, else it comes
  first; with `single_copy_rings`, the CPU preset, a sender whose regions are all contiguous
  copies nothing and its receiver copies straight out of its memory). The receiver takes it
  as the executor does (`ring_recv="runs"`): within a run of
  consecutive ring steps of its program, at once when it has arrived by the time the process
  reaches it, else after the run's other ready work, and the run ends once all have arrived and
  are unpacked (with `ring_carry`, NCCL clusters, it ends without the receives not there yet,
  which are taken as they arrive while the process waits for network messages, or at its next
  ring step or post after they arrived). `"in_order"` takes each strictly when reached, in key
  order; the what-if `"as_ready"` whenever it is there, without holding up the rest of the
  program. A ring has `ring_slots` slots (the executor's 2): a sender's next bucket on a ring
  waits until the bucket that many before it on that ring is unpacked at the receiver (its
  slot freed once the unpack's event is done); one its receiver left behind is taken then,
  once it is there;
* forwarded buckets (what a forwarder passes to one target out of the network buckets of a
  segment of a round's rotations, merged) sort into the next segment, spread over its
  rotations: the forwarder first completes its groups up to the last network bucket they draw
  from, so the next segment's receives are in flight while it forwards;
* CPU work per bucket end: `step_s`, plus `item_s` per item unless its regions are copied
  by one copy-table launch (`copy_tables`, GPU clusters), plus `message_s` per message where
  items travel as their own messages, plus its copies: bytes of strided regions at
  `copy_Bps`, of contiguous regions at `contig_copy_Bps`; network items in place (CPU wire
  format, `per_item_min_bytes`) copy nothing. With `host_overlap` (GPU clusters) the step
  is host time and the copy stream time: the host issues the copy and goes on (a ring slot
  is published once its copy's event is done), and before it waits for anything (a network
  group not yet ended, a ring bucket not yet there) it waits for its ring copies' events, as
  the executor flushes them. Every process first checks its local tensors
  (`tensor_s` each: a refit checks each local tensor the shards live in, e.g. one fused
  tensor for all of a layer's experts) and its view table (`shard_s` per shard).

The replay ends when every process has completed and unpacked everything. Where the cluster
caps the sum over all links (`fabric_Bps`, `domain_fabric_Bps`) the refit takes at least those
bytes over that rate; where ranks share `cpu_cores`, those fabrics are the same cores (loopback
sockets, shared-memory copies), so fabric time and all ranks' CPU work add up into one floor.
Predicted = max(replay, floor) + `refit_overhead_s`.

Two ways to get the buckets: `exact` walks `Plan.schedule(bucket_bytes).transfers` (the buckets
the executor runs); `aggregate` sums each (sender, receiver, path) pair's bytes, items and
copies from the plan's moves and cuts them into as many about equal buckets as the schedule
does, at the schedule's turns (`Plan.network_turns`) and in its key order, which avoids
building the schedule (millions of items at DeepSeek-V3 scale). Both take the cluster's
`per_item_min_bytes`, which marks the network buckets that travel as one message per item
(their contiguous ends copy nothing); `replay` refuses buckets built with another. A
forwarded (source, forwarder, target) total fills its share of the network pair's turns (all
of them where the target takes everything the pair brings); per (forwarder, target, segment)
the totals are merged and cut into buckets placed as `plan.forward_key` places them, and a
forward waits for all of its forwarder's groups of the earlier segments.

The bound is what no schedule can beat on this plan: the busiest NIC's bytes over its
bandwidth, the same for NVLink, and the fabrics' caps. `balanced_bound_s` is the network lower
bound spread perfectly over every destination NIC.

gather_broadcast follows the runtime's strategy: per tensor, a ring all-gather among one replica
of each source shard, then a pipelined broadcast of the whole tensor from one source to every
destination rank holding a part, tensor after tensor.
"""
from __future__ import annotations

import bisect
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..planning.plan import DEFAULT_BUCKET_BYTES, Plan
from ..planning.schedule import (MAX_WINDOW, bucket_keys, default_window, forward_key,
                                 forward_segment, group_span, is_forward_key, parent_key,
                                 segment_rotations)
from ..planning.moves import DOMAIN, LOCAL, NETWORK
from .cluster import Cluster

PATH_CODE = {NETWORK: 0, DOMAIN: 1, LOCAL: 2}   # also the key's order of the paths
PATHS = {c: p for p, c in PATH_CODE.items()}
FORWARD_ORDER = 3                                # a forwarded bucket's `order` below
# How a process takes its ring (domain) buckets: "runs", as the executor does (within a run of
# consecutive ring steps, whichever is ready first); "in_order", strictly in key order;
# "as_ready", a what-if: whenever they arrive, without holding up the rest of its program.
RING_RECV = ("runs", "in_order", "as_ready")


@dataclass
class Messages:
    """One row per bucket, in the schedule's global order.

    `order` is 0 network, 1 domain, 2 local, 3 forwarded; `parent` is
    the row of the network bucket a forwarded one passes on (-1: none, or unknown in the
    aggregate replay). Copied bytes per end: `strided_*` out of or into a strided region of the
    local shard, `contig_*` a contiguous one; the rest of a bucket's bytes move in place when
    `per_item` (a network bucket whose items all travel as their own messages on CPU).
    `per_item_min_bytes` is the threshold these rows were built with (see `messages_exact`);
    `replay` takes them only on a cluster with the same one.
    """

    round: np.ndarray
    order: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    path: np.ndarray
    nbytes: np.ndarray
    items: np.ndarray
    strided_send: np.ndarray
    strided_recv: np.ndarray
    contig_send: np.ndarray
    contig_recv: np.ndarray
    per_item: np.ndarray
    parent: np.ndarray
    mode: str
    slot: Optional[np.ndarray] = None   # the key's position in its round (groups, forwards)
    itemsize: Optional[np.ndarray] = None   # the smallest element size of a bucket's items
    # A delta refit's buckets (`sim.delta.delta_messages`): bytes each sender compares against
    # its baseline and each receiver decodes or checksums; their copies are then final, and
    # `nbytes` is the payload.
    encode_bytes: Optional[np.ndarray] = None
    decode_bytes: Optional[np.ndarray] = None
    per_item_min_bytes: Optional[int] = None


class _Staging:
    """What each end of an item copies where its bucket is packed: from/to a strided or a
    contiguous region of its local shard. In a bucket whose items travel as their own messages
    the contiguous ends copy nothing (see `_in_place`)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.boxes: dict = {}

    def _holder(self, ti: int, side: str, rank: int):
        spec = self.plan.specs[ti]
        lay = spec.src if side == "src" else spec.dst
        key = (id(lay), spec.shape, rank)
        b = self.boxes.get(key)
        if b is None:
            b = self.boxes[key] = lay.box(rank, spec.shape)
        return b

    @staticmethod
    def _contiguous(box, holder) -> bool:
        if holder is None:
            return False
        sizes, full = box.sizes, holder.sizes
        for i, n in enumerate(sizes):
            if n > 1:
                return all(sizes[j] == full[j] for j in range(i + 1, len(sizes)))
        return True

    def __call__(self, ti: int, box, nbytes: int, src_side: str, src_rank: int,
                 dst_rank: int) -> tuple[int, int, int, int]:
        """(strided sent, contiguous sent, strided received, contiguous received) bytes copied."""
        cs = self._contiguous(box, self._holder(ti, src_side, src_rank))
        cr = self._contiguous(box, self._holder(ti, "dst", dst_rank))
        return (0 if cs else nbytes, nbytes if cs else 0, 0 if cr else nbytes,
                nbytes if cr else 0)


def _in_place(code: int, smallest: int, min_bytes: Optional[int]) -> bool:
    """Whether a bucket's items travel as their own messages, each contiguous end sending from
    or receiving into its region in place (the executor's `per_item`): a network bucket whose
    smallest item has at least `min_bytes` (None: never)."""
    return code == PATH_CODE[NETWORK] and min_bytes is not None and smallest >= min_bytes


@dataclass
class SimResult:
    cluster: Cluster
    mode: str
    bucket_bytes: int
    predicted_s: float
    bound_s: float
    nic_bound_s: float
    nvlink_bound_s: float
    balanced_bound_s: float
    network_bytes: int
    min_network_bytes: int
    domain_bytes: int
    rounds: int
    messages: int
    busiest_links: list = field(default_factory=list)    # (name, bytes, seconds at full rate)
    timeline: list = field(default_factory=list)         # one rank: per round
    timeline_rank: str = ""
    cpu_s: float = 0.0          # the busiest process's CPU work (items, copies, view lookups)
    window: int = 2
    replay_s: float = 0.0       # the per-process replay alone
    shared_s: float = 0.0       # what shared cores / fabrics need at least (0: none shared)

    def as_dict(self) -> dict:
        return {
            "cluster": self.cluster.name, "mode": self.mode, "bucket_bytes": self.bucket_bytes,
            "window": self.window, "predicted_s": self.predicted_s, "bound_s": self.bound_s,
            "nic_bound_s": self.nic_bound_s, "nvlink_bound_s": self.nvlink_bound_s,
            "balanced_bound_s": self.balanced_bound_s, "network_bytes": self.network_bytes,
            "min_network_bytes": self.min_network_bytes, "domain_bytes": self.domain_bytes,
            "rounds": self.rounds, "messages": self.messages, "cpu_s": self.cpu_s,
            "replay_s": self.replay_s, "shared_s": self.shared_s,
            "busiest_links": [{"link": n, "bytes": b, "seconds": s} for n, b, s in self.busiest_links],
            "timeline_rank": self.timeline_rank, "timeline": self.timeline,
        }


def _gpu(plan: Plan):
    n_src = plan.topology.n_src
    return n_src, n_src + plan.topology.n_dst


def _check_threshold(per_item_min_bytes) -> None:
    if per_item_min_bytes is not None and (isinstance(per_item_min_bytes, bool)
                                           or not isinstance(per_item_min_bytes, int)
                                           or per_item_min_bytes < 1):
        raise ValueError(f"per_item_min_bytes must be a positive int or None (every bucket "
                         f"packed), got {per_item_min_bytes!r}")


def messages_exact(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   per_item_min_bytes: Optional[int] = None) -> Messages:
    """The schedule's buckets, as the executor runs them on a cluster whose network items of
    at least `per_item_min_bytes` travel as their own messages (`Cluster.per_item_min_bytes`;
    None: every bucket packed, as on GPUs)."""
    _check_threshold(per_item_min_bytes)
    n_src, _ = _gpu(plan)
    ts = plan.schedule(bucket_bytes).transfers
    n = len(ts)
    cols = [np.empty(n, dtype=np.int64) for _ in range(12)]
    rnd, order, snd, rcv, pth, nb, it, ss, sr, cs, cr, parent = cols
    slot = np.empty(n, dtype=np.int64)
    per_item = np.zeros(n, dtype=bool)
    staging = _Staging(plan)
    isz = [spec.itemsize for spec in plan.specs]
    row_of: dict = {}
    itemsize = np.empty(n, dtype=np.int64)
    for i, t in enumerate(ts):
        rnd[i], slot[i] = t.key[0], t.key[2]
        order[i] = FORWARD_ORDER if t.src.side == "dst" else t.key[1]
        snd[i] = t.src.rank if t.src.side == "src" else n_src + t.src.rank
        rcv[i] = n_src + t.dst
        pth[i] = code = PATH_CODE[t.path]
        nb[i] = t.nbytes
        it[i] = len(t.items)
        acc = [0, 0, 0, 0]
        smallest = 1 << 62
        itemsize[i] = min(isz[item.tensor] for item in t.items)
        for item in t.items:
            nbytes = item.box.numel * isz[item.tensor]
            smallest = min(smallest, nbytes)
            for j, v in enumerate(staging(item.tensor, item.box, nbytes, t.src.side,
                                          t.src.rank, t.dst)):
                acc[j] += v
        per_item[i] = _in_place(code, smallest, per_item_min_bytes)
        if per_item[i]:
            acc[1] = acc[3] = 0
        ss[i], cs[i], sr[i], cr[i] = acc
        if code == 0:
            row_of[t.key] = i
        parent[i] = row_of.get(parent_key(t), -1) if order[i] == FORWARD_ORDER else -1
    return Messages(rnd, order, snd, rcv, pth, nb, it, ss, sr, cs, cr, per_item, parent, "exact",
                    slot, itemsize, per_item_min_bytes=per_item_min_bytes)


def _share_of(total: int, n: int, k: int) -> int:
    """Bytes of bucket k of a pair whose `total` bytes the schedule cuts into n about equal
    buckets (`plan.bucket_starts`)."""
    return total * (k + 1) // n - total * k // n


def messages_aggregate(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       per_item_min_bytes: Optional[int] = None) -> Messages:
    """Per (sender, receiver, path) byte and item totals cut into buckets of at most
    bucket_bytes, in the schedule's key order: a network pair's bytes in as many about equal
    buckets as the schedule cuts (others ceil(total / bucket_bytes)), its k-th at its k-th turn
    (`Plan.network_turns`; others in round k); what a forwarder passes on to one target out of
    a segment of a round (each network pair's forwarded bytes placed in that pair's turns)
    merged and cut into buckets placed as `plan.forward_key` places them. `per_item_min_bytes`:
    as in `messages_exact`."""
    _check_threshold(per_item_min_bytes)
    n_src, world = _gpu(plan)
    n_dst = world - n_src
    staging = _Staging(plan)
    # per (sender, receiver, path, parent) - parent: for a forwarded piece the source whose
    # network bucket brought it in, else -1 - bytes, items, strided sent, contiguous sent,
    # strided received, contiguous received, smallest move, smallest itemsize
    pairs: dict[tuple, list] = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 1 << 62, 1 << 62])
    for tp, count, ti in plan.distinct_plans:
        isz = tp.itemsize
        per = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 1 << 62, isz])
        brought_by = {(m.dst, m.box): m.src.rank for m in tp.moves
                      if m.path == NETWORK and m.src.side == "src"}
        for m in tp.moves:
            forwarded = m.src.side == "dst"
            s = n_src + m.src.rank if forwarded else m.src.rank
            parent = brought_by.get((m.src.rank, m.box), -1) if forwarded else -1
            code = PATH_CODE[m.path]
            e = per[(s, n_src + m.dst, code, parent)]
            nbytes = m.box.numel * isz
            a = staging(ti, m.box, nbytes, m.src.side, m.src.rank, m.dst)
            e[0] += nbytes
            e[1] += 1
            e[2] += a[0]
            e[3] += a[1]
            e[4] += a[2]
            e[5] += a[3]
            e[6] = min(e[6], nbytes)
        for k, v in per.items():
            e = pairs[k]
            for j in range(6):
                e[j] += count * v[j]
            e[6] = min(e[6], v[6])
            e[7] = min(e[7], v[7])
    rows = []   # (key, sender, receiver, path, bytes, items, 4 copied counts, per item, itemsize)
    turns = plan.network_turns(bucket_bytes)      # the schedule's, so its bucket counts too
    net_of = {}
    for (snd, rcv, code, parent), v in pairs.items():
        if parent < 0:
            n = (len(turns[(snd, rcv - n_src)]) if code == PATH_CODE[NETWORK] and turns
                 else max(1, -(-v[0] // bucket_bytes)))
            net_of[(snd, rcv)] = (n, v[0])
    # what each forwarder passes to each target per round: (f, t, path, k) -> totals
    fwd: dict[tuple, list] = defaultdict(lambda: [0.0] * 6 + [1 << 62])
    for (snd, rcv, code, parent), v in pairs.items():
        if parent >= 0:
            # The pieces a target takes from a network pair fill about their share of that
            # pair's buckets (all of them where it takes everything the pair brings): spread
            # them over that many of the pair's rounds, staggered by target, in proportion to
            # the bytes the pair brings in each.
            nbk, pair_bytes = net_of.get((parent, snd), (1, v[0]))
            m = max(1, min(nbk, -(-v[0] * nbk // max(1, pair_bytes))))
            ks = [(parent + rcv + i * nbk // m) % nbk for i in range(m)]
            sizes = [_share_of(pair_bytes, nbk, k) for k in ks]
            whole = sum(sizes) or 1
            keys = bucket_keys(nbk, parent, parent, snd - n_src, NETWORK,
                               turns if (parent, snd) in net_of else None, n_src, n_dst)
            for k, size in zip(ks, sizes):
                e = fwd[(snd, rcv, code, keys[k][0], forward_segment(keys[k][2], n_src, n_dst))]
                for j in range(6):
                    e[j] += v[j] * size / whole
                e[6] = min(e[6], v[7])
            continue
        n = net_of[(snd, rcv)][0]
        tot, items = v[0], v[1]
        keys = bucket_keys(n, snd, snd, rcv - n_src, PATHS[code], turns, n_src, n_dst)
        for k in range(n):
            nb = _share_of(tot, n, k)
            share = nb / max(1, tot)
            it = max(1, items // n + (k < items % n))
            # all of a pair's buckets travel per item where its smallest move reaches the
            # threshold, else all are packed (the schedule's own buckets may differ)
            packed = not _in_place(code, v[6], per_item_min_bytes)
            rows.append((keys[k], snd, rcv, code, nb, it, int(v[2] * share),
                         int(v[3] * share) if packed else 0, int(v[4] * share),
                         int(v[5] * share) if packed else 0, not packed, v[7]))
    for (f, t, code, k, seg), v in fwd.items():
        tot = int(round(v[0]))
        n = max(1, -(-tot // bucket_bytes))
        for c in range(n):
            nb = bucket_bytes if c < n - 1 else tot - (n - 1) * bucket_bytes
            share = nb / max(1, tot)
            it = max(1, int(round(v[1] / n)))
            key = forward_key(k, seg, f - n_src, t - n_src, PATHS[code], c, (k, 0, 0, 0), n_src,
                              n_dst)
            rows.append((key, f, t, code, nb, it, *(int(v[j] * share) for j in (2, 3, 4, 5)),
                         False, v[6]))
    rows.sort(key=lambda r: r[0])
    n = len(rows)
    col = lambda j, dt=np.int64: np.fromiter((r[j] for r in rows), dtype=dt, count=n)
    keys = [r[0] for r in rows]
    fwd_row = np.fromiter(map(is_forward_key, keys), dtype=bool, count=n)
    path = col(3)
    return Messages(np.fromiter((k[0] for k in keys), dtype=np.int64, count=n),
                    np.where(fwd_row, FORWARD_ORDER, path), col(1), col(2), path, col(4),
                    col(5), col(6), col(8), col(7), col(9), col(10, bool),
                    np.full(n, -1, dtype=np.int64), "aggregate",
                    np.fromiter((k[2] for k in keys), dtype=np.int64, count=n), col(11),
                    per_item_min_bytes=per_item_min_bytes)


def simulate(plan: Plan, cluster: Cluster, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             mode: str = "auto", timeline_rank: Optional[tuple] = None,
             exact_max_moves: int = 200_000, window: Optional[int] = None,
             ring_recv: str = "runs") -> SimResult:
    """Predict the refit time of `plan` on `cluster` (see the module docstring).

    `mode`: "exact" (replay the schedule), "aggregate" (per-pair byte counts per round) or
    "auto" (exact up to `exact_max_moves` moves). `window`: staged buckets in flight per
    process (default: the executor's, from `bucket_bytes`). `timeline_rank`: ("src"|"dst",
    rank) whose rounds to report (default: the rank with the busiest link). `ring_recv`:
    "in_order" (the executor: a ring receive waits for its bucket, in key order) or "as_ready"
    (a what-if: ring buckets are taken whenever they arrive, without holding up the rest of the
    receiver's program).
    """
    if mode not in ("auto", "exact", "aggregate"):
        raise ValueError(f"mode must be 'auto', 'exact' or 'aggregate', got {mode!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= MAX_WINDOW):
        raise ValueError(f"window must be an int in 1..{MAX_WINDOW} (or None: the executor's "
                         f"default for bucket_bytes), got {window!r}")
    if ring_recv not in RING_RECV:
        raise ValueError(f"ring_recv must be one of {', '.join(map(repr, RING_RECV))}, "
                         f"got {ring_recv!r}")
    if mode == "auto":
        mode = "exact" if plan.stats.n_moves <= exact_max_moves else "aggregate"
    msgs = (messages_exact if mode == "exact" else messages_aggregate)(
        plan, bucket_bytes, cluster.per_item_min_bytes)
    return replay(plan, msgs, cluster, bucket_bytes, timeline_rank, window, ring_recv)


def _ranks_of(plan: Plan):
    """Per tensor, the GPUs (sources first, then destinations) that send or receive it, sorted
    (an array), and how many of them are sources."""
    n_src, _ = _gpu(plan)
    ranks_of: dict[int, tuple] = {}
    for tp in plan.tensor_plans:
        got = ranks_of.get(id(tp))
        if got is None:
            seen = set()
            for m in tp.moves:
                seen.add(m.src.rank if m.src.side == "src" else n_src + m.src.rank)
                seen.add(n_src + m.dst)
            rs = sorted(seen)
            got = ranks_of[id(tp)] = (np.array(rs, dtype=np.int64), bisect.bisect_left(rs, n_src))
        yield got


def checks_per_process(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU (sources first, then destinations): how many local tensors its shards live in
    (a spec's slots name them; a shard without a slot is a local tensor of its own), and how
    many shards it sends or receives. A refit checks the first and copies a table of the
    second."""
    n_src, world = _gpu(plan)
    shards = np.zeros(world, dtype=np.int64)
    own = np.zeros(world, dtype=np.int64)
    named: dict = {}                       # storage name -> which GPUs hold it
    for ti, (rs, cut) in enumerate(_ranks_of(plan)):
        shards[rs] += 1
        spec = plan.specs[ti]
        for gids, slots, base in ((rs[:cut], spec.src_slots, 0), (rs[cut:], spec.dst_slots, n_src)):
            if not slots:
                own[gids] += 1
                continue
            uniform, ranks = slots.uniform, slots.ranks
            if (uniform is not None and len(gids) and ranks[-1] - ranks[0] == len(ranks) - 1
                    and ranks[0] + base <= gids[0] and gids[-1] <= ranks[-1] + base):
                # the usual case: one fused tensor on a run of ranks holding all of these
                mask = named.get(uniform.storage)
                if mask is None:
                    mask = named[uniform.storage] = np.zeros(world, dtype=bool)
                mask[gids] = True
                continue
            for g in gids.tolist():
                slot = slots.get(g - base)
                if slot is None:
                    own[g] += 1
                    continue
                mask = named.get(slot.storage)
                if mask is None:
                    mask = named[slot.storage] = np.zeros(world, dtype=bool)
                mask[g] = True
    local = own + (np.sum(list(named.values()), axis=0, dtype=np.int64) if named else 0)
    return local, shards


def _link_names(n_src: int, world: int) -> list[str]:
    def who(g):
        return f"src {g}" if g < n_src else f"dst {g - n_src}"
    kinds = ("NIC send", "NIC recv", "NVLink send", "NVLink recv")
    return [f"{who(g)} {k}" for k in kinds for g in range(world)]


def _work(msgs: Messages, cluster: Cluster) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per bucket: the host's step at either end (per item, per message, per bucket end), and
    the copy seconds at its sender and at its receiver."""
    ss, cs = msgs.strided_send.astype(np.float64), msgs.contig_send.astype(np.float64)
    sr, cr = msgs.strided_recv.astype(np.float64), msgs.contig_recv.astype(np.float64)
    if cluster.single_copy_rings:
        # a ring bucket whose sender regions are all contiguous is read by its receiver
        # straight out of the sender's memory: the sender copies nothing, and a receiver
        # with strided regions copies into a bucket first (contiguous), then out of it
        listed = (msgs.path == PATH_CODE[DOMAIN]) & (ss == 0)
        cs = np.where(listed, 0.0, cs)
        cr = np.where(listed, cr + sr, cr)
    base = cluster.step_s + (0.0 if cluster.copy_tables else msgs.items * cluster.item_s)
    if cluster.message_s:
        base = base + np.where(msgs.per_item, msgs.items * cluster.message_s, 0.0)
    base = np.broadcast_to(np.asarray(base, dtype=np.float64), msgs.nbytes.shape)
    send = ss / cluster.copy_Bps + cs / cluster.contig_copy_Bps
    recv = sr / cluster.copy_Bps + cr / cluster.contig_copy_Bps
    if msgs.encode_bytes is not None:
        send = send + msgs.encode_bytes / cluster.delta_encode_Bps
        recv = recv + msgs.decode_bytes / cluster.delta_decode_Bps
    return base, send, recv


def replay(plan: Plan, msgs: Messages, cluster: Cluster, bucket_bytes: int,
           timeline_rank: Optional[tuple] = None, window: Optional[int] = None,
           ring_recv: str = "runs") -> SimResult:
    """Replay `msgs` (built with the cluster's `per_item_min_bytes`) on `cluster`; the
    arguments as in `simulate`."""
    if msgs.per_item_min_bytes != cluster.per_item_min_bytes:
        raise ValueError(
            f"these messages were built with per_item_min_bytes={msgs.per_item_min_bytes!r}, "
            f"cluster {cluster.name!r} has {cluster.per_item_min_bytes!r}: build them with "
            f"messages_exact/messages_aggregate(plan, bucket_bytes, "
            f"cluster.per_item_min_bytes)")
    n_src, world = _gpu(plan)
    st = plan.stats
    W = window or default_window(bucket_bytes)
    msgs = _in_run_order(msgs, group_span(W, max(n_src, world - n_src)))
    net = msgs.path == PATH_CODE[NETWORK]
    dom = msgs.path == PATH_CODE[DOMAIN]
    R = int(msgs.round.max()) + 1 if len(msgs.round) else 0
    base, send_copy, recv_copy = _work(msgs, cluster)
    send_work, recv_work = base + send_copy, base + recv_copy
    local, shards = checks_per_process(plan)
    prep = local * cluster.tensor_s + shards * cluster.shard_s

    total = np.zeros(4 * world)
    for mask, base_s, base_r in ((net, 0, world), (dom, 2 * world, 3 * world)):
        w = msgs.nbytes[mask].astype(np.float64)
        total += (np.bincount(base_s + msgs.sender[mask], w, minlength=4 * world)
                  + np.bincount(base_r + msgs.receiver[mask], w, minlength=4 * world))
    bw = np.concatenate([np.full(2 * world, cluster.nic_Bps), np.full(2 * world, cluster.nvlink_Bps)])
    t_full = total / bw
    if timeline_rank is None:
        g = int(np.argmax(t_full)) % world if len(msgs.round) else 0
    else:
        side, r = timeline_rank
        g = r if side == "src" else n_src + r

    cpu, rows = _replay_processes(msgs, cluster, W, world, base, send_copy, recv_copy, prep, g,
                                  ring_recv, n_src=n_src)
    replay_s = float(cpu.max()) if world else 0.0

    # Shared resources: all network bytes cross `fabric_Bps`, all domain bytes
    # `domain_fabric_Bps`; where ranks share `cpu_cores`, those fabrics are the same cores
    # (loopback sockets, shared-memory copies), so fabric time and every rank's CPU work add up.
    net_bytes = float(msgs.nbytes[net].sum())
    dom_bytes = float(msgs.nbytes[dom].sum())
    fab = [net_bytes / cluster.fabric_Bps if cluster.fabric_Bps else 0.0,
           dom_bytes / cluster.domain_fabric_Bps if cluster.domain_fabric_Bps else 0.0]
    if cluster.cpu_cores:
        shared = sum(fab) + (float(send_work.sum() + recv_work.sum()) + float(prep.sum())) \
            / cluster.cpu_cores
    else:
        shared = max(fab)
    predicted = max(replay_s, shared) + cluster.refit_overhead_s

    nic_bound = float((total[:2 * world] / cluster.nic_Bps).max()) if world else 0.0
    nvl_bound = float((total[2 * world:] / cluster.nvlink_Bps).max()) if world else 0.0
    bound = max(nic_bound, nvl_bound, *fab)
    balanced = st.min_network_bytes / (plan.topology.n_dst * cluster.nic_Bps)

    names = _link_names(n_src, world)
    top = np.argsort(-t_full)[:5]
    busiest = [(names[i], int(total[i]), float(t_full[i])) for i in top if total[i] > 0]
    label = f"src {g}" if g < n_src else f"dst {g - n_src}"
    timeline = []
    for k in sorted(rows):
        start, end, b, work, link = rows[k]
        timeline.append({"round": k, "start_s": start, "end_s": end, "nic_send": b[0],
                         "nic_recv": b[1], "nvlink_send": b[2], "nvlink_recv": b[3],
                         "limited_by": "cpu" if work > link else "link"})
    work_by_proc = (np.bincount(msgs.sender, send_work, minlength=world)
                    + np.bincount(msgs.receiver, recv_work, minlength=world) + prep)
    return SimResult(cluster, msgs.mode, bucket_bytes, predicted, bound, nic_bound, nvl_bound,
                     balanced, st.network_bytes, st.min_network_bytes, st.domain_bytes, R,
                     len(msgs.round), busiest, timeline, label,
                     float(work_by_proc.max()) if world else 0.0, W, replay_s, shared)


def _in_run_order(msgs: Messages, span: int) -> Messages:
    """The rows in the order processes run them with network groups of `span` positions
    (`plan.run_order`: forwards sorting inside a group's positions run right after it)."""
    if span <= 1 or msgs.slot is None or not len(msgs.round):
        return msgs
    fwd = msgs.order == FORWARD_ORDER
    first = np.where(fwd, 0, msgs.order)
    block = np.where(first == 0, msgs.slot // span, 0)
    o = np.lexsort((np.arange(len(fwd)), fwd & (first == 0), block, first, msgs.round))
    if np.array_equal(o, np.arange(len(o))):
        return msgs
    inv = np.empty_like(o)
    inv[o] = np.arange(len(o))
    par = msgs.parent[o]
    cols = {f: getattr(msgs, f)[o] for f in ("round", "order", "sender", "receiver", "path",
                                             "nbytes", "items", "strided_send", "strided_recv",
                                             "contig_send", "contig_recv", "per_item", "slot")}
    cols.update({f: getattr(msgs, f)[o] for f in ("itemsize", "encode_bytes", "decode_bytes")
                 if getattr(msgs, f) is not None})
    return Messages(parent=np.where(par >= 0, inv[np.maximum(par, 0)], -1), mode=msgs.mode,
                    per_item_min_bytes=msgs.per_item_min_bytes, **cols)


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


def _replay_processes(msgs: Messages, cluster: Cluster, W: int, world: int, base, send_copy,
                      recv_copy, prep, watch: int, ring_recv: str = "runs", n_src: int = 0):
    """Every process's program in the global key order (see the module docstring).

    Each process has a host clock and, with `host_overlap`, a GPU stream clock: the host pays a
    bucket end's step and queues its copy on the stream; before it waits for anything it waits
    for its ring copies' events (`RingChannel.flush`), and a network group starts no sooner
    than the stream work queued before it (NCCL waits for the current stream).
    Without `host_overlap` the copies are host work.

    Returns each process's finishing time and, for process `watch`, per round: (first start,
    last end, [NIC out, NIC in, NVLink out, NVLink in] bytes, CPU work, link seconds)."""
    span = group_span(W, max(n_src, world - n_src))
    max_msgs = 4 * W
    nic, nvl, lat = cluster.nic_Bps, cluster.nvlink_Bps, cluster.latency_s
    ring_lat = cluster.ring_latency_s
    overlap = cluster.host_overlap
    carry = cluster.ring_carry and ring_recv == "runs"
    cpu = [float(x) for x in prep]               # each process's host clock
    gpu = list(cpu)                               # its stream (= the host clock without overlap)
    ev = [0.0] * world                            # when its last ring copy is done (its event)
    nccl = [0.0] * world                          # when its previous network group ends
    nv_s, nv_r = [Link() for _ in range(world)], [Link() for _ in range(world)]
    inflight = [deque() for _ in range(world)]    # (end, buffers, messages, rows received, (round, slot), seq)
    used_buf, used_msg = [0] * world, [0] * world
    seq_next, seq_done = [0] * world, [-1] * world
    rnd, order, path = msgs.round.tolist(), msgs.order.tolist(), msgs.path.tolist()
    snd, rcv, nbytes = msgs.sender.tolist(), msgs.receiver.tolist(), msgs.nbytes.tolist()
    items, parent = msgs.items.tolist(), msgs.parent.tolist()
    slot = msgs.slot.tolist() if msgs.slot is not None else [0] * len(rnd)
    n_dst = world - n_src
    per_item = msgs.per_item.tolist()
    staged_s = (msgs.strided_send + msgs.contig_send).tolist()
    staged_r = (msgs.strided_recv + msgs.contig_recv).tolist()
    bs, sc, rc = base.tolist(), send_copy.tolist(), recv_copy.tolist()
    over_link = cluster.pack_over_link
    # A delta refit (sim.delta): a receiver posts a group's payloads once its headers arrived
    # (one latency after its senders posted), and then applies what earlier groups brought;
    # it checks the buckets that did not change at the end of its program (`later`).
    delta = msgs.encode_bytes is not None
    later = [0.0] * world
    recv_seq = [-1] * len(rnd)
    arrived = [0.0] * world                       # ring buckets taken as ready: last unpacked
    rings_in_order = ring_recv == "in_order"
    in_runs = ring_recv == "runs"
    deferred = [[] for _ in range(world)]         # runs: (arrival, row) not yet taken
    slots = cluster.ring_slots or None            # slots per ring (None: no limit)
    # (sender, receiver): its last slots + 1 ring rows
    ring_rows = defaultdict(lambda: deque(maxlen=slots + 1))
    freed: dict = {}                              # ring row: when its slot was freed
    rows: dict = {}

    def work(p, step, copy, ring=False):
        # the host's step, then the copy (on the stream with overlap)
        if overlap:
            cpu[p] += step
            gpu[p] = max(gpu[p], cpu[p]) + copy
            if ring:
                ev[p] = gpu[p]
        else:
            cpu[p] += step + copy
            gpu[p] = cpu[p]

    def block(p, t):
        # the host waits for `t`, first for its ring copies' events (the executor flushes
        # them before it waits)
        if t > cpu[p]:
            cpu[p] = max(ev[p], t)

    def on_links(s, r, t, d):
        # the earliest start at or after `t` with both NVLink ports free for `d`, taken
        t0 = earliest_free(nv_s[s], nv_r[r], t, d)
        nv_s[s].book(t0, d)
        nv_r[r].book(t0, d)
        return t0

    def take(p, m):
        # unpack ring bucket m; its slot is free once the unpack's event is done
        work(p, bs[m], rc[m], True)
        freed[m] = gpu[p]

    def take_ready(p):
        # runs: take the ring buckets that arrived by the process's clock
        d = deferred[p]
        if d:
            keep = []
            for a, m in d:
                if a <= cpu[p]:
                    take(p, m)
                else:
                    keep.append((a, m))
            deferred[p] = keep

    def slot_free(s, r, m):
        # when the slot ring bucket m of (s, r) is packed into is free: `slots` buckets earlier
        # on that ring released; a receiver that left that one behind takes it now
        if slots is None:
            return 0.0
        sent = ring_rows[(s, r)]
        sent.append(m)
        if len(sent) <= slots:
            return 0.0
        old = sent[0]
        if old not in freed:
            d = deferred[r]
            for j, (a, q) in enumerate(d):
                if q == old:
                    del d[j]
                    if overlap:
                        # its host takes it once it is there (between the slices of its
                        # waits), without waiting for it; the unpack queues on its stream
                        cpu[r] += bs[old]
                        gpu[r] = ev[r] = max(gpu[r], a + bs[old]) + rc[old]
                        freed[old] = gpu[r]
                    else:
                        block(r, a)
                        take(r, old)
                    break
        return freed[old]

    def end_run(p):
        # runs: the run ends once every ring bucket it takes has arrived and is unpacked
        d = deferred[p]
        if d:
            for a, m in sorted(d):
                block(p, a)
                take(p, m)
            d.clear()

    def note(i, start, end, kind, own_work, link_s):
        row = rows.get(rnd[i])
        if row is None:
            row = rows[rnd[i]] = [start, end, [0, 0, 0, 0], 0.0, 0.0]
        row[0], row[1] = min(row[0], start), max(row[1], end)
        row[2][kind] += nbytes[i]
        row[3] += own_work
        row[4] += link_s

    def pop(p):
        end, buf, n, received, _, seq = inflight[p].popleft()
        if carry:
            take_ready(p)
        if carry and deferred[p] and end > cpu[p]:
            # while it waits, it takes the ring receives left behind as they arrive
            cpu[p] = max(cpu[p], ev[p])
            keep = []
            for a, m in sorted(deferred[p]):
                if a <= end:
                    cpu[p] = max(cpu[p], a)
                    take(p, m)
                else:
                    keep.append((a, m))
            deferred[p] = keep
        block(p, end)
        for m in received:
            if delta and nbytes[m] == 0:        # a same bucket: checked at the end
                later[p] += bs[m] + rc[m]
            else:
                work(p, bs[m], rc[m])
        used_buf[p] -= buf
        used_msg[p] -= n
        seq_done[p] = seq

    def group_key(i):
        if path[i] != 0 or per_item[i] or not span:
            return None
        return (rnd[i], slot[i] // span)

    n = len(rnd)
    i = 0
    while i < n:
        if path[i] == 0:
            j = i + 1
            gk = group_key(i)
            if gk is not None:
                while j < n and group_key(j) == gk:
                    j += 1
            # one group: per process its staging buffers, messages, packing and unpacking
            parts: dict = {}
            for m in range(i, j):
                for p, sending in ((snd[m], True), (rcv[m], False)):
                    e = parts.get(p)
                    if e is None:
                        e = parts[p] = [0, 0, [], []]
                    staged = staged_s[m] if sending else staged_r[m]
                    e[0] += 1 if (not per_item[m] or staged) else 0
                    e[1] += items[m] if per_item[m] else 1
                    e[2 if sending else 3].append(m)
            start = {}
            for p, (buf, cnt, sent, _) in parts.items():
                if carry:
                    take_ready(p)
                else:
                    end_run(p)
                while inflight[p] and (used_buf[p] + buf > W or used_msg[p] + cnt > max_msgs):
                    pop(p)
                for m in sent:
                    work(p, bs[m], sc[m])
                start[p] = max(cpu[p], gpu[p], nccl[p])
            # a group's messages progress together, sharing each NIC direction: a message
            # ends once both its ends are posted and its own bytes have moved, and no sooner
            # than its sender's and its receiver's bytes of the group could have
            out_load, in_load = defaultdict(int), defaultdict(int)
            for m in range(i, j):
                out_load[snd[m]] += nbytes[m]
                in_load[rcv[m]] += nbytes[m]
            end = dict.fromkeys(parts, 0.0)
            for m in range(i, j):
                s, r = snd[m], rcv[m]
                t0 = max(start[s] + (lat if delta else 0.0), start[r])
                t1 = max(t0 + nbytes[m] / nic, start[s] + out_load[s] / nic,
                         start[r] + in_load[r] / nic)
                end[s], end[r] = max(end[s], t1), max(end[r], t1)
                if s == watch:
                    note(m, t0, t1 + lat, 0, bs[m] + sc[m], t1 - t0)
                if r == watch:
                    note(m, t0, t1 + lat, 1, bs[m] + rc[m], t1 - t0)
            for p, (buf, cnt, _, received) in parts.items():
                ge = nccl[p] = end[p] + lat
                inflight[p].append((ge, buf, cnt, received, (rnd[i], slot[i]), seq_next[p]))
                used_buf[p] += buf
                used_msg[p] += cnt
                seq_next[p] += 1
            for m in range(i, j):
                recv_seq[m] = seq_next[rcv[m]] - 1
            if delta:
                for p in parts:
                    while len(inflight[p]) > 1 and any(e[3] for e in list(inflight[p])[:-1]):
                        pop(p)
            i = j
            continue
        s, r = snd[i], rcv[i]
        if order[i] == FORWARD_ORDER:
            # the forwarder first completes its messages up to the bucket that brought the data
            q = parent[i]
            if q >= 0:
                while inflight[s] and seq_done[s] < recv_seq[q]:
                    pop(s)
            else:                   # aggregate: the network groups of the earlier segments
                seg = forward_segment(slot[i], n_src, n_dst)
                before = (rnd[i], segment_rotations(seg, n_src, n_dst)[0])
                while inflight[s] and inflight[s][0][4] < before:
                    pop(s)
        if path[i] == PATH_CODE[DOMAIN]:
            # a ring: the sender packs into the receiver's slot over the link (and waits for
            # it unless `host_overlap`); the receiver unpacks once the slot is there
            if in_runs:
                take_ready(s)
            block(s, slot_free(s, r, i))
            if over_link:               # the packing is the transfer
                cpu[s] += bs[i]
                ready = max(cpu[s], gpu[s])
                d = max(nbytes[i] / nvl, sc[i])
            else:
                work(s, bs[i], sc[i])
                ready = gpu[s]
                d = nbytes[i] / nvl
            if over_link and overlap:   # published at the sender's poll of its event
                t0 = on_links(s, r, ready, d)
                gpu[s] = ev[s] = t1 = t0 + d
                t1 += ring_lat
            else:                       # the sender waits for its stream, then publishes
                t0 = on_links(s, r, ready, d + ring_lat)
                cpu[s] = gpu[s] = t1 = t0 + d + ring_lat
            if s == watch:
                note(i, t0, t1, 2, bs[i] + sc[i], t1 - t0)
            if in_runs:
                # the executor's runs of ring steps: taken now if there, else once the
                # process's other ready work of the run is done (see `end_run`)
                take_ready(r)
                if t1 <= cpu[r]:
                    take(r, i)
                else:
                    deferred[r].append((t1, i))
            elif rings_in_order:
                block(r, t1)
                take(r, i)
            else:                                   # what-if: taken whenever it is there
                take(r, i)
                freed[i] = max(freed[i], t1 + bs[i] + rc[i])
                arrived[r] = max(arrived[r], t1 + bs[i] + rc[i])
            if r == watch:
                note(i, t0, max(cpu[r], gpu[r], t1 + rc[i]), 3, bs[i] + rc[i], t1 - t0)
        else:                                       # a local copy
            if not carry:
                end_run(s)
                end_run(r)
            work(s, bs[i], sc[i])
            block(r, gpu[s])
            work(r, bs[i], rc[i])
        i += 1
    for p in range(world):
        end_run(p)
        while inflight[p]:
            pop(p)
        if later[p]:
            work(p, 0.0, later[p])
    return np.maximum(np.maximum(np.array(cpu), np.array(gpu)), np.array(arrived)), rows


def gather_broadcast_seconds(plan: Plan, cluster: Cluster,
                             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """Predicted time of the gather-broadcast strategy on the plan's ranks and domains.

    As the runtime runs it: consecutive tensors with the same gather and broadcast groups share
    a step of at most `bucket_bytes`; per step a ring all-gather among one replica of each
    source shard, then a pipelined broadcast from the first of them to every destination rank
    holding a part (crossing a domain boundary on several NICs, one per ring channel); steps run
    one after another.
    """
    topo = plan.topology
    cache: dict = {}
    total = 0.0
    step_key, step_bytes = None, 0

    def step_time(key, size) -> float:
        n_gather, n_gdom, n_bdom, n_dst, per_dom = key[2]
        t = 0.0
        if n_gather > 1:
            bw = cluster.nic_Bps if n_gdom > 1 else cluster.nvlink_Bps
            if n_gdom > 1 and cluster.fabric_Bps:
                bw = min(bw, cluster.fabric_Bps / n_gather)
            t += (n_gather - 1) / n_gather * size / bw + (n_gather - 1) * cluster.latency_s
        if n_bdom > 1:
            bw = min(cluster.nvlink_Bps, cluster.nic_Bps * min(cluster.gpus_per_domain, per_dom))
            if cluster.fabric_Bps:
                bw = min(bw, cluster.fabric_Bps)
        else:
            bw = cluster.nvlink_Bps
            if cluster.domain_fabric_Bps:
                bw = min(bw, cluster.domain_fabric_Bps)
        if cluster.broadcast == "flat":          # the root sends one whole copy per receiver
            bw = min(bw, cluster.nic_Bps if n_bdom > 1 else cluster.nvlink_Bps) / n_dst
        t += size / bw + math.log2(max(2, n_dst + 1)) * cluster.latency_s
        # each receiver copies its slices out of the whole tensors
        return t + size / max(1, n_dst) / cluster.copy_Bps

    for spec in plan.specs:
        ckey = (spec.shape, id(spec.src), id(spec.dst))
        key = cache.get(ckey)
        if key is None:
            first_of_box = {}
            for r, b in sorted(spec.src.boxes(spec.shape).items()):
                if not b.empty:
                    first_of_box.setdefault(b, r)
            gather = tuple(sorted(set(first_of_box.values())))
            dsts = tuple(r for r, b in sorted(spec.dst.boxes(spec.shape).items()) if not b.empty)
            g_domains = {topo.src_domains[r] for r in gather}
            b_domains = {topo.src_domains[gather[0]]} | {topo.dst_domains[r] for r in dsts}
            per_domain = defaultdict(int)
            for r in dsts:
                per_domain[topo.dst_domains[r]] += 1
            key = cache[ckey] = (gather, dsts, (len(gather), len(g_domains), len(b_domains),
                                                len(dsts), max(per_domain.values(), default=1)))
        size = spec.nbytes
        total += cluster.item_s * 2                  # each tensor packed once, sliced once
        if step_key is not None and (key[:2] != step_key[:2] or step_bytes + size > bucket_bytes):
            total += step_time(step_key, step_bytes)
            step_bytes = 0
        step_key = key
        step_bytes += size
    if step_key is not None:
        total += step_time(step_key, step_bytes)
    return total + cluster.refit_overhead_s
