#!/usr/bin/env python
"""GPU check of ray-reshard on one machine: every step prints PASS / FAIL / SKIP with its time.

    python release_tests/gpu_smoke.py                  # on a machine with CUDA (one GPU is enough)
    python release_tests/gpu_smoke.py --cpu-dry-run    # the same steps on CPU, small (CI)
    python release_tests/gpu_smoke.py --json out.json  # also write the results as JSON

Steps: GPU pack/unpack bandwidth against a plain device-to-device copy of the same bytes (goal:
at least 0.8 of copy bandwidth); a bucket of 2000 strided regions packed by one copy-table
launch against one foreach call (host time per pack: the launch cost the cluster simulator's
GPU presets estimate); several actors sharing the GPU (fractional ``num_gpus``) refit
between layouts over CUDA IPC, bit-exact; dtype conversion (float32 -> bfloat16) on the GPU;
an atomic refit; a rank failing mid-refit (fail-fast: RefitError naming it long before the
deadline, old weights kept, the group rebuilt with a replacement); NCCL: refused clearly for
actors sharing one GPU, a one-rank NCCL group, and with two GPUs or more a refit over NCCL and
CUDA IPC between actors that each see only their own GPU.

Every step runs under its own time limit and the whole run under ``--time-limit``: a step that
hangs is reported FAIL and the script exits (never a hang). Exit status 0 when no step failed.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
import traceback

import torch

import ray
import ray_reshard as rr
from ray_reshard.planning.moves import Endpoint
from ray_reshard.execution.program import SEND, compile_program
from ray_reshard.layout.placement import Replicate, Shard

STEPS = []
# Every actor on the shared GPU asks for this much (Ray keeps 4 decimals: 1/6 six times is more
# than one GPU, 0.1 ten times is exactly one).
FRAC = 0.1


def step(limit_s: float):
    def register(fn):
        STEPS.append((fn.__name__, fn, limit_s))
        return fn
    return register


class Skip(Exception):
    pass


class Ctx:
    def __init__(self, dry: bool):
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.gpus = 0 if dry else torch.cuda.device_count()
        self.mb = 4 if dry else 256          # payload of the refit steps


@ray.remote(num_cpus=0)
class Rank:
    """A user actor holding tensors on its device (the GPU Ray gave it, or the CPU)."""

    def __init__(self, device: str):
        self.device = torch.device(device if device == "cpu" else "cuda")
        self.t = {}
        self.slow_from_call, self.calls = None, 0

    def set(self, tensors):
        self.t = {k: v.to(self.device) for k, v in tensors.items()}

    def get(self):
        return {k: v.cpu() for k, v in self.t.items()}

    def slow_from(self, call: int):
        """From the `call`-th lookup of its tensors on, take an hour (a stuck rank)."""
        self.slow_from_call, self.calls = call, 0

    def reshard_tensors(self):
        self.calls += 1
        if self.slow_from_call is not None and self.calls >= self.slow_from_call:
            time.sleep(3600)
        return self.t

    def where(self):
        return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "device": str(self.device), "pid": os.getpid()}


def _ranks(ctx, n: int, frac: float):
    opts = {"num_gpus": frac} if not ctx.dry else {}
    return [Rank.options(**opts).remote(ctx.device) for _ in range(n)]


def _sync(ctx):
    if not ctx.dry:
        torch.cuda.synchronize()


def _timed(ctx, fn, reps=5, trials=5, sync=True):
    """Best of `trials` runs of `reps` calls, per call, after a warm-up; with `sync` False
    the host's time only (the device may still be working)."""
    fn()
    _sync(ctx)
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if sync:
            _sync(ctx)
        best = min(best, (time.perf_counter() - t0) / reps)
        _sync(ctx)
    return best


def _layouts(n_src: int, n_dst: int):
    src = rr.Layout(rr.Mesh(list(range(n_src))), (Shard(0),))
    dst = rr.Layout(rr.Mesh(list(range(n_dst))), (Shard(1),))
    return src, dst


