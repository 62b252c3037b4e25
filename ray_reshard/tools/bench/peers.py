"""reshard and its peers side by side, on the same actors in one run, each at its best.

    python -m ray_reshard bench-peers [--mb 256] [--counts 32,1024,4096] [--repeats 5] [--runs 1]
    python -m ray_reshard bench-peers --shaped 1gbit,2gbit [--mb 128] [--repeats 5]

4 source actors on one node hold TP4 row shards of `--mb` MiB of fp32 weights, cut into 32,
1024 or 4096 tensors; 4 destination actors on another node are TP2 x DP2. Peers, on those same
8 actors, after one warm-up run each (whose result is checked against reshard's):

* reshard: `ReshardGroup.refit` (each byte crosses the network once, then the destination
  node's replicas exchange over shared memory);
* object store: what a careful Ray user writes: each source returns its shards as one list of
  numpy arrays (stored once, read zero-copy), each destination fetches the two source objects
  covering its rows and copies its rows out; every node's object store is sized for the
  payload, and Ray's spill counters are read before and after: a run that spilled fails;
* Ray Direct Transport: the same, with the source method declared
  `@ray.method(tensor_transport="gloo")`, so the tensors go actor to actor over a gloo
  collective group of the 8 actors instead of through the object store; once as the list of
  shards, once as one flat tensor per source (one message; the source copies its shards into
  it, each destination slices its rows out);
* gather-broadcast: `ReshardGroup(strategy="gather_broadcast")`;
* raw point-to-point: each source sends as many bytes as reshard moves over the network per
  source to one destination, all at once, over reshard's own transport (no packing, no plan):
  what the network of these actors allows; in bucket-sized messages two at a time (as the
  executor's window) and in one message per pair, the faster of the two being the ceiling.

On loopback (the default: two simulated nodes of one machine) the run adds the fair pair of
raw point-to-point: reshard TP4 -> TP4 (the same pairs and bytes as the raw sends), and the raw
sends followed by the forward reshard does inside the destination node (a refit of the first
replica into the second: the same domain bytes), since the raw sends deliver only half of what
the destinations hold.

With `--shaped RATES` the run happens on a cluster in a box (`ray_reshard.tools.netns_cluster`: Ray
nodes in network namespaces, links shaped with tc; needs root, `ip` and `tc`, else it says so
in one line and runs on loopback), once per link rate; every timed run reads the kernel's byte
counters of every link, so each peer's time stands beside the bytes it put on the wire, and
every figure beside the link bound (the busiest link's bytes of reshard's plan over its rate).
It also refits the layouts across 3 nodes of `bench.shaped.layouts` (pipeline stages, experts)
beside their link bounds. There reshard's bucket is 4 MiB unless `--bucket-mb` says otherwise
(gather-broadcast keeps 16 MiB: its collectives gain from large buckets).

Every peer is timed from the driver's call to every destination holding the weights. The peers
take turns within each repeat (so drift on a shared machine hits all alike), in an order rotated
each repeat, and each timed run starts once the machine is quiet (`harness.settle`: work the
previous run left behind, such as the object store freeing its objects, would otherwise be
charged to whichever peer runs next). Each figure is the median of `--repeats` with its range.
With `--runs N` the whole measurement runs N times, each on a fresh cluster, and each figure is
the median of the runs' medians with the lowest and highest of them: how far a fresh cluster
moves the figure, which one run's range of repeats does not tell (not a guarantee: were the
runs alike, a further run's median would fall inside the range of N runs' medians with chance
(N - 1) / (N + 1)). Nothing is asserted; the goals are printed beside the figures.
"""
from __future__ import annotations

import json
import time

import torch

from ..cli_args import Parser, output_file
from ..testing import local_cluster
from .harness import SETTLE_LIMIT_S, MiB, SpillCheck, Spread, check_store, machine_facts, \
    raw_bandwidth, settle, store_bytes_for

COLS = 1024
GOAL_OBJECT_STORE = 2.0       # reshard at least this many times faster than the object store
GOAL_RAW_SHARE = 0.85         # reshard at least this share of raw point-to-point
RAW = ("raw point-to-point, bucket-sized messages", "raw point-to-point, one message per pair")
RDT = "Ray Direct Transport (gloo)"
RDT_FLAT = "Ray Direct Transport (gloo), one flat tensor per source"
PEERS = ("reshard", "object store", RDT, "gather-broadcast") + RAW
# The fair pair of raw point-to-point (loopback): the same pairs and bytes as the raw sends,
# and the raw sends plus the forward inside the destination node.
FAIR = ("reshard TP4 -> TP4 (the raw sends' pairs and bytes)",
        "raw point-to-point + forward to the second replica")
