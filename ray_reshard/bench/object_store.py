"""reshard vs the Ray object store (zero-copy numpy), on the same local actors in one run.

    python -m ray_reshard bench-object-store [--mb 64] [--repeats 3]

4 source actors on one simulated node hold TP4 row shards; 4 destination actors on another are
TP2 x DP2. The object-store method is what a careful Ray user writes: each source returns its
shards as one list of numpy arrays (stored once in the object store, read zero-copy), each
destination fetches the two source objects covering its rows and copies its rows out of them.
Both methods are timed from the driver's call to every destination holding the new weights
(median of `--repeats`, after one warm-up); the results are checked equal. Tensor shapes are
the ones of the comparison in the project's notes, their count scaled to `--mb` of fp32.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [(1024, 2048), (256, 256), (128, 128)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ray_reshard bench-object-store",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64, help="MiB of fp32 weights per case")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import numpy as np
    import ray

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard
    from ray_reshard.testing import local_cluster

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    src_l = L([0, 1, 2, 3], Shard(0))
    dst_l = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))

    with local_cluster(2):
        @ray.remote(num_cpus=0)
        class Holder:
            def __init__(self):
                self.t = {}

            def make(self, shapes, fill):
                g = torch.Generator().manual_seed(1)
                self.t = {n: (torch.randn(s, generator=g) if fill else torch.zeros(s))
                          for n, s in shapes.items()}

            def reshard_tensors(self):
                return self.t

            def export(self, names):
                return [self.t[n].numpy() for n in names]

            def absorb(self, names, *parts):
                # parts: the source objects covering this rank's rows, in row order
                for i, n in enumerate(names):
                    dst = self.t[n]
                    row = 0
                    for part in parts:
                        a = torch.from_numpy(part[i])
                        dst[row:row + a.shape[0]].copy_(a)
                        row += a.shape[0]
                return True

            def digest(self):
                return float(sum(float(t.double().sum()) for t in self.t.values()))

        src = [Holder.options(resources={"node0": 1}).remote() for _ in range(4)]
        dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
        print(f"TP4 (4 actors, node A) -> TP2 x DP2 (4 actors, node B), fp32, {args.mb} MiB per "
              f"case; median of {args.repeats} after a warm-up")
        def noop(actor):
            return {"seconds": 0.0}

        def ray_floor():          # one no-op call to every actor, the way a refit calls them
            t0 = time.perf_counter()
            ray.get([a.__ray_call__.remote(noop) for a in src + dst])
            return time.perf_counter() - t0

        ray_floor()
        floor = statistics.median(ray_floor() for _ in range(20))
        print(f"driver ms: the driver's wall time around refit() minus the slowest actor's call "
              f"(a no-op call to all 8 actors takes {floor * 1e3:.1f} ms here); check ms: the "
              f"slowest actor's tensor lookup and checks")
        head = (f"{'tensors':<18} {'reshard s':>9} {'object store s':>14} {'ratio':>6} "
                f"{'driver ms':>9} {'check ms':>8}")
        print(head)
        print("-" * len(head))
        for rows, cols in SHAPES:
            n = max(1, (args.mb << 20) // (rows * cols * 4))
            names = [f"w{i}" for i in range(n)]
            specs = {nm: rr.TensorSpec((rows, cols), torch.float32, src_l, dst_l) for nm in names}
            shapes = lambda side, r: {nm: s.layout(side).local_shape(r, s.shape)
                                      for nm, s in specs.items()}
            ray.get([a.make.remote(shapes("src", r), True) for r, a in enumerate(src)])
            ray.get([a.make.remote(shapes("dst", r), False) for r, a in enumerate(dst)])

            def object_store():
                t0 = time.perf_counter()
                refs = [a.export.remote(names) for a in src]
                # destination rank d = dp * 2 + tp holds rows of sources 2 tp, 2 tp + 1
                ray.get([a.absorb.remote(names, refs[2 * (d % 2)], refs[2 * (d % 2) + 1])
                         for d, a in enumerate(dst)])
                return time.perf_counter() - t0

            with rr.ReshardGroup(src, dst, bucket_bytes=16 << 20) as g:
                g.refit(specs)
                walls, extra, checks = [], [], []   # the driver's wall time around refit()
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    res = g.refit(specs)
                    walls.append(time.perf_counter() - t0)
                    extra.append(walls[-1] - max(p["seconds"] for p in res.per_process))
                    checks.append(max(p["clock"].get("check", 0.0) for p in res.per_process))
            want = ray.get([a.digest.remote() for a in dst])
            ray.get([a.make.remote(shapes("dst", r), False) for r, a in enumerate(dst)])
            object_store()
            t_os = statistics.median(object_store() for _ in range(args.repeats))
            got = ray.get([a.digest.remote() for a in dst])
            if not np.allclose(want, got, rtol=1e-9, atol=1e-6):
                raise RuntimeError(f"results differ: reshard {want} vs object store {got}")
            t_wall = statistics.median(walls)
            print(f"{n:>5} x {rows}x{cols:<7} {t_wall:>9.3f} {t_os:>14.3f} {t_os / t_wall:>5.2f}x "
                  f"{statistics.median(extra) * 1e3:>9.1f} {statistics.median(checks) * 1e3:>8.1f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
