"""Parallel configurations of the two engines and their rank numbering.

Megatron-LM / Megatron-core (training side)
-------------------------------------------
Ranks follow Megatron's default order ``tp-cp-ep-dp-pp`` (tp fastest, pp slowest). A pipeline
stage owns a contiguous block of ``S = tp * cp * dp`` ranks: stage ``s`` is ranks
``s*S .. (s+1)*S - 1``. Inside a stage:

* dense parameters (attention, dense MLP, norms, embeddings, router, shared experts):
  ``rank = s*S + (dp_rank * cp + cp_rank) * tp + tp_rank``; replicated over dp and cp;
* expert parameters: ``rank = s*S + (edp_rank * ep + ep_rank) * etp + etp_rank`` with
  ``edp = S / (etp * ep)`` (Megatron's expert rank generator, same order with cp folded in);
  experts are split over ep in contiguous ranges (expert ``e`` on ep rank ``e // (E/ep)``,
  local index ``e % (E/ep)``), their FFN dim over etp, replicated over edp.

Layers are split over stages in order (``layers_per_stage``; default: as even as possible,
earlier stages taking the extra layers). Storage names use the stage-local layer index
(``decoder.layers.{local}``), as Megatron's per-stage state dicts do.

vLLM (inference side)
---------------------
``dp`` independent engine replicas (each a full copy of the model), replica outer; inside an
engine pipeline stages outer, tensor parallel inner:
``rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank``. ``ep`` is the expert parallel size
inside one engine: 1 (experts tensor-parallel over tp, vLLM's default) or ``tp``
(``enable_expert_parallel``: expert tp is 1 and experts are split in contiguous ranges over
the tp ranks). Layers over vLLM pipeline stages follow vLLM's default partition (extra layers
on the stages before the last) unless ``layers_per_stage`` is given; storage names keep the
global layer index as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


def _check_pos(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class Megatron:
    """Megatron-core training layout. See the module docstring for the rank numbering.

    `experts` chooses how a rank stores its local experts:
    ``"grouped"``: TEGroupedMLP, ``mlp.experts.linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``
    per local expert i; ``"sequential"``: SequentialMLP,
    ``mlp.experts.local_experts.{i}.linear_fc1.weight``; ``"stacked"``: one tensor per layer,
    ``mlp.experts.linear_fc1.weight`` of shape [E_local, 2*I/etp, H] and
    ``mlp.experts.linear_fc2.weight`` [E_local, H, I/etp] (a convenience layout, e.g. for a
    trainer that keeps experts stacked; it is not the transposed legacy GroupedMLP layout).
    `vocab_divisible_by` is Megatron's make_vocab_size_divisible_by (padded vocab is a
    multiple of it times tp).
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

    def __post_init__(self):
        for n in ("tp", "pp", "ep", "dp", "cp", "vocab_divisible_by"):
            _check_pos(n, getattr(self, n))
        if self.etp is not None:
            _check_pos("etp", self.etp)
        if self.experts not in ("grouped", "sequential", "stacked"):
            raise ValueError(f"experts must be 'grouped', 'sequential' or 'stacked', "
                             f"got {self.experts!r}")
        if self.layers_per_stage is not None:
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

    def __str__(self) -> str:
        parts = [f"TP{self.tp}"]
        for n, v in (("CP", self.cp), ("PP", self.pp), ("EP", self.ep), ("DP", self.dp)):
            if v > 1:
                parts.append(f"{n}{v}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"ETP{self.etp}")
        return "Megatron " + "x".join(parts)


@dataclass(frozen=True)
class VLLM:
    """vLLM inference layout: `dp` engine replicas of TP `tp` x PP `pp`; `ep` is 1 or tp.

    `vocab_padding` is vLLM's DEFAULT_VOCAB_PADDING_SIZE (embedding and lm_head rows are padded
    to a multiple of it, then split in blocks of padded/tp rows).
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    layers_per_stage: Optional[Sequence[int]] = None
    vocab_padding: int = 64

    def __post_init__(self):
        for n in ("tp", "dp", "pp", "ep", "vocab_padding"):
            _check_pos(n, getattr(self, n))
        if self.ep not in (1, self.tp):
            raise ValueError(f"vLLM ep must be 1 or tp ({self.tp}) (enable_expert_parallel "
                             f"inside one engine), got {self.ep}")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(int(x) for x in self.layers_per_stage))

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        parts = [f"TP{self.tp}"]
        for n, v in (("PP", self.pp), ("DP", self.dp)):
            if v > 1:
                parts.append(f"{n}{v}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        return "vLLM " + "x".join(parts)


def split_layers(n_layers: int, pp: int, given: Optional[Sequence[int]], rule: str) -> list[int]:
    """Layers per pipeline stage. rule "front": extra layers on the first stages;
    "vllm": vLLM's default (extra layers on the stages just before the last)."""
    if given is not None:
        given = [int(x) for x in given]
        if len(given) != pp or sum(given) != n_layers or any(x < 0 for x in given):
            raise ValueError(f"layers_per_stage {given} must give {pp} non-negative counts "
                             f"summing to {n_layers}")
        return given
    base, extra = divmod(n_layers, pp)
    out = [base] * pp
    if rule == "front":
        for i in range(extra):
            out[i] += 1
    else:
        for i in range(2, extra + 2):
            out[-i] += 1
    return out
