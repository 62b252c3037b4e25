"""Ray Train's TorchTrainer refits a live vLLM engine (vLLM's CPU build) every step.

Real: Ray Train V2 (its controller, worker actors, torch.distributed over gloo, FailureConfig,
checkpoints), an FSDP2 and a DDP model (transformers' Qwen3, tiny, made from a config), one vLLM
engine in a Ray actor shared by the module, the vLLM backend and `WeightSync` between them, and
a thread that keeps asking the engine for greedy completions while the trainers run. Every
completion must equal transformers' greedy generation on the weights of the version it is
labelled with (the checkpoint of that step): the engine never serves a mix of versions.
"""
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from live import MAX_TOKENS, PROMPTS, QWEN3, checkpoint_state, reference, require_vllm
from ray_train_job import Busy, Driver, Generations, checkpoints, train_loop

pytestmark = [pytest.mark.vllm_live, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
KEY = "gate-test"


@pytest.fixture(scope="module")
def live(cluster, tmp_path_factory):
    require_vllm()
    import ray_reshard as rr
    from ray_reshard.engines.vllm.launch import start_engine, write_model

    path = str(tmp_path_factory.mktemp("qwen3"))
    write_model(QWEN3, path, seed=0)
    base = checkpoint_state(path)
    engine = start_engine(path, tp=1, options=rr.on_node(0))    # trainers on node 1
    # the weights behind each version label the engine may serve (None: as started)
    yield {"path": path, "base": base, "engine": engine, "weights": {None: base}}
    ray.kill(engine)


def tokens(live, weights):
    return [r["token_ids"] for r in reference(live["path"], weights)]


# ------------------------------------------------------------------------ the engine's gate
def test_generation_waits_for_an_update_session_and_carries_its_version(live):
    from ray_reshard.engines.vllm.serving import GatedClient, generate, status

    engine, driver = live["engine"], Driver.remote()
    client = GatedClient([engine], owner=driver, participants=[driver], lease_s=60)
    client.init_weight_transfer_engine({"key": KEY})     # a transfer that moves no byte
    client.label = 101
    client.start_weight_update()
    assert status(engine)["state"] == "updating" and status(engine)["updating_to"] == 101
    got = []
    waiting = threading.Thread(target=lambda: got.append(generate(engine, PROMPTS, MAX_TOKENS)))
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive() and not got          # no generation inside the session
    client.update_weights({"version": 1, "key": KEY})
    client.finish_weight_update()
    waiting.join(timeout=60)
    out = got[0]
    assert {o["version"] for o in out} == {101}
    assert {tuple(o["weight_versions"]) for o in out} == {(("101", 0, MAX_TOKENS),)}
    assert [o["token_ids"] for o in out] == tokens(live, live["base"])
    assert status(engine) == {"state": "serving", "version": 101, "held_why": None,
                              "updating_to": None, "last_failure": None, "refits": 1}
    live["weights"][101] = live["base"]
    ray.kill(driver)


def test_a_session_whose_driver_died_or_overran_is_closed_by_the_engine(live):
    from ray_reshard.engines.vllm.serving import GatedClient, generate, status

    engine, driver = live["engine"], Driver.remote()
    ray.get(driver.ping.remote())
    client = GatedClient([engine], owner=driver, participants=[driver], lease_s=60)
    client.label = 102
    client.start_weight_update()
    ray.kill(driver)
    out = generate(engine, PROMPTS, MAX_TOKENS, timeout_s=30)
    assert {o["version"] for o in out} == {101}     # atomic: the previous version, whole
    st = status(engine)
    assert st["state"] == "serving" and st["version"] == 101
    assert "refit v102 did not complete: its driver (trainer rank 0) is gone; trainer rank 0 " \
           "is gone" in st["last_failure"], st

    alive = Driver.remote()
    client = GatedClient([engine], owner=alive, participants=[alive], lease_s=1.0)
    client.label = 103
    client.start_weight_update()
    t0 = time.monotonic()
    out = generate(engine, PROMPTS, MAX_TOKENS, timeout_s=30)
    assert {o["version"] for o in out} == {101} and time.monotonic() - t0 >= 0.5
    assert "did not finish it within its lease" in status(engine)["last_failure"]
    with pytest.raises(Exception, match="closed this update session already"):
        client.update_weights({"version": 2, "key": KEY})          # the late driver learns it
    ray.kill(alive)


def test_a_failed_refit_that_was_not_atomic_holds_the_engine_until_one_completes(live):
    from ray_reshard import RefitError
    from ray_reshard.engines.vllm.serving import GatedClient, generate, status

    engine, driver = live["engine"], Driver.remote()
    client = GatedClient([engine], owner=driver, participants=[driver], lease_s=60,
                         atomic=False)
    client.label = 104
    client.start_weight_update()
    try:
        raise RefitError("refit failed in run on src rank 1: process 1 died", [("src", 1)])
    except RefitError:
        client.finish_weight_update()       # as the backend closes a failed session
    st = status(engine)
    assert st["state"] == "held" and "src rank 1" in st["held_why"], st
    with pytest.raises(TimeoutError, match="it is held .*refit v104 failed part-way"):
        generate(engine, PROMPTS, MAX_TOKENS, timeout_s=5.0)
    client.label = 105
    client.start_weight_update()
    client.update_weights({"version": 2, "key": KEY})
    client.finish_weight_update()
    assert {o["version"] for o in generate(engine, PROMPTS, MAX_TOKENS)} == {105}
    live["weights"][105] = live["base"]
    ray.kill(driver)


def test_an_actor_that_takes_no_calls_while_it_waits_is_refused(cluster):
    """What Ray Train V1's workers are: their main thread runs Ray Train's result loop for as
    long as the training function runs."""
    busy = Busy.remote()
    msg = ray.get(busy.check.remote())
    assert msg is not None and "Ray Train V1" in msg and "Ray Train V2" in msg, msg
    ray.kill(busy)


# --------------------------------------------------------------------------- Ray Train runs
def fit(live, tmp_path, name, **config):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.exceptions import TrainingFailedError

    from ray_reshard.engines.vllm.serving import status

    max_failures = config.pop("max_failures", 0)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"path": live["path"], "engines": [live["engine"]],
                           "vocab_size": QWEN3["vocab_size"], "lr": 2.0, **config},
        # the workers mostly wait: a sliver of a CPU each, on node 1 (the engine is on node 0,
        # so the refit crosses the network, where delta refits apply)
        scaling_config=ScalingConfig(num_workers=2,
                                     resources_per_worker={"CPU": 0.01, "node1": 0.01}),
        run_config=RunConfig(storage_path=str(tmp_path), name=name,
                             failure_config=FailureConfig(max_failures=max_failures)))
    before = status(live["engine"])["version"]
    t0 = time.monotonic()
    with Generations(live["engine"]) as gen:
        try:
            result, error = trainer.fit(), None
        except TrainingFailedError as e:
            result, error = None, e
        time.sleep(0.5)
    return result, error, gen, before, time.monotonic() - t0


