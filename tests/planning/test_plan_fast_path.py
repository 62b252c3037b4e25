"""The planner's shared path (one canonical plan per problem, renamed lazily; each process
taking only its own moves; the compact shipped form) gives exactly the plan of planning every
tensor on its own ranks, on real recipe layouts and hand-made ones."""
from __future__ import annotations

import pickle
from collections import defaultdict

import pytest
import torch

from ray_reshard.tools.cli_args import DEEPSEEK_V3, QWEN3_235B
from ray_reshard.planning import Endpoint, plan
from ray_reshard.layout import Layout, Mesh, Replicate, Shard, Slot, TensorSpec
from ray_reshard.planning.share import build_share
from ray_reshard.planning.canonical import plan_tensor_direct
from ray_reshard.models import VLLM, Megatron, Recipe

F32, BF16 = torch.float32, torch.bfloat16


def small(config: dict, **over) -> dict:
    """A published config with fewer layers and experts and narrower dims (same structure)."""
    return {**config, **over}


def recipe_case(config, train, infer, per_domain):
    specs = Recipe(config, train, infer, hf_experts="split").specs(BF16)
    return (specs, [r // per_domain for r in range(train.world)],
            [100 + r // per_domain for r in range(infer.world)], {})


def hand_case():
    """Pipeline stages on disjoint ranks, replicas over domains, colocated devices, and an
    uneven split, on 8 -> 8 ranks (4 domains of 2 per side, the sides sharing two)."""
    specs = {}
    for stage in range(2):
        ranks = list(range(4 * stage, 4 * stage + 4))
        src = Layout(Mesh([ranks[:2], ranks[2:]]), [Replicate(), Shard(0)])
        dst = Layout(Mesh([[0, 1, 2, 3], [4, 5, 6, 7]]), [Replicate(), Shard(1)])
        for i in range(3):
            specs[f"s{stage}.w{i}"] = TensorSpec(
                (24, 40), BF16, src, dst, src_dtype=F32,
                dst_slots={r: Slot(f"fused{i}", dim=0) for r in range(8)})
        specs[f"s{stage}.bias"] = TensorSpec((7,), F32, Layout.replicated(ranks),
                                             Layout.sharded(list(range(8)), 0))
    specs["tiny"] = TensorSpec((3,), F32, Layout.replicated(list(range(8))),
                               Layout.replicated(list(range(8))))
    src_dom = ["a", "a", "b", "b", "c", "c", "d", "d"]
    dst_dom = ["a", "a", "b", "b", "e", "e", "f", "f"]
    devices = dict(src_devices=list(range(8)), dst_devices=[0, 1, 2, 3, 10, 11, 12, 13])
    return specs, src_dom, dst_dom, devices


CASES = {
    "deepseek-v3": lambda: recipe_case(
        small(DEEPSEEK_V3, num_hidden_layers=4, n_routed_experts=16, first_k_dense_replace=1,
              num_nextn_predict_layers=0, vocab_size=1000, hidden_size=256,
              intermediate_size=512, moe_intermediate_size=64, num_attention_heads=8,
              num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16),
        Megatron(tp=1, ep=4, etp=1, dp=4, pp=2), VLLM(tp=4, dp=4), 4),
    "qwen3-moe": lambda: recipe_case(
        small(QWEN3_235B, num_hidden_layers=4, num_experts=8, vocab_size=1000, hidden_size=256,
              intermediate_size=512, moe_intermediate_size=64, num_attention_heads=8,
              num_key_value_heads=4, head_dim=32),
        Megatron(tp=2, ep=4, etp=1, dp=2, pp=2), VLLM(tp=4, dp=2, ep=8), 4),
    "hand": hand_case,
}


def straightforward(specs, topo):
    """Every tensor planned on its own ranks, with the rotations `plan` hands out."""
    turns: dict = defaultdict(int)
    out = []
    for spec in specs.values():
        ref = plan_tensor_direct(spec.signature, topo)
        if ref.rotations > 1:
            turn = turns[spec.src]
            turns[spec.src] = turn + 1
            if turn % ref.rotations:
                ref = plan_tensor_direct(spec.signature, topo, turn % ref.rotations)
        out.append(ref)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_path_equals_straightforward_plan(case):
    specs, src_dom, dst_dom, devices = CASES[case]()
    p = plan(specs, src_dom, dst_dom, **devices)
    refs = straightforward(specs, p.topology)
    shared = sum(1 for tp in p.tensor_plans if tp.totals is not tp.stats)
    assert shared > 0 or case == "hand"           # the recipes do share canonical plans
    for name, tp, ref in zip(p.names, p.tensor_plans, refs):
        assert tp.moves == ref.moves, name
        assert tp.stats == ref.stats, name
        assert tp.n_moves == len(ref.moves)
    # Plan statistics and the lower bound, summed the straightforward way.
    st = p.stats
    assert st.network_bytes == sum(r.stats.network_bytes for r in refs)
    assert st.min_network_bytes == sum(r.stats.min_network_bytes for r in refs)
    assert st.network_bytes == st.min_network_bytes
    assert st.domain_bytes == sum(r.stats.domain_bytes for r in refs)
    assert st.local_bytes == sum(r.stats.local_bytes for r in refs)
    assert st.n_moves == sum(len(r.moves) for r in refs)
    for which, got in ((0, p.send_bytes_by_rank), (1, p.recv_bytes_by_rank)):
        want: dict = defaultdict(int)
        for r in refs:
            for rank, b in (r.stats.send_bytes, r.stats.recv_bytes)[which]:
                want[rank] += b
        assert got == dict(want)

    # The shipped form: the same plan, specs and slot tables; each process's share, taken
    # from its own moves only, equals its part of the global schedule.
    back = pickle.loads(pickle.dumps(p, protocol=5))
    assert back.stats == st and back.names == p.names
    assert back.specs == p.specs
    for spec, orig in zip(back.specs, p.specs):
        for side in ("src", "dst"):
            for r in spec.layout(side).ranks:
                assert spec.slot(side, r, "x") == orig.slot(side, r, "x")
    bucket = 1 << 16
    sched = p.schedule(bucket)
    topo = p.topology
    procs = [[Endpoint("src", r)] for r in range(topo.n_src)]
    procs += [[Endpoint("dst", r)] for r in range(topo.n_dst)]
    procs.append([Endpoint("src", 0), Endpoint("dst", 0)])
    for eps in procs:
        want = [t for t in sched.transfers if t.src in eps or Endpoint("dst", t.dst) in eps]
        q = pickle.loads(pickle.dumps(p, protocol=5))
        q.localize(eps)
        assert build_share(q, eps, bucket) == want, eps
    for tp, ref in zip(back.tensor_plans, refs):
        assert tp.moves == ref.moves


def test_slot_tables_are_compact_and_behave_as_pairs():
    from ray_reshard.layout import Slots
    from ray_reshard.layout.slots import pack_slot_tables, unpack_slot_tables

    same = Slot("w", (3,), dim=0, offset=8)
    a = Slots.same((0, 2, 5), same)
    b = Slots.from_pairs({5: same, 0: same, 2: Slot("w", (3,), dim=0, offset=8)})
    mixed = Slots.from_pairs([(1, Slot("x")), (0, Slot("y"))])
    assert a == b and hash(a) == hash(b) and a.uniform == same
    assert tuple(a) == ((0, same), (2, same), (5, same)) == a
    assert mixed.uniform is None and list(mixed) == [(0, Slot("y")), (1, Slot("x"))]
    assert a.get(2) == same and a.get(1) is None and mixed.get(1) == Slot("x")
    assert len(a) == 3 and a[1] == (2, same) and not Slots(())
    with pytest.raises(TypeError, match="rank 4 must be a Slot"):
        Slots.from_pairs({4: "w"})
    with pytest.raises(ValueError, match="names a rank twice"):
        Slots.from_pairs([(1, same), (1, same)])
    back = unpack_slot_tables(pack_slot_tables([a, None, mixed, b]))
    assert back[1] is None and back[2] is mixed
    assert back[0] == a and back[3].ranks == (0, 2, 5) and back[3].get(5) == same
    assert pickle.loads(pickle.dumps(back[0])) == a
    spec = TensorSpec((4,), F32, Layout.replicated([0, 2, 5]), Layout.replicated([0]),
                      src_slots={r: same for r in (0, 2, 5)})
    assert isinstance(spec.src_slots, Slots) and spec.src_slots == a
    assert spec.slot("src", 5, "n") == same and spec.slot("dst", 0, "n") == Slot("n")
