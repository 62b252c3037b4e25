"""Partial refits: a subset of the names (e.g. LoRA adapters, the layers that changed) against
the whole model, on the same local actors in one run.

    python -m ray_reshard bench-partial [--tensors 1000] [--mb 128] [--fraction 0.01]

A partial refit is a refit of a sub-mapping of the specs: it gets its own plan and programs
(planned and installed once, at its first refit; the full set's stay installed), and then costs
in proportion to its bytes and tensors.
"""
from __future__ import annotations

import statistics
import time

import torch

from ray_reshard.tools.cli_args import Parser


def main(argv=None) -> int:
    ap = Parser(prog="ray_reshard bench-partial",
                description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=1000, help="tensors in the model")
    ap.add_argument("--mb", type=int, default=128, help="MiB of fp32 weights in the model")
    ap.add_argument("--fraction", type=float, default=0.01, help="share of the names refitted")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import ray

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard
    from ray_reshard.tools.testing import holders, local_cluster

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    src_l = L([0, 1, 2, 3], Shard(0))
    dst_l = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    cols = 256
    rows = max(4, (args.mb << 20) // (args.tensors * cols * 4) // 4 * 4)
    specs = {f"w{i}": rr.TensorSpec((rows, cols), torch.float32, src_l, dst_l)
             for i in range(args.tensors)}
    n_part = max(1, round(args.tensors * args.fraction))
    names = list(specs)[::max(1, args.tensors // n_part)][:n_part]
    part = {n: specs[n] for n in names}

    with local_cluster(2):
        src, dst = holders(4, 0), holders(4, 1)
        g = torch.Generator().manual_seed(0)
        ray.get([a.set.remote({n: torch.randn(s.src.local_shape(r, s.shape), generator=g)
                               for n, s in specs.items()}) for r, a in enumerate(src)])
        ray.get([a.set.remote({n: torch.zeros(s.dst.local_shape(r, s.shape))
                               for n, s in specs.items()}) for r, a in enumerate(dst)])
        with rr.ReshardGroup(src, dst) as group:
            group.refit(specs)                                  # the full set, installed
            t0 = time.perf_counter()
            first = group.refit(part)                           # the subset: planned, installed
            t_first = time.perf_counter() - t0
            full, sub = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                group.refit(specs)
                full.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                res = group.refit(part)
                sub.append(time.perf_counter() - t0)
            got = ray.get(dst[0].get.remote())
            want = ray.get(src[0].get.remote())
            for n in names:                                     # rows of source 0 on dst 0
                if not torch.equal(got[n][:want[n].shape[0]], want[n]):
                    raise RuntimeError(f"{n}: partial refit not exact")
    t_full, t_sub = statistics.median(full), statistics.median(sub)
    print(f"{args.tensors} fp32 tensors of {rows}x{cols} ({args.tensors * rows * cols * 4 / 1e6:.0f} "
          f"MB), TP4 -> TP2 x DP2 on 4 + 4 local actors; partial refit: {len(part)} names "
          f"({100 * len(part) / args.tensors:.1f}%, {res.plan_stats.total_bytes / 1e6:.1f} MB); "
          f"median of {args.repeats}")
    print(f"full refit {t_full:.3f} s, partial refit {t_sub:.3f} s ({t_full / t_sub:.1f}x less); "
          f"first partial refit (plan + install) {t_first:.3f} s, planned: {first.planned}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
