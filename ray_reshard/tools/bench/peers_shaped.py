"""The peers benchmark on a cluster in a box (`bench-peers --shaped`): every peer at each link
rate with the bytes each run put on the wire, and reshard alone on 3-node layouts, each figure
beside the link bound."""
from __future__ import annotations

import json

from .harness import MiB, SpillCheck, Spread, check_store, machine_facts, store_bytes_for
from .peers_case import PEERS, RAW, RDT_FLAT, holder_class, rdt_group, run_case

# reshard alone on these layouts of `bench.shaped.layouts` (3 nodes) in a shaped run
SHAPED_LAYOUTS = ("PP2xTP2 -> TP4, 3 nodes", "EP4 -> EP2xTP2, 3 nodes")
# Goals on shaped links: reshard's share of the link bound at 1 and 2 Gbit/s; the wire bytes
# over the plan's network bytes.
GOAL_LINK_SHARE = {"1gbit": 0.93, "2gbit": 0.9}
GOAL_WIRE = 1.05
SHAPED_BUCKET_MB = 4          # reshard's default bucket on shaped links (see `peers.main`)


def measure_shaped(rates: list, mb: int, counts: list, repeats: int, bucket_mb: int = 16,
                   layout_names: tuple = SHAPED_LAYOUTS, log=print) -> dict:
    """Inside a box's driver: every peer at every count and link rate (each run's link bytes
    counted), then reshard alone on the 3-node layouts; returns the figures."""
    import ray

    from . import shaped

    out = {"mb": mb, "repeats": repeats, "bucket_mb": bucket_mb, "rates": {},
           "layout": "TP4 (4 actors, node 0) -> TP2 x DP2 (4 actors, node 1), fp32",
           "machine": machine_facts(), "shaped": True}
    address = ray.get_runtime_context().gcs_address
    out["store_bytes_per_node"] = check_store(2 * mb * MiB)
    Holder = holder_class()
    src = [Holder.options(resources={"node0": 1}).remote() for _ in range(4)]
    dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
    rdt, rdt_why = rdt_group(src + dst)
    out["rdt"] = "gloo collective group of the 8 actors" if rdt else f"not run: {rdt_why}"
    counted = shaped.Counted()
    out["mtu"] = counted.links.spec.mtu
    spill = SpillCheck(address)
    for rate in rates:
        shaped.set_rate(rate)
        bps = shaped.rate_Bps(rate)
        res = out["rates"][rate] = {"rate_Bps": bps, "counts": {}, "layouts": {}}
        log(f"\n== links at {rate} each way: {out['layout']}, {mb} MiB per case; median "
            f"[range] of {repeats} after a warm-up, peers taking turns", flush=True)
        for count in counts:
            row, why = run_case(src, dst, count, mb, bucket_mb, repeats, rdt, log,
                             counted=counted)
            if why:
                out["rdt"] = why
            row["spill"] = spill.check(f"{rate}, {count} tensors")
            row["link_bound_s"] = shaped.busiest_link(row["plan_links"]) / bps
            res["counts"][str(count)] = row
            log(render_shaped_row(row), flush=True)
        for name in layout_names:
            res["layouts"][name] = {}
            for count in counts:
                r = layout_case(name, mb, count, repeats, bucket_mb, counted)
                r["link_bound_s"] = shaped.busiest_link(r["plan_links"]) / bps
                res["layouts"][name][str(count)] = r
                log(f"  {name}, {count} tensors: reshard {Spread(r['seconds']).text()} s, "
                    f"link bound {r['link_bound_s']:.3f} s "
                    f"({r['link_bound_s'] / Spread(r['seconds']).median:.3f} of it)",
                    flush=True)
    out["goals"] = shaped_goals(out)
    return out


def layout_case(name: str, mb: int, count: int, repeats: int, bucket_mb: int,
                counted) -> dict:
    """reshard alone on a layout of `shaped.layouts()`: timed refits with their link bytes."""
    import ray

    import ray_reshard as rr

    from . import shaped

    spec_set = shaped.specs(name, mb, count)
    _, _, _, src_nodes, dst_nodes, _ = shaped.layouts()[name]
    src, dst = shaped.place(src_nodes, dst_nodes)
    shaped.fill(src, dst, spec_set)
    try:
        with rr.ReshardGroup(src, dst, bucket_bytes=bucket_mb * MiB) as g:
            runs = shaped.timed_refits(g, spec_set, repeats, counted)
            plan = g.plan(spec_set)
    finally:
        for a in src + dst:
            ray.kill(a)
    return {"seconds": runs["seconds"], "wire": [{str(i): v for i, v in w.items()}
                                                 for w in runs["wire"]],
            "network_bytes": plan.stats.network_bytes,
            "plan_links": {str(i): v for i, v in shaped.link_bytes(plan).items()},
            "description": shaped.layouts()[name][0]}


