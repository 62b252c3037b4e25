"""Refit recipes: TensorSpecs between two engines' layouts, and the helpers that build, from a
full HF state dict, each rank's storage (and back)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .._gc import gc_paused
from ..layout.quant import FP8
from ..layout.slicing import assemble as _assemble
from ..layout.spec import TensorSpec
from .config import ModelDims, model_dims
from .pieces import Piece, enumerate_pieces, hf_shapes, resolve_hf_experts
from .storage import EXPERT_KINDS, EngineSide, StorageDecl, make_side

SIDES = {"src": "src", "train": "src", "dst": "dst", "infer": "dst"}


def _piece_dtype(pc: Piece, dtype: torch.dtype) -> torch.dtype:
    # vLLM and Megatron both keep DeepSeek-V3's routing bias in float32.
    return torch.float32 if pc.kind == "router_bias" else dtype


def _decl_dtype(decl: StorageDecl, dtype: torch.dtype) -> torch.dtype:
    if decl.fp8:
        return FP8
    return torch.float32 if decl.fp32 else dtype


class Recipe:
    """The pieces of one model between two sides, with both sides' placements."""

    def __init__(self, config: Any, src, dst, hf_experts: str = "auto"):
        self.dims: ModelDims = model_dims(config)
        self.hf_experts = resolve_hf_experts(hf_experts)
        self.src: EngineSide = make_side(self.dims, src)
        self.dst: EngineSide = make_side(self.dims, dst)
        with gc_paused(keep=True):  # tens of thousands of pieces, none in a cycle
            pieces = enumerate_pieces(
                self.dims,
                split_groups=self.src.needs_group_split or self.dst.needs_group_split,
                per_expert=self.src.needs_expert_split or self.dst.needs_expert_split,
                hf_experts=self.hf_experts, mtp=self.dims.mtp_layers > 0)
            # what the destination keeps; the source must keep all of it
            self.pieces: list[Piece] = [pc for pc in pieces if self.dst.holds(pc)]
        for pc in self.pieces:
            if not self.src.holds(pc):
                raise ValueError(f"{pc.name}: the destination ({self.dst.name}) keeps it but "
                                 f"the source ({self.src.name}) does not (e.g. an MTP layer: "
                                 f"Megatron(mtp=True))")

    def specs(self, dtype: torch.dtype = torch.bfloat16,
              src_dtype: Optional[torch.dtype] = None) -> dict[str, TensorSpec]:
        out = {}
        with gc_paused(keep=True):
            src, dst = _placements(self.src, self.pieces), _placements(self.dst, self.pieces)
            first: dict = {}          # (layer, kind) -> an expert group's first spec
            for pc, (s_lay, s_slots), (d_lay, d_slots) in zip(self.pieces, src, dst):
                quant = self.dst.quant_of(pc)
                if quant is None and pc.expert is not None and pc.kind in EXPERT_KINDS:
                    like = first.get((pc.layer, pc.kind))
                    if like is not None and like.shape == pc.shape:   # checked once
                        out[pc.name] = like.sibling(s_lay, d_lay, s_slots, d_slots)
                        continue
                dt = _piece_dtype(pc, dtype)
                sdt = _piece_dtype(pc, src_dtype) if src_dtype is not None else None
                if quant is not None:       # block FP8, quantised by the senders
                    out[pc.name] = TensorSpec(pc.shape, FP8, s_lay, d_lay, src_dtype=sdt or dt,
                                              src_slots=s_slots, dst_slots=d_slots, quant=quant)
                    continue
                spec = out[pc.name] = TensorSpec(pc.shape, dt, s_lay, d_lay,
                                                 src_dtype=None if sdt == dt else sdt,
                                                 src_slots=s_slots, dst_slots=d_slots)
                if pc.expert is not None and pc.kind in EXPERT_KINDS:
                    first[(pc.layer, pc.kind)] = spec
        return out