def check_served(live, gen, before, weights):
    """Every completion the thread got equals transformers' greedy generation on the weights of
    its version: `before`'s (what the engine served when the run began) up to the run's first
    refit, then `weights[v]`; the run's versions only move forward. Returns them in order."""
    assert not gen.errors, gen.errors
    seen = list(gen.seen)
    head = 0
    while head < len(seen) and seen[head][0] == before:
        head += 1
    order = [v for v, _ in seen[head:]]
    assert order == sorted(order), order
    refs = {("before", before): tokens(live, live["weights"][before])} if head else {}
    for i, (v, got) in enumerate(seen):
        key = ("before", v) if i < head else v
        if key not in refs:
            refs[key] = tokens(live, weights[v])
        assert got == refs[key], (v, got, refs[key])
    return order


def test_fsdp2_trainer_refits_every_step_and_recovers_a_killed_worker(live, tmp_path):
    """FSDP2 on 2 workers, 4 steps, a delta refit after each (the first of each attempt goes
    dense and keeps the baseline); rank 1's process dies while the refit of step 2 reads its shards. Ray Train
    restarts the group from the latest checkpoint; WeightSync connects anew, and the engine,
    which kept serving step 1's weights whole, follows again."""
    from ray_reshard.engines.vllm.serving import status

    result, error, gen, before, seconds = fit(
        live, tmp_path, "fsdp2", parallel="fsdp2", steps=4, delta=True, max_failures=1,
        fault={"rank": 1, "step": 2},
        group={"bucket_bytes": 1 << 16})    # the embedding's rows fill buckets of their own
    assert error is None, error
    out = result.return_value
    assert out["train"] == "FSDP(shard=2, replicate=1, hf_experts='auto')"
    # the restarted attempt began from the latest checkpoint Ray Train had registered from
    # every worker when rank 1 died: step 1, or step 2 when a poll came in between
    assert out["start"] in (1, 2), out
    refits = out["refits"]
    print(f"fsdp2 run: {seconds:.1f} s, refits {refits}")
    assert [r["step"] for r in refits] == list(range(out["start"], 5))
    # delta refits: the first of an attempt sends dense and keeps a baseline; later ones send
    # what changed where a bucket holds parameters the engine reads in place (the embedding's
    # rows: the vLLM backend sends those as deltas, load_weights pieces whole)
    first, last = refits[0]["delta"], refits[-1]["delta"]
    assert any("no baseline yet" in f for f in first["fallbacks"]), refits
    assert not last["fallbacks"] and not last["mismatches"], refits
    assert last["encodings"]["mask"] + last["encodings"]["index"] > 0, refits
    assert last["network_bytes"] < last["dense_network_bytes"], refits
    weights = {0: live["base"], **checkpoints(result)}
    order = check_served(live, gen, before, weights)
    # generation went on while they trained, and ended on the last step's weights
    assert len(set(order)) >= 3 and order[-1] == 4, order
    st = status(live["engine"])
    assert st["state"] == "serving" and st["version"] == 4
    assert "rank 1" in st["last_failure"], st       # the refit of step 2, first attempt
    live["weights"][4] = weights[4]
    print(f"fsdp2 run: {len(gen.seen)} generations, versions {sorted(set(order))}")


