"""Delta refits into a live vLLM engine (CPU build) whose linear layers read their parameters
in place (fp32, vLLM's oneDNN repacking off, as a GPU engine reads unquantised weights): every
parameter is written in place and sent as the bytes that changed since the last round; greedy
generation equals transformers' on the trainers' weights after every round."""
import pytest
import ray
import torch

from live import (MAX_TOKENS, PROMPTS, QWEN3_TIED, ShardTrainer, assert_same_generation,
                  checkpoint_state, in_place_llm, perturbed, reference, require_vllm,
                  sparsely_changed)

from ray_reshard.models import VLLM, Megatron, local_state

pytestmark = [pytest.mark.vllm_live, pytest.mark.timeout(900)]


def test_delta_rounds_into_an_engine_reading_its_parameters_in_place(cluster, tmp_path):
    require_vllm()
    from ray_reshard.engines.vllm.launch import generate, start_engine, write_model

    cfg, train, infer = QWEN3_TIED, Megatron(tp=2), VLLM(tp=1)
    write_model(cfg, str(tmp_path), seed=0)
    base = checkpoint_state(str(tmp_path))
    # trainers and engine on two nodes: the bytes cross the network, where deltas travel
    engine = start_engine(str(tmp_path), tp=1, llm_class=in_place_llm(),
                          options={"resources": {"node1": 1}})
    try:
        weights = perturbed(base, seed=1)
        trainers = [ShardTrainer.options(resources={"node0": 1}).remote(
            r, local_state(cfg, train, "src", r, weights, dtype=torch.float32, hf_experts="split"))
                    for r in range(train.world)]
        report = ray.get([t.init.remote(trainers, [engine], cfg, train, infer, torch.float32,
                                        "delta", False, True) for t in trainers])[0]
        # every parameter is read in place (linear weights too) and travels as a delta
        assert report and all(r["route"] == "in place" and r["delta"] for r in report), report
        assert {r["name"] for r in report} >= {"model.layers.0.self_attn.qkv_proj.weight",
                                               "model.layers.1.mlp.down_proj.weight",
                                               "lm_head.weight"}
        dense_bytes = None
        for step in range(3):
            if step:
                weights = sparsely_changed(weights, seed=10 + step, fraction=0.1)
                ray.get([t.load.remote(local_state(cfg, train, "src", r, weights,
                                                   dtype=torch.float32, hf_experts="split"))
                         for r, t in enumerate(trainers)])
            res = ray.get([t.send.remote() for t in trainers])[0]
            d = res["delta"]
            if step == 0:       # nothing to compare against yet: dense, and said so
                assert d["fallbacks"] and d["network_bytes"] == d["dense_network_bytes"]
                dense_bytes = d["dense_network_bytes"]
            else:               # ~10% of the elements changed: a fraction of the bytes
                assert not d["fallbacks"] and not d["mismatches"], d
                assert d["network_bytes"] < 0.5 * dense_bytes, d
            assert_same_generation(generate(engine, PROMPTS, MAX_TOKENS),
                                   reference(str(tmp_path), weights))
        ray.get([t.close.remote() for t in trainers])
    finally:
        ray.kill(engine)
