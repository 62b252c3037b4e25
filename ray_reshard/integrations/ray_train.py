"""Ray Train to live vLLM engines: inside ``train_loop_per_worker`` of a
``ray.train.torch.TorchTrainer``, `WeightSync` refits the engines from the worker group's model
(FSDP2 ``fully_shard``, HSDP, DDP or a replicated module) every `every` steps:

    def train_loop_per_worker(config):
        model = ...                                  # fully_shard(...) or DistributedDataParallel
        sync = WeightSync(model, config["engines"])  # every worker; engines: actor handles or names
        for step in range(1, steps + 1):
            ...                                      # forward, backward, optimizer.step()
            ray.train.report(metrics, checkpoint=...)
            sync.push(step)                          # every worker; the engines now serve `step`

Each worker's actor handle is gathered over the trainer's torch.distributed group; trainer
rank 0 drives every refit through the vLLM backend (``ray_reshard.engines.vllm.backend``) while the
other workers wait in `push`. The engines' callers generate through
``ray_reshard.engines.vllm.serving`` (``generate``, ``call``): never during a refit, each output
labelled with the version (`push`'s step) of the weights that produced it. Needs Ray Train V2
(Ray's default), whose workers run the training function in a thread and take calls meanwhile.
Protocol, failures and versions: docs/ray-train.md.
"""
from __future__ import annotations

import re
import uuid
from typing import Any, Callable, Mapping, Optional

import ray
import torch

from ..errors import RefitError
from ..runtime.membership import current_actor

__all__ = ["WeightSync", "train_layout"]

# How long a worker's actor may take to answer a call from itself before we conclude it takes
# no calls while the training function runs (Ray Train V1, an actor without max_concurrency).
TAKES_CALLS_TIMEOUT_S = 10.0


def _answer(actor) -> bool:
    return True


def check_takes_calls(actor, timeout_s: float = TAKES_CALLS_TIMEOUT_S) -> None:
    """Raise unless `actor` (this worker's own) runs a call while this code waits: the refit's
    driver calls into every worker while the others wait in `push`."""
    try:
        ray.get(actor.__ray_call__.remote(_answer), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"this worker's actor did not run a call within {timeout_s} s while its training "
            f"function waited: a refit calls into every worker while they wait. Ray Train V1 "
            f"(RAY_TRAIN_V2_ENABLED=0) holds its workers' main thread for the whole training "
            f"function; use Ray Train V2 (Ray's default). A plain actor needs "
            f"max_concurrency >= 2.") from None


