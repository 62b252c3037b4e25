"""Megatron-core (training side): the parallel configuration, its rank numbering and where a
rank keeps each piece.

Ranks in Megatron's default order ``tp-cp-ep-dp-pp``; pipeline splits as Megatron builds them,
virtual pipeline chunks named ``model{c}.``; storage names of Megatron-core's GPT model with the
Transformer Engine layer spec, MTP layers included.
Details: docs/engines.md (Megatron: ranks, stages and names).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ...layout.placement import Replicate, Shard
from ...layout.slots import Slot, Slots
from ...models.config import ModelDims
from ...models.pieces import Piece, is_mtp
from ...models.storage import EngineSide, StorageDecl, Stores, check_counts, check_pos, div


@dataclass(frozen=True)
class Megatron:
    """Megatron-core training layout; rank numbering and splits: docs/engines.md (Megatron).

    `experts` chooses how a rank stores its local experts:
    ``"grouped"``: TEGroupedMLP, ``mlp.experts.linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``
    per local expert i; ``"sequential"``: SequentialMLP,
    ``mlp.experts.local_experts.{i}.linear_fc1.weight``; ``"stacked"``: one tensor per layer,
    ``mlp.experts.linear_fc1.weight`` of shape [E_local, 2*I/etp, H] and
    ``mlp.experts.linear_fc2.weight`` [E_local, H, I/etp] (a convenience layout, e.g. for a
    trainer that keeps experts stacked; it is not the transposed legacy GroupedMLP layout).
    `vocab_divisible_by` is Megatron's make_vocab_size_divisible_by (padded vocab is a
    multiple of it times tp). `vpp`: virtual pipeline model chunks per rank. `mtp`: the trainer
    holds the config's num_nextn_predict_layers multi-token prediction layers.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    dp: int = 1
    cp: int = 1
    layers_per_stage: Optional[Sequence[int]] = None
    experts: str = "grouped"
    vocab_divisible_by: int = 128
    vpp: int = 1
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    mtp: bool = False

    def __post_init__(self):
        for n in ("tp", "pp", "ep", "dp", "cp", "vocab_divisible_by", "vpp"):
            check_pos(n, getattr(self, n))
        if self.etp is not None:
            check_pos("etp", self.etp)
        for n in ("first_stage_layers", "last_stage_layers"):
            v = getattr(self, n)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                  or v < 0):
                raise ValueError(f"Megatron: {n} must be a non-negative int, got {v!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("Megatron: a virtual pipeline (vpp > 1) needs pp > 1")
        if self.experts not in ("grouped", "sequential", "stacked"):
            raise ValueError(f"experts must be 'grouped', 'sequential' or 'stacked', "
                             f"got {self.experts!r}")
        if self.layers_per_stage is not None:
            if self.first_stage_layers is not None or self.last_stage_layers is not None:
                raise ValueError("Megatron: give layers_per_stage or first/last_stage_layers, "
                                 "not both")
            object.__setattr__(self, "layers_per_stage", tuple(int(x) for x in self.layers_per_stage))
        if self.stage_size % (self.expert_tp * self.ep):
            raise ValueError(f"Megatron: tp*cp*dp = {self.stage_size} ranks per stage is not a "
                             f"multiple of etp*ep = {self.expert_tp * self.ep}")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def stage_size(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.stage_size // (self.expert_tp * self.ep)

    @property
    def world(self) -> int:
        return self.pp * self.stage_size

    def side(self, dims: ModelDims) -> "MegatronSide":
        return MegatronSide(dims, self)

    def virtual_stage_layers(self, n_layers: int) -> list[int]:
        """Layers per virtual stage ``v = chunk*pp + stage`` (vpp=1: per stage), as Megatron
        splits them; raises for a split Megatron refuses."""
        pp, vpp = self.pp, self.vpp
        if self.layers_per_stage is not None:
            return list(check_counts(self.layers_per_stage, pp * vpp, n_layers,
                                     "Megatron layers_per_stage (one count per virtual stage)"))
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            if n_layers % pp:
                raise ValueError(
                    f"Megatron: {n_layers} layers are not divisible by pp={pp}; give "
                    f"first_stage_layers and/or last_stage_layers (num_layers_in_first/last_"
                    f"pipeline_stage) or layers_per_stage")
            stages = [n_layers // pp] * pp
        else:
            given = (first is not None) + (last is not None)
            if given > pp or (pp == 1 and given):
                raise ValueError(f"Megatron: first/last_stage_layers need pp > 1 (pp={pp})")
            middle_stages = pp - given
            middle = n_layers - (first or 0) - (last or 0)
            if middle < 0 or (middle_stages == 0 and middle) or \
                    (middle_stages and middle % middle_stages):
                raise ValueError(
                    f"Megatron: {n_layers} layers minus first_stage_layers={first} and "
                    f"last_stage_layers={last} leave {middle}, not divisible over the "
                    f"{middle_stages} other stages")
            per = middle // middle_stages if middle_stages else 0
            stages = ([first] if first is not None else []) + [per] * middle_stages + \
                ([last] if last is not None else [])
        if vpp > 1:
            for s, n in enumerate(stages):
                if n % vpp:
                    raise ValueError(f"Megatron: stage {s} has {n} layers, not divisible by "
                                     f"vpp={vpp} model chunks")
        return [stages[s] // vpp for _ in range(vpp) for s in range(pp)]

    def __str__(self) -> str:
        parts = [f"TP{self.tp}"]
        for n, v in (("CP", self.cp), ("PP", self.pp), ("VPP", self.vpp), ("EP", self.ep),
                     ("DP", self.dp)):
            if v > 1:
                parts.append(f"{n}{v}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"ETP{self.etp}")
        return "Megatron " + "x".join(parts)


class MegatronSide(EngineSide):
    name = "megatron"

    def __init__(self, dims: ModelDims, par: Megatron):
        super().__init__(dims)
        d, self.par = dims, par
        tp = par.tp
        if par.mtp and not d.mtp_layers:
            raise ValueError("Megatron(mtp=True): the config has no num_nextn_predict_layers")
        if par.mtp and d.tie:
            raise NotImplementedError("Megatron MTP with tied embeddings is not supported")
        self.virtual_layers = par.virtual_stage_layers(d.layers)
        # layer -> (stage, chunk, local index)
        self.where: list[tuple[int, int, int]] = []
        for v, n in enumerate(self.virtual_layers):
            c, s = divmod(v, par.pp)
            self.where += [(s, c, i) for i in range(n)]
        self.vocab_padded = -(-d.vocab // (par.vocab_divisible_by * tp)) * par.vocab_divisible_by * tp
        self.vblock = self.vocab_padded // tp
        if not d.mla:
            ng = d.query_groups
            if ng % tp:
                raise ValueError(f"Megatron: {ng} query groups (kv heads) are not divisible by "
                                 f"tp={tp}")
            self.groups_local = ng // tp
            self.needs_group_split = self.groups_local > 1
        else:
            div(d.heads, tp, "Megatron: attention heads / tp")
        if d.intermediate and any(not d.is_moe(l) for l in range(d.layers)):
            div(d.intermediate, tp, "Megatron: intermediate_size / tp")
        if d.moe_layers:
            self.experts_local = div(d.experts, par.ep, "Megatron: experts / ep")
            div(d.moe_intermediate, par.expert_tp, "Megatron: moe_intermediate_size / etp")
            if d.shared_intermediate:
                div(d.shared_intermediate, tp, "Megatron: shared experts' intermediate / tp")
            self.needs_expert_split = par.experts != "stacked"
        if par.mtp:
            div(d.hidden, tp, "Megatron: MTP eh_proj rows (hidden_size) / tp")

    @property
    def n_ranks(self) -> int:
        return self.par.world

    def holds(self, pc: Piece) -> bool:
        return self.par.mtp or not is_mtp(self.d, pc)

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

    # stores ------------------------------------------------------------------------------
    def _chunk(self, c: int) -> str:
        return f"model{c}." if self.par.vpp > 1 else ""

    def _stage_of(self, layer: int) -> int:
        return self.par.pp - 1 if layer >= self.d.layers else self.where[layer][0]

    def layers_of(self, rank: int) -> list[int]:
        s = rank // self.par.stage_size
        out = [l for l, (st, _, _) in enumerate(self.where) if st == s]
        if self.par.mtp and s == self.par.pp - 1:
            out += list(range(self.d.layers, self.d.layers + self.d.mtp_layers))
        return out

    def global_stores(self, rank: Optional[int]) -> Stores:
        d, par, H = self.d, self.par, self.d.hidden
        s = None if rank is None else rank // par.stage_size
        first, last = self._chunk(0), self._chunk(par.vpp - 1)
        vocab = StorageDecl((self.vblock, H))
        out: Stores = {}
        if s is None or s == 0:
            out["embed"] = (first + "embedding.word_embeddings.weight", vocab)
        if s is None or s == par.pp - 1:
            if par.mtp and par.pp > 1:      # the MTP stage keeps its own embedding copy
                out["mtp_embed"] = (last + "embedding.word_embeddings.weight", vocab)
            out["final_norm"] = (last + "decoder.final_layernorm.weight", StorageDecl((H,)))
            if not d.tie or par.pp > 1:
                out["head"] = (last + "output_layer.weight", vocab)
        return out

    def layer_stores(self, layer: int, rank: Optional[int]) -> Stores:
        d, par, H = self.d, self.par, self.d.hidden
        tp = par.tp
        out: Stores = {}

        def put(role, name, *shape, fp32=False):
            out[role] = (name, StorageDecl(tuple(shape), fp32))

        if layer >= d.layers:
            M = f"{self._chunk(par.vpp - 1)}mtp.layers.{layer - d.layers}."
            put("mtp_enorm", M + "enorm.weight", H)
            put("mtp_hnorm", M + "hnorm.weight", H)
            put("mtp_eh", M + "eh_proj.weight", H // tp, 2 * H)
            put("mtp_norm", M + "final_layernorm.weight", H)
            P = M + "mtp_model_layer."
        else:
            _, c, i = self.where[layer]
            P = f"{self._chunk(c)}decoder.layers.{i}."
        A = P + "self_attention."
        if d.mla:
            nh = d.heads // tp
            put("in_norm", P + "input_layernorm.weight", H)
            if d.q_lora_rank is not None:
                put("q_a", A + "linear_q_down_proj.weight", d.q_lora_rank, H)
                put("q_a_norm", A + "linear_q_up_proj.layer_norm_weight", d.q_lora_rank)
                put("q_b", A + "linear_q_up_proj.weight", nh * d.qk_head_dim, d.q_lora_rank)
            else:
                put("q_full", A + "linear_q_proj.weight", nh * d.qk_head_dim, H)
            put("kv_a", A + "linear_kv_down_proj.weight", d.kv_lora_rank + d.qk_rope_dim, H)
            put("kv_a_norm", A + "linear_kv_up_proj.layer_norm_weight", d.kv_lora_rank)
            put("kv_b", A + "linear_kv_up_proj.weight", nh * (d.qk_nope_dim + d.v_head_dim),
                d.kv_lora_rank)
            put("o_w", A + "linear_proj.weight", H, nh * d.v_head_dim)
        else:
            hd = d.head_dim
            rows = self.groups_local * (d.heads_per_group + 2) * hd
            put("in_norm", A + "linear_qkv.layer_norm_weight", H)
            put("qkv_w", A + "linear_qkv.weight", rows, H)
            if d.qkv_bias:
                put("qkv_b", A + "linear_qkv.bias", rows)
            if d.qk_norm:
                put("q_norm", A + "q_layernorm.weight", hd)
                put("k_norm", A + "k_layernorm.weight", hd)
            put("o_w", A + "linear_proj.weight", H, d.heads * hd // tp)
            if d.o_bias:
                put("o_b", A + "linear_proj.bias", H)
        if d.is_moe(layer):
            E, El, etp = d.experts, self.experts_local, par.expert_tp
            Ie = d.moe_intermediate // etp
            put("post_norm", P + "pre_mlp_layernorm.weight", H)
            put("router", P + "mlp.router.weight", E, H)
            if d.router_bias:
                put("router_bias", P + "mlp.router.expert_bias", E, fp32=True)
            X = P + "mlp.experts."
            if par.experts == "stacked":
                put(("e_fc1", None), X + "linear_fc1.weight", El, 2 * Ie, H)
                put(("e_fc2", None), X + "linear_fc2.weight", El, H, Ie)
            else:
                for i in range(El):
                    if par.experts == "grouped":
                        n1, n2 = f"{X}linear_fc1.weight{i}", f"{X}linear_fc2.weight{i}"
                    else:
                        n1 = f"{X}local_experts.{i}.linear_fc1.weight"
                        n2 = f"{X}local_experts.{i}.linear_fc2.weight"
                    put(("e_fc1", i), n1, 2 * Ie, H)
                    put(("e_fc2", i), n2, H, Ie)
            if d.shared_intermediate:
                Is = d.shared_intermediate // tp
                put("sh_fc1", P + "mlp.shared_experts.linear_fc1.weight", 2 * Is, H)
                put("sh_fc2", P + "mlp.shared_experts.linear_fc2.weight", H, Is)
        else:
            I = d.intermediate // tp
            put("post_norm", P + "mlp.linear_fc1.layer_norm_weight", H)
            put("fc1", P + "mlp.linear_fc1.weight", 2 * I, H)
            put("fc2", P + "mlp.linear_fc2.weight", H, I)
        return out

    # placement ---------------------------------------------------------------------------
    def _place(self, pc: Piece):
        d, par, k = self.d, self.par, pc.kind
        if k in ("e_gate", "e_up", "e_down"):       # most pieces of a MoE model: first
            return self._place_expert(pc, self._stage_of(pc.layer))
        last = par.pp - 1
        g = self.store_name
        if k == "embed":
            extra = [("mtp_embed", last)] if par.mtp and par.pp > 1 else []
            if d.tie and par.pp > 1:
                extra.append(("head", last))
            if extra:
                grid = np.stack([self.dense_grid(0)] + [self.dense_grid(s) for _, s in extra])
                lay = self._layout(grid, (Replicate(), Replicate(), Shard(0, self.vblock)))
                slots = {int(r): Slot(g("embed"), dim=0) for r in self.dense_grid(0).reshape(-1)}
                for role, s in extra:
                    for r in self.dense_grid(s).reshape(-1):
                        slots[int(r)] = Slot(g(role), dim=0)
                return lay, self._table(slots)
            return self._same(self._shard(self.dense_grid(0), 0, self.vblock), Slot(g("embed"), dim=0))
        if k == "lm_head":
            return self._same(self._shard(self.dense_grid(last), 0, self.vblock), Slot(g("head"), dim=0))
        if k == "final_norm":
            return self._same(self._rep(self.dense_grid(last)), Slot(g("final_norm")))

        l = pc.layer
        s = self._stage_of(l)
        grid = self.dense_grid(s)

        def n(role):
            return g(role, l)

        if k in ("in_norm", "post_norm", "q_norm", "k_norm", "router", "router_bias", "q_a",
                 "q_a_norm", "kv_a", "kv_a_norm", "mtp_enorm", "mtp_hnorm", "mtp_norm"):
            return self._same(self._rep(grid), Slot(n(k)))
        if k in ("q_b", "q_full", "kv_b", "mtp_eh"):
            return self._same(self._shard(grid, 0), Slot(n(k)))
        if k in ("q", "k", "v"):
            hd, qpg = d.head_dim, d.heads_per_group
            per_group = (qpg + 2) * hd
            within = {"q": 0, "k": qpg * hd, "v": (qpg + 1) * hd}[k]
            store = n("qkv_b" if pc.bias else "qkv_w")
            if pc.group is None:
                if self.groups_local != 1:
                    raise AssertionError("whole q/k/v piece with several groups per rank")
                return self._same(self._shard(grid, 0), Slot(store, dim=0, offset=within))
            t, j = divmod(pc.group, self.groups_local)
            return self._same(self._rep(grid[:, t]), Slot(store, dim=0, offset=j * per_group + within))
        if k == "o":
            if pc.bias:
                return self._same(self._rep(grid), Slot(n("o_b")))
            return self._same(self._shard(grid, 1), Slot(n("o_w")))
        if k in ("gate", "up", "sh_gate", "sh_up"):
            shared = k.startswith("sh_")
            size = d.shared_intermediate if shared else d.intermediate
            off = 0 if k.endswith("gate") else size // par.tp
            return self._same(self._shard(grid, 0), Slot(n("sh_fc1" if shared else "fc1"), dim=0, offset=off))
        if k in ("down", "sh_down"):
            return self._same(self._shard(grid, 1), Slot(n("sh_fc2" if k == "sh_down" else "fc2")))
        raise ValueError(f"Megatron: no placement for piece kind {k!r} ({pc.name})")

    def _place_expert(self, pc: Piece, s: int):
        par, k = self.par, pc.kind
        if pc.expert is None:
            fc = "e_fc2" if k == "e_down" else "e_fc1"
            off = self.d.moe_intermediate // par.expert_tp if k == "e_up" else 0
            if par.experts != "stacked":
                raise AssertionError("stacked expert piece on a per-expert storage")
            store = self.store_name((fc, None), pc.layer)
            lay = self._layout(self.expert_grid(s),          # [edp, ep, etp]
                               (Replicate(), Shard(0), Shard(2 if k == "e_down" else 1)))
            return self._same(lay, Slot(store) if k == "e_down" else Slot(store, dim=1, offset=off))
        return self._expert_rule(pc.layer, k)(pc.expert)

    def _expert_rule(self, layer: int, k: str):
        par, s = self.par, self._stage_of(layer)
        fc = "e_fc2" if k == "e_down" else "e_fc1"
        off = self.d.moe_intermediate // par.expert_tp if k == "e_up" else 0
        tdim = 1 if k == "e_down" else 0
        per_rank, layouts = self.experts_local, self._expert_layouts
        stacked = self.store_name((fc, None), layer) if par.experts == "stacked" else None
        placed: dict = {}             # EP rank -> (layout, its ranks), for this rule's calls
        slots: dict = {}              # local expert -> Slot

        def one(expert: int):
            p, i = divmod(expert, per_rank)
            got = placed.get(p)
            if got is None:
                # one layout per (stage, EP rank, sharded dim), shared by its experts of every layer
                lay = layouts.get((s, p, tdim))
                if lay is None:
                    lay = layouts[(s, p, tdim)] = self._shard(self.expert_grid(s)[:, p, :], tdim)
                got = placed[p] = (lay, self._sorted_ranks(lay))
            slot = slots.get(i)       # the same local position on every EP rank
            if slot is None:
                if stacked is not None:
                    store, index = stacked, (i,)
                else:
                    store, index = self.store_name((fc, i), layer), ()
                slot = slots[i] = Slot(store, index) if k == "e_down" else \
                    Slot(store, index, dim=0, offset=off)
            return got[0], Slots(got[1], slot)
        return one


def fill_dp(fields: dict) -> dict:
    """An omitted dp: the smallest that fits ep * etp into each stage."""
    if "dp" in fields:
        return fields
    per_stage = fields.get("tp", 1) * fields.get("cp", 1)
    expert = fields.get("ep", 1) * fields.get("etp", fields.get("tp", 1))
    return {**fields, "dp": expert // math.gcd(per_stage, expert)}
