"""Logical pieces: the tensors a refit moves, each a Hugging Face parameter or a contiguous
sub-block of one.

A piece is named after its HF parameter. Most pieces are whole HF parameters and keep the HF
name exactly. A parameter is cut into sub-pieces only where some rank keeps its shard of the
parameter in several separate places of its storage, which one Slot cannot describe:

* ``...q_proj.weight@g3`` (and k/v, weights and biases): query group 3 of q/k/v, used only when
  a Megatron side holds more than one query group per tensor-parallel rank (its linear_qkv
  interleaves [q_g; k_g; v_g] group by group);
* fused HF experts (transformers >= 5 keeps ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``mlp.experts.down_proj`` [E, H, I]): ``gate_up_proj@gate`` / ``@up`` (the two halves,
  [E, I, H]) and, when a side stores each expert in its own tensor (Megatron grouped or
  sequential experts), ``gate_up_proj@e5.gate`` / ``@e5.up`` / ``down_proj@e5``.

Each piece records where it lies in its HF parameter as a Slot (index/dim/offset), the same
form the core uses for storages, so cutting a piece out of a state dict and writing it back are
`piece.hf_slot.view(full, piece.shape)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..layout.slots import Slot
from .config import ModelDims


@dataclass(frozen=True, init=False)
class Piece:
    name: str
    hf: str
    shape: tuple[int, ...]
    kind: str
    layer: Optional[int] = None
    group: Optional[int] = None      # query group (q/k/v pieces cut per group)
    expert: Optional[int] = None     # expert index (per-expert pieces); None: all experts
    bias: bool = False
    index: tuple[int, ...] = ()
    dim: Optional[int] = None
    offset: int = 0

    def __init__(self, name: str, hf: str, shape: tuple[int, ...], kind: str,
                 layer: Optional[int] = None, group: Optional[int] = None,
                 expert: Optional[int] = None, bias: bool = False, index: tuple[int, ...] = (),
                 dim: Optional[int] = None, offset: int = 0):
        # One dict update instead of a frozen dataclass's setattr per field: a large MoE model
        # has tens of thousands of pieces.
        self.__dict__.update(name=name, hf=hf, shape=shape, kind=kind, layer=layer, group=group,
                             expert=expert, bias=bias, index=index, dim=dim, offset=offset)

    @property
    def hf_slot(self) -> Slot:
        return Slot(self.hf, self.index, self.dim, self.offset)


def resolve_hf_experts(hf_experts: str) -> str:
    """"fused" (transformers >= 5 module layout), "split" (checkpoint files, transformers 4:
    one 2-d tensor per expert and projection) or "auto" (what the installed transformers uses;
    "split" without transformers)."""
    if hf_experts in ("fused", "split"):
        return hf_experts
    if hf_experts != "auto":
        raise ValueError(f"hf_experts must be 'auto', 'fused' or 'split', got {hf_experts!r}")
    try:
        import transformers
        major = int(transformers.__version__.split(".")[0])
    except Exception:
        return "split"
    return "fused" if major >= 5 else "split"


def enumerate_pieces(d: ModelDims, *, split_groups: bool, per_expert: bool,
                     hf_experts: str, mtp: bool = False) -> list[Piece]:
    """All pieces of the model, in HF state-dict order; with `mtp`, then the multi-token
    prediction layers under their checkpoint names (``model.layers.{num_hidden_layers + j}``:
    enorm, hnorm, eh_proj, shared_head.norm and a decoder layer; the MTP embedding and head are
    the model's own ``model.embed_tokens.weight`` / ``lm_head.weight`` pieces)."""
    out: list[Piece] = []
    H = d.hidden

    def add(name, shape, kind, layer=None, hf=None, **kw):
        out.append(Piece(name, hf or name, tuple(shape), kind, layer, **kw))

    def layer(l):
        p = f"model.layers.{l}."
        add(p + "input_layernorm.weight", (H,), "in_norm", l)
        if d.mla:
            a = p + "self_attn."
            nh = d.heads
            if d.q_lora_rank is not None:
                add(a + "q_a_proj.weight", (d.q_lora_rank, H), "q_a", l)
                add(a + "q_a_layernorm.weight", (d.q_lora_rank,), "q_a_norm", l)
                add(a + "q_b_proj.weight", (nh * d.qk_head_dim, d.q_lora_rank), "q_b", l)
            else:
                add(a + "q_proj.weight", (nh * d.qk_head_dim, H), "q_full", l)
            add(a + "kv_a_proj_with_mqa.weight", (d.kv_lora_rank + d.qk_rope_dim, H), "kv_a", l)
            add(a + "kv_a_layernorm.weight", (d.kv_lora_rank,), "kv_a_norm", l)
            add(a + "kv_b_proj.weight", (nh * (d.qk_nope_dim + d.v_head_dim), d.kv_lora_rank),
                "kv_b", l)
            add(a + "o_proj.weight", (H, nh * d.v_head_dim), "o", l)
        else:
            ng, hd = d.query_groups, d.head_dim
            rows = {"q": d.heads_per_group * hd, "k": hd, "v": hd}
            for which in ("q", "k", "v"):
                for bias in ((False, True) if d.qkv_bias else (False,)):
                    hf = p + f"self_attn.{which}_proj." + ("bias" if bias else "weight")
                    tail = () if bias else (H,)
                    r = rows[which]
                    if split_groups:
                        for g in range(ng):
                            add(f"{hf}@g{g}", (r,) + tail, which, l, hf=hf, group=g, bias=bias,
                                dim=0, offset=g * r)
                    else:
                        add(hf, (ng * r,) + tail, which, l, bias=bias)
            add(p + "self_attn.o_proj.weight", (H, d.heads * hd), "o", l)
            if d.o_bias:
                add(p + "self_attn.o_proj.bias", (H,), "o", l, bias=True)
            if d.qk_norm:
                add(p + "self_attn.q_norm.weight", (hd,), "q_norm", l)
                add(p + "self_attn.k_norm.weight", (hd,), "k_norm", l)
        if d.is_moe(l):
            m = p + "mlp."
            E, I = d.experts, d.moe_intermediate
            if hf_experts == "split":
                for e in range(E):
                    x = f"{m}experts.{e}."
                    add(x + "gate_proj.weight", (I, H), "e_gate", l, expert=e)
                    add(x + "up_proj.weight", (I, H), "e_up", l, expert=e)
                    add(x + "down_proj.weight", (H, I), "e_down", l, expert=e)
            else:
                gu, dn = m + "experts.gate_up_proj", m + "experts.down_proj"
                if per_expert:
                    for e in range(E):
                        add(f"{gu}@e{e}.gate", (I, H), "e_gate", l, hf=gu, expert=e, index=(e,),
                            dim=0, offset=0)
                        add(f"{gu}@e{e}.up", (I, H), "e_up", l, hf=gu, expert=e, index=(e,),
                            dim=0, offset=I)
                        add(f"{dn}@e{e}", (H, I), "e_down", l, hf=dn, expert=e, index=(e,))
                else:
                    add(gu + "@gate", (E, I, H), "e_gate", l, hf=gu, dim=1, offset=0)
                    add(gu + "@up", (E, I, H), "e_up", l, hf=gu, dim=1, offset=I)
                    add(dn, (E, H, I), "e_down", l)
            add(m + "gate.weight", (E, H), "router", l)
            if d.router_bias:
                add(m + "gate.e_score_correction_bias", (E,), "router_bias", l)
            if d.shared_intermediate:
                S = d.shared_intermediate
                add(m + "shared_experts.gate_proj.weight", (S, H), "sh_gate", l)
                add(m + "shared_experts.up_proj.weight", (S, H), "sh_up", l)
                add(m + "shared_experts.down_proj.weight", (H, S), "sh_down", l)
        else:
            I = d.intermediate
            add(p + "mlp.gate_proj.weight", (I, H), "gate", l)
            add(p + "mlp.up_proj.weight", (I, H), "up", l)
            add(p + "mlp.down_proj.weight", (H, I), "down", l)
        add(p + "post_attention_layernorm.weight", (H,), "post_norm", l)

    add("model.embed_tokens.weight", (d.vocab, H), "embed")
    for l in range(d.layers):
        layer(l)
    add("model.norm.weight", (H,), "final_norm")
    if not d.tie:
        add("lm_head.weight", (d.vocab, H), "lm_head")
    if mtp:
        for l in range(d.layers, d.layers + d.mtp_layers):
            p = f"model.layers.{l}."
            add(p + "enorm.weight", (H,), "mtp_enorm", l)
            add(p + "hnorm.weight", (H,), "mtp_hnorm", l)
            add(p + "eh_proj.weight", (H, 2 * H), "mtp_eh", l)
            layer(l)
            add(p + "shared_head.norm.weight", (H,), "mtp_norm", l)
    return out


def is_mtp(d: ModelDims, pc: Piece) -> bool:
    """Whether the piece belongs to a multi-token prediction layer."""
    return pc.layer is not None and pc.layer >= d.layers


def hf_shapes(d: ModelDims, hf_experts: str, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Shape of every HF parameter the pieces cover (tied lm_head excluded; MTP layers only
    with `mtp`)."""
    out: dict[str, tuple[int, ...]] = {}
    for pc in enumerate_pieces(d, split_groups=False, per_expert=False, hf_experts=hf_experts,
                               mtp=mtp):
        if pc.hf == pc.name:
            out[pc.hf] = pc.shape
        elif pc.dim == 1 and pc.kind in ("e_gate", "e_up"):
            out[pc.hf] = (pc.shape[0], 2 * pc.shape[1], pc.shape[2])
    return out
