"""reshard and its peers side by side, on the same actors in one run, each at its best.

    python -m ray_reshard bench-peers [--mb 256] [--counts 32,1024,4096] [--repeats 5] [--runs 1]
    python -m ray_reshard bench-peers --shaped 1gbit,2gbit [--mb 128] [--repeats 5]

Peers: the object store, Ray Direct Transport, gather-broadcast and raw point-to-point, each
warmed up and checked against reshard's result, then timed in turns. Nothing is asserted; the
goals print beside the figures. Method: docs/benchmark-commands.md (bench-peers).
"""
from __future__ import annotations

import json
import statistics

from ..cli_args import Parser, output_file
from ..testing import local_cluster
from .harness import MiB, SpillCheck, Spread, check_store, machine_facts, store_bytes_for
from .peers_case import (EXTRA, FAIR, FORWARD, PEERS, RAW, RDT, holder_class, rdt_group,
                         run_case, shape_for)
from .peers_shaped import SHAPED_BUCKET_MB, SHAPED_LAYOUTS, shaped_main

GOAL_OBJECT_STORE = 2.0       # reshard at least this many times faster than the object store
GOAL_RAW_SHARE = 0.85         # reshard at least this share of raw point-to-point
# The fair pair (see peers_case.FAIR), by tensor count: reshard TP4 -> TP4 against raw
# point-to-point (the same pairs and bytes), and reshard against raw plus the forward.
GOAL_FAIR_TP4_SHARE = {"32": 0.95}
GOAL_FAIR_FORWARD_SHARE = {"32": 0.9, "1024": 0.85}
# What reshard's time may grow from 1,024 to 4,096 tensors of the same bytes: about 1 us per
# local tensor per process (3,072 more tensors on each of 8 processes sharing 2 cores).
GOAL_RISE_MS = 20
RISE = (1024, 4096)           # the rise's tensor counts; measured inside the larger one's case


def measure(mb: int, counts: list, repeats: int, bucket_mb: int = 16,
            store_mb: int = 0, log=print) -> dict:
    """Run every peer at every tensor count on a loopback cluster; returns the figures (see
    docs/benchmark-commands.md, bench-peers)."""
    import ray

    payload = mb * MiB
    store = store_mb * MiB if store_mb else store_bytes_for(payload)
    out = {"mb": mb, "repeats": repeats, "bucket_mb": bucket_mb, "counts": {},
           "layout": "TP4 (4 actors, node 0) -> TP2 x DP2 (4 actors, node 1), fp32",
           "machine": machine_facts()}
    with local_cluster(2, store_bytes=store):
        address = ray.get_runtime_context().gcs_address
        # the fetched copies of the whole payload on the destination node, with room to spare
        out["store_bytes_per_node"] = check_store(2 * payload)
        Holder = holder_class()
        src = [Holder.options(resources={"node0": 1}).remote() for _ in range(4)]
        dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
        rdt, rdt_why = rdt_group(src + dst)
        out["rdt"] = "gloo collective group of the 8 actors" if rdt else f"not run: {rdt_why}"
        log(f"{out['layout']}, {mb} MiB per case, object store "
            f"{min(out['store_bytes_per_node'].values()) / MiB:.0f} MiB per node; median "
            f"[range] of {repeats} after a warm-up, peers taking turns")
        if not rdt:
            log(f"Ray Direct Transport: {out['rdt']}")
        spill = SpillCheck(address)
        for count in counts:
            row, why = run_case(src, dst, count, mb, bucket_mb, repeats, rdt, log, fair=True,
                                rise_from=RISE[0] if count == RISE[1] else None)
            if why:
                out["rdt"] = why
                rdt = None if RDT not in row["peers"] else rdt
            row["spill"] = spill.check(f"{count} tensors")
            out["counts"][str(count)] = row
            log(render_row(row), flush=True)
    out["goals"] = goals(out)
    return out


