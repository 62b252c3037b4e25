"""Block-FP8 quantisation on the sender: the arithmetic against the reference, plans on the
block grid, and refits in the in-process simulator compared byte for byte with the reference
applied to the full tensor."""
import pickle

import pytest
import torch

import ray_reshard as rr
from ray_reshard.execution.fp8 import quantize, reference_quantize
from ray_reshard.layout.quant import BlockFP8
from ray_reshard.execution.reference import simulate_refit

FP8 = torch.float8_e4m3fn


def _full(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])  # wide dynamic range
    x[..., :3, :5] = 0.0                      # an all-zero corner: amax clamps to 1e-4
    return x.to(dtype)


def _lay(ranks, *placements, names=None):
    mesh = rr.Mesh(ranks, names or tuple(f"d{i}" for i in range(len(placements))))
    return rr.Layout(mesh, placements)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _refit(full, src, dst, block, sdom, ddom, bucket=2048, src_devices=None, dst_devices=None,
           ship=False):
    """Plan and simulate; check every destination against the reference; return the plan."""
    q = BlockFP8(block)
    spec = rr.TensorSpec(full.shape, FP8, src, dst, src_dtype=full.dtype, quant=q)
    plan = rr.plan({"w": spec}, sdom, ddom, src_devices=src_devices, dst_devices=dst_devices)
    if ship:
        plan = pickle.loads(pickle.dumps(plan))
    srcs = [{"w": rr.shard_tensor(full, src, r)} for r in range(len(sdom))]
    dsts = []
    for r in range(len(ddom)):
        shape = dst.local_shape(r, full.shape)
        dsts.append({} if shape is None else {
            "w": torch.zeros(shape, dtype=FP8),
            "w_scale_inv": torch.full(q.scale_shape(shape), -1.0)})
    simulate_refit(plan, srcs, dsts, bucket_bytes=bucket)
    ref_q, ref_s = reference_quantize(full, block)
    fb = q.full_block(full.ndim)
    for r in range(len(ddom)):
        box = dst.box(r, full.shape)
        if box is None:
            continue
        sbox = tuple(slice(o // b, -(-(o + n) // b)) for o, n, b in zip(box.offsets, box.sizes, fb))
        assert torch.equal(_bytes(dsts[r]["w"]), _bytes(ref_q[box.slices()])), f"dst {r} weights"
        assert torch.equal(dsts[r]["w_scale_inv"], ref_s[sbox]), f"dst {r} scales"
    st = plan.stats
    assert st.network_bytes == st.min_network_bytes
    return plan


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 72), (16, 8)),
                                         ((3, 40, 36), (16, 16)), ((5, 7), (4, 4))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_reference(shape, block, dtype):
    x = _full(shape, dtype)
    x[..., :block[0], :block[1]] = 0.0        # an all-zero block
    q, s = quantize(x, (1,) * (len(shape) - 2) + block)
    rq, rs = reference_quantize(x, block)
    assert q.dtype == FP8 and s.dtype == torch.float32
    assert torch.equal(_bytes(q), _bytes(rq)) and torch.equal(s, rs)
    assert float(rs.min()) == pytest.approx(1e-4 / 448.0)      # the zero block's clamped scale


def test_quantize_in_slabs_and_of_strided_regions(monkeypatch):
    from ray_reshard.execution import fp8
    monkeypatch.setattr(fp8, "SLAB", 3000)              # a few block rows per pass
    x = _full((4, 100, 72))
    rq, rs = reference_quantize(x, (16, 8))
    q, s = quantize(x, (1, 16, 8))
    assert torch.equal(_bytes(q), _bytes(rq)) and torch.equal(s, rs)
    y = _full((72, 100), torch.float32).t()             # a transposed (strided) region
    rq, rs = reference_quantize(y, (16, 8))
    q, s = quantize(y, (16, 8))
    assert torch.equal(_bytes(q), _bytes(rq)) and torch.equal(s, rs)


def test_tp_to_tp_dp_across_domains_on_the_block_grid():
    full = _full((96, 64))
    src = _lay([0, 1], rr.Shard(0))                                  # 48 rows: 3 blocks each
    dst = _lay([[0, 1], [2, 3]], rr.Replicate(), rr.Shard(1))       # 32 cols: 2 blocks each
    plan = _refit(full, src, dst, (16, 16), ["a"] * 2, ["b", "b", "c", "c"], ship=True)
    spec = plan.specs[0]
    assert spec.signature[0] == (6, 4)                               # planned per block
    # FP8 bytes plus one float32 scale per block, once per destination domain
    assert plan.stats.network_bytes == 2 * 24 * (16 * 16 + 4)
    bf16 = rr.plan({"w": rr.TensorSpec(full.shape, torch.bfloat16, src, dst)},
                   ["a"] * 2, ["b", "b", "c", "c"])
    assert plan.stats.network_bytes / bf16.stats.network_bytes == pytest.approx(260 / 512)


