"""Planning at scale: a DeepSeek-V3-sized refit, PP16 x EP16 (256 ranks) -> TP32 x DP8 (256 ranks).

Builds the spec set by hand (no model library), then times `plan()` cold and warm (with the
per-signature cache), including the lazily computed `Plan.stats`. The schedule is timed apart.

    python -m ray_reshard.tools.bench.plan_scale [--schedule] [--bucket-mb 64]
"""
from __future__ import annotations

import gc
import time

import torch

from ray_reshard.tools.cli_args import Parser, positive_int
from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec
from ray_reshard.planning import plan
from ray_reshard.planning.canonical import clear_caches, plan_tensor

HIDDEN = 7168
VOCAB = 129280
N_LAYERS = 61
N_DENSE = 3
N_EXPERTS = 256
MOE_INTER = 2048
DENSE_INTER = 18432

PP, EP = 16, 16            # source: 16 stages of 16 ranks
TP, DP = 32, 8             # destination: mesh (dp, tp)
DOMAIN_SIZE = 8

COL, ROW, REP = "col", "row", "rep"    # vLLM parallel style of a weight on the destination


def stage_layers(n_layers: int = N_LAYERS, pp: int = PP) -> list[range]:
    """Contiguous layer ranges per stage (the first n_layers % pp stages get one more)."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def model_weights() -> list[tuple[str, tuple[int, ...], str, object]]:
    """(name, shape, destination style, where on the source) for every weight.

    `where` is ("stage", s) for a weight replicated over stage s, or ("expert", s, e) for routed
    expert e of a layer on stage s.
    """
    out = []
    stages = stage_layers()
    stage_of = {layer: s for s, rng in enumerate(stages) for layer in rng}
    out.append(("model.embed_tokens.weight", (VOCAB, HIDDEN), COL, ("stage", 0)))
    for layer in range(N_LAYERS):
        s = stage_of[layer]
        p = f"model.layers.{layer}."
        st = ("stage", s)
        out += [
            (p + "input_layernorm.weight", (HIDDEN,), REP, st),
            (p + "post_attention_layernorm.weight", (HIDDEN,), REP, st),
            (p + "self_attn.q_a_proj.weight", (1536, HIDDEN), REP, st),
            (p + "self_attn.q_a_layernorm.weight", (1536,), REP, st),
            (p + "self_attn.q_b_proj.weight", (24576, 1536), COL, st),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (576, HIDDEN), REP, st),
            (p + "self_attn.kv_a_layernorm.weight", (512,), REP, st),
            (p + "self_attn.kv_b_proj.weight", (32768, 512), COL, st),
            (p + "self_attn.o_proj.weight", (HIDDEN, 16384), ROW, st),
        ]
        if layer < N_DENSE:
            out += [
                (p + "mlp.gate_proj.weight", (DENSE_INTER, HIDDEN), COL, st),
                (p + "mlp.up_proj.weight", (DENSE_INTER, HIDDEN), COL, st),
                (p + "mlp.down_proj.weight", (HIDDEN, DENSE_INTER), ROW, st),
            ]
            continue
        out += [
            (p + "mlp.gate.weight", (N_EXPERTS, HIDDEN), REP, st),
            (p + "mlp.gate.e_score_correction_bias", (N_EXPERTS,), REP, st),
            (p + "mlp.shared_experts.gate_proj.weight", (MOE_INTER, HIDDEN), COL, st),
            (p + "mlp.shared_experts.up_proj.weight", (MOE_INTER, HIDDEN), COL, st),
            (p + "mlp.shared_experts.down_proj.weight", (HIDDEN, MOE_INTER), ROW, st),
        ]
        for e in range(N_EXPERTS):
            q = f"{p}mlp.experts.{e}."
            ex = ("expert", s, e)
            out += [
                (q + "gate_proj.weight", (MOE_INTER, HIDDEN), COL, ex),
                (q + "up_proj.weight", (MOE_INTER, HIDDEN), COL, ex),
                (q + "down_proj.weight", (HIDDEN, MOE_INTER), ROW, ex),
            ]
    out.append(("model.norm.weight", (HIDDEN,), REP, ("stage", PP - 1)))
    out.append(("lm_head.weight", (VOCAB, HIDDEN), COL, ("stage", PP - 1)))
    return out


def build_specs(dtype: torch.dtype = torch.bfloat16) -> dict[str, TensorSpec]:
    stage_layout = [Layout.replicated(range(s * EP, (s + 1) * EP)) for s in range(PP)]
    expert_layout = {(s, r): Layout.replicated([s * EP + r]) for s in range(PP) for r in range(EP)}
    dst_mesh = Mesh([[d * TP + t for t in range(TP)] for d in range(DP)], ("dp", "tp"))
    dst = {COL: Layout(dst_mesh, (Replicate(), Shard(0))),
           ROW: Layout(dst_mesh, (Replicate(), Shard(1))),
           REP: Layout(dst_mesh, (Replicate(), Replicate()))}
    specs = {}
    for name, shape, style, where in model_weights():
        if where[0] == "stage":
            src = stage_layout[where[1]]
        else:
            _, s, e = where
            src = expert_layout[(s, e // (N_EXPERTS // EP))]
        specs[name] = TensorSpec(shape, dtype, src, dst[style])
    return specs


def domains():
    src = [f"s{r // DOMAIN_SIZE}" for r in range(PP * EP)]
    dst = [f"d{j // DOMAIN_SIZE}" for j in range(TP * DP)]
    return src, dst


def add_args(ap) -> None:
    ap.add_argument("--schedule", action="store_true",
                    help="also time build_schedule on the first --schedule-layers layers")
    ap.add_argument("--schedule-layers", type=positive_int, default=8,
                    help="layers whose tensors the schedule timing covers (61: the whole model; "
                         "slow and memory hungry: every tensor's moves become bucket items)")
    ap.add_argument("--bucket-mb", type=positive_int, default=64)
    ap.add_argument("--repeat", type=positive_int, default=3, help="cold runs (best is reported)")


def main(argv=None) -> int:
    ap = Parser(prog="ray-reshard plan-scale", description=__doc__.splitlines()[0])
    add_args(ap)
    return run(ap.parse_args(argv))


def run(args) -> int:

    t0 = time.perf_counter()
    specs = build_specs()
    t_specs = time.perf_counter() - t0
    src_domains, dst_domains = domains()

    def run():
        t, c = time.perf_counter(), time.process_time()
        p = plan(specs, src_domains, dst_domains)
        st = p.stats
        return p, st, time.perf_counter() - t, time.process_time() - c

    cold, cold_cpu = [], []
    for _ in range(max(1, args.repeat)):
        clear_caches()
        gc.collect()
        p, st, dt, dc = run()
        cold.append(dt)
        cold_cpu.append(dc)
    _, _, warm, warm_cpu = run()
    info = plan_tensor.cache_info()

    print(f"DeepSeek-V3-sized refit: PP{PP}xEP{EP} ({PP * EP} ranks) -> TP{TP}xDP{DP} "
          f"({TP * DP} ranks), {DOMAIN_SIZE} ranks per domain")
    print(f"tensors: {len(specs)}   distinct plans: {st.n_signatures}   "
          f"(spec construction {t_specs:.2f} s)")
    print(f"planning (plan() + stats): cold {min(cold):.3f} s (cpu {min(cold_cpu):.3f} s), "
          f"warm {warm:.3f} s (cpu {warm_cpu:.3f} s)   "
          f"[plan_tensor cache over the last cold + warm runs: {info.hits} hits, {info.misses} misses]")
    print(st.summary())
    ok = st.network_bytes == st.min_network_bytes
    print(f"network bytes {'==' if ok else '!='} lower bound; "
          f"gather-broadcast / network = {st.gather_broadcast_bytes / max(1, st.network_bytes):.1f}x")
    if args.schedule:
        keep = {f"model.layers.{i}." for i in range(args.schedule_layers)}
        sub = {n: s for n, s in specs.items()
               if n.startswith("model.layers.") and n[:n.index(".", 13) + 1] in keep}
        sp = plan(sub, src_domains, dst_domains)
        n_moves = sp.stats.n_moves
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        sched = sp.schedule(args.bucket_mb << 20)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        print(f"schedule of the first {args.schedule_layers} layers ({len(sub)} tensors, "
              f"{n_moves} moves, {args.bucket_mb} MiB buckets): {len(sched)} transfers in "
              f"{dt:.2f} s (cpu {dc:.2f} s, {dc / max(1, n_moves) * 1e6:.1f} us per move)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
