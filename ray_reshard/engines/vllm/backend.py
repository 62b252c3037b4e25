"""A ``ray_reshard`` backend for vLLM's pluggable weight transfer
(``vllm.distributed.weight_transfer``; vLLM 0.32 and 0.33).

Worker side: `RayReshardWeightTransferEngine`, selected with
``WeightTransferConfig(backend="ray_reshard")`` and registered in every vLLM process by a
``vllm.general_plugins`` entry point (`register`). Trainer side: `RayReshardTrainerEngine`, on
every trainer rank; rank 0 drives each round. A parameter is written in place only when the
forward pass reads that very tensor, else loaded by vLLM's ``load_weights`` (`route`).
Protocol details: docs/engines.md (The vLLM backend).
"""
from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ...runtime.group import ReshardGroup
from .routes import (describe_model, finish_expert_processing, rederive, repack_modules, route,
                     track_expert_processing, writable)
from .specs import FULL, format_report, plan_specs, written_in_place
from ..views import (WorkerView, current_actor_id, entry, export_tensors, forget,
                           local_tensors)

BACKEND = "ray_reshard"
REGISTER_TIMEOUT_S = 300.0  # how long the sender waits for every rank's trainer_init
ROUND_MARGIN_S = 120.0      # a waiting rank's margin over the refit's deadline
# vLLM 0.33's TrainerWeightTransferEngine takes the trainer's rank; 0.32's does not
_TRAINER_BASE_TAKES_RANK = "rank" in inspect.signature(
    TrainerWeightTransferEngine.__init__).parameters

__all__ = ["BACKEND", "FULL", "RayReshardInitInfo", "RayReshardTrainerEngine",
           "RayReshardTrainerInitInfo", "RayReshardUpdateInfo", "RayReshardWeightTransferEngine",
           "describe_model", "format_report", "local_tensors", "plan_specs", "register", "route",
           "writable", "written_in_place"]


# ---------------------------------------------------------------------------------- worker side
@dataclass
class RayReshardInitInfo(WeightTransferInitInfo):
    key: str = "default"


@dataclass
class RayReshardUpdateInfo(WeightTransferUpdateInfo):
    version: int = 0
    key: Optional[str] = None       # the transfer this round belongs to (None: the only one)


@dataclass
class _Transfer:
    """What one trainer connection (one key) holds in a worker."""

    staging: dict = field(default_factory=dict)      # HF name -> whole tensor (fallback)
    exposed: dict = field(default_factory=dict)      # parameter name -> tensor (in place)
    fallback_modules: set = field(default_factory=set)
    repack: list = field(default_factory=list)       # modules whose packed copy is rebuilt


