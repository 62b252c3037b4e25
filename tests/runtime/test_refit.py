"""Refits on real Ray actors over gloo and shared memory, checked bit-exactly."""
import pytest
import ray
import torch

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard

from ray_reshard.runtime.executor import default_window
from ray_reshard.tools.testing import holders


@pytest.fixture(scope="module")
def actors(cluster):
    # 4 on node 0 and 4 on node 1; tests pick sides from these.
    a = holders(4, 0) + holders(4, 1)
    ray.get([x.node.remote() for x in a])
    return a


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


def fill(actors_, specs, fulls, side):
    per = [dict() for _ in actors_]
    for name, spec in specs.items():
        lay = spec.layout(side)
        full = fulls[name] if side == "src" else fulls[name].to(spec.dtype)
        for r in range(len(actors_)):
            if lay.box(r, spec.shape) is None:
                continue
            if side == "src":
                per[r][name] = rr.shard_tensor(full.to(spec.source_dtype), lay, r)
            else:
                per[r][name] = torch.full(lay.local_shape(r, spec.shape), -7, dtype=spec.dtype)
    ray.get([a.set.remote(t) for a, t in zip(actors_, per)])


def check(dst_actors, specs, fulls):
    got = ray.get([a.get.remote() for a in dst_actors])
    for name, spec in specs.items():
        want_full = fulls[name].to(spec.dtype)
        for r, tensors in enumerate(got):
            if spec.dst.box(r, spec.shape) is None:
                continue
            assert torch.equal(tensors[name], rr.shard_tensor(want_full, spec.dst, r)), (name, r)


def mixed_specs():
    g = torch.Generator().manual_seed(0)
    specs, fulls = {}, {}
    def add(name, shape, src, dst, dtype=torch.float32, src_dtype=None):
        specs[name] = rr.TensorSpec(shape, dtype, src, dst, src_dtype=src_dtype)
        fulls[name] = torch.randn(shape, generator=g) if shape else torch.randn((), generator=g)
    tp4 = L([0, 1, 2, 3], Shard(0))
    tp2dp2 = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    add("w_rows", (64, 48), tp4, tp2dp2)
    add("w_cols", (48, 64), L([0, 1, 2, 3], Shard(1)), L([[0, 1], [2, 3]], Replicate(), Shard(1)))
    add("mixed", (40, 36), L([[0, 1], [2, 3]], Shard(0), Shard(1)), L([0, 1, 2, 3], Shard(1)))
    add("uneven", (7, 5, 3), L([0, 1, 2, 3], Shard(0)), L([[0, 1], [2, 3]], Shard(1), Shard(2)))
    add("norm", (64,), L([0, 1, 2, 3], Replicate()), L([0, 1, 2, 3], Replicate()))
    add("scalar", (), L([0], Replicate()), L([0, 1, 2, 3], Replicate()))
    add("stage", (16, 8), L([2, 3], Shard(0)), L([1, 3], Shard(1)))
    add("odd_bf16", (3, 5), L([0, 1], Shard(1)), L([0, 1, 2, 3], Replicate()), dtype=torch.bfloat16)
    add("bf16", (32, 32), L([0, 1, 2, 3], Shard(1)), tp2dp2, dtype=torch.bfloat16,
        src_dtype=torch.float32)
    return specs, fulls


@pytest.mark.parametrize("placement", ["across_nodes", "within_node", "replicas_across"])
def test_refit_bit_exact(actors, placement):
    if placement == "across_nodes":
        src, dst = actors[:4], actors[4:]
    elif placement == "within_node":
        src, dst = actors[:2] + actors[4:6], actors[2:4] + actors[6:8]
    else:  # destination replicas (dp) on different nodes, sources on both
        src, dst = actors[0:2] + actors[4:6], actors[2:4] + actors[6:8]
        src, dst = src[::-1], [dst[0], dst[2], dst[1], dst[3]]
    specs, fulls = mixed_specs()
    fill(src, specs, fulls, "src")
    fill(dst, specs, fulls, "dst")
    with rr.ReshardGroup(src, dst, bucket_bytes=4096) as group:
        res = group.refit(specs)
        check(dst, specs, fulls)
        assert res.bytes_by_path["network"] == res.plan_stats.network_bytes
        assert res.bytes_by_path["domain"] == res.plan_stats.domain_bytes
        assert res.peak_staging_bytes <= default_window(4096) * 4096
        if placement != "within_node":
            # by the second refit every ring's consumer has probed cross-memory attach:
            # forwards of plain rows travel as lists of the forwarder's bytes (single copy)
            fill(dst, specs, fulls, "dst")
            res = group.refit(specs)
            check(dst, specs, fulls)
            single = sum(st["single_copy_bytes"] for st in res.per_process)
            assert 0 < single < res.bytes_by_path["domain"]     # strided ones still packed


