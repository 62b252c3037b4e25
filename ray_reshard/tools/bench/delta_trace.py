"""Delta refits vs dense refits of the same weights on the same actors, along an RL-like
training trace or at synthetic changed fractions; and the delta codec alone.

    ray-reshard bench-delta [--mb 256] [--steps 5] [--lr 1e-6]          # training trace
    ray-reshard bench-delta --synthetic 0,0.001,0.1,0.5,1.0 [--repeats 5]
    ray-reshard bench-delta --codec                                     # the codec, one thread
    ray-reshard bench-delta --small                                     # a few MiB, seconds

Method: docs/delta.md (Benchmark).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch

from ..cli_args import Parser, fraction_arg, number_in, output_file, positive_int
from .delta_codec import codec_rates, codec_table, render_codec
from .harness import (SETTLE_LIMIT_S, MiB, Spread, machine_facts, settle,
                      store_bytes_for)
from .trace_model import ModelConfig, Synthetic, Trainer, changed_share, config_for, digest, region

GOAL_BYTES_AT_10 = 0.25      # delta network bytes at most this share of dense, 10% changed
GOAL_TIME_AT_0 = 0.6         # delta refit time at most this share of dense, nothing changed
GOAL_TIME_AT_10 = 1.0        # delta refit time at most this share of dense, 10% changed
GOAL_TIME_AT_100 = 1.05      # delta refit time at most this share of dense, 100% changed
GOAL_TIME_TRACE = 0.9        # delta refit time at most this share of dense, along the trace
GOAL_SHAPED_AT_10 = 0.2      # on 1 Gbit/s links (--shaped): 10% changed
GOAL_SHAPED_TRACE = 0.15     # ... and along the trace
SMALL_MB = 4


# ---------------------------------------------------------------- the actors
def _shards_class():
    import ray

    @ray.remote(num_cpus=0)
    class Shards:
        """Holds named tensors, twice on a destination (one set per group: the delta group
        writes `t`, the dense group `dense`); loads new values in place; digests them."""

        def __init__(self):
            self.t, self.dense = {}, {}

        def make(self, shapes: dict, both: bool = False):
            self.t = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
            self.dense = ({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
                          if both else self.t)

        def load(self, tensors: dict):
            for n, v in tensors.items():
                self.t[n].copy_(v)

        def reshard_tensors(self):
            return self.t

        def digest(self, names: list, dense: bool = False) -> str:
            return digest([(self.dense if dense else self.t)[n] for n in names])

    return Shards


def dense_tensors(actor) -> dict:
    """What the dense group reads and writes in a `Shards` actor."""
    return actor.dense


# ---------------------------------------------------------------- the run
def measure(mode: str, cfg: ModelConfig, steps: int, lr: float, fractions: list, repeats: int,
            bucket_mb: int = 16, baseline: str = "device", log=print,
            in_box: bool = False) -> dict:
    """Run the trace (`mode` "trace": `steps` training steps) or the synthetic sweep (`mode`
    "synthetic": `repeats` steps at each of `fractions`); returns every step's figures.
    `in_box`: run on the cluster in a box this driver runs in (`netns_cluster`), each timed
    refit's bytes on its links counted by the kernel."""
    import contextlib

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard
    from ray_reshard.tools.testing import local_cluster

    weights_bytes = cfg.params * 2
    src_l = rr.Layout(rr.Mesh([0, 1, 2, 3]), (Shard(0),))
    dst_l = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (Replicate(), Shard(0)))
    out = {"mode": mode, "config": asdict(cfg), "weights_bytes": weights_bytes,
           "bucket_mb": bucket_mb, "delta_baseline": baseline,
           "layout": "TP4 (4 actors, node 0) -> TP2 x DP2 (4 actors, node 1), bf16",
           "machine": machine_facts(), "steps": []}
    if mode == "trace":
        out["lr"] = lr
        source = Trainer(cfg, lr)
    else:
        source = Synthetic(cfg)
    out["codec"] = codec_rates()
    log(render_codec([out["codec"]]))
    weights = source.weights()
    specs = {n: rr.TensorSpec(tuple(t.shape), torch.bfloat16, src_l, dst_l)
             for n, t in weights.items()}
    counted = None
    if in_box:
        from .shaped import Counted
        counted = Counted()
        out["links"] = {"rate": counted.links.spec.rate, "mtu": counted.links.spec.mtu}
    with (contextlib.nullcontext() if in_box else
          local_cluster(2, store_bytes=store_bytes_for(weights_bytes))):
        run = TwoGroups(specs, bucket_mb * MiB, baseline, counted)
        try:
            log(f"{out['layout']}; {cfg.layers} layers of d_model {cfg.d_model}, "
                f"{len(specs)} tensors, {weights_bytes / MiB:.1f} MiB of bf16 weights; "
                f"{bucket_mb} MiB buckets, delta baselines in {baseline} memory; each group "
                f"writes its own destination tensors in the same actors")
            first = run.warm_up(weights)
            out["warm_up_fallbacks"] = list(first.delta["fallbacks"]) if first.delta else []
            log(f"warm-up: the delta group's first refit travelled dense "
                f"({len(out['warm_up_fallbacks'])} sender -> receiver pairs without a "
                f"baseline)")
            out["lower_bound_bytes"] = first.plan_stats.min_network_bytes
            log(header())
            schedule = ([(None, i) for i in range(steps)] if mode == "trace" else
                        [(f, i) for f in fractions for i in range(repeats)])
            previous = {n: t.clone() for n, t in weights.items()}
            for k, (fraction, _) in enumerate(schedule):
                row = run.step(source, k, fraction, previous)
                out["steps"].append(row)
                log(render_step(row), flush=True)
            out["settle"] = {"runs": len(run.waits), "waited_s": round(sum(run.waits), 2),
                             "limit_s": SETTLE_LIMIT_S,
                             "at_limit": sum(w >= SETTLE_LIMIT_S for w in run.waits)}
        finally:
            run.close()
    out["summary"] = summarise(out["steps"], mode)
    out["goals"] = goals(out["summary"], shaped=in_box)
    return out


