"""Where each engine keeps each piece: its Layout over the side's ranks and, per rank, the Slot
inside the engine's own (fused, padded, stacked) storage tensors.

Megatron storage names follow Megatron-core's GPT model with the Transformer Engine layer spec
(input norm fused into linear_qkv as ``layer_norm_weight``, pre-MLP norm fused into
linear_fc1 for dense layers, ``pre_mlp_layernorm`` for MoE layers); vLLM's follow its model
classes (qkv_proj, gate_up_proj, FusedMoE w13/w2, fused_qkv_a_proj for MLA with q_lora_rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Optional

import numpy as np

from ..core.layout import Layout
from ..core.mesh import Mesh
from ..core.placement import Replicate, Shard
from ..core.spec import Slot
from .config import ModelDims
from .parallel import VLLM, Megatron, split_layers
from .pieces import Piece


@dataclass(frozen=True)
class StorageDecl:
    shape: tuple[int, ...]
    fp32: bool = False          # kept in float32 whatever the model dtype (router bias)


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


class SlotTable(tuple):
    """((rank, Slot), ...) sorted by rank, the frozen form TensorSpec keeps, with dict-like
    lookup by rank."""

    def get(self, rank: int, default=None):
        d = self.__dict__.get("_d")
        if d is None:
            d = self.__dict__["_d"] = dict(self)
        return d.get(rank, default)

    def items(self):
        return iter(self)


class Side:
    """Common part: placement and layout caching, the per-rank slot tables."""

    name = "side"
    needs_group_split = False
    needs_expert_split = False

    def __init__(self, dims: ModelDims):
        self.d = dims
        self._cache: dict[str, tuple[Layout, SlotTable]] = {}
        self._layouts: dict[tuple, Layout] = {}
        self._grids: dict[tuple, np.ndarray] = {}
        self._sorted: dict[int, tuple[int, ...]] = {}     # id(layout) -> sorted ranks

    @property
    def n_ranks(self) -> int:
        raise NotImplementedError

    def place(self, pc: Piece) -> tuple[Layout, SlotTable]:
        """The piece's layout on this side and the Slot of every rank holding part of it."""
        got = self._cache.get(pc.name)
        if got is None:
            got = self._cache[pc.name] = self._place(pc)
        return got

    def _place(self, pc: Piece):
        raise NotImplementedError

    def storages(self, rank: int) -> dict[str, StorageDecl]:
        raise NotImplementedError

    # layouts (cached: the planner keys its caches on them, and meshes are not free to build)
    def _layout(self, grid: np.ndarray, placements) -> Layout:
        grid = np.asarray(grid)
        key = (grid.shape, grid.tobytes(),
               tuple((type(p).__name__, getattr(p, "dim", None), getattr(p, "block", None))
                     for p in placements))
        lay = self._layouts.get(key)
        if lay is None:
            names = tuple(f"m{i}" for i in range(grid.ndim))
            lay = self._layouts[key] = Layout(Mesh(grid.tolist(), names), tuple(placements))
        return lay

    def _rep(self, grid: np.ndarray) -> Layout:
        """Every rank of the grid holds the whole piece."""
        return self._layout(np.asarray(grid).reshape(-1), (Replicate(),))

    def _shard(self, grid: np.ndarray, dim: int, block: Optional[int] = None) -> Layout:
        """grid [replicas, tp]: replicate over rows, shard tensor dim `dim` over columns."""
        return self._layout(grid, (Replicate(), Shard(dim, block)))

    def _same(self, layout: Layout, slot: Slot) -> tuple[Layout, SlotTable]:
        """Every rank of the layout keeps the piece in the same slot."""
        ranks = self._sorted.get(id(layout))
        if ranks is None:
            ranks = self._sorted[id(layout)] = tuple(sorted(layout.mesh.ranks))
        return layout, SlotTable(zip(ranks, repeat(slot)))

    @staticmethod
    def _table(slots: dict) -> SlotTable:
        return SlotTable(sorted(slots.items()))


# --------------------------------------------------------------------------------------------
# Megatron-core
# --------------------------------------------------------------------------------------------

