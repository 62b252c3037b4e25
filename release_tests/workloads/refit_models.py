"""Release workload: refit scaled real models between Ray actors placed with placement groups.

For each model (Llama-3, Qwen3-MoE, DeepSeek-V3 layouts, scaled down in layers, width and
experts so they fit the cluster), trainer actors hold the Megatron-core storages and engine
actors hold vLLM storages, in two placement groups (training GPUs, inference GPUs). The script
refits with `reshard` and with `gather_broadcast`, verifies every engine storage bit-exactly
against the expected shard, predicts the refit with the simulator for the same plan, and writes
one results JSON.

    # on a GPU cluster (NCCL), e.g. 2 nodes x 8 H100: 8 trainers, 8 engines
    python workloads/refit_models.py --mode gpu --gpus-per-side 8 --out /tmp/results.json
    # CPU mode (gloo, simulated nodes): what CI runs
    python workloads/refit_models.py --mode cpu --smoke --out /tmp/results.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import ray_reshard as rr
from ray_reshard import models
from ray_reshard.tools.cli_args import DEEPSEEK_V3, LLAMA3_70B, QWEN3_235B
from ray_reshard.sim import preset, simulate


def scaled(config: dict, layers: int, hidden: int, experts: int, vocab: int) -> dict:
    """The real config with fewer layers, a narrower model and fewer experts (same structure)."""
    c = dict(config, num_hidden_layers=layers, vocab_size=min(config["vocab_size"], vocab))
    f = hidden / config["hidden_size"]
    c["hidden_size"] = hidden
    c["intermediate_size"] = max(64, int(config["intermediate_size"] * f) // 64 * 64)
    if "moe_intermediate_size" in c:
        c["moe_intermediate_size"] = max(32, int(config["moe_intermediate_size"] * f) // 32 * 32)
    if "num_experts" in c:
        c["num_experts"] = experts
        c["num_experts_per_tok"] = min(c["num_experts_per_tok"], experts)
    if "n_routed_experts" in c:
        c["n_routed_experts"] = experts
        c["num_experts_per_tok"] = min(c["num_experts_per_tok"], experts)
        c["first_k_dense_replace"] = min(c["first_k_dense_replace"], 1)
        c["q_lora_rank"] = hidden // 4
        c["kv_lora_rank"] = hidden // 8
        c["num_attention_heads"] = c["num_key_value_heads"] = 16
    return c


def cases(world: int, smoke: bool):
    """(name, config, train, infer) for `world` GPUs per side (a power of two, >= 4)."""
    half = world // 2
    size = (dict(layers=2, hidden=128, vocab=4096) if smoke
            else dict(layers=8, hidden=2048, vocab=32000))
    e = max(8, world)
    return [
        ("llama3", scaled(LLAMA3_70B, experts=0, **size),
         models.Megatron(tp=half, pp=2), models.VLLM(tp=half, dp=2)),
        ("qwen3-moe", scaled(QWEN3_235B, experts=e, **size),
         models.Megatron(tp=1, pp=2, ep=half, etp=1, dp=half), models.VLLM(tp=half, dp=2, ep=half)),
        ("deepseek-v3", scaled(DEEPSEEK_V3, experts=e, **size),
         models.Megatron(tp=1, pp=2, ep=half, etp=1, dp=half), models.VLLM(tp=world)),
    ]


@ray.remote(num_cpus=0)
class Rank:
    """A trainer or an engine: builds its storages from the shared full state dict."""

    def __init__(self, device: str):
        self.device = device
        self.storages = {}

    def load(self, config, parallel, side: str, rank: int, state, dtype):
        if side == "src":
            st = models.local_state(config, parallel, "src", rank, state, dtype=dtype)
        else:
            st = models.empty_storage(config, parallel, rank, dtype=dtype, fill=float("nan"))
        self.storages = {n: t.to(self.device) for n, t in st.items()}
        if self.device == "cuda":
            torch.cuda.synchronize()

    def reshard_tensors(self):
        return self.storages

    def clear(self):
        for t in self.storages.values():
            t.fill_(float("nan"))

    def verify(self, config, parallel, rank: int, state, dtype) -> list:
        """Names of storages that differ from the expected shard (padding ignored)."""
        want = models.local_state(config, parallel, "dst", rank, state, dtype=dtype)
        pad = models.padding_mask(config, parallel, rank)
        bad = []
        for n, w in want.items():
            got = self.storages[n].cpu()
            keep = ~pad[n]
            if not torch.equal(got[keep], w[keep]):
                bad.append(n)
        return bad

    def node(self):
        return ray.get_runtime_context().get_node_id()


def place(n: int, mode: str, side_resource: str):
    """A placement group of n bundles: one GPU each (packed onto as few nodes as possible), or in
    CPU mode one bundle per rank on the simulated node `side_resource`."""
    bundles = [{"GPU": 1} if mode == "gpu" else {side_resource: 0.01} for _ in range(n)]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=600)
    return pg


def actors(pg, n: int, mode: str):
    device = "cuda" if mode == "gpu" else "cpu"
    return [Rank.options(num_gpus=1 if mode == "gpu" else 0,
                         scheduling_strategy=PlacementGroupSchedulingStrategy(
                             placement_group=pg, placement_group_bundle_index=i)).remote(device)
            for i in range(n)]


def timed(group, specs, repeats: int) -> tuple[float, object]:
    res = group.refit(specs)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = group.refit(specs)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), res


def run_case(name, config, train, infer, trainers, engines, args, cluster_preset) -> dict:
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g).to(dtype)
             for n, s in models.hf_parameter_shapes(config).items()}
    state_ref = ray.put(state)
    specs = models.refit_specs(config, train=train, infer=infer, dtype=dtype)
    tr, en = trainers[:train.world], engines[:infer.world]
    ray.get([a.load.remote(config, train, "src", r, state_ref, dtype) for r, a in enumerate(tr)])
    ray.get([a.load.remote(config, infer, "dst", r, None, dtype) for r, a in enumerate(en)])
    out = {"model": name, "train": str(train), "infer": str(infer), "tensors": len(specs),
           "bytes": sum(s.nbytes for s in specs.values())}
    for strategy in ("reshard", "gather_broadcast"):
        ray.get([a.clear.remote() for a in en])
        with rr.ReshardGroup(tr, en, strategy=strategy, bucket_bytes=args.bucket_mb << 20) as grp:
            seconds, res = timed(grp, specs, args.repeats)
            plan = grp.plan(specs)
        bad = ray.get([a.verify.remote(config, infer, r, state_ref, dtype) for r, a in enumerate(en)])
        out[strategy] = {"seconds": seconds, "verified": not any(bad),
                         "bad": [(r, b[:3]) for r, b in enumerate(bad) if b][:4],
                         "network_bytes": res.bytes_by_path["network"]}
        if strategy == "reshard":
            sim = simulate(plan, cluster_preset, args.bucket_mb << 20)
            out["predicted_s"] = sim.predicted_s
            out["bound_s"] = sim.bound_s
            out["min_network_bytes"] = plan.stats.min_network_bytes
    out["speedup_vs_gather_broadcast"] = out["gather_broadcast"]["seconds"] / out["reshard"]["seconds"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--gpus-per-side", type=int, default=8,
                    help="trainer ranks = engine ranks = this (a power of two >= 4)")
    ap.add_argument("--models", default="llama3,qwen3-moe,deepseek-v3")
    ap.add_argument("--smoke", action="store_true", help="small models, one timed refit")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--cluster", default=None, help="simulator preset for the prediction "
                                                    "(default: dgx-h100 on GPU, local on CPU)")
    ap.add_argument("--address", default=None, help="Ray address (default: auto on GPU; a new "
                                                    "local two-node cluster on CPU)")
    ap.add_argument("--out", default=os.environ.get("TEST_OUTPUT_JSON", "/tmp/release_test_out.json"))
    args = ap.parse_args(argv)
    w = args.gpus_per_side
    if w < 4 or w & (w - 1):
        print(f"--gpus-per-side must be a power of two >= 4, got {w}", file=sys.stderr)
        return 2
    if args.smoke:
        args.repeats = 1
    wanted = args.models.split(",")
    chosen = [c for c in cases(w, args.smoke) if c[0] in wanted]
    if len(chosen) != len(wanted):
        print(f"--models: unknown name in {args.models!r}", file=sys.stderr)
        return 2
    cluster_preset = preset(args.cluster or ("dgx-h100" if args.mode == "gpu" else "local"))

    local = None
    if args.mode == "cpu" and args.address is None:
        from ray_reshard.tools.testing import start_cluster
        local = start_cluster(2, shared=False)
    else:
        ray.init(address=args.address or "auto", log_to_driver=False)
    results = {"mode": args.mode, "gpus_per_side": w, "smoke": args.smoke,
               "simulator_cluster": cluster_preset.name, "python": platform.python_version(),
               "ray": ray.__version__, "torch": torch.__version__, "cases": []}
    try:
        pg_train = place(w, args.mode, "node0")
        pg_infer = place(w, args.mode, "node1")
        trainers, engines = actors(pg_train, w, args.mode), actors(pg_infer, w, args.mode)
        results["train_nodes"] = len(set(ray.get([a.node.remote() for a in trainers])))
        results["infer_nodes"] = len(set(ray.get([a.node.remote() for a in engines])))
        for name, config, train, infer in chosen:
            r = run_case(name, config, train, infer, trainers, engines, args, cluster_preset)
            results["cases"].append(r)
            print(f"{name:<12} {r['train']} -> {r['infer']}: {r['bytes'] / 1e6:.1f} MB, reshard "
                  f"{r['reshard']['seconds']:.3f} s (predicted {r['predicted_s']:.3f} s, bound "
                  f"{r['bound_s']:.3f} s), gather_broadcast {r['gather_broadcast']['seconds']:.3f} s, "
                  f"verified {r['reshard']['verified'] and r['gather_broadcast']['verified']}",
                  flush=True)
        remove_placement_group(pg_train)
        remove_placement_group(pg_infer)
    finally:
        ray.shutdown()
        if local is not None:
            local.shutdown()
    results["passed"] = all(c[s]["verified"] for c in results["cases"]
                            for s in ("reshard", "gather_broadcast"))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results written to {args.out}; {'PASSED' if results['passed'] else 'FAILED'}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
