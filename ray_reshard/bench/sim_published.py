"""Published refit figures beside the simulator's predictions (same models, layouts, hardware class).

    python -m ray_reshard.bench.sim_published

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


from ray_reshard.cli_args import Parser
from ray_reshard.sim.cli import build_parser, run

# (source, model, train, infer, cluster simulated, published reshard, published other, note):
# the published figures exactly as their sources give them; `note` says what the source leaves
# out and this table fills in (an assumption of the prediction).
BLOG = "NVIDIA blog (NCCL M2N reshard in NeMo RL)"
NEMO_TABLES = "NeMo RL nccl_reshard tables"
ROWS = [
    ("NCCL M2N bench, GB200 NVL72", "deepseek-v3", "megatron:pp=4,ep=16,dp=32",
     "vllm:tp=8,dp=16", "gb200-nvl72", "1.447 s", "direct 3.838 s",
     "128 -> 128 GPUs (EP16 DP2 PP4 -> TP8 DP16)"),
    ("NCCL M2N bench, GB200 NVL72", "qwen3-235b", "megatron:pp=4,ep=16,dp=16",
     "vllm:tp=8,dp=8", "gb200-nvl72", "0.989 s", "direct 2.175 s",
     "64 -> 64 GPUs; the split into PP and EP is ours"),
    (BLOG + ", DGX H100", "deepseek-v3", "megatron:pp=16,ep=16", "vllm:tp=32,dp=8",
     "dgx-h100", "2.6 s", "gather-broadcast 14.9 s", "DP filled in from the GPU count"),
    (BLOG + ", DGX GB200", "deepseek-v3", "megatron:pp=16,ep=16", "vllm:tp=32,dp=8",
     "gb200-nvl72", "2.3 s", "gather-broadcast 6.1 s", "DP filled in from the GPU count"),
    (BLOG + ", DGX H100", "qwen3-235b", "megatron:tp=4,pp=8,ep=16,etp=1", "vllm:tp=8,dp=16",
     "dgx-h100", "1.9 s", "gather-broadcast 6.4 s", "DP filled in from the GPU count"),
    (NEMO_TABLES, "qwen3-235b", "megatron:tp=4,pp=8,ep=16,etp=1", "vllm:tp=8,dp=16",
     "dgx-h100", "4.56-4.85 s", "", "cluster not stated: simulated on DGX H100"),
    (NEMO_TABLES, "deepseek-v3", "megatron:pp=16,ep=16", "vllm:tp=32,dp=8", "dgx-h100",
     "7.65-9.94 s", "", "cluster not stated: simulated on DGX H100"),
    ("vLLM sharded RDT, 8 -> 8 H100", "qwen3-235b", "megatron:ep=8", "vllm:tp=8", "dgx-h100",
     "3.2-3.3 s", "NCCL broadcast 64.7 s", "trainer layout not stated: EP8 assumed"),
]

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
    _, model, train, infer, cluster, _, _, _ = ROWS[i]
    return build_parser().parse_args(["--model", model, "--train", train, "--infer", infer,
                                      "--cluster", cluster])


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
        print(f"{i:>2} {ROWS[i][1]:<12} " + " ".join(
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
    for i, (who, model, train, infer, cluster, pub, other, note) in enumerate(ROWS):
        if pick is not None and i not in pick:
            continue
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
    print("pred. s: reshard predicted (copy tables); per-item: the same with each region copied "
          "on its own; links: no CPU costs at all; plan bnd: the plan's busiest NIC; layout "
          "bnd: each domain's distinct needed bytes over its own NICs, from the layouts alone; "
          "direct: predicted point-to-point without domain de-duplication; gath-bc: predicted "
          "gather-broadcast. All predictions.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