def combine_runs(outs: list) -> dict:
    """Several runs' figures (each `measure` on a fresh cluster) as one: each peer's median of
    the runs' medians with the range of those medians (how far a fresh cluster moved it), each
    ratio's median over the runs with its range, and each goal judged on that median."""
    if len(outs) == 1:
        return dict(outs[0], runs=1)
    first = outs[0]
    out = {k: first[k] for k in ("mb", "repeats", "bucket_mb", "layout", "machine",
                                 "store_bytes_per_node")}
    out["rdt"] = "; ".join(dict.fromkeys(o["rdt"] for o in outs))
    out["runs"] = len(outs)
    out["machines"] = [o["machine"] for o in outs]
    out["counts"] = {}
    for count in first["counts"]:
        rows = [o["counts"][count] for o in outs]
        row = {k: rows[0][k] for k in ("tensors", "shape", "network_bytes", "raw_bytes")}
        names = [n for n in rows[0]["peers"] if all(n in r["peers"] for r in rows)]
        row["peers"] = {n: Spread([r["peers"][n]["median"] for r in rows]).as_dict()
                        for n in names}
        row["ratios_by_run"] = [ratios(r) for r in rows]
        row["settle"] = {k: sum(r["settle"][k] for r in rows) for k in rows[0]["settle"]}
        row["spill"] = {k: sum(r["spill"][k] for r in rows) for k in rows[0]["spill"]}
        row["by_run"] = rows
        out["counts"][count] = row
    out["goals"] = goals(out)
    return out


def ratio_spreads(row: dict) -> dict:
    """Each ratio of `ratios` over the runs of a combined row (one value for a single run)."""
    by_run = row.get("ratios_by_run") or [ratios(row)]
    return {k: Spread([r[k] for r in by_run]) for k in by_run[0] if all(k in r for r in by_run)}


def ratios(row: dict) -> dict:
    """Median ratios of one tensor count: each peer's time over reshard's, and reshard's share
    of raw point-to-point (raw seconds per network byte over reshard's). For several runs
    combined, each ratio's median over the runs."""
    if row.get("ratios_by_run"):
        return {k: s.median for k, s in ratio_spreads(row).items()}
    med = {n: p["median"] for n, p in row["peers"].items()}
    r = med["reshard"]
    out = {n: t / r for n, t in med.items()
           if n != "reshard" and n not in RAW and n not in FAIR and n != FORWARD}
    raw = min(med[n] for n in RAW) * row["network_bytes"] / row["raw_bytes"]
    out["raw share"] = raw / r
    if FAIR[0] in med:           # the fair pair: same pairs and bytes; raw plus the forward
        out["TP4 share of raw"] = raw / med[FAIR[0]]
        out["share of raw + forward"] = (raw + med[FORWARD]) / r
    return out


def render_row(row: dict) -> str:
    lines = [f"\n{row['tensors']} tensors of {row['shape'][0]}x{row['shape'][1]} fp32 "
             f"(network bytes of reshard's plan: {row['network_bytes'] / MiB:.0f} MiB; nothing "
             f"spilled)",
             f"  {'peer':<42} {'seconds: median [range]':>28} {'vs reshard':>10}"]
    rat = ratio_spreads(row)
    for name in PEERS + EXTRA:
        if name not in row["peers"]:
            continue
        s = Spread(row["peers"][name]["values"])
        vs = "" if name == "reshard" or name not in rat else ratio_text(rat[name], "x")
        lines.append(f"  {name:<56} {s.text():>28} {vs:>10}")
    lines.append(f"  reshard's share of raw point-to-point (the faster one): "
                 f"{ratio_text(rat['raw share'])}")
    if "TP4 share of raw" in rat:
        lines.append(f"  fair pair: reshard TP4 -> TP4's share of raw point-to-point "
                     f"{ratio_text(rat['TP4 share of raw'])}; reshard's share of raw + the "
                     f"forward {ratio_text(rat['share of raw + forward'])}")
    rises = [r["rise"] for r in row.get("by_run", [row]) if "rise" in r]
    if rises:
        per_run = Spread([statistics.median(r["ms_by_round"]) for r in rises])
        lines.append(f"  reshard's rise from {rises[0]['from']} tensors of the same bytes (both "
                     f"in each round, the median of the rounds' differences): "
                     f"{ratio_text(per_run, ' ms')}")
    return "\n".join(lines)