FORWARD = "forward to the second replica (a refit of replica 0 into replica 1)"
EXTRA = (RDT_FLAT, FAIR[0], FORWARD)
# Goals on shaped links: reshard's share of the link bound at 1 and 2 Gbit/s; the wire bytes
# over the plan's network bytes.
GOAL_LINK_SHARE = {"1gbit": 0.93, "2gbit": 0.9}
GOAL_WIRE = 1.05
GB_BUCKET_MB = 16             # gather-broadcast's bucket (whole tensors per collective), at least
SHAPED_BUCKET_MB = 4          # reshard's default bucket on shaped links (see `main`)


def shape_for(mb: int, count: int) -> tuple[int, int]:
    """(rows, 1024) fp32 tensors, `count` of them making `mb` MiB; rows a multiple of 4."""
    rows = (mb * MiB) // (count * COLS * 4)
    if rows < 4 or rows % 4:
        raise ValueError(f"--mb {mb} over {count} tensors gives {rows} rows of {COLS} fp32 "
                         f"each: expected a positive multiple of 4 (TP4 row shards)")
    return rows, COLS


def _holder_class():
    import ray

    @ray.remote(num_cpus=0)
    class Holder:
        """Holds named tensors; exports and absorbs them the ways the peers move them."""

        def __init__(self):
            self.t = {}

        def make(self, shapes, fill):
            g = torch.Generator().manual_seed(1)
            self.t = {n: (torch.randn(s, generator=g) if fill else torch.zeros(s))
                      for n, s in shapes.items()}

        def zero(self):
            for t in self.t.values():
                t.zero_()

        def reshard_tensors(self):
            return self.t

        def export(self, names):
            return [self.t[n].numpy() for n in names]

        @ray.method(tensor_transport="gloo")
        def export_tensors(self, names):
            return [self.t[n] for n in names]

        @ray.method(tensor_transport="gloo")
        def export_flat(self, names):
            return torch.cat([self.t[n].view(-1) for n in names])

        def absorb_flat(self, names, *flats):
            # flats: one flat tensor per source covering this rank's rows, in row order
            offs = [0] * len(flats)
            for n in names:
                dst = self.t[n]
                row = 0
                for k, flat in enumerate(flats):
                    rows = dst.shape[0] // len(flats)
                    count = rows * dst.shape[1]
                    dst[row:row + rows].copy_(flat[offs[k]:offs[k] + count].view(rows, -1))
                    offs[k] += count
                    row += rows
            return True

        def add(self, shapes):
            """More tensors beside the ones it holds (zeros)."""
            self.t.update({n: torch.zeros(s) for n, s in shapes.items()})

        def alias(self, names):
            """Its tensors also under other names ({new: existing}; no copy)."""
            self.t.update({new: self.t[old] for new, old in names.items()})

        def absorb(self, names, *parts):
            # parts: the source objects covering this rank's rows, in row order
            for i, n in enumerate(names):
                dst = self.t[n]
                row = 0
                for part in parts:
                    a = torch.as_tensor(part[i])
                    dst[row:row + a.shape[0]].copy_(a)
                    row += a.shape[0]
            return True

        def digest(self, names):
            return float(sum(float(self.t[n].double().sum()) for n in names))

    return Holder