def test_every_network_item_is_whole_blocks_of_one_sender_that_holds_them():
    full = _full((128, 96))
    src = _lay([[0, 1], [2, 3]], rr.Replicate(), rr.Shard(1))
    dst = _lay([[0, 1], [2, 3]], rr.Replicate(), rr.Shard(0))
    plan = rr.plan({"w": rr.TensorSpec(full.shape, FP8, src, dst, src_dtype=torch.bfloat16,
                                       quant=BlockFP8((16, 16)))},
                   ["a", "a", "b", "b"], ["c", "c", "d", "d"])
    grid_src = plan.specs[0].signature[2]
    sched = plan.schedule(3 * 260)                                     # buckets of 3 blocks
    seen = {}
    for t in sched.transfers:
        for it in t.items:
            assert it.box.numel <= 3
            if t.src.side == "src":
                assert grid_src.box(t.src.rank, (8, 6)).contains(it.box)
            if t.path == "network":
                for cell in _cells(it.box):
                    dom = "c" if t.dst < 2 else "d"
                    assert (cell, dom) not in seen, "a block crosses into a domain twice"
                    seen[(cell, dom)] = t.src
    assert len(seen) == 2 * 48


def _cells(box):
    (r0, c0), (nr, nc) = box.offsets, box.sizes
    return [(r, c) for r in range(r0, r0 + nr) for c in range(c0, c0 + nc)]


def test_ragged_edge_blocks_uneven_shards_and_expert_dims():
    # 100 rows: the last block is 4 rows; sources split columns, destinations rows (TP3 of
    # blocks of 16 rows: 48, 48, 4)
    full = _full((100, 96))
    src = _lay([0, 1], rr.Shard(1))
    dst = _lay([0, 1, 2], rr.Shard(0, block=48))
    _refit(full, src, dst, (16, 16), ["a", "a"], ["b"] * 3, bucket=700)
    # stacked experts: blocks over the last two dims, experts sharded (EP) on both sides
    full = _full((6, 64, 40), torch.float32)
    src = _lay([[0, 1], [2, 3]], rr.Shard(0), rr.Shard(1))
    dst = _lay([0, 1, 2], rr.Shard(0))
    _refit(full, src, dst, (16, 8), ["a"] * 4, ["b", "c", "c"])


def test_sources_that_cut_blocks_fall_back_to_destination_quantisation():
    full = _full((100, 64))
    src = _lay([0, 1, 2], rr.Shard(0))                        # 34-row shards cut 16-row blocks
    dst = _lay([[0, 1], [2, 3]], rr.Replicate(), rr.Shard(1))
    plan = _refit(full, src, dst, (16, 16), ["a"] * 3, ["b", "c", "b", "c"], bucket=1000,
                  ship=True)
    spec = plan.specs[0]
    assert spec.signature[0] == (100, 64) and spec.itemsize == 2     # source dtype on the wire
    # each domain's two replicas split the pieces and forward them to each other
    assert plan.stats.network_bytes == plan.stats.domain_bytes == 100 * 64 * 2


def test_colocated_and_same_device_copies():
    full = _full((64, 64))
    src = _lay([0, 1], rr.Shard(0))
    dst = _lay([0, 1], rr.Shard(1))
    # same devices: local copies quantise on the spot; other rank: domain path
    plan = _refit(full, src, dst, (16, 16), ["n"] * 2, ["n"] * 2,
                  src_devices=[0, 1], dst_devices=[0, 1])
    assert plan.stats.local_bytes > 0 and plan.stats.network_bytes == 0
    src3 = _lay([0, 1, 2], rr.Shard(0))                            # fallback, local too
    _refit(full, src3, dst, (16, 16), ["n"] * 3, ["n"] * 2, src_devices=[0, 1, 2],
           dst_devices=[0, 1])


def test_quantised_and_plain_specs_of_one_shape_plan_apart():
    src = _lay([0, 1], rr.Shard(0))
    dst = _lay([0, 1], rr.Shard(1))
    q = rr.TensorSpec((64, 64), FP8, src, dst, src_dtype=torch.bfloat16, quant=BlockFP8((16, 16)))
    plain = rr.TensorSpec((64, 64), FP8, src, dst, src_dtype=torch.bfloat16)
    plan = rr.plan({"q": q, "p": plain}, ["a"] * 2, ["b"] * 2)
    assert plan.tensor_plans[0].shape == (4, 4) and plan.tensor_plans[1].shape == (64, 64)


