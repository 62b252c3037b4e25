"""Quickstart: the README's first example, runnable.

A weight trained TP4 (row shards on 4 trainer actors) is refit into TP2 x DP2 inference actors,
then every destination shard is checked against the full tensor.

    python examples/quickstart.py [--rows 4096] [--cols 1024]
"""
import argparse

import ray
import torch

import ray_reshard as rr


@ray.remote(num_cpus=0)
class Trainer:                      # any actor; it only has to expose its tensors
    def __init__(self, w): self.w = w
    def reshard_tensors(self): return {"w": self.w}


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self, shape): self.w = torch.zeros(shape)
    def reshard_tensors(self): return {"w": self.w}
    def weights(self): return self.w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--address", default="local",
                    help="Ray cluster to connect to (default: start a local one)")
    args = ap.parse_args(argv)
    ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
    try:
        full = torch.randn(args.rows, args.cols)
        train = rr.Layout(rr.Mesh([0, 1, 2, 3], ("tp",)), (rr.Shard(0),))                       # TP4
        infer = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))  # TP2 x DP2
        spec = rr.TensorSpec(full.shape, torch.float32, src=train, dst=infer)

        src = [Trainer.remote(rr.shard_tensor(full, train, r)) for r in range(4)]
        dst = [Engine.remote(infer.local_shape(r, full.shape)) for r in range(4)]
        with rr.ReshardGroup(src, dst) as group:          # collective group, helpers: once
            result = group.refit({"w": spec})             # plan once, then reused every step
            print(result.summary())
        got = ray.get([e.weights.remote() for e in dst])
        for r, w in enumerate(got):
            if not torch.equal(w, rr.shard_tensor(full, infer, r)):
                print(f"FAILED: destination {r} differs")
                return 1
        print(f"verified: all {len(got)} destination shards equal the full tensor's slices")

        plan = rr.plan({"w": spec}, src_domains=["n0"] * 4, dst_domains=["n1"] * 4)
        print(plan.summary())
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
