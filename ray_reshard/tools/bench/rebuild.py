"""Membership change: `group.update()` (replace one destination actor) vs a brand-new group.

`python -m ray_reshard.tools.bench.rebuild --repeats 5`

4 source actors on one simulated node, 4 destination actors on another (TP4 -> TP2 x DP2, so
the group has shared-memory rings as well as the network group). Side by side, several times
each, medians printed:

- update: `group.update(dst_actors=...)` swapping destination 3 for a spare actor (alternating
  between two, so every update changes membership), then the first refit after it;
- new group: `close()` the old group and build `ReshardGroup(...)` with the same actors as the
  update produced, then the first refit after it.

The first refit after each is timed as well because both paths leave work to it (programs,
shared-memory rings). Spare actors are started and placed before timing, as a deployment would
have its replacement ready; what is timed is ray-reshard's own work.
"""
from __future__ import annotations

import statistics
import time

import torch

from ray_reshard.tools.cli_args import Parser, positive_float, positive_int


def main(repeats: int = 5, mb: float = 8.0, bucket_mb: float = 64.0) -> int:
    import ray
    from ray_reshard.tools.testing import local_cluster

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard

    with local_cluster(2):
        @ray.remote(num_cpus=0)
        class Rank:
            def __init__(self):
                self.t = {}

            def set(self, t):
                self.t = t

            def reshard_tensors(self):
                return self.t

        L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
        src_l = L([0, 1, 2, 3], Shard(0))
        dst_l = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
        n = max(1, int(mb * 2 ** 20 // (512 * 512 * 4)))
        specs = {f"w{i}": rr.TensorSpec((512, 512), torch.float32, src_l, dst_l) for i in range(n)}
        src = [Rank.options(resources={"node0": 1}).remote() for _ in range(4)]
        dst = [Rank.options(resources={"node1": 1}).remote() for _ in range(6)]   # 2 spares
        ray.get([a.set.remote({k: torch.randn(s.src.local_shape(r, s.shape)) for k, s in specs.items()})
                 for r, a in enumerate(src)])
        ray.get([a.set.remote({k: torch.zeros(s.dst.local_shape(r % 4 if r < 4 else 3, s.shape))
                               for k, s in specs.items()}) for r, a in enumerate(dst)])
        members = dst[:4]
        bucket = int(bucket_mb * 2 ** 20)
        spares = dst[4:]
        print(f"rebuild: 4 sources (node A) -> 4 destinations (node B), {len(specs)} tensors "
              f"({sum(s.nbytes for s in specs.values()) / 1e6:.0f} MB), bucket {bucket_mb:g} MB, "
              f"{repeats} repetitions")

        upd, upd_plan, upd_first, new, new_plan, new_first, steady = [], [], [], [], [], [], []
        group = rr.ReshardGroup(src, members, bucket_bytes=bucket)
        group.refit(specs)
        try:
            for i in range(repeats):
                # update(): swap destination 3 for a spare.
                spare = spares[i % 2]
                members = members[:3] + [spare]
                upd.append(group.update(dst_actors=members))
                t0 = time.perf_counter()
                group.plan(specs)
                upd_plan.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                group.refit(specs)
                upd_first.append(time.perf_counter() - t0)
                steady.append(group.refit(specs).seconds)
                # A brand-new group over the same actors.
                t0 = time.perf_counter()
                group.close()
                group = rr.ReshardGroup(src, members, bucket_bytes=bucket)
                new.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                group.plan(specs)
                new_plan.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                group.refit(specs)
                new_first.append(time.perf_counter() - t0)
        finally:
            group.close()

        med = statistics.median
        print(f"\n{'':<38}{'median':>9}{'min':>9}{'max':>9}")
        for title, xs in (("update() (replace 1 destination)", upd),
                          ("  + planning (driver)", upd_plan),
                          ("  + first refit (install, rings, run)", upd_first),
                          ("new ReshardGroup (close + build)", new),
                          ("  + planning (driver)", new_plan),
                          ("  + first refit (install, rings, run)", new_first),
                          ("steady-state refit (reference)", steady)):
            print(f"{title:<38}{med(xs):>8.3f}s{min(xs):>8.3f}s{max(xs):>8.3f}s")
        u = med(upd) + med(upd_plan) + med(upd_first)
        b = med(new) + med(new_plan) + med(new_first)
        print(f"\nto the first completed refit: update {u:.3f} s vs new group {b:.3f} s "
              f"({b / u:.2f}x)")
        return 0


def add_args(ap) -> None:
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--mb", type=positive_float, default=8.0, help="megabytes of weights")
    ap.add_argument("--bucket-mb", type=positive_float, default=64.0,
                    help="bucket_bytes in MB (ring slots)")


def run(args) -> int:
    return main(args.repeats, args.mb, args.bucket_mb)


if __name__ == "__main__":
    ap = Parser(prog="python -m ray_reshard.tools.bench.rebuild", description=__doc__.splitlines()[0])
    add_args(ap)
    raise SystemExit(run(ap.parse_args()))
