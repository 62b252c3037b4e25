"""Pinned error messages: each names the tensor (where there is one) and what was expected."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial as TPartial

from ray_reshard.layout import Layout, Mesh, Replicate, Shard, Slot, TensorSpec, as_placement
from ray_reshard.planning import PlanError, plan
from ray_reshard.planning.canonical import plan_tensor
from ray_reshard.planning.moves import Topology

BF16 = torch.bfloat16


def spec(shape=(8, 4), src=None, dst=None, **kw):
    src = src or Layout.sharded([0, 1], 0)
    dst = dst or Layout.sharded([0, 1, 2, 3], 1)
    return TensorSpec(shape, BF16, src, dst, **kw)


# -------------------------------------------------------------------- placements and meshes


def test_shard_dim_out_of_range_names_tensor_side_and_shape():
    s = spec(shape=(8, 4), dst=Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")),
                                      [Replicate(), Shard(2)]))
    with pytest.raises(ValueError, match=r"'layers\.0\.w' \(dst layout\): placement Shard\(2\) on "
                                         r"mesh dim 'tp' shards tensor dim 2, but the tensor has 2 "
                                         r"dims \(shape \(8, 4\)\)"):
        plan({"layers.0.w": s})


def test_shard_dim_on_scalar():
    s = TensorSpec((), BF16, Layout.sharded([0, 1], 0), Layout.replicated([0]))
    with pytest.raises(ValueError, match=r"'bias' \(src layout\): .* shards tensor dim 0, but the "
                                         r"tensor has 0 dims \(shape \(\)\)"):
        plan({"bias": s})


@pytest.mark.parametrize("dim", [-1, 1.5, "0", True, None])
def test_shard_dim_must_be_non_negative_int(dim):
    with pytest.raises(ValueError, match=r"Shard dim must be a non-negative int, got "):
        Shard(dim)


@pytest.mark.parametrize("block", [0, -2, 2.5])
def test_shard_block_must_be_positive_int(block):
    with pytest.raises(ValueError, match=r"Shard block must be a positive int, got "):
        Shard(0, block=block)


def test_shard_block_too_small_names_tensor():
    s = spec(shape=(10, 4), src=Layout(Mesh([0, 1]), [Shard(0, block=3)]))
    with pytest.raises(ValueError, match=r"'embed' \(src layout\): Shard\(0, block=3\) over mesh "
                                         r"dim 'd0' of size 2 covers 6 of 10 elements of dim 0"):
        plan({"embed": s})


def test_placement_count_must_match_mesh_dims():
    with pytest.raises(ValueError, match=r"Layout has 1 placements \(Shard\(0\),\) for a mesh of "
                                         r"2 dims \{'dp': 2, 'tp': 2\}: give exactly one "
                                         r"placement per mesh dim"):
        Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Shard(0)])
    with pytest.raises(ValueError, match=r"Layout has 3 placements .* for a mesh of 1 dims"):
        Layout(Mesh([0, 1]), [Shard(0), Replicate(), Replicate()])


def test_rank_twice_in_mesh():
    with pytest.raises(ValueError, match=r"rank 1 appears twice in mesh \[\[0, 1\], \[1, 2\]\]"):
        Mesh([[0, 1], [1, 2]])


@pytest.mark.parametrize("bad", [-1, 1.0, "3", True, None, 2.5])
def test_mesh_entries_must_be_non_negative_ints(bad):
    with pytest.raises(ValueError, match=r"Mesh entries must be non-negative ints, got "):
        Mesh([0, bad])


def test_mesh_must_be_rectangular_and_non_empty():
    with pytest.raises(ValueError, match=r"Mesh must be a rectangular grid of ranks"):
        Mesh([[0, 1], [2]])
    with pytest.raises(ValueError, match=r"Mesh must hold at least one rank"):
        Mesh([])
    with pytest.raises(ValueError, match=r"Mesh needs at least one dim, got the scalar 3"):
        Mesh(3)
    with pytest.raises(ValueError, match=r"Mesh of 2 dims \(2, 2\) got 1 dim_names \('tp',\)"):
        Mesh([[0, 1], [2, 3]], ("tp",))
    with pytest.raises(ValueError, match=r"Mesh dim_names must be distinct"):
        Mesh([[0, 1], [2, 3]], ("tp", "tp"))


def test_partial_refused():
    with pytest.raises(ValueError, match=r"Partial placements cannot be resharded: the tensor is a "
                                         r"pending reduction\. Reduce it first"):
        Layout(Mesh([0, 1]), [Replicate()] * 0 + [TPartial()])


def test_unsupported_placement_type():
    with pytest.raises(TypeError, match=r"Unsupported placement 'S0': expected Shard\(dim\) or "
                                        r"Replicate\(\)"):
        as_placement("S0")


def test_layout_needs_a_mesh():
    with pytest.raises(TypeError, match=r"Layout needs a ray_reshard Mesh, got list"):
        Layout([0, 1], [Shard(0)])


# -------------------------------------------------------------------------------- specs


@pytest.mark.parametrize("bad", [-1, 2.0, "4", True, None])
def test_shape_must_hold_non_negative_ints(bad):
    with pytest.raises(ValueError, match=r"shape \(8, .*\) must hold non-negative ints, got "):
        spec(shape=(8, bad))


def test_shape_must_be_a_tuple():
    with pytest.raises(TypeError, match=r"shape must be a tuple of ints, got 8"):
        spec(shape=8)


def test_shape_accepts_numpy_and_torch_sizes():
    import numpy as np

    assert spec(shape=(np.int64(8), 4)).shape == (8, 4)
    assert spec(shape=torch.Size([8, 4])).shape == (8, 4)
    assert spec(shape=[8, 4]).shape == (8, 4)


def test_spec_field_types():
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype, got 'bf16'"):
        TensorSpec((8, 4), "bf16", Layout.sharded([0, 1], 0), Layout.sharded([0], 0))
    with pytest.raises(TypeError, match=r"src_dtype must be a torch\.dtype, got 'fp32'"):
        spec(src_dtype="fp32")
    with pytest.raises(TypeError, match=r"src must be a Layout, got Mesh"):
        TensorSpec((8, 4), BF16, Mesh([0, 1]), Layout.sharded([0], 0))
    with pytest.raises(TypeError, match=r"dst must be a Layout or LayoutUnion, got NoneType"):
        TensorSpec((8, 4), BF16, Layout.sharded([0], 0), None)
    with pytest.raises(TypeError, match=r"slot for rank 0 must be a Slot, got str"):
        spec(dst_slots={0: "qkv"})


def test_slot_outside_mesh_names_tensor():
    s = spec(dst_slots={7: Slot("qkv", dim=0)})
    with pytest.raises(ValueError, match=r"'attn\.q': dst_slots names rank 7, which is not in the "
                                         r"dst mesh \[0, 1, 2, 3\]"):
        plan({"attn.q": s})


# ------------------------------------------------------------------------------ plan()


def test_mesh_rank_beyond_domains_names_tensor():
    specs = {"a": spec(), "b": spec(src=Layout.sharded([0, 4], 0))}
    with pytest.raises(ValueError, match=r"'b': the src mesh uses rank 4, but the src side has only "
                                         r"4 ranks \(0\.\.3\)"):
        plan(specs, src_domains=["n0", "n0", "n1", "n1"])
    with pytest.raises(ValueError, match=r"'a': the dst mesh uses rank 3, but the dst side has only "
                                         r"2 ranks \(0\.\.1\)"):
        plan(specs, dst_domains=[0, 0])
    with pytest.raises(ValueError, match=r"the dst mesh uses rank 3, but the dst side has only 3"):
        plan(specs, n_dst=3)


def test_domain_and_device_lists_must_agree():
    with pytest.raises(ValueError, match=r"src_devices has 3 entries but src_domains has 4"):
        plan({"a": spec()}, src_domains=[0, 0, 1, 1], src_devices=[0, 1, 2])
    with pytest.raises(ValueError, match=r"dst_domains has 5 entries but n_dst=4"):
        plan({"a": spec()}, dst_domains=[0] * 5, n_dst=4)


def test_domain_ids_must_be_hashable():
    with pytest.raises(TypeError, match=r"src_domains entries must be hashable, got \[0\]"):
        plan({"a": spec()}, src_domains=[[0], [0]])


def test_empty_spec_set():
    with pytest.raises(ValueError, match=r"empty spec set: nothing to refit"):
        plan({})


def test_plan_argument_types():
    with pytest.raises(TypeError, match=r"specs must be a mapping of name -> TensorSpec, got list"):
        plan([spec()])
    with pytest.raises(TypeError, match=r"'w': expected a TensorSpec, got dict"):
        plan({"w": {"shape": (8, 4)}})
    with pytest.raises(TypeError, match=r"tensor names must be non-empty strings, got 3"):
        plan({3: spec()})
    with pytest.raises(TypeError, match=r"tensor names must be non-empty strings, got ''"):
        plan({"": spec()})


def test_bucket_bytes_must_be_positive():
    p = plan({"w": spec()})
    with pytest.raises(ValueError, match=r"bucket_bytes must be positive, got 0"):
        p.schedule(0)


def test_plan_tensor_rank_beyond_topology():
    s = spec()
    topo = Topology.make(2, 3)
    with pytest.raises(PlanError, match=r"the dst mesh uses rank 3, but the topology has only 3 "
                                        r"dst ranks \(0\.\.2\)"):
        plan_tensor(s.signature, topo)


def test_slots_checked_for_every_spec_sharing_a_signature():
    good = spec()
    bad = spec(dst_slots={9: Slot("fused")})
    assert good.signature == bad.signature
    with pytest.raises(ValueError, match=r"'second': dst_slots names rank 9"):
        plan({"first": good, "second": bad})
