"""The simulator against published refit figures (same models, layouts and hardware class).

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

import argparse

from ray_reshard.sim.cli import build_parser, run

ROWS = [
    # (source, model, train, infer, cluster, published reshard, published other)
    ("NCCL M2N bench, GB200 NVL72", "deepseek-v3", "megatron:pp=4,ep=16,dp=32",
     "vllm:tp=8,dp=16", "gb200-nvl72", "1.447 s", "direct 3.838 s"),
    ("NCCL M2N bench, GB200 NVL72", "qwen3-235b", "megatron:pp=4,ep=16,dp=16",
     "vllm:tp=8,dp=8", "gb200-nvl72", "0.989 s", "direct 2.175 s"),
    ("NeMo RL, DGX H100", "deepseek-v3", "megatron:pp=16,ep=16", "vllm:tp=32,dp=8", "dgx-h100",
     "2.4-2.8 s", "gather-broadcast 14.9 s"),
    ("NeMo RL, DGX H100", "qwen3-235b", "megatron:tp=4,pp=8,ep=16,etp=1", "vllm:tp=8,dp=16",
     "dgx-h100", "4.6-4.9 s (blog: 1.9 s)", "gather-broadcast 6.4 s"),
    ("vLLM sharded RDT, 8 -> 8 H100", "qwen3-235b", "megatron:ep=8", "vllm:tp=8", "dgx-h100",
     "3.2-3.3 s", "NCCL broadcast 64.7 s"),
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
    _, model, train, infer, cluster, _, _ = ROWS[i]
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=None, help="comma-separated row numbers (default: all)")
    ap.add_argument("--executor", action="store_true",
                    help="instead: each row with the executor's ring behaviours switched "
                         "(ours / links seconds)")
    args = ap.parse_args(argv)
    pick = None if args.rows is None else {int(x) for x in args.rows.split(",")}
    if args.executor:
        executor_table([i for i in range(len(ROWS)) if pick is None or i in pick])
        return 0
    head = (f"{'#':>2} {'published by':<30} {'model':<12} {'train -> infer':<52} "
            f"{'published':<26} {'ours s':>7} {'per-item s':>10} {'links s':>7} {'bound s':>7} "
            f"{'/bound':>6} {'direct s':>8} "
            f"{'gath-bc s':>9}  published other")
    print(head)
    print("-" * len(head))
    for i, (who, model, train, infer, cluster, pub, other) in enumerate(ROWS):
        if pick is not None and i not in pick:
            continue
        o = run(_args(i), VARIANTS)
        per_item, links = o["variants"]["per_item"], o["variants"]["links"]
        lay = f"{o['train']} -> {o['infer']}".replace("Megatron ", "").replace("vLLM ", "")
        print(f"{i:>2} {who:<30} {model:<12} {lay:<52} {pub:<26} {o['predicted_s']:>7.2f} "
              f"{per_item:>10.2f} {links:>7.2f} {o['bound_s']:>7.2f} {o['predicted_s'] / o['bound_s']:>6.2f} {o['direct_s']:>8.2f} "
              f"{o['gather_broadcast_s']:>9.2f}  {other}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
