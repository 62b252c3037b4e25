"""Seconds from a fault to the refit's error, for each kind of fault, on a local two-node cluster.

    ray-reshard bench-faults [--timeout 10] [--repeats 1]

Two source actors on one node, two destination replicas on the other (network and a
shared-memory ring both used). Each fault is armed in one destination and strikes in the refit's
one call to it: at the lookup (refused everywhere before any byte moves: a wrong shape is bad
input, ValueError; a lookup that raises is a fault of that rank, RefitError), or once every
process's checks passed (RefitError). The refit is
timed from the call to the error; then update() repairs the group where a fault broke it, and a
good refit checks it.
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
from ray_reshard.tools.cli_args import Parser, positive_float, positive_int, raylet_messages_at_debug
from ray_reshard.tools.testing import Holder, local_cluster

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAULTS = {
    "lookup raises": "the tensor lookup raises: a fault of that rank, refused (RefitError)",
    "wrong shape": "the tensor lookup returns a wrong shape: refused (ValueError)",
    "raise in run": "the run raises once the checks passed (e.g. staging out of memory)",
    "process exit in run": "the process exits (os._exit) once the checks passed",
    "killed before refit": "ray.kill() right before the refit",
    "hung rank": "the process sleeps past the deadline",
}
REFUSED = ("wrong shape",)                           # bad input: ValueError
# refused before any byte moves (bad input, or a fault in the actor's own lookup): the group
# stays usable without update()
KEEPS_GROUP = ("lookup raises", "wrong shape")


def _lookup(actor):
    fault, actor.rr_fault = getattr(actor, "rr_fault", None), None
    if fault == "lookup raises":
        raise RuntimeError("injected fault")
    if fault == "wrong shape":
        return {k: v[:1] for k, v in actor.tensors.items()}
    if fault == "hung rank":
        time.sleep(actor.rr_hang_s)
    return actor.tensors


def _arm(actor, kind, hang_s):
    if kind in ("raise in run", "process exit in run"):
        # Strike once every process's checks passed, where the executor starts.
        from ray_reshard.runtime import executor
        real = executor.run_program

        def strike(*args, **kwargs):
            executor.run_program = real
            if kind == "process exit in run":
                os._exit(1)
            raise MemoryError("injected fault")
        executor.run_program = strike
    else:
        actor.rr_fault = kind
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
    """{fault kind: [seconds from fault to the refit's error, ...]} (a cluster must be
    connected)."""
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
                    assert kind not in REFUSED and ("dst", 1) in e.failed_ranks, (kind, e)
                except ValueError as e:
                    out[kind].append(time.monotonic() - t0)
                    assert kind in REFUSED and "dst rank 1" in str(e), (kind, e)
                if kind in ("process exit in run", "killed before refit", "hung rank"):
                    replacement = new(1, 1)[0]
                    group.update(dst_actors=[group.dst_actors[0], replacement])
                elif kind not in KEEPS_GROUP:
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
    # Ray relays each injected death as a raylet paragraph: logged at DEBUG, the table names it.
    with local_cluster(2), raylet_messages_at_debug():
        res = measure(args.timeout, args.repeats)
    print(f"seconds from fault to the refit's error (refit deadline {args.timeout:.0f} s, "
          f"{args.repeats} run(s) each)")
    for kind, secs in res.items():
        print(f"  {kind:<22} {statistics.median(secs):6.2f} s   ({FAULTS[kind]})")
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="ray-reshard bench-faults", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