def train_layout(model: torch.nn.Module, world: int):
    """(`FSDP` layout, module whose ``named_parameters`` are the HF names) of a model trained by
    `world` ranks: FSDP2 / HSDP (parameters are DTensors sharded on dim 0 over the whole group),
    DDP or a plain module replicated on every rank (``FSDP(shard=1, replicate=world)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.nn.parallel import DistributedDataParallel

    from ..models import FSDP

    module = model.module if isinstance(model, DistributedDataParallel) else model
    params = list(module.named_parameters())
    sharded = [(n, p) for n, p in params if hasattr(p, "device_mesh")]
    if not sharded:
        return FSDP(shard=1, replicate=world), module
    plain = [n for n, p in params if not hasattr(p, "device_mesh")]
    if plain:
        raise ValueError(f"parameter {plain[0]!r} is not sharded while others are (FSDP2): call "
                         f"fully_shard on the root module too, so every parameter is a DTensor")
    name, p = sharded[0]
    mesh = p.device_mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(f"{name!r}: a {mesh.ndim}-d device mesh; FSDP2 (1-d) and HSDP "
                         f"(replicate, shard) are supported")
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(world)):
        raise ValueError(f"{name!r} lives on device mesh ranks {ranks}, not on the whole "
                         f"trainer group 0..{world - 1}")
    want = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    for n, q in sharded:
        if q.device_mesh != mesh or list(q.placements) != want:
            raise ValueError(f"parameter {n!r} has placements {tuple(q.placements)} on "
                             f"{q.device_mesh}; FSDP2's Shard(0) (HSDP: Replicate(), Shard(0)) "
                             f"on {mesh} is described")
    shard = mesh.size(mesh.ndim - 1)
    return FSDP(shard=shard, replicate=world // shard), module


def _engine_facts(llm) -> dict:
    import vllm

    cfg = llm.llm_engine.vllm_config
    pc = cfg.parallel_config
    return {"dtype": str(cfg.model_config.dtype).replace("torch.", ""),
            "tp": int(pc.tensor_parallel_size), "pp": int(pc.pipeline_parallel_size),
            "dp": int(pc.data_parallel_size), "vllm": vllm.__version__}


def _resolve(engines) -> list:
    if isinstance(engines, (str, ray.actor.ActorHandle)):
        engines = [engines]
    out = [ray.get_actor(e) if isinstance(e, str) else e for e in engines]
    if not out:
        raise ValueError("engines: at least one vLLM engine actor (a handle or its name)")
    return out


class WeightSync:
    """Refits live vLLM engines from a Ray Train worker group's model; see the module docstring.

    Build it on every worker (a collective). `engines`: vLLM ``LLM`` actors started with
    ``WeightTransferConfig(backend="ray_reshard")`` (handles or actor names). `infer`: their
    layout (default: each engine's TP and PP, one data-parallel rank per engine). `config`: the
    model's HF config (default: ``model.config``). `every`: `push` refits when its step is a
    multiple. `atomic` (default): a refit that fails leaves the engines serving the previous
    version (destinations stage first); otherwise they are held until a refit completes.
    `delta`: refits send what changed since the previous one where the backend allows (see
    docs/delta.md; `push(delta=False)` sends one dense). `tensors`: this worker's storages by HF
    name (default: the model's local shards, looked up at every refit). `timeout_s`: one
    refit's deadline. `group_options`: ReshardGroup options (e.g. ``bucket_bytes``)."""

    def __init__(self, model: torch.nn.Module, engines, *, infer=None, config: Any = None,
                 every: int = 1, atomic: bool = True, delta: bool = False,
                 dtype: Optional[torch.dtype] = None,
                 tensors: Optional[Callable[[], Mapping[str, torch.Tensor]]] = None,
                 timeout_s: float = 120.0, key: Optional[str] = None,
                 group_options: Optional[dict] = None):
        import torch.distributed as dist

        from ..models import VLLM, fsdp_local_tensors
        from ..engines.vllm.backend import RayReshardTrainerEngine, RayReshardTrainerInitInfo
        from ..engines.vllm.serving import GatedClient

        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world = dist.get_world_size() if self._distributed else 1
        self.every, self.delta, self.timeout_s = every, delta, float(timeout_s)
        self.transfer, self.last = None, None
        me = current_actor()
        # Collectives are reached by every rank; a rank's error is exchanged at the next one,
        # so all raise together and none waits for a peer that gave up.
        pairs = self._gather((me, uuid.uuid4().hex if self.rank == 0 else None))
        src_actors = [a for a, _ in pairs]
        self.key = key or f"ray-train-{pairs[0][1]}"
        error = None
        try:
            check_takes_calls(me)
            self.engines = _resolve(engines)
            self.train, module = train_layout(model, self.world)
            facts = ray.get([e.__ray_call__.remote(_engine_facts) for e in self.engines],
                            timeout=self.timeout_s)
            if infer is None:
                f = facts[0]
                if f["dp"] != 1 or any((g["tp"], g["pp"], g["dp"]) != (f["tp"], f["pp"], 1)
                                       for g in facts):
                    raise ValueError(f"the engines' (tp, pp, dp) are "
                                     f"{[(g['tp'], g['pp'], g['dp']) for g in facts]}: give "
                                     f"infer=VLLM(...) for them")
                infer = VLLM(tp=f["tp"], pp=f["pp"], dp=len(self.engines),
                             version=".".join(f["vllm"].split(".")[:2]))
            self.infer = infer
            if config is None:
                config = getattr(module, "config", None)
                if config is None:
                    raise ValueError("config: the model's Hugging Face config (the model has "
                                     "no .config)")
            if delta and "delta" not in RayReshardTrainerInitInfo.__dataclass_fields__:
                raise ValueError("delta=True: this vLLM backend does not send delta refits "
                                 "(RayReshardTrainerInitInfo has no `delta`)")
            if tensors is None:
                tensors = lambda: fsdp_local_tensors(module)        # noqa: E731
            self.client = GatedClient(self.engines, owner=me, participants=src_actors,
                                      lease_s=self.timeout_s + 60.0, atomic=atomic)
            info = RayReshardTrainerInitInfo(
                rank=self.rank, config=config.to_dict() if hasattr(config, "to_dict") else config,
                train=self.train, infer=infer, engines=self.engines, src_actors=src_actors,
                tensors=tensors, dtype=dtype or getattr(torch, facts[0]["dtype"]),
                train_dtype=next(module.parameters()).dtype, key=self.key,
                timeout_s=self.timeout_s, atomic=atomic, group_options=dict(group_options or {}),
                **({"delta": True} if delta else {}))
            if self.rank != 0:      # its storages are registered before rank 0's group calls in
                self.transfer = RayReshardTrainerEngine.trainer_init(info, client=self.client)
        except Exception as e:      # noqa: BLE001  (raised below, on every rank)
            error = e
        self._agree(error, "could not prepare the refit")
        if self.rank == 0:
            try:
                self.transfer = RayReshardTrainerEngine.trainer_init(info, client=self.client)
            except Exception as e:      # noqa: BLE001  (raised below, on every rank)
                error = e
        self._agree(error, "could not connect to the engines")

    def _gather(self, obj) -> list:
        import torch.distributed as dist

        if not self._distributed:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def _agree(self, error: Optional[BaseException], what: str) -> None:
        """Every rank learns every rank's error; each raises its own, or names the first."""
        texts = self._gather(None if error is None else f"{type(error).__name__}: {error}")
        first = next(((r, t) for r, t in enumerate(texts) if t is not None), None)
        if first is None:
            return
        self.close()
        if error is not None:
            raise error
        raise RuntimeError(f"trainer rank {self.rank}: trainer rank {first[0]} {what}: "
                           f"{first[1]}")

    def report(self) -> list[dict]:
        """Rank 0: every engine parameter's route (in place or through load_weights) and why."""
        return self.transfer.report() if self.rank == 0 else []

    def push(self, step: int, *, force: bool = False, delta: Optional[bool] = None):
        """On every worker after its optimizer step: refit the engines when `step` is a multiple
        of `every` (or `force`), labelling the weights `step`. Returns the RefitResult on rank 0,
        None elsewhere (and when skipped). `delta`: this refit as a delta refit or not (default:
        as built). A failed refit raises RefitError on every worker."""
        import torch.distributed as dist

        if self.transfer is None:
            raise RuntimeError("this WeightSync is closed")
        if not force and step % self.every:
            return None
        if delta is None:
            delta = self.delta
        elif delta and not self.delta:
            raise ValueError("push(delta=True) needs WeightSync(..., delta=True): senders keep "
                             "a baseline of what they send from the first refit on")
        if self.delta:
            self.transfer.info.delta = bool(delta)
        if self._distributed:
            dist.barrier()      # every worker stepped: no shard changes while it moves
        self.client.label = int(step)
        try:
            self.transfer.send_weights()
        except RefitError:
            raise
        except Exception as e:
            raise _as_refit_error(e, self.rank, step) from e
        self.last = self.transfer.last if self.rank == 0 else None
        return self.last

    def close(self) -> None:
        """Leave the engines: rank 0 closes the group, and the engines free this transfer's
        staging memory."""
        if self.transfer is not None:
            transfer, self.transfer = self.transfer, None
            transfer.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _as_refit_error(e: BaseException, rank: int, step: int) -> RefitError:
    """A failed `push` as a RefitError: the one underneath when another error came after it,
    else this rank's view of the driver's failure (its text names the ranks at fault)."""
    seen = e
    while seen is not None:
        if isinstance(seen, RefitError):
            return seen
        seen = seen.__context__
    if rank != 0 and isinstance(e, TimeoutError):
        return RefitError(f"trainer rank {rank}: refit v{step}: trainer rank 0, which drives "
                          f"it, did not finish it ({e})", [("src", 0)])
    ranks = sorted({(side, int(r)) for side, r in re.findall(r"\b(src|dst) rank (\d+)", str(e))})
    return RefitError(f"trainer rank {rank}: refit v{step} failed: {type(e).__name__}: {e}",
                      ranks)
