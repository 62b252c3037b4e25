"""Several destination groups in one refit: LayoutUnion, the planner across groups sharing
domains, and combine_destinations."""
from __future__ import annotations

import pickle
import random

import pytest
import torch

import ray_reshard as rr
from ray_reshard.planning.canonical import plan_tensor, plan_tensor_direct
from ray_reshard.planning.moves import Topology
from ray_reshard.execution.reference import simulate_refit


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


TRAIN = L([0, 1, 2, 3], rr.Shard(0))
PREFILL = L([0, 1, 2, 3], rr.Shard(0))                                  # TP4
DECODE = L([[0, 1], [2, 3]], rr.Replicate(), rr.Shard(0), names=("dp", "tp"))  # TP2 x DP2


def shifted(lay, offset):
    import numpy as np
    grid = (np.asarray(lay.mesh.ranks) + offset).reshape(lay.mesh.shape).tolist()
    return rr.Layout(rr.Mesh(grid, lay.mesh.dim_names), lay.placements)


def test_union_boxes_ranks_and_pickling():
    u = rr.LayoutUnion([PREFILL, shifted(DECODE, 4)])
    assert u.ranks == (0, 1, 2, 3, 4, 5, 6, 7)
    assert u.box(1, (8, 2)) == PREFILL.box(1, (8, 2))
    assert u.box(6, (8, 2)) == DECODE.box(2, (8, 2))
    assert u.box(9, (8, 2)) is None
    assert u.local_shape(5, (8, 2)) == (4, 2)
    assert set(u.boxes((8, 2))) == set(range(8))
    back = pickle.loads(pickle.dumps(u))
    assert back == u and hash(back) == hash(u) and back.box(6, (8, 2)) == u.box(6, (8, 2))


def test_union_refuses_shared_ranks_and_source_side():
    with pytest.raises(ValueError, match="parts 0 and 1 both use rank 0"):
        rr.LayoutUnion([PREFILL, DECODE])
    with pytest.raises(TypeError, match="LayoutUnion as dst; sources take one Layout"):
        rr.TensorSpec((8, 2), torch.float32, rr.LayoutUnion([PREFILL, shifted(DECODE, 4)]),
                      PREFILL)
    u = rr.LayoutUnion([PREFILL, shifted(L([0, 1, 2, 3], rr.Shard(2)), 4)])
    spec = rr.TensorSpec((8, 2), torch.float32, TRAIN, u)
    with pytest.raises(ValueError, match="group 1.*shards tensor dim 2"):
        spec.validate("w")


def run(spec, src_domains, dst_domains, seed=0):
    """Plan and run `spec` in one process; check every destination rank bit-exactly."""
    plan = rr.plan({"w": spec}, src_domains=src_domains, dst_domains=dst_domains)
    full = torch.randn(spec.shape, generator=torch.Generator().manual_seed(seed))
    src = [{"w": rr.shard_tensor(full, spec.src, r)} for r in range(len(src_domains))]
    dst = [{"w": torch.full(spec.dst.local_shape(r, spec.shape), float("nan"))}
           for r in range(len(dst_domains))]
    simulate_refit(plan, src, dst, bucket_bytes=1 << 10)
    for r in range(len(dst_domains)):
        assert torch.equal(dst[r]["w"], rr.shard_tensor(full, spec.dst, r)), r
    return plan


@pytest.mark.parametrize("dst_domains,together,alone", [
    (["a"] * 4 + ["b"] * 4, 2, 2),        # each group in its own domain: nothing to share
    (["a", "a", "b", "b"] * 2, 2, 3),     # both groups in both domains
    (["x"] * 8, 1, 2),                    # everything in one domain
])
def test_groups_planned_together_reach_the_bound_and_land_exactly(dst_domains, together, alone):
    """Network bytes, in copies of the whole tensor, of the groups planned together and of
    each group planned alone (each then pays for its own copy of what both need)."""
    spec = rr.TensorSpec((64, 24), torch.float32, TRAIN,
                         rr.LayoutUnion([PREFILL, shifted(DECODE, 4)]))
    plan = run(spec, ["s"] * 4, dst_domains)
    full = 64 * 24 * 4
    assert plan.stats.network_bytes == plan.stats.min_network_bytes == together * full
    apart = sum(rr.plan({"w": rr.TensorSpec((64, 24), torch.float32, TRAIN, lay)},
                        src_domains=["s"] * 4,
                        dst_domains=[dst_domains[r] for r in ranks]).stats.network_bytes
                for lay, ranks in ((PREFILL, range(4)), (DECODE, range(4, 8))))
    assert apart == alone * full


