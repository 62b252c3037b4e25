"""Meshes, placements, boxes and layouts: torch.chunk semantics, nesting like DTensor, dtypes,
torch's own placement objects, DeviceMesh/DTensor import, hashing and pickling."""
from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ray_reshard.layout import (Box, Layout, Mesh, Replicate, Shard, Slot, TensorSpec,
                                as_placement, assemble, shard_tensor)

ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
              torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
              torch.uint32, torch.uint64]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, for bit-exact comparison of any dtype (NaN, float8 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def random_full(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, int(np.prod(shape))) * torch.empty((), dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8)
    n = int(np.prod(shape))
    return raw.view(dtype)[:n].reshape(shape).clone()


# --------------------------------------------------------------------------------- meshes


def test_mesh_any_subset_and_order():
    m = Mesh([[7, 2], [5, 0]], ("pp", "tp"))
    assert m.shape == (2, 2) and m.ndim == 2 and m.size == 4
    assert m.ranks == (7, 2, 5, 0)
    assert m.coords(7) == (0, 0) and m.coords(0) == (1, 1) and m.coords(5) == (1, 0)
    assert m.coords(3) is None
    assert m.dim_index("tp") == 1 and m.dim_index(0) == 0
    with pytest.raises(KeyError, match="no dim named 'ep'"):
        m.dim_index("ep")
    assert "7" in repr(m) and "pp" in repr(m)


def test_mesh_from_shape_and_numpy_input():
    m = Mesh.from_shape((2, 3), start=16)
    assert m.ranks == tuple(range(16, 22)) and m.shape == (2, 3)
    assert Mesh(np.arange(6).reshape(2, 3)) == Mesh.from_shape((2, 3))
    assert Mesh(torch.arange(4).tolist()) == Mesh([0, 1, 2, 3])
    m3 = Mesh.from_shape((2, 1, 2))
    assert m3.coords(3) == (1, 0, 1)


def test_mesh_equality_depends_on_order_and_names():
    assert Mesh([0, 1]) != Mesh([1, 0])
    assert Mesh([0, 1], ("a",)) != Mesh([0, 1], ("b",))
    assert Mesh([[0, 1]]) != Mesh([0, 1])
    assert hash(Mesh([0, 1], ("a",))) == hash(Mesh([0, 1], ("a",)))


# ----------------------------------------------------------------------------- placements


@pytest.mark.parametrize("n", list(range(0, 13)))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7])
def test_shard_follows_torch_chunk(n, k):
    """Uneven shards follow torch.chunk (and DTensor): ceil-sized blocks, trailing empty ones."""
    x = torch.arange(n)
    chunks = list(torch.chunk(x, k)) if n else []
    chunks += [x[n:]] * (k - len(chunks))       # torch.chunk drops trailing empty chunks
    lay = Layout(Mesh(list(range(k))), [Shard(0)])
    boxes = lay.boxes((n,))
    for r in range(k):
        got = x[boxes[r].slices()]
        assert torch.equal(got, chunks[r]), (n, k, r, boxes[r])
        assert torch.equal(shard_tensor(x, lay, r), chunks[r])
    # Shards tile the dim in rank order
    assert sum(b.numel for b in boxes.values()) == n


@pytest.mark.parametrize("n,k", [(8, 4), (12, 3), (10, 5), (0, 2)])
def test_even_shards_equal_tensor_split(n, k):
    x = torch.arange(n)
    lay = Layout.sharded(range(k), 0)
    for r, part in enumerate(torch.tensor_split(x, k)):
        assert torch.equal(x[lay.box(r, (n,)).slices()], part)