class RayReshardWeightTransferEngine(WeightTransferEngine[RayReshardInitInfo, RayReshardUpdateInfo]):
    """Worker side: describes how the forward pass reads each parameter, exposes the in-place
    parameters and the fallback staging tensors to the trainer's ReshardGroup, loads fallback
    pieces, re-derives MLA tensors, rebuilds tied heads' packed copies. The bytes arrive outside
    ``update_weights`` (the group writes them between start_weight_update and update_weights).

    Several transfers (trainer connections, by key) may be open at once; each keeps its own
    staging tensors, and a round loads only its own (its key comes with ``update_weights``)."""

    init_info_cls = RayReshardInitInfo
    update_info_cls = RayReshardUpdateInfo
    # the recipes describe the MTP draft (VLLM(model="mtp")), but this engine describes and
    # exposes the model it was initialised with: draft updates are not wired here
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.transfers: dict[str, _Transfer] = {}
        self.key: Optional[str] = None          # the transfer initialised last
        self.version = 0
        self.rederived: list[str] = []
        self.reprocessed: list[str] = []
        self.repacked: list[str] = []
        self._round: Optional[dict] = None      # the update session's key, reload, experts

    def _quantized(self) -> bool:
        return getattr(self.model_config, "quantization", None) is not None

    def transfer(self, key: Optional[str]) -> _Transfer:
        """The state of transfer `key` (None: the only open one)."""
        if key is None:
            if len(self.transfers) != 1:
                raise RuntimeError(f"{len(self.transfers)} ray_reshard transfers are open on "
                                   f"this worker ({sorted(self.transfers)}): name the key")
            key = next(iter(self.transfers))
        try:
            return self.transfers[key]
        except KeyError:
            raise RuntimeError(f"no ray_reshard weight transfer {key!r} on this worker (open: "
                               f"{sorted(self.transfers)})") from None

    def init_transfer_engine(self, init_info: RayReshardInitInfo) -> None:
        self.key = init_info.key
        self.transfers.setdefault(init_info.key, _Transfer())
        entry(init_info.key)["engine"] = self

    def quantization(self) -> dict:
        """The served model's quantization: method (None: unquantized), block FP8's
        weight_block_size, whether the checkpoint holds FP8 (else vLLM quantizes on load)."""
        qc = getattr(self.vllm_config, "quant_config", None)
        block = getattr(qc, "weight_block_size", None)
        return {"method": getattr(self.model_config, "quantization", None),
                "block": None if block is None else tuple(int(b) for b in block),
                "serialized": getattr(qc, "is_checkpoint_fp8_serialized", None)}

    def parallel(self) -> dict:
        pc = self.parallel_config
        return {"tp": int(getattr(pc, "tensor_parallel_size", 1)),
                "pp": int(getattr(pc, "pipeline_parallel_size", 1)),
                "dp": int(getattr(pc, "data_parallel_size", 1))}

    def hf_config(self) -> Optional[dict]:
        """The Hugging Face config of the served model, as a dict (None when not known)."""
        cfg = getattr(self.model_config, "hf_config", None)
        if cfg is None:
            return None
        return dict(cfg) if isinstance(cfg, Mapping) else cfg.to_dict()

    def describe(self, key: Optional[str] = None) -> dict:
        """Every parameter: name -> {shape, dtype, why, tied} (see `describe_model`). Also
        remembers, for transfer `key`, the in-place parameters: during a layerwise reload the
        module attributes point elsewhere, the tensors remembered here keep the memory the
        forward pass reads."""
        t = self.transfer(key)
        out, t.exposed, t.fallback_modules, t.repack = describe_model(self.model,
                                                                      self._quantized())
        return out

    def configure(self, staging: Mapping[str, tuple], key: Optional[str] = None) -> None:
        """Allocate transfer `key`'s staging tensors of fallback pieces: HF name -> (shape,
        dtype name)."""
        self.transfer(key).staging = {
            n: torch.empty(tuple(s), dtype=getattr(torch, dt), device=self.device)
            for n, (s, dt) in staging.items()}

    def tensors(self, key: Optional[str] = None) -> dict:
        t = self.transfer(key)
        out = dict(t.exposed)
        out.update({FULL + n: s for n, s in t.staging.items()})
        return out

    def begin_reload(self) -> None:
        """vLLM's layerwise reload around load_weights of fallback pieces."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def start_weight_update(self) -> None:
        # Which transfer this round belongs to comes with update_weights: the reload starts
        # there (in-place bytes written before it stay: a reload restores the tensors of the
        # modules it does not load).
        self._round = None

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RayReshardUpdateInfo) -> None:
        t = self.transfer(update_info.key)
        self.version = update_info.version
        self._round = {"transfer": t, "layerwise": bool(t.staging), "experts": {}}
        if t.staging:
            self._round["experts"] = track_expert_processing(self.model, t.fallback_modules)
            self.begin_reload()
            self.model.load_weights(iter(list(t.staging.items())))

    def finish_weight_update(self) -> None:
        rnd, self._round = self._round, None
        if rnd is not None and rnd["layerwise"]:
            self.end_reload()       # re-processes deferred attention layers itself
            self.reprocessed = finish_expert_processing(self.model, rnd["experts"])
            self.rederived = []
        else:
            self.rederived = rederive(self.model,
                                      getattr(self.model_config, "dtype", torch.bfloat16))
        # in-place bytes may have landed even in a round that failed: every open transfer's
        # tied heads follow the tensors they copy
        self.repacked = repack_modules(self.model, sorted({m for t in self.transfers.values()
                                                           for m in t.repack}))

    def forget(self, key: str) -> None:
        """Close transfer `key` on this worker (its staging tensors go)."""
        self.transfers.pop(key, None)
        ent = entry(key)
        if ent.get("engine") is self:
            del ent["engine"]

    def shutdown(self) -> None:
        for key in list(self.transfers):
            self.forget(key)


# Functions run by the engine (an `LLM` actor, through __ray_call__) and by its workers (through
# the engine's collective_rpc: called with the worker, results in worker rank order).
def _engine_where(llm) -> tuple:
    return ray.get_runtime_context().get_node_id(), current_actor_id()


def _engine_rpc(llm, fn, *args) -> list:
    return list(llm.collective_rpc(fn, args=args))


def _worker_engine(worker, key: str) -> RayReshardWeightTransferEngine:
    eng = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(eng, RayReshardWeightTransferEngine) or key not in eng.transfers:
        raise RuntimeError(f"vLLM worker {getattr(worker, 'rank', '?')} has no ray_reshard "
                           f"weight transfer {key!r} (weight_transfer_config backend "
                           f"{BACKEND!r} and init_weight_transfer_engine first)")
    return eng


def _own_actor(engine_actor_id):
    """This worker's handle when it is a Ray actor other than the engine's (a ReshardGroup
    reaches it directly), else None (it is reached through a WorkerView)."""
    me = current_actor_id()
    if me is None or me == engine_actor_id:
        return None
    return ray.get_runtime_context().current_actor


def _worker_describe(worker, key: str, engine_actor_id) -> dict:
    """A worker's description, and how a ReshardGroup reaches it: its own actor handle, or its
    in-place tensors exported for a view."""
    eng = _worker_engine(worker, key)
    described = eng.describe(key)
    handle = _own_actor(engine_actor_id)
    return {"describe": described, "quantization": eng.quantization(),
            "parallel": eng.parallel(), "hf_config": eng.hf_config(), "handle": handle,
            "exported": None if handle is not None else
            export_tensors(eng.transfer(key).exposed)}


def _worker_configure(worker, key: str, staging_by_rank: list, engine_actor_id) -> Optional[dict]:
    """Allocate a worker's staging tensors; exported for its view unless it is a Ray actor."""
    eng = _worker_engine(worker, key)
    eng.configure(staging_by_rank[int(getattr(worker, "rank", 0))], key)
    if _own_actor(engine_actor_id) is not None:
        return None
    return export_tensors({FULL + n: t for n, t in eng.transfer(key).staging.items()})


