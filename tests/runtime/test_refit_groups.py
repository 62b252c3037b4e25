"""Two destination groups of different layouts (prefill TP2, decode TP1 x DP2) fed from one
set of trainers in one refit on a real two-node Ray cluster."""
from __future__ import annotations

import pytest
import ray
import torch

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.layout.slots import Slot, Slots
from ray_reshard.tools.testing import holders


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


@pytest.mark.parametrize("per_rank", [False, True], ids=["by-name", "per-rank-storages"])
def test_prefill_and_decode_groups_refit_in_one_call(cluster, per_rank):
    """`per_rank`: each trainer keeps its shards in storages of its own name (a table of
    differing source slots), which the tensor taken in two dtypes reads twice."""
    train = L([0, 1], Shard(0))

    def src(n):
        return (Slots.from_pairs({r: Slot(f"{n}_{r}") for r in range(2)}) if per_rank
                else None)

    prefill = {"w": rr.TensorSpec((32, 16), torch.bfloat16, train, L([0, 1], Shard(1)),
                                  src_dtype=torch.float32, src_slots=src("w")),
               "b": rr.TensorSpec((16,), torch.float32, train, L([0, 1], Replicate()),
                                  src_slots=src("b"))}
    decode = {"w": rr.TensorSpec((32, 16), torch.bfloat16, train,
                                 L([[0], [1]], Replicate(), Shard(0), names=("dp", "tp")),
                                 src_dtype=torch.float32, src_slots=src("w")),
              "b": rr.TensorSpec((16,), torch.bfloat16, train, L([0, 1], Replicate()),
                                 src_dtype=torch.float32, src_slots=src("b"))}
    specs = rr.combine_destinations({"prefill": prefill, "decode": decode})
    assert set(specs) == {"w", "b", "b#decode"}     # decode takes b in bf16: its own bytes

    trainers = holders(2, 0)
    engines = holders(2, 1) + holders(2, 1)          # prefill ranks 0-1, decode ranks 2-3
    g = torch.Generator().manual_seed(5)
    fulls = {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}
    ray.get([a.set.remote({f"{n}_{r}" if per_rank else n: rr.shard_tensor(fulls[n], train, r)
                           for n in fulls})
             for r, a in enumerate(trainers)])
    local = []
    for r in range(4):
        d = {}
        for n, s in specs.items():
            box = s.dst.box(r, s.shape)
            if box is not None:
                d[s.slot("dst", r, n).storage] = torch.zeros(box.sizes, dtype=s.dtype)
        local.append(d)
    ray.get([a.set.remote(t) for a, t in zip(engines, local)])

    gb = rr.ReshardGroup(trainers, engines, strategy="gather_broadcast")
    with rr.ReshardGroup(trainers, engines) as group:
        for step in range(3):
            # the third refit goes through gather-broadcast: the same result, more bytes
            result = (gb if step == 2 else group).refit(specs)
            got = ray.get([a.get.remote() for a in engines])
            for r in range(4):
                for n, s in specs.items():
                    if s.dst.box(r, s.shape) is None:
                        continue
                    want = rr.shard_tensor(fulls[n.split("#")[0]].to(s.dtype), s.dst, r)
                    assert torch.equal(got[r][s.slot("dst", r, n).storage], want), (step, r, n)
            # the engines share one node: w and b cross into it once for both groups
            bound = result.plan_stats.min_network_bytes
            if step < 2:
                assert result.bytes_by_path["network"] == result.plan_stats.network_bytes \
                    == bound
            else:
                assert result.bytes_by_path["network"] > bound
            fulls = {n: t * 2 + 1 for n, t in fulls.items()}
            ray.get([a.set.remote({f"{n}_{r}" if per_rank else n:
                                   rr.shard_tensor(fulls[n], train, r) for n in fulls})
                     for r, a in enumerate(trainers)])
    gb.close()