def test_uneven_shards_are_chunk_not_tensor_split():
    # 5 over 4: torch.chunk gives 2,2,1,0; tensor_split would give 2,1,1,1.
    lay = Layout.sharded(range(4), 0)
    assert [lay.local_shape(r, (5,)) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    # 1 element over 3 ranks: two empty shards
    assert [lay.box(r, (1, 3)).numel for r in range(3)] == [3, 0, 0]


@pytest.mark.parametrize("n,k,block", [(10, 4, 3), (129280 // 1000, 4, 33), (7, 2, 4), (5, 3, 5)])
def test_shard_block_matches_tensor_split_at_block_boundaries(n, k, block):
    """Shard(dim, block): blocks of `block` rows, clipped (vLLM's padded vocabulary)."""
    x = torch.arange(n)
    parts = torch.tensor_split(x, [min(block * i, n) for i in range(1, k)])
    lay = Layout(Mesh(list(range(k))), [Shard(0, block=block)])
    lay.validate_for((n,))
    for r in range(k):
        assert torch.equal(x[lay.box(r, (n,)).slices()], parts[r])


def test_placements_from_torch_and_repr():
    assert as_placement(TShard(1)) == Shard(1)
    assert as_placement(TReplicate()) == Replicate()
    mesh = Mesh.from_shape((2, 2))
    assert Layout(mesh, [TReplicate(), TShard(0)]) == Layout(mesh, [Replicate(), Shard(0)])
    assert repr(Shard(0)) == "Shard(0)" and repr(Shard(1, block=4)) == "Shard(1, block=4)"
    assert Shard(0).is_shard() and Shard(0).is_shard(0) and not Shard(0).is_shard(1)
    assert Replicate().is_replicate() and not Replicate().is_shard()
    # A single placement may be given bare for a 1-d mesh
    assert Layout(Mesh([0, 1]), Shard(0)) == Layout(Mesh([0, 1]), [Shard(0)])


def test_partial_refused_with_clear_message():
    with pytest.raises(ValueError, match=r"Partial placements cannot be resharded.*pending "
                                         r"reduction.*redistribute"):
        as_placement(TPartial())
    with pytest.raises(ValueError, match="Partial"):
        Layout(Mesh([0, 1]), [TPartial()])


# ---------------------------------------------------------------------------------- boxes


def test_box_basics():
    b = Box((2, 0), (3, 4))
    assert b.numel == 12 and not b.empty and b.ndim == 2
    assert b.intersect(Box((4, 1), (5, 1))) == Box((4, 1), (1, 1))
    assert b.intersect(Box((5, 0), (1, 4))) is None          # touching is not overlapping
    assert b.contains(Box((3, 1), (2, 2))) and not b.contains(Box((1, 0), (2, 2)))
    assert Box((3, 1), (2, 2)).relative_to(b) == Box((1, 1), (2, 2))
    assert b.slices() == (slice(2, 5), slice(0, 4))
    assert Box.full((3, 0)).empty
    assert repr(b) == "Box[2:5, 0:4]"


def test_box_zero_dim():
    b = Box.full(())
    assert b.numel == 1 and not b.empty and b.slices() == ()
    assert b.intersect(b) == b and b.contains(b)
    assert b.split(4) == [b] and b.chunks(1) == [b]
    x = torch.tensor(3.5)
    assert x[b.slices()].item() == 3.5


@pytest.mark.parametrize("sizes", [(7,), (3, 5), (2, 3, 4), (1, 9, 2)])
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 50])
def test_box_split_tiles(sizes, parts):
    b = Box(tuple(range(1, len(sizes) + 1)), sizes)
    pieces = b.split(parts)
    assert 1 <= len(pieces) <= parts
    assert all(not p.empty and b.contains(p) for p in pieces)
    assert sum(p.numel for p in pieces) == b.numel
    numels = sorted(p.numel for p in pieces)
    assert numels[-1] - numels[0] <= numels[-1] // 8 or \
        numels[-1] - numels[0] <= b.numel // max(b.sizes)          # near-equal slabs


def test_box_split_keeps_row_blocks_contiguous():
    b = Box((0, 0), (1024, 2048))
    assert [p.sizes for p in b.split(2)] == [(512, 2048), (512, 2048)]
    assert [p.sizes for p in Box((0, 0), (3, 64)).split(2)] == [(3, 32), (3, 32)]


@pytest.mark.parametrize("sizes", [(7,), (3, 5), (2, 3, 4), (4, 1, 6)])
@pytest.mark.parametrize("max_numel", [1, 2, 5, 6, 13, 100])
def test_box_chunks_tile_in_row_major_order(sizes, max_numel):
    b = Box((1,) * len(sizes), sizes)
    full = torch.arange(int(np.prod([o + s for o, s in zip(b.offsets, b.sizes)]))).reshape(
        [o + s for o, s in zip(b.offsets, b.sizes)])
    chunks = b.chunks(max_numel)
    assert all(c.numel <= max_numel and b.contains(c) for c in chunks)
    flat = torch.cat([full[c.slices()].reshape(-1) for c in chunks])
    assert torch.equal(flat, full[b.slices()].reshape(-1))          # row-major order, no overlap


def test_box_chunks_are_about_equal():
    assert [c.sizes for c in Box((0, 0), (10, 4)).chunks(16)] == [(3, 4), (3, 4), (4, 4)]
    assert [c.sizes for c in Box((0,), (100,)).chunks(34)] == [(33,), (33,), (34,)]


# -------------------------------------------------------------------------------- layouts


def _nested_chunk_oracle(shape, mesh_shape, placements, coord):
    """Hand oracle: apply torch.chunk per mesh dim in mesh-dim order on index ranges."""
    idx = [torch.arange(n) for n in shape]
    for c, k, p in zip(coord, mesh_shape, placements):
        if isinstance(p, Shard):
            parts = list(torch.chunk(idx[p.dim], k)) if len(idx[p.dim]) else []
            parts += [idx[p.dim][:0]] * (k - len(parts))
            idx[p.dim] = parts[c]
    return idx


MESH_SHAPES = [(1,), (2,), (3,), (4,), (2, 2), (3, 2), (2, 3), (1, 4), (2, 2, 2), (3, 1, 2)]
TENSOR_SHAPES = [(0,), (1,), (5,), (7,), (3, 4), (13, 2), (1, 9), (2, 0, 3), (5, 3, 4)]


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
@pytest.mark.parametrize("shape", TENSOR_SHAPES)
def test_layout_boxes_match_dtensor(mesh_shape, shape):
    """Every placement combination, nested sharding included, against DTensor's own
    local shape / global offset computation and a hand oracle on index ranges; the boxes of
    the whole mesh at once equal them."""
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    ranks = list(range(100, 100 + int(np.prod(mesh_shape))))[::-1]     # any labels, any order
    mesh = Mesh(np.array(ranks).reshape(mesh_shape).tolist())
    for pls in itertools.product(options, repeat=len(mesh_shape)):
        lay = Layout(mesh, pls)
        tpls = [TReplicate() if isinstance(p, Replicate) else TShard(p.dim) for p in pls]
        for i, coord in enumerate(itertools.product(*[range(k) for k in mesh_shape])):
            box = lay.box(ranks[i], shape)
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape,
                                                                   list(coord), tpls)
            assert box.sizes == tuple(local), (pls, coord)
            if not box.empty:
                assert box.offsets == tuple(offset), (pls, coord)
            oracle = _nested_chunk_oracle(shape, mesh_shape, pls, coord)
            assert box.sizes == tuple(len(ix) for ix in oracle)
            for d, ix in enumerate(oracle):
                if len(ix):
                    assert box.offsets[d] == int(ix[0])
        # the whole mesh at once (the planner's path), in mesh order, equals rank by rank
        assert list(lay.boxes(shape).items()) == [(r, lay.box(r, shape)) for r in ranks]


def test_nested_sharding_one_dim_by_two_mesh_dims():
    """(Shard(0), Shard(0)) on a 2x2 mesh: mesh dim 0 splits first, then dim 1 splits each part."""
    lay = Layout(Mesh([[0, 1], [2, 3]]), [Shard(0), Shard(0)])
    x = torch.arange(7)
    got = [x[lay.box(r, (7,)).slices()].tolist() for r in range(4)]
    assert got == [[0, 1], [2, 3], [4, 5], [6]]
    # Placements always nest in mesh-dim order: a transposed rank grid permutes the owners.
    lay_t = Layout(Mesh([[0, 2], [1, 3]]), [Shard(0), Shard(0)])
    got_t = [x[lay_t.box(r, (7,)).slices()].tolist() for r in range(4)]
    assert got_t == [[0, 1], [4, 5], [2, 3], [6]]


def test_ranks_outside_the_mesh_hold_nothing():
    lay = Layout(Mesh([4, 5, 6, 7]), [Shard(0)])          # a pipeline stage over ranks 4..7
    assert lay.box(0, (8, 2)) is None and lay.local_shape(3, (8, 2)) is None
    assert shard_tensor(torch.zeros(8, 2), lay, 1) is None
    assert set(lay.boxes((8, 2))) == {4, 5, 6, 7}
    assert lay.ranks == (4, 5, 6, 7)


def test_zero_dim_tensors():
    full = torch.tensor(2.5)
    lay = Layout(Mesh([[0, 1], [2, 3]]), [Replicate(), Replicate()])
    lay.validate_for(())
    for r in range(4):
        assert lay.box(r, ()) == Box((), ())
        s = shard_tensor(full, lay, r)
        assert s.shape == () and s.item() == 2.5
    assert torch.equal(assemble({r: full.clone() for r in range(4)}, lay, ()), full)
    with pytest.raises(ValueError, match="shards tensor dim 0, but the tensor has 0 dims"):
        Layout(Mesh([0, 1]), [Shard(0)]).validate_for((), "'scalar'")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_shard_and_assemble_every_dtype(dtype):
    shape = (5, 3)
    full = random_full(shape, dtype, seed=3)
    lay = Layout(Mesh([[3, 1], [0, 2]]), [Shard(0), Shard(1)])
    shards = {r: shard_tensor(full, lay, r) for r in lay.ranks}
    for r, s in shards.items():
        assert s.dtype == dtype and s.is_contiguous()
        assert torch.equal(bits(s), bits(full[lay.box(r, shape).slices()]))
    back = assemble(shards, lay, shape)
    assert torch.equal(bits(back), bits(full))
    spec = TensorSpec(shape, dtype, lay, lay)
    assert spec.itemsize == torch.empty((), dtype=dtype).element_size()
    assert spec.nbytes == 15 * spec.itemsize


def test_assemble_detects_missing_and_disagreeing_replicas():
    lay = Layout(Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0)])
    full = torch.arange(8.0).reshape(4, 2)
    shards = {r: shard_tensor(full, lay, r) for r in range(4)}
    assert torch.equal(assemble(shards, lay, (4, 2)), full)
    bad = dict(shards)
    bad[2] = bad[2] + 1
    with pytest.raises(ValueError, match="replica disagrees"):
        assemble(bad, lay, (4, 2))
    with pytest.raises(ValueError, match="held by none"):
        assemble({0: shards[0]}, lay, (4, 2))


