"""The main job: refit a small MoE model between two real-world layouts on a local CPU cluster.

A two-node local Ray cluster (simulated nodes). Four training actors on node A hold a small
Qwen3-MoE model the way Megatron-core does (PP2 x EP2 x DP2, fused linear_qkv grouped per
query group, fc1 = [gate; up], fp32 master weights); four inference actors on node B hold it the
way vLLM does (DP2 engines of TP2 with expert parallelism, qkv_proj / gate_up_proj / stacked w13
and w2 experts, vocabulary padded to a multiple of 64, bf16). The actors are plain classes that
only expose their tensors. We refit with both strategies, verify every destination storage
bit-exactly, and print what each strategy moved (bytes by path) next to its measured time.

Both simulated nodes share one machine, where the loopback "network" costs about what shared
memory does, so local times understate the difference; the bytes are what a real cluster pays
for. `cluster_prediction` is where a cluster simulator's predicted times are added to the table.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from .cli_args import SMALL_MOE as CONFIG      # a Qwen3-MoE-style model, seconds to plan


PREDICTED_ON = "dgx-h100"


def cluster_prediction(plan) -> Optional[dict]:
    """Predicted refit seconds of this plan's ranks and domains on DGX H100 nodes (NVLink
    inside a node, one 400 Gb/s NIC per GPU), {strategy: seconds}, from the cluster simulator."""
    from ..sim import gather_broadcast_seconds, preset, simulate

    cluster = preset(PREDICTED_ON)
    return {"reshard": simulate(plan, cluster).predicted_s,
            "gather_broadcast": gather_broadcast_seconds(plan, cluster)}


def run_demo(scale: int = 1, repeats: int = 3) -> int:
    import ray

    import ray_reshard as rr
    from ray_reshard import models
    from ray_reshard.tools.cli_args import raylet_messages_at_debug, say
    from ray_reshard.session import connect

    config = dict(CONFIG, num_hidden_layers=CONFIG["num_hidden_layers"] * scale)
    train = models.Megatron(tp=1, pp=2, ep=2, dp=2)
    infer = models.VLLM(tp=2, dp=2, ep=2)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) * 0.02
             for n, s in models.hf_parameter_shapes(config).items()}
    specs = models.refit_specs(config, train=train, infer=infer, dtype=torch.bfloat16,
                               train_dtype=torch.float32)
    print(f"model: Qwen3-MoE-style, {config['num_hidden_layers']} layers, "
          f"{len(state)} HF parameters, {sum(s.nbytes for s in specs.values()) / 1e6:.1f} MB "
          f"in bf16 as {len(specs)} logical tensors")
    print(f"training side: Megatron {train.pp=} {train.ep=} {train.dp=} (fp32), node A; "
          f"inference side: {infer} (bf16), node B")

    # Tests running many commands share one cluster through RAY_RESHARD_CLUSTER_ADDRESS.
    address = os.environ.get("RAY_RESHARD_CLUSTER_ADDRESS")
    if address is None and not ray.is_initialized():
        say("starting a local two-node Ray cluster...")
    with connect(address, nodes=2), raylet_messages_at_debug():
        @ray.remote(num_cpus=0)
        class Trainer:
            def __init__(self, params):
                self.params = params

            def reshard_tensors(self):
                return self.params

        @ray.remote(num_cpus=0)
        class Engine:
            def __init__(self, weights):
                self.weights = weights

            def reshard_tensors(self):
                return self.weights

            def weights_now(self):
                return self.weights

            def zero(self):
                for t in self.weights.values():
                    t.zero_()

        trainers = [Trainer.options(resources={"node0": 1}).remote(
            models.local_state(config, train, "src", r, state, dtype=torch.float32))
            for r in range(train.world)]
        engines = [Engine.options(resources={"node1": 1}).remote(
            models.empty_storage(config, infer, r, dtype=torch.bfloat16))
            for r in range(infer.world)]
        want = [models.local_state(config, infer, "dst", r, state, dtype=torch.bfloat16)
                for r in range(infer.world)]
        seconds, moved, plan = {}, {}, None
        for strategy in ("reshard", "gather_broadcast"):
            ray.get([e.zero.remote() for e in engines])
            with rr.ReshardGroup(trainers, engines, strategy=strategy,
                                 bucket_bytes=16 << 20) as group:
                if strategy == "reshard":
                    plan = group.plan(specs)
                    print("\nplan:\n" + plan.summary())
                say(f"{strategy}: first refit (sets up groups and programs)...")
                group.refit(specs)                      # first refit also installs programs
                runs = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    res = group.refit(specs)
                    runs.append(time.perf_counter() - t0)
                seconds[strategy] = sorted(runs)[len(runs) // 2]
                moved[strategy] = res.bytes_by_path
                print(f"\n{res.summary()}")
            got = ray.get([e.weights_now.remote() for e in engines])
            bad = [(r, n) for r in range(infer.world) for n in want[r]
                   if not torch.equal(got[r][n], want[r][n])]
            if bad:
                print(f"VERIFY FAILED ({strategy}): {bad[:5]}")
                return 1
            print(f"verified all {sum(len(w) for w in want)} storage tensors of "
                  f"{infer.world} engines bit-exactly ({strategy})")
        predicted = cluster_prediction(plan)
        print(f"\n{'strategy':<18}{'network MB':>11}{'domain MB':>11}{'local MB':>10}"
              f"{'local s':>9}" + (f"{PREDICTED_ON + ' s':>13}" if predicted else ""))
        for strategy in ("reshard", "gather_broadcast"):
            b = moved[strategy]
            print(f"{strategy.replace('_', '-'):<18}{b['network'] / 1e6:>11.1f}"
                  f"{b['domain'] / 1e6:>11.1f}{b['local'] / 1e6:>10.1f}{seconds[strategy]:>9.3f}"
                  + (f"{predicted[strategy]:>13.4f}" if predicted else ""))
        r, gb = seconds["reshard"], seconds["gather_broadcast"]
        net = moved["gather_broadcast"]["network"] / max(1, moved["reshard"]["network"])
        print(f"gather-broadcast / reshard: {net:.1f}x the network bytes, {gb / r:.2f}x the local "
              f"time (median of {repeats} refits)"
              + (f", {predicted['gather_broadcast'] / predicted['reshard']:.1f}x the predicted "
                 f"time on {PREDICTED_ON} nodes (ray-reshard simulate)" if predicted else ""))
        print("local s: both simulated nodes share this machine, where the loopback 'network' "
              "costs about what shared memory does;\nthe network bytes are what a real "
              "cluster pays for, over links far slower than NVLink.")
        return 0
