"""Command line: `python -m ray_reshard demo | bench | plan-scale | model-bytes`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ray_reshard", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="refit a small model between two layouts on a local CPU Ray cluster")
    d.add_argument("--scale", type=int, default=1, help="multiply the number of layers")
    b = sub.add_parser("bench", help="reshard vs gather-broadcast vs raw bandwidth on local actors")
    b.add_argument("--mb", type=int, default=256, help="megabytes of weights")
    b.add_argument("--repeats", type=int, default=3)
    sub.add_parser("plan-scale", help="plan a DeepSeek-V3-sized refit and time it",
                   add_help=False)
    sub.add_parser("model-bytes", help="bytes of real-size models under the brief's layouts",
                   add_help=False)
    for name, what in (("replay", "the busiest ranks' programs through the executor at model scale"),
                       ("first-refit", "driver and per-actor set-up of a first refit at 256-1024 ranks"),
                       ("object-store", "reshard vs Ray object store on local actors")):
        sub.add_parser(f"bench-{name}", help=what, add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd in ("bench-replay", "bench-first-refit"):
        from .bench.scale import main as m
        return m(rest, args.cmd[6:])
    if args.cmd == "bench-object-store":
        from .bench.object_store import main as m
        return m(rest)
    if args.cmd == "demo":
        from .demo import run_demo
        return run_demo(scale=args.scale)
    if args.cmd == "bench":
        from .bench.refit_bench import main as bench_main
        return bench_main(mb=args.mb, repeats=args.repeats)
    if args.cmd == "plan-scale":
        from .bench.plan_scale import main as m
        return m(rest) or 0
    if args.cmd == "model-bytes":
        from .bench.model_bytes import main as m
        return m(rest) or 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
