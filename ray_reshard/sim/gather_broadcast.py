"""The gather-broadcast strategy's predicted time on a described cluster, as the runtime runs it
(strategies.py): per step a ring all-gather among one replica of each source shard, then a
pipelined broadcast of the whole tensors to every destination rank holding a part.
"""
from __future__ import annotations

import math
from collections import defaultdict

from ..planning.plan import DEFAULT_BUCKET_BYTES, Plan
from .cluster import Cluster


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