def peer_table(out: dict, names, ratios) -> tuple[list, list]:
    """(head, rows) with one row per tensor count: each peer of `names`' median [range], then
    each ratio of `ratios` ((key of `ratios()`, unit, heading)); "not run" where one is missing."""
    rows = []
    for count, row in out["counts"].items():
        cells = [f"{count} x {row['shape'][0]}x{row['shape'][1]}"]
        for name in names:
            p = row["peers"].get(name)
            cells.append("not run" if p is None else
                         f"{p['median']:.3f} [{p['low']:.3f}-{p['high']:.3f}]")
        rat = ratio_spreads(row)
        cells += [ratio_text(rat[k], unit) if k in rat else "not run" for k, unit, _ in ratios]
        rows.append(cells)
    return ["tensors"] + list(names) + [heading for _, _, heading in ratios], rows


def extra_table(out: dict) -> tuple[list, list]:
    """`peer_table` of the peers beside the main ones (`peers_case.EXTRA`) with the fair pair's
    ratios; no rows when none of them ran."""
    extra = [n for n in EXTRA if any(n in row["peers"] for row in out["counts"].values())]
    if not extra:
        return [], []
    return peer_table(out, extra, (
        ("TP4 share of raw", "", "reshard TP4 -> TP4's share of raw point-to-point"),
        ("share of raw + forward", "", "reshard's share of raw point-to-point + the forward")))


def ratio_text(s: Spread, unit: str = "") -> str:
    """A ratio's median, and its range over the runs when there were several."""
    text = f"{s.median:.2f}{unit}"
    return text if len(s.values) == 1 else f"{text} [{s.low:.2f}-{s.high:.2f}]"


def goals(out: dict) -> list:
    """Each goal with the measured median ratio and whether it is met (with several runs: on
    the median over the runs, and in how many of them)."""
    rows = []
    for count, row in out["counts"].items():
        spreads = ratio_spreads(row)
        for key, goal, text in (
                ("object store", GOAL_OBJECT_STORE,
                 f"reshard >= {GOAL_OBJECT_STORE:g}x the object store, {count} tensors"),
                ("raw share", GOAL_RAW_SHARE,
                 f"reshard >= {GOAL_RAW_SHARE:g} of raw point-to-point, {count} tensors")):
            rows.append({"goal": text, **spreads[key].judged(lambda v, g=goal: v >= g)})
        for key, goals_by_count, text in (
                ("TP4 share of raw", GOAL_FAIR_TP4_SHARE,
                 "reshard TP4 -> TP4 >= {g:g} of raw point-to-point, {c} tensors"),
                ("share of raw + forward", GOAL_FAIR_FORWARD_SHARE,
                 "reshard >= {g:g} of raw point-to-point + the forward, {c} tensors")):
            goal = goals_by_count.get(count)
            if goal is not None and key in spreads:
                rows.append({"goal": text.format(g=goal, c=count),
                             **spreads[key].judged(lambda v, g=goal: v >= g)})
    rise = reshard_rise(out, str(RISE[0]), str(RISE[1]))
    if rise is not None:
        rows.append({"goal": f"reshard's rise from {RISE[0]} to {RISE[1]} tensors <= "
                             f"{GOAL_RISE_MS} ms (in ms)",
                     **rise.judged(lambda v: v <= GOAL_RISE_MS)})
    return rows


def reshard_rise(out: dict, fewer: str, more: str):
    """Reshard's time at `more` tensors less its time at `fewer` (the same bytes), in ms: a
    Spread over the runs. Measured in `more`'s case (both in each round: the median of the
    rounds' differences), else from the two cases' medians; None when neither was run."""
    counts = out["counts"]
    b = counts.get(more)
    runs = [] if b is None else b.get("by_run", [b])
    if runs and all(r.get("rise", {}).get("from") == int(fewer) for r in runs):
        return Spread([statistics.median(r["rise"]["ms_by_round"]) for r in runs])
    if fewer not in counts or more not in counts:
        return None
    a = counts[fewer]
    if "by_run" in a:
        return Spread([1e3 * (y["peers"]["reshard"]["median"] - x["peers"]["reshard"]["median"])
                       for x, y in zip(a["by_run"], b["by_run"])])
    return Spread([1e3 * (b["peers"]["reshard"]["median"] - a["peers"]["reshard"]["median"])])


