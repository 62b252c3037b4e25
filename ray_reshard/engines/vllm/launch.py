"""vLLM engines as Ray actors, as an RL loop runs them: start one (CPU build included), generate
greedily, and gather full weights the way users load them without ray-reshard.

    engine = start_engine(model_dir, tp=2)               # an `LLM` in a Ray actor
    client = RayVLLMWeightSyncClient(engine)             # vLLM's own weight-sync client
    out = generate(engine, [[1, 2, 3]], max_tokens=8)    # [{"token_ids": [...], "logprobs": [...]}]

On vLLM's CPU build: tp > 1 runs vLLM's multiprocessing executor inside the actor (its Ray
executor does not run on CPU), each worker pinned to its own core with
``VLLM_CPU_OMP_THREADS_BIND``; tp == 1 keeps the model in the actor's own process. Functions for
``collective_rpc`` need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set here).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Optional, Sequence

import ray
import torch

__all__ = ["engine_env", "generate", "load_full_weights", "sample", "start_engine",
           "vllm_worker_actors", "write_model"]


def engine_env(tp: int, cores: Optional[Sequence[int]] = None, kv_cache_gib: int = 1) -> dict:
    """Environment of an engine actor on vLLM's CPU build (harmless on GPU builds)."""
    cores = list(cores) if cores is not None else list(range(tp))
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if tp == 1 else "1",
           "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c % (os.cpu_count() or 1)) for c in cores),
           "TOKENIZERS_PARALLELISM": "false"}
    return env


def start_engine(model: str, *, tp: int = 1, dtype: str = "float32", max_model_len: int = 256,
                 seed: int = 0, backend: str = "ray_reshard", options: Optional[dict] = None,
                 llm_class: Optional[type] = None, **llm_kwargs: Any):
    """An `LLM` (or `llm_class`, a subclass) serving `model` (a local HF directory) in a Ray
    actor (num_cpus=0), its weight transfer backend `backend`. Returns the actor handle once
    the engine is up."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    LLM = llm_class or LLM

    env = engine_env(tp)
    kwargs = dict(model=model, tensor_parallel_size=tp, dtype=dtype, max_model_len=max_model_len,
                  seed=seed, enforce_eager=True, skip_tokenizer_init=True, max_num_seqs=8,
                  weight_transfer_config=WeightTransferConfig(backend=backend))
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if dtype not in ("bfloat16", "auto") and _uses_mla(model) and \
            "attention_backend" not in llm_kwargs and "attention_config" not in llm_kwargs:
        # vLLM prefers its AMX MLA kernels on CPUs with AMX tiles, which take bf16 weights
        # only; its reference CPU MLA takes any dtype.
        kwargs["attention_backend"] = "CPU_MLA"
    kwargs.update(llm_kwargs)
    opts = {"num_cpus": 0, "runtime_env": {"env_vars": env}}
    opts.update(options or {})
    engine = ray.remote(LLM).options(**opts).remote(**kwargs)
    ray.get(engine.__ray_call__.remote(_ready))
    return engine


def _uses_mla(model: str) -> bool:
    """Whether the HF config in directory `model` is an MLA model (DeepSeek-style)."""
    import json
    try:
        with open(os.path.join(model, "config.json")) as f:
            return bool(json.load(f).get("kv_lora_rank"))
    except (OSError, ValueError):
        return False


def _ready(llm) -> bool:
    return True


def generate_in_engine(llm, prompts: list, max_tokens: int, temperature: float = 0.0,
                       seed: Optional[int] = None, spans: bool = False) -> list[dict]:
    """Run inside the engine's actor: per prompt the new token ids and each one's logprob
    (`spans`: also vLLM's ``weight_versions`` spans)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0,
                            ignore_eos=True, seed=seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                        use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        row = {"token_ids": list(c.token_ids),
               "logprobs": [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]}
        if spans:
            row["weight_versions"] = [(v.version, v.start, v.end)
                                      for v in getattr(c, "weight_versions", None) or []]
        res.append(row)
    return res


def generate(engine, prompts: Iterable[Sequence[int]], max_tokens: int = 8) -> list[dict]:
    """Greedy generation from token-id prompts: per prompt the new token ids and the logprob
    of each."""
    return ray.get(engine.__ray_call__.remote(generate_in_engine, [list(p) for p in prompts],
                                              max_tokens))


def sample(engine, prompts: Iterable[Sequence[int]], max_tokens: int = 8, seed: int = 0,
           temperature: float = 1.0) -> list[dict]:
    """Sampled generation (reproducible from `seed`), as `generate` returns it."""
    return ray.get(engine.__ray_call__.remote(generate_in_engine, [list(p) for p in prompts],
                                              max_tokens, temperature, seed))


def _load_full(worker, names: list, tensors: list) -> int:
    """vLLM's own reload of full HF tensors inside a worker (layerwise reload around
    ``load_weights``), what users run through ``collective_rpc`` without ray-reshard."""
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)
    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    model.load_weights(zip(names, tensors))
    finalize_layerwise_reload(model, worker.model_config)
    return len(names)


def load_full_weights(engine, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load full HF tensors into every worker of `engine` through ``collective_rpc`` (the
    usual refit on Ray without ray-reshard: a trainer gathers, then the engine reloads)."""
    names = list(state_dict)
    tensors = [state_dict[n] for n in names]
    ray.get(engine.__ray_call__.remote(_rpc, _load_full, names, tensors))


def _rpc(llm, fn, *args):
    return llm.collective_rpc(fn, args=args)


def write_model(config: Mapping[str, Any], path: str, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face model built from `config` (random weights from `seed`), saved to `path`
    as a checkpoint vLLM loads; returns its state dict (HF names, transformers' modules)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**dict(config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype).eval()
    model.save_pretrained(path)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _worker_actor(worker) -> Any:
    return ray.get_runtime_context().current_actor


def vllm_worker_actors(llm, timeout: Optional[float] = 60.0) -> list:
    """Handles of an `LLM`'s Ray worker actors, in vLLM's worker rank order, through
    ``LLM.collective_rpc`` (which runs the function on every worker and returns results by
    rank). Needs ``distributed_executor_backend="ray"``."""
    return list(llm.collective_rpc(_worker_actor, timeout=timeout))
