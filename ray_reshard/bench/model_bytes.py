"""Refit bytes of real models at real size: reshard vs its lower bound vs gather-broadcast.

    python -m ray_reshard.bench.model_bytes [--models llama70b,qwen3-235b,deepseek-v3]
                                            [--experts grouped|stacked] [--ranks-per-domain 8]

Configs are written inline (no download). Every byte of every model goes through the reshard
plan (the "through reshard" column is the share of the model's parameters the specs cover).
Network bytes count what crosses between NVLink domains; gather-broadcast is the all-gather on
the training side plus a full copy to every inference rank that holds the tensor.
"""
from __future__ import annotations

import argparse
import time

import torch

from ..core.plan import plan as make_plan
from ..models import VLLM, Megatron, Recipe, hf_parameter_shapes
from ..models.recipe import gc_paused

LLAMA3_70B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "tie_word_embeddings": False,
}
QWEN3_235B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
}

# name -> (config, [(train, infer), ...]); the first layout of each is the brief's. Megatron
# needs the first/last stage sizes when the layers do not divide over the stages.
QWEN3_PP8 = dict(pp=8, first_stage_layers=11, last_stage_layers=11)      # 11 + 6 x 12 + 11
DSV3_PP16 = dict(pp=16, first_stage_layers=3, last_stage_layers=2)       # 3 + 14 x 4 + 2
CASES = {
    "llama70b": ("Llama-3-70B", LLAMA3_70B, [
        (Megatron(tp=8, pp=4), VLLM(tp=8, dp=4)),
    ]),
    "qwen3-235b": ("Qwen3-235B-A22B", QWEN3_235B, [
        (Megatron(tp=4, ep=16, etp=1, dp=4, **QWEN3_PP8), VLLM(tp=8, dp=16)),
        (Megatron(tp=4, ep=16, etp=1, dp=4, **QWEN3_PP8), VLLM(tp=8, dp=16, ep=8)),
    ]),
    "deepseek-v3": ("DeepSeek-V3", DEEPSEEK_V3, [
        (Megatron(tp=1, ep=16, etp=1, dp=16, **DSV3_PP16), VLLM(tp=32, dp=8)),
        (Megatron(tp=1, ep=16, etp=1, dp=16, **DSV3_PP16), VLLM(tp=32, dp=8, ep=32)),
    ]),
}


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(CASES))
    ap.add_argument("--experts", default="grouped", choices=("grouped", "sequential", "stacked"),
                    help="how Megatron stores local experts (grouped: one tensor per expert)")
    ap.add_argument("--hf-experts", default="split", choices=("split", "fused"),
                    help="HF naming of experts: split (checkpoints: a 2-d tensor per expert) "
                         "or fused (transformers >= 5: [E, 2I, H] per layer)")
    ap.add_argument("--ranks-per-domain", type=int, default=8)
    args = ap.parse_args(argv)
    gb = lambda b: f"{b / 1e9:,.1f}"
    head = (f"{'model':<16} {'train -> infer':<44} {'tensors':>7} {'weights GB':>10} "
            f"{'reshard%':>8} {'net GB':>8} {'bound GB':>8} {'NVLink GB':>9} {'gath-bc GB':>10} "
            f"{'gb/net':>6} {'max rx GB':>9} {'specs s':>7} {'plan s':>7}")
    print(f"BF16, {args.ranks_per_domain} ranks per NVLink domain on each side, "
          f"Megatron experts {args.experts!r}, HF experts {args.hf_experts!r}")
    print(head)
    print("-" * len(head))
    for key in args.models.split(","):
        title, config, layouts = CASES[key]
        for train, infer in layouts:
            train = _with_experts(train, args.experts)
            m = measure(config, train, infer, args.ranks_per_domain, hf_experts=args.hf_experts)
            lay = f"{train} -> {infer}".replace("Megatron ", "").replace("vLLM ", "")
            print(f"{title:<16} {lay:<44} {m['tensors']:>7} {gb(m['total']):>10} "
                  f"{100 * m['share']:>7.1f}% {gb(m['network']):>8} {gb(m['bound']):>8} "
                  f"{gb(m['domain']):>9} {gb(m['gb']):>10} {m['gb'] / m['network']:>6.1f} "
                  f"{gb(m['max_recv']):>9} {m['t_specs']:>7.1f} {m['t_plan']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