def _fill(actors, full_by_name, layout_by_name, side_dtype=None):
    for r, a in enumerate(actors):
        ray.get(a.set.remote({k: rr.shard_tensor(v if side_dtype is None else v.to(side_dtype),
                                                 layout_by_name[k], r).contiguous()
                              for k, v in full_by_name.items()}))


def _check(actors, full, layout, name, dtype=None):
    for r, a in enumerate(actors):
        got = ray.get(a.get.remote())[name]
        want = rr.shard_tensor(full if dtype is None else full.to(dtype), layout, r)
        if not torch.equal(got, want):
            raise AssertionError(f"{name!r} on destination {r} differs")


# ---- steps ----------------------------------------------------------------------------------

@step(60)
def environment(ctx):
    if ctx.dry:
        return f"CPU dry run, torch {torch.__version__}, ray {ray.__version__}"
    p = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return (f"{ctx.gpus} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl}, ray {ray.__version__}")


@step(120)
def pack_bandwidth(ctx):
    """Pack a bucket of column blocks (strided reads) and unpack it; compare with a plain copy."""
    rows, cols = (1024, 1024) if ctx.dry else (8192, 8192)
    full = torch.randn(rows, cols, device=ctx.device).to(torch.bfloat16)
    src = rr.Layout(rr.Mesh([0]), (Replicate(),))
    dst = rr.Layout(rr.Mesh([0, 1, 2, 3]), (Shard(1),))
    spec = rr.TensorSpec((rows, cols), torch.bfloat16, src, dst)
    plan = rr.plan({"w": spec}, src_domains=["a"], dst_domains=["b"] * 4)
    nbytes = rows * cols // 4 * 2
    dst_shard = torch.empty(rows, cols // 4, dtype=torch.bfloat16, device=ctx.device)
    # The runtime's compiled programs of source 0 and destination 0, bound to their shards:
    # the bucket source 0 sends destination 0, packed and unpacked as the executor does.
    sender = compile_program(plan, [Endpoint("src", 0)], 1 << 30)
    receiver = compile_program(plan, [Endpoint("dst", 0)], 1 << 30)
    sender.bind({("src", 0, 0): full})
    receiver.bind({("dst", 0, 0): dst_shard})
    send = next(s.send for s in sender.steps if s.kind == SEND and s.peer == 1)
    recv = receiver.steps[0].recv
    buf = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    contiguous = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 255)

    copy_s = _timed(ctx, lambda: buf.copy_(contiguous))
    pack_s = _timed(ctx, lambda: send.pack(buf))
    unpack_s = _timed(ctx, lambda: recv.unpack(buf))
    if not torch.equal(dst_shard, rr.shard_tensor(full, dst, 0)):
        raise AssertionError("pack/unpack round trip differs")
    gbs = lambda s: nbytes / s / 1e9
    ratio = min(copy_s / pack_s, copy_s / unpack_s)
    text = (f"{nbytes / 1e6:.1f} MB bucket: copy {gbs(copy_s):.1f} GB/s, pack {gbs(pack_s):.1f} "
            f"GB/s, unpack {gbs(unpack_s):.1f} GB/s -> {ratio:.2f} of copy (goal 0.80)")
    if not ctx.dry and ratio < 0.8:
        raise AssertionError(text)
    return text


