"""Refit benchmark on local CPU actors: reshard vs gather-broadcast vs raw bandwidth.

4 source actors on one simulated node, 4 destination actors on another; two layouts:
TP4 -> TP2 x DP2 (destination replicas share a node, so the domain exchange runs over shared
memory) and a mixed one (2-d sharded sources -> column-sharded destinations). Prints figures
measured side by side in one run, each the median [range] of `--repeats` after a warm-up;
raw point-to-point is the faster of bucket-sized messages and one message per pair (the
ceiling at its best). Nothing here is asserted. `bench-peers` runs the same actors against
the object store and Ray Direct Transport too.
"""
from __future__ import annotations

import torch

from .harness import Spread
from .harness import raw_bandwidth

from ray_reshard.tools.cli_args import Parser, positive_int


def _layouts():
    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    return {
        "TP4 -> TP2xDP2": (L([0, 1, 2, 3], Shard(0)),
                           L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))),
        "(TP2 x TP2 on rows, cols) -> TP4 on cols": (
            L([[0, 1], [2, 3]], Shard(0), Shard(1)), L([0, 1, 2, 3], Shard(1))),
    }


def main(mb: int = 256, repeats: int = 5) -> int:
    import ray

    import ray_reshard as rr
    from ray_reshard.tools.testing import local_cluster

    with local_cluster(2):
        @ray.remote(num_cpus=0)
        class Holder:
            def __init__(self):
                self.t = {}

            def make(self, shapes, fill):
                g = torch.Generator().manual_seed(1)
                self.t = {n: (torch.randn(s, generator=g).to(torch.bfloat16) if fill
                              else torch.zeros(s, dtype=torch.bfloat16)) for n, s in shapes.items()}

            def reshard_tensors(self):
                return self.t

        src = [Holder.options(resources={"node0": 1}).remote() for _ in range(4)]
        dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
        n_tensors = max(1, mb // 8)
        rows, cols = 2048, 2048                    # 8 MB per bf16 tensor
        print(f"{n_tensors} bf16 tensors of {rows}x{cols} ({n_tensors * rows * cols * 2 / 1e6:.0f} MB), "
              f"4 source actors on node A, 4 destination actors on node B, 2 CPU cores in all")
        for title, (src_l, dst_l) in _layouts().items():
            specs = {f"w{i}": rr.TensorSpec((rows, cols), torch.bfloat16, src_l, dst_l)
                     for i in range(n_tensors)}
            ray.get([a.make.remote({n: s.src.local_shape(r, s.shape) for n, s in specs.items()}, True)
                     for r, a in enumerate(src)])
            ray.get([a.make.remote({n: s.dst.local_shape(r, s.shape) for n, s in specs.items()}, False)
                     for r, a in enumerate(dst)])
            print(f"\n== {title}")
            times = {}
            with rr.ReshardGroup(src, dst, bucket_bytes=16 << 20) as g:
                st = g.plan(specs).stats
                print(st.summary())
                g.refit(specs)
                runs = [g.refit(specs) for _ in range(repeats)]
                spread = Spread([r.seconds for r in runs])
                t = spread.median
                times["reshard"] = t
                per_pair = max(st.network_bytes // 4, 1)
                raws = {"bucket-sized messages": [raw_bandwidth(g, per_pair)
                                                  for _ in range(repeats)]}
                with rr.ReshardGroup(src, dst, bucket_bytes=per_pair) as whole:
                    raws["one message per pair"] = [raw_bandwidth(whole, per_pair)
                                                    for _ in range(repeats)]
                raw_by = {k: Spread(v) for k, v in raws.items()}
                best = max(raw_by, key=lambda k: raw_by[k].median)
                raw = raw_by[best].median
                print(f"reshard: {t:.3f} s [{spread.low:.3f}-{spread.high:.3f}], network "
                      f"{st.network_bytes / 1e6:.0f} MB -> {st.network_bytes / t / 1e9:.2f} GB/s; "
                      f"peak staging {max(r.peak_staging_bytes for r in runs) / 1e6:.0f} MB/rank")
                print(f"raw point-to-point, same actors and transport: {raw:.2f} GB/s "
                      f"[{raw_by[best].low:.2f}-{raw_by[best].high:.2f}] ({best}; "
                      + ", ".join(f"{k} {v.median:.2f}" for k, v in raw_by.items())
                      + f") -> reshard reaches {st.network_bytes / t / 1e9 / raw * 100:.0f}% of it")
            with rr.ReshardGroup(src, dst, strategy="gather_broadcast", bucket_bytes=16 << 20) as g:
                g.refit(specs)
                runs = Spread([g.refit(specs).seconds for _ in range(repeats)])
                times["gather_broadcast"] = runs.median
                print(f"gather-broadcast: {runs.median:.3f} s [{runs.low:.3f}-{runs.high:.3f}] "
                      f"(logical payload {st.gather_broadcast_bytes / 1e6:.0f} MB)")
            print(f"speed-up reshard vs gather-broadcast: "
                  f"{times['gather_broadcast'] / times['reshard']:.2f}x")
        return 0


def add_args(ap) -> None:
    ap.add_argument("--mb", type=positive_int, default=256, help="megabytes of weights")
    ap.add_argument("--repeats", type=positive_int, default=5)


def run(args) -> int:
    return main(mb=args.mb, repeats=args.repeats)


if __name__ == "__main__":
    ap = Parser(prog="python -m ray_reshard.tools.bench.refit_bench",
                description=__doc__.splitlines()[0])
    add_args(ap)
    raise SystemExit(run(ap.parse_args()))
