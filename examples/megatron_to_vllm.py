"""Megatron -> vLLM refit of a small Hugging Face model, with outputs checked after the refit.

A tiny random Qwen3-MoE model is built from a config with transformers (no download). Four
trainer actors on one node hold it the way Megatron-core does (TP2 x PP2, experts EP2: fused
linear_qkv per query group, linear_fc1 = [gate; up], one tensor per local expert); four
engine actors on another node hold empty vLLM storages (qkv_proj, gate_up_proj, stacked w13/w2
experts, padded vocabulary). `ray_reshard.models` builds the TensorSpecs from the config; one
refit fills the engines. Then each side's storages are reassembled into a Hugging Face model
and the engines' logits must equal the trainers' exactly.

    python examples/megatron_to_vllm.py [--layers 2] [--hidden 64] [--address HOST:PORT]

Needs transformers (`pip install 'transformers>=4.51'`) besides ray-reshard, to build the model
and compute its logits. Without --address it uses the Ray session already started in this
process, or else starts a local two-node cluster on this machine (stopped at the end).
"""
import argparse
import sys

import ray
import torch

import ray_reshard as rr
from ray_reshard import models


def build_model(layers: int, hidden: int):
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    transformers.logging.set_verbosity_error()
    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
                         moe_intermediate_size=hidden // 2, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in model.state_dict().values():      # random norms too, so a misplaced one shows
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return cfg, model


@ray.remote(num_cpus=0)
class Holder:
    """A trainer or an engine: it only exposes its storage tensors."""

    def __init__(self, storages: dict):
        self.storages = storages

    def reshard_tensors(self):
        return self.storages

    def get(self):
        return self.storages


def logits_of(cfg, model_cls, state_dict, tokens):
    model = model_cls(cfg).eval()
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        return model(tokens).logits


def refit_and_compare(layers: int, hidden: int) -> int:
    """Megatron storages on node 0, vLLM storages on node 1; one refit; logits compared."""
    cfg, model = build_model(layers, hidden)
    train = models.Megatron(tp=2, pp=2, ep=2, etp=1)      # world 4: TP2 x PP2, experts EP2
    infer = models.VLLM(tp=2, dp=2, ep=2)                  # two engines of TP2, experts EP across them
    specs = models.refit_specs(cfg, train=train, infer=infer, dtype=torch.float32)
    state = model.state_dict()
    print(f"Qwen3-MoE, {layers} layers: {len(state)} HF parameters as {len(specs)} logical "
          f"tensors; train {train} -> infer {infer}")
    trainers = [Holder.options(**rr.on_node(0)).remote(
        models.local_state(cfg, train, "src", r, state)) for r in range(train.world)]
    engines = [Holder.options(**rr.on_node(1)).remote(
        models.empty_storage(cfg, infer, r, dtype=torch.float32)) for r in range(infer.world)]
    print("trainer rank 0 storages:", sorted(ray.get(trainers[0].get.remote()))[:6], "...")
    print("engine rank 0 storages: ", sorted(ray.get(engines[0].get.remote()))[:6], "...")
    with rr.ReshardGroup(trainers, engines) as group:
        print(group.plan(specs).summary())
        print(group.refit(specs).summary())
    src_sd = models.assemble_state_dict(cfg, train, ray.get([t.get.remote() for t in trainers]))
    dst_sd = models.assemble_state_dict(cfg, infer, ray.get([e.get.remote() for e in engines]))
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    want = logits_of(cfg, type(model), src_sd, tokens)
    got = logits_of(cfg, type(model), dst_sd, tokens)
    if not torch.equal(got, want):
        print(f"FAILED: engine logits differ from the trainer's (max |diff| "
              f"{(got - want).abs().max().item():.3g})")
        return 1
    print(f"ok: the engines' model gives exactly the trainers' logits "
          f"({tuple(got.shape)}, max |logit| {got.abs().max().item():.3f})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--address", help="Ray cluster to join (default: this process's Ray session, "
                                      "or a local two-node cluster)")
    args = ap.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("megatron_to_vllm: error: this example builds its model with transformers: "
              "pip install 'transformers>=4.51'", file=sys.stderr)
        return 2
    try:
        with rr.connect(args.address):
            return refit_and_compare(args.layers, args.hidden)
    except rr.ClusterUnreachable as e:
        print(f"megatron_to_vllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