def test_bad_fp8_specs_are_refused_naming_the_problem():
    src = _lay([0, 1], rr.Shard(0))
    dst = _lay([0, 1, 2], rr.Shard(1))
    with pytest.raises(ValueError, match="needs dtype torch.float8_e4m3fn"):
        rr.TensorSpec((64, 96), torch.bfloat16, src, dst, quant=BlockFP8((16, 16)))
    with pytest.raises(ValueError, match="at least 2 dims"):
        rr.TensorSpec((64,), FP8, src, src, src_dtype=torch.bfloat16, quant=BlockFP8((16, 16)))
    with pytest.raises(ValueError, match="block"):
        BlockFP8((3, 5))
    spec = rr.TensorSpec((64, 72), FP8, src, dst, src_dtype=torch.bfloat16,
                         quant=BlockFP8((16, 16)))
    with pytest.raises(ValueError, match=r"'w': destination rank 0 holds .* cuts"):
        rr.plan({"w": spec})
    fused = rr.TensorSpec((64, 64), FP8, src, src, src_dtype=torch.bfloat16,
                          quant=BlockFP8((16, 16)),
                          dst_slots={r: rr.Slot("qkv", dim=0, offset=8) for r in (0, 1)})
    with pytest.raises(ValueError, match="offset 8 of dim 0"):
        rr.plan({"w": fused})


def test_missing_or_wrong_scales_are_named():
    src = _lay([0, 1], rr.Shard(0))
    full = _full((64, 64))
    spec = rr.TensorSpec(full.shape, FP8, src, src, src_dtype=torch.bfloat16,
                         quant=BlockFP8((16, 16)))
    plan = rr.plan({"w": spec}, ["a"] * 2, ["b"] * 2)
    srcs = [{"w": rr.shard_tensor(full, src, r)} for r in range(2)]
    dsts = [{"w": torch.zeros(32, 64, dtype=FP8)} for _ in range(2)]
    with pytest.raises(ValueError, match="no local tensor 'w_scale_inv'"):
        simulate_refit(plan, srcs, dsts)
    for d in dsts:
        d["w_scale_inv"] = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype torch.bfloat16, expected torch.float32"):
        simulate_refit(plan, srcs, dsts)
    for d in dsts:
        d["w_scale_inv"] = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"expected \(2, 4\)"):
        simulate_refit(plan, srcs, dsts)


def test_gather_broadcast_refuses_fp8_specs():
    from ray_reshard.runtime.gather_broadcast import build_steps
    src = _lay([0, 1], rr.Shard(0))
    spec = rr.TensorSpec((64, 64), FP8, src, src, src_dtype=torch.bfloat16,
                         quant=BlockFP8((16, 16)))
    plan = rr.plan({"w": spec}, ["a"] * 2, ["b"] * 2)
    procs = {rr.Endpoint(side, r): i for i, (side, r) in
             enumerate([("src", 0), ("src", 1), ("dst", 0), ("dst", 1)])}
    with pytest.raises(ValueError, match="'w': block-FP8 .* reshard strategy"):
        build_steps(plan, procs, 0, 1 << 20)


def test_wider_items_after_fp8_blocks_travel_as_bytes():
    """A 2x4 block is 12 wire bytes: a float64 tensor packed after one starts at byte 12."""
    one = _lay([0], rr.Replicate())
    q = rr.TensorSpec((2, 4), FP8, one, one, src_dtype=torch.bfloat16, quant=BlockFP8((2, 4)))
    d = rr.TensorSpec((3,), torch.float64, one, one)
    plan = rr.plan({"q": q, "d": d}, ["a"], ["b"])
    x = _full((2, 4))
    src = [{"q": x, "d": torch.randn(3, dtype=torch.float64)}]
    dst = [{"q": torch.zeros(2, 4, dtype=FP8), "q_scale_inv": torch.zeros(1, 1),
            "d": torch.zeros(3, dtype=torch.float64)}]
    simulate_refit(plan, src, dst)
    rq, rs = reference_quantize(x, (2, 4))
    assert torch.equal(dst[0]["d"], src[0]["d"])
    assert torch.equal(_bytes(dst[0]["q"]), _bytes(rq)) and torch.equal(dst[0]["q_scale_inv"], rs)
