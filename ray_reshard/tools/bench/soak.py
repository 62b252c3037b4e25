"""Soak test: hundreds of consecutive refits on one ReshardGroup, watching for drift.

`python -m ray_reshard.tools.bench.soak --refits 300`

4 source actors on one simulated node (TP4 over rows) and 4 destination actors on another
(TP2 x DP2, so every refit uses both the network transport and the shared-memory domain
exchange), a few MB of weights in float32 and bfloat16. Before every refit the sources change
their weights in place (an optimizer step); every `--every` refits the destinations are checked
bit-exactly and the bench samples, per window: refit latency (median, p99), the RSS and open file
descriptors of every actor and node-helper process, live Python objects in the actors (after a
gc.collect(), which the probe runs after reading RSS), shared-memory segments (`rr-*` files in
/dev/shm, and `rr-*` mappings in the actor processes), and the driver's RSS and fds. The /dev/shm
count is machine-wide: other programs' `rr-*` segments show up there too. It prints a table
and a verdict per metric: flat, or drifting with the fitted slope.
"""
from __future__ import annotations

import os
import re
import statistics
import time
from typing import Optional

import torch

from ray_reshard.tools.cli_args import Parser, positive_float, positive_int, progress

_SEG = re.compile(r"rr-[0-9a-f]{32}")


# ---------------------------------------------------------------- process figures
def _rss_bytes(pid: Optional[int] = None) -> int:
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds(pid: Optional[int] = None) -> int:
    try:
        return len(os.listdir(f"/proc/{pid or 'self'}/fd"))
    except OSError:
        return -1


def _probe(actor) -> dict:
    """Runs inside an actor or helper: its own pid, RSS, fds, mapped rr-* segments and the
    number of live Python objects (tells a Python-side leak from native growth)."""
    import gc
    with open("/proc/self/maps") as f:
        mapped = len(set(_SEG.findall(f.read())))
    rss = _rss_bytes()                  # read before collecting: garbage counts as growth here
    gc.collect()
    return {"pid": os.getpid(), "rss": rss, "fds": _fds(), "mapped": mapped,
            "pyobjs": len(gc.get_objects())}


def _shm_files() -> int:
    try:
        return sum(1 for f in os.listdir("/dev/shm") if _SEG.fullmatch(f))
    except OSError:
        return -1


# ---------------------------------------------------------------- the actors
def _set_base(actor, tensors: dict) -> None:
    actor.base = tensors
    actor.t = {k: v.clone() for k, v in tensors.items()}


def _step(actor, k: int) -> None:
    """An optimizer step: new values written in place (the storage stays the same)."""
    for name, t in actor.t.items():
        t.copy_(actor.base[name] + k)


def _get(actor) -> dict:
    return actor.t


