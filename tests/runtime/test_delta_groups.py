"""Delta refits through the executor under NCCL's rules, on CPU: every process's compiled program
runs in its own thread over the in-memory channels of test_executor_groups (a process's groups
run one after another, a group completes only when all its messages did), refit after refit
with one baseline per process. Each network group exchanges headers, then payloads; buckets go
same, index, mask or dense (dense ones as a dense refit sends them: items in place), sources
read in place or packed (a conversion), destinations written in place or through a bucket
(strided). Results bit-exact, no deadlock at any window; a destination written outside refits
is reported by its receiver without failing anyone's run."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import ray_reshard as rr
from ray_reshard.execution.pack import shard_view
from ray_reshard.execution.program import compile_program
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.planning.moves import Endpoint
from ray_reshard.runtime.delta import Baselines, DeltaRun
from ray_reshard.runtime.executor import Transports, run_program

from test_executor_groups import STALL_S, Fabric, FakeNet, FakeRings, L


class Cluster:
    """Every process of a plan with its program, views and baselines, kept across refits."""

    def __init__(self, p, src_store, dst_store, bucket_bytes, window, serial, per_item):
        self.p, self.window, self.serial = p, window, serial
        topo = p.topology
        self.eps = [Endpoint("src", r) for r in range(topo.n_src)] + \
                   [Endpoint("dst", r) for r in range(topo.n_dst)]
        stores = {"src": src_store, "dst": dst_store}
        self.procs = []
        for ep in self.eps:
            prog = compile_program(p, [ep], bucket_bytes, per_item_bytes=per_item)
            views = {k: shard_view(p, k[0], k[1], k[2], stores[k[0]][k[1]]) for k in prog.held}
            self.procs.append({"prog": prog, "views": views, "base": Baselines("device"),
                               "held": None})
        self.version = 0

    def refit(self) -> list:
        """One delta refit of every process; returns each one's delta stats."""
        self.version += 1
        fabric, rings = Fabric(self.serial), {}
        errors, stats, threads = [], [None] * len(self.procs), []

        def one(proc):
            st = self.procs[proc]
            try:
                run = DeltaRun(st["base"], self.version, st["held"], torch.device("cpu"), proc)
                tr = Transports(FakeNet(fabric, proc, polls=self.serial), FakeRings(rings, proc),
                                torch.device("cpu"), self.window)
                stats[proc] = run_program(st["prog"], st["views"], tr,
                                          time.monotonic() + STALL_S, delta=run)["delta"]
            except BaseException as e:          # noqa: BLE001 - reported below
                errors.append((proc, e))

        for proc in range(len(self.procs)):
            t = threading.Thread(target=one, args=(proc,), daemon=True)
            threads.append(t)
            t.start()
        for t in threads:
            t.join(STALL_S + 10)
        assert not errors, errors
        ok = not any(s["mismatches"] for s in stats)
        for st in self.procs:                   # the driver's word: finished everywhere or not
            st["base"].settle(self.version if ok else -1)
            st["held"] = self.version if ok else None
        return stats


def problem(kind):
    tp4 = L([0, 1, 2, 3], Shard(0))
    if kind == "rows":          # bf16 rows: sources and destinations contiguous, in place
        dst = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
        shapes, dtype, src_dtype = [(64, 48), (48, 64), (7, 5), (128, 32)], torch.bfloat16, None
    else:                       # fp32 -> bf16 (packed on the sender), strided destinations
        dst = L([[0, 1], [2, 3]], Replicate(), Shard(1), names=("dp", "tp"))
        shapes, dtype, src_dtype = [(64, 48), (40, 64), (8, 6)], torch.bfloat16, torch.float32
    specs = {f"w{i}": rr.TensorSpec(s, dtype, tp4, dst, src_dtype=src_dtype)
             for i, s in enumerate(shapes)}
    return specs


@pytest.mark.parametrize("serial", [True, False], ids=["nccl-like", "independent"])
@pytest.mark.parametrize("window", [1, 2, 8])
@pytest.mark.parametrize("per_item", [None, 2048], ids=["packed", "per-item"])
@pytest.mark.parametrize("kind", ["rows", "converted"])
def test_delta_groups_match_and_never_deadlock(serial, window, per_item, kind):
    specs = problem(kind)
    g = torch.Generator().manual_seed(window)
    fulls = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    p = rr.plan(specs, src_domains=["s"] * 4, dst_domains=["d0", "d0", "d1", "d1"])
    src_store = [{n: rr.shard_tensor(fulls[n].to(s.source_dtype), s.src, r)
                  for n, s in specs.items()} for r in range(4)]
    dst_store = [{n: torch.full(s.dst.local_shape(r, s.shape), -1.0, dtype=s.dtype)
                  for n, s in specs.items()} for r in range(4)]
    cl = Cluster(p, src_store, dst_store, 4096, window, serial, per_item)
    seen = set()
    for i, fraction in enumerate([0.0, 0.0, 0.002, 0.1, 1.0, 0.02]):
        for n, s in specs.items():              # change that share, in place
            f = fulls[n]
            m = torch.rand(f.shape, generator=g) < fraction
            f[m] = f[m] * 1.5 + 1
            for r in range(4):
                src_store[r][n].copy_(rr.shard_tensor(f.to(s.source_dtype), s.src, r))
        stats = cl.refit()
        for n, s in specs.items():
            for r in range(4):
                want = rr.shard_tensor(fulls[n].to(s.dtype), s.dst, r)
                assert torch.equal(dst_store[r][n].view(torch.int16), want.view(torch.int16)), \
                    (i, n, r)
        enc = {k: sum(st["encodings"][k] for st in stats) for k in stats[0]["encodings"]}
        seen |= {k for k, v in enc.items() if v}
        fallbacks = [f for st in stats for f in st["fallbacks"]]
        assert bool(fallbacks) == (i == 0)
        if i == 1:
            assert set(k for k, v in enc.items() if v) == {"same"}
    assert seen == {"same", "index", "mask", "dense"}


def test_a_mismatch_is_reported_and_every_run_ends():
    specs = problem("rows")
    g = torch.Generator().manual_seed(1)
    fulls = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    p = rr.plan(specs, src_domains=["s"] * 4, dst_domains=["d0", "d0", "d1", "d1"])
    src_store = [{n: rr.shard_tensor(fulls[n].to(s.dtype), s.src, r) for n, s in specs.items()}
                 for r in range(4)]
    dst_store = [{n: torch.zeros(s.dst.local_shape(r, s.shape), dtype=s.dtype)
                  for n, s in specs.items()} for r in range(4)]
    cl = Cluster(p, src_store, dst_store, 4096, 2, True, None)
    cl.refit()
    cl.refit()
    for r in range(4):                           # written behind the refits' back
        dst_store[r]["w0"].view(-1)[0] += 1
    stats = cl.refit()
    bad = [proc for proc, st in enumerate(stats) if st["mismatches"]]
    assert bad and all(proc >= 4 for proc in bad)
    assert "changed outside refits" in stats[bad[0]]["mismatches"][0]
    stats = cl.refit()                           # baselines unconfirmed: dense, and right
    assert all(st["fallbacks"] for st in stats[:4]) and not any(st["mismatches"] for st in stats)
    for n, s in specs.items():
        for r in range(4):
            assert torch.equal(dst_store[r][n], rr.shard_tensor(fulls[n].to(s.dtype), s.dst, r))
