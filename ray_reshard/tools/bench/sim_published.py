"""Published refit figures beside the simulator's predictions (same models, layouts, hardware class).

    python -m ray_reshard.tools.bench.sim_published

For each published row: the published reshard (and gather-broadcast or direct) figure, our
predicted reshard time, the bound, our direct point-to-point and gather_broadcast predictions.
Layout details the publications leave out are filled in as printed (e.g. Megatron's data
parallel size from the GPU count). `ours` uses the executor's CPU costs: per bucket end its
step and one copy-table launch (GPU presets), per tensor its view lookups; `per-item` copies
each region on its own at the per-item cost `bench-replay` measured (copy tables off); `links`
sets every CPU cost to zero (what the executor's ordering of the schedule takes when only links
limit each step). `--executor` prints each row with the executor's ring behaviours switched
(`host_overlap`: ring copies on events; `ring_carry`: late ring receives left behind).
"""
from __future__ import annotations

from dataclasses import dataclass

from ray_reshard.tools.cli_args import Parser
from ray_reshard.tools.simulate import build_parser, run



@dataclass(frozen=True)
class Published:
    """One published figure, exactly as its source gives it, and how this table simulates it.
    `source`: where (a URL, or a repository path at a commit); `date`: of that source;
    `measures`: what the figure is, in the source's words; `note`: what the source leaves out
    and this table fills in (an assumption of the prediction)."""

    who: str
    source: str
    date: str
    measures: str
    model: str
    train: str
    infer: str
    cluster: str
    reshard: str
    other: str
    note: str


M2N = "NCCL M2N bench, GB200 NVL72"
M2N_SRC = "github.com/NVIDIA/nccl-extensions nccl_m2n/README.md @ e5e3cea1"
M2N_WHAT = ("max latency: the slowest rank's wall clock summed over the benchmark's per-pattern "
            "timings (--validate --no-dedup); hierarchical (intra-NVL fan-out + cross-NVL ring) "
            "vs direct point-to-point; measurements the README calls historical")
BLOG = "NVIDIA blog (NCCL M2N reshard in NeMo RL)"
BLOG_SRC = "NVIDIA technical blog; its URL is not recorded here (figures as quoted by it)"
BLOG_WHAT = "weight refit time, reshard vs the gather-broadcast it replaces"
XFER = "NeMo RL NCCL-Xfer refit PR table"
XFER_SRC = "github.com/NVIDIA-NeMo/RL/pull/2808 (description)"
XFER_WHAT = ("refit time in the PR's test table; the hardware is not stated there, and a later PR "
             "(#2971) labels a table like it 'xferdtensor_python_impl (fallback path)'")
DOC = "NeMo RL nccl_reshard_refit design doc"
DOC_SRC = ("github.com/NVIDIA-NeMo/RL docs/design-docs/nccl-reshard-refit.md @ 36b5999a, "
           "'Expected Performance'")
DOC_WHAT = ("refit time; FFN weights (97.6% of the bytes here) through the reshard, the rest a "
            "packed broadcast")
