"""vLLM (inference side): the parallel configuration, its rank numbering and where a rank keeps
each piece.

Ranks in vLLM's order (data parallel outer, then pipeline, tensor inner), ``engine_dp`` dp ranks
per engine, MoE layers over an engine's ``engine_dp * tp`` ranks with or without expert
parallelism; storage names of vLLM's model classes, block FP8 and the DeepSeek MTP draft model.
Details: docs/engines.md (vLLM: ranks, experts and names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ...layout.placement import Replicate, Shard
from ...layout.quant import BlockFP8
from ...layout.slots import Slot, Slots
from ...models.config import ModelDims
from ...models.pieces import Piece, is_mtp
from ...models.storage import EngineSide, StorageDecl, Stores, check_counts, check_pos, div

PLACEMENTS = ("linear", "round_robin")
QUANTIZATIONS = (None, "fp8")
# Stores vLLM's FP8 methods keep as block FP8, and the piece kinds stored in them.
FP8_ROLES = frozenset({"qkv_w", "o_w", "gate_up", "down", "sh_gate_up", "sh_down", "w13", "w2",
                       "q_a", "kv_a", "q_b", "q_full", "kv_b"})
FP8_KINDS = frozenset({"q", "k", "v", "o", "gate", "up", "down", "sh_gate", "sh_up", "sh_down",
                       "e_gate", "e_up", "e_down", "q_a", "kv_a", "q_b", "q_full", "kv_b"})


def parse_version(version: str) -> tuple[int, int]:
    try:
        major, minor = str(version).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        raise ValueError(f"vLLM version must look like '0.33' or '0.33.0', got {version!r}") from None


def split_layers(n_layers: int, pp: int, given: Optional[Sequence[int]]) -> list[int]:
    """Layers per vLLM pipeline stage: `given`, or vLLM's default partition (the extra layers
    on the stages just before the last)."""
    if given is not None:
        return list(check_counts(given, pp, n_layers, "vLLM layers_per_stage"))
    base, extra = divmod(n_layers, pp)
    out = [base] * pp
    for i in range(2, extra + 2):
        out[-i] += 1
    return out


@dataclass(frozen=True)
class VLLM:
    """vLLM inference layout; rank numbering and names: docs/engines.md (vLLM).

    `dp` data-parallel ranks in groups of `engine_dp` per engine (default: ep // tp when
    ep > tp, else 1); `ep` is 1 or engine_dp * tp. `vocab_padding` is vLLM's
    DEFAULT_VOCAB_PADDING_SIZE. `expert_placement` is vLLM's expert_placement_strategy.
    `version` picks names that changed between vLLM versions. `model` is "main" or "mtp"
    (the DeepSeek MTP draft model). `quantization="fp8"`: block FP8 of `weight_block_size`
    (see docs/engines.md).
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    layers_per_stage: Optional[Sequence[int]] = None
    vocab_padding: int = 64
    engine_dp: Optional[int] = None
    expert_placement: str = "linear"
    version: str = "0.33"
    model: str = "main"
    quantization: Optional[str] = None
    weight_block_size: Sequence[int] = (128, 128)

    def __post_init__(self):
        for n in ("tp", "dp", "pp", "ep", "vocab_padding"):
            check_pos(n, getattr(self, n))
        if self.engine_dp is None:
            edp = self.ep // self.tp if self.ep > self.tp and self.ep % self.tp == 0 else 1
            object.__setattr__(self, "engine_dp", edp)
        check_pos("engine_dp", self.engine_dp)
        if self.dp % self.engine_dp:
            raise ValueError(f"vLLM dp={self.dp} is not a multiple of engine_dp={self.engine_dp}")
        if self.ep not in (1, self.moe_ranks):
            raise ValueError(f"vLLM ep must be 1 or engine_dp*tp = {self.moe_ranks} "
                             f"(enable_expert_parallel spans an engine's dp x tp ranks), got "
                             f"{self.ep}")
        if self.expert_placement not in PLACEMENTS:
            raise ValueError(f"vLLM expert_placement must be one of {PLACEMENTS}, got "
                             f"{self.expert_placement!r}")
        parse_version(self.version)
        if self.model not in ("main", "mtp"):
            raise ValueError(f"vLLM model must be 'main' or 'mtp', got {self.model!r}")
        if self.model == "mtp" and self.pp != 1:
            raise ValueError("vLLM MTP draft model: pp must be 1")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(int(x) for x in self.layers_per_stage))
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"vLLM quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        object.__setattr__(self, "weight_block_size", tuple(self.weight_block_size))
        BlockFP8(self.weight_block_size)          # checks it

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def engines(self) -> int:
        return self.dp // self.engine_dp

    @property
    def moe_ranks(self) -> int:
        """Ranks one MoE layer is spread over inside an engine (engine_dp * tp)."""
        return self.engine_dp * self.tp

    @property
    def sequence_parallel_moe(self) -> bool:
        """vLLM's use_sequence_parallel_moe (default all-to-all backend): shared experts are
        then replicated instead of tensor-parallel."""
        return self.ep > 1 and self.tp > 1 and self.engine_dp > 1

    @property
    def routed_experts_naming(self) -> bool:
        return parse_version(self.version) >= (0, 32)

    def local_experts(self, n_experts: int, ep_rank: int) -> list[int]:
        """Global expert ids on `ep_rank` in local order (vLLM's determine_expert_map)."""
        if self.ep == 1:
            return list(range(n_experts))
        base, rem = divmod(n_experts, self.ep)
        n = base + (1 if ep_rank < rem else 0)
        if self.expert_placement == "linear":
            start = ep_rank * base + min(ep_rank, rem)
            return list(range(start, start + n))
        return list(range(ep_rank, n_experts, self.ep))

    def side(self, dims: ModelDims) -> "VLLMSide":
        return VLLMSide(dims, self)

    def __str__(self) -> str:
        parts = [f"TP{self.tp}"]
        for n, v in (("PP", self.pp), ("DP", self.dp)):
            if v > 1:
                parts.append(f"{n}{v}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        s = "vLLM " + "x".join(parts)
        if self.engine_dp > 1:
            s += f" ({self.engines} engine{'s' if self.engines > 1 else ''})"
        s += " FP8" if self.quantization == "fp8" else ""
        return s + (" MTP draft" if self.model == "mtp" else "")


FP8_BLOCK_RULE = ("vLLM's validate_fp8_block_shape: with tp > 1 every partition of a block-FP8 "
                  "weight must be a multiple of the block; at tp 1 only the last part of a "
                  "merged weight may be ragged")


def fp8_linears(d: ModelDims, par: VLLM) -> list:
    """vLLM's block-FP8 linear layers of one decoder layer as (name, tp size, input size,
    input size per partition, output size, output partition sizes)."""
    tp, H = par.tp, d.hidden
    out = []

    def column(name, t, k, parts):        # (Merged/QKV) column-parallel over t ranks
        out.append((name, t, k, k, sum(parts) * t, list(parts)))

    def row(name, t, k, n):               # row-parallel over t ranks
        out.append((name, t, k, k // t, n, [n]))

    if d.mla:
        nh = d.heads // tp
        if d.q_lora_rank is not None:
            column("fused_qkv_a_proj", 1, H, [d.q_lora_rank, d.kv_lora_rank + d.qk_rope_dim])
            column("q_b_proj", tp, d.q_lora_rank, [nh * (d.qk_nope_dim + d.qk_rope_dim)])
        else:
            column("q_proj", tp, H, [nh * (d.qk_nope_dim + d.qk_rope_dim)])
        column("kv_b_proj", tp, d.kv_lora_rank, [nh * (d.qk_nope_dim + d.v_head_dim)])
        row("o_proj", tp, d.heads * d.v_head_dim, H)
    else:
        hd = d.head_dim
        kv = max(1, d.kv_heads // tp) * hd
        column("qkv_proj", tp, H, [d.heads // tp * hd, kv, kv])
        row("o_proj", tp, d.heads * hd, H)
    if d.intermediate and any(not d.is_moe(l) for l in range(d.layers)):
        column("mlp.gate_up_proj", tp, H, [d.intermediate // tp] * 2)
        row("mlp.down_proj", tp, d.intermediate, H)
    if d.moe_layers and d.shared_intermediate:
        t = 1 if par.sequence_parallel_moe else tp
        column("mlp.shared_experts.gate_up_proj", t, H, [d.shared_intermediate // t] * 2)
        row("mlp.shared_experts.down_proj", t, d.shared_intermediate, H)
    return out


def check_fp8_blocks(d: ModelDims, par: VLLM, block: Sequence[int],
                     expert_inter: Optional[int]) -> None:
    """Refuse what vLLM refuses when it builds block-FP8 layers (the same rule as its
    validate_fp8_block_shape), and routed experts whose per-partition intermediate size is not
    a multiple of the block (vLLM pads or refines their scale grid; a refit does not)."""
    bn, bk = block
    for name, t, k, k_part, n, parts in fp8_linears(d, par):
        where = f"vLLM FP8 {name} ({par}, weight_block_size {bn}x{bk})"
        if t > 1 and k // k_part == t and k_part % bk:
            raise ValueError(f"{where}: input size per partition {k_part} is not a multiple of "
                             f"block_k={bk}; {FP8_BLOCK_RULE}")
        tp_split = t > 1 and n // sum(parts) == t
        if tp_split or len(parts) > 1:
            for i, size in enumerate(parts if tp_split else parts[:-1]):
                if size % bn:
                    raise ValueError(f"{where}: output partition {i} of {parts} has {size} rows, "
                                     f"not a multiple of block_n={bn}; {FP8_BLOCK_RULE}")
    if d.moe_layers and expert_inter is not None and (expert_inter % bn or expert_inter % bk):
        raise ValueError(
            f"vLLM FP8 routed experts ({par}, weight_block_size {bn}x{bk}): intermediate size "
            f"per partition {expert_inter} is not a multiple of the block; vLLM pads or refines "
            f"the scale grid of such experts, which a refit does not reproduce, so it is refused")


class VLLMSide(EngineSide):
    name = "vllm"

    def __init__(self, dims: ModelDims, par: VLLM):
        super().__init__(dims)
        d, self.par = dims, par
        tp = par.tp
        self.fp8 = BlockFP8(par.weight_block_size) if par.quantization == "fp8" else None
        self.mtp = par.model == "mtp"
        if self.mtp:
            if not d.mtp_layers:
                raise ValueError("vLLM MTP draft model: the config has no num_nextn_predict_layers")
            if d.mtp_layers != 1:
                raise NotImplementedError("vLLM MTP draft model: only one MTP layer is supported "
                                          f"(config has {d.mtp_layers})")
            if d.tie:
                raise NotImplementedError("vLLM MTP draft model with tied embeddings is not supported")
            self.stage_layers = [d.mtp_layers]
        else:
            self.stage_layers = split_layers(d.layers, par.pp, par.layers_per_stage)
        self.stage_of = [s for s, n in enumerate(self.stage_layers) for _ in range(n)]
        self.vocab_padded = -(-d.vocab // par.vocab_padding) * par.vocab_padding
        self.vblock = div(self.vocab_padded, tp, "vLLM: padded vocab / tp")
        self.heads_local = div(d.heads, tp, "vLLM: attention heads / tp")
        if not d.mla:
            nkv = d.kv_heads
            if nkv >= tp:
                div(nkv, tp, "vLLM: kv heads / tp")
            else:
                div(tp, nkv, "vLLM: tp / kv heads")
            self.kv_local = max(1, nkv // tp)
        if d.intermediate and any(not d.is_moe(l) for l in range(d.layers)):
            div(d.intermediate, tp, "vLLM: intermediate_size / tp")
        if d.moe_layers:
            E = d.experts
            if par.ep > 1:
                if E < par.ep:
                    raise ValueError(f"vLLM: {E} experts over ep={par.ep} ranks leaves ranks "
                                     f"without experts")
                self.expert_inter = d.moe_intermediate
                self.needs_expert_split = bool(E % par.ep) or par.expert_placement != "linear"
                self.owner = {}
                for r in range(par.ep):
                    for i, e in enumerate(par.local_experts(E, r)):
                        self.owner[e] = (r, i)
            else:
                self.expert_inter = div(d.moe_intermediate, par.moe_ranks,
                                        "vLLM: moe_intermediate_size / (engine_dp * tp)")
            if d.shared_intermediate and not par.sequence_parallel_moe:
                div(d.shared_intermediate, tp, "vLLM: shared experts' intermediate / tp")
        if self.fp8 is not None:
            check_fp8_blocks(d, par, self.fp8.block, getattr(self, "expert_inter", None))

    @property
    def n_ranks(self) -> int:
        return self.par.world

    def quant_of(self, pc: Piece):
        if self.fp8 is None or pc.bias or pc.kind not in FP8_KINDS:
            return None
        return self.fp8

    def holds(self, pc: Piece) -> bool:
        if self.mtp:
            return is_mtp(self.d, pc) or pc.kind in ("embed", "lm_head")
        return not is_mtp(self.d, pc)

    def grid(self, p: int) -> np.ndarray:
        """Ranks of pipeline stage p: [dp, tp]."""
        g = self._grids.get(p)
        if g is None:
            par = self.par
            base = np.arange(par.dp)[:, None] * (par.pp * par.tp) + p * par.tp
            g = self._grids[p] = base + np.arange(par.tp)[None, :]
        return g

    def expert_grid(self, p: int) -> np.ndarray:
        """Ranks of stage p for routed experts: [engines, engine_dp * tp] (flat MoE index)."""
        return self.grid(p).reshape(self.par.engines, self.par.moe_ranks)

    def _moe_rank(self, rank: int) -> int:
        par = self.par
        return (rank // (par.pp * par.tp)) % par.engine_dp * par.tp + rank % par.tp

    # stores ------------------------------------------------------------------------------
    def layers_of(self, rank: int) -> list[int]:
        if self.mtp:
            return list(range(self.d.layers, self.d.layers + self.d.mtp_layers))
        p = (rank // self.par.tp) % self.par.pp
        first = sum(self.stage_layers[:p])
        return list(range(first, first + self.stage_layers[p]))

    def global_stores(self, rank: Optional[int]) -> Stores:
        d, par, H = self.d, self.par, self.d.hidden
        p = None if rank is None else (rank // par.tp) % par.pp
        last = par.pp - 1
        vocab = StorageDecl((self.vblock, H))
        out: Stores = {}
        if self.mtp:
            out["embed"] = ("model.embed_tokens.weight", vocab)
            out["head"] = (f"model.layers.{d.layers}.shared_head.head.weight", vocab)
            return out
        if p is None or p == 0 or (d.tie and p == last):
            out["embed"] = ("model.embed_tokens.weight", vocab)
        if p is None or p == last:
            out["final_norm"] = ("model.norm.weight", StorageDecl((H,)))
            if not d.tie:
                out["head"] = ("lm_head.weight", vocab)
        return out

    def layer_stores(self, layer: int, rank: Optional[int]) -> Stores:
        d, par, H = self.d, self.par, self.d.hidden
        tp = par.tp
        out: Stores = {}

        fp8 = self.fp8

        def put(role, name, *shape, fp32=False):
            if fp8 is not None and role in FP8_ROLES:
                out[role] = (name, StorageDecl(tuple(shape), fp8=True))
                out[role + "_scale"] = (fp8.scale_storage(name),
                                        StorageDecl(fp8.scale_shape(shape), fp32=True))
                return
            out[role] = (name, StorageDecl(tuple(shape), fp32))

        P = f"model.layers.{layer}."
        if layer >= d.layers:
            put("mtp_enorm", P + "enorm.weight", H)
            put("mtp_hnorm", P + "hnorm.weight", H)
            put("mtp_eh", P + "eh_proj.weight", H, 2 * H)
            put("mtp_norm", P + "shared_head.norm.weight", H)
            P += "mtp_block."
        A = P + "self_attn."
        put("in_norm", P + "input_layernorm.weight", H)
        if d.mla:
            nh = self.heads_local
            if d.q_lora_rank is not None:
                put("q_a", A + "fused_qkv_a_proj.weight",
                    d.q_lora_rank + d.kv_lora_rank + d.qk_rope_dim, H)
                put("q_a_norm", A + "q_a_layernorm.weight", d.q_lora_rank)
                put("q_b", A + "q_b_proj.weight", nh * d.qk_head_dim, d.q_lora_rank)
            else:
                put("q_full", A + "q_proj.weight", nh * d.qk_head_dim, H)
                put("kv_a", A + "kv_a_proj_with_mqa.weight", d.kv_lora_rank + d.qk_rope_dim, H)
            put("kv_a_norm", A + "kv_a_layernorm.weight", d.kv_lora_rank)
            put("kv_b", A + "kv_b_proj.weight", nh * (d.qk_nope_dim + d.v_head_dim), d.kv_lora_rank)
            put("o_w", A + "o_proj.weight", H, nh * d.v_head_dim)
        else:
            hd = d.head_dim
            rows = (self.heads_local + 2 * self.kv_local) * hd
            put("qkv_w", A + "qkv_proj.weight", rows, H)
            if d.qkv_bias:
                put("qkv_b", A + "qkv_proj.bias", rows)
            put("o_w", A + "o_proj.weight", H, self.heads_local * hd)
            if d.o_bias:
                put("o_b", A + "o_proj.bias", H)
            if d.qk_norm:
                put("q_norm", A + "q_norm.weight", hd)
                put("k_norm", A + "k_norm.weight", hd)
        if d.is_moe(layer):
            E, Ie = d.experts, self.expert_inter
            if par.ep > 1:
                El = len(par.local_experts(E, self._moe_rank(rank))) if rank is not None else 0
            else:
                El = E
            put("router", P + "mlp.gate.weight", E, H)
            if d.router_bias:
                put("router_bias", P + "mlp.gate.e_score_correction_bias", E, fp32=True)
            X = P + ("mlp.experts.routed_experts." if par.routed_experts_naming else "mlp.experts.")
            put("w13", X + "w13_weight", El, 2 * Ie, H)
            put("w2", X + "w2_weight", El, H, Ie)
            if d.shared_intermediate:
                Is = d.shared_intermediate // (1 if par.sequence_parallel_moe else tp)
                put("sh_gate_up", P + "mlp.shared_experts.gate_up_proj.weight", 2 * Is, H)
                put("sh_down", P + "mlp.shared_experts.down_proj.weight", H, Is)
        else:
            I = d.intermediate // tp
            put("gate_up", P + "mlp.gate_up_proj.weight", 2 * I, H)
            put("down", P + "mlp.down_proj.weight", H, I)
        put("post_norm", P + "post_attention_layernorm.weight", H)
        return out

    # placement ---------------------------------------------------------------------------
    def _place(self, pc: Piece):
        d, par, k = self.d, self.par, pc.kind
        if k in ("e_gate", "e_up", "e_down"):       # most pieces of a MoE model: first
            l = pc.layer
            return self._place_expert(pc, self.stage_of[l - d.layers if self.mtp else l])
        last = par.pp - 1
        tp = par.tp
        g = self.store_name
        if k == "embed":
            grid = self.grid(0)
            if d.tie and par.pp > 1:
                grid = np.concatenate([grid, self.grid(last)])
            return self._same(self._shard(grid, 0, self.vblock), Slot(g("embed"), dim=0))
        if k == "lm_head":
            return self._same(self._shard(self.grid(last), 0, self.vblock), Slot(g("head"), dim=0))
        if k == "final_norm":
            return self._same(self._rep(self.grid(last)), Slot(g("final_norm")))
        l = pc.layer
        grid = self.grid(self.stage_of[l - d.layers if self.mtp else l])

        def n(role):
            return g(role, l)

        if k in ("in_norm", "post_norm", "q_norm", "k_norm", "router", "router_bias",
                 "q_a_norm", "kv_a_norm", "mtp_enorm", "mtp_hnorm", "mtp_norm", "mtp_eh"):
            return self._same(self._rep(grid), Slot(n(k)))
        if k in ("q", "k", "v"):
            return self._place_qkv(pc, grid, n("qkv_b" if pc.bias else "qkv_w"))
        if k == "o":
            if pc.bias:
                return self._same(self._rep(grid), Slot(n("o_b")))
            return self._same(self._shard(grid, 1), Slot(n("o_w")))
        if k in ("gate", "up"):
            off = 0 if k == "gate" else d.intermediate // tp
            return self._same(self._shard(grid, 0), Slot(n("gate_up"), dim=0, offset=off))
        if k == "down":
            return self._same(self._shard(grid, 1), Slot(n("down")))
        if k in ("sh_gate", "sh_up", "sh_down"):
            if par.sequence_parallel_moe:
                lay = self._rep(grid)
                off = 0 if k != "sh_up" else d.shared_intermediate
            else:
                lay = self._shard(grid, 1 if k == "sh_down" else 0)
                off = 0 if k != "sh_up" else d.shared_intermediate // tp
            if k == "sh_down":
                return self._same(lay, Slot(n("sh_down")))
            return self._same(lay, Slot(n("sh_gate_up"), dim=0, offset=off))
        # MLA
        if k == "q_a":
            return self._same(self._rep(grid), Slot(n("q_a"), dim=0, offset=0))
        if k == "kv_a":
            if d.q_lora_rank is not None:
                return self._same(self._rep(grid), Slot(n("q_a"), dim=0, offset=d.q_lora_rank))
            return self._same(self._rep(grid), Slot(n("kv_a")))
        if k in ("q_b", "q_full", "kv_b"):
            return self._same(self._shard(grid, 0), Slot(n(k)))
        raise ValueError(f"vLLM: no placement for piece kind {k!r} ({pc.name})")

    def _place_qkv(self, pc: Piece, grid: np.ndarray, store: str):
        d, tp, k = self.d, self.par.tp, pc.kind
        hd, qpg, nkv = d.head_dim, d.heads_per_group, d.kv_heads
        q_local, kv_local = self.heads_local * hd, self.kv_local * hd
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

    def _place_expert(self, pc: Piece, stage: int):
        if pc.expert is None:
            par, k = self.par, pc.kind
            w = self.store_name("w2" if k == "e_down" else "w13", pc.layer)
            off = self.expert_inter if k == "e_up" else 0
            if self.needs_expert_split:
                raise AssertionError("stacked expert piece on an uneven expert placement")
            tdim = 0 if par.ep > 1 else (2 if k == "e_down" else 1)
            slot = Slot(w) if k == "e_down" else Slot(w, dim=1, offset=off)
            return self._same(self._shard(self.expert_grid(stage), tdim), slot)
        return self._expert_rule(pc.layer, pc.kind)(pc.expert)

    def _expert_rule(self, layer: int, k: str):
        stage = self.stage_of[layer - self.d.layers if self.mtp else layer]
        w = self.store_name("w2" if k == "e_down" else "w13", layer)
        off = self.expert_inter if k == "e_up" else 0
        layouts = self._expert_layouts
        if self.par.ep > 1:
            owner = self.owner
            placed: dict = {}         # EP rank -> (layout, its ranks), for this rule's calls
            slots: dict = {}          # local expert -> Slot

            def one(expert: int):
                t, i = owner[expert]
                slot = slots.get(i)   # the same local position on every EP rank
                if slot is None:
                    slot = slots[i] = Slot(w, (i,)) if k == "e_down" else \
                        Slot(w, (i,), dim=0, offset=off)
                got = placed.get(t)
                if got is None:
                    # one layout per (stage, EP rank), shared by its experts of every layer
                    lay = layouts.get(("rep", stage, t))
                    if lay is None:
                        lay = layouts[("rep", stage, t)] = \
                            self._rep(self.expert_grid(stage)[:, t])
                    got = placed[t] = (lay, self._sorted_ranks(lay))
                return got[0], Slots(got[1], slot)
            return one
        tdim = 1 if k == "e_down" else 0
        # one layout per (stage, sharded dim), shared by every expert of the stage's layers
        lay = layouts.get(("shard", stage, tdim))
        if lay is None:
            lay = layouts[("shard", stage, tdim)] = self._shard(self.expert_grid(stage), tdim)
        ranks = self._sorted_ranks(lay)

        def one(expert: int):
            slot = Slot(w, (expert,)) if k == "e_down" else \
                Slot(w, (expert,), dim=0, offset=off)
            return lay, Slots(ranks, slot)
        return one
