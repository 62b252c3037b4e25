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

from live import (DEEPSEEK_V3, LLAMA_BIAS, MAX_TOKENS, PROMPTS, QWEN3_MOE, QWEN3_MOE_TIED,
                  QWEN3_TIED, FSDPTrainer, ShardTrainer, assert_same_generation,
                  checkpoint_state, fresh_engine_reference, perturbed, random_state, reference,
                  require_vllm)

from ray_reshard.models import FSDP, VLLM, Megatron, local_state

# engines take seconds to start alone, minutes on a loaded machine
pytestmark = [pytest.mark.vllm_live, pytest.mark.timeout(900)]

CASES = [  # (model, engine TP, trainer layout)
    ("qwen3_tied", 1, Megatron(tp=2)),
    ("qwen3_tied", 2, Megatron(pp=2)),
    ("llama_bias", 2, Megatron(tp=2, pp=2)),
    ("qwen3_moe_tied", 1, Megatron(pp=2, dp=2, ep=2)),
    ("qwen3_moe", 2, Megatron(tp=2, ep=2, etp=1)),
    ("deepseek_v3", 1, Megatron(tp=2, ep=2, etp=1)),
]
CONFIGS = {"qwen3_tied": QWEN3_TIED, "llama_bias": LLAMA_BIAS, "qwen3_moe": QWEN3_MOE,
           "qwen3_moe_tied": QWEN3_MOE_TIED, "deepseek_v3": DEEPSEEK_V3}
# Weights to refit: the checkpoint's plus noise of this scale.
SCALE = {"qwen3_tied": 0.05, "llama_bias": 0.05, "qwen3_moe": 0.05, "qwen3_moe_tied": 0.05,
         "deepseek_v3": 0.3}
# DeepSeek-V3 on vLLM's CPU build does not generate as transformers does, whoever loads the
# weights (a new engine started from the checkpoint does not match transformers' tokens at these
# weights): its reference is a new vLLM engine started from the same weights, which the refit
# engine must equal exactly (token ids and logprobs).
FRESH_ENGINE_REFERENCE = {"deepseek_v3"}


def expected(live, sd):
    if live["name"] in FRESH_ENGINE_REFERENCE:
        return fresh_engine_reference(live["path"], sd, tp=live["tp"]), 0.0
    return reference(live["path"], sd), 2e-3


def case_id(case) -> str:
    return f"{case[0]}-tp{case[1]}"


class OneEngine:
    """The live engine of the last case asked for: asking for another case stops it and starts
    that case's. Tests run grouped by case (`order_key`), so each engine starts once and the
    machine holds one at a time."""

    def __init__(self, tmp_path_factory):
        self.tmp, self.case, self.live = tmp_path_factory, None, None

    def get(self, case) -> dict:
        from ray_reshard.engines.vllm.launch import start_engine, write_model

        if case != self.case:
            self.stop()
            name, tp, train = case
            path = str(self.tmp.mktemp(case_id(case)))
            write_model(CONFIGS[name], path, seed=0)
            base = checkpoint_state(path)
            self.live = {"name": name, "cfg": CONFIGS[name], "tp": tp, "train": train,
                         "infer": VLLM(tp=tp), "path": path, "base": base,
                         "engine": start_engine(path, tp=tp), "scale": SCALE[name]}
            self.case = case
        return self.live

    def stop(self):
        if self.live is not None:
            ray.kill(self.live["engine"])
        self.case = self.live = None


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
    require_vllm()
    one = OneEngine(tmp_path_factory)
    yield one
    one.stop()


@pytest.fixture
def live(request, engines):
    """The engine (and its model) of the case this test is parametrized with."""
    return engines.get(request.param)


def order_key(item):
    """Grouped by engine case; on each engine, the test that needs it fresh (it compares the
    first generation with the checkpoint's) runs first."""
    case = item.callspec.params["live"]
    fresh = item.originalname == "test_refit_then_generate_equals_transformers"
    return CASES.index(case), not fresh


def trainers_for(live, sd):
    train, cfg = live["train"], live["cfg"]
    return [ShardTrainer.remote(r, local_state(cfg, train, "src", r, sd, dtype=torch.float32,
                                               hf_experts="split"))
            for r in range(train.world)]


def init_all(trainers, live, infer=None, dtype=torch.float32, key="default"):
    infer = infer or live["infer"]
    return ray.get([t.init.remote(trainers, [live["engine"]], live["cfg"], live["train"], infer,
                                  dtype, key) for t in trainers])[0]


