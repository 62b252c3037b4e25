"""Calibrate the simulator's `local` cluster and check its predictions against measured refits.

    python -m ray_reshard.tools.bench.sim_calibrate [--mb 64] [--repeats 3]
    python -m ray_reshard.tools.bench.sim_calibrate --check [--rates 1gbit,2gbit] [--mb 64]

The first fits the `local` preset's constants from primitive transfers and predicts other refits
with them; `--check` fits nothing and checks the `shaped` presets on a cluster in a box.
Method: docs/simulator.md (Calibrating the local preset; Shaped links).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Optional

import ray
import torch

import ray_reshard as rr
from ray_reshard.tools.cli_args import Parser, output_file
from ray_reshard.execution.program import PER_ITEM_MIN_BYTES
from ray_reshard.tools.bench.harness import raw_bandwidth
from ray_reshard.sim import Cluster, gather_broadcast_seconds, messages_exact, simulate
from ray_reshard.tools.testing import holders, local_cluster

N = 4


def _mesh1(ranks):
    return rr.Mesh(list(ranks), ("x",))


def _specs(n_tensors: int, rows: int, cols: int, src: rr.Layout, dst: rr.Layout):
    return {f"t{i}": rr.TensorSpec((rows, cols), torch.float32, src=src, dst=dst)
            for i in range(n_tensors)}


def _fill(actors, specs, side: str):
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    for r, a in enumerate(actors):
        ts = {}
        for n, s in specs.items():
            lay = s.src if side == "src" else s.dst
            if lay.box(r, s.shape) is not None:
                ts[n] = (rr.shard_tensor(full[n], lay, r) if side == "src"
                         else torch.zeros(lay.local_shape(r, s.shape)))
        ray.get(a.set.remote(ts))
    return full


def _timed_refits(group, specs, repeats: int) -> tuple[list, object]:
    """Seconds of `repeats` refits after a warm-up, and the last refit's result."""
    group.refit(specs)                               # installs programs, rings
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = group.refit(specs)
        runs.append(time.perf_counter() - t0)
    return runs, res


