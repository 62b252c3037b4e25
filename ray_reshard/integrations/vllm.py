"""A ``ray_reshard`` backend for vLLM's pluggable weight transfer
(``vllm.distributed.weight_transfer``, vLLM >= 0.33).

Worker side: `RayReshardWeightTransferEngine` (a ``WeightTransferEngine``), selected with
``WeightTransferConfig(backend="ray_reshard")`` once `register()` ran in the vLLM processes.
Trainer side: `RayReshardTrainerEngine` (a ``TrainerWeightTransferEngine``), built on every
trainer rank by ``WeightTransferTrainerFactory.trainer_init(RayReshardTrainerInitInfo(...),
client=...)``.

Protocol (one round, driven by trainer rank 0, the sender):

1. ``trainer_init``: every rank registers its local tensors (Megatron storages:
   ``tensors()`` or ``source.iter_local()``) in its process under ``key``. The sender calls
   ``client.init_weight_transfer_engine({"key": key})`` (each vLLM worker registers its engine
   under ``key``), asks every worker which of its parameters can be written in place
   (`RayReshardWeightTransferEngine.describe`), builds the specs
   (`ray_reshard.models.refit_specs`) and opens one `ReshardGroup` (trainer actors ->
   vLLM worker actors). Everything is checked before any byte moves: a storage the recipe
   expects but the worker lacks, or with another shape or dtype, is an error naming the rank.
2. ``send_weights``: the sender calls ``client.start_weight_update()``, ``group.refit(specs)``
   (bytes go straight into the live parameters), ``client.update_weights({"version": v})``,
   ``client.finish_weight_update()``, then releases the other ranks, which wait in
   ``send_weights`` meanwhile (their actors must take calls while waiting, as Ray Train's
   workers do: the training function runs in its own thread).

Quantization. A worker serving a block-FP8 checkpoint (vLLM's ``Fp8Config`` with
``weight_block_size``) takes FP8 weights quantised by the senders plus their
``weight_scale_inv`` through the fallback below, as the checkpoint holds them; the trainer side
must then describe it with ``VLLM(..., quantization="fp8", weight_block_size=...)``, and any
mismatch is refused before a byte moves. A model vLLM quantizes on load from an unquantized
checkpoint takes the unquantized weights through the fallback, and vLLM's layerwise reload
quantizes them again. Other quantized checkpoints are refused.

In place vs fallback. A parameter is written in place when the model is not quantized and the
module keeps the parameter in checkpoint layout after loading: modules without a quant method
(norms, nn.Linear), ``UnquantizedLinearMethod``, ``UnquantizedEmbeddingMethod``, and
``UnquantizedFusedMoEMethod`` on the Triton backends. Everything else falls back to
``model.load_weights``: quantized models, MoE backends that rearrange expert weights after
loading (FlashInfer CUTLASS swaps w1/w3, FlashInfer TRT-LLM permutes blocks, AITER shuffles, XPU
transposes, CPU prepacks, MoonEP), MLA's kv_b_proj when the AMX path released it. A fallback
piece is delivered whole (its HF tensor, replicated to every rank holding it) into a staging
tensor on the worker, and loaded inside vLLM's layerwise reload
(``initialize_layerwise_reload`` at start, ``finalize_layerwise_reload`` at finish), as vLLM's
own M2N backend does.

Derived tensors. After an in-place refit ``finish_weight_update`` calls
``process_weights_after_loading(model_config.dtype)`` on every deferred attention layer
(``is_deferred_attention_layer``): MLA recomputes ``W_UK_T`` / ``W_UV`` from ``kv_b_proj``,
copying into the existing tensors (``replace_parameter`` keeps their addresses, so captured CUDA
graphs stay valid). This is the second loop of vLLM's ``process_weights_after_loading``; the
first loop (quant methods) is not re-run on in-place parameters, because it is not idempotent
where it transforms (the fallback covers those), and is a no-op copy where it does not.

Destinations allocated under ``torch.inference_mode()`` are written through plain aliases of
their storage (same memory, outside inference mode).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

import ray
import torch

from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

import ray_reshard as rr

from ..models import Recipe, hf_parameter_shapes, storage_shapes

BACKEND = "ray_reshard"
FULL = "full:"            # storage name prefix of fallback staging tensors (whole HF tensors)
IN_PLACE_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")

# key -> {"engine": worker engine, "tensors": trainer tensors callable, "rounds": {n: Event}}
_REGISTRY: dict[str, dict] = {}
_LOCK = threading.Lock()


def _entry(key: str) -> dict:
    with _LOCK:
        return _REGISTRY.setdefault(key, {"rounds": {}, "errors": {}})


def local_tensors(key: str, actor=None) -> dict:
    """The tensors this process holds for transfer `key` (trainer storages and/or the vLLM
    engine's parameters); the `tensors` callable of the ReshardGroup."""
    ent = _REGISTRY.get(key)
    if ent is None:
        raise RuntimeError(f"no ray_reshard weight transfer {key!r} in this process")
    out: dict = {}
    if "tensors" in ent:
        out.update(ent["tensors"]())
    if "engine" in ent:
        out.update(ent["engine"].tensors())
    return out


def writable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a plain alias of its memory when it is an inference tensor (which cannot be
    written in place outside inference mode)."""
    if not t.is_inference():
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def in_place_reason(module: torch.nn.Module, quantized: bool) -> Optional[str]:
    """None when `module`'s parameters stay in checkpoint layout after loading (written in
    place); otherwise why they go through load_weights."""
    if quantized:
        return "quantized model (kernels keep processed weights)"
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


# ---------------------------------------------------------------------------------- worker side
@dataclass
class RayReshardInitInfo(WeightTransferInitInfo):
    key: str = "default"


@dataclass
class RayReshardUpdateInfo(WeightTransferUpdateInfo):
    version: int = 0


class RayReshardWeightTransferEngine(WeightTransferEngine[RayReshardInitInfo, RayReshardUpdateInfo]):
    """Worker side: exposes the live parameters to the trainer's ReshardGroup, loads fallback
    pieces, re-derives MLA tensors. The bytes themselves arrive outside ``update_weights``
    (the group writes them between start_weight_update and update_weights)."""

    init_info_cls = RayReshardInitInfo
    update_info_cls = RayReshardUpdateInfo
    # the recipes describe the MTP draft (VLLM(model="mtp")), but this engine describes and
    # exposes the model it was initialised with: draft updates are not wired here
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.key: Optional[str] = None
        self.staging: dict[str, torch.Tensor] = {}      # HF name -> whole tensor (fallback)
        self.version = 0
        self.rederived: list[str] = []
        self._layerwise = False

    def _quantized(self) -> bool:
        return getattr(self.model_config, "quantization", None) is not None

    def init_transfer_engine(self, init_info: RayReshardInitInfo) -> None:
        self.key = init_info.key
        _entry(self.key)["engine"] = self

    def quantization(self) -> dict:
        """The served model's quantization: method (None: unquantized), block FP8's
        weight_block_size, whether the checkpoint holds FP8 (else vLLM quantizes on load)."""
        qc = getattr(self.vllm_config, "quant_config", None)
        block = getattr(qc, "weight_block_size", None)
        return {"method": getattr(self.model_config, "quantization", None),
                "block": None if block is None else tuple(int(b) for b in block),
                "serialized": getattr(qc, "is_checkpoint_fp8_serialized", None)}

    def describe(self) -> dict:
        """Every parameter: name -> (shape, dtype name, None or why it is not written in place)."""
        quantized = self._quantized()
        out = {}
        for mod_name, module in self.model.named_modules():
            reason = in_place_reason(module, quantized)
            for pname, p in module.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                r = reason if p.numel() else "empty parameter (released after loading)"
                out[name] = (tuple(p.shape), str(p.dtype).replace("torch.", ""), r)
        return out

    def configure(self, staging: Mapping[str, tuple]) -> None:
        """Allocate the staging tensors of fallback pieces: HF name -> (shape, dtype name)."""
        self.staging = {n: torch.empty(tuple(s), dtype=getattr(torch, dt), device=self.device)
                        for n, (s, dt) in staging.items()}

    def tensors(self) -> dict:
        params = dict(self.model.named_parameters())
        out = {n: writable(p.data) for n, p in params.items()}
        out.update({FULL + n: t for n, t in self.staging.items()})
        return out

    def begin_reload(self) -> None:
        """vLLM's layerwise reload around load_weights of fallback pieces."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def start_weight_update(self) -> None:
        self._layerwise = bool(self.staging)
        if self._layerwise:
            self.begin_reload()

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RayReshardUpdateInfo) -> None:
        self.version = update_info.version
        if self.staging:
            self.model.load_weights(iter(list(self.staging.items())))

    def finish_weight_update(self) -> None:
        if self._layerwise:
            self.end_reload()
            self._layerwise = False
        self.rederived = rederive(self.model, getattr(self.model_config, "dtype", torch.bfloat16))

    def shutdown(self) -> None:
        self.staging = {}
        ent = _REGISTRY.get(self.key or "")
        if ent is not None and ent.get("engine") is self:
            del ent["engine"]


