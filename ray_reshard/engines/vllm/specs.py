"""The specs of a refit into live vLLM workers (`plan_specs`): the recipe's, with every piece a
worker does not write in place sent whole to a staging tensor for `load_weights`; refused
before any byte moves when a worker serves another layout, quantization or model config."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...layout import Layout, Mesh, Replicate, Slot, TensorSpec
from ...models import Recipe, config_differences, hf_parameter_shapes

FULL = "full:"            # storage name prefix of fallback staging tensors (whole HF tensors)


def plan_specs(config: Any, train, infer, described: list[dict], dtype=torch.bfloat16,
               train_dtype: Optional[torch.dtype] = None,
               quantization: Optional[list[dict]] = None,
               parallel: Optional[list[dict]] = None,
               engine_configs: Optional[list] = None) -> tuple[dict, list[dict]]:
    """Specs of a refit into live vLLM workers, and each worker's staging tensors.

    `described[r]` is worker r's `describe()` (name -> {shape, dtype, why}), `quantization[r]`
    its `quantization()`, `parallel[r]` its engine's parallel sizes, `engine_configs[r]` the HF
    config it serves (compared with `config`: any difference in a parameter's shape or meaning
    is refused, see `config_differences`). Pieces whose storage a
    worker does not write in place go whole (HF tensor, replicated to every rank holding the
    piece) to ``full:<hf name>`` staging tensors; block-FP8 pieces go as the checkpoint holds
    them, FP8 weights quantised by the senders plus ``<hf name>_scale_inv``. Raises, naming the
    rank and the parameter, when the engine runs another layout than `infer`, or a worker lacks
    a parameter the recipe expects, or holds an in-place one with another shape or dtype, or
    serves another quantization than `infer` describes, or another model config than `config`."""
    if len(described) != infer.world:
        raise ValueError(f"{infer} has {infer.world} ranks but the engines have "
                         f"{len(described)} workers")
    for r, p in enumerate(parallel or ()):
        if (p["tp"], p["pp"]) != (infer.tp, infer.pp):
            raise ValueError(f"vLLM worker {r} runs tensor_parallel_size={p['tp']}, "
                             f"pipeline_parallel_size={p['pp']}, but {infer} has tp={infer.tp}, "
                             f"pp={infer.pp}")
    for r, q in enumerate(quantization or ()):
        _check_quantization(r, q, infer)
    _check_configs(config, engine_configs)
    # HF expert naming of the trainers' storages where they name them (FSDP: transformers'
    # modules), else the checkpoints' split experts; fallback pieces keep that naming
    hf_experts = getattr(train, "hf_experts", None) or "split"
    recipe = Recipe(config, train, infer, hf_experts=hf_experts)
    specs = recipe.specs(dtype, train_dtype)
    dt_name = str(dtype).replace("torch.", "")
    fallback: list[set] = []
    problems = []
    for r, desc in enumerate(described):
        bad = set()
        for name, decl in recipe.dst.storages(r).items():
            shape = decl.shape
            got = desc.get(name)
            if got is None:
                problems.append(f"vLLM worker {r}: no parameter {name!r} (expected shape "
                                f"{tuple(shape)}); is it {infer}?")
            elif got["why"] is not None:
                bad.add(name)
            elif tuple(got["shape"]) != tuple(shape):
                problems.append(f"vLLM worker {r}: {name!r} has shape {tuple(got['shape'])}, "
                                f"the recipe for {infer} expects {tuple(shape)}")
            elif got["dtype"] != dt_name and "e_score_correction_bias" not in name:
                problems.append(f"vLLM worker {r}: {name!r} is {got['dtype']}, refit dtype is "
                                f"{dt_name}")
        fallback.append(bad)
    if problems:
        raise ValueError("refit refused before moving any byte:\n  " + "\n  ".join(problems))
    staging: list[dict] = [{} for _ in described]
    hf_shapes = hf_parameter_shapes(config, hf_experts=hf_experts, mtp=True)
    for pc in recipe.pieces:
        spec = specs[pc.name]
        if not any(slot.storage in fallback[r] for r, slot in spec.dst_slots):
            continue
        ranks = sorted({r for r, _ in spec.dst_slots})
        hf_name = pc.hf
        slot = Slot(FULL + hf_name, pc.index, pc.dim, pc.offset)
        dst = Layout(Mesh(ranks, ("workers",)), (Replicate(),))
        specs[pc.name] = TensorSpec(spec.shape, spec.dtype, spec.src, dst,
                                    src_dtype=spec.src_dtype, src_slots=spec.src_slots,
                                    dst_slots={r: slot for r in ranks}, quant=spec.quant)
        for r in ranks:
            staging[r][hf_name] = (hf_shapes[pc.hf], str(spec.dtype).replace("torch.", ""))
            if spec.quant is not None:      # the checkpoint's scales beside the weight
                staging[r][spec.quant.scale_storage(hf_name)] = (
                    spec.quant.scale_shape(hf_shapes[pc.hf]), "float32")
    return specs, staging


def written_in_place(spec) -> bool:
    """Whether every destination of `spec` (a `plan_specs` spec) is a parameter written in
    place, not a staging tensor for load_weights."""
    slots = spec.dst_slots
    return slots is None or not any(slot.storage.startswith(FULL) for _, slot in slots)


def _check_configs(config: Any, engine_configs: Optional[list]) -> None:
    """The trainer's model config is the one every worker serves (shapes and meaning)."""
    problems = []
    for r, served in enumerate(engine_configs or ()):
        if served is None:
            problems.append(f"vLLM worker {r} did not report the config it serves "
                            f"(model_config.hf_config)")
            continue
        diffs = config_differences(config, served)
        if diffs:
            problems.append(f"vLLM worker {r} serves another model config than the trainer's "
                            f"(trainer vs engine): " + "; ".join(diffs))
    if problems:
        raise ValueError("refit refused before moving any byte:\n  " + "\n  ".join(problems))


