"""How a vLLM worker's forward pass reads each parameter (`route`, `describe_model`): in place,
or through `load_weights`; and what to re-run after bytes were written in place (tied heads'
packed copies, MLA's derived tensors, MoE experts' processing). Imports no vLLM module at load."""
from __future__ import annotations

from typing import Optional

import torch

IN_PLACE_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")
PACKED_COPY = "its GEMM reads a packed copy (CPU prepack), not this parameter"


def writable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a plain alias of its memory when it is an inference tensor (which cannot be
    written in place outside inference mode)."""
    if not t.is_inference():
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def quant_method_reason(module: torch.nn.Module) -> Optional[str]:
    """None when `module`'s quant method keeps its parameters in checkpoint layout after
    loading; otherwise why not."""
    qm = getattr(module, "quant_method", None)
    if qm is None:
        return None
    name = type(qm).__name__
    if name in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return None
    if name == "UnquantizedFusedMoEMethod":
        backend = getattr(getattr(qm, "unquantized_backend", None), "name", None)
        if backend in IN_PLACE_MOE_BACKENDS:
            return None
        return f"MoE backend {backend} rearranges expert weights after loading"
    return f"{name} processes weights after loading"


def gemm_reads_weight(module: torch.nn.Module) -> Optional[bool]:
    """Whether the module's CPU GEMM (vLLM's ``cpu_linear``) computes with the weight it is
    handed: probed with two 1-row weights (a packed kernel ignores them and answers for its
    own copy). None when the module has no CPU GEMM."""
    gemm = getattr(module, "cpu_linear", None)
    w = getattr(module, "weight", None)
    if gemm is None or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    x = torch.ones(1, w.shape[1], dtype=w.dtype, device=w.device)
    with torch.no_grad():
        a = gemm(x, torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device), None)
        b = gemm(x, torch.ones(1, w.shape[1], dtype=w.dtype, device=w.device), None)
    return not (a.shape == b.shape and torch.equal(a, b))


def route(module: torch.nn.Module, param: torch.Tensor, *, quantized: bool,
          lm_head: bool) -> Optional[str]:
    """None when a write into `param` is what `module`'s forward pass reads (in place);
    otherwise why the parameter must go through vLLM's load_weights (fallback)."""
    if quantized:
        return "quantized model: its kernels keep processed weights"
    if param.numel() == 0:
        return (f"released after loading (shape {tuple(param.shape)}): the platform keeps a "
                f"repacked copy")
    embedding = type(getattr(module, "quant_method", None)).__name__ == \
        "UnquantizedEmbeddingMethod"
    if lm_head or not embedding:        # an embedding's lookup reads the parameter itself
        try:
            reads = gemm_reads_weight(module)
        except Exception as e:      # noqa: BLE001  (any failure: do not trust the parameter)
            return f"could not tell what its GEMM reads ({type(e).__name__}: {e})"
        if reads is False:
            return PACKED_COPY
    return quant_method_reason(module)