ROWS = [
    Published(M2N, M2N_SRC, "2026-08-22", M2N_WHAT, "deepseek-v3", "megatron:pp=4,ep=16,dp=32",
              "vllm:tp=8,dp=16", "gb200-nvl72", "1.447 s", "direct 3.838 s",
              "128 -> 128 GPUs; the source's TP1 CP1 EP16 DP2 PP4 is Megatron dp=32 per stage"),
    Published(M2N, M2N_SRC, "2026-08-22", M2N_WHAT, "qwen3-235b",
              "megatron:tp=2,cp=2,pp=4,ep=16,etp=1", "vllm:tp=8,dp=8", "gb200-nvl72",
              "0.989 s", "direct 2.175 s",
              "64 -> 64 GPUs; the source's TP2 CP2 EP16 DP1 PP4: Megatron dp=4 fills each "
              "16-GPU stage; ETP1 assumed"),
    Published(BLOG + ", DGX H100", BLOG_SRC, "not recorded", BLOG_WHAT, "deepseek-v3",
              "megatron:pp=16,ep=16", "vllm:tp=32,dp=8", "dgx-h100", "2.6 s",
              "gather-broadcast 14.9 s", "DP filled in from the GPU count"),
    Published(BLOG + ", DGX GB200", BLOG_SRC, "not recorded", BLOG_WHAT, "deepseek-v3",
              "megatron:pp=16,ep=16", "vllm:tp=32,dp=8", "gb200-nvl72", "2.3 s",
              "gather-broadcast 6.1 s", "DP filled in from the GPU count"),
    Published(BLOG + ", DGX H100", BLOG_SRC, "not recorded", BLOG_WHAT, "qwen3-235b",
              "megatron:tp=4,pp=8,ep=16,etp=1", "vllm:tp=8,dp=16", "dgx-h100", "1.9 s",
              "gather-broadcast 6.4 s", "DP filled in from the GPU count"),
    Published(XFER, XFER_SRC, "2026-06-15", XFER_WHAT, "qwen3-235b",
              "megatron:tp=4,pp=8,ep=16,etp=1", "vllm:tp=8,dp=16", "dgx-h100", "4.56-4.85 s",
              "", "hardware not stated: simulated on DGX H100"),
    Published(XFER, XFER_SRC, "2026-06-15", XFER_WHAT, "deepseek-v3", "megatron:pp=16,ep=16",
              "vllm:tp=32,dp=8", "dgx-h100", "7.65-9.94 s", "",
              "hardware not stated: simulated on DGX H100"),
    Published("vLLM sharded RDT PR, 8 -> 8 H100", "github.com/vllm-project/vllm/pull/43375 "
              "(description, 'End-to-end validation')", "2026-05 (reviewed 2026-05-22)",
              "seconds per weight sync, 8-rank FSDP2 trainer -> vLLM DP8 + EP8, 2 nodes of 8 H100",
              "qwen3-235b", "fsdp:shard=8", "vllm:tp=1,dp=8,ep=8", "dgx-h100", "3.2-3.3 s", "",
              "trainers and engine one node each; the trainer's experts one tensor each (HF "
              "checkpoint names, --hf-experts split)"),
    Published(DOC + ", H100", DOC_SRC, "2026-08-19", DOC_WHAT, "deepseek-v3",
              "megatron:pp=16,ep=16", "vllm:tp=32,dp=8", "dgx-h100", "2.39-2.83 s", "",
              "DP filled in from the GPU count"),
    Published(DOC + ", GB200", DOC_SRC, "2026-08-19", DOC_WHAT, "deepseek-v3",
              "megatron:pp=16,ep=16", "vllm:tp=32,dp=8", "gb200-nvl72", "1.93-2.59 s", "",
              "DP filled in from the GPU count"),
    Published("vLLM blog: sharded RDT, 16 -> 16 H100",
              "github.com/vllm-project/vllm-project.github.io "
              "_posts/2026-08-22-rdt-weight-transfer.md @ 25dd3539", "2026-08-22",
              "end-to-end weight sync incl. the trainers' all-gather, averaged over syncs after "
              "the first; pipelined version", "qwen3-235b", "megatron:tp=4,pp=2,ep=8,etp=1",
              "vllm:tp=1,dp=16,ep=16", "dgx-h100", "3.49 s", "NCCL broadcast (SkyRL) 64.72 s",
              "4 nodes of 8 H100: trainers and engine two each"),
]
# The row the command tests and the page's small mode run.
SMALL_ROW = 7

# The same plan with each region copied on its own (copy tables off), and with no CPU costs.
NO_CPU = {"item_s": 0.0, "tensor_s": 0.0, "shard_s": 0.0, "step_s": 0.0}
VARIANTS = {"per_item": {"copy_tables": False, "step_s": 0.0}, "links": NO_CPU}
# `--executor`: the executor's ring behaviours on the GPU presets, each (ours, links).
EXECUTOR = [("host waits for each ring copy, runs wait", {"host_overlap": False,
                                                           "ring_carry": False}),
            ("+ late receives left behind", {"host_overlap": False, "ring_carry": True}),
            ("+ ring copies on events", {"host_overlap": True, "ring_carry": False}),
            ("both (today)", {"host_overlap": True, "ring_carry": True})]


def _args(i: int):
    """The simulate arguments of row `i`."""
    r = ROWS[i]
    return build_parser().parse_args(["--model", r.model, "--train", r.train, "--infer",
                                      r.infer, "--cluster", r.cluster])


