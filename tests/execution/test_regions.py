"""Copy tables: a part's regions described as rows of bytes and copied in one launch.

The table is checked here by running it on host memory (`regions.HostCopy`, one memmove per
row piece, the same indexing as the CUDA kernel) against torch's own copies; the kernel itself
runs in the `gpu` tests and the GPU check script.
"""
from __future__ import annotations

import ctypes
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

import ray_reshard as rr
from ray_reshard.execution import regions
from ray_reshard.execution.reference import simulate_refit
from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec, shard_tensor
from ray_reshard.planning import plan


def _reference_pack(views, offsets, nbytes):
    wire = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    for v, off in zip(views, offsets):
        b = torch.empty(v.shape, dtype=v.dtype).copy_(v.cpu()).reshape(-1).view(torch.uint8)
        wire[off:off + b.numel()] = b
    return wire


def _views(seed, device="cpu"):
    """Strided views of several tensors (slices, steps, transposes, broadcasts), odd sizes and
    offsets, and the wire offsets of their back-to-back layout."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    views, offsets, off = [], [], 0
    for _ in range(rng.randint(1, 12)):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64, torch.uint8, torch.int16])
        ndim = rng.randint(1, 4)
        shape = [rng.randint(1, 9) for _ in range(ndim)]
        base = torch.randint(0, 250, shape, generator=g).to(dtype).to(device)
        idx = []
        for n in shape:
            a = rng.randint(0, n - 1)
            b = rng.randint(a + 1, n)
            idx.append(slice(a, b, rng.choice([1, 1, 2])))
        v = base[tuple(idx)]
        if ndim >= 2 and rng.random() < 0.3:
            v = v.transpose(0, ndim - 1)
        if rng.random() < 0.1:
            v = v.unsqueeze(0).expand(2, *v.shape)
        es = v.element_size()
        off = (off + es - 1) // es * es + rng.choice([0, 0, es, 16])
        views.append(v)
        offsets.append(off)
        off += v.numel() * es
    return views, offsets, off


def test_rows_of_coalesces_dense_dims():
    t = torch.zeros(4, 6, 8)
    assert regions.rows_of(t) == (4 * 6 * 8 * 4, [], [])
    assert regions.rows_of(t[:, 1:3]) == (2 * 8 * 4, [4], [6 * 8 * 4])
    assert regions.rows_of(t[:, :, 2:5]) == (3 * 4, [4 * 6], [8 * 4])
    # A transposed view has no dense inner dim: rows of one element.
    assert regions.rows_of(t[0].t()) == (4, [8, 6], [4, 8 * 4])
    # Size-one dims are dropped; more than three outer dims is left to the caller.
    assert regions.rows_of(t[1:2, :, :1]) == (4, [6], [8 * 4])
    assert regions.rows_of(torch.zeros(3, 3, 3, 3)[..., ::2]) == (4, [27, 2], [12, 8])
    assert regions.rows_of(torch.zeros(3, 3, 3, 3, 3)[::2, ::2, ::2, ::2, ::2]) is None


@pytest.mark.parametrize("seed", range(40))
def test_host_copy_packs_and_unpacks_like_torch(seed):
    views, offsets, nbytes = _views(seed)
    table = regions.build(views, offsets)
    described = [k for k, v in enumerate(views) if v.numel() and regions.rows_of(v) is not None]
    assert table.covered == described
    engine = regions.HostCopy()
    engine.upload([table], torch.device("cpu"))
    wire = torch.full((nbytes + 32,), 0xAB, dtype=torch.uint8)[:nbytes]
    assert wire.data_ptr() % regions.WIRE_ALIGN == 0
    engine.copy(table, wire, True)
    want = _reference_pack([views[k] for k in described], [offsets[k] for k in described], nbytes)
    assert torch.equal(wire, want)
    assert table.nbytes == sum(views[k].numel() * views[k].element_size() for k in described)
    # Unpack into fresh, differently strided destinations (no broadcast dims there).
    outs = []
    for k in described:
        v = views[k]
        if 0 in v.stride():
            continue
        big = torch.zeros([n + 2 for n in v.shape], dtype=v.dtype)
        outs.append((k, big[tuple(slice(1, 1 + n) for n in v.shape)]))
    if outs:
        back = regions.build([o for _, o in outs], [offsets[k] for k, _ in outs])
        engine.upload([back], torch.device("cpu"))
        engine.copy(back, wire, False)
        for k, o in outs:
            assert torch.equal(o, views[k])


def test_chunks_cut_wide_rows_and_group_narrow_ones():
    flat = torch.arange(1 << 16, dtype=torch.float32)           # one 256 KiB row
    narrow = torch.zeros(1000, 8)[:, :2]                       # 1000 rows of 8 bytes
    table = regions.build([flat, narrow], [0, flat.numel() * 4])
    rows = {k: [c for c in table.chunks.tolist() if c[0] == k] for k in (0, 1)}
    assert len(rows[0]) == (1 << 18) // regions.CHUNK_BYTES
    assert all(c[2] == 1 for c in rows[0])
    assert sum(c[2] for c in rows[1]) == 1000 and len(rows[1]) == 1
    assert table.regions[0, 12] == 16 and table.regions[1, 12] == 8


def test_tables_upload_together_each_at_its_own_addresses():
    tables = [regions.build(*_views(seed)[:2]) for seed in range(5)]
    regions.upload(tables, torch.device("cpu"))
    buffer = tables[0].device_data[0]
    for t in tables:
        data, reg_at, chunks_at = t.device_data
        assert data is buffer
        for at, want in ((reg_at, t.regions), (chunks_at, t.chunks)):
            got = np.ctypeslib.as_array((ctypes.c_int64 * want.size).from_address(at))
            assert np.array_equal(got.reshape(want.shape), want)


def test_unaligned_wire_is_refused():
    table = regions.build([torch.zeros(8)], [0])
    engine = regions.HostCopy()
    engine.upload([table], torch.device("cpu"))
    with pytest.raises(ValueError, match="aligned"):
        engine.copy(table, torch.zeros(64, dtype=torch.uint8)[1:33], True)


def _layouts_case():
    src = Layout(Mesh([[0, 1], [2, 3]], ("dp", "tp")), (Replicate(), Shard(0)))
    dst = Layout(Mesh([0, 1, 2], ("tp",)), (Shard(1),))
    specs = {"w": TensorSpec((12, 18), torch.float32, src, dst),
             "b": TensorSpec((12, 5, 3), torch.bfloat16, src, dst),
             "h": TensorSpec((18, 6), torch.bfloat16, src, dst, src_dtype=torch.float32)}
    return specs, plan(specs, src_domains=["a", "a", "b", "b"], dst_domains=["a", "b", "b"],
                       dst_devices=[0, 1, 2], src_devices=[0, 3, 4, 5])


class CountingCopy(regions.HostCopy):
    """The host engine, counting the tables it runs (between a bucket and regions, and local)."""

    def __init__(self):
        self.wire = self.local = 0

    def copy(self, table, wire, to_wire):
        if wire is None:
            self.local += 1
        else:
            self.wire += 1
        super().copy(table, wire, to_wire)


def _refit_both_ways(p, specs, bucket, processes=None):
    """The same refit with foreach copies and with copy tables (host engine): the destinations
    of each, the engine, and the bytes moved per path."""
    fulls = {n: torch.randn(s.shape).to(s.src_dtype or s.dtype) for n, s in specs.items()}
    engine = CountingCopy()
    got = {}
    for e in (None, engine):
        src = [{n: shard_tensor(fulls[n], s.src, r).clone() for n, s in specs.items()}
               for r in range(4)]
        dst = [{n: torch.zeros(s.dst.local_shape(r, s.shape), dtype=s.dtype)
                for n, s in specs.items()} for r in range(3)]
        moved = simulate_refit(p, src, dst, bucket_bytes=bucket, engine=e, processes=processes)
        got[e is None] = dst
    for r in range(3):
        for n, s in specs.items():
            want = shard_tensor(fulls[n].to(s.dtype), s.dst, r)
            assert torch.equal(got[True][r][n], want), (n, r)
            assert torch.equal(got[False][r][n], want), (n, r)
    return engine, moved


@pytest.mark.parametrize("bucket", [1 << 20, 96])
def test_refit_with_copy_tables_is_bit_exact(bucket):
    """Whole refits with every part's regions on copy tables (run on the host) match the
    foreach path and the truth, small buckets (many parts, items cut across them) included."""
    specs, p = _layouts_case()
    engine, _ = _refit_both_ways(p, specs, bucket)
    assert engine.wire > 0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_cuda_kernel_packs_and_unpacks_like_torch(seed):
    from ray_reshard.execution import cuda_copy
    assert cuda_copy.available(), cuda_copy.why_not()
    views, offsets, nbytes = _views(seed, "cuda")
    table = regions.build(views, offsets)
    engine = cuda_copy.engine()
    engine.upload([table], torch.device("cuda"))
    wire = torch.full((nbytes,), 0xAB, dtype=torch.uint8, device="cuda")
    engine.copy(table, wire, True)
    torch.cuda.synchronize()
    described = table.covered
    want = _reference_pack([views[k] for k in described], [offsets[k] for k in described], nbytes)
    assert torch.equal(wire.cpu(), want)
    outs = [(k, torch.zeros([n + 2 for n in views[k].shape], dtype=views[k].dtype,
                            device="cuda")[tuple(slice(1, 1 + n) for n in views[k].shape)])
            for k in described if 0 not in views[k].stride()]
    if outs:
        back = regions.build([o for _, o in outs], [offsets[k] for k, _ in outs])
        engine.upload([back], torch.device("cuda"))
        engine.copy(back, wire, False)
        torch.cuda.synchronize()
        for k, o in outs:
            assert torch.equal(o, views[k])


HOST_SHIM = """
#include <cstdint>
struct uint4 { unsigned int x, y, z, w; };
struct Index { unsigned int x; };
static Index threadIdx, blockIdx, blockDim;
#define __global__
#define __device__
%s
extern "C" void run_blocks(const long long* regions, const long long* chunks, long long n,
                           long long wire, long long to_wire, int threads) {
    blockDim.x = threads;
    for (long long b = 0; b < n; b++) {
        blockIdx.x = (unsigned int) b;
        for (int t = 0; t < threads; t++) {
            threadIdx.x = t;
            copy_table(regions, chunks, wire, to_wire);
        }
    }
}
"""


@pytest.fixture(scope="module")
def kernel_on_host(tmp_path_factory):
    """The CUDA kernel's own source compiled for the host (every block and thread run in
    turn), so its indexing is checked here against torch without a GPU."""
    from ray_reshard.execution import cuda_copy
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++ on PATH) to build the kernel for the host")
    d = tmp_path_factory.mktemp("kernel")
    (d / "k.cpp").write_text(HOST_SHIM % cuda_copy.SOURCE)
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(d / "k.so"))
    lib.run_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                               ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int]
    return lib


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("threads", [1, 7, 256])
def test_kernel_source_run_on_the_host_packs_like_torch(kernel_on_host, seed, threads):
    views, offsets, nbytes = _views(seed)
    table = regions.build(views, offsets)
    reg = np.ascontiguousarray(table.regions)
    chunks = np.ascontiguousarray(table.chunks)
    wire = torch.full((nbytes + 32,), 0xAB, dtype=torch.uint8)[:nbytes]
    kernel_on_host.run_blocks(reg.ctypes.data, chunks.ctypes.data, len(chunks), wire.data_ptr(),
                              1, threads)
    described = table.covered
    want = _reference_pack([views[k] for k in described], [offsets[k] for k in described], nbytes)
    assert torch.equal(wire, want)
    outs = [(k, torch.zeros([n + 2 for n in views[k].shape], dtype=views[k].dtype)[
        tuple(slice(1, 1 + n) for n in views[k].shape)])
        for k in described if 0 not in views[k].stride()]
    if outs:
        back = regions.build([o for _, o in outs], [offsets[k] for k, _ in outs])
        reg, chunks = np.ascontiguousarray(back.regions), np.ascontiguousarray(back.chunks)
        kernel_on_host.run_blocks(reg.ctypes.data, chunks.ctypes.data, len(chunks),
                                  wire.data_ptr(), 0, threads)
        for k, o in outs:
            assert torch.equal(o, views[k])


def test_kernel_source_on_the_host_wide_rows_and_three_outer_dims(kernel_on_host):
    g = torch.Generator().manual_seed(3)
    big = torch.randn(100_000, generator=g)                        # rows cut into chunks
    four = torch.randn(5, 7, 7, 8, generator=g)[1:4, ::2, 1:6, :6]  # three outer dims
    odd = torch.randint(0, 255, (50, 33), generator=g, dtype=torch.uint8)[:, 1:30]  # vec 1
    views = [big, four, odd]
    offsets = [0, big.numel() * 4, big.numel() * 4 + four.numel() * 4]
    nbytes = offsets[-1] + odd.numel()
    table = regions.build(views, offsets)
    assert table.covered == [0, 1, 2]
    assert regions.rows_of(four)[1] == [3, 4, 5]
    reg, chunks = np.ascontiguousarray(table.regions), np.ascontiguousarray(table.chunks)
    wire = torch.zeros(nbytes, dtype=torch.uint8)
    kernel_on_host.run_blocks(reg.ctypes.data, chunks.ctypes.data, len(chunks), wire.data_ptr(),
                              1, 64)
    assert torch.equal(wire, _reference_pack(views, offsets, nbytes))


def _pairs(seed):
    """Local copies: random strided sources (as `_views`) and destinations of the same shapes
    laid out otherwise (padded, some transposed)."""
    rng = random.Random(seed + 1000)
    src = [v for v in _views(seed)[0] if 0 not in v.stride() or v.numel() == 0]
    dst = []
    for v in src:
        if v.dim() >= 2 and rng.random() < 0.4:
            big = torch.zeros([n + 1 for n in reversed(v.shape)], dtype=v.dtype)
            d = big[tuple(slice(0, n) for n in reversed(v.shape))]
            dst.append(d.permute(*reversed(range(v.dim()))))
        else:
            big = torch.zeros([n + rng.randint(0, 2) for n in v.shape], dtype=v.dtype)
            dst.append(big[tuple(slice(0, n) for n in v.shape)])
    return dst, src


@pytest.mark.parametrize("seed", range(30))
def test_local_copy_tables_copy_like_torch(seed):
    dst, src = _pairs(seed)
    table = regions.build_pairs(dst, src)
    assert not table.wire
    engine = regions.HostCopy()
    engine.upload([table], torch.device("cpu"))
    engine.copy(table, None, False)
    for k in table.covered:
        assert torch.equal(dst[k], src[k])
    assert table.covered == [k for k, d in enumerate(dst) if d.numel()
                             and regions.joint_rows(d.shape, d.element_size(), d.stride(),
                                                    src[k].stride()) is not None]


@pytest.mark.parametrize("seed", range(16))
def test_kernel_source_on_the_host_copies_locally_like_torch(kernel_on_host, seed):
    dst, src = _pairs(seed)
    table = regions.build_pairs(dst, src)
    reg, chunks = np.ascontiguousarray(table.regions), np.ascontiguousarray(table.chunks)
    kernel_on_host.run_blocks(reg.ctypes.data, chunks.ctypes.data, len(chunks), 0, 0, 32)
    for k in table.covered:
        assert torch.equal(dst[k], src[k])


def test_colocated_refit_copies_locally_through_copy_tables():
    """Sources and destinations sharing processes (colocated): the local copies go through
    copy tables of region pairs (one launch per step), bit-exact with the foreach path."""
    from ray_reshard.planning.moves import Endpoint
    specs, _ = _layouts_case()
    p = plan(specs, src_domains=["a", "a", "b", "b"], dst_domains=["a", "a", "b"],
             src_devices=[0, 1, 2, 3], dst_devices=[0, 1, 2])
    processes = [[Endpoint("src", r), Endpoint("dst", r)] for r in range(3)] + [
        [Endpoint("src", 3)]]
    engine, moved = _refit_both_ways(p, specs, 256, processes)
    assert moved["local"] > 0 and engine.local > 0


@pytest.mark.gpu
def test_cuda_kernel_copies_locally_like_torch():
    from ray_reshard.execution import cuda_copy
    assert cuda_copy.available(), cuda_copy.why_not()
    a = torch.randn(64, 96, device="cuda")
    b = torch.randn(8, 16, 32, device="cuda").to(torch.bfloat16)
    src = [a[:, 5:37], a.t()[3:40, 1:60], b[:, 2:9, ::2], b.reshape(-1)[7:1031]]
    dst = [torch.zeros(64, 40, device="cuda")[:, 4:36],
           torch.zeros(64, 50, device="cuda").t()[:37, :59],
           torch.zeros(9, 10, 20, device="cuda", dtype=torch.bfloat16)[1:, 2:9, 3:19],
           torch.zeros(2048, device="cuda", dtype=torch.bfloat16)[16:1040]]
    table = regions.build_pairs(dst, src)
    assert table.covered == [0, 1, 2, 3]
    engine = cuda_copy.engine()
    engine.upload([table], torch.device("cuda"))
    engine.copy(table, None, False)
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


@pytest.mark.gpu
@pytest.mark.parametrize("bucket", [1 << 20, 256])
def test_cuda_refits_with_copy_tables_are_bit_exact(bucket):
    """Whole refits on the GPU (the default engine: copy tables), colocated processes included."""
    from ray_reshard.execution import cuda_copy
    from ray_reshard.planning.moves import Endpoint
    assert cuda_copy.available(), cuda_copy.why_not()
    specs, _ = _layouts_case()
    p = plan(specs, src_domains=["a", "a", "b", "b"], dst_domains=["a", "a", "b"],
             src_devices=[0, 1, 2, 3], dst_devices=[0, 1, 2])
    fulls = {n: torch.randn(s.shape, device="cuda").to(s.src_dtype or s.dtype)
             for n, s in specs.items()}
    for processes in (None, [[Endpoint("src", r), Endpoint("dst", r)] for r in range(3)]
                      + [[Endpoint("src", 3)]]):
        src = [{n: shard_tensor(fulls[n], s.src, r).clone() for n, s in specs.items()}
               for r in range(4)]
        dst = [{n: torch.zeros(s.dst.local_shape(r, s.shape), dtype=s.dtype, device="cuda")
                for n, s in specs.items()} for r in range(3)]
        simulate_refit(p, src, dst, bucket_bytes=bucket, processes=processes)
        torch.cuda.synchronize()
        for r in range(3):
            for n, s in specs.items():
                assert torch.equal(dst[r][n], shard_tensor(fulls[n].to(s.dtype), s.dst, r))


def test_a_bucket_the_table_cannot_use_is_copied_with_foreach():
    """A staging view not aligned for the table (or on another device) falls back to foreach
    for every region, with the same bytes."""
    from ray_reshard.execution.program import SEND, compile_program
    from ray_reshard.execution.pack import shard_view
    from ray_reshard.planning.moves import Endpoint
    specs, p = _layouts_case()
    fulls = {n: torch.randn(s.shape).to(s.src_dtype or s.dtype) for n, s in specs.items()}
    store = {n: shard_tensor(fulls[n], s.src, 0).clone() for n, s in specs.items()}
    engine = CountingCopy()
    prog = compile_program(p, [Endpoint("src", 0)], 1 << 20)
    prog.bind({k: shard_view(p, *k, store) for k in prog.held}, engine=engine)
    step = next(s for s in prog.steps if s.kind == SEND and s.send.table is not None)
    aligned = torch.zeros(step.nbytes + 16, dtype=torch.uint8)[:step.nbytes]
    step.send.pack(aligned)
    assert engine.wire == 1
    odd = torch.zeros(step.nbytes + 16, dtype=torch.uint8)[8:step.nbytes + 8]
    step.send.pack(odd)
    assert engine.wire == 1 and torch.equal(odd, aligned)
