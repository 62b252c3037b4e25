"""ray-reshard: plan, simulate and run refits between differently sharded layouts.

    ray-reshard plan --model deepseek-v3 --train megatron:pp=16,ep=16 --infer vllm:tp=32,dp=8
    ray-reshard simulate --model llama70b --train megatron:tp=8,pp=4 --infer vllm:tp=8,dp=4
    ray-reshard demo

Every command takes --help. A wrong argument prints one line and exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time

from .cli_args import (Parser, add_refit_args, build_refit, describe, fraction_arg, output_dir,
                       positive_int, progress, require_module, say)
from ..planning.plan import DEFAULT_BUCKET_BYTES

# subcommand -> (module, help); each module has add_args(parser) and run(args) -> int.
BENCHES = {
    "bench": ("ray_reshard.tools.bench.refit_bench",
              "reshard vs gather-broadcast vs raw bandwidth on local CPU actors"),
    "model-bytes": ("ray_reshard.tools.bench.model_bytes",
                    "bytes of real-size models between their usual layouts (no transfer)"),
    "plan-scale": ("ray_reshard.tools.bench.plan_scale", "time planning a DeepSeek-V3-sized refit"),
    "soak": ("ray_reshard.tools.bench.soak", "hundreds of refits on one group, watching for drift"),
    "rebuild": ("ray_reshard.tools.bench.rebuild", "update() vs a new group after a membership change"),
    "bench-faults": ("ray_reshard.tools.bench.faults", "seconds from each kind of fault to RefitError"),
    "bench-overlap": ("ray_reshard.tools.bench.overlap",
                      "trainer idle time per step: blocking vs overlapped refits"),
    "bench-fp8": ("ray_reshard.tools.bench.fp8",
                  "block-FP8 refits: bytes vs BF16, quantisation throughput, bit-exactness"),
    "bench-delta": ("ray_reshard.tools.bench.delta_trace",
                    "delta vs dense refits along an RL-like training trace (or synthetic "
                    "changed fractions) on the same actors"),
}


# subcommand -> (module, help, how to call it with the remaining arguments): benchmarks that
# parse their own arguments.
OWN_PARSERS = {
    "bench-replay": ("ray_reshard.tools.bench.scale",
                     "the busiest ranks' compiled programs through the executor at model scale",
                     lambda m, rest: m.main(rest, "replay")),
    "bench-first-refit": ("ray_reshard.tools.bench.scale",
                          "driver and per-actor set-up of a first refit at 256-1024 ranks",
                          lambda m, rest: m.main(rest, "first-refit")),
    "bench-peers": ("ray_reshard.tools.bench.peers",
                    "reshard vs object store, Ray Direct Transport, gather-broadcast and raw "
                    "point-to-point on the same local actors",
                    lambda m, rest: m.main(rest)),
    "bench-object-store": ("ray_reshard.tools.bench.peers",
                           "the same run as bench-peers (the object store sized, spills checked)",
                           lambda m, rest: m.main(rest)),
    "bench-partial": ("ray_reshard.tools.bench.partial",
                      "a refit of a subset of the names vs the whole model, side by side",
                      lambda m, rest: m.main(rest)),
    "bench-groups": ("ray_reshard.tools.bench.groups",
                     "prefill and decode groups in one refit vs one refit per group",
                     lambda m, rest: m.main(rest)),
    "bench-vllm": ("ray_reshard.tools.bench.vllm_refit",
                   "a live vLLM engine refit: ray-reshard vs gather on rank 0 + collective_rpc",
                   lambda m, rest: m.main(rest)),
    "bench-ring-wakeup": ("ray_reshard.tools.bench.ring_wakeup",
                          "shared-memory ring wake-up latency: futex vs sleeping",
                          lambda m, rest: m.main(rest)),
}


# Plans of at least this many tensors announce themselves on stderr (they take seconds).
LARGE_PLAN_TENSORS = 2000


def parser() -> Parser:
    from .. import __version__

    ap = Parser(prog="ray-reshard", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"ray-reshard {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser, metavar="command",
                            title="commands")
    p = sub.add_parser("plan", help="traffic report of a model's refit between two layouts",
                       description="What a refit moves: bytes by path vs the lower bound vs "
                                   "gather-broadcast, busiest ranks, buckets, staging.")
    add_refit_args(p)
    p.add_argument("--bucket-mb", type=positive_int, default=DEFAULT_BUCKET_BYTES >> 20,
                   help=f"bucket size (default {DEFAULT_BUCKET_BYTES >> 20})")
    p.add_argument("--png", metavar="DIR",
                   help="write tilings.png (one parameter) and domains.png (traffic heat map) "
                        "into DIR, created if missing (needs the viz extra)")
    p.add_argument("--param", help="the parameter tilings.png draws (default: a telling one)")
    p.add_argument("--changed-fraction", type=fraction_arg, metavar="F",
                   help="also predict a delta refit's network bytes when this fraction of the "
                        "elements changed since the previous one (e.g. 0.1)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    d = sub.add_parser("demo", help="refit a small MoE model between Megatron and vLLM layouts "
                                    "on a local CPU Ray cluster")
    d.add_argument("--scale", type=positive_int, default=1, help="multiply the number of layers")
    d.add_argument("--repeats", type=positive_int, default=3, help="timed refits per strategy")
    for name, (module, text) in BENCHES.items():
        b = sub.add_parser(name, help=text, description=text)
        importlib.import_module(module).add_args(b)
    for name, (_, text, _) in OWN_PARSERS.items():
        sub.add_parser(name, help=text, add_help=False)
    if _has_simulator():
        sub.add_parser("simulate", help="predict a refit's time on a described cluster "
                                        "(same --model/--train/--infer as plan)", add_help=False)
    ap.plan_parser = p        # its errors name "ray-reshard plan"
    return ap


def _has_simulator() -> bool:
    return importlib.util.find_spec("ray_reshard.sim") is not None


def plan_command(args, ap) -> int:
    from .plan_report import delta_prediction, render, render_delta, traffic

    if args.png:      # before planning: a long plan should not end in a wrong path
        try:
            require_module("matplotlib", "viz", "--png")
            output_dir(args.png)
        except argparse.ArgumentTypeError as e:
            ap.error(f"argument --png: {e}")
    t0 = time.perf_counter()
    refit = build_refit(args, ap)
    t1 = time.perf_counter()
    if len(refit.specs) >= LARGE_PLAN_TENSORS:
        say(f"planning {refit.title}: {len(refit.specs):,} tensors, {refit.train.world} -> "
            f"{refit.infer.world} ranks (large models take seconds to a minute)...")
    try:
        plan = refit.plan()
    except ValueError as e:          # e.g. FP8 blocks cut by the inference layout
        ap.error(f"--infer/--train: {str(e).splitlines()[0]}")
    _ = plan.stats
    t2 = time.perf_counter()
    t = traffic(plan, args.bucket_mb << 20,
                progress=lambda xs: progress(xs, len(xs), "traffic per tensor"))
    if args.changed_fraction is not None:
        t["delta"] = delta_prediction(plan, args.bucket_mb << 20, args.changed_fraction)
    t3 = time.perf_counter()
    t.update(model=refit.title, train=describe(refit.train), infer=describe(refit.infer),
             gpus_per_domain=refit.gpus_per_domain, dtype=args.dtype,
             seconds={"specs": t1 - t0, "plan": t2 - t1, "report": t3 - t2})
    pictures = {}
    if args.png:
        from .pictures import draw_domain_traffic, draw_tilings, pick_parameter

        name = args.param or pick_parameter(plan)
        if name not in plan.index:
            ap.error(f"argument --param: no parameter {name!r} in {refit.title}'s specs "
                     f"(e.g. {next(iter(plan.names))!r})")
        try:
            pictures["tilings"] = draw_tilings(plan, name, os.path.join(args.png, "tilings.png"))
        except ValueError as e:
            ap.error(f"argument --param: {e}")
        pictures["domains"] = draw_domain_traffic(
            t["domain_network_bytes"], t["domains"]["src"], t["domains"]["dst"],
            os.path.join(args.png, "domains.png"),
            f"{refit.title}: {t['train']} -> {t['infer']}\nnetwork GB between NVLink domains")
        t["pictures"] = pictures
    if args.json:
        print(json.dumps(t, indent=1))
        return 0
    print(render(t, f"{refit.title}: {refit.train} -> {refit.infer}, {args.dtype}, "
                    f"{refit.gpus_per_domain} ranks per NVLink domain"))
    if "delta" in t:
        print(render_delta(t["delta"]))
    print(f"specs {t['seconds']['specs']:.2f} s, plan {t['seconds']['plan']:.2f} s, "
          f"report {t['seconds']['report']:.2f} s")
    for kind, path in pictures.items():
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"] and _has_simulator():     # the simulator parses its own arguments
        from .simulate import main as simulate
        return simulate(argv[1:])
    if argv[:1] and argv[0] in OWN_PARSERS:               # so do these benchmarks
        module, _, call = OWN_PARSERS[argv[0]]
        return call(importlib.import_module(module), argv[1:]) or 0
    ap = parser()
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        return plan_command(args, ap.plan_parser)
    if args.cmd == "demo":
        from .demo import run_demo
        return run_demo(scale=args.scale, repeats=args.repeats)
    return importlib.import_module(BENCHES[args.cmd][0]).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
