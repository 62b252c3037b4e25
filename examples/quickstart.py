"""Quickstart: README's first example, runnable and checked.

A weight trained TP4 (row shards on 4 trainer actors, node 0) is refit into TP2 x DP2 inference
actors (node 1), then every destination shard is compared with the full tensor's slice.

    python examples/quickstart.py [--rows 4096] [--cols 1024] [--address HOST:PORT]

Without --address it uses the Ray session already started in this process, or else starts a
local two-node cluster on this machine (stopped at the end).
"""
import argparse
import sys

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


def refit_and_check(rows: int, cols: int) -> int:
    full = torch.randn(rows, cols)
    train = rr.Layout(rr.Mesh([0, 1, 2, 3], ("tp",)), (rr.Shard(0),))                       # TP4
    infer = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))  # TP2 x DP2
    spec = rr.TensorSpec(full.shape, torch.float32, src=train, dst=infer)

    src = [Trainer.options(**rr.on_node(0)).remote(rr.shard_tensor(full, train, r))
           for r in range(4)]
    dst = [Engine.options(**rr.on_node(1)).remote(infer.local_shape(r, full.shape))
           for r in range(4)]
    with rr.ReshardGroup(src, dst) as group:          # collective group, helpers: once
        print("plan, for the actors as placed:\n" + group.plan({"w": spec}).summary())
        result = group.refit({"w": spec})             # plan once, then reused every step
        print(result.summary())
    got = ray.get([e.weights.remote() for e in dst])
    for r, w in enumerate(got):
        if not torch.equal(w, rr.shard_tensor(full, infer, r)):
            print(f"FAILED: destination {r} differs")
            return 1
    print(f"verified: all {len(got)} destination shards equal the full tensor's slices")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--address", help="Ray cluster to join (default: this process's Ray session, "
                                      "or a local two-node cluster)")
    args = ap.parse_args(argv)
    try:
        with rr.connect(args.address):
            return refit_and_check(args.rows, args.cols)
    except rr.ClusterUnreachable as e:
        print(f"quickstart: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