@step(180)
def copy_tables(ctx):
    """A bucket of many small strided regions packed by one copy-table launch against one
    foreach call over the same regions: bit-exact both ways; host time per pack (the launch,
    what the simulator's GPU presets charge per bucket end besides the executor's step) and
    device time."""
    from ray_reshard.execution import cuda_copy, regions
    from ray_reshard.sim import cluster
    n, rows, cols, width = (64, 16, 64, 16) if ctx.dry else (2000, 64, 1024, 128)
    if ctx.dry:
        engine = regions.HostCopy()
    else:
        if not cuda_copy.available():
            raise AssertionError(f"copy tables cannot run: {cuda_copy.why_not()}")
        engine = cuda_copy.engine()
    tensors = [torch.randn(rows, cols, device=ctx.device).to(torch.bfloat16) for _ in range(n)]
    views = [t[:, (k % 4) * width:(k % 4 + 1) * width] for k, t in enumerate(tensors)]
    size = rows * width * 2
    offsets = [k * size for k in range(n)]
    nbytes = n * size
    table = regions.build(views, offsets)
    engine.upload([table], torch.device(ctx.device))
    wire = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    ref = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    wires = [ref[o:o + size].view(torch.bfloat16).view(rows, width) for o in offsets]

    pack_table = lambda: engine.copy(table, wire, True)
    pack_foreach = lambda: torch._foreach_copy_(wires, views)
    host_table = _timed(ctx, pack_table, reps=20, trials=3, sync=False)
    host_foreach = _timed(ctx, pack_foreach, trials=3, sync=False)
    dev_table = _timed(ctx, pack_table, reps=20, trials=3)
    dev_foreach = _timed(ctx, pack_foreach, trials=3)
    if not torch.equal(wire, ref):
        raise AssertionError("copy-table pack differs from foreach")
    outs = [torch.zeros(rows, cols, dtype=torch.bfloat16, device=ctx.device)[:, :width]
            for _ in range(n)]
    back = regions.build(outs, offsets)
    engine.upload([back], torch.device(ctx.device))
    engine.copy(back, wire, False)
    _sync(ctx)
    if not all(torch.equal(o, v) for o, v in zip(outs, views)):
        raise AssertionError("copy-table unpack differs")
    gbs = lambda t: nbytes / t / 1e9
    return (f"{n} regions, {nbytes / 1e6:.1f} MB: host per pack: table {host_table * 1e6:.1f} us, "
            f"foreach {host_foreach * 1e6:.1f} us; device: table {gbs(dev_table):.1f} GB/s, "
            f"foreach {gbs(dev_foreach):.1f} GB/s (simulator's launch estimate "
            f"{cluster.LAUNCH_S * 1e6:.0f} us)")


