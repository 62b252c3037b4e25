"""FSDP2 (training side): trainers that shard a Hugging Face model with
``torch.distributed.fsdp.fully_shard``, keeping the HF parameter names.

Storages are the HF parameters' local shards (``torch.chunk`` of dim 0, HSDP replicas);
`fsdp_local_tensors(module)` gives a trainer's ``{hf_name: local shard}``. Where pieces of a
parameter lie, and which are refused: docs/engines.md (FSDP2: shards and pieces).
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch

from ...layout.slots import Slot
from ...models.config import ModelDims
from ...models.pieces import Piece, enumerate_pieces, is_mtp, resolve_hf_experts
from ...models.storage import EngineSide, StorageDecl, check_pos

# Pieces that are buffers in transformers' modules: FSDP2 leaves them whole on every rank.
BUFFER_KINDS = frozenset({"router_bias"})
# Module wrappers that insert a name component (activation checkpointing, torch.compile,
# FSDP1): dropped so names are the HF model's own.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class FSDP:
    """FSDP2 training layout on Hugging Face parameter names; see docs/engines.md (FSDP2).

    `shard`: ranks each parameter is cut over (dim 0, torch.chunk, FSDP2's default
    placement). `replicate`: HSDP replica groups (1: plain FSDP); ranks are
    ``replicate_index * shard + shard_index``. `hf_experts`: the HF naming of MoE experts
    the trainer's model uses: "fused" (transformers >= 5: ``mlp.experts.gate_up_proj`` /
    ``down_proj``, 3-d), "split" (transformers 4: ``mlp.experts.{e}.gate_proj.weight``...) or
    "auto" (the installed transformers'); give `refit_specs` / `local_state` the same.
    """

    shard: int
    replicate: int = 1
    hf_experts: str = "auto"

    def __post_init__(self):
        check_pos("FSDP shard", self.shard)
        check_pos("FSDP replicate", self.replicate)
        try:
            resolve_hf_experts(self.hf_experts)
        except ValueError as e:
            raise ValueError(f"FSDP {e}") from None

    @property
    def world(self) -> int:
        return self.replicate * self.shard

    def coords(self, rank: int) -> tuple[int, int]:
        """(replicate index, shard index) of `rank`."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or \
                not 0 <= rank < self.world:
            raise ValueError(f"FSDP rank must be an int in 0..{self.world - 1}, got {rank!r}")
        return divmod(int(rank), self.shard)

    def side(self, dims: ModelDims) -> "FSDPSide":
        return FSDPSide(dims, self)

    def __str__(self) -> str:
        if self.replicate > 1:
            return f"FSDP2 HSDP{self.replicate}x{self.shard}"
        return f"FSDP2 shard{self.shard}"


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk `index` of `n` elements cut by torch.chunk into `parts` (empty
    past the last chunk), as FSDP2 cuts dim 0."""
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n) - start


class FSDPSide(EngineSide):
    name = "fsdp"

    def __init__(self, dims: ModelDims, par: FSDP):
        super().__init__(dims)
        self.par = par
        self.hf_experts = resolve_hf_experts(par.hf_experts)
        self.grid = np.arange(par.world).reshape(par.replicate, par.shard)
        # HF name -> (full shape, whether FSDP2 shards it), in HF order
        self.params: dict[str, tuple[tuple[int, ...], bool]] = {}
        self.fp32: set[str] = set()
        for pc in enumerate_pieces(dims, split_groups=False, per_expert=False,
                                   hf_experts=self.hf_experts, mtp=False):
            shape = pc.shape
            if pc.name != pc.hf:        # fused experts' halves: the parameter is [E, 2I, H]
                shape = (shape[0], 2 * shape[1], shape[2])
            buffer = pc.kind in BUFFER_KINDS
            self.params.setdefault(pc.hf, (shape, not buffer and len(shape) > 0))
            if buffer:
                self.fp32.add(pc.hf)

    @property
    def n_ranks(self) -> int:
        return self.par.world

    def holds(self, pc: Piece) -> bool:
        # transformers' models have no multi-token prediction layers
        return not is_mtp(self.d, pc)

    def storages(self, rank: int) -> dict:
        _, j = self.par.coords(rank)
        out = {}
        for name, (shape, sharded) in self.params.items():
            if sharded:
                shape = (chunk_bounds(shape[0], self.par.shard, j)[1],) + shape[1:]
            out[name] = StorageDecl(shape, fp32=name in self.fp32)
        return out

    def _place(self, pc: Piece):
        got = self.params.get(pc.hf)
        if got is None:
            raise ValueError(
                f"FSDP(hf_experts={self.par.hf_experts!r}) has no parameter {pc.hf!r} (piece "
                f"{pc.name!r}): the recipe names experts differently; give refit_specs / "
                f"local_state the same hf_experts as FSDP")
        shape, sharded = got
        grid = self.grid
        if not sharded:
            return self._same(self._rep(grid), pc.hf_slot)
        S = self.par.shard
        size = -(-shape[0] // S)               # torch.chunk's chunk length
        if pc.index:                           # a position of dim 0: in one chunk
            j, local = divmod(pc.index[0], size)
            slot = Slot(pc.hf, (local,) + pc.index[1:], pc.dim, pc.offset)
            return self._same(self._rep(grid[:, j]), slot)
        if pc.dim != 0 or pc.shape[0] == shape[0]:
            # whole along dim 0 (the whole parameter, or a slice of another dim)
            return self._same(self._shard(grid, 0), pc.hf_slot)
        return self._place_rows(pc, shape, size)

    def _place_rows(self, pc: Piece, shape: tuple[int, ...], size: int):
        """A piece of rows [a, a + n) of dim 0."""
        a, n, S = pc.offset, pc.shape[0], self.par.shard
        grid = self.grid
        if n == 0:
            return self._same(self._rep(grid[:, 0]), Slot(pc.hf, (), 0, 0))
        first, last = a // size, (a + n - 1) // size
        skip = a - first * size                # rows of the first chunk before the piece
        if first == last:
            return self._same(self._rep(grid[:, first]), Slot(pc.hf, (), 0, skip))
        cols = grid[:, first:last + 1]
        if skip == 0:                          # chunk-aligned: cut in blocks of a chunk
            return self._same(self._shard(cols, 0, size), Slot(pc.hf, (), 0, 0))
        head = size - skip                     # the piece's rows in its first chunk
        if last == first + 1 and n - head <= head:
            slots = {}
            for r in cols[:, 0]:
                slots[int(r)] = Slot(pc.hf, (), 0, skip)
            for r in cols[:, 1]:
                slots[int(r)] = Slot(pc.hf, (), 0, 0)
            return self._shard(cols, 0, head), self._table(slots)
        rest = f"chunk {last}" if last == first + 1 else f"chunks {first + 1}..{last}"
        raise ValueError(
            f"FSDP: piece {pc.name!r} is rows {a}..{a + n - 1} of {pc.hf!r} (shape {shape}); "
            f"shard={S} cuts that parameter in chunks of {size} rows, so the piece has {head} "
            f"rows in chunk {first} and {n - head} more in {rest}. One layout describes a "
            f"piece of rows only when it lies in one chunk, starts a chunk, or spans two chunks "
            f"with its part in the first at least as long. (Pieces of rows are q/k/v cut per "
            f"query group for a Megatron side holding several groups per tensor-parallel rank: "
            f"choose a shard count whose chunks start at group boundaries.)")


def _hf_name(name: str) -> str:
    for p in WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def fsdp_local_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{hf_name: local tensor}`` of a module sharded with FSDP2: each parameter's local shard
    (``DTensor.to_local()``; plain tensors as they are), then buffers not named already (whole:
    FSDP2 does not shard them). Tensors are detached views of the trainer's own memory, so a
    refit reads (or, as a destination, writes) the parameters in place; look them up anew at
    every refit, as FSDP2 may swap storages. Wrapper name components (activation
    checkpointing, torch.compile, FSDP1) are dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out[_hf_name(name)] = t.detach()
    for name, b in module.named_buffers():
        t = b.to_local() if hasattr(b, "to_local") else b
        out.setdefault(_hf_name(name), t.detach())
    return out