def _time_refits(group, specs, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` refits after a warm-up, for the constants and the cases
    alike, and the last refit's result."""
    runs, res = _timed_refits(group, specs, repeats)
    return statistics.median(runs), res


def copy_rates(repeats: int = 7) -> tuple[float, float]:
    """Bytes per second of one core copying 32 MiB between buffers that already exist, as a
    process packs into and unpacks out of its staging buffers and ring slots: out of a strided
    region (the left half of a row-major [32768, 512] fp32 matrix: 1 KiB runs, as a column
    slice of a tensor-parallel weight has: a few hundred bytes to a few KiB) and out of a
    contiguous one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                         # one process, one core
    try:
        x = torch.randn(32768, 512)
        y = torch.empty(32768, 256)
        z = torch.empty(32768 * 256)
        out = []
        for f in (lambda: y.copy_(x[:, :256]), lambda: z.copy_(x[:16384].reshape(-1))):
            f()
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                f()
                best = min(best, time.perf_counter() - t0)
            out.append(y.numel() * 4 / best)
        return out[0], out[1]
    finally:
        torch.set_num_threads(threads)


def cases(mb: int):
    """(name, specs) of the layouts predicted after calibration."""
    tp4 = rr.Layout(_mesh1(range(N)), (rr.Shard(0),))
    tp4c = rr.Layout(_mesh1(range(N)), (rr.Shard(1),))
    tp2dp2 = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))
    mixed = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("a", "b")), (rr.Shard(0), rr.Shard(1)))
    dp4 = rr.Layout.replicated(range(N))
    rows = 1024
    cols = max(64, (mb << 20) // 4 // 32 // rows)
    return [
        ("TP4 -> TP2xDP2, 32 tensors", _specs(32, rows, cols, tp4, tp2dp2)),
        ("(TP2xTP2) -> TP4 cols, 32 tensors", _specs(32, rows, cols, mixed, tp4c)),
        ("TP4 -> DP4 (replicated), 8 tensors", _specs(8, rows, cols, tp4, dp4)),
        ("TP4 -> TP4 cols, 512 small tensors", _specs(512, 64, 64, tp4, tp4c)),
        ("TP4 -> TP2xDP2, 2 big tensors", _specs(2, rows * 4, cols * 4, tp4, tp2dp2)),
    ]


ROUNDS = 16                 # rounds of the chunked refit (one 16-chunk item per pair)
# The Cluster fields a calibration run fits from its measurements (see `fit`).
FITTED = ("nvlink_Bps", "nic_Bps", "fabric_Bps", "domain_fabric_Bps", "latency_s",
          "ring_latency_s", "refit_overhead_s", "item_s", "tensor_s", "message_s", "copy_Bps",
          "contig_copy_Bps")


def measure(args, src, dst, near) -> dict:
    """The figures the constants are fitted to (see `fit`): median seconds of refits `t_*`,
    rates `*_Bps` in bytes per second, the cores, and the domain refit's bytes, rounds and
    whether its rings copied once (`single_copy`)."""
    bucket = args.bucket_mb << 20
    tp4 = rr.Layout(_mesh1(range(N)), (rr.Shard(0),))
    tp4c = rr.Layout(_mesh1(range(N)), (rr.Shard(1),))
    # each the median of 3x as many runs as the cases' (cheap)
    prim = 3 * args.repeats
    probe = 64 << 20
    m = {"cores": os.cpu_count() or 1}
    with rr.ReshardGroup(src[:1], dst[:1]) as g1:
        m["one_Bps"] = statistics.median(raw_bandwidth(g1, probe) for _ in range(prim)) * 1e9
    with rr.ReshardGroup(src, dst, bucket_bytes=bucket) as g:
        m["fabric_Bps"] = statistics.median(raw_bandwidth(g, probe) for _ in range(prim)) * 1e9
        tiny = _specs(1, N, 4, tp4, tp4)                # one item per rank, one round
        _fill(src, tiny, "src"), _fill(dst, tiny, "dst")
        m["t_round"], _ = _time_refits(g, tiny, prim * 2)
        many = _specs(400, 16, 16, tp4, tp4)            # 400 tensors, 1 item each per pair
        _fill(src, many, "src"), _fill(dst, many, "dst")
        m["t_many"], _ = _time_refits(g, many, prim)
        cross = _specs(400, 16, 16, tp4, tp4c)          # 400 tensors, 4 items each per source
        _fill(src, cross, "src"), _fill(dst, cross, "dst")
        m["t_cross"], _ = _time_refits(g, cross, prim)
        # the same bytes as 64 tensors of items at the per-item threshold (each its own
        # message, in place) or one tensor of one item per pair: 63 more messages per pair
        msg_cols = PER_ITEM_MIN_BYTES // 4
        msgs64 = _specs(64, N, msg_cols, tp4, tp4)
        _fill(src, msgs64, "src"), _fill(dst, msgs64, "dst")
        m["t_msgs64"], _ = _time_refits(g, msgs64, prim)
        msgs1 = _specs(1, N * 64, msg_cols, tp4, tp4)
        _fill(src, msgs1, "src"), _fill(dst, msgs1, "dst")
        m["t_msgs1"], _ = _time_refits(g, msgs1, prim)
    chunked = _specs(1, N * ROUNDS, 1024, tp4, tp4)
    with rr.ReshardGroup(src, dst, bucket_bytes=4096) as g4:
        _fill(src, chunked, "src"), _fill(dst, chunked, "dst")
        m["t_rounds"], _ = _time_refits(g4, chunked, prim * 2)
    with rr.ReshardGroup(near, dst, bucket_bytes=4096) as gr:
        # the same two refits inside one node: the fixed cost of one ring transfer
        _fill(near, tiny, "src"), _fill(dst, tiny, "dst")
        m["t_ring_round"], _ = _time_refits(gr, tiny, prim * 2)
        _fill(near, chunked, "src"), _fill(dst, chunked, "dst")
        m["t_ring_rounds"], _ = _time_refits(gr, chunked, prim * 2)
    m["copy_Bps"], m["contig_copy_Bps"] = copy_rates()
    dom = _specs(8, 1024, max(256, 4 * (args.mb << 20) // 4 // 8 // 1024), tp4, tp4)
    with rr.ReshardGroup(near, dst, bucket_bytes=bucket) as gd:
        _fill(near, dom, "src"), _fill(dst, dom, "dst")
        assert gd.plan(dom).stats.domain_bytes == gd.plan(dom).stats.total_bytes
        m["t_dom"], res = _time_refits(gd, dom, prim)
        m["dom_rounds"] = 1 + max(t.key[0] for t in gd.plan(dom).schedule(bucket).transfers)
        # whether the rings' receivers read the senders' memory themselves (see shm.py)
        m["single_copy"] = sum(p.get("single_copy_bytes", 0) for p in res.per_process) > 0
    m["dom_bytes"] = sum(s.nbytes for s in dom.values())
    return m


def fit(m: dict) -> tuple[dict, dict]:
    """The `local` cluster's constants fitted to `measure`'s figures, {Cluster field: number}
    (the fields of `FITTED`), and its settings, {Cluster field: value}."""
    cores, rounds = m["cores"], ROUNDS
    # all ranks share the cores; an item is handled by its sender and its receiver, a
    # tensor's views are looked up by each of the 8 processes
    item_s = max(0.0, (m["t_cross"] - m["t_many"]) * cores / (400 * 3 * N * 2))
    tensor_s = max(0.0, ((m["t_many"] - m["t_round"]) * cores - 400 * N * 2 * item_s)
                   / (400 * 2 * N))
    message_s = max(0.0, ((m["t_msgs64"] - m["t_msgs1"]) * cores
                          - 63 * 2 * N * (item_s + tensor_s)) / (63 * N * 2))
    per_round_cpu = 2 * N * item_s / cores + 2 * N * tensor_s / cores / rounds
    latency = max(0.0, (m["t_rounds"] - m["t_round"]) / (rounds - 1) - per_round_cpu)
    overhead = max(0.0, m["t_round"] - latency - per_round_cpu)
    ring_latency = max(0.0, (m["t_ring_rounds"] - m["t_ring_round"]) / (rounds - 1)
                       - per_round_cpu)
    # a ring transfer is the receiver's copy straight out of the sender's memory where the
    # kernel allows it, else the sender's copy into the slot and the receiver's copy out of it
    # (contiguous here), on the shared cores, plus the ring's own cost: the domain link
    dom_copies = ((1 if m["single_copy"] else 2) * m["dom_bytes"] / m["contig_copy_Bps"]
                  / cores)
    domain_fabric = m["dom_bytes"] / max(1e-4, m["t_dom"] - m["t_ring_round"] - dom_copies
                                         - (m["dom_rounds"] - 1) * ring_latency)
    constants = {"nvlink_Bps": domain_fabric, "nic_Bps": m["one_Bps"],
                 "fabric_Bps": m["fabric_Bps"], "domain_fabric_Bps": domain_fabric,
                 "latency_s": latency, "ring_latency_s": ring_latency,
                 "refit_overhead_s": overhead, "item_s": item_s, "tensor_s": tensor_s,
                 "message_s": message_s, "copy_Bps": m["copy_Bps"],
                 "contig_copy_Bps": m["contig_copy_Bps"]}
    settings = {"gpus_per_domain": N, "cpu_cores": cores, "broadcast": "flat",
                "per_item_min_bytes": PER_ITEM_MIN_BYTES,
                "single_copy_rings": bool(m["single_copy"])}
    return {k: float(v) for k, v in constants.items()}, settings


def fitted_cluster(constants: dict, settings: dict) -> Cluster:
    """The cluster a calibration run predicts with: `fit`'s constants and settings."""
    missing = [n for n in FITTED if n not in constants]
    if missing:
        raise ValueError(f"constants lack {', '.join(missing)}")
    return Cluster("local (measured now)", **settings, **constants)


def calibrate_once(args, src, dst, near) -> dict:
    """Measure and fit the constants, then refit every case and predict it: one calibration
    run, {"measured", "constants", "settings", "cluster", "rows"}."""
    m = measure(args, src, dst, near)
    constants, settings = fit(m)
    local = fitted_cluster(constants, settings)
    c = constants
    print("constants (measured with primitive transfers, not with the refits below):")
    beyond_round = m['t_dom'] - m['t_ring_round']
    in_node = (f"{m['dom_bytes'] / beyond_round / 1e9:.2f} GB/s" if beyond_round > 0 else
               f"not resolved ({m['t_dom'] * 1e3:.1f} ms, within one ring round's "
               f"{m['t_ring_round'] * 1e3:.1f} ms: too few bytes)")
    print(f"  network one pair {c['nic_Bps'] / 1e9:.2f} GB/s, 4 pairs together "
          f"{c['fabric_Bps'] / 1e9:.2f} GB/s; shared-memory refit in a node {in_node}")
    print(f"  one-item refit {m['t_round'] * 1e3:.1f} ms = overhead "
          f"{c['refit_overhead_s'] * 1e3:.1f} ms + one round; per extra round "
          f"{c['latency_s'] * 1e3:.2f} ms (in a node: {c['ring_latency_s'] * 1e3:.2f} ms); per "
          f"item {c['item_s'] * 1e6:.1f} us and {c['tensor_s'] * 1e6:.1f} us per tensor per "
          f"process of CPU; per message of an item sent as its own "
          f"{c['message_s'] * 1e6:.1f} us per end")
    print(f"  copies on one core: strided {c['copy_Bps'] / 1e9:.2f} GB/s, contiguous "
          f"{c['contig_copy_Bps'] / 1e9:.2f} GB/s; {settings['cpu_cores']} cores; the domain "
          f"link without its copies {c['domain_fabric_Bps'] / 1e9:.2f} GB/s")
    print(f"  -> {local.describe()}\n")
    return {"measured": m, "constants": constants, "settings": settings,
            "cluster": local.describe(), "rows": predict_cases(args, src, dst, local)}


def predict_cases(args, src, dst, local: Cluster) -> list:
    """Refit every case and predict it on `local`: one row per case (see `_row`)."""
    bucket = args.bucket_mb << 20
    print(f"{'case':<40} {'MB':>6} {'items':>6} {'measured s: median [range]':>27} "
          f"{'predicted s':>11} {'pred/meas':>9} {'bound s':>8}   (median of {args.repeats} "
          f"refits after a warm-up; a prediction off by more than {MISS:.0%} is a MISS)")
    rows = []
    for name, specs in cases(args.mb):
        with rr.ReshardGroup(src, dst, bucket_bytes=bucket) as g:
            _fill(src, specs, "src"), _fill(dst, specs, "dst")
            p = g.plan(specs)
            runs, _ = _timed_refits(g, specs, args.repeats)
        sim = simulate(p, local, bucket, "exact")
        items = sum(len(t.items) for t in p.schedule(bucket).transfers)
        rows.append(_row(name, "reshard", runs, sim.predicted_s, p.stats.total_bytes, items,
                         sim.bound_s))
    name, specs = cases(args.mb)[0]
    with rr.ReshardGroup(src, dst, bucket_bytes=bucket, strategy="gather_broadcast") as g:
        _fill(src, specs, "src"), _fill(dst, specs, "dst")
        p = g.plan(specs)
        runs, _ = _timed_refits(g, specs, args.repeats)
    rows.append(_row("gather_broadcast: " + name, "gather_broadcast", runs,
                     gather_broadcast_seconds(p, local, bucket), p.stats.total_bytes, 0,
                     None))
    return rows


CHECK_MISS = 0.15          # --check: a prediction further than this off the measured median


def check_shaped(rates: list, mb: int, count: int, repeats: int, fraction: float,
                 bucket_mb: int = 16, layout_names: Optional[list] = None) -> dict:
    """Inside a box's driver: each layout at each rate, dense and delta, measured (median of
    `repeats` after a warm-up, each run's link bytes counted) beside the `shaped` preset's
    prediction for that rate. Returns {"rows": [...], "summary": {...}}."""
    from ray_reshard.sim.cluster import shaped as shaped_preset
    from ray_reshard.sim.delta import simulate_delta

    from . import shaped

    bucket = bucket_mb << 20
    counted = shaped.Counted()
    names = layout_names or list(shaped.layouts())
    rows = []
    print(f"{'layout':<42} {'rate':>6} {'kind':>6} {'measured s: median [range]':>27} "
          f"{'predicted s':>11} {'pred/meas':>9} {'wire MB':>8} {'pred MB':>8}   (median of "
          f"{repeats} refits after a warm-up; more than {CHECK_MISS:.0%} off is a MISS)",
          flush=True)
    for name in names:
        spec_set = shaped.specs(name, mb, count)
        _, _, _, src_nodes, dst_nodes, _ = shaped.layouts()[name]
        src, dst = shaped.place(src_nodes, dst_nodes)
        shaped.fill(src, dst, spec_set)
        try:
            with rr.ReshardGroup(src, dst, bucket_bytes=bucket) as g:
                plan = g.plan(spec_set)
                for rate in rates:
                    shaped.set_rate(rate)
                    cl = shaped_preset(shaped.rate_Bps(rate))
                    msgs = messages_exact(plan, bucket, cl.per_item_min_bytes)
                    step = iter(range(1 << 30))
                    change = lambda: ray.get([a.change.remote(fraction, next(step))
                                              for a in src])
                    for kind in ("dense", "delta"):
                        runs = shaped.timed_refits(g, spec_set, repeats, counted,
                                                   delta=kind == "delta",
                                                   between=change if kind == "delta" else None)
                        if kind == "dense":
                            pred = simulate(plan, cl, bucket, "exact").predicted_s
                            pred_bytes = plan.stats.network_bytes
                        else:
                            d = simulate_delta(plan, msgs, cl, bucket, fraction)
                            pred, pred_bytes = d["predicted_s"], d["network_bytes"]
                        wire = statistics.median(sum(v[1] for v in w.values())
                                                 for w in runs["wire"])
                        rows.append(_check_row(name, rate, kind, runs["seconds"], pred, wire,
                                               pred_bytes, shaped.busiest_link(
                                                   shaped.link_bytes(plan))
                                               / shaped.rate_Bps(rate)))
        finally:
            for a in src + dst:
                ray.kill(a)
    return {"rows": rows, "summary": check_summary(rows)}


def _check_row(layout, rate, kind, runs, predicted, wire, pred_bytes, bound_s) -> dict:
    med = statistics.median(runs)
    ratio = predicted / med
    row = {"layout": layout, "rate": rate, "kind": kind, "measured_s": runs, "median_s": med,
           "low_s": min(runs), "high_s": max(runs), "predicted_s": predicted, "ratio": ratio,
           "miss": abs(ratio - 1) > CHECK_MISS, "wire_bytes": wire,
           "predicted_network_bytes": pred_bytes, "link_bound_s": bound_s}
    spread = f"{med:.3f} [{min(runs):.3f}-{max(runs):.3f}]"
    print(f"{layout:<42} {rate:>6} {kind:>6} {spread:>27} {predicted:>11.3f} {ratio:>9.2f} "
          f"{wire / 1e6:>8.1f} {pred_bytes / 1e6:>8.1f}{'   MISS' if row['miss'] else ''}",
          flush=True)
    return row


def check_summary(rows: list) -> dict:
    """How the predictions did: misses, and the bias (median and mean of predicted /
    measured - 1) over all rows and per kind and rate."""
    def stats(rs):
        devs = [r["ratio"] - 1 for r in rs]
        return {"cases": len(rs), "misses": sum(r["miss"] for r in rs),
                "bias_median": statistics.median(devs), "bias_mean": statistics.fmean(devs),
                "worst": max(devs, key=abs)}
    out = {"all": stats(rows)}
    for key in ("kind", "rate"):
        for v in dict.fromkeys(r[key] for r in rows):
            out[f"{key}={v}"] = stats([r for r in rows if r[key] == v])
    out["missed"] = [f"{r['layout']} {r['rate']} {r['kind']}" for r in rows if r["miss"]]
    return out


def check_main(args, ap) -> int:
    from ray_reshard.tools.netns_cluster import rate_bytes_per_s, unavailable

    from .shaped import layouts, run_in_box

    rates = [r.strip().lower() for r in args.rates.split(",") if r.strip()]
    try:
        if not rates:
            raise ValueError("no rate given")
        for r in rates:
            rate_bytes_per_s(r)
    except ValueError as e:
        ap.error(f"--rates: {e}")
    if not 0 < args.fraction < 1:
        ap.error(f"--fraction must be between 0 and 1, got {args.fraction}")
    names = list(layouts())
    picked = names
    if args.layouts:
        try:
            picked = [names[int(i)] for i in args.layouts.split(",")]
        except (ValueError, IndexError):
            ap.error(f"--layouts: expected indices 0-{len(names) - 1}, got {args.layouts!r}")
    why = unavailable()
    if why:
        ap.error(f"--check needs a cluster in a box: {why}")
    from .harness import machine_facts
    machine = machine_facts()
    out = run_in_box("ray_reshard.tools.bench.sim_calibrate:check_shaped",
                     {"rates": rates, "mb": args.mb, "count": args.count,
                      "repeats": args.repeats, "fraction": args.fraction,
                      "bucket_mb": args.bucket_mb, "layout_names": picked},
                     nodes=3, rate=rates[0])
    sm = out["summary"]
    print(f"\n{sm['all']['cases'] - sm['all']['misses']} of {sm['all']['cases']} predictions "
          f"within {CHECK_MISS:.0%} of the measured medians; bias (predicted / measured - 1): "
          f"median {sm['all']['bias_median']:+.1%}, mean {sm['all']['bias_mean']:+.1%}, worst "
          f"{sm['all']['worst']:+.1%}")
    for k, v in sm.items():
        if k not in ("all", "missed"):
            print(f"  {k:<14} median {v['bias_median']:+.1%}, mean {v['bias_mean']:+.1%}, "
                  f"{v['misses']} of {v['cases']} missed")
    if sm["missed"]:
        print("MISSES: " + "; ".join(sm["missed"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"check": True, "rates": rates, "mb": args.mb, "count": args.count,
                       "repeats": args.repeats, "fraction": args.fraction,
                       "machine": machine, **out}, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="ray_reshard.tools.bench.sim_calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64, help="megabytes of weights per case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3,
                    help="whole calibration runs (constants and cases), summarized by median")
    ap.add_argument("--check", action="store_true",
                    help="fit nothing: compare the shaped preset's predictions with refits on a "
                         "cluster in a box (needs root, ip and tc)")
    ap.add_argument("--rates", default="1gbit,2gbit", help="--check: link rates (tc syntax)")
    ap.add_argument("--count", type=int, default=32, help="--check: tensors per layout")
    ap.add_argument("--layouts", help="--check: comma-separated indices into the layouts "
                                      "(default: all 8; see bench/shaped.py)")
    ap.add_argument("--fraction", type=float, default=0.1,
                    help="--check: share of the elements changed between delta refits")
    ap.add_argument("--json", metavar="PATH", type=output_file,
                    help="also write the figures as JSON; its \"constants\" (the median over "
                         "the runs) and \"settings\" are the local preset's Cluster fields")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.repeats < 1 or args.mb < 1 or args.count < 1:
        ap.error("--runs, --repeats, --mb and --count must be positive")
    if args.check:
        return check_main(args, ap)
    with local_cluster(2):
        src, dst = holders(N, 0), holders(N, 1)
        near = holders(N, 1)                         # beside the destinations: same domain
        per_run = []
        for k in range(args.runs):
            print(f"\n=== calibration run {k + 1} of {args.runs}")
            per_run.append(calibrate_once(args, src, dst, near))
    summary = summarize(per_run)
    ours = [r for r in summary if r["strategy"] == "reshard"]
    misses = [r["case"] for r in summary if r["miss"]]
    worst = max(abs(r["ratio"] - 1) for r in ours)
    print(f"\npredicted / measured over {args.runs} calibration runs (each its own constants; "
          f"median [range]; a median more than {MISS:.0%} off is a MISS):")
    for r in summary:
        print(f"  {r['case']:<46} {r['ratio']:.2f} [{r['low']:.2f}-{r['high']:.2f}]"
              f"{'   MISS' if r['miss'] else ''}")
    print(f"\nreshard predictions: {len(ours) - sum(r['miss'] for r in ours)} of {len(ours)} "
          f"within {MISS:.0%} of the measured times (median over runs), worst off by "
          f"{100 * worst:.0f}%" + (f"; MISSES: {', '.join(misses)}" if misses else ""))
    out = {"repeats": args.repeats, "runs": args.runs, "mb": args.mb, **over_runs(per_run),
           "per_run": per_run, "summary": summary, "worst": worst, "misses": misses}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def over_runs(per_run: list) -> dict:
    """What to refresh the `local` preset from: {"constants": {Cluster field: its median over
    the runs}, "settings": {Cluster field: its value, or the runs' values where they
    differ}}."""
    constants = {n: statistics.median(run["constants"][n] for run in per_run) for n in FITTED}
    settings = {}
    for n in per_run[0]["settings"]:
        values = [run["settings"][n] for run in per_run]
        settings[n] = values[0] if all(v == values[0] for v in values) else values
    return {"constants": constants, "settings": settings}


def summarize(per_run: list) -> list:
    """Per case: the median and range over the runs of predicted / measured."""
    out = []
    for i, row in enumerate(per_run[0]["rows"]):
        ratios = [run["rows"][i]["ratio"] for run in per_run]
        med = statistics.median(ratios)
        out.append({"case": row["case"], "strategy": row["strategy"], "ratio": med,
                    "low": min(ratios), "high": max(ratios), "ratios": ratios,
                    "miss": abs(med - 1) > MISS})
    return out


MISS = 0.25        # a prediction further than this from the measured median is a miss


def _row(case: str, strategy: str, runs: list, predicted: float, nbytes: int, items: int,
         bound) -> dict:
    """One case's figures, printed as it is measured."""
    med = statistics.median(runs)
    ratio = predicted / med
    row = {"case": case, "strategy": strategy, "measured_s": runs, "median_s": med,
           "low_s": min(runs), "high_s": max(runs), "predicted_s": predicted, "ratio": ratio,
           "miss": abs(ratio - 1) > MISS, "mb": nbytes / 1e6, "items": items, "bound_s": bound}
    spread = f"{med:.3f} [{min(runs):.3f}-{max(runs):.3f}]"
    print(f"{case:<40} {nbytes / 1e6:>6.1f} {items or '':>6} {spread:>27} {predicted:>11.3f} "
          f"{ratio:>9.2f} {'' if bound is None else f'{bound:.3f}':>8}"
          f"{'   MISS' if row['miss'] else ''}", flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