def test_forward_into_a_column_major_replica(actors):
    """A forwarder lists its rows; the replica it forwards to holds a column-major tensor, so
    it copies the listed bytes into a bucket and unpacks that."""
    src, dst = actors[:4], actors[4:]
    tp4 = L([0, 1, 2, 3], Shard(0))
    tp2dp2 = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    specs = {f"w{i}": rr.TensorSpec((64, 32), torch.float32, tp4, tp2dp2) for i in range(6)}
    g = torch.Generator().manual_seed(3)
    fulls = {n: torch.randn(64, 32, generator=g) for n in specs}
    fill(src, specs, fulls, "src")
    per = []
    for r in range(4):
        t = {n: torch.full(tp2dp2.local_shape(r, (64, 32)), -7.0) for n in specs}
        if r >= 2:                  # the second replica: column-major storage
            t = {n: v.t().contiguous().t() for n, v in t.items()}
        per.append(t)
    ray.get([a.set.remote(t) for a, t in zip(dst, per)])
    with rr.ReshardGroup(src, dst, bucket_bytes=8192) as group:
        for _ in range(2):
            res = group.refit(specs)
            check(dst, specs, fulls)
        assert sum(st["single_copy_bytes"] for st in res.per_process) > 0
    got = ray.get([a.get.remote() for a in dst])
    assert not got[3]["w0"].is_contiguous() and got[3]["w0"].t().is_contiguous()


def test_colocated_same_actors(actors):
    both = actors[:4]
    src_l = L([0, 1, 2, 3], Shard(0))
    dst_l = L([[0, 1], [2, 3]], Replicate(), Shard(1))
    specs = {"w": rr.TensorSpec((8, 8), torch.float32, src_l, dst_l)}
    fulls = {"w": torch.arange(64.0).reshape(8, 8)}
    tensors = [{"w": rr.shard_tensor(fulls["w"], src_l, r),
                "w.dst": torch.zeros(dst_l.local_shape(r, (8, 8)))} for r in range(4)]
    ray.get([a.set.remote(t) for a, t in zip(both, tensors)])
    specs = {"w": rr.TensorSpec((8, 8), torch.float32, src_l, dst_l,
                                dst_slots={r: rr.Slot("w.dst") for r in range(4)})}
    with rr.ReshardGroup(both, both) as group:
        res = group.refit(specs)
        assert res.bytes_by_path["local"] > 0
    got = ray.get([a.get.remote() for a in both])
    for r in range(4):
        assert torch.equal(got[r]["w.dst"], rr.shard_tensor(fulls["w"], dst_l, r))


def test_repeated_refits_reuse_plan_and_see_rebound_tensors(actors):
    src, dst = actors[:4], actors[4:]
    specs, fulls = mixed_specs()
    fill(src, specs, fulls, "src")
    fill(dst, specs, fulls, "dst")
    with rr.ReshardGroup(src, dst) as group:
        first = group.refit(specs)
        assert first.planned
        for step in range(2):
            fulls = {k: v + step + 1 for k, v in fulls.items()}
            fill(src, specs, fulls, "src")          # trainer rebinds its tensors
            res = group.refit(specs)
            assert not res.planned
            check(dst, specs, fulls)
        assert group.version == 3
        assert group.versions() == [3] * len(set(src + dst))
        group.update(src_actors=src, dst_actors=dst[::-1])      # membership change keeps it
        assert group.versions() == [3] * len(set(src + dst))


def test_strategies_agree(actors):
    src, dst = actors[:4], actors[4:]
    specs, fulls = mixed_specs()
    outs = []
    for strategy in ("reshard", "gather_broadcast"):
        fill(src, specs, fulls, "src")
        fill(dst, specs, fulls, "dst")
        with rr.ReshardGroup(src, dst, strategy=strategy, bucket_bytes=8192) as group:
            group.refit(specs)
        check(dst, specs, fulls)
        outs.append(ray.get([a.get.remote() for a in dst]))
    for a, b in zip(*outs):
        for k in a:
            assert torch.equal(a[k], b[k])


def test_bad_local_tensor_refused_before_any_byte_moves(actors):
    src, dst = actors[:2], actors[4:6]
    lay = L([0, 1], Shard(0))
    specs = {"a": rr.TensorSpec((4, 4), torch.float32, lay, lay),
             "b": rr.TensorSpec((4, 4), torch.float32, lay, lay)}
    ray.get([a.set.remote({"a": torch.ones(2, 4), "b": torch.ones(2, 4)}) for a in src])
    ray.get(dst[0].set.remote({"a": torch.zeros(2, 4), "b": torch.zeros(2, 4)}))
    ray.get(dst[1].set.remote({"a": torch.zeros(2, 4), "b": torch.zeros(3, 4)}))
    with rr.ReshardGroup(src, dst) as group:
        with pytest.raises(ValueError, match=r"'b' on dst rank 1: local shard has shape \(3, 4\), expected \(2, 4\)"):
            group.refit(specs)
    got = ray.get([a.get.remote() for a in dst])
    # a refit that ran would have written the sources' ones into dst rank 0
    assert all(float(t.abs().sum()) == 0 for g in got for t in g.values())