def _placements(side: EngineSide, pieces: list[Piece]) -> list:
    """side.place(pc) of every piece, the per-expert ones a layer and kind at a time."""
    out: list = [None] * len(pieces)
    groups: dict = {}
    for i, pc in enumerate(pieces):
        if pc.expert is not None and pc.kind in EXPERT_KINDS:
            groups.setdefault((pc.layer, pc.kind), []).append(i)
        else:
            out[i] = side.place(pc)
    for at in groups.values():
        for i, got in zip(at, side.place_experts([pieces[i] for i in at])):
            out[i] = got
    return out


def refit_specs(config: Any, train, infer, dtype: torch.dtype = torch.bfloat16,
                train_dtype: Optional[torch.dtype] = None, hf_experts: str = "auto"
                ) -> dict[str, TensorSpec]:
    """TensorSpecs of a refit from `train` (e.g. Megatron(tp=.., pp=..)) to `infer`
    (e.g. VLLM(tp=.., dp=..)).

    Logical tensors are the Hugging Face parameters (names and shapes of the HF model's
    state dict), cut into sub-pieces only where a rank's shard is not one slice of its storage
    (see ray_reshard.models.pieces). Together they cover every byte of the model once (a tied
    lm_head is the embedding). `dtype` is the inference dtype (what moves), `train_dtype` the
    training storage dtype (senders convert). `hf_experts` picks the HF naming of MoE experts:
    "fused" (transformers >= 5), "split" (checkpoints, transformers 4) or "auto".
    """
    return Recipe(config, train, infer, hf_experts).specs(dtype, train_dtype)


def _side_pieces(config: Any, parallel, hf_experts: str
                 ) -> tuple[ModelDims, EngineSide, list[Piece]]:
    dims = model_dims(config)
    side = make_side(dims, parallel)
    pieces = enumerate_pieces(dims, split_groups=side.needs_group_split,
                              per_expert=side.needs_expert_split,
                              hf_experts=resolve_hf_experts(hf_experts), mtp=dims.mtp_layers > 0)
    return dims, side, [pc for pc in pieces if side.holds(pc)]


def _check_side(side: str) -> str:
    if side not in SIDES:
        raise ValueError(f"side must be 'src'/'train' or 'dst'/'infer', got {side!r}")
    return SIDES[side]


