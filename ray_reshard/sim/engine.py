"""Predict a refit's time on a described cluster: the plan's buckets as rows (messages.py), every
process's program replayed on the cluster (processes.py), and the floors no replay beats (shared
fabrics and cores, the busiest links). The order replayed is `ray_reshard.planning.schedule`'s
(see its docstring); the simulator never imports the runtime.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..planning.plan import DEFAULT_BUCKET_BYTES, Plan
from ..planning.moves import DOMAIN, NETWORK
from ..planning.schedule import MAX_WINDOW, default_window, group_span
from .cluster import Cluster
from .gather_broadcast import gather_broadcast_seconds
from .messages import (PATH_CODE, Messages, in_run_order, messages_aggregate, messages_exact,
                       sources_and_world)
from .processes import RING_RECV, ProcessReplay

# What the command line takes from here: the replay's entry points and their options.
__all__ = ["RING_RECV", "SimResult", "checks_per_process", "gather_broadcast_seconds",
           "messages_aggregate", "messages_exact", "replay", "simulate"]


@dataclass
class SimResult:
    """A prediction (`predicted_s`) with the bounds no schedule of this plan beats (`bound_s`:
    the busiest NIC or NVLink direction, or a shared fabric; `balanced_bound_s`: the network
    bytes spread perfectly over every destination NIC), the bytes, and one rank's rounds."""

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
            "busiest_links": [{"link": n, "bytes": b, "seconds": s}
                              for n, b, s in self.busiest_links],
            "timeline_rank": self.timeline_rank, "timeline": self.timeline,
        }


def simulate(plan: Plan, cluster: Cluster, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             mode: str = "auto", timeline_rank: Optional[tuple] = None,
             exact_max_moves: int = 200_000, window: Optional[int] = None,
             ring_recv: str = "runs") -> SimResult:
    """Predict the refit time of `plan` on `cluster`.

    `mode`: "exact" (the schedule's own buckets), "aggregate" (per-pair totals cut as the
    schedule cuts them: no schedule built, see `messages_aggregate`) or "auto" (exact up to
    `exact_max_moves` moves). `window`: staged buckets in flight per process (default: the
    executor's, from `bucket_bytes`). `timeline_rank`: ("src"|"dst", rank) whose rounds to
    report (default: the rank with the busiest link). `ring_recv`: how a process takes its
    ring buckets, one of `RING_RECV` ("runs": as the executor does; "in_order" and the what-if
    "as_ready" on either side of it).
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
    n_src, _ = sources_and_world(plan)
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
    n_src, world = sources_and_world(plan)
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
    """Per bucket: the host's step at either end (`step_s` per bucket end, plus `item_s` per
    item unless one copy-table launch copies its regions (`copy_tables`), plus `message_s` per
    message where items travel as their own messages), and the copy seconds at its sender and
    at its receiver (strided regions at `copy_Bps`, contiguous ones at `contig_copy_Bps`,
    a delta's codec at its rates)."""
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
    arguments as in `simulate`. Predicted = max(the replay's last process, the floor of shared
    fabrics and cores) + `refit_overhead_s`."""
    if msgs.per_item_min_bytes != cluster.per_item_min_bytes:
        raise ValueError(
            f"these messages were built with per_item_min_bytes={msgs.per_item_min_bytes!r}, "
            f"cluster {cluster.name!r} has {cluster.per_item_min_bytes!r}: build them with "
            f"messages_exact/messages_aggregate(plan, bucket_bytes, "
            f"cluster.per_item_min_bytes)")
    n_src, world = sources_and_world(plan)
    st = plan.stats
    W = window or default_window(bucket_bytes)
    msgs = in_run_order(msgs, group_span(W, max(n_src, world - n_src)))
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
    bw = np.concatenate([np.full(2 * world, cluster.nic_Bps),
                         np.full(2 * world, cluster.nvlink_Bps)])
    t_full = total / bw
    if timeline_rank is None:
        g = int(np.argmax(t_full)) % world if len(msgs.round) else 0
    else:
        side, r = timeline_rank
        g = r if side == "src" else n_src + r

    cpu, rows = ProcessReplay(msgs, cluster, W, world, base, send_copy, recv_copy, prep, g,
                              ring_recv, n_src=n_src).run()
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