@pytest.mark.parametrize("live", CASES, indirect=True,
                         ids=lambda c: f"{case_id(c)}-{c[2]}")
def test_refit_then_generate_equals_transformers(live):
    from ray_reshard.engines.vllm.launch import generate

    engine = live["engine"]
    before = generate(engine, PROMPTS, MAX_TOKENS)
    if live["name"] not in FRESH_ENGINE_REFERENCE:
        assert_same_generation(before, reference(live["path"], live["base"]))

    new = perturbed(live["base"], seed=1, scale=live["scale"])
    trainers = trainers_for(live, new)
    report = init_all(trainers, live)
    results = ray.get([t.send.remote() for t in trainers])
    assert results[0]["version"] == 1 and results[1:] == [None] * (len(trainers) - 1)
    got = generate(engine, PROMPTS, MAX_TOKENS)
    assert_same_generation(got, *expected(live, new))
    assert [g["token_ids"] for g in got] != [b["token_ids"] for b in before]

    # a second refit with changed weights: the engine follows them
    newer = perturbed(live["base"], seed=2, scale=live["scale"])
    for r, t in enumerate(trainers):
        ray.get(t.load.remote(local_state(live["cfg"], live["train"], "src", r, newer,
                                          dtype=torch.float32, hf_experts="split")))
    assert ray.get([t.send.remote() for t in trainers])[0]["version"] == 2
    assert_same_generation(generate(engine, PROMPTS, MAX_TOKENS), *expected(live, newer))
    ray.get([t.close.remote() for t in trainers])

    # every decision as the CPU build requires: norms, the embedding lookup, MLA's kv_b_proj
    # (its GEMM reads the parameter) and MLA's derived W_UK_T / W_UV read their parameters (in
    # place), and so does a tied LM head (its packed copy rebuilt from the embedding); other
    # linear weights and their biases are released and repacked, an untied LM head's logits
    # read a packed copy, MoE experts are prepacked, the router's bias is reloaded with its
    # released weight (all through load_weights)
    tied = live["cfg"].get("tie_word_embeddings")
    for row in report:
        name, why = row["name"], row["why"] or ""
        if name.endswith(("norm.weight", "kv_b_proj.weight", ".W_UK_T", ".W_UV")) or \
                name == "model.embed_tokens.weight" or (tied and name == "lm_head.weight"):
            assert row["route"] == "in place", row
            if tied and name in ("lm_head.weight", "model.embed_tokens.weight"):
                assert row["tied"] in ("lm_head.weight", "model.embed_tokens.weight"), row
            continue
        assert row["route"] == "fallback", row
        if name.endswith("_proj.bias"):
            assert "reloaded as a whole" in why, row
        elif name == "lm_head.weight":
            assert "packed copy" in why, row
        elif ".experts." in name:
            assert "rearranges expert weights" in why, row
        elif name.endswith("gate.e_score_correction_bias"):
            assert "reloaded as a whole" in why, row
        else:
            assert ("_proj." in name or name.endswith("mlp.gate.weight")) and \
                row["shape"] == (0,) and "released" in why, row
    assert {r["rank"] for r in report} == set(range(live["tp"]))


# refusals are checked before any byte moves, the same for every model: one TP1 and one TP2
# engine stand for all
@pytest.mark.parametrize("live", [CASES[0], CASES[4]], indirect=True,
                         ids=["qwen3_tied-tp1", "qwen3_moe-tp2"])
def test_refused_refit_leaves_the_engine_serving_as_before(live):
    from ray_reshard.engines.vllm.launch import generate

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


@pytest.mark.parametrize("live, world", [(CASES[1], 3), (CASES[3], 2)],
                         indirect=["live"], ids=["qwen3_tied-tp2-fsdp3", "qwen3_moe_tied-tp1"])
def test_fsdp2_trainers_refit_a_live_engine(live, world):
    """torch FSDP2 trainers (gloo, Hugging Face names: transformers' fused experts for MoE) take
    an optimizer step and refit the engine from their shards (on 3 ranks: uneven shards); it
    then generates as transformers does on their full_tensor()."""
    import socket

    from ray_reshard.engines.vllm.launch import generate

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainers = [FSDPTrainer.remote(r, world, f"tcp://127.0.0.1:{port}", live["path"])
                for r in range(world)]
    losses = ray.get([t.step.remote(1) for t in trainers])
    assert all(loss > 0 for loss in losses)
    full = ray.get([t.full_state.remote() for t in trainers])[0]
    assert not torch.equal(full["model.norm.weight"], live["base"]["model.norm.weight"])
    ray.get([t.init.remote(trainers, [live["engine"]], live["cfg"], FSDP(shard=world),
                           live["infer"], torch.float32, "fsdp") for t in trainers])
    moved = ray.get([t.send.remote() for t in trainers])[0]
    assert sum(moved[f"{p}_bytes"] for p in ("network", "domain", "local")) > 0, moved
    assert_same_generation(generate(live["engine"], PROMPTS, MAX_TOKENS),
                           reference(live["path"], full))
    ray.get([t.close.remote() for t in trainers])


