"""The executor and the first refit at real-model scale (one process, no cluster).

    python -m ray_reshard bench-replay [--model deepseek-v3] [--scale 8] [--repeat 3] [--runs 1]
    python -m ray_reshard bench-first-refit [--models deepseek-v3,qwen3-235b] [--wide 1] [--repeats 3]

replay: the busiest ranks' compiled programs through the real executor over a loopback channel;
first-refit: what the driver and the busiest processes pay on a spec set's first refit. Both
in CPU time. Method: docs/benchmark-commands.md (bench-replay and bench-first-refit).
"""
from __future__ import annotations

import gc
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

from ..._gc import gc_paused
from ...planning.plan import Plan, plan as make_plan
from ...planning.share import build_share
from ...planning.moves import Endpoint
from ...execution import regions
from ...execution.part import Part
from ...execution.program import Program, Step, compile_program, per_item_min_bytes
from ...models import VLLM, Megatron, Recipe
from ...runtime.channel import LoopbackChannel
from ...runtime.executor import Transports, default_window, run_program
from ...runtime.local_check import StorageSignature
from ..cli_args import DEEPSEEK_V3, Parser, QWEN3_235B, output_file
from .harness import settle
from .model_bytes import DSV3_PP16, QWEN3_PP8

NIC_BYTES_PER_S = 50e9          # 400 Gb/s per GPU (DGX H100)
BUCKET = 16 << 20
RANKS_PER_DOMAIN = 8

CASES = {
    "deepseek-v3": ("DeepSeek-V3", DEEPSEEK_V3, [
        (Megatron(tp=1, ep=16, etp=1, dp=16, **DSV3_PP16), VLLM(tp=32, dp=8)),
        (Megatron(tp=1, ep=16, etp=1, dp=16, **DSV3_PP16), VLLM(tp=32, dp=8, ep=32)),
    ]),
    "qwen3-235b": ("Qwen3-235B-A22B", QWEN3_235B, [
        (Megatron(tp=4, ep=16, etp=1, dp=4, **QWEN3_PP8), VLLM(tp=8, dp=16)),
    ]),
}
# 1024 -> 1024 ranks: DeepSeek-V3 on PP16 x EP64 -> TP32 x DP32.
WIDE = ("DeepSeek-V3 1024", DEEPSEEK_V3,
        (Megatron(tp=1, ep=64, etp=1, dp=64, **DSV3_PP16), VLLM(tp=32, dp=32)))