def _staging(res):
    """(peak staging bytes of each sending process, of each receiving process)."""
    senders = sorted(st["peak_staging_bytes"] for st in res.per_process if st["sent_bytes"])
    receivers = sorted(st["peak_staging_bytes"] for st in res.per_process if st["recv_bytes"])
    return senders, receivers


def test_strided_local_tensors_move_in_place_or_staged(actors):
    # Items of 128 KiB qualify for in-place messages: contiguous shards travel as their own
    # bytes (no staging at either end); a destination keeping its shard in columns of a wider
    # storage, or a source holding a transposed view, goes through staging instead.
    src, dst = actors[:2], actors[4:6]
    shape = (256, 512)
    src_l, dst_l = L([0, 1], Shard(0)), L([0, 1], Shard(0))
    full = torch.randn(shape)
    plain = rr.TensorSpec(shape, torch.float32, src_l, dst_l)
    ray.get([src[r].set.remote({"w": rr.shard_tensor(full, src_l, r)}) for r in range(2)])
    ray.get([d.set.remote({"w": torch.zeros(128, 512)}) for d in dst])
    with rr.ReshardGroup(src, dst) as group:
        res = group.refit({"w": plain})
    assert _staging(res) == ([0, 0], [0, 0])           # every item in place
    got = ray.get([d.get.remote() for d in dst])
    for r in range(2):
        assert torch.equal(got[r]["w"], rr.shard_tensor(full, dst_l, r))

    spec = rr.TensorSpec(shape, torch.float32, src_l, dst_l,
                         dst_slots={r: rr.Slot("wide", dim=1, offset=3) for r in range(2)})
    ray.get(src[1].__ray_call__.remote(
        lambda self, t: self.tensors.update(w=t.t().contiguous().t()),
        rr.shard_tensor(full, src_l, 1)))
    ray.get([d.set.remote({"wide": torch.zeros(128, 520)}) for d in dst])
    with rr.ReshardGroup(src, dst) as group:
        res = group.refit({"w": spec})
    senders, receivers = _staging(res)
    # source 0 still sends in place, source 1 (transposed) and both strided destinations stage
    assert senders[0] == 0 and senders[1] > 0, senders
    assert all(b > 0 for b in receivers), receivers
    got = ray.get([d.get.remote() for d in dst])
    for r in range(2):
        want = rr.shard_tensor(full, dst_l, r)
        assert torch.equal(got[r]["wide"][:, 3:515], want)
        assert float(got[r]["wide"][:, :3].abs().sum()) == 0


def test_model_recipe_on_actors(actors):
    """A Qwen3-MoE-style model: Megatron PP2 x EP2 x DP2 (fp32) -> vLLM TP2 x DP2 x EP2 (bf16),
    fused qkv / gate_up / stacked experts and padded vocabulary, on real actors."""
    from ray_reshard import models
    from ray_reshard.tools.demo import CONFIG

    config = dict(CONFIG, hidden_size=128, moe_intermediate_size=64, intermediate_size=256,
                  num_attention_heads=4, head_dim=32, vocab_size=1000)
    train, infer = models.Megatron(tp=1, pp=2, ep=2, dp=2), models.VLLM(tp=2, dp=2, ep=2)
    g = torch.Generator().manual_seed(3)
    state = {n: torch.randn(s, generator=g) for n, s in models.hf_parameter_shapes(config).items()}
    specs = models.refit_specs(config, train=train, infer=infer, dtype=torch.bfloat16,
                               train_dtype=torch.float32)
    src, dst = actors[:4], actors[4:]
    ray.get([a.set.remote(models.local_state(config, train, "src", r, state, dtype=torch.float32))
             for r, a in enumerate(src)])
    ray.get([a.set.remote(models.empty_storage(config, infer, r, fill=-1.0)) for r, a in enumerate(dst)])
    with rr.ReshardGroup(src, dst, bucket_bytes=1 << 16) as group:
        res = group.refit(specs)
        assert res.bytes_by_path["network"] == res.plan_stats.min_network_bytes
    got = ray.get([a.get.remote() for a in dst])
    for r in range(4):
        want = models.local_state(config, infer, "dst", r, state, dtype=torch.bfloat16)
        pad = models.padding_mask(config, infer, r)
        for name, w in want.items():
            g_ = got[r][name]
            mask = pad.get(name)
            if mask is not None:
                assert bool((g_[mask] == -1).all()), (r, name)    # padding rows untouched
                assert torch.equal(g_[~mask], w[~mask]), (r, name)
            else:
                assert torch.equal(g_, w), (r, name)


