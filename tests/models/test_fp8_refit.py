"""Refits into vLLM engines serving block FP8 (`VLLM(quantization="fp8")`): which tensors the
recipe quantises, and every destination byte compared with the reference quantisation of the
HF tensor (in the simulator and on a real local Ray cluster, colocated too)."""
import sys

import pytest
import ray
import torch

import ray_reshard as rr
from ray_reshard.execution.fp8 import reference_quantize
from ray_reshard.layout.quant import BlockFP8, scale_view
from ray_reshard.models import Megatron, VLLM, Recipe, empty_storage, local_state, refit_specs
from ray_reshard.execution.program import PER_ITEM_MIN_BYTES
from ray_reshard.execution.reference import simulate_refit
from ray_reshard.tools.testing import holders

from engine_reference import reference_state
from models_testutil import make_model

FP8 = torch.float8_e4m3fn
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _kinds(cfg, train, infer):
    rec = Recipe(cfg, train, infer)
    specs = rec.specs(torch.bfloat16, torch.float32)
    quantised = {pc.kind for pc in rec.pieces if specs[pc.name].quant is not None}
    plain = {pc.kind for pc in rec.pieces if specs[pc.name].quant is None}
    return specs, quantised, plain


def test_recipe_quantises_what_vllm_fp8_quantises():
    cfg, _ = make_model("qwen3_moe")
    specs, quantised, plain = _kinds(cfg, Megatron(tp=2), VLLM(tp=2, quantization="fp8",
                                                                weight_block_size=(16, 16)))
    assert quantised == {"q", "k", "v", "o", "gate", "up", "down", "e_gate", "e_up", "e_down"}
    assert plain == {"embed", "lm_head", "final_norm", "in_norm", "post_norm", "q_norm",
                     "k_norm", "router"}
    for name, spec in specs.items():
        if spec.quant is not None:
            assert spec.dtype == FP8 and spec.source_dtype == torch.float32, name
            assert spec.quant == BlockFP8((16, 16))
        else:
            assert spec.dtype == torch.bfloat16, name
    cfg, _ = make_model("deepseek_v3")
    _, quantised, plain = _kinds(cfg, Megatron(tp=2), VLLM(tp=2, quantization="fp8",
                                                           weight_block_size=(8, 8)))
    assert quantised == {"q_a", "kv_a", "q_b", "kv_b", "o", "gate", "up", "down", "sh_gate",
                         "sh_up", "sh_down", "e_gate", "e_up", "e_down"}
    assert {"router", "router_bias", "embed", "lm_head", "q_a_norm", "kv_a_norm"} <= plain
    # storages: FP8 weights and float32 scales named as vLLM names them
    st = empty_storage(cfg, VLLM(tp=2, ep=2, quantization="fp8", weight_block_size=(8, 8)), 0)
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert st[w13].dtype == FP8 and st[w13 + "_scale_inv"].dtype == torch.float32
    assert tuple(st[w13 + "_scale_inv"].shape) == (4, 2 * 32 // 8, 64 // 8)
    assert st["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"].shape == (6, 8)
    assert st["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def _check(cfg, sd, specs, infer, dst):
    """Every destination region equals the reference applied to the HF tensor."""
    ref = {}
    n_fp8 = 0
    for name, spec in specs.items():
        full = _piece(cfg, sd, name, spec)
        for r in range(infer.world):
            box = spec.dst.box(r, spec.shape)
            if box is None or box.empty:
                continue
            slot = spec.slot("dst", r, name)
            got = slot.view(dst[r][slot.storage], box.sizes)
            if spec.quant is None:
                assert torch.equal(got, full[box.slices()].to(spec.dtype)), (r, name)
                continue
            if name not in ref:
                ref[name] = reference_quantize(full.to(spec.source_dtype), spec.quant.block)
            q, s = ref[name]
            assert torch.equal(got.view(torch.uint8), q[box.slices()].view(torch.uint8)), \
                (r, name)
            scales, problem = scale_view(spec, name, r, dst[r])
            b = spec.quant.full_block(len(spec.shape))
            sl = tuple(slice(o // k, -(-(o + n) // k))
                       for o, n, k in zip(box.offsets, box.sizes, b))
            assert torch.equal(scales, s[sl]), (r, name, problem)
            n_fp8 += 1
    assert n_fp8 > 0


def _piece(cfg, sd, name, spec):
    pieces = {pc.name: pc for pc in _piece._recipe.pieces}
    pc = pieces[name]
    return pc.hf_slot.view(sd[pc.hf], pc.shape)


KV4 = {"num_key_value_heads": 4}
CASES = [
    # aligned sources: the senders quantise every block
    ("qwen3_moe", {}, Megatron(tp=2, ep=2, etp=1),
     VLLM(tp=2, dp=2, ep=4, quantization="fp8", weight_block_size=(16, 16))),
    # Megatron TP4 cuts 16-row blocks of the MLPs (96 / 4 = 24 rows, experts 32 / 4 = 8):
    # those tensors fall back to destination quantisation; the rest is quantised by the senders
    ("qwen3_moe cut", KV4, Megatron(tp=4),
     VLLM(tp=2, dp=2, quantization="fp8", weight_block_size=(16, 16))),
    ("deepseek_v3", {}, Megatron(tp=2, ep=2, etp=1),
     VLLM(tp=2, dp=2, quantization="fp8", weight_block_size=(8, 8))),
]


@pytest.mark.parametrize("family,over,train,infer", CASES)
def test_fp8_refit_simulated(family, over, train, infer):
    cfg, model = make_model(family.split()[0], **over)
    sd = model.state_dict()
    specs = refit_specs(cfg, train, infer, dtype=torch.bfloat16, train_dtype=torch.float32)
    _piece._recipe = Recipe(cfg, train, infer)
    src = [local_state(cfg, train, "src", r, sd, dtype=torch.float32) for r in range(train.world)]
    dst = [empty_storage(cfg, infer, r, fill=7.0) for r in range(infer.world)]
    plan = rr.plan(specs, [("s", r // 2) for r in range(train.world)],
                   [("d", r // 2) for r in range(infer.world)])
    assert plan.stats.network_bytes == plan.stats.min_network_bytes
    bf16 = rr.plan(refit_specs(cfg, train, VLLM(**{**infer.__dict__, "quantization": None}),
                               dtype=torch.bfloat16, train_dtype=torch.float32),
                   [("s", r // 2) for r in range(train.world)],
                   [("d", r // 2) for r in range(infer.world)])
    on_grid = [n for n, sp in specs.items() if sp.quant is not None and sp.itemsize > 4]
    fallback = [n for n, sp in specs.items() if sp.quant is not None and sp.itemsize <= 4]
    assert on_grid and (bool(fallback) == ("cut" in family))
    # blocks sent by their quantising senders: FP8 bytes plus a float32 scale per block
    per_block = infer.weight_block_size[0] * infer.weight_block_size[1]
    fp8_bytes = sum(plan.tensor_plans[plan.index[n]].stats.network_bytes for n in on_grid)
    bf16_bytes = sum(bf16.tensor_plans[bf16.index[n]].stats.network_bytes for n in on_grid)
    assert fp8_bytes / bf16_bytes == pytest.approx((per_block + 4) / (2 * per_block))
    simulate_refit(plan, src, dst, bucket_bytes=4096)
    _check(cfg, sd, specs, infer, dst)
    # every storage, FP8 weights and scales included, as engine_reference builds the engine's
    for r in range(infer.world):
        want = reference_state(cfg, sd, infer, r, dtype=torch.bfloat16, fill=7.0)
        assert set(want) == set(dst[r]), (r, sorted(set(want) ^ set(dst[r])))
        for n, t in dst[r].items():
            assert t.dtype == want[n].dtype and t.shape == want[n].shape, (r, n)
            assert torch.equal(t.view(torch.uint8), want[n].view(torch.uint8)), (r, n)


# Ray's serialiser cannot ship float8 tensors (torch's legacy storage path has no float8), so
# engine storages are made inside the actors and read back as bytes, as an engine keeps its
# parameters in its own process.
def _add_engine_storage(actor, cfg, infer, rank):
    actor.tensors = {**actor.tensors, **empty_storage(cfg, infer, rank, fill=7.0)}


def _storage_bytes(actor):
    return {k: v.view(torch.uint8) if v.dtype == FP8 else v for k, v in actor.tensors.items()}


def _read(actors):
    got = ray.get([a.__ray_call__.remote(_storage_bytes) for a in actors])
    return [{k: v.view(FP8) if v.dtype == torch.uint8 else v for k, v in d.items()} for d in got]


def test_fp8_refit_on_ray_cluster_with_colocated_engines(cluster):
    """Megatron TP4 (cutting some blocks) -> vLLM TP2 x DP2 (experts EP4) FP8 on two nodes,
    then the same refit colocated (each trainer actor is also an engine actor)."""
    cfg, model = make_model("qwen3_moe", **KV4)
    sd = model.state_dict()
    train = Megatron(tp=4)
    infer = VLLM(tp=2, dp=2, ep=4, quantization="fp8", weight_block_size=(16, 16))
    specs = refit_specs(cfg, train, infer, dtype=torch.bfloat16, train_dtype=torch.float32)
    _piece._recipe = Recipe(cfg, train, infer)
    src = holders(4, 0)
    dst = holders(2, 0) + holders(2, 1)
    ray.get([a.set.remote(local_state(cfg, train, "src", r, sd, dtype=torch.float32))
             for r, a in enumerate(src)])
    ray.get([a.__ray_call__.remote(_add_engine_storage, cfg, infer, r) for r, a in enumerate(dst)])
    with rr.ReshardGroup(src, dst, bucket_bytes=1 << 16) as group:
        result = group.refit(specs)
        assert result.version == 1
        _check(cfg, sd, specs, infer, _read(dst))
        ray.get([a.__ray_call__.remote(_add_engine_storage, cfg, infer, r)
                 for r, a in enumerate(dst)])
        group.refit(specs, atomic=True)           # staged copies, scales too
        _check(cfg, sd, specs, infer, _read(dst))
    # colocated: the four actors hold their training shards and an engine's storage
    both = holders(4, 0)
    ray.get([a.set.remote(local_state(cfg, train, "src", r, sd, dtype=torch.float32))
             for r, a in enumerate(both)])
    ray.get([a.__ray_call__.remote(_add_engine_storage, cfg, infer, r)
             for r, a in enumerate(both)])
    with rr.ReshardGroup(both, both) as group:
        group.refit(specs)
        _check(cfg, sd, specs, infer, _read(both))


def test_bench_fp8_command_small_mode():
    """`python -m ray_reshard bench-fp8` as a user runs it (small mode: the first 4 layers)."""
    import os
    import re
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "ray_reshard", "bench-fp8", "--models",
                        "deepseek-v3", "--layers", "4", "--repeats", "1"], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    ratios = [float(x) for x in re.findall(r"-> (\d\.\d+)x\n", out)]
    assert len(ratios) == 2 and all(0.45 < r < 0.8 for r in ratios), out
    assert "GB/s of BF16 read" in out
    assert "bit-exact against the reference: yes" in out


@pytest.mark.slow
def test_fp8_items_as_single_messages_on_ray(cluster):
    """Items at the per-item threshold or above travel as one message each (staged: quantised on the way out,
    weights and scales unpacked on the way in; a fallback tensor widened), forwarded to the
    other replica of each destination node."""
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(1024, 512, generator=g) * 0.02).to(torch.bfloat16)
    cut = (torch.randn(600, 2048, generator=g) * 0.02).to(torch.bfloat16)
    q = rr.BlockFP8((16, 16))
    src2 = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(0),))
    src3 = rr.Layout(rr.Mesh([0, 1, 2]), (rr.Shard(0),))           # 200-row shards cut blocks
    dst = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(1)))
    specs = {"w": rr.TensorSpec(full.shape, FP8, src2, dst, src_dtype=torch.bfloat16, quant=q),
             "c": rr.TensorSpec(cut.shape, FP8, src3, dst, src_dtype=torch.bfloat16, quant=q)}
    src = holders(3, 0)
    engines = [holders(1, 0)[0], holders(1, 1)[0], holders(1, 0)[0], holders(1, 1)[0]]
    ray.get([a.set.remote({k: rr.shard_tensor(t, lay, r) for k, t, lay in
                           (("w", full, src2), ("c", cut, src3)) if r in lay.mesh.ranks})
             for r, a in enumerate(src)])

    def make(actor, shapes):
        actor.tensors = {k: torch.zeros(s, dtype=FP8 if not k.endswith("inv") else torch.float32)
                         for k, s in shapes.items()}

    for r, a in enumerate(engines):
        shapes = {}
        for k, t in (("w", full), ("c", cut)):
            local = dst.local_shape(r, t.shape)
            shapes[k], shapes[k + "_scale_inv"] = local, q.scale_shape(local)
        ray.get(a.__ray_call__.remote(make, shapes))
    with rr.ReshardGroup(src, engines) as group:
        result = group.refit(specs)
        assert result.bytes_by_path["domain"] > 0
    got = _read(engines)
    for k, t in (("w", full), ("c", cut)):
        rq, rs = reference_quantize(t, (16, 16))
        for r in range(4):
            box = dst.box(r, t.shape)
            sl = slice(box.offsets[1] // 16, (box.offsets[1] + box.sizes[1]) // 16)
            assert torch.equal(got[r][k].view(torch.uint8), rq[box.slices()].view(torch.uint8))
            assert torch.equal(got[r][k + "_scale_inv"], rs[:, sl])
    plan = rr.plan(specs, ["n0"] * 3, ["n0", "n1", "n0", "n1"])
    big = [t for t in plan.schedule(64 << 20).transfers if t.path == "network"
           and all(it.box.numel * specs[plan.names[it.tensor]].itemsize >= PER_ITEM_MIN_BYTES
                   for it in t.items)]
    assert {plan.names[it.tensor] for t in big for it in t.items} == {"w", "c"}