class TwoGroups:
    """The run's actors and its two groups over them: one only ever refits delta, the other only
    dense (into a second set of destination tensors); ships weights, times refits, checks every
    destination bit for bit."""

    def __init__(self, specs: dict, bucket: int, baseline: str, counted=None):
        import ray

        import ray_reshard as rr

        self.specs, self.counted, self.names = specs, counted, list(specs)
        self.waits: list = []
        Shards = _shards_class()
        self.src = [Shards.options(resources={"node0": 1}).remote() for _ in range(4)]
        self.dst = [Shards.options(resources={"node1": 1}).remote() for _ in range(4)]
        self.boxes = {side: [{n: s.layout(side).box(r, s.shape) for n, s in specs.items()}
                             for r in range(4)] for side in ("src", "dst")}
        ray.get([a.make.remote({n: tuple(b.sizes) for n, b in self.boxes["src"][r].items()})
                 for r, a in enumerate(self.src)])
        ray.get([a.make.remote({n: tuple(b.sizes) for n, b in self.boxes["dst"][r].items()},
                               True) for r, a in enumerate(self.dst)])
        self.delta_group = rr.ReshardGroup(self.src, self.dst, bucket_bytes=bucket,
                                           delta_baseline=baseline)
        self.dense_group = rr.ReshardGroup(self.src, self.dst, bucket_bytes=bucket,
                                           tensors=dense_tensors)

    def close(self) -> None:
        self.delta_group.close()
        self.dense_group.close()

    def ship(self, w: dict) -> None:
        """The new weights' shards into the source actors (not timed)."""
        import ray

        ray.get([a.load.remote({n: region(w[n], self.boxes["src"][r][n]).clone()
                                for n in self.names}) for r, a in enumerate(self.src)])

    def verify(self, w: dict, what: str, dense: bool = False) -> None:
        """Every destination of one group holds `w`'s bytes exactly, or RuntimeError."""
        import ray

        want = {}
        refs = [a.digest.remote(self.names, dense) for a in self.dst]
        for r in range(4):
            key = tuple(tuple(self.boxes["dst"][r][n].offsets) for n in self.names)
            if key not in want:
                want[key] = digest([region(w[n], self.boxes["dst"][r][n]) for n in self.names])
            if ray.get(refs[r]) != want[key]:
                raise RuntimeError(f"{what}: destination {r} does not hold the trainer's bf16 "
                                   f"weights bit for bit")

    def timed(self, group, **kw):
        """(result, seconds, bytes out of every node's link or None) of one refit, once the
        work the last run left has ended."""
        self.waits.append(settle())
        got = []

        def run():
            t0 = time.perf_counter()
            got.append(group.refit(self.specs, **kw))
            return time.perf_counter() - t0
        if self.counted is None:
            secs = run()
            return got[0], secs, None
        secs, wire = self.counted(run)
        return got[0], secs, sum(sent for sent, _ in wire.values())

    def warm_up(self, weights: dict):
        """Both groups refit the initial weights (the delta group's first refit travels dense:
        it has no baseline); returns the delta group's result."""
        self.ship(weights)
        first, _, _ = self.timed(self.delta_group, delta=True)
        self.verify(weights, "warm-up delta refit")
        self.timed(self.dense_group)
        self.verify(weights, "warm-up dense refit", dense=True)
        return first

    def step(self, source, k: int, fraction, previous: dict) -> dict:
        """One step: the source's new weights shipped, both groups' refits timed (the order
        alternating step by step, so neither always runs first) and checked; its figures."""
        if fraction is not None:
            source.fraction = fraction
        t0 = time.perf_counter()
        loss = source.step()
        step_s = time.perf_counter() - t0
        weights = source.weights()
        share = changed_share(weights, previous)
        for n, t in weights.items():
            previous[n].copy_(t)
        self.ship(weights)
        delta_first = k % 2 == 0
        if not delta_first:
            n_res, n_s, n_wire = self.timed(self.dense_group)
        d_res, d_s, d_wire = self.timed(self.delta_group, delta=True)
        if delta_first:
            n_res, n_s, n_wire = self.timed(self.dense_group)
        self.verify(weights, f"step {k + 1} delta refit")
        self.verify(weights, f"step {k + 1} dense refit", dense=True)
        row = {"step": k + 1, "fraction": fraction, "changed": share,
               "loss": loss, "step_s": step_s, "first": "delta" if delta_first else "dense",
               "delta_s": d_s, "dense_s": n_s,
               "delta_network_bytes": d_res.bytes_by_path["network"],
               "dense_network_bytes": n_res.bytes_by_path["network"],
               "lower_bound_bytes": n_res.plan_stats.min_network_bytes,
               "delta": d_res.delta, "verified": True}
        if self.counted is not None:        # what the links carried, as the kernel counts
            row["delta_wire_bytes"], row["dense_wire_bytes"] = d_wire, n_wire
        return row


