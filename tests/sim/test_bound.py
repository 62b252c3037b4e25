"""The layout bound: computed from the layouts alone, checked by hand and against plans."""
import json

import pytest
import torch

import ray_reshard as rr
from ray_reshard.sim.bound import check_plan, layout_bound, tensor_needs
from ray_reshard.tools.simulate import main as cli_main
from ray_reshard.sim.cluster import ASSUMED, DATASHEET, PRESETS, PROVENANCE, constants, preset

GB = 1e9


def _specs(src, dst, n=3, shape=(64, 32), dtype=torch.float32):
    return {f"w{i}": rr.TensorSpec(shape, dtype, src=src, dst=dst) for i in range(n)}


def test_replicas_in_one_domain_need_the_bytes_once():
    """TP4 -> TP2 x DP2, all four destinations in one domain: the domain needs the tensor
    once; each source holds a quarter nobody else holds."""
    tp4 = rr.Layout(rr.Mesh([0, 1, 2, 3]), (rr.Shard(0),))
    tp2dp2 = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))
    specs = _specs(tp4, tp2dp2)
    b = layout_bound(specs.values(), 4, 4, 4, 10 * GB)
    assert b.needed == [3 * 64 * 32 * 4]
    assert b.only_here == [3 * 64 * 32 * 4]
    assert b.bound_s == pytest.approx(3 * 64 * 32 * 4 / (4 * 10 * GB))
    # one domain per rank: each destination needs half of every tensor
    b1 = layout_bound(specs.values(), 4, 4, 1, 10 * GB)
    assert b1.needed == [3 * 32 * 32 * 4] * 4
    assert b1.only_here == [3 * 16 * 32 * 4] * 4


def test_replicated_sources_force_nothing_alone_but_share_the_total():
    """Sources replicated over two domains: no domain is forced to send a byte, but all
    source NICs together send every destination domain's need."""
    dp2 = rr.Layout(rr.Mesh([0, 1]), (rr.Replicate(),))
    tp2 = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(1),))
    b = layout_bound(_specs(dp2, tp2, n=1).values(), 2, 2, 1, 1 * GB)
    assert b.only_here == [0, 0]
    assert b.needed == [64 * 16 * 4, 64 * 16 * 4]
    assert b.src_s == pytest.approx(2 * 64 * 16 * 4 / (2 * GB))


def test_overlapping_boxes_union_is_exact():
    from ray_reshard.layout.box import Box

    dst = {0: Box((0, 0), (4, 4)), 1: Box((2, 2), (4, 4))}     # overlap 2x2
    src = {0: Box((0, 0), (6, 6))}
    needed, only = tensor_needs(src, dst, 1, 1, 2)
    assert needed.tolist() == [16 + 16 - 4]
    assert only.tolist() == [28]


@pytest.mark.parametrize("g", [1, 2, 4])
def test_plans_never_move_less_than_the_layouts_need(g):
    mixed = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("a", "b")), (rr.Shard(0), rr.Shard(1)))
    cols = rr.Layout(rr.Mesh([0, 1, 2, 3]), (rr.Shard(1),))
    rep = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(1)))
    for dst in (cols, rep):
        specs = _specs(mixed, dst, n=2)
        p = rr.plan(specs, [("t", r // g) for r in range(4)], [("i", r // g) for r in range(4)])
        b = layout_bound(specs.values(), 4, 4, g, 10 * GB)
        assert check_plan(b, p.recv_bytes_by_rank) is None
        assert sum(p.recv_bytes_by_rank.values()) >= sum(b.needed)
        # a plan moving less than a domain needs is caught
        assert check_plan(b, {}) is not None


def test_every_preset_constant_has_a_provenance():
    for name, cl in PRESETS.items():
        consts = constants(cl, name)
        assert {c["name"] for c in consts} == set(PROVENANCE[name])
        assert all(c["source"] and c["provenance"] for c in consts)
    gpu = {c["name"]: c["provenance"] for c in constants(preset("dgx-h100"), "dgx-h100")}
    assert gpu["nic_Bps"] == DATASHEET and gpu["latency_s"] == ASSUMED


def test_cli_json_reports_provenance_bound_and_sensitivity(capsys):
    rc = cli_main(["--model", "small-moe", "--train", "megatron:pp=2,ep=2,dp=2", "--infer",
                   "vllm:tp=2,dp=2,ep=2", "--gpus-per-domain", "2", "--json"])
    assert rc == 0
    o = json.loads(capsys.readouterr().out)
    assert o["plan_within_layout_bound"] is True
    assert 0 < o["layout_bound"]["bound_s"] <= o["bound_s"] + 1e-12
    assert o["network_bytes"] >= o["layout_bound"]["needed_bytes"]
    kinds = {c["name"]: c["provenance"] for c in o["constants"]}
    assert kinds["gpus_per_domain"] == "given" and kinds["nic_Bps"] == DATASHEET
    lo, hi = o["sensitivity_range_s"]
    assert lo <= o["predicted_s"] <= hi
    varied = {s["name"] for s in o["sensitivity"]}
    assert "latency_s" in varied and "nic_Bps" not in varied
    over = [s for s in o["sensitivity"] if s["name"] == "refit_overhead_s"][0]
    assert over["half_s"] < o["predicted_s"] < over["double_s"]


def test_every_preset_delta_constant_has_a_provenance():
    from ray_reshard.sim.cluster import DELTA_PROVENANCE, MEASURED_CPU

    for name, cl in PRESETS.items():
        consts = constants(cl, name, delta=True)
        assert {c["name"] for c in consts} == {"delta_encode_Bps", "delta_decode_Bps"}
        assert all(c["source"] and c["provenance"] and c["value"] > 0 for c in consts)
        assert set(DELTA_PROVENANCE[name]) == {c["name"] for c in consts}
    local = {c["name"]: c["provenance"] for c in constants(preset("local"), "local", delta=True)}
    assert set(local.values()) == {MEASURED_CPU}
    gpu = {c["name"]: c["provenance"] for c in constants(preset("dgx-h100"), "dgx-h100",
                                                          delta=True)}
    assert set(gpu.values()) == {ASSUMED}