def goal_text(g: dict) -> str:
    """'met' or 'NOT met', and with several runs in how many of them."""
    text = "met" if g["met"] else "NOT met"
    if g.get("runs", 1) > 1:
        text += f" ({g['runs_met']} of {g['runs']} runs)"
    return text


def main(argv=None) -> int:
    ap = Parser(prog="ray_reshard bench-peers",
                description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=None,
                    help="MiB of fp32 weights per case (default 256; with --shaped 128)")
    ap.add_argument("--counts", default="32,1024,4096",
                    help="comma-separated tensor counts (default 32,1024,4096)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1,
                    help="whole measurements, each on a fresh cluster; figures are then the "
                         "median of the runs' medians, ranges those of the run medians")
    ap.add_argument("--bucket-mb", type=int, default=None,
                    help=f"reshard's bucket size (default 16 MiB; with --shaped "
                         f"{SHAPED_BUCKET_MB}: on a link-bound cluster the first bucket's "
                         f"packing and the last one's forward inside the node are not "
                         f"overlapped with the link, and smaller buckets shorten both)")
    ap.add_argument("--store-mb", type=int, default=0,
                    help="object store per node (default: sized for --mb, see harness)")
    ap.add_argument("--shaped", metavar="RATES",
                    help="run on a cluster in a box (Ray nodes in network namespaces, needs "
                         "root, ip and tc) whose links are shaped to each of these rates in "
                         "turn, e.g. 1gbit,2gbit")
    ap.add_argument("--mtu", type=int, default=9000, help="the shaped links' MTU (default 9000)")
    ap.add_argument("--json", metavar="PATH", type=output_file,
                    help="also write the figures as JSON")
    args = ap.parse_args(argv)
    rates = []
    if args.shaped is not None:
        from ..netns_cluster import rate_bytes_per_s
        rates = [r.strip().lower() for r in args.shaped.split(",") if r.strip()]
        try:
            if not rates:
                raise ValueError("no rate given")
            for r in rates:
                rate_bytes_per_s(r)
        except ValueError as e:
            ap.error(f"--shaped: {e}")
        if args.runs != 1:
            ap.error("--runs: the shaped run measures one box (give --runs 1)")
        if not 1280 <= args.mtu <= 65000:
            ap.error(f"--mtu must be 1280 to 65000, got {args.mtu}")
    if args.mb is None:
        args.mb = 128 if rates else 256
    if args.bucket_mb is None:
        args.bucket_mb = SHAPED_BUCKET_MB if rates else 16
    if args.bucket_mb < 1:
        ap.error(f"--bucket-mb must be positive, got {args.bucket_mb}")
    try:
        counts = [int(x) for x in args.counts.split(",")]
        for c in counts:
            shape_for(args.mb, c)
            if rates:
                from .shaped import specs
                for name in SHAPED_LAYOUTS:
                    specs(name, args.mb, c)
    except ValueError as e:
        ap.error(f"--counts/--mb: {e}")
    if args.repeats < 1 or args.mb < 1 or args.runs < 1:
        ap.error("--repeats, --runs and --mb must be positive")
    if rates:
        from ..netns_cluster import unavailable
        why = unavailable()
        if why:
            print(f"bench-peers --shaped: no cluster in a box here ({why}); measuring on the "
                  f"loopback cluster instead", flush=True)
        else:
            return shaped_main(args, rates, counts)
    outs = []
    for k in range(args.runs):
        if args.runs > 1:
            print(f"\n== run {k + 1} of {args.runs}, on a fresh cluster", flush=True)
        outs.append(measure(args.mb, counts, args.repeats, args.bucket_mb, args.store_mb,
                            log=lambda *a, **k: print(*a, **k)))
    out = combine_runs(outs)
    if args.runs > 1:
        print(f"\nover the {args.runs} runs: median of the run medians [lowest-highest run "
              f"median]")
        for count, row in out["counts"].items():
            print(render_row(row))
    print("\ngoals (median ratios" + (" over the runs" if args.runs > 1 else "") + "):")
    for g in out["goals"]:
        print(f"  {g['goal']:<52} {g['measured']:6.2f}  {goal_text(g)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
