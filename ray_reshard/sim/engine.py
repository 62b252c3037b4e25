"""Replay a refit plan's schedule on a described cluster.

Model
-----
The executor runs every process's transfers in one global key order whose first field is the
bucket round (the k-th bucket of every sender/receiver pair; a forwarded bucket runs one round
after the network bucket it passes on). The simulator replays that order round by round:

* a round's transfers share links: each GPU's NIC carries its network sends in one direction
  and its receives in the other; its NVLink port likewise carries domain transfers;
* a round lasts as long as its busiest link needs for its bytes (or the whole fabric, where a
  cluster caps it), or as long as the busiest rank's CPU work on its items, whichever is
  longer, plus one message latency; rounds run one after another.

Two ways to get the rounds: `exact` walks `Plan.schedule(bucket_bytes).transfers` (the buckets
the executor runs); `aggregate` sums each (sender, receiver, path) pair's bytes and items from
the plan's moves and cuts them into buckets of `bucket_bytes` the way the schedule does, which
avoids building the schedule (millions of items at DeepSeek-V3 scale). Both give the same
per-round byte counts up to how items pack into buckets.

The bound is what no schedule can beat on this plan: the busiest NIC's bytes over its
bandwidth, and the same for NVLink. `balanced_bound_s` is the network lower bound spread
perfectly over every destination NIC.

gather_broadcast follows the runtime's strategy: per tensor, a ring all-gather among one replica
of each source shard, then a pipelined broadcast of the whole tensor from one source to every
destination rank holding a part, tensor after tensor.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..core.plan import DEFAULT_BUCKET_BYTES, Plan
from ..core.planner import DOMAIN, LOCAL, NETWORK
from .cluster import Cluster

PATH_CODE = {NETWORK: 0, DOMAIN: 1, LOCAL: 2}


@dataclass
class Messages:
    """One row per bucket: round, sending GPU, receiving GPU, path code, bytes, items."""

    round: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    path: np.ndarray
    nbytes: np.ndarray
    items: np.ndarray
    staged_send: np.ndarray        # bytes the sender copies (packs) rather than sends in place
    staged_recv: np.ndarray        # bytes the receiver copies out of a staging buffer
    mode: str


# Network items at least this large move in place when contiguous (the executor's per-item
# messages); smaller ones, strided ones and every domain (ring) transfer are copied.
IN_PLACE_MIN_BYTES = 64 << 10


class _Staging:
    """Which bytes of an item each end must copy: strided in its local shard, small, or ring."""

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

    def __call__(self, ti: int, box, nbytes: int, src_side: str, src_rank: int, dst_rank: int,
                 path_code: int) -> tuple[int, int]:
        if path_code != 0 or nbytes < IN_PLACE_MIN_BYTES:
            return nbytes, nbytes
        s = 0 if self._contiguous(box, self._holder(ti, src_side, src_rank)) else nbytes
        r = 0 if self._contiguous(box, self._holder(ti, "dst", dst_rank)) else nbytes
        return s, r


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
    cpu_s: float = 0.0                                    # rounds where CPU work was the limit

    def as_dict(self) -> dict:
        return {
            "cluster": self.cluster.name, "mode": self.mode, "bucket_bytes": self.bucket_bytes,
            "predicted_s": self.predicted_s, "bound_s": self.bound_s,
            "nic_bound_s": self.nic_bound_s, "nvlink_bound_s": self.nvlink_bound_s,
            "balanced_bound_s": self.balanced_bound_s, "network_bytes": self.network_bytes,
            "min_network_bytes": self.min_network_bytes, "domain_bytes": self.domain_bytes,
            "rounds": self.rounds, "messages": self.messages,
            "busiest_links": [{"link": n, "bytes": b, "seconds": s} for n, b, s in self.busiest_links],
            "timeline_rank": self.timeline_rank, "timeline": self.timeline,
        }


def _gpu(plan: Plan):
    n_src = plan.topology.n_src
    return n_src, n_src + plan.topology.n_dst


def messages_exact(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Messages:
    """The schedule's buckets, as the executor runs them."""
    n_src, _ = _gpu(plan)
    ts = plan.schedule(bucket_bytes).transfers
    n = len(ts)
    rnd, snd, rcv, pth, nb, it, ss, sr = (np.empty(n, dtype=np.int64) for _ in range(8))
    staging = _Staging(plan)
    isz = [spec.itemsize for spec in plan.specs]
    for i, t in enumerate(ts):
        rnd[i] = t.key[0]
        snd[i] = t.src.rank if t.src.side == "src" else n_src + t.src.rank
        rcv[i] = n_src + t.dst
        pth[i] = code = PATH_CODE[t.path]
        nb[i] = t.nbytes
        it[i] = len(t.items)
        a = b = 0
        for item in t.items:
            x, y = staging(item.tensor, item.box, item.box.numel * isz[item.tensor], t.src.side,
                           t.src.rank, t.dst, code)
            a += x
            b += y
        ss[i], sr[i] = a, b
    return Messages(rnd, snd, rcv, pth, nb, it, ss, sr, "exact")