def domains(n: int, side: str, per_domain: int = RANKS_PER_DOMAIN) -> list:
    return [(side, r // per_domain) for r in range(n)]


def build(config, train, infer, lookup: Optional[list] = None,
          per_domain: int = RANKS_PER_DOMAIN):
    """Specs and plan of a recipe, with the CPU seconds of each. With `lookup`, also time
    what the driver's plan cache does first at every refit (`lookup` gets its seconds)."""
    t0 = time.process_time()
    specs = Recipe(config, train, infer, hf_experts="split").specs(torch.bfloat16)
    t1 = time.process_time()
    if lookup is not None:
        hash(tuple(specs.items()))
        lookup.append(time.process_time() - t1)
        t1 = time.process_time()
    p = make_plan(specs, domains(train.world, "train", per_domain),
                  domains(infer.world, "infer", per_domain))
    st = p.stats
    t2 = time.process_time()
    return specs, p, st, t1 - t0, t2 - t1


def busiest(p: Plan) -> tuple[Endpoint, Endpoint]:
    d = max(p.recv_bytes_by_rank.items(), key=lambda kv: (kv[1], -kv[0]))[0]
    s = max(p.send_bytes_by_rank.items(), key=lambda kv: (kv[1], -kv[0]))[0]
    return Endpoint("dst", d), Endpoint("src", s)


# ------------------------------------------------------------------------------- replay
def _scale_part(part: Part, origin_shapes: dict, f: int) -> Part:
    """The same items with every extent divided by f (at least 1), in shards scaled alike."""
    slices, shapes, numels, offs, nbs = [], [], [], [], []
    off = 0
    for h, sl, w in zip(part.held, part.slices, part.wire):
        lim = origin_shapes[h]
        new = []
        for s, n in zip(sl, lim):
            a = min(s.start // f, n - 1)
            b = max(a + 1, min(-(-s.stop // f), n))
            new.append(slice(a, b))
        shape = tuple(s.stop - s.start for s in new)
        k = 1
        for x in shape:
            k *= x
        nb = k * torch.empty((), dtype=w).element_size()
        slices.append(tuple(new))
        shapes.append(shape)
        numels.append(k)
        offs.append(off)
        nbs.append(nb)
        off += nb
    return Part(list(part.held), slices, shapes, numels, list(part.wire), offs, nbs, off)


def scaled_program(p: Plan, prog: Program, f: int) -> tuple[Program, dict]:
    """`prog` with extents divided by f, and zero-filled shards to bind it to."""
    shard_shapes, views = {}, {}
    for h, (side, rank, ti) in enumerate(prog.held):
        spec = p.specs[ti]
        box = spec.layout(side).box(rank, spec.shape)
        shape = tuple(max(1, -(-n // f)) for n in box.sizes)
        shard_shapes[h] = shape
        dtype = spec.source_dtype if side == "src" else spec.dtype
        views[(side, rank, ti)] = torch.zeros(shape, dtype=dtype)
    steps = []
    for s in prog.steps:
        send = _scale_part(s.send, shard_shapes, f) if s.send is not None else None
        recv = _scale_part(s.recv, shard_shapes, f) if s.recv is not None else None
        nbytes = (send or recv).nbytes
        steps.append(Step(s.kind, s.key, s.path, s.peer, nbytes, s.per_item, s.after, send, recv))
    return Program(list(prog.held), steps, prog.bucket_bytes), views


def per_item_path(prog: Program, views: dict) -> float:
    """Seconds for what the executor did per item before compiled programs, on the same items:
    cut the region from the shard, view the bucket's bytes as it, copy (no batching, no cached
    views; the box arithmetic it also did per item is left out, so this is a lower bound)."""
    shard = [views[k] for k in prog.held]
    bufs = {}
    t0 = time.process_time()
    for s in prog.steps:
        for part, packing in ((s.send, True), (s.recv, False)):
            if part is None:
                continue
            buf = bufs.get(part.nbytes)
            if buf is None:
                buf = bufs[part.nbytes] = torch.empty(part.nbytes, dtype=torch.uint8)
            for h, sl, shape, w, off, nb in zip(part.held, part.slices, part.shapes, part.wire,
                                                 part.offsets, part.item_bytes):
                region = shard[h][sl]
                wire = buf[off:off + nb].view(w).view(shape)
                if packing:
                    wire.copy_(region)
                else:
                    region.copy_(wire)
    return time.process_time() - t0


def steady_check(p: Plan, prog: Program, views: dict, repeat: int = 20) -> tuple:
    """What a steady-state refit's check costs this process (see `local_check.StorageSignature`):
    (local tensors, shards, seconds per local tensor, seconds per shard). The local tensors are
    the recipe's storage names for the program's shards (small 2-D parameters as stand-ins: a
    signature does not depend on a tensor's size); the view table is the program's."""
    names = tuple(dict.fromkeys(p.specs[ti].slot(side, rank, p.names[ti]).storage
                                for side, rank, ti in prog.held))
    storage = {n: torch.nn.Parameter(torch.zeros(4, 4)) for n in names}
    with gc_paused():                      # as the worker runs it
        last = StorageSignature(storage, names)
        t0 = time.perf_counter()
        for _ in range(repeat):
            assert last.matches(storage)
        per_storage = (time.perf_counter() - t0) / repeat / len(names)
        t0 = time.perf_counter()
        for _ in range(repeat):
            dict(views)
        per_shard = (time.perf_counter() - t0) / repeat / max(1, len(views))
    return len(names), len(views), per_storage, per_shard


def replay(args) -> dict:
    """Print the replay table and the steady-state check table; returns the run figures, each
    the median of `args.repeat` runs with their range and values."""
    torch.set_num_threads(1)         # CPU time below is one thread's work
    title, config, layouts = CASES[args.model]
    print(f"{title}: replay of the busiest ranks' compiled programs through the executor over a "
          f"loopback channel ({args.bucket_mb} MiB buckets, {args.wire} wire format, "
          f"extents / {args.scale} per dim). run cpu s: the median [range] of {args.repeat} runs "
          f"after a warm-up run, each starting once the machine is quiet; us/item and share "
          f"from that median")
    head = (f"{'layout':<40} {'rank':>6} {'items':>7} {'steps':>6} {'turns s':>7} {'compile s':>9} "
            f"{'bind s':>7} {'run cpu s':>21} {'wall s':>6} {'us/item':>7} {'NIC bound s':>11} {'share':>6} "
            f"{'per-item path us/item':>21} {'steps w/o copies us/step':>24} "
            f"{'rebind s (foreach / tables)':>27}")
    print(head)
    print("-" * len(head))
    checks, figures = [], []
    for train, infer in layouts:
        specs, p, st, _, _ = build(config, train, infer)
        bound_s = max(st.max_recv_bytes, st.max_send_bytes) / NIC_BYTES_PER_S
        lay = f"{train} -> {infer}".replace("Megatron ", "").replace("vLLM ", "")
        for ep in busiest(p):
            gc.collect()
            # The driver counts the network turns once and ships them with the plan: not part
            # of a process's compile (timed apart, once per layout).
            t0 = time.process_time()
            p.network_turns(args.bucket_mb << 20)
            t_turns = time.process_time() - t0
            t0 = time.process_time()
            share = build_share(p, [ep], args.bucket_mb << 20)
            prog = compile_program(p, [ep], args.bucket_mb << 20, transfers=share,
                                   per_item_bytes=per_item_min_bytes(args.wire))
            t_compile = time.process_time() - t0
            small, views = scaled_program(p, prog, args.scale)
            tr = Transports(LoopbackChannel(), None, torch.device("cpu"),
                            default_window(args.bucket_mb << 20))
            deadline = time.monotonic() + 600
            # A steady-state refit: the actor's checks found every local tensor as last time,
            # so the views are the same objects (named by one token) and not re-checked.
            token = object()
            with gc_paused():     # as the runtime binds: inside a refit, collector paused
                t0 = time.process_time()
                small.bind(views, token)
                t_bind = time.process_time() - t0
            runs, walls, bare = [], [], []
            run_program(small, views, tr, deadline, token)         # warm-up, not counted
            for _ in range(args.repeat):
                settle()
                t0, c0 = time.perf_counter(), time.process_time()
                stats = run_program(small, views, tr, deadline, token)
                runs.append(time.process_time() - c0)
                walls.append(time.perf_counter() - t0)
                clock = stats["clock"]
                bare.append(walls[-1] - clock["pack"] - clock["unpack"])
            items = small.n_items
            mid = statistics.median(runs)
            old = min(per_item_path(small, views) for _ in range(args.repeat)) / items * 1e6
            checks.append((lay, ep, steady_check(p, prog, views)))
            # Binding again from scratch, without and with every part's copy table built as on
            # a GPU (the host engine builds the same tables; uploading them is left out).
            rebind = []
            for engine in (None, regions.HostCopy()):
                small.unbind()
                gc.collect()
                with gc_paused():
                    t0 = time.process_time()
                    small.bind(views, None, engine=engine)
                    rebind.append(time.process_time() - t0)
            print(f"{lay:<40} {str(ep):>6} {items:>7} {len(small.steps):>6} {t_turns:>7.2f} {t_compile:>9.2f} "
                  f"{t_bind:>7.2f} {f'{mid:.3f} [{min(runs):.3f}-{max(runs):.3f}]':>21} "
                  f"{statistics.median(walls):>6.2f} {mid / items * 1e6:>7.2f} {bound_s:>11.2f} "
                  f"{100 * mid / bound_s:>5.1f}% {old:>21.1f} "
                  f"{min(bare) / len(small.steps) * 1e6:>24.1f} "
                  f"{f'{rebind[0]:.2f} / {rebind[1]:.2f}':>27}", flush=True)
            figures.append({"figure": f"replay run CPU s, {lay}, {ep}", "measured": mid,
                            "low": min(runs), "high": max(runs), "values": runs,
                            "runs": len(runs), "items": items, "us_per_item": mid / items * 1e6})
            del small, views, prog, share
        del specs, p
    print()
    print("A steady-state refit's check of the same ranks' local tensors (nothing changed since "
          "the last refit): one signature per local tensor, one copy of the view table")
    head = (f"{'layout':<40} {'rank':>6} {'local tensors':>13} {'shards':>7} "
            f"{'us/local tensor':>15} {'us/shard':>8} {'check ms':>8}")
    print(head)
    print("-" * len(head))
    for lay, ep, (n_storage, n_shard, per_storage, per_shard) in checks:
        print(f"{lay:<40} {str(ep):>6} {n_storage:>13} {n_shard:>7} {per_storage * 1e6:>15.2f} "
              f"{per_shard * 1e6:>8.3f} {(n_storage * per_storage + n_shard * per_shard) * 1e3:>8.2f}",
              flush=True)
    return {"figures": figures, "repeats": args.repeat}


def replay_runs(args) -> dict:
    """`replay` `args.runs` times, each in a fresh process (its tables printed as it goes), then
    per rank the median of the runs' medians with their range: runs in one process share its
    state, so their spread understates how far a further run moves."""
    # every option of this replay but --runs and --json, for each run's own command line
    same = [a for k, v in vars(args).items() if k not in ("runs", "json")
            for a in (f"--{k.replace('_', '-')}", str(v))]
    per_run = []
    for k in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "replay.json")
            print(f"run {k + 1} of {args.runs}, in a fresh process:", flush=True)
            subprocess.run([sys.executable, "-m", "ray_reshard", "bench-replay", *same,
                            "--json", path], check=True)
            with open(path) as f:
                per_run.append(json.load(f)["figures"])
            print(flush=True)
    print(f"Over the {args.runs} runs: run cpu s, the median of each run's median [range of "
          f"those medians]")
    figures = []
    for i, first in enumerate(per_run[0]):
        medians = [run[i]["measured"] for run in per_run]
        mid = statistics.median(medians)
        figures.append(dict(first, measured=mid, low=min(medians), high=max(medians),
                            values=medians, runs=len(medians),
                            us_per_item=mid / first["items"] * 1e6))
        print(f"  {first['figure'][len('replay run CPU s, '):]:<48} {mid:.3f} "
              f"[{min(medians):.3f}-{max(medians):.3f}]  {mid / first['items'] * 1e6:.2f} us/item",
              flush=True)
    return {"figures": figures, "repeats": args.repeat, "runs": args.runs}


# --------------------------------------------------------------------------- first refit
GOAL_DRIVER_S = 0.4          # DeepSeek-V3 256 -> 256: the driver's CPU seconds, specs included
GOAL_INSTALL_S = 0.2         # and the busiest process's whole install
GOAL_WIDE_FACTOR = 1.5       # 1024 -> 1024: at most this many times the 256 -> 256 figures


def actor_step(path: str, side: str, rank: int, n_src: int, n_dst: int,
               bucket_bytes: int) -> dict:
    """What one actor does with the shipped plan, timed in CPU seconds: unpickle it (load),
    then the runtime's own `worker.install` (localize the plan, build the shard table,
    compile this process's program), with one process per rank as the group has it."""
    from ...runtime import worker
    from ...runtime.process_state import hold_state

    with open(path, "rb") as f:
        blob = f.read()
    torch.set_num_threads(1)
    ep_pid = {Endpoint("src", r): r for r in range(n_src)}
    ep_pid.update({Endpoint("dst", r): n_src + r for r in range(n_dst)})
    me = ep_pid[Endpoint(side, rank)]
    hold_state("bench", me, ep_pid, bucket_bytes)
    gc.collect()          # an actor at rest: no garbage pending from starting this process
    t0 = time.process_time()
    q = pickle.loads(blob)
    t_load = time.process_time() - t0
    t0 = time.process_time()
    worker.install(None, "bench", "plan", q, None, "reshard")
    t_install = time.process_time() - t0
    return {"load": t_load, "install": t_install}


def _in_fresh_process(name: str, *args) -> dict:
    """This module's function `name`(*args) in a new Python process; its JSON result."""
    code = (f"import json; from ray_reshard.tools.bench.scale import {name}; "
            f"print(json.dumps({name}{args!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cases(models: str, wide: int) -> list:
    cases = []
    for key in models.split(","):
        title, config, layouts = CASES[key]
        cases.append((title, config, layouts[0]))
    if wide:
        cases.append(WIDE)
    return cases


def first_refit_once(models: str, wide: int, index: int, bucket_mb: int,
                     ranks_per_domain: int) -> dict:
    """One measurement of case `index` of `_cases(models, wide)`: the driver's steps, then the
    busiest destination's and source's load + install, each in a fresh process. Run it in a
    fresh process too (`_in_fresh_process`): the planner's caches would make a second
    plan of the same layouts in one process cheaper than a driver's first."""
    title, config, (train, infer) = _cases(models, wide)[index]
    torch.set_num_threads(1)
    gc.collect()
    lookup: list = []        # the driver's plan cache looks a spec set up at every refit
    specs, p, st, t_specs, t_plan = build(config, train, infer, lookup, ranks_per_domain)
    t0 = time.process_time()
    turns = p.network_turns(bucket_mb << 20)      # as the driver does, once
    t_turns = time.process_time() - t0
    with gc_paused():
        t0 = time.process_time()
        blob = pickle.dumps(p, protocol=5)
        bytearray(blob)                  # ray.put writes the bytes into the store once
        t_put = time.process_time() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.pkl")
        with open(path, "wb") as f:
            f.write(blob)
        # each process holds nothing but the plan, as an actor
        got = [_in_fresh_process("actor_step", path, ep.side, ep.rank, train.world,
                                 infer.world, bucket_mb << 20) for ep in busiest(p)]
    t0 = time.process_time()                 # a later refit's lookup
    hash(tuple(specs.items()))
    lookup.append(time.process_time() - t0)
    return {"tensors": len(specs), "specs_s": t_specs, "lookup_s": lookup[0], "plan_s": t_plan,
            "turns_s": t_turns, "turns": turns is not None, "put_s": t_put,
            "driver_s": t_specs + lookup[0] + t_plan + t_turns + t_put,
            "shipped_mb": len(blob) / 1e6, "load_s": max(g["load"] for g in got),
            "install_dst_s": got[0]["install"], "install_src_s": got[1]["install"],
            "busiest_s": max(g["load"] + g["install"] for g in got), "next_lookup_s": lookup[1]}


def first_refit(args) -> dict:
    """Print the first-refit table and the goals; returns the figures per row: each the
    median of `args.repeats` measurements, the driver's and the busiest process's with their
    range, and each goal judged on the medians with in how many repeats it was met."""
    cases = _cases(args.models, args.wide)
    head = (f"{'model':<18} {'ranks':>11} {'tensors':>7} {'specs s':>7} {'lookup s':>8} "
            f"{'plan s':>6} {'turns s':>9} {'put s':>6} {'driver s':>17} {'shipped MB':>10} "
            f"{'load s':>6} {'install s (dst/src)':>19} {'busiest s':>17} {'next lookup s':>13}")
    torch.set_num_threads(1)
    print(f"First refit of a spec set, {args.bucket_mb} MiB buckets, {args.ranks_per_domain} "
          f"ranks per domain, CPU seconds on one thread, each the median of {args.repeats} "
          f"measurements (driver and busiest with their [range]). driver s = everything the "
          f"driver does from the recipe to the plan shipped: the recipe's specs() + looking the "
          f"spec set up in the plan cache + plan + its network turns (-: the plan keeps the "
          f"rotation schedule; in brackets the time to find that out) + pickling the plan and "
          f"copying the bytes once (ray.put). Each process (here a fresh process per rank: the "
          f"busiest destination and the busiest source) unpickles the plan (load) and runs the "
          f"runtime's own install (localize, shard table, compile); busiest s = the slower "
          f"one's load + install. The cases take turns within each repeat.")
    print(head)
    print("-" * len(head))
    rows, per_repeat = {}, [{} for _ in range(args.repeats)]
    # The cases take turns within each repeat: a slower spell of the shared host then lands on
    # every case, not on one, and each repeat's ratios compare measurements made together.
    by_case = [[] for _ in cases]
    for _ in range(args.repeats):
        for index, runs in enumerate(by_case):
            runs.append(_in_fresh_process("first_refit_once", args.models, args.wide, index,
                                          args.bucket_mb, args.ranks_per_domain))
    for index, (title, _, (train, infer)) in enumerate(cases):
        ranks = f"{train.world}->{infer.world}"
        runs = by_case[index]
        for k, one in enumerate(runs):
            per_repeat[k][ranks] = dict(one, model=title)
        row = {"model": title, "repeats": len(runs)}
        for key, first in runs[0].items():
            # a figure the repeats agree on (the tensor count, whether turns are kept) as it is
            row[key] = first if all(one[key] == first for one in runs) else \
                statistics.median(one[key] for one in runs)
        for key in ("driver_s", "busiest_s"):
            row[key + "_range"] = [min(one[key] for one in runs),
                                   max(one[key] for one in runs)]
        rows[ranks] = row
        turns_s = f"{row['turns_s']:.2f}" if row["turns"] else f"- ({row['turns_s']:.2f})"
        spread = lambda key: (f"{row[key]:.2f} [{row[key + '_range'][0]:.2f}-"
                              f"{row[key + '_range'][1]:.2f}]")
        print(f"{title:<18} {ranks:>11} {row['tensors']:>7.0f} {row['specs_s']:>7.2f} "
              f"{row['lookup_s']:>8.2f} {row['plan_s']:>6.2f} {turns_s:>9} "
              f"{row['put_s']:>6.2f} {spread('driver_s'):>17} {row['shipped_mb']:>10.1f} "
              f"{row['load_s']:>6.2f} {row['install_dst_s']:>9.2f} / "
              f"{row['install_src_s']:<7.2f} {spread('busiest_s'):>17} "
              f"{row['next_lookup_s']:>13.2f}", flush=True)
    goals = first_refit_goals(rows)
    each = [first_refit_goals(r) for r in per_repeat]
    for i, g in enumerate(goals):
        values = [e[i]["measured"] for e in each]
        g.update(low=min(values), high=max(values), runs=len(each),
                 runs_met=sum(e[i]["met"] for e in each), values=values)
    if goals:
        print("\ngoals (on the medians; [range] over the repeats):")
        for g in goals:
            print(f"  {g['goal']:<58} {g['measured']:6.2f} [{g['low']:.2f}-{g['high']:.2f}]  "
                  f"{'met' if g['met'] else 'NOT met'} ({g['runs_met']} of {g['runs']})")
    return {"rows": rows, "goals": goals, "repeats": args.repeats}


def first_refit_goals(rows: dict) -> list:
    """The first-refit goals against the DeepSeek-V3 rows measured (those present)."""
    out = []
    base = rows.get("256->256")
    if base is not None and base["model"] == "DeepSeek-V3":
        out.append({"goal": f"DeepSeek-V3 256->256 driver CPU s <= {GOAL_DRIVER_S:g}",
                    "measured": base["driver_s"], "met": base["driver_s"] <= GOAL_DRIVER_S})
        out.append({"goal": f"DeepSeek-V3 256->256 busiest install s <= {GOAL_INSTALL_S:g}",
                    "measured": base["busiest_s"], "met": base["busiest_s"] <= GOAL_INSTALL_S})
        wide = rows.get("1024->1024")
        if wide is not None:
            for key, what in (("driver_s", "driver"), ("busiest_s", "busiest install")):
                r = wide[key] / base[key]
                out.append({"goal": f"1024->1024 {what} <= {GOAL_WIDE_FACTOR:g}x 256->256",
                            "measured": r, "met": r <= GOAL_WIDE_FACTOR})
    return out


def main(argv=None, cmd: str = "replay") -> int:
    ap = Parser(prog=f"ray_reshard bench-{cmd}",
                description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mb", type=int, default=BUCKET >> 20)
    if cmd == "replay":
        ap.add_argument("--model", default="deepseek-v3", choices=sorted(CASES))
        ap.add_argument("--scale", type=int, default=8,
                        help="divide every item's extent by this per dimension")
        ap.add_argument("--repeat", type=int, default=3,
                        help="timed runs per rank after a warm-up (figures: their median)")
        ap.add_argument("--wire", default="cuda", choices=("cuda", "cpu"),
                        help="wire format of that device type (cuda: packed buckets; cpu: "
                             "large items as their own messages)")
        ap.add_argument("--runs", type=int, default=1,
                        help="runs of the whole replay, each in a fresh process (figures: the "
                             "median of the runs' medians, with their range)")
        ap.add_argument("--json", metavar="PATH", type=output_file,
                        help="also write the figures as JSON")
        args = ap.parse_args(argv)
        out = replay_runs(args) if args.runs > 1 else replay(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    else:
        ap.add_argument("--models", default="deepseek-v3,qwen3-235b")
        ap.add_argument("--wide", type=int, default=1, help="also the 1024 -> 1024 layout (0: no)")
        ap.add_argument("--repeats", type=int, default=3,
                        help="measurements per case (each figure their median)")
        ap.add_argument("--ranks-per-domain", type=int, default=RANKS_PER_DOMAIN,
                        help="GPUs per NVLink domain (72: GB200 NVL72)")
        ap.add_argument("--json", metavar="PATH", type=output_file,
                        help="also write the figures as JSON")
        args = ap.parse_args(argv)
        out = first_refit(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    main()