def describe_model(model: torch.nn.Module, quantized: bool) -> tuple[dict, dict, set, list]:
    """How the forward pass reads each parameter of `model` (see `route`).

    Returns (description, in-place tensors, modules reloaded as a whole, modules to repack).
    The description maps each parameter name to {shape, dtype, why, tied}: `why` None means the
    parameter is written in place, else why it goes through load_weights; `tied` names another
    parameter sharing its tensor (tied embeddings). A module whose GEMM reads a packed copy of
    a tensor shared with a parameter written in place (a tied LM head on vLLM's CPU build) is
    repacked from it after each refit; a tied parameter that must go through load_weights takes
    its aliases with it."""
    lm_head = getattr(model, "lm_head", None)
    rows = []            # (module name, module, parameter name, tensor, why)
    for mod_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        is_head = module is lm_head or type(module).__name__ == "ParallelLMHead"
        for pname, p in params:
            why = route(module, p, quantized=quantized, lm_head=is_head)
            rows.append((mod_name, module, f"{mod_name}.{pname}" if mod_name else pname, p, why))
    names_of: dict = {}
    for _, _, name, p, _ in rows:
        names_of.setdefault(id(p), []).append(name)
    groups = [names for names in names_of.values() if len(names) > 1]
    whys = {name: why for _, _, name, _, why in rows}
    owner = {name: (mod_name, module) for mod_name, module, name, _, _ in rows}
    repack = set()
    for names in groups:        # read in place by one alias, through a packed copy by others
        if any(whys[n] is None for n in names):
            for n in names:
                if whys[n] == PACKED_COPY and quant_method_reason(owner[n][1]) is None:
                    whys[n] = None
                    repack.add(owner[n][0])
    members: dict = {}
    for mod_name, _, name, _, _ in rows:
        members.setdefault(mod_name, []).append(name)
    changed = True
    while changed:          # a reload takes whole modules, and a tied tensor's every alias
        changed = False
        for mod_name, names in members.items():
            bad = next((n for n in names if whys[n] is not None), None)
            for n in names:
                if bad is not None and whys[n] is None:
                    whys[n] = (f"its module is reloaded as a whole "
                               f"({bad.rsplit('.', 1)[-1]}: {whys[bad]})")
                    changed = True
        for names in groups:
            bad = next((n for n in names if whys[n] is not None), None)
            for n in names:
                if bad is not None and whys[n] is None:
                    whys[n] = f"tied to {bad}, which goes through load_weights"
                    changed = True
    out, exposed, fallback = {}, {}, set()
    for mod_name, module, name, p, _ in rows:
        why = whys[name]
        tied = next((n for n in names_of[id(p)] if n != name), None)
        out[name] = {"shape": tuple(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                     "why": why, "tied": tied}
        if why is None:
            exposed[name] = writable(p.data)
        else:
            fallback.add(mod_name)
    return out, exposed, fallback, sorted(m for m in repack if m not in fallback)


def repack_modules(model: torch.nn.Module, names: list) -> list[str]:
    """Rebuild the packed copies of `names` (modules whose GEMM reads a copy of a tensor written
    in place) through their quant method's own post-load step. Returns the modules it ran on."""
    modules = dict(model.named_modules())
    done = []
    for name in names:
        module = modules[name]
        module.quant_method.process_weights_after_loading(module)
        done.append(name)
    return done


def track_expert_processing(model: torch.nn.Module, modules: set) -> dict:
    """Before a reload: watch whether the MoE experts of `modules` re-run their own weight
    processing. vLLM 0.32 skips it on weight updates once the MoE kernel exists
    (``UnquantizedFusedMoEMethod._setup_kernel``), so its CPU experts would compute with
    checkpoint-layout bytes as if they were prepacked. Returns module name -> [experts, calls]."""
    calls = {}
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if name not in modules or experts is None or \
                "process_weights_after_loading" not in type(experts).__dict__:
            continue
        record = [experts, 0]
        original = type(experts).process_weights_after_loading

        def watched(layer, _record=record, _original=original):
            _record[1] += 1
            return _original(_record[0], layer)
        experts.process_weights_after_loading = watched
        calls[name] = record
    return calls


def finish_expert_processing(model: torch.nn.Module, calls: dict) -> list[str]:
    """After a reload: run the experts' weight processing where the reload skipped it (see
    `track_expert_processing`); stop watching. Returns the modules it ran on."""
    done = []
    modules = dict(model.named_modules())
    for name, (experts, n) in calls.items():
        del experts.process_weights_after_loading
        if n == 0:
            experts.process_weights_after_loading(modules[name])
            done.append(name)
    return done


def rederive(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Re-run what vLLM derives from weights after loading for deferred attention layers
    (MLA: W_UK_T / W_UV from kv_b_proj). Returns the modules it ran on."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:     # vLLM's attention layers need its full install (GPU build)
        def is_deferred_attention_layer(m):
            return hasattr(m, "kv_b_proj") and callable(getattr(m, "process_weights_after_loading", None))
    done = []
    for name, module in model.named_modules():
        if module is not model and is_deferred_attention_layer(module):
            module.process_weights_after_loading(dtype)
            done.append(name)
    return done


