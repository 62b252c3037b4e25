"""Filling new destination ranks from a replica (destination to destination), without Ray."""
from __future__ import annotations

import pytest
import torch

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.execution.reference import simulate_refit


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


def engines_specs():
    """Trainers TP2 -> engines DP2 x TP2 (ranks 0,1 | 2,3), one tensor in a fused storage."""
    train = L([0, 1], Shard(0))
    infer = L([[0, 1], [2, 3]], Replicate(), Shard(1), names=("dp", "tp"))
    fused = {r: rr.Slot("qkv", dim=0, offset=4) for r in range(4)}
    return {"w": rr.TensorSpec((8, 6), torch.float32, train, infer),
            "k": rr.TensorSpec((6, 4), torch.bfloat16, train, infer, src_dtype=torch.float32,
                               dst_slots=fused),
            "norm": rr.TensorSpec((6,), torch.float32, L([0, 1], Replicate()),
                                  L([[0, 1], [2, 3]], Replicate(), Replicate(),
                                    names=("dp", "tp")))}


def engine_storage(specs, fulls, rank):
    out = {}
    for n, s in specs.items():
        shard = rr.shard_tensor(fulls[n].to(s.dtype), s.dst, rank)
        slot = s.slot("dst", rank, n)
        if slot.storage == n:
            out[n] = shard.clone()
        else:                                # k lives in rows 4.. of a fused qkv storage
            out[slot.storage] = torch.cat([torch.full((4, shard.shape[1]), -1, dtype=s.dtype),
                                           shard])
    return out


def test_layout_replica_keeps_boxes_and_refuses_sharded_dims():
    lay = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    rep = lay.replica({"dp": 1})
    assert rep.mesh.ranks == (2, 3) and rep.placements == (Shard(0),)
    assert all(rep.box(r, (8, 4)) == lay.box(r, (8, 4)) for r in (2, 3))
    with pytest.raises(ValueError, match="'tp' is Shard.*not Replicate"):
        lay.replica({"tp": 0})
    with pytest.raises(ValueError, match="must be an int in 0..1"):
        lay.replica({"dp": 2})


@pytest.mark.parametrize("which", [{"dp": 0}, {"dp": 1}])
def test_new_engine_mirrors_a_replica_bit_exactly(which):
    specs = engines_specs()
    g = torch.Generator().manual_seed(0)
    fulls = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    engines = [engine_storage(specs, fulls, r) for r in range(4)]
    join, ranks = rr.replica_specs(specs, which)
    assert ranks == ([0, 1] if which["dp"] == 0 else [2, 3])
    new = [{k: torch.zeros_like(v) for k, v in engines[r].items()} for r in ranks]
    p = rr.plan(join, src_domains=["a", "a"], dst_domains=["b", "b"])
    simulate_refit(p, [engines[r] for r in ranks], new)
    for i, r in enumerate(ranks):
        for k, v in engines[r].items():
            if k == "qkv":
                assert torch.equal(new[i][k][4:], v[4:])      # the slot only
                assert torch.equal(new[i][k][:4], torch.zeros_like(v[:4]))
            else:
                assert torch.equal(new[i][k], v)
    # one pass per byte: the new engine receives exactly its shards
    assert p.stats.network_bytes == sum(s.nbytes for s in join.values())


def test_new_engine_with_another_layout():
    specs = {n: s for n, s in engines_specs().items() if n != "k"}
    g = torch.Generator().manual_seed(1)
    fulls = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    engines = [engine_storage(specs, fulls, r) for r in range(4)]
    whole = L([0], Replicate())                   # a TP1 engine: one rank, whole tensors
    join, ranks = rr.replica_specs(specs, {"dp": 1}, dst=whole)
    new = [{n: torch.zeros(s.shape) for n, s in specs.items()}]
    simulate_refit(rr.plan(join, n_src=2, n_dst=1), [engines[r] for r in ranks], new)
    assert all(torch.equal(new[0][n], fulls[n]) for n in specs)


def test_quantised_destinations_are_refused():
    s = engines_specs()["w"]
    fp8 = rr.TensorSpec((256, 256), torch.float8_e4m3fn, L([0, 1], Shard(0)),
                        L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp")),
                        src_dtype=torch.bfloat16, quant=rr.BlockFP8())
    with pytest.raises(ValueError, match="'q': quantised destinations"):
        rr.replica_specs({"w": s, "q": fp8}, {"dp": 0})