def _shared_refit_setup(ctx, n_src=2, n_dst=3):
    frac = FRAC
    rows = max(8, int(ctx.mb * 2**20 / 4 / 1024) // 8 * 8)
    full = torch.randn(rows, 1024)
    src_l, dst_l = _layouts(n_src, n_dst)
    specs = {"w": rr.TensorSpec((rows, 1024), torch.float32, src_l, dst_l),
             "h": rr.TensorSpec((rows, 1024), torch.bfloat16, src_l, dst_l,
                                src_dtype=torch.float32)}
    src, dst = _ranks(ctx, n_src, frac), _ranks(ctx, n_dst, frac)
    _fill(src, {"w": full, "h": full}, {"w": src_l, "h": src_l})
    for r, a in enumerate(dst):
        shape = dst_l.local_shape(r, (rows, 1024))
        ray.get(a.set.remote({"w": torch.zeros(shape), "h": torch.zeros(shape, dtype=torch.bfloat16)}))
    return full, specs, src, dst, src_l, dst_l


STATE: dict = {}


@step(240)
def ipc_refit_shared_gpu(ctx):
    """Five actors on one GPU (fractional num_gpus; four in the dry run): refits between
    layouts over CUDA IPC."""
    full, specs, src, dst, src_l, dst_l = _shared_refit_setup(ctx, 2, 2 if ctx.dry else 3)
    if not ctx.dry:
        where = ray.get([a.where.remote() for a in src + dst])
        if len({w["visible"] for w in where}) != 1:
            raise AssertionError(f"expected actors sharing one GPU, got {where}")
    g = rr.ReshardGroup(src, dst, timeout_s=120)
    STATE.update(group=g, full=full, specs=specs, src=src, dst=dst, src_l=src_l, dst_l=dst_l)
    res = [g.refit({"w": specs["w"]}) for _ in range(3)]
    _check(dst, full, dst_l, "w")
    if res[-1].bytes_by_path["network"] != 0:
        raise AssertionError(f"one node, yet network bytes moved: {res[-1].bytes_by_path}")
    best = min(r.seconds for r in res)
    moved = sum(res[-1].bytes_by_path.values())
    return (f"backend {g.backend}, {moved / 1e6:.0f} MB per refit (local+domain), best "
            f"{best * 1e3:.1f} ms = {moved / best / 1e9:.2f} GB/s, bit-exact")


@step(120)
def dtype_conversion(ctx):
    g, s = STATE["group"], STATE
    if g is None:
        raise Skip("needs ipc_refit_shared_gpu")
    res = g.refit({"h": s["specs"]["h"]})
    _check(s["dst"], s["full"], s["dst_l"], "h", torch.bfloat16)
    return f"float32 -> bfloat16 on the sender, {res.seconds * 1e3:.1f} ms, bit-exact"


@step(120)
def atomic_refit(ctx):
    g, s = STATE["group"], STATE
    new = torch.randn_like(s["full"])
    _fill(s["src"], {"w": new}, {"w": s["src_l"]})
    res = g.refit({"w": s["specs"]["w"]}, atomic=True)
    _check(s["dst"], new, s["dst_l"], "w")
    s["full"] = new
    return f"{res.seconds * 1e3:.1f} ms, extra {res.extra_bytes / 1e6:.1f} MB/rank, bit-exact"


@step(120)
def delta_codec(ctx):
    """The delta codec on the device: a bf16 bucket with 10% of its elements changed encoded
    against its baseline and decoded back, bit-exact; throughput of each."""
    from ray_reshard.execution import codecs, delta as codec
    n = (4 if ctx.dry else 256) << 19                 # bf16 elements (4 or 256 MiB)
    base = torch.randint(-30000, 30000, (n,), dtype=torch.int16, device=ctx.device)
    new = base.clone()
    new[torch.rand(n, device=ctx.device) < 0.1] += 1
    nb, bb = new.view(torch.uint8), base.view(torch.uint8)
    enc = codecs.encode(nb, bb, 2)
    t_enc = _timed(ctx, lambda: codecs.encode(nb, bb, 2), reps=3, trials=3)
    out = bb.clone()
    codecs.decode(enc.kind, enc.payload, out, 2)
    if not torch.equal(out, nb) or codec.checksum(out, 2) != enc.check:
        raise AssertionError("decode(encode(x)) != x")
    t_dec = _timed(ctx, lambda: codecs.decode(enc.kind, enc.payload, bb.clone(), 2), reps=3,
                   trials=3)
    return (f"{codec.KINDS[enc.kind]}, payload {enc.nbytes / nb.numel():.3f} of dense; encode "
            f"{nb.numel() / t_enc / 1e9:.1f} GB/s, decode (with a copy) "
            f"{nb.numel() / t_dec / 1e9:.1f} GB/s, bit-exact")


@step(240)
def delta_refit(ctx):
    """Delta refits of device tensors between two 'domains' on one GPU (gloo: NCCL needs a GPU
    per rank), equal to the sources' bytes; fewer network bytes than dense at 1% changed."""
    full, specs, src, dst, src_l, dst_l = _shared_refit_setup(ctx, 2, 2)
    spec = {"w": specs["w"]}
    g = rr.ReshardGroup(src, dst, backend="gloo", src_domains=["a", "a"],
                        dst_domains=["b", "b"], timeout_s=120)
    try:
        first = g.refit(spec, delta=True)
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):
            full = full.clone()
            m = torch.rand(full.shape, generator=gen) < 0.01
            full[m] += 1
            _fill(src, {"w": full}, {"w": src_l})
            res = g.refit(spec, delta=True)
            _check(dst, full, dst_l, "w")
    finally:
        g.close()
    d = res.delta
    if d["fallbacks"] or not 0 < d["network_bytes"] < d["dense_network_bytes"] / 2:
        raise AssertionError(f"expected a delta of a few bytes, got {d}")
    return (f"first {first.seconds * 1e3:.0f} ms (dense, no baseline), then "
            f"{res.seconds * 1e3:.0f} ms for {d['network_bytes'] / 1e6:.2f} MB of "
            f"{d['dense_network_bytes'] / 1e6:.1f} MB, bit-exact")


