"""Traffic report of a plan: what `ray-reshard plan` prints, as data and as text.

`traffic(plan)` walks every move once: network bytes between each pair of NVLink domains, and
bytes per (sender, receiver, path) pair. Buckets come from the real schedule when the plan has
at most `exact_buckets_up_to` moves; above that (building the schedule of tens of millions of
moves takes minutes) each pair's bytes are divided by `bucket_bytes`, rounded up: the count if
every bucket were full, a lower bound. Busiest ranks come from the plan's per-rank figures.
Staging: a rank stages at most `window` buckets at once (double buffering), and only pieces
that are strided in its storage or change dtype.

`delta_prediction(plan, bucket_bytes, fraction)` predicts a delta refit's network bytes when a
`fraction` of the elements changed since the previous one: per network bucket, the size of its
smallest encoding (`execution.delta.expected_encoding`) with the changes spread evenly over
buckets.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Optional

from ..execution.delta import KINDS, expected_encoding, granule
from ..planning.plan import DEFAULT_BUCKET_BYTES, Plan
from ..planning.schedule import default_window, network_bucket_counts, network_entries
from ..planning.moves import NETWORK, PATHS


def traffic(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES, top: int = 3,
            progress=None, exact_buckets_up_to: int = 200_000) -> dict[str, Any]:
    """Figures of `plan` as plain data (JSON-ready). `progress` wraps the walk over tensors."""
    topo = plan.topology
    window = default_window(bucket_bytes)          # the executor's staged buckets
    st = plan.stats
    src_doms = list(dict.fromkeys(topo.src_domains))
    dst_doms = list(dict.fromkeys(topo.dst_domains))
    si = {d: i for i, d in enumerate(src_doms)}
    di = {d: i for i, d in enumerate(dst_doms)}
    src_of = [si[d] for d in topo.src_domains]
    dst_of = [di[d] for d in topo.dst_domains]
    matrix = [[0] * len(dst_doms) for _ in src_doms]
    pairs: dict = defaultdict(int)
    tensors = plan.tensor_plans if progress is None else progress(plan.tensor_plans)
    for tp in tensors:
        isz = tp.itemsize
        for m in tp.moves:
            b = m.box.numel * isz
            pairs[(m.src, m.dst, m.path)] += b
            if m.path == NETWORK:
                matrix[src_of[m.src.rank]][dst_of[m.dst]] += b
    handled: dict = defaultdict(int)        # bytes each rank sends or receives, any path
    for (src, dst, _), b in pairs.items():
        handled[src] += b
        handled[("dst", dst)] += b
    buckets = {p: 0 for p in PATHS}
    exact = st.n_moves <= exact_buckets_up_to
    if exact:
        for tr in plan.schedule(bucket_bytes).transfers:
            buckets[tr.path] += 1
    else:
        for (_, _, path), b in pairs.items():
            buckets[path] += math.ceil(b / bucket_bytes)
    turns = plan.network_turns(bucket_bytes)     # None: the rotation schedule (a large plan)
    per_rank: dict = defaultdict(int)           # network buckets each rank sends or receives
    for (s, d), ts in (turns or {}).items():
        per_rank[("src", s)] += len(ts)
        per_rank[("dst", d)] += len(ts)
    if turns is not None:
        buckets[NETWORK] = sum(per_rank.values()) // 2
    send, recv = plan.send_bytes_by_rank, plan.recv_bytes_by_rank
    busiest = lambda d, doms: [{"rank": r, "domain": str(doms[r]), "bytes": b}
                               for r, b in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]
    mean = lambda d, n: sum(d.values()) / n if n else 0.0
    return {
        "tensors": st.n_tensors, "distinct_plans": st.n_signatures, "moves": st.n_moves,
        "total_bytes": st.total_bytes,
        "bytes_by_path": {"network": st.network_bytes, "domain": st.domain_bytes,
                          "local": st.local_bytes},
        "lower_bound_bytes": st.min_network_bytes,
        "gather_broadcast_bytes": st.gather_broadcast_bytes,
        "gather_broadcast_over_network": (st.gather_broadcast_bytes / st.network_bytes
                                          if st.network_bytes else None),
        "ranks": {"src": topo.n_src, "dst": topo.n_dst},
        "busiest_senders": busiest(send, topo.src_domains),
        "busiest_receivers": busiest(recv, topo.dst_domains),
        "mean_send_bytes": mean(send, topo.n_src), "mean_recv_bytes": mean(recv, topo.n_dst),
        "bucket_bytes": bucket_bytes,
        "buckets_by_path": buckets, "buckets_exact": exact,
        "pairs_by_path": {p: sum(1 for k in pairs if k[2] == p) for p in PATHS},
        "network_entries": network_entries(plan),
        "network_turns": (None if turns is None else
                          1 + max((ts[-1] for ts in turns.values()), default=-1)),
        "busiest_rank_network_buckets": None if turns is None else max(per_rank.values(),
                                                                       default=0),
        "staging_window": window,
        "peak_staging_bound_bytes": min(window * bucket_bytes,
                                        max(handled.values(), default=0)),
        "domains": {"src": [str(d) for d in src_doms], "dst": [str(d) for d in dst_doms]},
        "domain_network_bytes": matrix,
    }


def render(t: dict, title: Optional[str] = None) -> str:
    """The report as text."""
    gb = lambda b: f"{b / 1e9:,.3f} GB"
    by = t["bytes_by_path"]
    ratio = t["gather_broadcast_over_network"]
    lines = []
    if title:
        lines.append(title)
    lines += [
        f"tensors {t['tensors']} ({t['distinct_plans']} distinct plans), {gb(t['total_bytes'])} "
        f"of weights, {t['moves']} moves, {t['ranks']['src']} -> {t['ranks']['dst']} ranks, "
        f"{len(t['domains']['src'])} -> {len(t['domains']['dst'])} domains",
        "",
        f"{'bytes by path':<34}{'GB':>14}",
        f"{'  network (between domains)':<34}{by['network'] / 1e9:>14,.3f}",
        f"{'  domain (NVLink / shared memory)':<34}{by['domain'] / 1e9:>14,.3f}",
        f"{'  local (same device)':<34}{by['local'] / 1e9:>14,.3f}",
        f"{'network lower bound':<34}{t['lower_bound_bytes'] / 1e9:>14,.3f}",
        f"{'gather-broadcast':<34}{t['gather_broadcast_bytes'] / 1e9:>14,.3f}",
        f"network == lower bound: {'yes' if by['network'] == t['lower_bound_bytes'] else 'NO'}; "
        f"gather-broadcast / network = " + (f"{ratio:.1f}x" if ratio is not None else "n/a"),
        "",
        f"busiest senders (network, mean {gb(t['mean_send_bytes'])}): "
        + ", ".join(f"src {x['rank']} {gb(x['bytes'])}" for x in t["busiest_senders"]),
        f"busiest receivers (network, mean {gb(t['mean_recv_bytes'])}): "
        + ", ".join(f"dst {x['rank']} {gb(x['bytes'])}" for x in t["busiest_receivers"]),
        f"buckets of {t['bucket_bytes'] / 2 ** 20:g} MiB"
        + (" (from the schedule): " if t["buckets_exact"] else
           " (network from the schedule's turns; domain and local at least, in full buckets): "
           if t["network_turns"] is not None else " (at least; full buckets): ")
        + ", ".join(f"{p} {t['buckets_by_path'][p]} over "
                                               f"{t['pairs_by_path'][p]} pairs"
                                               for p in ("network", "domain", "local")),
        (f"network buckets in {t['network_turns']} turns (a rank sends at most one and "
         f"receives at most one per turn; the busiest has {t['busiest_rank_network_buckets']}, "
         f"so no schedule takes fewer)" if t["network_turns"] is not None else
         "network buckets in rounds of rotations (turns would not take fewer positions, or "
         "too many pairs to count)")
        + f"; {t['network_entries']:,} (tensor, network pair) entries",
        f"peak staging per rank: at most {t['peak_staging_bound_bytes'] / 2 ** 20:,.1f} MiB "
        f"({t['staging_window']} buckets, the executor's default window, or all a rank moves "
        f"if less; only strided pieces and dtype conversions are staged)",
    ]
    return "\n".join(lines)


DELTA_ASSUMPTIONS = (
    "a prediction, not a measurement: every network bucket has the given fraction of its "
    "granules changed (changes spread evenly over buckets)",
    "a granule is the smallest element size of a bucket's items; a bucket travels as the "
    "smallest of same (nothing), mask, index and dense",
    "this is a delta refit after another of the same spec set (the first one, and one after "
    "a failed refit, update() or a dense refit in between, travels dense)",
)


def network_buckets(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    exact_buckets_up_to: int = 200_000) -> tuple[list, bool]:
    """([(bytes, smallest itemsize)] per network bucket, exact). Exact: the schedule's buckets
    (plans of at most `exact_buckets_up_to` moves); else each network pair's bytes cut into as
    many about equal buckets as the schedule cuts, at the pair's smallest itemsize."""
    if plan.stats.n_moves <= exact_buckets_up_to:
        specs = plan.specs
        out = [(t.nbytes, min(specs[i.tensor].itemsize for i in t.items))
               for t in plan.schedule(bucket_bytes).transfers if t.path == NETWORK]
        return out, True
    pair_bytes: dict = defaultdict(int)
    pair_itemsize: dict = {}
    for tp, count, _ in plan.distinct_plans:
        isz = tp.itemsize
        per: dict = defaultdict(int)
        for m in tp.moves:
            if m.path == NETWORK:
                per[(m.src.rank, m.dst)] += m.box.numel * isz
        for pair, b in per.items():
            pair_bytes[pair] += count * b
            pair_itemsize[pair] = min(pair_itemsize.get(pair, isz), isz)
    counts = network_bucket_counts(plan, bucket_bytes)
    out = []
    for pair, total in pair_bytes.items():
        n = max(1, counts.get(pair, -(-total // bucket_bytes)))
        out += [(total * (k + 1) // n - total * k // n, pair_itemsize[pair]) for k in range(n)]
    return out, False


def delta_prediction(plan: Plan, bucket_bytes: int, fraction: float,
                     exact_buckets_up_to: int = 200_000, buckets=None) -> dict:
    """Predicted network bytes of a delta refit of `plan` when `fraction` of the elements
    changed since the previous one (see `DELTA_ASSUMPTIONS`); `buckets`: `network_buckets`'s
    answer when already computed."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"changed fraction must be in [0, 1], got {fraction}")
    if buckets is None:
        buckets = network_buckets(plan, bucket_bytes, exact_buckets_up_to)
    rows, exact = buckets
    kinds = {name: 0 for name in KINDS.values()}
    sent = dense = 0
    for nbytes, itemsize in rows:
        kind, size = expected_encoding(nbytes, granule(nbytes, itemsize), fraction)
        kinds[KINDS[kind]] += 1
        sent += size
        dense += nbytes
    return {"changed_fraction": fraction, "network_bytes": sent, "dense_network_bytes": dense,
            "over_dense": sent / dense if dense else None,
            "over_lower_bound": (sent / plan.stats.min_network_bytes
                                 if plan.stats.min_network_bytes else None),
            "encodings": kinds, "buckets": len(rows), "buckets_exact": exact,
            "assumptions": list(DELTA_ASSUMPTIONS)}


def render_delta(d: dict) -> str:
    """The delta prediction as text (labelled a prediction, with its assumptions)."""
    ratio = d["over_dense"]
    lines = [
        f"delta refit, PREDICTED for {d['changed_fraction']:g} of the elements changed since "
        f"the previous delta refit:",
        f"  network {d['network_bytes'] / 1e9:,.3f} GB vs dense "
        f"{d['dense_network_bytes'] / 1e9:,.3f} GB"
        + (f" ({ratio:.3f}x)" if ratio is not None else ""),
        f"  {d['buckets']} network buckets"
        + (" (from the schedule)" if d["buckets_exact"] else
           " (each pair cut into the schedule's count of equal buckets)") + ": "
        + ", ".join(f"{k} {n}" for k, n in d["encodings"].items()),
        "  assumptions: " + "; ".join(d["assumptions"]),
    ]
    return "\n".join(lines)
