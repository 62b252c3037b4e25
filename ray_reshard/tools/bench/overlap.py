"""Trainer idle time per RL step: a blocking refit vs an overlapped one (refit_async).

    ray-reshard bench-overlap [--mb 64] [--steps 5] [--step-s 0.3]

Two trainer actors on one simulated node, two engines on the other. Each RL step is an optimizer
step (`--step-s` seconds of device work, modelled as a sleep: on a GPU the host waits the same
way) followed by a refit. Blocking: step, then refit. Overlapped: refit_async, then the next
step while the bytes move, then wait. Idle time per step = wall time per step - step time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.tools.cli_args import Parser, positive_float, positive_int
from ray_reshard.tools.testing import Holder, local_cluster

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0, max_concurrency=2)
class Trainer(Holder.__ray_actor_class__):
    def step(self, seconds: float) -> None:
        time.sleep(seconds)                   # the device's work
        for t in self.tensors.values():
            t.add_(1.0)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=positive_float, default=64.0, help="MB of fp32 weights")
    p.add_argument("--steps", type=positive_int, default=5, help="timed RL steps per mode")
    p.add_argument("--step-s", type=positive_float, default=0.3,
                   help="seconds of device work per optimizer step")


def run(args) -> int:
    rows = max(2, int(args.mb * 1e6 / 4 / 1024) // 2 * 2)
    shape = (rows, 1024)
    src_l = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(0),))
    dst_l = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(1),))
    specs = {"w": rr.TensorSpec(shape, torch.float32, src_l, dst_l)}
    full = torch.randn(shape)
    with local_cluster(2):
        src = [Trainer.options(resources={"node0": 1}).remote() for _ in range(2)]
        dst = [Holder.options(resources={"node1": 1}).remote() for _ in range(2)]
        ray.get([a.set.remote({"w": rr.shard_tensor(full, src_l, r)}) for r, a in enumerate(src)]
                + [a.set.remote({"w": torch.zeros(dst_l.local_shape(r, shape))})
                   for r, a in enumerate(dst)])
        idle = {}
        with rr.ReshardGroup(src, dst, timeout_s=120) as group:
            group.refit(specs)                                    # plan, install, warm up
            for mode in ("blocking", "overlapped"):
                per = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    if mode == "blocking":
                        ray.get([a.step.remote(args.step_s) for a in src])
                        group.refit(specs)
                    else:
                        pending = group.refit_async(specs)
                        ray.get([a.step.remote(args.step_s) for a in src])
                        pending.wait()
                    per.append(time.perf_counter() - t0 - args.step_s)
                idle[mode] = statistics.median(per)
            refit_s = group.refit(specs).seconds
    print(f"{args.mb:.0f} MB fp32, 2 -> 2 actors, step {args.step_s:.2f} s, refit alone "
          f"{refit_s:.3f} s; median of {args.steps} RL steps")
    print(f"trainer idle per step: blocking {idle['blocking']:.3f} s, overlapped "
          f"{idle['overlapped']:.3f} s ({idle['blocking'] / max(idle['overlapped'], 1e-6):.1f}x "
          f"less)")
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="ray-reshard bench-overlap", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