def measure_in_box(**kwargs) -> dict:
    """`measure` in the driver of a cluster in a box (`bench.shaped.run_in_box`), JSON out."""
    kwargs["cfg"] = ModelConfig(**kwargs["cfg"])
    return json.loads(json.dumps(measure(**kwargs, in_box=True), default=str))


def header() -> str:
    return (f"{'step':>4} {'changed':>9} {'delta MiB':>10} {'dense MiB':>10} {'bound MiB':>10} "
            f"{'bytes':>6} {'delta s':>8} {'dense s':>8} {'time':>6}  "
            f"encodings same/mask/index/dense  checked")


def render_step(row: dict) -> str:
    enc = row["delta"]["encodings"] if row["delta"] else {}
    return (f"{row['step']:>4} {row['changed']:>9.5f} {row['delta_network_bytes'] / MiB:>10.2f} "
            f"{row['dense_network_bytes'] / MiB:>10.2f} {row['lower_bound_bytes'] / MiB:>10.2f} "
            f"{row['delta_network_bytes'] / max(row['dense_network_bytes'], 1):>5.3f}x "
            f"{row['delta_s']:>8.3f} {row['dense_s']:>8.3f} "
            f"{row['delta_s'] / row['dense_s']:>5.2f}x  "
            f"{'/'.join(str(enc.get(k, 0)) for k in ('same', 'mask', 'index', 'dense')):>31}"
            f"  {'bit-identical' if row['verified'] else 'NO'}"
            + (f"  wire MiB {row['delta_wire_bytes'] / MiB:.2f} / "
               f"{row['dense_wire_bytes'] / MiB:.2f}" if "delta_wire_bytes" in row else ""))