def _worker_forget(worker, key: str) -> None:
    """Close transfer `key` in a worker (its staging tensors go)."""
    eng = getattr(worker, "weight_transfer_engine", None)
    if isinstance(eng, RayReshardWeightTransferEngine):
        eng.forget(key)


def _await_registered(actor, key: str, rank: int, timeout_s: float) -> None:
    """Wait until this trainer rank's trainer_init registered its tensors under `key`."""
    if not entry(key).setdefault("registered", threading.Event()).wait(timeout_s):
        raise RuntimeError(f"trainer rank {rank} did not call trainer_init for transfer {key!r} "
                           f"within {timeout_s:.0f} s (every rank must)")


def _release(actor, key: str, round_no: int, error: Optional[str]) -> None:
    ent = entry(key)
    ev = ent["rounds"].setdefault(round_no, threading.Event())
    ent["errors"][round_no] = error
    ev.set()


# --------------------------------------------------------------------------------- trainer side
@dataclass
class RayReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. `config`: the HF config; `train` / `infer`: the layouts
    (``Megatron(...)`` / ``FSDP(...)``, ``VLLM(...)``); `engines`: the vLLM engine actors (``LLM``
    as a Ray actor; several engines in `infer`'s data-parallel order; default: the handles of a
    ``RayVLLMWeightSyncClient``); `src_actors`: the trainer actors in `train`'s rank order
    (default: gathered over torch.distributed's default group); `tensors`: this rank's storages
    (default: the WeightSource's ``iter_local()``, vLLM >= 0.33); `atomic`: stage the whole refit
    before writing any destination (see ``ReshardGroup.refit``); `delta`: send the parameters
    written in place as the bytes that changed since the last round (delta refits, see
    docs/delta.md), those going through load_weights whole."""

    backend: ClassVar[str] = BACKEND
    config: Any = None
    train: Any = None
    infer: Any = None
    engines: Optional[list] = None
    src_actors: Optional[list] = None
    tensors: Optional[Callable[[], Mapping[str, torch.Tensor]]] = None
    dtype: torch.dtype = torch.bfloat16
    train_dtype: Optional[torch.dtype] = None
    key: str = "default"
    timeout_s: Optional[float] = None
    atomic: bool = False
    delta: bool = False
    group_options: dict = field(default_factory=dict)


class RayReshardTrainerEngine(TrainerWeightTransferEngine[RayReshardTrainerInitInfo]):
    """Trainer side (see the module docstring). On the sender: `group` (the ReshardGroup),
    `specs`, `last` (the last RefitResult), `report()` (the per-parameter decisions)."""

    init_info_cls = RayReshardTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, rank=0, init_info=None):
        kw = {"rank": rank} if _TRAINER_BASE_TAKES_RANK else {}
        super().__init__(client=client, source=source, is_sender=is_sender, **kw)
        self.rank = rank
        self.info = init_info
        self.group = None
        self.specs: dict = {}
        self.round = 0
        self.last = None
        self.views: list = []
        self.engines: list = []
        self.fallback: dict = {}
        self.delta_names: tuple = ()      # specs sent as deltas (written in place)
        self._decisions: list[dict] = []

    @classmethod
    def trainer_init(cls, init_info: RayReshardTrainerInitInfo, *, client, source=None):
        from ...runtime.membership import train_worker_actors

        info = init_info
        if info.config is None or info.train is None or info.infer is None:
            raise ValueError("RayReshardTrainerInitInfo needs config, train and infer")
        tensors = info.tensors
        if tensors is None:
            if source is None or not hasattr(source, "iter_local"):
                raise ValueError("give RayReshardTrainerInitInfo.tensors (this rank's storages) "
                                 "or, with vLLM >= 0.33, a WeightSource with iter_local()")
            tensors = lambda: dict(source.iter_local())       # noqa: E731
        ent = entry(info.key)
        ent["tensors"] = tensors
        ent.setdefault("registered", threading.Event()).set()
        src_actors = info.src_actors if info.src_actors is not None else train_worker_actors()
        engine = cls(client=client, source=source, is_sender=info.is_sender, rank=info.rank,
                     init_info=info)
        engine.src_actors = list(src_actors)
        if not engine.is_sender:
            return engine
        if len(engine.src_actors) != info.train.world:
            raise ValueError(f"{info.train} has {info.train.world} ranks, got "
                             f"{len(engine.src_actors)} trainer actors")
        engines = info.engines if info.engines is not None else getattr(client, "handles", None)
        if not engines:
            raise ValueError("RayReshardTrainerInitInfo.engines: the vLLM engine actors (or a "
                             "client with .handles, e.g. RayVLLMWeightSyncClient)")
        client.init_weight_transfer_engine({"key": info.key})
        try:
            engine._connect(list(engines))
        except BaseException:       # nothing stays open in the workers for a refused transfer
            engine.engines = engine.engines or list(engines)
            engine.shutdown()
            raise
        return engine

    def _connect(self, engines: list) -> None:
        """Wait for every trainer rank's tensors, describe every worker, plan, allocate
        staging, reach every worker, open the group."""
        info, key = self.info, self.info.key
        self.engines = list(engines)
        wait_s = info.timeout_s or REGISTER_TIMEOUT_S
        ray.get([a.__ray_call__.remote(_await_registered, key, i, wait_s)
                 for i, a in enumerate(self.src_actors) if i != self.rank], timeout=wait_s + 30)
        where = ray.get([e.__ray_call__.remote(_engine_where) for e in engines])
        reports = ray.get([e.__ray_call__.remote(_engine_rpc, _worker_describe, key, aid)
                           for e, (_, aid) in zip(engines, where)])
        flat = [rep for reps in reports for rep in reps]
        self.specs, staging = plan_specs(
            info.config, info.train, info.infer, [r["describe"] for r in flat], info.dtype,
            info.train_dtype, [r["quantization"] for r in flat], [r["parallel"] for r in flat],
            [r["hf_config"] for r in flat])
        per_engine, off = [], 0
        for reps in reports:
            per_engine.append(staging[off:off + len(reps)])
            off += len(reps)
        staged = ray.get([e.__ray_call__.remote(_engine_rpc, _worker_configure, key, st, aid)
                          for e, st, (_, aid) in zip(engines, per_engine, where)])
        handles, rank = [], 0
        for (node, _), reps, exports in zip(where, reports, staged):
            for rep, exp in zip(reps, exports):
                if rep["handle"] is not None:
                    handles.append(rep["handle"])
                else:
                    view = WorkerView.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                        node, soft=False)).remote(key, rank, {**rep["exported"], **(exp or {})})
                    self.views.append(view)
                    handles.append(view)
                rank += 1
        ray.get([v.where.remote() for v in self.views])
        self.fallback = {r: sorted(st) for r, st in enumerate(staging) if st}
        self.delta_names = tuple(sorted(n for n, spec in self.specs.items()
                                        if written_in_place(spec)))
        self._decisions = [
            {"rank": r, "name": name, "shape": d["shape"], "dtype": d["dtype"],
             "route": ("in place" if d["why"] is None else "fallback"), "why": d["why"],
             "tied": d.get("tied"), "delta": bool(info.delta) and d["why"] is None}
            for r, rep in enumerate(flat) for name, d in sorted(rep["describe"].items())]
        self.group = ReshardGroup(self.src_actors, handles,
                                     tensors=functools.partial(local_tensors, key),
                                     **info.group_options)

    def report(self) -> list[dict]:
        """Per worker rank and parameter: shape, dtype, route ("in place" or "fallback": through
        vLLM's load_weights), why (see `route`) and the parameter it is tied to, if any;
        `format_report` prints it."""
        return list(self._decisions)

    def send_weights(self) -> None:
        self.round += 1
        key = self.info.key
        if not self.is_sender:
            ent = entry(key)
            ev = ent["rounds"].setdefault(self.round, threading.Event())
            # the sender's round is its refit (timeout_s) plus the engine's start, load and
            # finish: wait for it with a margin
            if not ev.wait((self.info.timeout_s or 3600.0) + ROUND_MARGIN_S):
                raise TimeoutError(f"trainer rank {self.rank}: the sender did not finish round "
                                   f"{self.round}")
            err = ent["errors"].pop(self.round, None)
            ent["rounds"].pop(self.round, None)
            if err:
                raise RuntimeError(f"trainer rank {self.rank}: refit failed on the sender: {err}")
            return
        error = None
        started = False
        try:
            self.client.start_weight_update()
            started = True
            self.last = self.group.refit(self.specs, timeout_s=self.info.timeout_s,
                                         atomic=self.info.atomic,
                                         delta=self.delta_names if self.info.delta else False)
            self.client.update_weights({"version": self.last.version, "key": key})
            started = False
            self.client.finish_weight_update()
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            if started:     # close the engine's update session: reloaded modules get their
                try:        # previous tensors back
                    self.client.finish_weight_update()
                except Exception:       # noqa: BLE001  (the first error is the one to report)
                    pass
            raise
        finally:       # release the waiting ranks; a dead one (the refit named it) is skipped
            others = [a for i, a in enumerate(self.src_actors) if i != self.rank]
            refs = [a.__ray_call__.remote(_release, key, self.round, error) for a in others]
            ray.wait(refs, num_returns=len(refs), timeout=30)

    def shutdown(self) -> None:
        """Close the group and the views, and the transfer in every engine worker (its staging
        tensors go); an engine that is gone is skipped."""
        if self.group is not None:
            self.group.close()
            self.group = None
        for v in self.views:
            ray.kill(v)
        self.views = []
        if self.engines:
            refs = [e.__ray_call__.remote(_engine_rpc, _worker_forget, self.info.key)
                    for e in self.engines]
            ray.wait(refs, num_returns=len(refs), timeout=30)
            self.engines = []
        forget(self.info.key, "tensors")


def register() -> None:
    """Register the backend with vLLM's factories (idempotent). Installing ray-reshard runs it
    in every vLLM process (a ``vllm.general_plugins`` entry point); call it yourself in a
    process that builds an engine without loading vLLM's plugins."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:         # a vLLM without the trainer-side factory
        WeightTransferTrainerFactory = None
    for factory, cls in ((WeightTransferEngineFactory, "RayReshardWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "RayReshardTrainerEngine")):
        if factory is None:
            continue
        try:
            factory.register_engine(BACKEND, __name__, cls)
        except ValueError as e:          # registered before (by us, or a name clash)
            if "already registered" not in str(e):
                raise
