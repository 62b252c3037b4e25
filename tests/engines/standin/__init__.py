"""A stand-in inference engine, written as a new engine is: one folder with its layout. It keeps
every Hugging Face parameter under its own name, whole, on each of its `replicas` ranks."""
from dataclasses import dataclass

import numpy as np

from ray_reshard.models.pieces import Piece
from ray_reshard.models.storage import EngineSide, StorageDecl, check_pos


@dataclass(frozen=True)
class StandIn:
    replicas: int = 1

    def __post_init__(self):
        check_pos("StandIn replicas", self.replicas)

    @property
    def world(self) -> int:
        return self.replicas

    def side(self, dims):
        return StandInSide(dims, self)

    def __str__(self) -> str:
        return f"StandIn x{self.replicas}"


class StandInSide(EngineSide):
    name = "standin"

    def __init__(self, dims, par: StandIn):
        super().__init__(dims)
        self.par = par
        self.grid = np.arange(par.replicas)
        from ray_reshard.models.pieces import enumerate_pieces
        self.params = {}
        for pc in enumerate_pieces(dims, split_groups=False, per_expert=False,
                                   hf_experts="split", mtp=False):
            self.params.setdefault(pc.hf, pc)

    @property
    def n_ranks(self) -> int:
        return self.par.replicas

    def holds(self, pc: Piece) -> bool:
        return pc.hf in self.params

    def storages(self, rank: int) -> dict:
        from ray_reshard.models import hf_parameter_shapes
        shapes = hf_parameter_shapes(self.d, hf_experts="split")
        return {n: StorageDecl(tuple(shapes[n])) for n in self.params}

    def _place(self, pc: Piece):
        return self._same(self._rep(self.grid), pc.hf_slot)