class MegatronSide(Side):
    name = "megatron"

    def __init__(self, dims: ModelDims, par: Megatron):
        super().__init__(dims)
        d, self.par = dims, par
        tp = par.tp
        self.stage_layers = split_layers(d.layers, par.pp, par.layers_per_stage, "front")
        self.stage_of, self.local_of = [], []
        for s, n in enumerate(self.stage_layers):
            for i in range(n):
                self.stage_of.append(s)
                self.local_of.append(i)
        mult = par.vocab_divisible_by * tp
        self.vocab_padded = -(-d.vocab // mult) * mult
        self.vblock = self.vocab_padded // tp
        _div(d.heads, tp, "Megatron: attention heads / tp")
        if not d.mla:
            self.groups_local = _div(d.query_groups, tp, "Megatron: query groups / tp")
            self.needs_group_split = self.groups_local > 1
        if d.intermediate and any(not d.is_moe(l) for l in range(d.layers)):
            _div(d.intermediate, tp, "Megatron: intermediate_size / tp")
        if d.moe_layers:
            self.experts_local = _div(d.experts, par.ep, "Megatron: experts / ep")
            _div(d.moe_intermediate, par.expert_tp, "Megatron: moe_intermediate_size / etp")
            if d.shared_intermediate:
                _div(d.shared_intermediate, tp, "Megatron: shared experts' intermediate / tp")
            self.needs_expert_split = par.experts != "stacked"

    @property
    def n_ranks(self) -> int:
        return self.par.world

    # grids -------------------------------------------------------------------------------
    def dense_grid(self, s: int) -> np.ndarray:
        """Ranks of stage s for dense parameters: [dp * cp, tp]."""
        g = self._grids.get(("dense", s))
        if g is None:
            p = self.par
            g = np.arange(s * p.stage_size, (s + 1) * p.stage_size).reshape(p.dp * p.cp, p.tp)
            self._grids[("dense", s)] = g
        return g

    def expert_grid(self, s: int) -> np.ndarray:
        """Ranks of stage s for expert parameters: [edp, ep, etp]."""
        g = self._grids.get(("expert", s))
        if g is None:
            p = self.par
            g = np.arange(s * p.stage_size, (s + 1) * p.stage_size).reshape(
                p.expert_dp, p.ep, p.expert_tp)
            self._grids[("expert", s)] = g
        return g

    def _prefix(self, layer: int) -> str:
        return f"decoder.layers.{self.local_of[layer]}."

    # placement ---------------------------------------------------------------------------
    def _place(self, pc: Piece):
        d, par, k = self.d, self.par, pc.kind
        last = par.pp - 1
        if k == "embed":
            if d.tie and par.pp > 1:
                grid = np.stack([self.dense_grid(0), self.dense_grid(last)])
                lay = self._layout(grid, (Replicate(), Replicate(), Shard(0, self.vblock)))
                slots = {}
                for r in self.dense_grid(0).reshape(-1):
                    slots[int(r)] = Slot("embedding.word_embeddings.weight", dim=0)
                for r in self.dense_grid(last).reshape(-1):
                    slots[int(r)] = Slot("output_layer.weight", dim=0)
                return lay, self._table(slots)
            return self._same(self._shard(self.dense_grid(0), 0, self.vblock),
                              Slot("embedding.word_embeddings.weight", dim=0))
        if k == "lm_head":
            return self._same(self._shard(self.dense_grid(last), 0, self.vblock),
                              Slot("output_layer.weight", dim=0))
        if k == "final_norm":
            return self._same(self._rep(self.dense_grid(last)), Slot("decoder.final_layernorm.weight"))

        s = self.stage_of[pc.layer]
        P = self._prefix(pc.layer)
        grid = self.dense_grid(s)
        A = P + "self_attention."
        if k == "in_norm":
            name = "input_layernorm.weight" if d.mla else "self_attention.linear_qkv.layer_norm_weight"
            return self._same(self._rep(grid), Slot(P + name))
        if k == "post_norm":
            name = "pre_mlp_layernorm.weight" if d.is_moe(pc.layer) else "mlp.linear_fc1.layer_norm_weight"
            return self._same(self._rep(grid), Slot(P + name))
        if k in ("q", "k", "v"):
            hd, qpg = d.head_dim, d.heads_per_group
            per_group = (qpg + 2) * hd
            within = {"q": 0, "k": qpg * hd, "v": (qpg + 1) * hd}[k]
            store = A + "linear_qkv." + ("bias" if pc.bias else "weight")
            if pc.group is None:
                if self.groups_local != 1:
                    raise AssertionError("whole q/k/v piece with several groups per rank")
                return self._same(self._shard(grid, 0), Slot(store, dim=0, offset=within))
            t, j = divmod(pc.group, self.groups_local)
            return self._same(self._rep(grid[:, t]), Slot(store, dim=0, offset=j * per_group + within))
        if k in ("q_norm", "k_norm"):
            return self._same(self._rep(grid), Slot(A + ("q_layernorm" if k == "q_norm" else "k_layernorm") + ".weight"))
        if k == "o":
            if pc.bias:
                return self._same(self._rep(grid), Slot(A + "linear_proj.bias"))
            return self._same(self._shard(grid, 1), Slot(A + "linear_proj.weight"))
        if k in ("gate", "up", "sh_gate", "sh_up"):
            shared = k.startswith("sh_")
            size = d.shared_intermediate if shared else d.intermediate
            store = P + ("mlp.shared_experts.linear_fc1.weight" if shared else "mlp.linear_fc1.weight")
            off = 0 if k.endswith("gate") else size // par.tp
            return self._same(self._shard(grid, 0), Slot(store, dim=0, offset=off))
        if k in ("down", "sh_down"):
            store = P + ("mlp.shared_experts.linear_fc2.weight" if k == "sh_down" else "mlp.linear_fc2.weight")
            return self._same(self._shard(grid, 1), Slot(store))
        if k == "router":
            return self._same(self._rep(grid), Slot(P + "mlp.router.weight"))
        if k == "router_bias":
            return self._same(self._rep(grid), Slot(P + "mlp.router.expert_bias"))
        if k in ("e_gate", "e_up", "e_down"):
            return self._place_expert(pc, s, P)
        # MLA
        if k == "q_a":
            return self._same(self._rep(grid), Slot(A + "linear_q_down_proj.weight"))
        if k == "q_a_norm":
            return self._same(self._rep(grid), Slot(A + "linear_q_up_proj.layer_norm_weight"))
        if k == "q_b":
            return self._same(self._shard(grid, 0), Slot(A + "linear_q_up_proj.weight"))
        if k == "q_full":
            return self._same(self._shard(grid, 0), Slot(A + "linear_q_proj.weight"))
        if k == "kv_a":
            return self._same(self._rep(grid), Slot(A + "linear_kv_down_proj.weight"))
        if k == "kv_a_norm":
            return self._same(self._rep(grid), Slot(A + "linear_kv_up_proj.layer_norm_weight"))
        if k == "kv_b":
            return self._same(self._shard(grid, 0), Slot(A + "linear_kv_up_proj.weight"))
        raise ValueError(f"Megatron: no placement for piece kind {k!r} ({pc.name})")

    def _expert_store(self, P: str, fc: str, i: int) -> tuple[str, tuple[int, ...]]:
        fmt = self.par.experts
        if fmt == "grouped":
            return f"{P}mlp.experts.{fc}.weight{i}", ()
        if fmt == "sequential":
            return f"{P}mlp.experts.local_experts.{i}.{fc}.weight", ()
        return f"{P}mlp.experts.{fc}.weight", (i,)

    def _place_expert(self, pc: Piece, s: int, P: str):
        par, k = self.par, pc.kind
        etp = par.expert_tp
        grid = self.expert_grid(s)                # [edp, ep, etp]
        fc = "linear_fc2" if k == "e_down" else "linear_fc1"
        off = self.d.moe_intermediate // etp if k == "e_up" else 0
        if pc.expert is None:
            if par.experts != "stacked":
                raise AssertionError("stacked expert piece on a per-expert storage")
            tdim = 2 if k == "e_down" else 1
            lay = self._layout(grid, (Replicate(), Shard(0), Shard(tdim)))
            slot = Slot(f"{P}mlp.experts.{fc}.weight") if k == "e_down" else \
                Slot(f"{P}mlp.experts.{fc}.weight", dim=1, offset=off)
            return self._same(lay, slot)
        p, i = divmod(pc.expert, self.experts_local)
        lay = self._layout(grid[:, p, :], (Replicate(), Shard(1 if k == "e_down" else 0)))
        store, index = self._expert_store(P, fc, i)
        slot = Slot(store, index) if k == "e_down" else Slot(store, index, dim=0, offset=off)
        return self._same(lay, slot)

    # storages ----------------------------------------------------------------------------
    def storages(self, rank: int) -> dict[str, StorageDecl]:
        d, par = self.d, self.par
        if not 0 <= rank < par.world:
            raise ValueError(f"Megatron rank {rank} out of range 0..{par.world - 1}")
        s = rank // par.stage_size
        tp, H = par.tp, d.hidden
        out: dict[str, StorageDecl] = {}
        if s == 0:
            out["embedding.word_embeddings.weight"] = StorageDecl((self.vblock, H))
        first = sum(self.stage_layers[:s])
        for l in range(first, first + self.stage_layers[s]):
            P = self._prefix(l)
            A = P + "self_attention."
            if d.mla:
                nh = d.heads // tp
                out[P + "input_layernorm.weight"] = StorageDecl((H,))
                if d.q_lora_rank is not None:
                    out[A + "linear_q_down_proj.weight"] = StorageDecl((d.q_lora_rank, H))
                    out[A + "linear_q_up_proj.layer_norm_weight"] = StorageDecl((d.q_lora_rank,))
                    out[A + "linear_q_up_proj.weight"] = StorageDecl((nh * d.qk_head_dim, d.q_lora_rank))
                else:
                    out[A + "linear_q_proj.weight"] = StorageDecl((nh * d.qk_head_dim, H))
                out[A + "linear_kv_down_proj.weight"] = StorageDecl((d.kv_lora_rank + d.qk_rope_dim, H))
                out[A + "linear_kv_up_proj.layer_norm_weight"] = StorageDecl((d.kv_lora_rank,))
                out[A + "linear_kv_up_proj.weight"] = StorageDecl(
                    (nh * (d.qk_nope_dim + d.v_head_dim), d.kv_lora_rank))
                out[A + "linear_proj.weight"] = StorageDecl((H, nh * d.v_head_dim))
            else:
                hd = d.head_dim
                rows = self.groups_local * (d.heads_per_group + 2) * hd
                out[A + "linear_qkv.layer_norm_weight"] = StorageDecl((H,))
                out[A + "linear_qkv.weight"] = StorageDecl((rows, H))
                if d.qkv_bias:
                    out[A + "linear_qkv.bias"] = StorageDecl((rows,))
                if d.qk_norm:
                    out[A + "q_layernorm.weight"] = StorageDecl((hd,))
                    out[A + "k_layernorm.weight"] = StorageDecl((hd,))
                out[A + "linear_proj.weight"] = StorageDecl((H, d.heads * hd // tp))
                if d.o_bias:
                    out[A + "linear_proj.bias"] = StorageDecl((H,))
            if d.is_moe(l):
                E, El, etp = d.experts, self.experts_local, par.expert_tp
                Ie = d.moe_intermediate // etp
                out[P + "pre_mlp_layernorm.weight"] = StorageDecl((H,))
                out[P + "mlp.router.weight"] = StorageDecl((E, H))
                if d.router_bias:
                    out[P + "mlp.router.expert_bias"] = StorageDecl((E,), fp32=True)
                if par.experts == "stacked":
                    out[P + "mlp.experts.linear_fc1.weight"] = StorageDecl((El, 2 * Ie, H))
                    out[P + "mlp.experts.linear_fc2.weight"] = StorageDecl((El, H, Ie))
                else:
                    for i in range(El):
                        out[self._expert_store(P, "linear_fc1", i)[0]] = StorageDecl((2 * Ie, H))
                        out[self._expert_store(P, "linear_fc2", i)[0]] = StorageDecl((H, Ie))
                if d.shared_intermediate:
                    Is = d.shared_intermediate // tp
                    out[P + "mlp.shared_experts.linear_fc1.weight"] = StorageDecl((2 * Is, H))
                    out[P + "mlp.shared_experts.linear_fc2.weight"] = StorageDecl((H, Is))
            else:
                I = d.intermediate // tp
                out[P + "mlp.linear_fc1.layer_norm_weight"] = StorageDecl((H,))
                out[P + "mlp.linear_fc1.weight"] = StorageDecl((2 * I, H))
                out[P + "mlp.linear_fc2.weight"] = StorageDecl((H, I))
        if s == par.pp - 1:
            out["decoder.final_layernorm.weight"] = StorageDecl((H,))
            if not d.tie or par.pp > 1:
                out["output_layer.weight"] = StorageDecl((self.vblock, H))
        return out


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------

class VLLMSide(Side):
    name = "vllm"

    def __init__(self, dims: ModelDims, par: VLLM):
        super().__init__(dims)
        d, self.par = dims, par
        tp = par.tp
        self.stage_layers = split_layers(d.layers, par.pp, par.layers_per_stage, "vllm")
        self.stage_of = [s for s, n in enumerate(self.stage_layers) for _ in range(n)]
        self.vocab_padded = -(-d.vocab // par.vocab_padding) * par.vocab_padding
        self.vblock = _div(self.vocab_padded, tp, "vLLM: padded vocab / tp")
        self.heads_local = _div(d.heads, tp, "vLLM: attention heads / tp")
        if not d.mla:
            nkv = d.kv_heads
            if nkv >= tp:
                _div(nkv, tp, "vLLM: kv heads / tp")
            else:
                _div(tp, nkv, "vLLM: tp / kv heads")
            self.kv_local = max(1, nkv // tp)
        if d.intermediate and any(not d.is_moe(l) for l in range(d.layers)):
            _div(d.intermediate, tp, "vLLM: intermediate_size / tp")
        if d.moe_layers:
            if par.ep > 1:
                self.experts_local = _div(d.experts, par.ep, "vLLM: experts / ep")
                self.expert_inter = d.moe_intermediate
            else:
                self.experts_local = d.experts
                self.expert_inter = _div(d.moe_intermediate, tp, "vLLM: moe_intermediate_size / tp")
            if d.shared_intermediate:
                _div(d.shared_intermediate, tp, "vLLM: shared experts' intermediate / tp")

    @property
    def n_ranks(self) -> int:
        return self.par.world

    def grid(self, p: int) -> np.ndarray:
        """Ranks of pipeline stage p: [dp, tp]."""
        g = self._grids.get(p)
        if g is None:
            par = self.par
            base = np.arange(par.dp)[:, None] * (par.pp * par.tp) + p * par.tp
            g = self._grids[p] = base + np.arange(par.tp)[None, :]
        return g

    def _place(self, pc: Piece):
        d, par, k = self.d, self.par, pc.kind
        last = par.pp - 1
        tp = par.tp
        if k == "embed":
            grid = self.grid(0)
            if d.tie and par.pp > 1:
                grid = np.concatenate([grid, self.grid(last)])
            return self._same(self._shard(grid, 0, self.vblock), Slot("model.embed_tokens.weight", dim=0))
        if k == "lm_head":
            return self._same(self._shard(self.grid(last), 0, self.vblock), Slot("lm_head.weight", dim=0))
        if k == "final_norm":
            return self._same(self._rep(self.grid(last)), Slot("model.norm.weight"))
        grid = self.grid(self.stage_of[pc.layer])
        P = f"model.layers.{pc.layer}."
        A = P + "self_attn."
        if k == "in_norm":
            return self._same(self._rep(grid), Slot(P + "input_layernorm.weight"))
        if k == "post_norm":
            return self._same(self._rep(grid), Slot(P + "post_attention_layernorm.weight"))
        if k in ("q", "k", "v"):
            return self._place_qkv(pc, grid, A)
        if k in ("q_norm", "k_norm"):
            return self._same(self._rep(grid), Slot(A + k + ".weight"))
        if k == "o":
            if pc.bias:
                return self._same(self._rep(grid), Slot(A + "o_proj.bias"))
            return self._same(self._shard(grid, 1), Slot(A + "o_proj.weight"))
        if k in ("gate", "up", "sh_gate", "sh_up"):
            shared = k.startswith("sh_")
            size = d.shared_intermediate if shared else d.intermediate
            store = P + ("mlp.shared_experts.gate_up_proj.weight" if shared else "mlp.gate_up_proj.weight")
            off = 0 if k.endswith("gate") else size // tp
            return self._same(self._shard(grid, 0), Slot(store, dim=0, offset=off))
        if k in ("down", "sh_down"):
            store = P + ("mlp.shared_experts.down_proj.weight" if k == "sh_down" else "mlp.down_proj.weight")
            return self._same(self._shard(grid, 1), Slot(store))
        if k == "router":
            return self._same(self._rep(grid), Slot(P + "mlp.gate.weight"))
        if k == "router_bias":
            return self._same(self._rep(grid), Slot(P + "mlp.gate.e_score_correction_bias"))
        if k in ("e_gate", "e_up", "e_down"):
            return self._place_expert(pc, grid, P)
        # MLA
        if k == "q_a":
            return self._same(self._rep(grid), Slot(A + "fused_qkv_a_proj.weight", dim=0, offset=0))
        if k == "kv_a":
            if d.q_lora_rank is not None:
                return self._same(self._rep(grid), Slot(A + "fused_qkv_a_proj.weight", dim=0,
                                                   offset=d.q_lora_rank))
            return self._same(self._rep(grid), Slot(A + "kv_a_proj_with_mqa.weight"))
        if k == "q_a_norm":
            return self._same(self._rep(grid), Slot(A + "q_a_layernorm.weight"))
        if k == "q_b":
            return self._same(self._shard(grid, 0), Slot(A + "q_b_proj.weight"))
        if k == "q_full":
            return self._same(self._shard(grid, 0), Slot(A + "q_proj.weight"))
        if k == "kv_a_norm":
            return self._same(self._rep(grid), Slot(A + "kv_a_layernorm.weight"))
        if k == "kv_b":
            return self._same(self._shard(grid, 0), Slot(A + "kv_b_proj.weight"))
        raise ValueError(f"vLLM: no placement for piece kind {k!r} ({pc.name})")

    def _place_qkv(self, pc: Piece, grid: np.ndarray, A: str):
        d, tp, k = self.d, self.par.tp, pc.kind
        hd, qpg, nkv = d.head_dim, d.heads_per_group, d.kv_heads
        q_local, kv_local = self.heads_local * hd, self.kv_local * hd
        store = A + "qkv_proj." + ("bias" if pc.bias else "weight")
        base = {"q": 0, "k": q_local, "v": q_local + kv_local}[k]
        if pc.group is None:
            if k == "q" or tp <= nkv:
                return self._same(self._shard(grid, 0), Slot(store, dim=0, offset=base))
            r = tp // nkv              # ranks sharing one kv head
            lay = self._layout(grid.reshape(grid.shape[0], nkv, r), (Replicate(), Shard(0), Replicate()))
            return self._same(lay, Slot(store, dim=0, offset=base))
        g = pc.group
        if tp <= nkv:
            gv = nkv // tp             # groups per rank
            t, j = divmod(g, gv)
            step = qpg * hd if k == "q" else hd
            return self._same(self._rep(grid[:, t]), Slot(store, dim=0, offset=base + j * step))
        r = tp // nkv
        sub = grid[:, g * r:(g + 1) * r]
        lay = self._shard(sub, 0) if k == "q" else self._rep(sub)
        return self._same(lay, Slot(store, dim=0, offset=base))

    def _place_expert(self, pc: Piece, grid: np.ndarray, P: str):
        par, k = self.par, pc.kind
        w = P + "mlp.experts." + ("w2_weight" if k == "e_down" else "w13_weight")
        off = self.expert_inter if k == "e_up" else 0
        ep = par.ep > 1
        if pc.expert is None:
            tdim = 0 if ep else (2 if k == "e_down" else 1)
            slot = Slot(w) if k == "e_down" else Slot(w, dim=1, offset=off)
            return self._same(self._shard(grid, tdim), slot)
        if ep:
            t, i = divmod(pc.expert, self.experts_local)
            slot = Slot(w, (i,)) if k == "e_down" else Slot(w, (i,), dim=0, offset=off)
            return self._same(self._rep(grid[:, t]), slot)
        e = pc.expert
        slot = Slot(w, (e,)) if k == "e_down" else Slot(w, (e,), dim=0, offset=off)
        return self._same(self._shard(grid, 1 if k == "e_down" else 0), slot)

    def storages(self, rank: int) -> dict[str, StorageDecl]:
        d, par = self.d, self.par
        if not 0 <= rank < par.world:
            raise ValueError(f"vLLM rank {rank} out of range 0..{par.world - 1}")
        p = (rank // par.tp) % par.pp
        tp, H = par.tp, d.hidden
        out: dict[str, StorageDecl] = {}
        last = par.pp - 1
        if p == 0 or (d.tie and p == last):
            out["model.embed_tokens.weight"] = StorageDecl((self.vblock, H))
        first = sum(self.stage_layers[:p])
        for l in range(first, first + self.stage_layers[p]):
            P = f"model.layers.{l}."
            A = P + "self_attn."
            out[P + "input_layernorm.weight"] = StorageDecl((H,))
            if d.mla:
                nh = self.heads_local
                if d.q_lora_rank is not None:
                    out[A + "fused_qkv_a_proj.weight"] = StorageDecl(
                        (d.q_lora_rank + d.kv_lora_rank + d.qk_rope_dim, H))
                    out[A + "q_a_layernorm.weight"] = StorageDecl((d.q_lora_rank,))
                    out[A + "q_b_proj.weight"] = StorageDecl((nh * d.qk_head_dim, d.q_lora_rank))
                else:
                    out[A + "q_proj.weight"] = StorageDecl((nh * d.qk_head_dim, H))
                    out[A + "kv_a_proj_with_mqa.weight"] = StorageDecl((d.kv_lora_rank + d.qk_rope_dim, H))
                out[A + "kv_a_layernorm.weight"] = StorageDecl((d.kv_lora_rank,))
                out[A + "kv_b_proj.weight"] = StorageDecl((nh * (d.qk_nope_dim + d.v_head_dim), d.kv_lora_rank))
                out[A + "o_proj.weight"] = StorageDecl((H, nh * d.v_head_dim))
            else:
                hd = d.head_dim
                rows = (self.heads_local + 2 * self.kv_local) * hd
                out[A + "qkv_proj.weight"] = StorageDecl((rows, H))
                if d.qkv_bias:
                    out[A + "qkv_proj.bias"] = StorageDecl((rows,))
                out[A + "o_proj.weight"] = StorageDecl((H, self.heads_local * hd))
                if d.o_bias:
                    out[A + "o_proj.bias"] = StorageDecl((H,))
                if d.qk_norm:
                    out[A + "q_norm.weight"] = StorageDecl((hd,))
                    out[A + "k_norm.weight"] = StorageDecl((hd,))
            if d.is_moe(l):
                E, El, Ie = d.experts, self.experts_local, self.expert_inter
                out[P + "mlp.gate.weight"] = StorageDecl((E, H))
                if d.router_bias:
                    out[P + "mlp.gate.e_score_correction_bias"] = StorageDecl((E,), fp32=True)
                out[P + "mlp.experts.w13_weight"] = StorageDecl((El, 2 * Ie, H))
                out[P + "mlp.experts.w2_weight"] = StorageDecl((El, H, Ie))
                if d.shared_intermediate:
                    Is = d.shared_intermediate // tp
                    out[P + "mlp.shared_experts.gate_up_proj.weight"] = StorageDecl((2 * Is, H))
                    out[P + "mlp.shared_experts.down_proj.weight"] = StorageDecl((H, Is))
            else:
                I = d.intermediate // tp
                out[P + "mlp.gate_up_proj.weight"] = StorageDecl((2 * I, H))
                out[P + "mlp.down_proj.weight"] = StorageDecl((H, I))
            out[P + "post_attention_layernorm.weight"] = StorageDecl((H,))
        if p == last:
            out["model.norm.weight"] = StorageDecl((H,))
            if not d.tie:
                out["lm_head.weight"] = StorageDecl((self.vblock, H))
        return out


def make_side(dims: ModelDims, parallel) -> Side:
    if isinstance(parallel, Side):
        return parallel
    if isinstance(parallel, Megatron):
        return MegatronSide(dims, parallel)
    if isinstance(parallel, VLLM):
        return VLLMSide(dims, parallel)
    raise TypeError(f"parallel must be Megatron(...) or VLLM(...), got {type(parallel).__name__}")