def messages_aggregate(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Messages:
    """Per (sender, receiver, path) byte and item totals cut into rounds of bucket_bytes."""
    n_src, _ = _gpu(plan)
    uses: dict[int, list] = {}
    for tp in plan.tensor_plans:
        u = uses.get(id(tp))
        if u is None:
            uses[id(tp)] = [tp, 1]
        else:
            u[1] += 1
    first_use = {}
    for ti, tp in enumerate(plan.tensor_plans):
        first_use.setdefault(id(tp), ti)
    staging = _Staging(plan)
    pairs: dict[tuple, list] = defaultdict(lambda: [0, 0, 0, 0])
    for key, (tp, count) in uses.items():
        isz = tp.itemsize
        ti = first_use[key]
        per = defaultdict(lambda: [0, 0, 0, 0])
        for m in tp.moves:
            s = m.src.rank if m.src.side == "src" else n_src + m.src.rank
            code = PATH_CODE[m.path]
            e = per[(s, n_src + m.dst, code, m.src.side == "dst")]
            nbytes = m.box.numel * isz
            a, b = staging(ti, m.box, nbytes, m.src.side, m.src.rank, m.dst, code)
            e[0] += nbytes
            e[1] += 1
            e[2] += a
            e[3] += b
        for k, v in per.items():
            e = pairs[k]
            for j in range(4):
                e[j] += count * v[j]
    if not pairs:
        z = np.zeros(0, dtype=np.int64)
        return Messages(z, z, z, z, z, z, z, z, "aggregate")
    keys = np.array([k[:3] + (int(k[3]),) for k in pairs], dtype=np.int64)
    tot = np.array([v[0] for v in pairs.values()], dtype=np.int64)
    items = np.array([v[1] for v in pairs.values()], dtype=np.int64)
    nbk = np.maximum(1, -(-tot // bucket_bytes))
    rep = np.repeat(np.arange(len(tot)), nbk)
    first = np.cumsum(nbk) - nbk
    k_in_pair = np.arange(len(rep)) - first[rep]
    last = k_in_pair == nbk[rep] - 1
    nbytes = np.where(last, tot[rep] - (nbk[rep] - 1) * bucket_bytes, bucket_bytes)
    # items spread evenly over a pair's buckets (each bucket holds at least one)
    it = np.maximum(1, items[rep] // nbk[rep] + (k_in_pair < items[rep] % nbk[rep]))
    forwarded = keys[rep, 3]
    share = nbytes / tot[rep].clip(min=1)
    ss = (np.array([v[2] for v in pairs.values()], dtype=np.float64)[rep] * share).astype(np.int64)
    sr = (np.array([v[3] for v in pairs.values()], dtype=np.float64)[rep] * share).astype(np.int64)
    return Messages(k_in_pair + forwarded, keys[rep, 0], keys[rep, 1], keys[rep, 2], nbytes, it,
                    ss, sr, "aggregate")


def simulate(plan: Plan, cluster: Cluster, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             mode: str = "auto", timeline_rank: Optional[tuple] = None,
             exact_max_moves: int = 200_000) -> SimResult:
    """Predict the refit time of `plan` on `cluster` (see the module docstring).

    `mode`: "exact" (replay the schedule), "aggregate" (per-pair byte counts per round) or
    "auto" (exact up to `exact_max_moves` moves). `timeline_rank`: ("src"|"dst", rank) whose
    rounds to report (default: the rank with the busiest link).
    """
    if mode not in ("auto", "exact", "aggregate"):
        raise ValueError(f"mode must be 'auto', 'exact' or 'aggregate', got {mode!r}")
    if mode == "auto":
        mode = "exact" if plan.stats.n_moves <= exact_max_moves else "aggregate"
    msgs = (messages_exact if mode == "exact" else messages_aggregate)(plan, bucket_bytes)
    return replay(plan, msgs, cluster, bucket_bytes, timeline_rank)


def tensors_per_process(plan: Plan) -> np.ndarray:
    """How many tensors each GPU (sources first, then destinations) sends or receives."""
    n_src, world = _gpu(plan)
    counts = np.zeros(world, dtype=np.int64)
    ranks_of: dict[int, list] = {}
    for tp in plan.tensor_plans:
        rs = ranks_of.get(id(tp))
        if rs is None:
            seen = set()
            for m in tp.moves:
                seen.add(m.src.rank if m.src.side == "src" else n_src + m.src.rank)
                seen.add(n_src + m.dst)
            rs = ranks_of[id(tp)] = list(seen)
        counts[rs] += 1
    return counts


def _link_names(n_src: int, world: int) -> list[str]:
    def who(g):
        return f"src {g}" if g < n_src else f"dst {g - n_src}"
    kinds = ("NIC send", "NIC recv", "NVLink send", "NVLink recv")
    return [f"{who(g)} {k}" for k in kinds for g in range(world)]


def replay(plan: Plan, msgs: Messages, cluster: Cluster, bucket_bytes: int,
           timeline_rank: Optional[tuple] = None) -> SimResult:
    n_src, world = _gpu(plan)
    L = 4 * world
    st = plan.stats
    bw = np.concatenate([np.full(2 * world, cluster.nic_Bps), np.full(2 * world, cluster.nvlink_Bps)])
    net = msgs.path == PATH_CODE[NETWORK]
    dom = msgs.path == PATH_CODE[DOMAIN]
    R = int(msgs.round.max()) + 1 if len(msgs.round) else 0

    def per_round_link(mask, base_s, base_r):
        idx_s = msgs.round[mask] * L + base_s + msgs.sender[mask]
        idx_r = msgs.round[mask] * L + base_r + msgs.receiver[mask]
        w = msgs.nbytes[mask].astype(np.float64)
        return (np.bincount(idx_s, w, minlength=R * L) + np.bincount(idx_r, w, minlength=R * L))

    link_bytes = (per_round_link(net, 0, world) + per_round_link(dom, 2 * world, 3 * world)
                  ).reshape(R, L)
    link_t = (link_bytes / bw[None, :]).max(axis=1) if R else np.zeros(0)
    if cluster.fabric_Bps:
        link_t = np.maximum(link_t, np.bincount(msgs.round[net], msgs.nbytes[net].astype(float),
                                                minlength=R) / cluster.fabric_Bps)
    if cluster.domain_fabric_Bps:
        link_t = np.maximum(link_t, np.bincount(msgs.round[dom], msgs.nbytes[dom].astype(float),
                                                minlength=R) / cluster.domain_fabric_Bps)
    send_work = msgs.items * cluster.item_s + msgs.staged_send / cluster.copy_Bps
    recv_work = msgs.items * cluster.item_s + msgs.staged_recv / cluster.copy_Bps
    work = (np.bincount(msgs.round * world + msgs.sender, send_work, minlength=R * world)
            + np.bincount(msgs.round * world + msgs.receiver, recv_work, minlength=R * world)
            ).reshape(R, world)
    cpu_t = work.max(axis=1) if R else np.zeros(0)
    if cluster.cpu_cores:
        cpu_t = np.maximum(cpu_t, work.sum(axis=1) / cluster.cpu_cores)
    # CPU work overlaps the links, except where the "links" are CPU copies themselves (ranks
    # sharing a few cores, as on the local preset): then they add up
    round_t = (link_t + cpu_t if cluster.cpu_cores else np.maximum(link_t, cpu_t)) + cluster.latency_s
    # before the rounds, every process looks up its tensors' views once
    per_proc = tensors_per_process(plan) * cluster.tensor_s
    prep = float(per_proc.max()) if len(per_proc) else 0.0
    if cluster.cpu_cores:
        prep = max(prep, float(per_proc.sum()) / cluster.cpu_cores)
    predicted = float(round_t.sum()) + cluster.refit_overhead_s + prep

    total = link_bytes.sum(axis=0) if R else np.zeros(L)
    nic_bound = float((total[:2 * world] / cluster.nic_Bps).max()) if R else 0.0
    nvl_bound = float((total[2 * world:] / cluster.nvlink_Bps).max()) if R else 0.0
    bound = max(nic_bound, nvl_bound)
    if cluster.fabric_Bps:
        bound = max(bound, float(msgs.nbytes[net].sum()) / cluster.fabric_Bps)
    if cluster.domain_fabric_Bps:
        bound = max(bound, float(msgs.nbytes[dom].sum()) / cluster.domain_fabric_Bps)
    balanced = st.min_network_bytes / (plan.topology.n_dst * cluster.nic_Bps)

    names = _link_names(n_src, world)
    t_full = total / bw
    top = np.argsort(-t_full)[:5]
    busiest = [(names[i], int(total[i]), float(t_full[i])) for i in top if total[i] > 0]

    if timeline_rank is None:
        g = int(np.argmax(t_full)) % world if R else 0
    else:
        side, r = timeline_rank
        g = r if side == "src" else n_src + r
    label = f"src {g}" if g < n_src else f"dst {g - n_src}"
    starts = np.concatenate([[0.0], np.cumsum(round_t)[:-1]]) if R else np.zeros(0)
    timeline = []
    for k in range(R):
        row = link_bytes[k, [g, world + g, 2 * world + g, 3 * world + g]]
        if row.any() or work[k, g] > 0:
            timeline.append({"round": k, "start_s": float(starts[k]), "end_s": float(starts[k] + round_t[k]),
                             "nic_send": int(row[0]), "nic_recv": int(row[1]),
                             "nvlink_send": int(row[2]), "nvlink_recv": int(row[3]),
                             "limited_by": "cpu" if cpu_t[k] > link_t[k] else "link"})
    return SimResult(cluster, msgs.mode, bucket_bytes, predicted, bound, nic_bound, nvl_bound,
                     balanced, st.network_bytes, st.min_network_bytes, st.domain_bytes, R,
                     len(msgs.round), busiest, timeline, label,
                     float(round_t[cpu_t > link_t].sum()) if R else 0.0)


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