def _describe(actor, key: str) -> dict:
    return _REGISTRY[key]["engine"].describe()


def _quantization(actor, key: str) -> dict:
    return _REGISTRY[key]["engine"].quantization()


def _configure(actor, key: str, staging: dict) -> None:
    _REGISTRY[key]["engine"].configure(staging)


def _release(actor, key: str, round_no: int, error: Optional[str]) -> None:
    ent = _entry(key)
    with _LOCK:
        ev = ent["rounds"].setdefault(round_no, threading.Event())
        ent["errors"][round_no] = error
    ev.set()


# --------------------------------------------------------------------------------- specs
def plan_specs(config: Any, train, infer, described: list[dict], dtype=torch.bfloat16,
               train_dtype: Optional[torch.dtype] = None,
               quantization: Optional[list[dict]] = None) -> tuple[dict, list[dict]]:
    """Specs of a refit into live vLLM workers, and each worker's staging tensors.

    `described[r]` is worker r's `describe()`, `quantization[r]` its `quantization()`. Pieces
    whose storage a worker cannot write in place go whole (HF tensor, replicated to every rank
    holding the piece) to ``full:<hf name>`` staging tensors; block-FP8 pieces go as the
    checkpoint holds them, FP8 weights quantised by the senders plus ``<hf name>_scale_inv``.
    Raises, naming rank and storage, when a worker lacks a storage the recipe expects or holds
    it with another shape or dtype, or serves another quantization than `infer` describes."""
    if len(described) != infer.world:
        raise ValueError(f"{infer} has {infer.world} ranks but {len(described)} workers answered")
    for r, q in enumerate(quantization or ()):
        _check_quantization(r, q, infer)
    recipe = Recipe(config, train, infer, hf_experts="split")
    specs = recipe.specs(dtype, train_dtype)
    dt_name = str(dtype).replace("torch.", "")
    fallback: list[set] = []
    for r, desc in enumerate(described):
        bad = set()
        for name, shape in storage_shapes(config, infer, r).items():
            got = desc.get(name)
            if got is None:
                raise ValueError(f"vLLM worker {r}: no parameter {name!r} (expected shape "
                                 f"{tuple(shape)}); is it {infer}?")
            if tuple(got[0]) != tuple(shape):
                raise ValueError(f"vLLM worker {r}: {name!r} has shape {tuple(got[0])}, the "
                                 f"recipe for {infer} expects {tuple(shape)}")
            if got[2] is not None:
                bad.add(name)
            elif got[1] != dt_name and "e_score_correction_bias" not in name:
                raise ValueError(f"vLLM worker {r}: {name!r} is {got[1]}, refit dtype is "
                                 f"{dt_name}")
        fallback.append(bad)
    staging: list[dict] = [{} for _ in described]
    hf_shapes = hf_parameter_shapes(config, hf_experts="split", mtp=True)
    for pc in recipe.pieces:
        spec = specs[pc.name]
        if not any(slot.storage in fallback[r] for r, slot in spec.dst_slots):
            continue
        ranks = sorted({r for r, _ in spec.dst_slots})
        hf_name = pc.hf
        slot = rr.Slot(FULL + hf_name, pc.index, pc.dim, pc.offset)
        dst = rr.Layout(rr.Mesh(ranks, ("workers",)), (rr.Replicate(),))
        specs[pc.name] = rr.TensorSpec(spec.shape, spec.dtype, spec.src, dst,
                                    src_dtype=spec.src_dtype, src_slots=spec.src_slots,
                                    dst_slots={r: slot for r in ranks}, quant=spec.quant)
        for r in ranks:
            staging[r][hf_name] = (hf_shapes[pc.hf], str(spec.dtype).replace("torch.", ""))
            if spec.quant is not None:      # the checkpoint's scales beside the weight
                staging[r][spec.quant.scale_storage(hf_name)] = (
                    spec.quant.scale_shape(hf_shapes[pc.hf]), "float32")
    return specs, staging


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


