"""Block-FP8 refits: network bytes FP8 vs BF16, quantisation throughput per sender, bit-exactness.

    ray-reshard bench-fp8 [--repeats 3] [--models qwen3-235b,deepseek-v3] [--layers 0]

1. Bytes (plan statistics, no transfer): Qwen3-235B (Megatron TP4 x PP4 x EP16 -> vLLM TP8 x
   DP4 x EP32 with FP8: 1536 / 8 expert rows would cut blocks, which vLLM refuses too) and
   DeepSeek-V3 (Megatron PP4 x EP16 -> vLLM TP8 x DP4 with FP8), 8 ranks per
   NVLink domain; the same refit with a BF16 destination beside it. `--layers N` keeps the
   first N layers (0: all).
2. Throughput: one sender's compiled program of a scaled Qwen3-MoE and a scaled DeepSeek-V3
   refit (real block size 128 x 128, head dims 128; BF16 sources), packed bucket by bucket on
   one CPU thread: the quantising pack (FP8 + scales) vs the plain BF16 pack of the same
   layouts, side by side; GB/s of source bytes read.
3. Bit-exactness: the same scaled refits run in the in-process simulator; every destination
   byte (FP8 weights, float32 scales, BF16 tensors) is compared with the reference
   quantisation of the full Hugging Face tensor.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ray_reshard as rr
from ray_reshard.tools.cli_args import (DEEPSEEK_V3, QWEN3_235B, even_out_stages, models_list_arg,
                                  positive_int)
from ray_reshard._gc import gc_paused
from ray_reshard.planning.plan import Plan
from ray_reshard.planning.moves import Endpoint
from ray_reshard.execution.program import SEND, compile_program
from ray_reshard.execution.fp8 import reference_quantize
from ray_reshard.layout.quant import scale_view
from ray_reshard.models import (VLLM, Megatron, Recipe, empty_storage, hf_parameter_shapes,
                                local_state)
from ray_reshard.execution.reference import simulate_refit

FULL = {
    "qwen3-235b": ("Qwen3-235B-A22B", QWEN3_235B, Megatron(tp=4, pp=4, ep=16, etp=1, dp=4),
                   VLLM(tp=8, dp=4, ep=32)),
    "deepseek-v3": ("DeepSeek-V3", DEEPSEEK_V3, Megatron(pp=4, ep=16, dp=16),
                    VLLM(tp=8, dp=4)),
}
# Scaled models: the real block size (128) and head dims, few layers and experts.
SCALED = {
    "qwen3-235b": ("scaled Qwen3-MoE", {
        "model_type": "qwen3_moe", "vocab_size": 8192, "hidden_size": 1024,
        "intermediate_size": 2048, "moe_intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "num_experts": 16, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False},
        Megatron(tp=2, ep=4, etp=1, dp=2), VLLM(tp=2, dp=2, ep=4)),
    "deepseek-v3": ("scaled DeepSeek-V3", {
        "model_type": "deepseek_v3", "vocab_size": 8192, "hidden_size": 1024,
        "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 16,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "q_lora_rank": 512, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False,
        "topk_method": "noaux_tc"},
        Megatron(ep=4, dp=4), VLLM(tp=2, dp=2)),
}
PER_NODE = 8
SCALED_PER_NODE = 2


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=models_list_arg, default=list(FULL),
                   help="comma-separated: qwen3-235b, deepseek-v3 (default both)")
    p.add_argument("--layers", type=int, default=0,
                   help="bytes: keep the first N layers of the full-size models (0: all)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed packs of the sender's program per format (median)")


def _fp8(infer: VLLM) -> VLLM:
    return VLLM(**{**infer.__dict__, "quantization": "fp8"})


def _plan(config, train, infer, per_node: int) -> Plan:
    train = even_out_stages(train, config["num_hidden_layers"])
    specs = Recipe(config, train, infer).specs(torch.bfloat16)
    with gc_paused():
        return rr.plan(specs, [f"t{r // per_node}" for r in range(train.world)],
                       [f"i{r // per_node}" for r in range(infer.world)])


def _bytes(name: str, layers: int) -> None:
    title, config, train, infer = FULL[name]
    if layers:
        config = {**config, "num_hidden_layers": layers, "num_nextn_predict_layers": 0}
        title += f" (first {layers} layers)"
    t0 = time.perf_counter()
    fp8 = _plan(config, train, _fp8(infer), PER_NODE)
    bf16 = _plan(config, train, infer, PER_NODE)
    secs = time.perf_counter() - t0
    a, b = fp8.stats, bf16.stats
    quantised = [sp for sp in fp8.specs if sp.quant is not None]
    on_sender = sum(1 for sp in quantised if sp.itemsize > 4)
    print(f"== {title}: {train} -> {_fp8(infer)}, {PER_NODE} ranks per domain "
          f"(planned in {secs:.1f} s)")
    print(f"tensors {a.n_tensors}: {len(quantised)} block FP8 ({on_sender} quantised by "
          f"their senders, {len(quantised) - on_sender} on the destinations), "
          f"{a.n_tensors - len(quantised)} BF16")
    print(f"network bytes: FP8 {a.network_bytes / 1e9:.3f} GB (lower bound "
          f"{a.min_network_bytes / 1e9:.3f} GB) vs BF16 {b.network_bytes / 1e9:.3f} GB "
          f"-> {a.network_bytes / b.network_bytes:.3f}x")
    print(f"busiest source sends FP8 {a.max_send_bytes / 1e9:.3f} GB vs BF16 "
          f"{b.max_send_bytes / 1e9:.3f} GB; busiest destination receives FP8 "
          f"{a.max_recv_bytes / 1e9:.3f} GB vs BF16 {b.max_recv_bytes / 1e9:.3f} GB")


def _state(config) -> dict:
    g = torch.Generator().manual_seed(7)
    return {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16)
            for n, s in hf_parameter_shapes(config).items()}


def _sender_throughput(plan: Plan, src_storage: dict, repeats: int) -> tuple[float, int]:
    """(median seconds to pack every bucket source rank 0 sends, source bytes read)."""
    prog = compile_program(plan, [Endpoint("src", 0)], 16 << 20)
    views = {}
    for key in prog.held:
        side, rank, ti = key
        spec, name = plan.specs[ti], plan.names[ti]
        slot = spec.slot(side, rank, name)
        views[key] = slot.view(src_storage[slot.storage], spec.src.box(rank, spec.shape).sizes)
    prog.bind(views)
    sends = [s for s in prog.steps if s.kind == SEND]
    buf = torch.empty(max(s.nbytes for s in sends), dtype=torch.uint8)
    read = sum(s.send.region(i).numel() * s.send.region(i).element_size()
               for s in sends for i in range(len(s.send)))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for s in sends:
            s.send.pack(buf[:s.nbytes], cache=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), read


def _check(recipe: Recipe, plan: Plan, state: dict, dst: list) -> tuple[int, int]:
    """Compare every destination region with the reference; (tensors, bytes) checked."""
    pieces = {pc.name: pc for pc in recipe.pieces}
    n = nbytes = 0
    for name, spec in zip(plan.names, plan.specs):
        pc = pieces[name]
        full = pc.hf_slot.view(state[pc.hf], pc.shape)
        ref = reference_quantize(full, spec.quant.block) if spec.quant is not None else None
        for r in range(len(dst)):
            box = spec.dst.box(r, spec.shape)
            if box is None or box.empty:
                continue
            slot = spec.slot("dst", r, name)
            got = slot.view(dst[r][slot.storage], box.sizes)
            if ref is None:
                want = full[box.slices()].to(spec.dtype)
                ok = torch.equal(got, want)
            else:
                q, s = ref
                b = spec.quant.full_block(len(spec.shape))
                sl = tuple(slice(o // k, -(-(o + m) // k))
                           for o, m, k in zip(box.offsets, box.sizes, b))
                scales, _ = scale_view(spec, name, r, dst[r])
                ok = (torch.equal(got.view(torch.uint8), q[box.slices()].view(torch.uint8))
                      and scales is not None and torch.equal(scales, s[sl]))
                nbytes += scales.numel() * 4
            if not ok:
                raise AssertionError(f"{name!r} on destination rank {r} differs from the "
                                     f"reference")
            nbytes += got.numel() * got.element_size()
        n += 1
    return n, nbytes


def _scaled(name: str, repeats: int) -> bool:
    title, config, train, infer = SCALED[name]
    state = _state(config)
    src = [local_state(config, train, "src", r, state) for r in range(train.world)]
    plans = {}
    for fmt, lay in (("FP8", _fp8(infer)), ("BF16", infer)):
        plans[fmt] = (_plan(config, train, lay, SCALED_PER_NODE), lay)
    print(f"== {title} (hidden {config['hidden_size']}, blocks 128 x 128): {train} -> "
          f"{_fp8(infer)}, {SCALED_PER_NODE} ranks per domain")
    a, b = plans["FP8"][0].stats, plans["BF16"][0].stats
    print(f"network bytes: FP8 {a.network_bytes / 1e6:.2f} MB (lower bound "
          f"{a.min_network_bytes / 1e6:.2f} MB) vs BF16 {b.network_bytes / 1e6:.2f} MB "
          f"-> {a.network_bytes / b.network_bytes:.3f}x")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = {fmt: _sender_throughput(p, src[0], repeats) for fmt, (p, _) in plans.items()}
    finally:
        torch.set_num_threads(threads)
    (tq, rq), (tb, rb) = got["FP8"], got["BF16"]
    print(f"source rank 0 packs its buckets on one CPU thread: FP8 (quantising) "
          f"{rq / tq / 1e9:.2f} GB/s of BF16 read ({tq * 1e3:.1f} ms for {rq / 1e6:.1f} MB), "
          f"BF16 copy {rb / tb / 1e9:.2f} GB/s ({tb * 1e3:.1f} ms) -> quantising costs "
          f"{tq / tb:.1f}x the plain pack")
    plan, lay = plans["FP8"]
    recipe = Recipe(config, train, lay)
    dst = [empty_storage(config, lay, r, fill=7.0) for r in range(lay.world)]
    simulate_refit(plan, src, dst)
    n, nbytes = _check(recipe, plan, state, dst)
    print(f"bit-exact against the reference: yes ({n} tensors, {nbytes / 1e6:.2f} MB of "
          f"destination bytes compared)")
    return True


def run(args) -> int:
    for name in args.models:
        if name not in FULL:
            raise SystemExit(f"bench-fp8: --models takes qwen3-235b and deepseek-v3, got {name}")
    for name in args.models:
        _bytes(name, args.layers)
    for name in args.models:
        _scaled(name, args.repeats)
    return 0
