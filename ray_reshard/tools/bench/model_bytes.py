"""Refit bytes of real models at real size: reshard vs its lower bound vs gather-broadcast.

    python -m ray_reshard.tools.bench.model_bytes [--models llama70b,qwen3-235b,deepseek-v3,small-moe]
                                            [--experts grouped|stacked] [--ranks-per-domain 8]

Configs are written inline (no download). Every byte of every model goes through the reshard
plan (the "through reshard" column is the share of the model's parameters the specs cover).
Network bytes count what crosses between NVLink domains; gather-broadcast is the all-gather on
the training side plus a full copy to every inference rank that holds the tensor.
"""
from __future__ import annotations

import time

import torch

from ..cli_args import MODELS, Parser, models_list_arg, positive_int
from ...planning.plan import plan as make_plan
from ...models import VLLM, Megatron, Recipe, hf_parameter_shapes
from ..._gc import gc_paused

# name -> (title, config, [(train, infer), ...]); the first layout of each is the usual one.
# Megatron needs the first/last stage sizes when the layers do not divide over the stages.
QWEN3_PP8 = dict(pp=8, first_stage_layers=11, last_stage_layers=11)      # 11 + 6 x 12 + 11
DSV3_PP16 = dict(pp=16, first_stage_layers=3, last_stage_layers=2)       # 3 + 14 x 4 + 2
CASES = {
    "llama70b": (*MODELS["llama70b"], [
        (Megatron(tp=8, pp=4), VLLM(tp=8, dp=4)),
    ]),
    "qwen3-235b": (*MODELS["qwen3-235b"], [
        (Megatron(tp=4, ep=16, etp=1, dp=4, **QWEN3_PP8), VLLM(tp=8, dp=16)),
        (Megatron(tp=4, ep=16, etp=1, dp=4, **QWEN3_PP8), VLLM(tp=8, dp=16, ep=8)),
    ]),
    "deepseek-v3": (*MODELS["deepseek-v3"], [
        (Megatron(tp=1, ep=16, etp=1, dp=16, **DSV3_PP16), VLLM(tp=32, dp=8)),
        (Megatron(tp=1, ep=16, etp=1, dp=16, **DSV3_PP16), VLLM(tp=32, dp=8, ep=32)),
    ]),
    "small-moe": (*MODELS["small-moe"], [
        (Megatron(tp=1, pp=2, ep=2, dp=2), VLLM(tp=2, dp=2, ep=2)),
    ]),
}
DEFAULT_MODELS = "llama70b,qwen3-235b,deepseek-v3"


def _with_experts(par, experts: str):
    if isinstance(par, Megatron) and par.experts != experts:
        from dataclasses import replace
        return replace(par, experts=experts)
    return par


def measure(config: dict, train, infer, ranks_per_domain: int = 8,
            dtype: torch.dtype = torch.bfloat16, hf_experts: str = "split") -> dict:
    t0 = time.perf_counter()
    recipe = Recipe(config, train, infer, hf_experts=hf_experts)
    specs = recipe.specs(dtype)
    t1 = time.perf_counter()
    with gc_paused():
        p = make_plan(specs, [("train", r // ranks_per_domain) for r in range(train.world)],
                      [("infer", r // ranks_per_domain) for r in range(infer.world)])
        s = p.stats
    t2 = time.perf_counter()
    model_numel = 0
    for shape in hf_parameter_shapes(config, hf_experts=hf_experts).values():
        n = 1
        for x in shape:
            n *= x
        model_numel += n
    return dict(tensors=len(specs), total=s.total_bytes, network=s.network_bytes,
                bound=s.min_network_bytes, gb=s.gather_broadcast_bytes, domain=s.domain_bytes,
                max_recv=s.max_recv_bytes, max_send=s.max_send_bytes,
                share=sum(sp.numel for sp in specs.values()) / model_numel,
                t_specs=t1 - t0, t_plan=t2 - t1, signatures=s.n_signatures)


def add_args(ap) -> None:
    ap.add_argument("--models", type=models_list_arg, default=DEFAULT_MODELS,
                    help=f"comma-separated, from {', '.join(CASES)} (default {DEFAULT_MODELS})")
    ap.add_argument("--experts", default="grouped", choices=("grouped", "sequential", "stacked"),
                    help="how Megatron stores local experts (grouped: one tensor per expert)")
    ap.add_argument("--hf-experts", default="split", choices=("split", "fused"),
                    help="HF naming of experts: split (checkpoints: a 2-d tensor per expert) "
                         "or fused (transformers >= 5: [E, 2I, H] per layer)")
    ap.add_argument("--ranks-per-domain", type=positive_int, default=8,
                    help="ranks per NVLink domain (default 8)")


def main(argv=None) -> int:
    ap = Parser(prog="ray-reshard model-bytes", description=__doc__.splitlines()[0])
    add_args(ap)
    return run(ap.parse_args(argv))


def run(args) -> int:
    gb = lambda b: f"{b / 1e9:,.1f}"
    head = (f"{'model':<16} {'train -> infer':<44} {'tensors':>7} {'weights GB':>10} "
            f"{'reshard%':>8} {'net GB':>8} {'bound GB':>8} {'NVLink GB':>9} {'gath-bc GB':>10} "
            f"{'gb/net':>6} {'max rx GB':>9} {'specs s':>7} {'plan s':>7}")
    print(f"BF16, {args.ranks_per_domain} ranks per NVLink domain on each side, "
          f"Megatron experts {args.experts!r}, HF experts {args.hf_experts!r}")
    print(head)
    print("-" * len(head))
    for key in args.models:
        title, config, layouts = CASES[key]
        for train, infer in layouts:
            train = _with_experts(train, args.experts)
            m = measure(config, train, infer, args.ranks_per_domain, hf_experts=args.hf_experts)
            lay = f"{train} -> {infer}".replace("Megatron ", "").replace("vLLM ", "")
            print(f"{title:<16} {lay:<44} {m['tensors']:>7} {gb(m['total']):>10} "
                  f"{100 * m['share']:>7.1f}% {gb(m['network']):>8} {gb(m['bound']):>8} "
                  f"{gb(m['domain']):>9} {gb(m['gb']):>10} {m['gb'] / m['network']:>6.1f} "
                  f"{gb(m['max_recv']):>9} {m['t_specs']:>7.1f} {m['t_plan']:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