def summarise(steps: list, mode: str) -> list:
    """Medians and ranges per synthetic fraction (or over the whole trace)."""
    groups: dict = {}
    for row in steps:
        groups.setdefault(row["fraction"] if mode == "synthetic" else "trace", []).append(row)
    out = []
    for key, rows in groups.items():
        out.append({
            "fraction": key, "steps": len(rows),
            "changed": Spread([r["changed"] for r in rows]).as_dict(),
            "delta_network_bytes": Spread([r["delta_network_bytes"] for r in rows]).as_dict(),
            "dense_network_bytes": Spread([r["dense_network_bytes"] for r in rows]).as_dict(),
            "delta_s": Spread([r["delta_s"] for r in rows]).as_dict(),
            "dense_s": Spread([r["dense_s"] for r in rows]).as_dict()})
        if "delta_wire_bytes" in rows[0]:
            for k in ("delta_wire_bytes", "dense_wire_bytes"):
                out[-1][k] = Spread([r[k] for r in rows]).as_dict()
    return out


def render_summary(summary: list) -> str:
    lines = [f"{'changed':>10} {'steps':>5} {'delta MiB: median [range]':>28} "
             f"{'dense MiB':>10} {'bytes':>6} {'delta s: median [range]':>26} "
             f"{'dense s: median [range]':>26} {'time':>6}"]
    for s in summary:
        label = "trace" if s["fraction"] == "trace" else f"{s['fraction']:g}"
        d, n = Spread(s["delta_network_bytes"]["values"]), s["dense_network_bytes"]["median"]
        ds, ns = Spread(s["delta_s"]["values"]), Spread(s["dense_s"]["values"])
        lines.append(f"{label:>10} {s['steps']:>5} {d.text(MiB, 2):>28} {n / MiB:>10.2f} "
                     f"{d.median / max(n, 1):>5.3f}x {ds.text():>26} {ns.text():>26} "
                     f"{ds.median / ns.median:>5.2f}x")
        if "delta_wire_bytes" in s:
            dw, nw = s["delta_wire_bytes"]["median"], s["dense_wire_bytes"]["median"]
            lines.append(f"{'':>10} {'':>5} bytes out of the nodes' links (kernel counters): "
                         f"delta {dw / MiB:.2f} MiB, dense {nw / MiB:.2f} MiB "
                         f"({dw / max(nw, 1):.3f}x)")
    return "\n".join(lines)


