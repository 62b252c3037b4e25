"""reshard and its peers side by side, on the same actors in one run, each at its best.

    python -m ray_reshard bench-peers [--mb 256] [--counts 32,1024,4096] [--repeats 5] [--runs 1]

4 source actors on one simulated node hold TP4 row shards of `--mb` MiB of fp32 weights, cut
into 32, 1024 or 4096 tensors; 4 destination actors on another node are TP2 x DP2. Peers, on
those same 8 actors, after one warm-up run each (whose result is checked against reshard's):

* reshard: `ReshardGroup.refit` (each byte crosses the network once, then the destination
  node's replicas exchange over shared memory);
* object store: what a careful Ray user writes: each source returns its shards as one list of
  numpy arrays (stored once, read zero-copy), each destination fetches the two source objects
  covering its rows and copies its rows out; every node's object store is sized for the
  payload, and Ray's spill counters are read before and after: a run that spilled fails;
* Ray Direct Transport: the same, with the source method declared
  `@ray.method(tensor_transport="gloo")`, so the tensors go actor to actor over a gloo
  collective group of the 8 actors instead of through the object store;
* gather-broadcast: `ReshardGroup(strategy="gather_broadcast")`;
* raw point-to-point: each source sends as many bytes as reshard moves over the network per
  source to one destination, all at once, over reshard's own transport (no packing, no plan):
  what the network of these actors allows; in bucket-sized messages two at a time (as the
  executor's window) and in one message per pair, the faster of the two being the ceiling.

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
    settle, store_bytes_for

COLS = 1024
GOAL_OBJECT_STORE = 2.0       # reshard at least this many times faster than the object store
GOAL_RAW_SHARE = 0.85         # reshard at least this share of raw point-to-point
RAW = ("raw point-to-point, bucket-sized messages", "raw point-to-point, one message per pair")
RDT = "Ray Direct Transport (gloo)"
PEERS = ("reshard", "object store", RDT, "gather-broadcast") + RAW


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

        def digest(self):
            return float(sum(float(t.double().sum()) for t in self.t.values()))

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


def measure(mb: int, counts: list, repeats: int, bucket_mb: int = 16,
            store_mb: int = 0, log=print) -> dict:
    """Run every peer at every tensor count; returns the figures (see the module docstring)."""
    import numpy as np
    import ray

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    src_l = L([0, 1, 2, 3], Shard(0))
    dst_l = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
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
            rows, cols = shape_for(mb, count)
            names = [f"w{i}" for i in range(count)]
            specs = {n: rr.TensorSpec((rows, cols), torch.float32, src_l, dst_l) for n in names}
            shapes = lambda side, r: {n: s.layout(side).local_shape(r, s.shape)
                                      for n, s in specs.items()}
            ray.get([a.make.remote(shapes("src", r), True) for r, a in enumerate(src)])
            ray.get([a.make.remote(shapes("dst", r), False) for r, a in enumerate(dst)])
            bucket = bucket_mb * MiB
            g = rr.ReshardGroup(src, dst, bucket_bytes=bucket)
            gb = rr.ReshardGroup(src, dst, strategy="gather_broadcast", bucket_bytes=bucket)
            whole = None
            try:
                network = g.plan(specs).stats.network_bytes
                per_pair = max(1, network // 4)
                whole = rr.ReshardGroup(src, dst, bucket_bytes=per_pair)   # one message a pair

                def reshard():
                    t0 = time.perf_counter()
                    g.refit(specs)
                    return time.perf_counter() - t0

                def gather_broadcast():
                    t0 = time.perf_counter()
                    gb.refit(specs)
                    return time.perf_counter() - t0

                def through(export):
                    def run():
                        t0 = time.perf_counter()
                        refs = [export(a) for a in src]
                        # destination rank d = dp * 2 + tp holds rows of sources 2 tp, 2 tp + 1
                        ray.get([a.absorb.remote(names, refs[2 * (d % 2)], refs[2 * (d % 2) + 1])
                                 for d, a in enumerate(dst)])
                        del refs
                        return time.perf_counter() - t0
                    return run

                def raw(group):
                    def run():
                        t0 = time.perf_counter()
                        group.raw_bandwidth(per_pair)
                        return time.perf_counter() - t0
                    return run

                peers = {"reshard": reshard,
                         "object store": through(lambda a: a.export.remote(names)),
                         "gather-broadcast": gather_broadcast, RAW[0]: raw(g), RAW[1]: raw(whole)}
                if rdt:
                    peers[RDT] = through(
                        lambda a: a.export_tensors.remote(names))
                # warm-up, each peer's result checked against reshard's
                want = None
                for name, fn in list(peers.items()):
                    if name in RAW:
                        fn()
                        continue
                    ray.get([a.zero.remote() for a in dst])
                    try:
                        fn()
                    except Exception as e:
                        if name != RDT:               # an alpha API: report it, run the rest
                            raise
                        del peers[name]
                        out["rdt"] = (f"failed at {count} tensors: {type(e).__name__}: "
                                      f"{str(e).splitlines()[-1][:200] if str(e) else ''}")
                        log(f"Ray Direct Transport: {out['rdt']}")
                        rdt = None
                        continue
                    got = ray.get([a.digest.remote() for a in dst])
                    if want is None:
                        want = got
                    elif not np.allclose(want, got, rtol=1e-9, atol=1e-6):
                        raise RuntimeError(f"{count} tensors: {name} left {got} on the "
                                           f"destinations, reshard {want}")
                # Each repeat rotates the order, so no peer always runs right after the same
                # one; each timed run starts once the machine is quiet again.
                times = {name: [] for name in peers}
                order = list(peers)
                waits = []
                for k in range(repeats):
                    for name in order[k % len(order):] + order[:k % len(order)]:
                        waits.append(settle())
                        times[name].append(peers[name]())
            finally:
                for group in (g, gb, whole):
                    if group is not None:
                        group.close()
            row = {"tensors": count, "shape": [rows, cols], "network_bytes": network,
                   "raw_bytes": per_pair * 4, "peers": {n: Spread(v).as_dict()
                                                        for n, v in times.items()}}
            row["settle"] = {"runs": len(waits), "waited_s": round(sum(waits), 2),
                             "not_quiet": sum(w >= SETTLE_LIMIT_S for w in waits)}
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
    out = {n: t / r for n, t in med.items() if n != "reshard" and n not in RAW}
    raw = min(med[n] for n in RAW) * row["network_bytes"] / row["raw_bytes"]
    out["raw share"] = raw / r
    return out


def render_row(row: dict) -> str:
    lines = [f"\n{row['tensors']} tensors of {row['shape'][0]}x{row['shape'][1]} fp32 "
             f"(network bytes of reshard's plan: {row['network_bytes'] / MiB:.0f} MiB; nothing "
             f"spilled)",
             f"  {'peer':<42} {'seconds: median [range]':>28} {'vs reshard':>10}"]
    rat = ratio_spreads(row)
    for name in PEERS:
        if name not in row["peers"]:
            continue
        s = Spread(row["peers"][name]["values"])
        vs = "" if name == "reshard" or name not in rat else ratio_text(rat[name], "x")
        lines.append(f"  {name:<42} {s.text():>28} {vs:>10}")
    lines.append(f"  reshard's share of raw point-to-point (the faster one): "
                 f"{ratio_text(rat['raw share'])}")
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
    ap.add_argument("--mb", type=int, default=256, help="MiB of fp32 weights per case")
    ap.add_argument("--counts", default="32,1024,4096",
                    help="comma-separated tensor counts (default 32,1024,4096)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1,
                    help="whole measurements, each on a fresh cluster; figures are then the "
                         "median of the runs' medians, ranges those of the run medians")
    ap.add_argument("--bucket-mb", type=int, default=16, help="reshard's bucket size")
    ap.add_argument("--store-mb", type=int, default=0,
                    help="object store per node (default: sized for --mb, see harness)")
    ap.add_argument("--json", metavar="PATH", type=output_file,
                    help="also write the figures as JSON")
    args = ap.parse_args(argv)
    try:
        counts = [int(x) for x in args.counts.split(",")]
        for c in counts:
            shape_for(args.mb, c)
    except ValueError as e:
        ap.error(f"--counts/--mb: {e}")
    if args.repeats < 1 or args.mb < 1 or args.runs < 1:
        ap.error("--repeats, --runs and --mb must be positive")
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