def random_layout(rng, ranks, ndim, shape):
    n = len(ranks)
    dims = [d for d in (1, 2, 4) if n % d == 0]
    a = rng.choice(dims)
    grid = [ranks[i * (n // a):(i + 1) * (n // a)] for i in range(a)]
    pls = []
    for _ in range(2):
        pls.append(rng.choice([rr.Replicate(), rr.Shard(rng.randrange(ndim))]))
    return L(grid, *pls)


def test_random_unions_with_colocated_sources_are_exact_and_at_the_bound():
    rng = random.Random(7)
    for case in range(40):
        shape = tuple(rng.choice([5, 8, 12, 16]) for _ in range(rng.choice([1, 2, 3])))
        n_src = rng.choice([2, 4])
        src = random_layout(rng, list(range(n_src)), len(shape), shape)
        parts, at = [], 0
        for _ in range(rng.choice([2, 3])):
            n = rng.choice([1, 2, 4])
            parts.append(random_layout(rng, list(range(at, at + n)), len(shape), shape))
            at += n
        spec = rr.TensorSpec(shape, torch.float32, src, rr.LayoutUnion(parts))
        n_dom = rng.choice([1, 2, 3])
        dst_domains = [rng.randrange(n_dom) for _ in range(at)]
        src_domains = [rng.randrange(n_dom + 1) for _ in range(n_src)]   # some shared
        plan = run(spec, src_domains, dst_domains, seed=case)
        assert plan.stats.network_bytes == plan.stats.min_network_bytes, (case, spec)
        topo = Topology.make(n_src, at, src_domains, dst_domains)
        assert plan_tensor(spec.signature, topo) == plan_tensor_direct(spec.signature, topo)


def test_unions_differing_only_in_rank_ids_share_one_canonical_plan():
    from ray_reshard.planning.canonical import canonical_plan, clear_caches
    clear_caches()
    topo = Topology.make(8, 8, ["s"] * 8, ["a"] * 8)
    for stage in range(2):
        src = L([4 * stage + i for i in range(4)], rr.Shard(0))
        spec = rr.TensorSpec((16, 8), torch.float32, src,
                             rr.LayoutUnion([PREFILL, shifted(DECODE, 4)]))
        plan_tensor(spec.signature, topo)
    assert canonical_plan.cache_info().currsize == 1


def test_combine_destinations_offsets_ranks_and_joins_alike_tensors():
    fused = rr.Slot("qkv", dim=0, offset=4)
    pre = {"w": rr.TensorSpec((8, 4), torch.bfloat16, TRAIN, PREFILL, src_dtype=torch.float32),
           "b": rr.TensorSpec((8,), torch.bfloat16, TRAIN, L([0], rr.Replicate()),
                              src_dtype=torch.float32)}
    dec = {"w": rr.TensorSpec((8, 4), torch.bfloat16, TRAIN, DECODE, src_dtype=torch.float32,
                              dst_slots={r: fused for r in range(4)}),
           "only": rr.TensorSpec((2,), torch.float32, TRAIN, L([1], rr.Replicate()))}
    out = rr.combine_destinations({"prefill": pre, "decode": dec})
    assert list(out) == ["w", "b", "only"]
    w = out["w"]
    assert isinstance(w.dst, rr.LayoutUnion) and w.dst.ranks == tuple(range(8))
    assert w.dst.parts[1].mesh.ranks == (4, 5, 6, 7)
    assert w.slot("dst", 5, "w") == fused and w.slot("dst", 2, "w") == rr.Slot("w")
    assert out["only"].dst.ranks == (5,)
    assert out["b"].dst == pre["b"].dst
    # sizes wider than the specs need move the next group further
    assert rr.combine_destinations([pre, dec], sizes=[6, 4])["only"].dst.ranks == (7,)


def test_combine_destinations_keeps_different_bytes_apart_under_explicit_slots():
    pre = {"w": rr.TensorSpec((256, 256), torch.bfloat16, TRAIN, PREFILL,
                              src_dtype=torch.float32)}
    dec = {"w": rr.TensorSpec((256, 256), torch.float8_e4m3fn,
                              L([0, 1], rr.Shard(0)), L([0, 1], rr.Shard(0)),
                              src_dtype=torch.float32, quant=rr.BlockFP8())}
    with pytest.raises(ValueError, match="different source layouts"):
        rr.combine_destinations({"prefill": pre, "decode": dec})
    dec["w"] = rr.TensorSpec((256, 256), torch.float8_e4m3fn, TRAIN, L([0, 1], rr.Shard(0)),
                             src_dtype=torch.float32, quant=rr.BlockFP8())
    out = rr.combine_destinations({"prefill": pre, "decode": dec})
    assert set(out) == {"w", "w#decode"}
    fp8 = out["w#decode"]
    assert fp8.dst.ranks == (4, 5) and fp8.slot("dst", 4, "w#decode") == rr.Slot("w")
    assert fp8.slot("src", 3, "w#decode") == rr.Slot("w")


def test_combine_destinations_errors_name_the_group():
    pre = {"w": rr.TensorSpec((8, 4), torch.float32, TRAIN, PREFILL)}
    dec = {"w": rr.TensorSpec((8, 5), torch.float32, TRAIN, DECODE)}
    with pytest.raises(ValueError, match="'w': groups 'a' and 'b' give it different shapes"):
        rr.combine_destinations({"a": pre, "b": dec})
    with pytest.raises(ValueError, match="group '0' has 2 destination actors"):
        rr.combine_destinations([pre, pre], sizes=[2, 4])
    with pytest.raises(ValueError, match="already has several destination groups"):
        rr.combine_destinations([rr.combine_destinations([pre, pre])])
