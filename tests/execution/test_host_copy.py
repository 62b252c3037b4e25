"""The host copy engine: contiguous regions of a table copied with one memmove each, in one
compiled pass (or, where it cannot be built, one ctypes call per region)."""
from __future__ import annotations

import pytest
import torch

from ray_reshard.execution import host_copy, regions
from ray_reshard.execution.program import compile_program
from ray_reshard.execution.reference import simulate_refit
from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec, shard_tensor
from ray_reshard.planning import plan
from ray_reshard.planning.moves import Endpoint


def _contiguous(seed):
    g = torch.Generator().manual_seed(seed)
    views, offsets, off = [], [], 0
    for k in range(40):
        dtype = (torch.float32, torch.bfloat16, torch.uint8)[k % 3]
        n = int(torch.randint(1, 300, (), generator=g))
        base = torch.randn(n + 8, generator=g).to(dtype)
        start = int(torch.randint(0, 8, (), generator=g))
        views.append(base[start:start + n])            # contiguous, any alignment
        off = -(-off // 16) * 16
        offsets.append(off)
        off += n * base.element_size()
    return views, offsets, off


@pytest.fixture(params=["compiled", "a call per region"])
def engine(request):
    if request.param == "compiled":
        # CI installs a C++ compiler: a missing pass would silently cost every small item
        assert host_copy.why_not() is None, host_copy.why_not()
        return host_copy.engine()
    e = host_copy.HostMemmove()
    e.why_not = "not built, for this test"
    assert e.kernel() is None
    return e


@pytest.mark.parametrize("seed", range(6))
def test_packs_and_unpacks_like_torch(seed, engine):
    views, offsets, nbytes = _contiguous(seed)
    table = regions.build(views, offsets)
    assert table.covered == list(range(len(views)))
    engine.upload([table], torch.device("cpu"))
    for _ in range(2):                                  # the second pass reuses its calls
        wire = torch.full((nbytes + 64,), 0xAB, dtype=torch.uint8)[16:16 + nbytes]
        engine.copy(table, wire, True)
        for v, off in zip(views, offsets):
            got = wire[off:off + v.numel() * v.element_size()].view(v.dtype)
            assert torch.equal(got, v)
    outs = [torch.zeros_like(v) for v in views]
    back = regions.build(outs, offsets)
    engine.upload([back], torch.device("cpu"))
    engine.copy(back, wire, False)
    for o, v in zip(outs, views):
        assert torch.equal(o, v)


def test_local_copies_like_torch(engine):
    views, _, _ = _contiguous(7)
    outs = [torch.zeros_like(v) for v in views]
    table = regions.build_pairs(outs, views)
    engine.upload([table], torch.device("cpu"))
    engine.copy(table, None, False)
    for o, v in zip(outs, views):
        assert torch.equal(o, v)


def test_a_strided_region_is_refused(engine):
    table = regions.build([torch.zeros(4, 6)[:, :3], torch.zeros(5)], [0, 64])
    with pytest.raises(ValueError, match="one row per region"):
        engine.upload([table], torch.device("cpu"))


def test_parts_put_only_contiguous_regions_on_it_and_refits_stay_exact():
    """A refit whose parts mix contiguous regions (row shards) and strided ones (column
    shards): on CPU the contiguous ones go on memmove tables, the strided ones stay with
    foreach, and every destination ends bit-exact."""
    src = Layout(Mesh([0, 1, 2, 3]), (Shard(0),))
    rows = Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), (Replicate(), Shard(0)))
    cols = Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), (Replicate(), Shard(1)))
    specs = {f"r{i}": TensorSpec((8, 6), torch.float32, src, rows) for i in range(6)}
    specs.update({f"c{i}": TensorSpec((8, 6), torch.bfloat16, src, cols) for i in range(3)})
    p = plan(specs)
    fulls = {n: torch.randn(s.shape).to(s.dtype) for n, s in specs.items()}
    srcs = [{n: shard_tensor(fulls[n], s.src, r).clone() for n, s in specs.items()}
            for r in range(4)]
    dsts = [{n: torch.zeros(s.dst.local_shape(r, s.shape), dtype=s.dtype)
             for n, s in specs.items()} for r in range(4)]
    simulate_refit(p, srcs, dsts, bucket_bytes=1 << 20, engine="auto")
    for r in range(4):
        for n, s in specs.items():
            assert torch.equal(dsts[r][n], shard_tensor(fulls[n], s.dst, r)), (n, r)
    # the source's column-shard items are strided there (half of each row): off the tables
    me = Endpoint("src", 0)
    prog = compile_program(p, [me], 1 << 20)
    views = {k: srcs[0][p.names[k[2]]] for k in prog.held}
    prog.bind(views, engine="auto")
    parts = [part for part in prog.parts() if part.table is not None]
    assert parts, "no part put its contiguous regions on a table"
    assert all((part.table.regions[:, 3:6] == 1).all() for part in parts)
    assert any(part.n_runs > len(part.table.covered) for part in parts)
