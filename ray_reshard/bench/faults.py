"""Seconds from a fault to RefitError, for each kind of fault, on a local two-node cluster.

    ray-reshard bench-faults [--timeout 10] [--repeats 1]

Two source actors on one node, two destination replicas on the other (network and a
shared-memory ring both used). Each fault is armed in one destination, the refit is timed from
the call to the RefitError (the fault strikes at the start of the run phase, so that is the
fault-to-error time), then update() repairs the group and a good refit checks it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.cli_args import positive_float, positive_int
from ray_reshard.testing import Holder, local_cluster

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAULTS = {
    "raise in run": "the tensor lookup raises",
    "wrong shape in run": "the tensor lookup returns a wrong shape",
    "process exit in run": "the process exits (os._exit) at the start of its run",
    "killed before refit": "ray.kill() right before the refit",
    "hung rank": "the process sleeps past the deadline",
}


def _lookup(actor):
    fault = getattr(actor, "rr_fault", None)
    if fault is not None:
        actor.rr_fault = None if fault[1] == 0 else (fault[0], fault[1] - 1)
        if fault[1] == 0:
            if fault[0] == "raise in run":
                raise RuntimeError("injected fault")
            if fault[0] == "wrong shape in run":
                return {k: v[:1] for k, v in actor.tensors.items()}
            if fault[0] == "process exit in run":
                os._exit(1)
            if fault[0] == "hung rank":
                time.sleep(actor.rr_hang_s)
    return actor.tensors


def _arm(actor, kind, hang_s):
    actor.rr_fault = (kind, 1)           # pass the prepare lookup, strike in run
    actor.rr_hang_s = hang_s


def _specs():
    src = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(0),))
    dst = rr.Layout(rr.Mesh([[0], [1]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))
    return {"w": rr.TensorSpec((1024, 256), torch.float32, src, dst)}


def _load(src, dst, specs, step):
    full = torch.randn(1024, 256, generator=torch.Generator().manual_seed(step))
    s = specs["w"]
    ray.get([a.set.remote({"w": rr.shard_tensor(full, s.src, r)}) for r, a in enumerate(src)] +
            [a.set.remote({"w": torch.zeros(s.dst.local_shape(r, s.shape))})
             for r, a in enumerate(dst)])
    return full


def measure(timeout_s: float = 10.0, repeats: int = 1) -> dict:
    """{fault kind: [seconds from fault to RefitError, ...]} (a cluster must be connected)."""
    new = lambda n, node: [Holder.options(resources={f"node{node}": 1}, max_restarts=0).remote()
                           for _ in range(n)]
    src, dst = new(2, 0), new(2, 1)
    specs = _specs()
    out: dict = {k: [] for k in FAULTS}
    with rr.ReshardGroup(src, dst, tensors=_lookup, timeout_s=timeout_s) as group:
        _load(src, dst, specs, 0)
        group.refit(specs)
        for rep in range(repeats):
            for kind in FAULTS:
                victim = group.dst_actors[1]
                if kind == "killed before refit":
                    ray.kill(victim)
                else:
                    ray.get(victim.__ray_call__.remote(_arm, kind, timeout_s + 10))
                t0 = time.monotonic()
                try:
                    group.refit(specs)
                    raise AssertionError(f"{kind}: the refit did not fail")
                except rr.RefitError as e:
                    out[kind].append(time.monotonic() - t0)
                    assert ("dst", 1) in e.failed_ranks, (kind, e)
                if kind in ("process exit in run", "killed before refit", "hung rank"):
                    replacement = new(1, 1)[0]
                    group.update(dst_actors=[group.dst_actors[0], replacement])
                else:
                    group.update()
                full = _load(group.src_actors, group.dst_actors, specs, rep + 1)
                group.refit(specs)
                got = ray.get(group.dst_actors[1].get.remote())["w"]
                assert torch.equal(got, full), f"{kind}: refit after update() not exact"
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=positive_float, default=10.0,
                   help="refit deadline in s (default 10)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of each fault (default 1)")


def run(args) -> int:
    with local_cluster(2):
        res = measure(args.timeout, args.repeats)
    print(f"seconds from fault to RefitError (refit deadline {args.timeout:.0f} s, "
          f"{args.repeats} run(s) each)")
    for kind, secs in res.items():
        print(f"  {kind:<22} {statistics.median(secs):6.2f} s   ({FAULTS[kind]})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ray-reshard bench-faults", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