def _slope(xs, ys) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _p99(xs):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def main(refits: int = 300, every: int = 25, mb: float = 4.0, bucket_kb: int = 256,
         warmup: int = 1) -> int:
    import ray
    from ray_reshard.tools.testing import local_cluster

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard

    with local_cluster(2):
        @ray.remote(num_cpus=0)
        class Rank:
            def __init__(self):
                self.t, self.base = {}, {}

            def reshard_tensors(self):
                return self.t

        L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
        src_l = L([0, 1, 2, 3], Shard(0))
        dst_l = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
        # Tensors of 256 x 512 float32 (512 KB) and bfloat16, with a few odd ones.
        n = max(1, int(mb * 2 ** 20 // (256 * 512 * 4)))
        specs = {}
        for i in range(n):
            dt = torch.float32 if i % 2 == 0 else torch.bfloat16
            specs[f"layer{i}.w"] = rr.TensorSpec((256, 512), dt, src_l, dst_l,
                                                 src_dtype=torch.float32)
        specs["norm"] = rr.TensorSpec((512,), torch.float32, L([0, 1, 2, 3], Replicate()),
                                      L([0, 1, 2, 3], Replicate()))
        specs["odd"] = rr.TensorSpec((37, 11), torch.float32, src_l,
                                     L([[0, 1], [2, 3]], Replicate(), Shard(1)))
        g = torch.Generator().manual_seed(0)
        fulls = {k: torch.randn(s.shape, generator=g) for k, s in specs.items()}
        total = sum(s.nbytes for s in specs.values())

        src = [Rank.options(resources={"node0": 1}).remote() for _ in range(4)]
        dst = [Rank.options(resources={"node1": 1}).remote() for _ in range(4)]
        ray.get([a.__ray_call__.remote(_set_base, {k: rr.shard_tensor(fulls[k], s.src, r)
                                                   for k, s in specs.items()})
                 for r, a in enumerate(src)])
        ray.get([a.__ray_call__.remote(_set_base, {k: torch.zeros(s.dst.local_shape(r, s.shape),
                                                                  dtype=s.dtype)
                                                   for k, s in specs.items()})
                 for r, a in enumerate(dst)])
        print(f"soak: {refits} refits of {len(specs)} tensors ({total / 1e6:.1f} MB in destination "
              f"dtypes), 4 sources (node A, TP4) -> 4 destinations (node B, TP2 x DP2), "
              f"bucket {bucket_kb} KB, sample every {every}")

        def check(k: int) -> None:
            got = ray.get([a.__ray_call__.remote(_get) for a in dst])
            for name, s in specs.items():
                want = (fulls[name] + k).to(s.dtype)
                for r in range(4):
                    if not torch.equal(got[r][name], rr.shard_tensor(want, s.dst, r)):
                        raise AssertionError(f"refit {k}: {name} on dst rank {r} is not bit-exact")

        rows = []
        with rr.ReshardGroup(src, dst, bucket_bytes=bucket_kb * 1024, timeout_s=60) as group:
            helpers = list(group.resources()["helpers"].values())
            watched = src + dst + helpers

            def sample(i: int, lat: list) -> dict:
                probes = ray.get([a.__ray_call__.remote(_probe) for a in watched])
                # This group's segments still named in /dev/shm (rings are sealed once mapped,
                # so 0 is expected) plus what its helpers still hold for it.
                ours = sum(os.path.exists(os.path.join("/dev/shm", n))
                           for n in group.resources()["segments"])
                ours += sum(len(x) for x in ray.get([h.segments.remote(group.group_id)
                                                     for h in helpers]))
                actors_p, helpers_p = probes[:8], probes[8:]
                return {"refit": i, "median_ms": statistics.median(lat) * 1e3 if lat else 0.0,
                        "p99_ms": _p99(lat) * 1e3 if lat else 0.0,
                        "actor_rss_mb": [p["rss"] / 2 ** 20 for p in actors_p],
                        "helper_rss_mb": [p["rss"] / 2 ** 20 for p in helpers_p],
                        "actor_fds": [p["fds"] for p in actors_p],
                        "helper_fds": [p["fds"] for p in helpers_p],
                        "mapped": sum(p["mapped"] for p in actors_p),
                        "pyobjs": sum(p["pyobjs"] for p in actors_p),
                        "shm_files": _shm_files(), "shm_ours": ours,
                        "driver_rss_mb": _rss_bytes() / 2 ** 20,
                        "driver_fds": _fds()}

            k = 0
            for _ in range(warmup):                   # plan, install, first touch of buffers
                k += 1
                ray.get([a.__ray_call__.remote(_step, k) for a in src])
                group.refit(specs)
            check(k)
            rows.append(sample(0, []))
            lat: list = []
            t_start = time.perf_counter()
            for i in progress(range(1, refits + 1), refits, "refits"):
                k += 1
                ray.get([a.__ray_call__.remote(_step, k) for a in src])
                res = group.refit(specs)
                lat.append(res.seconds)
                if i % every == 0 or i == refits:
                    check(k)
                    rows.append(sample(i, lat))
                    lat = []
            wall = time.perf_counter() - t_start
            assert group.version == k and set(group.versions()) == {k}

        _report(rows, refits, wall, total)
        return 0


def _report(rows: list, refits: int, wall: float, total: int) -> None:
    print(f"\n{refits} refits in {wall:.1f} s ({refits / wall:.1f} refits/s including the "
          f"optimizer-step calls); every sampled refit was bit-exact\n")
    hdr = (f"{'refit':>6} {'med ms':>7} {'p99 ms':>7} {'actor RSS MB (min-max, sum)':>28} "
           f"{'helper RSS':>10} {'fds (actors)':>12} {'helper fds':>10} {'maps':>5} {'ours':>4} {'shm*':>4} "
           f"{'driver MB':>9} {'drv fds':>7} {'py objs (actors)':>16}")
    print(hdr)
    print("-" * len(hdr))
    # maps: rr-* segments mapped by the actors; ours: this group's segments still named in
    # /dev/shm or held by the helpers; shm*: every rr-* file in /dev/shm
    for r in rows:
        a = r["actor_rss_mb"]
        print(f"{r['refit']:>6} {r['median_ms']:>7.1f} {r['p99_ms']:>7.1f} "
              f"{min(a):>9.1f}-{max(a):<7.1f} {sum(a):>9.1f} {sum(r['helper_rss_mb']):>10.1f} "
              f"{sum(r['actor_fds']):>12} {sum(r['helper_fds']):>10} {r['mapped']:>5} "
              f"{r['shm_ours']:>4} {r['shm_files']:>4} {r['driver_rss_mb']:>9.1f} {r['driver_fds']:>7} {r['pyobjs']:>16}")
    # Verdicts over the windows after the first one (the first includes warm-up effects).
    body = [r for r in rows if r["refit"] > 0]
    steady = body[1:] if len(body) > 2 else body
    xs = [r["refit"] for r in steady]
    span = (xs[-1] - xs[0]) if len(xs) > 1 else 0
    print("\nverdict (slopes fitted over the windows after the first):")
    verdicts = []

    def judge(name, ys, unit, limit_total, scale=1.0):
        s = _slope(xs, ys)
        drift = s * span
        ok = drift <= limit_total          # growth is what leaks look like; shrinking is warm-up
        verdicts.append(ok)
        word = "DRIFTING" if not ok else ("flat    " if drift >= -limit_total else "falling ")
        print(f"  {name:<28} {word} slope {s * scale:+.4f} {unit} "
              f"(fitted change over the run {drift:+.2f}, tolerance +{limit_total:g})")

    med = [r["median_ms"] for r in steady]
    judge("latency median (ms)", med, "ms/refit", max(0.5 * statistics.median(med), 2.0))
    judge("actor RSS sum (MB)", [sum(r["actor_rss_mb"]) for r in steady], "MB/refit", 16.0)
    judge("actor RSS max (MB)", [max(r["actor_rss_mb"]) for r in steady], "MB/refit", 8.0)
    judge("helper RSS sum (MB)", [sum(r["helper_rss_mb"]) for r in steady], "MB/refit", 8.0)
    judge("driver RSS (MB)", [r["driver_rss_mb"] for r in steady], "MB/refit", 16.0)
    judge("live Python objects (actors)", [r["pyobjs"] for r in steady], "objs/refit", 2000.0)
    judge("actor fds (sum)", [sum(r["actor_fds"]) for r in steady], "fds/refit", 2.0)
    judge("helper fds (sum)", [sum(r["helper_fds"]) for r in steady], "fds/refit", 2.0)
    judge("driver fds", [r["driver_fds"] for r in steady], "fds/refit", 2.0)
    judge("rr-* mappings in actors", [r["mapped"] for r in steady], "maps/refit", 0.5)
    judge("this group's shm segments", [r["shm_ours"] for r in steady], "files/refit", 0.5)
    print("  (shm* = every rr-* file in /dev/shm, machine-wide: other programs' too; not judged)")
    print(f"\nVERDICT: {'flat' if all(verdicts) else 'drifting'}")


def add_args(ap) -> None:
    ap.add_argument("--refits", type=positive_int, default=300)
    ap.add_argument("--every", type=positive_int, default=25, help="sample every N refits")
    ap.add_argument("--mb", type=positive_float, default=4.0,
                    help="megabytes of weights (approx.)")
    ap.add_argument("--bucket-kb", type=positive_int, default=256)


def run(args) -> int:
    return main(args.refits, args.every, args.mb, args.bucket_kb)


if __name__ == "__main__":
    ap = Parser(prog="python -m ray_reshard.tools.bench.soak", description=__doc__.splitlines()[0])
    add_args(ap)
    raise SystemExit(run(ap.parse_args()))