# --------------------------------------------------------------- DeviceMesh and DTensor


@pytest.fixture(scope="module")
def fake_world():
    """A fake process group of 16 ranks (no communication), this process being rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    yield
    dist.destroy_process_group()


def test_from_device_mesh(fake_world):
    from torch.distributed.device_mesh import DeviceMesh

    dm = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp"))
    lay = Layout.from_device_mesh(dm, [TReplicate(), TShard(0)])
    assert lay.mesh == Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "tp"))
    assert lay.placements == (Replicate(), Shard(0))
    # A mesh this process is not part of (a later pipeline stage), with a rank map
    dm2 = DeviceMesh("cpu", torch.arange(8, 16).reshape(2, 4), mesh_dim_names=("dp", "tp"))
    lay2 = Layout.from_device_mesh(dm2, [TShard(1), TReplicate()], rank_map=list(range(100, 116)))
    assert lay2.mesh.ranks == tuple(range(108, 116))
    lay3 = Layout.from_device_mesh(dm2, [TShard(1), TReplicate()],
                                   rank_map={8 + i: 7 - i for i in range(8)})
    assert lay3.mesh.ranks == tuple(range(7, -1, -1))
    with pytest.raises(ValueError, match="rank_map has no actor index for process rank 8"):
        Layout.from_device_mesh(dm2, [TShard(1), TReplicate()], rank_map={0: 0})
    with pytest.raises(ValueError, match="Partial"):
        Layout.from_device_mesh(dm, [TPartial(), TShard(0)])


def test_from_dtensor(fake_world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    dm = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp"))
    shape = (17, 3)
    placements = [TShard(1), TShard(0)]
    local, _ = _compute_local_shape_and_global_offset(shape, (2, 4), [0, 0], placements)
    dt = DTensor.from_local(torch.zeros(local), dm, placements, run_check=False,
                            shape=torch.Size(shape), stride=(3, 1))
    rank_map = {i: 10 + i for i in range(8)}
    lay = Layout.from_dtensor(dt, rank_map=rank_map)
    assert lay.mesh.ranks == tuple(range(10, 18)) and lay.mesh.dim_names == ("dp", "tp")
    assert lay.placements == (Shard(1), Shard(0))
    for pr in range(8):
        coord = [pr // 4, pr % 4]
        loc, off = _compute_local_shape_and_global_offset(shape, (2, 4), coord, placements)
        box = lay.box(rank_map[pr], shape)
        assert box.sizes == tuple(loc)
        if not box.empty:
            assert box.offsets == tuple(off)


# ------------------------------------------------------- hashing, equality and pickling


def _layouts():
    return [
        Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Replicate(), Shard(0)]),
        Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Replicate(), Shard(1)]),
        Layout(Mesh([[0, 1], [2, 3]], ("x", "y")), [Replicate(), Shard(0)]),
        Layout(Mesh([[0, 2], [1, 3]], ("dp", "tp")), [Replicate(), Shard(0)]),
        Layout(Mesh([0, 1, 2, 3]), [Shard(0, block=2)]),
        Layout(Mesh([0, 1, 2, 3]), [Shard(0)]),
        Layout.replicated([5, 6]),
    ]


def test_layout_equality_and_hash():
    a, b = _layouts(), _layouts()
    for x, y in zip(a, b):
        assert x == y and hash(x) == hash(y) and x is not y
    for i, j in itertools.combinations(range(len(a)), 2):
        assert a[i] != a[j]
    assert len(set(a) | set(b)) == len(a)
    assert a[0] != "layout"


def test_layout_and_spec_pickle_roundtrip():
    for lay in _layouts():
        hash(lay)                                    # populate any cached hash
        back = pickle.loads(pickle.dumps(lay))
        assert back == lay and hash(back) == hash(lay)
        assert back.boxes((9, 4)) == lay.boxes((9, 4))
    src, dst = _layouts()[0], _layouts()[5]
    spec = TensorSpec((8, 4), torch.bfloat16, src, dst, src_dtype=torch.float32,
                      dst_slots={1: Slot("qkv", dim=0, offset=2)})
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and hash(back) == hash(spec) and back.signature == spec.signature
    assert back.slot("dst", 1, "w") == Slot("qkv", dim=0, offset=2)
    assert back.slot("dst", 0, "w") == Slot("w")
    assert TensorSpec(torch.Size([8, 4]), torch.bfloat16, src, dst).shape == (8, 4)
    # Specs differing only in the source dtype share a signature (one plan)
    plain = TensorSpec((8, 4), torch.bfloat16, src, dst)
    assert plain != spec and plain.signature == spec.signature
    assert TensorSpec((8, 4), torch.float32, src, dst).signature != plain.signature


_CHILD = r"""
import pickle, sys
from ray_reshard.layout import Layout, Mesh, Replicate, Shard
loaded, table = pickle.loads(sys.stdin.buffer.read())
fresh = Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Replicate(), Shard(0)])
assert loaded == fresh, (loaded, fresh)
assert hash(loaded) == hash(fresh), "stale cached hash crossed the process boundary"
assert hash(loaded.mesh) == hash(fresh.mesh)
assert fresh in table and table[fresh] == 1 and {loaded: 2}[fresh] == 2
print("ok")
"""


def test_pickled_layout_hash_is_valid_in_another_process():
    """String hashes differ between processes: a cached hash must not travel in the pickle."""
    lay = Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), [Replicate(), Shard(0)])
    payload = pickle.dumps((lay, {lay: 1}))
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _CHILD], input=payload, capture_output=True,
                         env=env, timeout=120, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr.decode()[-2000:]