def _check_quantization(rank: int, q: dict, infer) -> None:
    """The worker serves what `infer` describes: a block-FP8 checkpoint iff quantization="fp8"
    with the same block; no other quantization (its loader would take the wrong bytes)."""
    method, block, serialized = q.get("method"), q.get("block"), q.get("serialized")
    want = getattr(infer, "quantization", None)
    fp8_ckpt = method == "fp8" and serialized and block is not None
    if want == "fp8":
        if not fp8_ckpt:
            raise ValueError(
                f"vLLM worker {rank} serves quantization={method!r} (checkpoint FP8: "
                f"{serialized}, weight_block_size={block}), but {infer} asks for a block-FP8 "
                f"checkpoint; refit with the worker's quantization")
        if tuple(block) != tuple(infer.weight_block_size):
            raise ValueError(f"vLLM worker {rank} uses weight_block_size={tuple(block)}, "
                             f"{infer} has {tuple(infer.weight_block_size)}")
        return
    if fp8_ckpt:
        raise ValueError(f"vLLM worker {rank} serves a block-FP8 checkpoint (weight_block_size="
                         f"{tuple(block)}): refit with VLLM(..., quantization='fp8', "
                         f"weight_block_size={tuple(block)}) so the senders deliver FP8 and "
                         f"scales; bf16 weights would be cast without scales")
    if method is not None and serialized:
        raise ValueError(f"vLLM worker {rank} serves a {method!r} checkpoint, which ray_reshard "
                         f"does not produce; only unquantized checkpoints (vLLM may quantize "
                         f"on load) and block FP8 are supported")


def format_report(rows: list[dict]) -> str:
    """A table of `RayReshardTrainerEngine.report()` rows, one line per parameter and rank."""
    lines = [f"{'rank':>4}  {'route':9}  {'shape':18} {'dtype':10} parameter / why"]
    for r in rows:
        why = f"  ({r['why']})" if r["why"] else \
            f"  (tied to {r['tied']})" if r.get("tied") else ""
        route = r["route"] + (", delta" if r.get("delta") else "")
        lines.append(f"{r['rank']:>4}  {route:9}  {str(tuple(r['shape'])):18} "
                     f"{r['dtype']:10} {r['name']}{why}")
    n_in = sum(r["route"] == "in place" for r in rows)
    lines.append(f"{n_in} in place, {len(rows) - n_in} through load_weights")
    return "\n".join(lines)