def test_a_worker_that_never_comes_back_ends_the_run_and_the_engine_keeps_a_whole_version(
        live, tmp_path):
    """DDP on 2 workers; rank 1's process dies while the refit of step 2 reads its shards and
    Ray Train may not restart it (max_failures=0): the run ends, the refit's failure names
    rank 1, and the engine serves step 1's weights, whole."""
    from ray_reshard.engines.vllm.serving import generate, status

    result, error, gen, before, seconds = fit(
        live, tmp_path, "ddp", parallel="ddp", steps=3, fault={"rank": 1, "step": 2})
    assert result is None and error is not None
    assert 1 in error.worker_failures, error
    st = status(live["engine"])
    assert st["state"] == "serving" and st["version"] == 1, st
    assert "v2" in st["last_failure"] and "rank 1" in st["last_failure"], st
    from safetensors.torch import load_file

    weights = {0: live["base"]}
    for d in tmp_path.glob("ddp/checkpoint_*/"):       # the run failed: read them from storage
        weights[int((d / "step").read_text())] = load_file(str(d / "model.safetensors"))
    order = check_served(live, gen, before, weights)
    assert order[-1] == 1, order
    after = generate(live["engine"], PROMPTS, MAX_TOKENS)
    assert {o["version"] for o in after} == {1}
    assert [o["token_ids"] for o in after] == tokens(live, weights[1])
    print(f"ddp run: {seconds:.1f} s, {len(gen.seen)} generations")


@pytest.mark.slow
def test_the_documented_program_runs_as_written(cluster, tmp_path):
    """docs/ray-train.md's program, as written, on the session's cluster."""
    require_vllm()
    text = (ROOT / "docs" / "ray-train.md").read_text()
    blocks = re.findall(r"```python\n(# train_and_serve\.py.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/ray-train.md lost its train_and_serve.py program"
    path = tmp_path / "train_and_serve.py"
    path.write_text(blocks[0])
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, RAY_ADDRESS=cluster.address), timeout=800)
    assert p.returncode == 0 and re.search(r"^version 3 tokens \[(\d+, ){7}\d+\]$", p.stdout,
                                           re.M), (p.stdout[-3000:], p.stderr[-3000:])
    print(f"documented program: {time.monotonic() - t0:.1f} s")
