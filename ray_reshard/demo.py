"""The main job: refit a small model between two layouts on a local CPU Ray cluster.

Starts a two-node local cluster (simulated nodes), places 4 training actors on one node and
4 inference actors on the other, shards a small Llama-style model TP4 on the training side and
TP2 x DP2 on the inference side, refits with both strategies, verifies every destination shard
against the full weights, and prints the report.
"""
from __future__ import annotations

import time

import torch


def toy_model_specs(layers: int, hidden: int, vocab: int = 4096):
    """Full tensors and TensorSpecs of a small Llama-style model: TP4 -> TP2 x DP2."""
    import ray_reshard as rr
    from ray_reshard.core.placement import Replicate, Shard

    tp4 = rr.Mesh([0, 1, 2, 3], ("tp",))
    infer = rr.Mesh([[0, 1], [2, 3]], ("dp", "tp"))
    col = (rr.Layout(tp4, (Shard(0),)), rr.Layout(infer, (Replicate(), Shard(0))))
    row = (rr.Layout(tp4, (Shard(1),)), rr.Layout(infer, (Replicate(), Shard(1))))
    rep = (rr.Layout(tp4, (Replicate(),)), rr.Layout(infer, (Replicate(), Replicate())))
    inter = 4 * hidden
    shapes = {"model.embed_tokens.weight": ((vocab, hidden), col)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": ((hidden,), rep),
            p + "self_attn.q_proj.weight": ((hidden, hidden), col),
            p + "self_attn.k_proj.weight": ((hidden // 4, hidden), col),
            p + "self_attn.v_proj.weight": ((hidden // 4, hidden), col),
            p + "self_attn.o_proj.weight": ((hidden, hidden), row),
            p + "post_attention_layernorm.weight": ((hidden,), rep),
            p + "mlp.gate_proj.weight": ((inter, hidden), col),
            p + "mlp.up_proj.weight": ((inter, hidden), col),
            p + "mlp.down_proj.weight": ((hidden, inter), row),
        })
    shapes["model.norm.weight"] = ((hidden,), rep)
    shapes["lm_head.weight"] = ((vocab, hidden), col)
    g = torch.Generator().manual_seed(0)
    specs, fulls = {}, {}
    for name, (shape, (src, dst)) in shapes.items():
        specs[name] = rr.TensorSpec(shape, torch.bfloat16, src, dst, src_dtype=torch.float32)
        fulls[name] = torch.randn(shape, generator=g)
    return specs, fulls


def run_demo(layers: int = 4, hidden: int = 512) -> int:
    import ray
    from ray.cluster_utils import Cluster

    import ray_reshard as rr

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"train": 8}})
    cluster.add_node(num_cpus=1, resources={"infer": 8})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0)
        class Trainer:
            def __init__(self, tensors):
                self.params = tensors

            def reshard_tensors(self):
                return self.params

        @ray.remote(num_cpus=0)
        class Engine:
            def __init__(self, shapes):
                self.weights = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}

            def reshard_tensors(self):
                return self.weights

            def weights_now(self):
                return self.weights

        specs, fulls = toy_model_specs(layers, hidden)
        total = sum(s.nbytes for s in specs.values())
        print(f"model: {len(specs)} tensors, {total / 1e6:.1f} MB in bf16 "
              f"(fp32 master weights on the trainers)")
        trainers = [Trainer.options(resources={"train": 1}).remote(
            {n: rr.shard_tensor(fulls[n], s.src, r) for n, s in specs.items()}) for r in range(4)]
        engines = [Engine.options(resources={"infer": 1}).remote(
            {n: s.dst.local_shape(r, s.shape) for n, s in specs.items()}) for r in range(4)]
        print("training layout: TP4 on node 1; inference layout: TP2 x DP2 on node 2")
        results = {}
        for strategy in ("reshard", "gather_broadcast"):
            with rr.ReshardGroup(trainers, engines, strategy=strategy,
                                 bucket_bytes=16 << 20) as group:
                if strategy == "reshard":
                    print(group.plan(specs).summary())
                group.refit(specs)                      # warm-up: installs programs
                t0 = time.perf_counter()
                res = group.refit(specs)
                results[strategy] = (time.perf_counter() - t0, res)
                print(res.summary())
            bad = _verify(engines, specs, fulls)
            if bad:
                print(f"VERIFY FAILED ({strategy}): {bad[:5]}")
                return 1
            print(f"verified {len(specs)} tensors on 4 engines bit-exactly ({strategy})")
            ray.get([e.__ray_call__.remote(_zero) for e in engines])
        r, g = results["reshard"][0], results["gather_broadcast"][0]
        print(f"reshard {r:.3f} s vs gather-broadcast {g:.3f} s: {g / r:.1f}x faster")
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


def _zero(engine):
    for t in engine.weights.values():
        t.zero_()


def _verify(engines, specs, fulls) -> list:
    import ray

    import ray_reshard as rr

    got = ray.get([e.weights_now.remote() for e in engines])
    bad = []
    for name, spec in specs.items():
        want = fulls[name].to(spec.dtype)
        for r, w in enumerate(got):
            if not torch.equal(w[name], rr.shard_tensor(want, spec.dst, r)):
                bad.append((name, r))
    return bad