def executor_table(rows) -> None:
    """Per row, `ours / links` seconds with the executor's ring behaviours switched."""
    print(f"{'#':>2} {'model':<12} " + " ".join(f"{name:>42}" for name, _ in EXECUTOR)
          + f" {'bound s':>7}")
    for i in rows:
        variants = {}
        for k, (_, changes) in enumerate(EXECUTOR):
            variants[f"{k}"] = changes
            variants[f"{k} links"] = {**changes, **NO_CPU}
        o = run(_args(i), variants)
        v = o["variants"]
        print(f"{i:>2} {ROWS[i].model:<12} " + " ".join(
            f"{v[str(k)]:>35.2f} / {v[f'{k} links']:.2f}" for k in range(len(EXECUTOR)))
            + f" {o['bound_s']:>7.2f}", flush=True)


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=None, help="comma-separated row numbers (default: all)")
    ap.add_argument("--executor", action="store_true",
                    help="instead: each row with the executor's ring behaviours switched "
                         "(ours / links seconds)")
    args = ap.parse_args(argv)
    pick = None if args.rows is None else {int(x) for x in args.rows.split(",")}
    if args.executor:
        executor_table([i for i in range(len(ROWS)) if pick is None or i in pick])
        return 0
    print("Published refit times exactly as their sources give them, each beside this "
          "simulator's PREDICTIONS for the same model, layouts and hardware class (none of "
          "ours is a measurement on that hardware). Assumptions of every prediction: the "
          "preset's constants (datasheet link rates; CPU costs measured on this 2-core "
          "machine; launch, latency, copy rates and per-refit overhead assumed: see "
          "`ray-reshard simulate --json` for each constant's provenance and the range with "
          "each uncertain one halved and doubled); not modelled: NCCL protocol efficiency, "
          "kernel launches besides one copy-table launch, CUDA IPC handle opening, HBM/PCIe "
          "contention; plus each row's note.")
    head = (f"{'#':>2} {'published by':<46} {'model':<12} {'train -> infer':<44} "
            f"{'published':<12} {'pred. s':>7} {'per-item':>8} {'links':>6} {'plan bnd':>8} "
            f"{'layout bnd':>10} {'direct':>6} {'gath-bc':>7}  published other; note")
    print(head)
    print("-" * len(head))
    checks = []         # rows publishing a direct time too: (row, ours, published, theirs)
    for i, row in enumerate(ROWS):
        if pick is not None and i not in pick:
            continue
        who, model, pub, other, note = row.who, row.model, row.reshard, row.other, row.note
        args = _args(i)
        args.sensitivity = "off"
        o = run(args, VARIANTS)
        per_item, links = o["variants"]["per_item"], o["variants"]["links"]
        lay = f"{o['train']} -> {o['infer']}".replace("Megatron ", "").replace("vLLM ", "")
        check = "" if o["plan_within_layout_bound"] else f"; PLAN CHECK: {o['plan_check']}"
        if other.startswith("direct ") and other.endswith(" s"):
            checks.append((i, o["direct_s"], pub, float(other.split()[1])))
        print(f"{i:>2} {who:<46} {model:<12} {lay:<44} {pub:<12} {o['predicted_s']:>7.2f} "
              f"{per_item:>8.2f} {links:>6.2f} {o['bound_s']:>8.2f} "
              f"{o['layout_bound']['bound_s']:>10.2f} {o['direct_s']:>6.2f} "
              f"{o['gather_broadcast_s']:>7.2f}  {'; '.join(x for x in (other, note) if x)}"
              f"{check}", flush=True)
    for i, pred_direct, pub, pub_direct in checks:
        print(f"row {i}: the source measured direct point-to-point at {pub_direct:g} s; this "
              f"simulator predicts {pred_direct:.2f} s for it ({pred_direct / pub_direct:.2f}x "
              f"the measurement), so its reshard prediction for that system (published: {pub}) "
              f"carries an error of that order")
    print("sources (as each gives its figure):")
    for i, row in enumerate(ROWS):
        if pick is None or i in pick:
            print(f"  row {i}: {row.source}, {row.date}: {row.measures}")
    print("pred. s: reshard predicted (copy tables); per-item: the same with each region copied "
          "on its own; links: no CPU costs at all; plan bnd: the plan's busiest NIC; layout "
          "bnd: each domain's distinct needed bytes over its own NICs, from the layouts alone; "
          "direct: predicted point-to-point without domain de-duplication; gath-bc: predicted "
          "gather-broadcast. All predictions.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