# --------------------------------------------------------------------------------- trainer side
@dataclass
class RayReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. `config`: the HF config; `train` / `infer`: the layouts
    (Megatron(...), VLLM(...)); `dst_actors`: the vLLM worker actors in `infer`'s rank order
    (`ray_reshard.integrations.actors.vllm_worker_actors`); `src_actors`: the trainer actors in
    `train`'s rank order (default: gathered over torch.distributed's default group);
    `tensors`: this rank's storages (default: ``source.iter_local()``)."""

    backend: ClassVar[str] = BACKEND
    config: Any = None
    train: Any = None
    infer: Any = None
    dst_actors: list = field(default_factory=list)
    src_actors: Optional[list] = None
    tensors: Optional[Callable[[], Mapping[str, torch.Tensor]]] = None
    dtype: torch.dtype = torch.bfloat16
    train_dtype: Optional[torch.dtype] = None
    key: str = "default"
    timeout_s: Optional[float] = None
    group_options: dict = field(default_factory=dict)


class RayReshardTrainerEngine(TrainerWeightTransferEngine[RayReshardTrainerInitInfo]):
    init_info_cls = RayReshardTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, rank=0, init_info=None):
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.info = init_info
        self.group = None
        self.specs: dict = {}
        self.round = 0
        self.last = None

    @classmethod
    def trainer_init(cls, init_info: RayReshardTrainerInitInfo, *, client, source=None):
        from .actors import train_worker_actors

        info = init_info
        if info.config is None or info.train is None or info.infer is None:
            raise ValueError("RayReshardTrainerInitInfo needs config, train and infer")
        tensors = info.tensors
        if tensors is None:
            if source is None:
                raise ValueError("give RayReshardTrainerInitInfo.tensors or a WeightSource")
            tensors = lambda: dict(source.iter_local())       # noqa: E731
        _entry(info.key)["tensors"] = tensors
        src_actors = info.src_actors if info.src_actors is not None else train_worker_actors()
        engine = cls(client=client, source=source, is_sender=info.is_sender, rank=info.rank,
                     init_info=info)
        engine.src_actors = list(src_actors)
        if not engine.is_sender:
            return engine
        if len(engine.src_actors) != info.train.world:
            raise ValueError(f"{info.train} has {info.train.world} ranks, got "
                             f"{len(engine.src_actors)} trainer actors")
        if len(info.dst_actors) != info.infer.world:
            raise ValueError(f"{info.infer} has {info.infer.world} ranks, got "
                             f"{len(info.dst_actors)} vLLM worker actors")
        client.init_weight_transfer_engine({"key": info.key})
        described = ray.get([a.__ray_call__.remote(_describe, info.key) for a in info.dst_actors])
        quant = ray.get([a.__ray_call__.remote(_quantization, info.key)
                         for a in info.dst_actors])
        engine.specs, staging = plan_specs(info.config, info.train, info.infer, described,
                                           info.dtype, info.train_dtype, quant)
        ray.get([a.__ray_call__.remote(_configure, info.key, st)
                 for a, st in zip(info.dst_actors, staging)])
        engine.fallback = {r: sorted(st) for r, st in enumerate(staging) if st}
        engine.group = rr.ReshardGroup(engine.src_actors, info.dst_actors,
                                    tensors=functools.partial(local_tensors, info.key),
                                    **info.group_options)
        return engine

    def send_weights(self) -> None:
        self.round += 1
        key = self.info.key
        if not self.is_sender:
            ent = _entry(key)
            with _LOCK:
                ev = ent["rounds"].setdefault(self.round, threading.Event())
            if not ev.wait(self.info.timeout_s or 3600.0):
                raise TimeoutError(f"trainer rank {self.rank}: the sender did not finish round "
                                   f"{self.round}")
            err = ent["errors"].pop(self.round, None)
            ent["rounds"].pop(self.round, None)
            if err:
                raise RuntimeError(f"trainer rank {self.rank}: refit failed on the sender: {err}")
            return
        error = None
        try:
            self.client.start_weight_update()
            self.last = self.group.refit(self.specs, timeout_s=self.info.timeout_s)
            self.client.update_weights({"version": self.last.version})
            self.client.finish_weight_update()
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            others = [a for i, a in enumerate(self.src_actors) if i != self.rank]
            ray.get([a.__ray_call__.remote(_release, key, self.round, error) for a in others])

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        ent = _REGISTRY.get(self.info.key)
        if ent is not None:
            ent.pop("tensors", None)


def register() -> None:
    """Register the backend with vLLM's factories (idempotent); run it in every process that
    builds a weight-transfer engine (vLLM workers: e.g. from a vLLM plugin, or before
    creating the engine in-process; trainers: before trainer_init)."""
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)
    for factory, cls in ((WeightTransferEngineFactory, "RayReshardWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "RayReshardTrainerEngine")):
        try:
            factory.register_engine(BACKEND, __name__, cls)
        except ValueError as e:          # registered before (by us, or a name clash)
            if "already registered" not in str(e):
                raise