def goals(summary: list, shaped: bool = False) -> list:
    """The goals, from the medians: time at 0%, 10% and 100% changed and bytes at 10% (a
    synthetic run), time along the trace (a trace run); on shaped links (`shaped`) the time at
    10% changed and along the trace; the others listed as not measured."""
    by = {s["fraction"]: s for s in summary}
    ratio = lambda s, what: s[f"delta_{what}"]["median"] / s[f"dense_{what}"]["median"]
    rows = []
    table = ((0.1, "s", GOAL_SHAPED_AT_10, "delta refit time <= %g x dense, 10%% changed"),
             ("trace", "s", GOAL_SHAPED_TRACE, "delta refit time <= %g x dense, RL trace")) \
        if shaped else (
            (0.0, "s", GOAL_TIME_AT_0, "delta refit time <= %g x dense, nothing changed"),
            (0.1, "network_bytes", GOAL_BYTES_AT_10,
             "delta network bytes <= %g x dense, 10%% changed"),
            (0.1, "s", GOAL_TIME_AT_10, "delta refit time <= %g x dense, 10%% changed"),
            (1.0, "s", GOAL_TIME_AT_100, "delta refit time <= %g x dense, 100%% changed"),
            ("trace", "s", GOAL_TIME_TRACE, "delta refit time <= %g x dense, RL trace"))
    for fraction, what, limit, text in table:
        s = by.get(fraction)
        measured = ratio(s, what) if s else None
        rows.append({"goal": text % limit, "measured": measured, "limit": limit,
                     "met": measured is not None and measured <= limit,
                     "needs": "the trace (no --synthetic)" if fraction == "trace" else
                     f"--synthetic with {fraction:g}"})
    return rows


def combine_runs(outs: list) -> dict:
    """Several runs' figures (each `measure` on a fresh cluster) as one: every run kept, and
    each goal judged on the median over the runs of its ratio, with the lowest and highest run
    and in how many runs it was met."""
    if len(outs) == 1:
        return dict(outs[0], runs=1)
    out = {"runs": len(outs), "by_run": outs, "mode": outs[0]["mode"],
           "machines": [o["machine"] for o in outs], "goals": []}
    for i, g in enumerate(outs[0]["goals"]):
        values = [o["goals"][i]["measured"] for o in outs]
        if any(v is None for v in values):
            out["goals"].append(dict(g))
            continue
        out["goals"].append(dict(g, **Spread(values).judged(lambda v: v <= g["limit"])))
    return out


def render_goals(rows: list) -> str:
    runs = max((g.get("runs", 1) for g in rows), default=1)
    lines = ["goals (ratios of medians" + (f"; median over {runs} runs [lowest-highest run])"
                                           if runs > 1 else "):")]
    for g in rows:
        if g["measured"] is None:
            m = f"not measured (needs {g['needs']})"
        else:
            m = f"{g['measured']:6.3f}" + (f" [{g['low']:.3f}-{g['high']:.3f}]"
                                           if g.get("runs", 1) > 1 else "")
            m += f"  {'met' if g['met'] else 'NOT met'}"
            if g.get("runs", 1) > 1:
                m += f" ({g['runs_met']} of {g['runs']} runs)"
        lines.append(f"  {g['goal']:<50} {m}")
    return "\n".join(lines)


