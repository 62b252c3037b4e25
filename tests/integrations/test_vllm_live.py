"""The vLLM backend against live vLLM engines (vLLM's CPU build) on a local Ray cluster.

Real: vLLM engines (`LLM` in a Ray actor; TP 1 in the actor's process, TP 2 with vLLM's
multiprocessing executor), vLLM's weight-transfer API and its Ray client, trainer actors holding
Megatron-style shards, the ReshardGroup between them. Models are tiny Qwen3 and Qwen3-MoE made
from configs. After each refit the engine's greedy generation must equal transformers' on the
same full weights.
"""
import pytest
import ray
import torch

from live import (DEEPSEEK_V3, MAX_TOKENS, PROMPTS, QWEN3, QWEN3_MOE, FSDPTrainer, ShardTrainer,
                  assert_same_generation, checkpoint_state, perturbed, reference, require_vllm)

from ray_reshard.models import FSDP, VLLM, Megatron, local_state

# engines take seconds to start alone, minutes on a loaded machine
pytestmark = [pytest.mark.vllm_live, pytest.mark.timeout(900)]

CASES = [  # (model, engine TP, trainer layout)
    ("qwen3", 1, Megatron(tp=2)),
    ("qwen3", 2, Megatron(pp=2)),
    ("qwen3_moe", 1, Megatron(ep=2, dp=2)),
    ("qwen3_moe", 2, Megatron(tp=2, ep=2, etp=1)),
    ("deepseek_v3", 1, Megatron(tp=2, ep=2, etp=1)),
]
CONFIGS = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "deepseek_v3": DEEPSEEK_V3}
# Weights to refit: the checkpoint's plus noise of this scale. DeepSeek-V3 gets larger weights,
# so its logits are far apart: at init scale, vLLM's absorbed MLA and transformers' MLA differ
# in rounding enough to break near-ties between greedy tokens.
SCALE = {"qwen3": 0.05, "qwen3_moe": 0.05, "deepseek_v3": 0.3}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-tp{c[1]}-{c[2]}")
def live(request, cluster, tmp_path_factory):
    require_vllm()
    from ray_reshard.integrations.vllm_engine import start_engine, write_model

    name, tp, train = request.param
    cfg = CONFIGS[name]
    path = str(tmp_path_factory.mktemp(f"{name}-tp{tp}"))
    write_model(cfg, path, seed=0)
    base = checkpoint_state(path)
    engine = start_engine(path, tp=tp)
    yield {"name": name, "cfg": cfg, "tp": tp, "train": train, "infer": VLLM(tp=tp),
           "path": path, "base": base, "engine": engine, "scale": SCALE[name]}
    ray.kill(engine)


def trainers_for(live, sd):
    train, cfg = live["train"], live["cfg"]
    return [ShardTrainer.remote(r, local_state(cfg, train, "src", r, sd, dtype=torch.float32,
                                               hf_experts="split"))
            for r in range(train.world)]


def init_all(trainers, live, infer=None, dtype=torch.float32, key="default"):
    infer = infer or live["infer"]
    return ray.get([t.init.remote(trainers, [live["engine"]], live["cfg"], live["train"], infer,
                                  dtype, key) for t in trainers])[0]


def test_refit_then_generate_equals_transformers(live):
    from ray_reshard.integrations.vllm_engine import generate

    engine = live["engine"]
    before = generate(engine, PROMPTS, MAX_TOKENS)
    if live["name"] != "deepseek_v3":       # near-ties at init scale (see SCALE)
        assert_same_generation(before, reference(live["path"], live["base"]))

    new = perturbed(live["base"], seed=1, scale=live["scale"])
    trainers = trainers_for(live, new)
    report = init_all(trainers, live)
    results = ray.get([t.send.remote() for t in trainers])
    assert results[0]["version"] == 1 and results[1:] == [None] * (len(trainers) - 1)
    got = generate(engine, PROMPTS, MAX_TOKENS)
    assert_same_generation(got, reference(live["path"], new))
    assert [g["token_ids"] for g in got] != [b["token_ids"] for b in before]

    # a second refit with changed weights: the engine follows them
    newer = perturbed(live["base"], seed=2, scale=live["scale"])
    for r, t in enumerate(trainers):
        ray.get(t.load.remote(local_state(live["cfg"], live["train"], "src", r, newer,
                                          dtype=torch.float32, hf_experts="split")))
    assert ray.get([t.send.remote() for t in trainers])[0]["version"] == 2
    assert_same_generation(generate(engine, PROMPTS, MAX_TOKENS), reference(live["path"], newer))
    ray.get([t.close.remote() for t in trainers])

    # every decision as the CPU build requires: norms and the embedding lookup read their
    # parameters (in place); linear weights are released and repacked, the LM head's logits
    # read a packed copy, MoE experts are prepacked (all through load_weights)
    for row in report:
        name = row["name"]
        in_place = name.endswith("norm.weight") or name == "model.embed_tokens.weight"
        assert (row["route"] == "in place") == in_place, row
        if "proj" in name and "experts" not in name or name.endswith("mlp.gate.weight"):
            assert row["shape"] == (0,) and "released" in row["why"], row
        if name == "lm_head.weight":
            assert "packed copy" in row["why"], row
        if "experts" in name:
            assert "rearranges expert weights" in row["why"], row
    assert {r["rank"] for r in report} == set(range(live["tp"]))


def test_refused_refit_leaves_the_engine_serving_as_before(live):
    from ray_reshard.integrations.vllm_engine import generate

    engine = live["engine"]
    before = generate(engine, PROMPTS, MAX_TOKENS)
    new = perturbed(live["base"], seed=3)
    trainers = trainers_for(live, new)
    wrong_tp = VLLM(tp=3 - live["tp"])
    with pytest.raises(Exception, match="has .* ranks but the engines have|tensor_parallel_size"):
        init_all(trainers, live, infer=wrong_tp, key="wrong-layout")
    with pytest.raises(Exception, match="(?s)refused before moving any byte.*is float32, "
                                        "refit dtype is bfloat16"):
        init_all(trainers, live, dtype=torch.bfloat16, key="wrong-dtype")
    after = generate(engine, PROMPTS, MAX_TOKENS)
    assert after == before
    ray.get([t.close.remote() for t in trainers])
    for t in trainers:
        ray.kill(t)


@pytest.mark.parametrize("live", [CASES[1]], indirect=True, ids=["qwen3-tp2"])
def test_fsdp2_trainers_refit_a_live_engine(live):
    """torch FSDP2 trainers (gloo, Hugging Face names) take an optimizer step and refit the
    engine from their shards; it then generates as transformers does on their full_tensor()."""
    import socket

    from ray_reshard.integrations.vllm_engine import generate

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 2
    trainers = [FSDPTrainer.remote(r, world, f"tcp://127.0.0.1:{port}", live["path"])
                for r in range(world)]
    losses = ray.get([t.step.remote(1) for t in trainers])
    assert all(loss > 0 for loss in losses)
    full = ray.get([t.full_state.remote() for t in trainers])[0]
    assert not torch.equal(full["model.norm.weight"], live["base"]["model.norm.weight"])
    ray.get([t.init.remote(trainers, [live["engine"]], live["cfg"], FSDP(shard=world),
                           live["infer"], torch.float32, "fsdp") for t in trainers])
    assert ray.get([t.send.remote() for t in trainers])[0]["network_bytes"] > 0
    assert_same_generation(generate(live["engine"], PROMPTS, MAX_TOKENS),
                           reference(live["path"], full))
    ray.get([t.close.remote() for t in trainers])