def storage_shapes(config: Any, parallel, rank: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every local storage tensor of `rank` under `parallel`."""
    side = make_side(model_dims(config), parallel)
    return {n: decl.shape for n, decl in side.storages(rank).items()}


def empty_storage(config: Any, parallel, rank: int, dtype: torch.dtype = torch.bfloat16,
                  fill: Optional[float] = 0.0, device: Union[str, torch.device, None] = None
                  ) -> dict[str, torch.Tensor]:
    """Destination storages of `rank` (padded, fused, stacked as the engine keeps them),
    filled with `fill` (None: uninitialised)."""
    side = make_side(model_dims(config), parallel)
    out = {}
    for name, decl in side.storages(rank).items():
        dt = _decl_dtype(decl, dtype)
        if fill is None:
            out[name] = torch.empty(decl.shape, dtype=dt, device=device)
        else:
            out[name] = torch.full(decl.shape, fill, dtype=dt, device=device)
    return out


def local_state(config: Any, parallel, side: str, rank: int,
                state_dict: Mapping[str, torch.Tensor], dtype: Optional[torch.dtype] = None,
                hf_experts: str = "auto") -> dict[str, torch.Tensor]:
    """The storage dict rank `rank` of `parallel` holds for a full HF `state_dict`.

    Storage names and fusion are the engine's (Megatron: linear_qkv grouped per query group,
    linear_fc1 = [gate; up], experts per local expert or stacked; vLLM: qkv_proj, gate_up_proj,
    w13/w2, padded vocabulary blocks). Padding rows are zero. `dtype` converts (default: the
    state dict's dtype); routing biases stay float32.
    """
    _check_side(side)
    dims, sd, pieces = _side_pieces(config, parallel, hf_experts)
    decls = sd.storages(rank)
    if dtype is None:
        dtype = next(iter(state_dict.values())).dtype
    out = {n: torch.zeros(decl.shape, dtype=_decl_dtype(decl, dtype)) for n, decl in decls.items()}
    for pc, slot, box in _placed(sd, pieces, rank):
        try:
            full = state_dict[pc.hf]
        except KeyError:
            raise KeyError(f"state dict has no {pc.hf!r} (needed for {pc.name!r})") from None
        src = pc.hf_slot.view(full, pc.shape)[box.slices()]
        slot.view(out[slot.storage], box.sizes).copy_(src)
    return out


def _placed(sd, pieces, rank: int):
    """(piece, slot, box) of every piece `rank` holds a non-empty part of."""
    for pc in pieces:
        layout, slots = sd.place(pc)
        slot = slots.get(rank)
        if slot is None:
            continue
        box = layout.box(rank, pc.shape)
        if not box.empty:
            yield pc, slot, box


def padding_mask(config: Any, parallel, rank: int, hf_experts: str = "auto"
                 ) -> dict[str, torch.Tensor]:
    """Per storage tensor of `rank`, a bool mask of the elements that hold no logical data
    (vocabulary padding). Raises if a logical element is placed twice."""
    dims, sd, pieces = _side_pieces(config, parallel, hf_experts)
    cover = {n: torch.zeros(decl.shape, dtype=torch.int32) for n, decl in sd.storages(rank).items()}
    for pc, slot, box in _placed(sd, pieces, rank):
        if slot.storage not in cover:
            raise KeyError(f"{pc.name!r} is placed in {slot.storage!r}, which rank {rank} lacks")
        slot.view(cover[slot.storage], box.sizes).add_(1)
    for n, c in cover.items():
        if c.numel() and int(c.max()) > 1:
            raise ValueError(f"rank {rank}: elements of {n!r} are placed more than once")
    return {n: c == 0 for n, c in cover.items()}


def assemble_state_dict(config: Any, parallel, storages: Union[Sequence[Mapping[str, torch.Tensor]],
                                                                Mapping[int, Mapping[str, torch.Tensor]]],
                        hf_experts: str = "auto", check_replicas: bool = True,
                        dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Rebuild the full HF state dict from every rank's storages under `parallel` (the inverse
    of local_state). Replicas must agree when `check_replicas`. A tied lm_head.weight is
    returned as the embedding tensor itself."""
    dims, sd, pieces = _side_pieces(config, parallel, hf_experts)
    if not isinstance(storages, Mapping):
        storages = dict(enumerate(storages))
    shapes = hf_shapes(dims, resolve_hf_experts(hf_experts), mtp=True)
    out: dict[str, torch.Tensor] = {}
    for pc in pieces:
        layout, slots = sd.place(pc)
        shards = {}
        for r, slot in slots:
            if r in storages:
                box = layout.box(r, pc.shape)
                shards[r] = slot.view(storages[r][slot.storage], box.sizes)
        if not shards:
            raise ValueError(f"no storage of the given ranks holds {pc.name!r}")
        full = _assemble(shards, layout, pc.shape, check_replicas=check_replicas)
        if pc.hf not in out:
            out[pc.hf] = torch.empty(shapes[pc.hf], dtype=dtype or full.dtype)
        pc.hf_slot.view(out[pc.hf], pc.shape).copy_(full)
    if dims.tie:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def tied_aliases(config: Any) -> dict[str, str]:
    """HF state-dict names that alias another parameter (not refit separately)."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if model_dims(config).tie else {}


def hf_parameter_shapes(config: Any, hf_experts: str = "auto", mtp: bool = False
                        ) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every HF parameter a refit covers (tied aliases excluded); with
    `mtp`, also the multi-token prediction layers' (checkpoint names, model.layers.{L + j})."""
    return hf_shapes(model_dims(config), resolve_hf_experts(hf_experts), mtp=mtp)


def logical_to_hf(specs_or_recipe) -> dict[str, str]:
    """Map logical tensor names to the HF parameter they are part of (strip '@...')."""
    names = specs_or_recipe if not isinstance(specs_or_recipe, Recipe) else \
        [p.name for p in specs_or_recipe.pieces]
    return {n: n.split("@", 1)[0] for n in names}