@step(180)
def rank_fails_mid_refit(ctx):
    """A source stuck in the refit is killed: RefitError well before the deadline, naming it;
    destinations keep their weights (atomic); the group is rebuilt with a replacement."""
    g, s = STATE["group"], STATE
    old = s["full"]
    _fill(s["src"], {"w": torch.randn_like(old)}, {"w": s["src_l"]})
    victim = s["src"][1]
    ray.get(victim.slow_from.remote(1))       # each refit looks its tensors up once
    timeout = 60.0
    out: dict = {}

    def go():
        t0 = time.monotonic()
        try:
            g.refit({"w": s["specs"]["w"]}, atomic=True, timeout_s=timeout)
            out["error"] = None
        except Exception as e:
            out["error"] = e
        out["end"] = time.monotonic()
        out["t0"] = t0

    th = threading.Thread(target=go, daemon=True)
    th.start()
    time.sleep(3.0)
    killed = time.monotonic()
    ray.kill(victim)
    th.join(timeout + 30)
    if th.is_alive():
        raise AssertionError("refit still running long after its deadline")
    err = out["error"]
    if not isinstance(err, rr.RefitError):
        raise AssertionError(f"expected RefitError, got {err!r}")
    after = out["end"] - killed
    if ("src", 1) not in err.failed_ranks:
        raise AssertionError(f"RefitError does not name src rank 1: {err}")
    _check(s["dst"], old, s["dst_l"], "w")
    if after > timeout / 2:
        raise AssertionError(f"RefitError {after:.1f} s after the kill (deadline {timeout:.0f} s)")
    # rebuild with a replacement source
    frac = {} if ctx.dry else {"num_gpus": FRAC}
    repl = Rank.options(**frac).remote(ctx.device)
    s["src"][1] = repl
    _fill(s["src"], {"w": old}, {"w": s["src_l"]})
    g.update(src_actors=s["src"])
    g.refit({"w": s["specs"]["w"]})
    _check(s["dst"], old, s["dst_l"], "w")
    return (f"RefitError {after:.1f} s after the kill (deadline {timeout:.0f} s), names "
            f"{err.failed_ranks}, old weights kept; rebuilt with a replacement and refit again")


@step(240)
def nccl(ctx):
    s = STATE
    parts = []
    # actors sharing one GPU: NCCL refused before anything is built, naming them
    try:
        rr.ReshardGroup(s["src"], s["dst"], backend="nccl").close()
        raise AssertionError("backend='nccl' accepted for actors sharing one GPU"
                             if not ctx.dry else "backend='nccl' accepted on CPU actors")
    except ValueError as e:
        want = "needs every actor on a GPU" if ctx.dry else "share GPU"
        if want not in str(e):
            raise AssertionError(f"unclear refusal: {e}")
        parts.append("refused for shared GPU" if not ctx.dry else "refused on CPU")
    if ctx.dry:
        raise Skip("; ".join(parts) + "; NCCL itself needs CUDA")
    # one rank on one GPU: a one-rank communicator, local copies
    a = Rank.options(num_gpus=FRAC).remote("cuda")
    lay = rr.Layout(rr.Mesh([0]), (Replicate(),))
    w = torch.randn(1024, 1024)
    ray.get(a.set.remote({"w": w, "out": torch.zeros_like(w)}))
    spec = rr.TensorSpec((1024, 1024), torch.float32, lay, lay, dst_slots={0: rr.Slot("out")})
    with rr.ReshardGroup([a], [a], backend="nccl") as g1:
        g1.refit({"w": spec})
    if not torch.equal(ray.get(a.get.remote())["out"], w):
        raise AssertionError("one-rank NCCL refit differs")
    parts.append("one-rank NCCL group ok")
    if ctx.gpus < 2:
        return "; ".join(parts) + "; a refit between GPUs over NCCL needs 2 GPUs (not run)"
    # two GPUs, each actor sees only its own: NCCL over the network path, CUDA IPC on the node.
    # Whole GPUs are needed: free the shared one first.
    STATE["group"].close()
    STATE["group"] = None
    for actor in [*s["src"], *s["dst"], a]:
        ray.kill(actor)
    src, dst = _ranks(ctx, 1, 1.0), _ranks(ctx, 1, 1.0)
    src_l, dst_l = _layouts(1, 1)
    full = torch.randn(4096, 1024)
    _fill(src, {"w": full}, {"w": src_l})
    ray.get(dst[0].set.remote({"w": torch.zeros(4096, 1024)}))
    sp = {"w": rr.TensorSpec((4096, 1024), torch.float32, src_l, dst_l)}
    with rr.ReshardGroup(src, dst, backend="nccl", src_domains=["a"], dst_domains=["b"]) as gn:
        gn.refit(sp)
        _check(dst, full, dst_l, "w")
        parts.append(f"NCCL refit between 2 GPUs ok ({gn.backend})")
    ray.get(dst[0].set.remote({"w": torch.zeros(4096, 1024)}))
    with rr.ReshardGroup(src, dst) as gi:
        res = gi.refit(sp)
        _check(dst, full, dst_l, "w")
        parts.append(f"CUDA IPC between GPUs invisible to each other ok "
                     f"({res.bytes_by_path})")
    return "; ".join(parts)