def wire_in(links: dict) -> int:
    """Bytes that crossed the links in one run: what entered every node."""
    return sum(v[1] for v in links.values())


def render_shaped_row(row: dict) -> str:
    bound = row["link_bound_s"]
    lines = [f"\n{row['tensors']} tensors of {row['shape'][0]}x{row['shape'][1]} fp32 "
             f"(reshard's plan: {row['network_bytes'] / MiB:.0f} MiB over the network, link "
             f"bound {bound:.3f} s)",
             f"  {'peer':<58} {'seconds: median [range]':>26} {'of bound':>8} "
             f"{'wire MB':>8}"]
    for name in PEERS[:3] + (RDT_FLAT,) + PEERS[3:]:
        if name not in row["peers"]:
            continue
        s = Spread(row["peers"][name]["values"])
        wire = Spread([wire_in(w) for w in row["wire"][name]]).median
        tl = row.get("link_timeline", {}).get(name)
        when = ("" if not tl else f"   link idle {tl['before_ms']:.0f} ms before, busy "
                f"{tl['busy_ms']:.0f} ms, then {tl['after_ms']:.0f} ms")
        lines.append(f"  {name:<58} {s.text():>26} {bound / s.median:>8.3f} "
                     f"{wire / 1e6:>8.1f}{when}")
    return "\n".join(lines)


def shaped_goals(out: dict) -> list:
    """The goals on shaped links, each with its measured median and whether it is met."""
    rows = []
    for rate, res in out["rates"].items():
        need = GOAL_LINK_SHARE.get(rate.lower(), 0.9)
        for count, row in res["counts"].items():
            med = {n: p["median"] for n, p in row["peers"].items()}
            share = row["link_bound_s"] / med["reshard"]
            rows.append({"goal": f"{rate}: reshard >= {need:g} of the link bound, TP4 -> "
                                 f"TP2xDP2, {count} tensors",
                         "measured": share, "met": share >= need})
            slower = [n for n in med if n not in RAW and n != "reshard"
                      and med[n] < med["reshard"]]
            fastest = min((med[n] for n in med if n not in RAW and n != "reshard"),
                          default=float("inf"))
            rows.append({"goal": f"{rate}: reshard at least as fast as every refit peer, "
                                 f"{count} tensors", "measured": fastest / med["reshard"],
                         "met": not slower, "faster": slower})
            wire = Spread([wire_in(w) for w in row["wire"]["reshard"]]).median
            rows.append({"goal": f"{rate}: reshard's wire bytes / plan network bytes <= "
                                 f"{GOAL_WIRE:g}, {count} tensors",
                         "measured": wire / row["network_bytes"],
                         "met": wire / row["network_bytes"] <= GOAL_WIRE})
        for name, by_count in res["layouts"].items():
            for count, r in by_count.items():
                share = r["link_bound_s"] / Spread(r["seconds"]).median
                rows.append({"goal": f"{rate}: reshard >= {need:g} of the link bound, {name}, "
                                     f"{count} tensors", "measured": share,
                             "met": share >= need})
    return rows


def shaped_main(args, rates: list, counts: list) -> int:
    from .shaped import run_in_box

    store = args.store_mb * MiB if args.store_mb else store_bytes_for(args.mb * MiB)
    out = run_in_box("ray_reshard.tools.bench.peers_shaped:measure_shaped",
                     {"rates": rates, "mb": args.mb, "counts": counts,
                      "repeats": args.repeats, "bucket_mb": args.bucket_mb},
                     nodes=3, rate=rates[0], mtu=args.mtu, store_bytes=store)
    print("\ngoals (medians):")
    for g in out["goals"]:
        extra = f" (faster: {', '.join(g['faster'])})" if g.get("faster") else ""
        print(f"  {g['goal']:<78} {g['measured']:6.3f}  {'met' if g['met'] else 'NOT met'}"
              f"{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