def fractions_arg(text: str) -> list:
    """Comma-separated fractions in [0, 1]."""
    try:
        out = [fraction_arg(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        out = []
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions in [0, 1], "
                                         f"got {text!r}")
    return out


def lr_arg(text: str) -> float:
    return number_in(text, lambda v: 0 < v < 1, "a learning rate in (0, 1)")


def add_args(ap) -> None:
    ap.add_argument("--mb", type=positive_int, default=256,
                    help="MiB of bf16 weights (default 256; --small: %d)" % SMALL_MB)
    ap.add_argument("--steps", type=positive_int, default=5,
                    help="training steps of the trace (default 5; --small: 2)")
    ap.add_argument("--lr", type=lr_arg, default=1e-6,
                    help="Adam's learning rate (default 1e-6; RL runs use 1e-6 to 1e-5)")
    ap.add_argument("--synthetic", type=fractions_arg, metavar="F,F,...",
                    help="instead of training, flip that share of the elements per step, e.g. "
                         "0,0.001,0.1,0.5,1.0 (the goals need 0, 0.1 and 1.0)")
    ap.add_argument("--repeats", type=positive_int, default=5,
                    help="steps per synthetic fraction (default 5; --small: 2)")
    ap.add_argument("--bucket-mb", type=positive_int, default=16, help="bucket size (default 16)")
    ap.add_argument("--baseline", choices=("device", "host"), default="device",
                    help="where senders keep their delta baseline (default device)")
    ap.add_argument("--runs", type=positive_int, default=1,
                    help="whole measurements, each on a fresh cluster; each goal is then judged "
                         "on the median over the runs, with the lowest and highest run")
    ap.add_argument("--small", action="store_true",
                    help="a few MiB and 2 steps (repeats): seconds, for tests")
    ap.add_argument("--shaped", metavar="RATE",
                    help="run on a cluster in a box instead (2 Ray nodes in network namespaces, "
                         "each link shaped to RATE both ways, e.g. 1gbit; needs root, ip, tc): "
                         "the links' bytes counted by the kernel, the shaped-link goals judged")
    ap.add_argument("--codec", action="store_true",
                    help="only the codec on one thread (no cluster): GB/s encoded and decoded "
                         "at 0, 0.1%%, 1%%, 10%% and 100%% changed, medians of 9 (or --repeats, if "
                         "more)")
    ap.add_argument("--json", metavar="PATH", type=output_file,
                    help="also write every figure as JSON")


def run(args) -> int:
    mb, steps, repeats, bucket_mb = args.mb, args.steps, args.repeats, args.bucket_mb
    if args.codec:
        rows = codec_table(repeats=max(repeats, 9) if not args.small else 3,
                           nbytes=(1 if args.small else 16) * MiB)
        print(render_codec(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"codec": rows, "machine": machine_facts()}, f, indent=1,
                          default=str)
        return 0
    if args.small:
        mb, steps, repeats, bucket_mb = SMALL_MB, 2, 2, 1
    cfg = config_for(mb)
    mode = "synthetic" if args.synthetic else "trace"
    if args.shaped and args.runs != 1:
        print("ray-reshard bench-delta: error: --runs: a shaped run measures one box (give "
              "--runs 1)", file=sys.stderr)
        return 2
    outs = []
    for k in range(args.runs):
        if args.runs > 1:
            print(f"\n== run {k + 1} of {args.runs}, on a fresh cluster", flush=True)
        if args.shaped:
            from .shaped import run_in_box
            one = run_in_box("ray_reshard.tools.bench.delta_trace:measure_in_box",
                             dict(mode=mode, cfg=asdict(cfg), steps=steps, lr=args.lr,
                                  fractions=args.synthetic or [], repeats=repeats,
                                  bucket_mb=bucket_mb, baseline=args.baseline),
                             nodes=2, rate=args.shaped,
                             store_bytes=store_bytes_for(cfg.params * 2), log=print)
        else:
            one = measure(mode, cfg, steps, args.lr, args.synthetic or [], repeats, bucket_mb,
                          args.baseline, log=print)
        print()
        print(("median [range] per fraction:" if mode == "synthetic" else
               f"median [range] over the {steps} steps of the trace (lr {args.lr:g}):"))
        print(render_summary(one["summary"]))
        st = one["settle"]
        print(f"quiet-machine wait before each timed refit: {st['waited_s']:.1f} s in all over "
              f"{st['runs']} refits ({st['at_limit']} gave up after {st['limit_s']:g} s); load "
              f"average at the start {one['machine']['load_avg_1m']}")
        if args.runs > 1:
            print(render_goals(one["goals"]))
        outs.append(one)
    out = combine_runs(outs)
    if args.runs > 1:
        print(f"\nover the {args.runs} runs:")
    print(render_goals(out["goals"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    ap = Parser(prog="python -m ray_reshard.tools.bench.delta_trace",
                description=__doc__.splitlines()[0])
    add_args(ap)
    raise SystemExit(run(ap.parse_args()))