def _rdt_group(actors):
    """A gloo collective group of `actors` for Ray Direct Transport, or the reason there is
    none on this Ray."""
    try:
        from ray.experimental.collective import create_collective_group
    except ImportError as e:
        return None, f"Ray {__import__('ray').__version__} has no Ray Direct Transport ({e})"
    try:
        return create_collective_group(actors, backend="torch_gloo"), ""
    except Exception as e:                        # an alpha API: report, do not hide
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _case(src, dst, count: int, mb: int, bucket_mb: int, repeats: int, rdt, log=print,
          fair: bool = False, counted=None) -> tuple[dict, str]:
    """Every peer at one tensor count on the same actors: warm-up (each result checked against
    reshard's), then `repeats` rounds of timed runs in rotated order; with `counted`
    (`shaped.Counted`) each run's link bytes too. Returns the row and why Ray Direct Transport
    stopped ("" when it ran)."""
    import numpy as np
    import ray

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    src_l = L([0, 1, 2, 3], Shard(0))
    dst_l = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    rows, cols = shape_for(mb, count)
    names = [f"w{i}" for i in range(count)]
    specs = {n: rr.TensorSpec((rows, cols), torch.float32, src_l, dst_l) for n in names}
    shapes = lambda spec_set, side, r: {n: s.layout(side).local_shape(r, s.shape)
                                        for n, s in spec_set.items()}
    ray.get([a.make.remote(shapes(specs, "src", r), True) for r, a in enumerate(src)])
    ray.get([a.make.remote(shapes(specs, "dst", r), False) for r, a in enumerate(dst)])
    fair_specs = fwd_specs = None
    if fair:
        # TP4 -> TP4 into tensors of their own: source i sends its shard to destination i
        fair_specs = {f"p{i}": rr.TensorSpec((rows, cols), torch.float32, src_l, src_l)
                      for i in range(count)}
        ray.get([a.add.remote(shapes(fair_specs, "dst", r)) for r, a in enumerate(dst)] +
                [a.alias.remote({f"p{i}": f"w{i}" for i in range(count)}) for a in src])
        # the first replica's shards into the second's, inside the destination node
        tp2 = L([0, 1], Shard(0), names=("tp",))
        fwd_specs = {n: rr.TensorSpec((rows, cols), torch.float32, tp2, tp2) for n in names}
    bucket = bucket_mb * MiB
    g = rr.ReshardGroup(src, dst, bucket_bytes=bucket)
    # gather-broadcast's collectives gain from large buckets: never under 16 MiB
    gb = rr.ReshardGroup(src, dst, strategy="gather_broadcast",
                         bucket_bytes=max(bucket, GB_BUCKET_MB * MiB))
    whole = fwd = None
    why_not_rdt = ""
    try:
        network = g.plan(specs).stats.network_bytes
        per_pair = max(1, network // 4)
        whole = rr.ReshardGroup(src, dst, bucket_bytes=per_pair)   # one message a pair
        if fair:
            fwd = rr.ReshardGroup(dst[:2], dst[2:], bucket_bytes=bucket)

        def refit(group, spec_set):
            def run():
                t0 = time.perf_counter()
                group.refit(spec_set)
                return time.perf_counter() - t0
            return run

        def through(export, absorb="absorb"):
            def run():
                t0 = time.perf_counter()
                refs = [export(a) for a in src]
                # destination rank d = dp * 2 + tp holds rows of sources 2 tp, 2 tp + 1
                ray.get([getattr(a, absorb).remote(names, refs[2 * (d % 2)],
                                                   refs[2 * (d % 2) + 1])
                         for d, a in enumerate(dst)])
                del refs
                return time.perf_counter() - t0
            return run

        def raw(group):
            def run():
                t0 = time.perf_counter()
                raw_bandwidth(group, per_pair)
                return time.perf_counter() - t0
            return run

        peers = {"reshard": refit(g, specs),
                 "object store": through(lambda a: a.export.remote(names)),
                 "gather-broadcast": refit(gb, specs), RAW[0]: raw(g), RAW[1]: raw(whole)}
        if rdt:
            peers[RDT] = through(lambda a: a.export_tensors.remote(names))
            peers[RDT_FLAT] = through(lambda a: a.export_flat.remote(names), "absorb_flat")
        if fair:
            peers[FAIR[0]] = refit(g, fair_specs)
            peers[FORWARD] = refit(fwd, fwd_specs)
        # warm-up, each peer's result checked against reshard's
        want = None
        for name, fn in list(peers.items()):
            if name in RAW or name in FAIR or name == FORWARD:
                fn()
                continue
            ray.get([a.zero.remote() for a in dst])
            try:
                fn()
            except Exception as e:
                if name not in (RDT, RDT_FLAT):      # an alpha API: report it, run the rest
                    raise
                del peers[name]
                why_not_rdt = (f"{name} failed at {count} tensors: {type(e).__name__}: "
                               f"{str(e).splitlines()[-1][:200] if str(e) else ''}")
                log(why_not_rdt)
                continue
            got = ray.get([a.digest.remote(names) for a in dst])
            if want is None:
                want = got
            elif not np.allclose(want, got, rtol=1e-9, atol=1e-6):
                raise RuntimeError(f"{count} tensors: {name} left {got} on the "
                                   f"destinations, reshard {want}")
        # Each repeat rotates the order, so no peer always runs right after the same
        # one; each timed run starts once the machine is quiet again.
        times = {name: [] for name in peers}
        wire = {name: [] for name in peers}
        idle = {name: [] for name in peers}
        order = list(peers)
        waits = []
        for k in range(repeats):
            for name in order[k % len(order):] + order[:k % len(order)]:
                waits.append(settle())
                if counted is None:
                    times[name].append(peers[name]())
                else:
                    seconds, links = counted(peers[name])
                    times[name].append(seconds)
                    wire[name].append(links)
                    if counted.last_timeline:
                        idle[name].append(counted.last_timeline)
        plan = g.plan(specs)
    finally:
        for group in (g, gb, whole, fwd):
            if group is not None:
                group.close()
    row = {"tensors": count, "shape": [rows, cols], "network_bytes": network,
           "raw_bytes": per_pair * 4, "peers": {n: Spread(v).as_dict()
                                                for n, v in times.items()}}
    if counted is not None:
        from .shaped import link_bytes
        row["plan_links"] = {str(i): v for i, v in link_bytes(plan).items()}
        row["wire"] = {n: [{str(i): v for i, v in w.items()} for w in ws]
                       for n, ws in wire.items()}
        # where a timed run's time went: before node 0's link started, while it carried the
        # bytes, after it finished (medians over the repeats)
        row["link_timeline"] = {n: {k: Spread([x[k] for x in xs]).median for k in xs[0]}
                                for n, xs in idle.items() if xs}
    row["settle"] = {"runs": len(waits), "waited_s": round(sum(waits), 2),
                     "not_quiet": sum(w >= SETTLE_LIMIT_S for w in waits)}
    return row, why_not_rdt


def measure(mb: int, counts: list, repeats: int, bucket_mb: int = 16,
            store_mb: int = 0, log=print) -> dict:
    """Run every peer at every tensor count on a loopback cluster; returns the figures (see
    the module docstring)."""
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
        Holder = _holder_class()
        src = [Holder.options(resources={"node0": 1}).remote() for _ in range(4)]
        dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
        rdt, rdt_why = _rdt_group(src + dst)
        out["rdt"] = "gloo collective group of the 8 actors" if rdt else f"not run: {rdt_why}"
        log(f"{out['layout']}, {mb} MiB per case, object store "
            f"{min(out['store_bytes_per_node'].values()) / MiB:.0f} MiB per node; median "
            f"[range] of {repeats} after a warm-up, peers taking turns")
        if not rdt:
            log(f"Ray Direct Transport: {out['rdt']}")
        spill = SpillCheck(address)
        for count in counts:
            row, why = _case(src, dst, count, mb, bucket_mb, repeats, rdt, log, fair=True)
            if why:
                out["rdt"] = why
                rdt = None if RDT not in row["peers"] else rdt
            row["spill"] = spill.check(f"{count} tensors")
            out["counts"][str(count)] = row
            log(render_row(row), flush=True)
    out["goals"] = goals(out)
    return out


# reshard alone on these layouts of `bench.shaped.layouts` (3 nodes) in a shaped run
SHAPED_LAYOUTS = ("PP2xTP2 -> TP4, 3 nodes", "EP4 -> EP2xTP2, 3 nodes")


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
    Holder = _holder_class()
    src = [Holder.options(resources={"node0": 1}).remote() for _ in range(4)]
    dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
    rdt, rdt_why = _rdt_group(src + dst)
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
            row, why = _case(src, dst, count, mb, bucket_mb, repeats, rdt, log,
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
    return "\n".join(lines)


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
            sp = spreads[key]
            rows.append({"goal": text, "measured": sp.median, "met": sp.median >= goal,
                         "low": sp.low, "high": sp.high, "runs": len(sp.values),
                         "runs_met": sum(v >= goal for v in sp.values),
                         "values": list(sp.values)})
    return rows


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


def shaped_main(args, rates: list, counts: list) -> int:
    from .shaped import run_in_box

    store = args.store_mb * MiB if args.store_mb else store_bytes_for(args.mb * MiB)
    out = run_in_box("ray_reshard.tools.bench.peers:measure_shaped",
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


if __name__ == "__main__":
    raise SystemExit(main())