# ---- driver ---------------------------------------------------------------------------------

def run_steps(ctx, only=None) -> list:
    results = []
    for name, fn, limit in STEPS:
        if only and name not in only:
            continue
        box: dict = {}

        def target():
            try:
                box["detail"] = fn(ctx)
                box["status"] = "PASS"
            except Skip as e:
                box["status"], box["detail"] = "SKIP", str(e)
            except BaseException as e:
                box["status"] = "FAIL"
                box["detail"] = f"{type(e).__name__}: {e}"
                box["trace"] = traceback.format_exc()

        t0 = time.perf_counter()
        th = threading.Thread(target=target, daemon=True)
        th.start()
        th.join(limit)
        secs = time.perf_counter() - t0
        if th.is_alive():
            box = {"status": "FAIL", "detail": f"no result within its {limit:.0f} s limit"}
        line = f"{box['status']:4}  {name:24} {secs:7.2f} s  {box.get('detail') or ''}"
        print(line, flush=True)
        if box["status"] == "FAIL" and box.get("trace"):
            print(box["trace"], file=sys.stderr, flush=True)
        results.append({"step": name, "status": box["status"], "seconds": round(secs, 3),
                        "detail": box.get("detail")})
        if th.is_alive():
            break                               # a stuck step: stop here rather than pile up
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run every step on CPU actors with small tensors (CI)")
    ap.add_argument("--time-limit", type=float, default=900.0,
                    help="hard limit for the whole run in seconds (default 900)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--only", nargs="*", help="run only these steps")
    args = ap.parse_args(argv)
    # The hard limit: whatever happens, the process ends (with every thread's stack on stderr).
    faulthandler.dump_traceback_later(args.time_limit, exit=True)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("FAIL  environment: no CUDA device (use --cpu-dry-run on a machine without one)")
        return 2
    ctx = Ctx(args.cpu_dry_run)
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             num_cpus=2 if ctx.dry else min(16, os.cpu_count() or 1),
             num_gpus=0 if ctx.dry else ctx.gpus)
    t0 = time.perf_counter()
    STATE.update(group=None)
    try:
        results = run_steps(ctx, args.only)
    finally:
        g = STATE.get("group")
        if g is not None:
            try:
                g.close()
            except Exception:
                pass
        ray.shutdown()
    failed = [r["step"] for r in results if r["status"] == "FAIL"]
    print(f"{'FAIL' if failed else 'PASS'}  {len(results)} steps in {time.perf_counter() - t0:.1f} s"
          f"{': failed ' + ', '.join(failed) if failed else ''}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dry_run": ctx.dry, "results": results}, f, indent=1)
    faulthandler.cancel_dump_traceback_later()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
