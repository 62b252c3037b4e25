"""Several destination groups in one refit (prefill and decode engines of different layouts)
against one refit per group, side by side.

    python -m ray_reshard bench-groups [--model llama70b] [--local-mb 64] [--repeats 3]

Plans (no Ray): a model from Megatron TP8 x PP4 into prefill engines (vLLM TP4 x DP4) and
decode engines (vLLM TP2 x DP8) on 8-GPU nodes, in two placements: each node hosting one
prefill and two decode replicas (shared nodes), or each group on nodes of its own. For each:
network bytes of one combined refit, of two refits (one per group), the lower bound over all
groups, and the DGX H100 simulator's prediction for each.

Local (a two-node Ray cluster on CPU): 4 trainers (TP4) on one node, 4 prefill (TP4) and 4
decode (TP2 x DP2) engines on the other; one call for both groups vs two calls in a row.
"""
from __future__ import annotations

import statistics
import time

import torch

from ray_reshard.tools.cli_args import Parser


def plan_rows(model: str) -> list[dict]:
    import ray_reshard as rr
    from ray_reshard.tools.cli_args import MODELS, even_out_stages
    from ray_reshard._gc import gc_paused
    from ray_reshard.models import Megatron, VLLM, Recipe
    from ray_reshard.sim import preset, simulate

    title, config = MODELS[model]
    train = even_out_stages(Megatron(tp=8, pp=4), config["num_hidden_layers"])
    prefill, decode = VLLM(tp=4, dp=4), VLLM(tp=2, dp=8)
    groups = {"prefill": Recipe(config, train, prefill).specs(torch.bfloat16),
              "decode": Recipe(config, train, decode).specs(torch.bfloat16)}
    together = rr.combine_destinations(groups)
    src_domains = [f"train{r // 8}" for r in range(train.world)]
    cluster = preset("dgx-h100")
    placements = {
        # node k: prefill replica k (4 GPUs) and decode replicas 2k, 2k+1 (4 GPUs)
        "shared nodes": ([f"node{r // 4}" for r in range(prefill.world)],
                         [f"node{r // 4}" for r in range(decode.world)]),
        "nodes of their own": ([f"prefill{r // 8}" for r in range(prefill.world)],
                               [f"decode{r // 8}" for r in range(decode.world)]),
    }
    rows = []
    for where, (pre_dom, dec_dom) in placements.items():
        with gc_paused():
            t0 = time.perf_counter()
            plan = rr.plan(together, src_domains, pre_dom + dec_dom)
            st = plan.stats
            t_plan = time.perf_counter() - t0
            apart = [rr.plan(groups["prefill"], src_domains, pre_dom),
                     rr.plan(groups["decode"], src_domains, dec_dom)]
        rows.append(dict(
            model=title, where=where, together_gb=st.network_bytes / 1e9,
            apart_gb=sum(p.stats.network_bytes for p in apart) / 1e9,
            bound_gb=st.min_network_bytes / 1e9, plan_s=t_plan,
            together_s=simulate(plan, cluster).predicted_s,
            apart_s=sum(simulate(p, cluster).predicted_s for p in apart)))
    return rows


def local_rows(mb: int, repeats: int) -> dict:
    import ray

    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard
    from ray_reshard.tools.testing import holders, local_cluster

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    train = L([0, 1, 2, 3], Shard(0))
    pre_l = L([0, 1, 2, 3], Shard(0))
    dec_l = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    n, cols = 32, 256
    rows = max(8, (mb << 20) // (n * cols * 4) // 8 * 8)
    pre = {f"w{i}": rr.TensorSpec((rows, cols), torch.float32, train, pre_l) for i in range(n)}
    dec = {f"w{i}": rr.TensorSpec((rows, cols), torch.float32, train, dec_l) for i in range(n)}
    both = rr.combine_destinations({"prefill": pre, "decode": dec})
    with local_cluster(2):
        src, engines = holders(4, 0), holders(8, 1)
        g = torch.Generator().manual_seed(0)
        ray.get([a.set.remote({k: torch.randn(s.src.local_shape(r, s.shape), generator=g)
                               for k, s in both.items()}) for r, a in enumerate(src)])
        ray.get([a.set.remote({k: torch.zeros(s.dst.local_shape(r, s.shape))
                               for k, s in both.items() if s.dst.box(r, s.shape) is not None})
                 for r, a in enumerate(engines)])
        one, two = [], []
        with rr.ReshardGroup(src, engines) as g_both, \
                rr.ReshardGroup(src, engines[:4]) as g_pre, \
                rr.ReshardGroup(src, engines[4:]) as g_dec:
            res = g_both.refit(both)
            g_pre.refit(pre), g_dec.refit(dec)
            for _ in range(repeats):
                t0 = time.perf_counter()
                g_both.refit(both)
                one.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                a = g_pre.refit(pre)
                b = g_dec.refit(dec)
                two.append(time.perf_counter() - t0)
        return dict(mb=res.plan_stats.network_bytes / 2**20,
                    mb_apart=(a.plan_stats.network_bytes + b.plan_stats.network_bytes) / 2**20,
                    one=statistics.median(one), two=statistics.median(two))


def main(argv=None) -> int:
    ap = Parser(prog="ray_reshard bench-groups",
                description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama70b", choices=("llama70b", "qwen3-235b"),
                    help="model of the planned rows (default llama70b)")
    ap.add_argument("--local-mb", type=int, default=64, help="MiB of fp32 weights locally")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-local", action="store_true", help="plans only (no Ray)")
    args = ap.parse_args(argv)

    print("Megatron TP8xPP4 -> prefill vLLM TP4xDP4 + decode vLLM TP2xDP8, DGX H100 nodes")
    print(f"{'placement':<20}{'together GB':>12}{'apart GB':>10}{'bound GB':>10}"
          f"{'plan s':>8}{'sim together s':>16}{'sim apart s':>13}")
    for r in plan_rows(args.model):
        print(f"{r['where']:<20}{r['together_gb']:>12.2f}{r['apart_gb']:>10.2f}"
              f"{r['bound_gb']:>10.2f}{r['plan_s']:>8.2f}{r['together_s']:>16.2f}"
              f"{r['apart_s']:>13.2f}")
    if not args.no_local:
        r = local_rows(args.local_mb, args.repeats)
        print(f"\nlocal, trainers TP4 on one node, prefill TP4 + decode TP2xDP2 on the other "
              f"(median of {args.repeats}):")
        print(f"  one call for both groups: {r['one']:.3f} s, {r['mb']:.1f} MiB over the network")
        print(f"  one call per group:       {r['two']:.3f} s, {r['mb_apart']:.1f} MiB over the "
              f"network")
        print(f"  -> {r['two'] / r['one']:.2f}x faster, {r['mb_apart'] / r['mb']:.2f}x fewer "
              f"network bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