def test_cached_program_sees_in_place_writes_and_rebound_storage(actors):
    """The compiled program keeps its views while storages stay put, and rebuilds them when a
    trainer rebinds a tensor (a new storage, like `param.data = ...`) on either side."""
    src, dst = actors[:2] + actors[4:6], actors[2:4] + actors[6:8]
    specs, fulls = mixed_specs()
    fill(src, specs, fulls, "src")
    fill(dst, specs, fulls, "dst")
    with rr.ReshardGroup(src, dst, bucket_bytes=4096) as group:
        group.refit(specs)
        check(dst, specs, fulls)
        # Same storages, new values written in place: the cached views see them.
        double = lambda actor: any(t.mul_(2) is None for t in actor.tensors.values())
        ray.get([a.__ray_call__.remote(double) for a in src])
        group.refit(specs)
        check(dst, specs, {n: f.to(specs[n].source_dtype) * 2 for n, f in fulls.items()})
        # New storages on both sides (set() clones): the new tensors are read and written.
        fulls2 = {n: f + 1 for n, f in fulls.items()}
        fill(src, specs, fulls2, "src")
        fill(dst, specs, fulls2, "dst")
        group.refit(specs)
        check(dst, specs, fulls2)


def test_checks_rerun_when_a_parameter_is_rebound(actors):
    """Each refit checks the local tensors once; the full check is skipped only while every
    tensor keeps its memory and layout. A parameter rebound in place (`param.data = ...`, the
    same tensor object with new storage) is seen: a right-shaped one is written, a wrong-shaped
    one refuses the refit before any byte moves."""
    src, dst = actors[:2], actors[2:4]
    specs = {"w": rr.TensorSpec((8, 6), torch.float32, L([0, 1], Shard(0)), L([0, 1], Shard(1)))}
    fulls = {"w": torch.randn(8, 6)}
    fill(src, specs, fulls, "src")
    fill(dst, specs, fulls, "dst")
    with rr.ReshardGroup(src, dst) as group:
        group.refit(specs)
        check(dst, specs, fulls)

        def rebind(shape):
            def fn(actor):
                p = torch.nn.Parameter(actor.tensors["w"], requires_grad=False)
                actor.tensors["w"] = p
                p.data = torch.full(shape, -1.0)
                return p.data_ptr()
            return fn

        ray.get(dst[1].__ray_call__.remote(rebind((8, 3))))   # new storage, right shape
        group.refit(specs)
        check(dst, specs, fulls)
        ray.get(dst[1].__ray_call__.remote(rebind((8, 3))))
        group.refit(specs)                                     # a Parameter rebound again
        check(dst, specs, fulls)
        before = ray.get(dst[0].get.remote())["w"].clone()
        # new source values: a refit that ran would change dst rank 0's shard
        fill(src, specs, {"w": fulls["w"] + 1}, "src")
        ray.get(dst[1].__ray_call__.remote(rebind((8, 2))))   # wrong shape: refused
        with pytest.raises(ValueError, match=r"'w' on dst rank 1: local shard has shape"):
            group.refit(specs)
        assert torch.equal(ray.get(dst[0].get.remote())["w"], before)
        ray.get(dst[1].__ray_call__.remote(rebind((8, 3))))   # right again: the new values land
        group.refit(specs)
        check(dst, specs, {"w": fulls["w"] + 1})


@pytest.mark.parametrize("window", [1, 3])
def test_window_bounds_staging(actors, window):
    """`window` network buckets in flight per process: staging never exceeds window buckets,
    and the result is the same whatever the window."""
    src, dst = actors[:4], actors[4:]
    specs, fulls = mixed_specs()
    fill(src, specs, fulls, "src")
    fill(dst, specs, fulls, "dst")
    with rr.ReshardGroup(src, dst, bucket_bytes=2048, window=window) as group:
        assert group.window == window
        res = group.refit(specs)
        check(dst, specs, fulls)
        assert 0 < res.peak_staging_bytes <= window * 2048
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="window must be an int in 1..16"):
            rr.ReshardGroup(src, dst, window=bad)


def test_host_copy_kernel_is_built_when_the_group_forms(cluster):
    """Fresh processes load the compiled host copy pass when they join a group, before any
    refit (a first refit's deadline never pays for a compiler run)."""
    from ray_reshard.execution import host_copy

    fresh = holders(1, 0) + holders(1, 1)
    loaded = lambda actor: host_copy.engine().loaded
    assert ray.get([a.__ray_call__.remote(loaded) for a in fresh]) == [False, False]
    with rr.ReshardGroup(fresh[:1], fresh[1:]):
        assert ray.get([a.__ray_call__.remote(loaded) for a in fresh]) == [True, True]
    for a in fresh:
        ray.kill(a)