@pytest.mark.parametrize("live", [CASES[0]], indirect=True, ids=["qwen3_tied-tp1"])
@pytest.mark.parametrize("delta", [64, -64], ids=["larger", "smaller"])
def test_a_trainer_of_another_config_is_refused(live, delta):
    """Trainers built for another intermediate_size are refused before any byte moves, naming
    the field; the engine generates exactly as before."""
    from ray_reshard.engines.vllm.launch import generate

    engine = live["engine"]
    before = generate(engine, PROMPTS, MAX_TOKENS)
    cfg = dict(live["cfg"], intermediate_size=live["cfg"]["intermediate_size"] + delta)
    sd = random_state(cfg, seed=5)
    train = live["train"]
    trainers = [ShardTrainer.remote(r, local_state(cfg, train, "src", r, sd, dtype=torch.float32,
                                                   hf_experts="split"))
                for r in range(train.world)]
    want = f"intermediate_size: {cfg['intermediate_size']} vs {live['cfg']['intermediate_size']}"
    with pytest.raises(Exception, match=f"(?s)refused before moving any byte.*worker 0 serves "
                                        f"another model config.*{want}"):
        ray.get([t.init.remote(trainers, [engine], cfg, train, live["infer"], torch.float32,
                               f"foreign{delta}") for t in trainers])
    assert generate(engine, PROMPTS, MAX_TOKENS) == before
    for t in trainers:
        ray.kill(t)


@pytest.mark.parametrize("live", [CASES[0]], indirect=True, ids=["qwen3_tied-tp1"])
def test_failures_after_the_update_started_leave_an_engine_a_new_transfer_refits(live):
    """A round that fails after start_weight_update (a trainer rank whose shards cannot be
    read; a trainer rank that died) raises on the sender, the engine still generates as before,
    and a new transfer refits it exactly."""
    from ray_reshard.engines.vllm.launch import generate

    engine = live["engine"]
    before = generate(engine, PROMPTS, MAX_TOKENS)
    new = perturbed(live["base"], seed=7)
    for fault in ("unreadable", "dead"):
        trainers = trainers_for(live, new)
        init_all(trainers, live, key=f"fault-{fault}")
        if fault == "unreadable":
            ray.get(trainers[1].break_tensors.remote())
            match = "(?s)src rank 1.*TypeError"
        else:
            ray.kill(trainers[1])
            match = "src rank 1"
        with pytest.raises(Exception, match=match):
            ray.get(trainers[0].send.remote())
        assert generate(engine, PROMPTS, MAX_TOKENS) == before, fault
        ray.get(trainers[0].close.remote())
        for t in trainers:
            ray.kill(t)
    trainers = trainers_for(live, new)
    init_all(trainers, live, key="after-faults")
    assert ray.get([t.send.remote() for t in trainers])[0]["version"] >= 1
    assert_same_generation(generate(engine, PROMPTS, MAX_TOKENS), *expected(live, new))
    ray.get([t.close.remote() for t in trainers])


@pytest.mark.parametrize("live", [CASES[0]], indirect=True, ids=["qwen3_tied-tp1"])
def test_two_transfers_open_on_one_engine_keep_their_own_staging(live):
    """Two trainer connections open on one engine (keys a and b): each round loads its own
    staging tensors, so the engine serves whichever sent last, exactly."""
    from ray_reshard.engines.vllm.launch import generate

    engine = live["engine"]
    wa, wb = perturbed(live["base"], seed=11), perturbed(live["base"], seed=12)
    a, b = trainers_for(live, wa), trainers_for(live, wb)
    init_all(a, live, key="a")
    init_all(b, live, key="b")
    for trainers, weights in ((b, wb), (a, wa)):
        ray.get([t.send.remote() for t in trainers])
        assert_same_generation(generate(engine, PROMPTS, MAX_TOKENS), *expected(live, weights))
    ray.get([t.close.remote() for t in a + b])
