"""The delta codec: every encoding round-trips exactly, the smallest one is chosen, payload
sizes are what `encoded_bytes` predicts; the host kernel (each instruction-set path it has), the
CUDA kernel's source run on the host and the torch path give the same bytes, baselines and
checksums, from packed buckets and from rows of separate regions; malformed payloads are
refused before anything is written; and the GPU paths give the host's bytes."""
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_reshard.execution import codecs, delta as D
from ray_reshard.execution import delta_host

HOST = codecs.host_codec()
TORCH = D.TorchCodec()


def test_the_host_kernel_builds_here():
    # CI installs a C++ compiler: a missing kernel would silently cost the codec's speed
    assert HOST is not None, delta_host.why_not()


def _builds():
    """The kernel's builds to check: native, no vector extension, and AVX2 where the CPU has
    it (on an AVX-512 machine the native build takes the AVX-512 paths)."""
    try:
        avx2 = " avx2" in open("/proc/cpuinfo").read()
    except OSError:
        avx2 = False
    return ["native", "plain"] + (["avx2"] if avx2 else [])


@pytest.fixture(scope="module", params=_builds())
def host(request):
    """The host kernel as built here (the native instruction set) and built for AVX2 and for
    no vector extension, so every path of its source is checked against torch."""
    if request.param == "native":
        return HOST
    flags = ("-O2", "-mavx2") if request.param == "avx2" else ("-O2",)
    return D.HostCodec(delta_host.build(flags))


def bucket(n_bytes, fraction, seed, g=2):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    n = n_bytes // g
    k = int(round(fraction * n))
    if k:
        idx = torch.randperm(n, generator=gen)[:k]
        for b in range(g):                      # change every byte of the chosen granules
            new.view(-1, g)[idx, b] ^= 0x5A
    return base, new, k


def rows_of(new, g, rng):
    """`new`'s bytes copied into separate, oddly placed regions (cut at granule boundaries),
    and their rows (address, bytes) in order."""
    n = new.numel() // g
    cuts = sorted({rng.randrange(0, n) for _ in range(rng.randint(0, 6))} - {0}) + [n]
    regions, prev = [], 0
    for c in cuts:
        t = torch.empty((c - prev) * g + 9 * g, dtype=torch.uint8)
        start = rng.randrange(0, 8) * g
        t = t[start:start + (c - prev) * g]
        t.copy_(new[prev * g:c * g])
        regions.append(t)
        prev = c
    return regions, np.array([[t.data_ptr(), t.numel()] for t in regions], dtype=np.int64)


def roundtrip(codec, new, base, g, src=None):
    """Encode `new` (or its rows `src`) against a copy of `base`, apply the payload onto
    another copy; both end as `new`."""
    kept = base.clone()
    out = torch.full((new.numel(),), 0xEE, dtype=torch.uint8)
    e = codec.encode(new if src is None else src, kept, out, g, probe=True)
    assert torch.equal(kept, new)                    # the baseline holds the new bytes
    if e.kind in (D.MASK, D.INDEX, D.SAME):
        into = base.clone()
        got = codec.apply(e.kind, e.payload, into, g)
        assert torch.equal(into, new)
        assert got == e.check == D.checksum(new, g)
    if e.kind == D.DENSE:
        assert e.nbytes == new.numel() and e.payload is None
    return e


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 3000),
       st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.1, 0.5, 0.9, 1.0]), st.integers(0, 99))
def test_roundtrip_and_smallest_encoding(g, n, fraction, seed):
    base, new, k = bucket(n * g, fraction, seed, g)
    e = roundtrip(HOST, new, base, g)
    kind, size = D.encoded_bytes(n * g, g, k)
    if k == 0:
        assert e.kind == D.SAME and e.nbytes == 0
    elif e.kind != D.DENSE or kind == D.DENSE:
        assert (e.kind, e.nbytes) == (kind, size)
    assert e.nbytes <= n * g


def test_host_kernel_equals_torch(host, monkeypatch):
    """Kinds, payload bytes, baselines and checksums equal torch's for random buckets given as
    rows of separate regions, early 'mostly changed' exits included (small chunks), and
    applying onto rows equals applying onto a packed bucket."""
    monkeypatch.setattr(D, "CHUNK", 256)
    rng = random.Random(5)
    kinds = set()
    for trial in range(100):
        g = rng.choice([1, 2, 4, 8])
        n = rng.randint(1, 6000)
        base, new, _ = bucket(n * g, rng.choice([0, 0.001, 0.02, 0.1, 0.5, 0.85, 1.0]), trial, g)
        if rng.random() < 0.3:                       # changes crowded into the first part
            keep = rng.randint(1, n)
            new.view(-1, g)[keep:] = base.view(-1, g)[keep:]
        regions, rows = rows_of(new, g, rng)
        a, b = base.clone(), base.clone()
        oa = torch.full((n * g,), 1, dtype=torch.uint8)
        ob = torch.full((n * g,), 2, dtype=torch.uint8)
        ea = host.encode(rows, a, oa, g, probe=True)
        eb = TORCH.encode(new, b, ob, g, probe=True)
        assert torch.equal(a, new) and torch.equal(b, new)
        assert (ea.kind, ea.nbytes, ea.check) == (eb.kind, eb.nbytes, eb.check), trial
        kinds.add(ea.kind)
        if ea.kind in (D.MASK, D.INDEX):
            assert torch.equal(ea.payload, eb.payload)
        if ea.kind != D.DENSE:
            dst, drows = rows_of(base, g, rng)
            got = host.apply(ea.kind, ea.payload, drows, g)
            assert torch.equal(torch.cat(dst), new)
            into = base.clone()
            assert TORCH.apply(eb.kind, eb.payload, into, g) == got == ea.check
            assert torch.equal(into, new)
    assert kinds == {D.SAME, D.MASK, D.INDEX, D.DENSE}


def test_special_values_are_bytes(host):
    """+0.0 / -0.0 and NaNs with different payloads are different bytes: they travel."""
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 64, dtype=torch.float32)
    new = base.clone()
    new[0] = -0.0
    bits = new.view(torch.int32)
    bits[1] = bits[1] ^ 1                            # another NaN payload
    e = roundtrip(host, new.view(torch.uint8), base.view(torch.uint8), 4)
    assert e.kind == D.INDEX and e.changed == 2


def test_many_chunks_and_a_ragged_tail(monkeypatch):
    monkeypatch.setattr(D, "CHUNK", 1024)          # ten chunks and a ragged last one
    for fraction in (0.0, 0.002, 0.1, 0.6):
        base, new, _ = bucket(2 * 10_007, fraction, 3)
        roundtrip(HOST, new, base, 2)
        roundtrip(TORCH, new, base, 2)


def test_kinds_follow_density():
    n = 1 << 16
    kinds = {}
    for fraction in (0.0, 0.001, 0.1, 1.0):
        base, new, _ = bucket(2 * n, fraction, 1)
        kinds[fraction] = codecs.encode(new, base.clone(), 2).kind
    assert kinds == {0.0: D.SAME, 0.001: D.INDEX, 0.1: D.MASK, 1.0: D.DENSE}


def test_mostly_changed_stops_early_and_keeps_the_baseline_whole(monkeypatch):
    monkeypatch.setattr(D, "CHUNK", 1024)
    base, new, _ = bucket(2 * 64 * 1024, 0.95, 2)
    kept = base.clone()
    e = HOST.encode(new, kept, torch.empty_like(new), 2)
    assert e.kind == D.DENSE and e.changed < 0.95 * 64 * 1024 * 0.5   # stopped counting
    assert torch.equal(kept, new)
    # deferred: the rest of the baseline waits for finish() (the send is posted first)
    regions, rows = rows_of(new, 2, random.Random(1))
    kept = base.clone()
    e = HOST.encode(rows, kept, torch.empty_like(new), 2, defer=True)
    assert e.kind == D.DENSE and e.rest is not None and not torch.equal(kept, new)
    HOST.finish(e)
    assert torch.equal(kept, new) and e.rest is None


def test_granule_and_prediction():
    assert D.granule(12, 4) == 4 and D.granule(10, 4) == 2 and D.granule(9, 8) == 1
    assert D.granule(16, 3) == 2
    assert D.expected_bytes(1 << 20, 2, 0.0) == 0
    assert D.expected_bytes(1 << 20, 2, 1.0) == 1 << 20
    # 10% of bf16 granules: a bit each plus the changed values, about 0.16 of dense
    assert 0.15 < D.expected_bytes(1 << 20, 2, 0.1) / (1 << 20) < 0.17


@pytest.mark.parametrize("codec", [HOST, TORCH], ids=["host", "torch"])
def test_apply_refuses_a_payload_that_does_not_fit(codec):
    for fraction in (0.1, 0.001):                   # a mask, an index payload
        base, new, _ = bucket(2 * 4096, fraction, 4)
        e = codecs.encode(new, base.clone(), 2)
        into = base.clone()
        for bad in (e.payload[:-2], e.payload[:-1], torch.cat([e.payload, e.payload[:2]])):
            with pytest.raises(ValueError):
                codec.apply(e.kind, bad, into, 2)
        assert torch.equal(into, base)              # nothing written
    if e.kind == D.INDEX:                           # indices out of order
        bad = e.payload.clone()
        bad[:8].view(torch.int32)[:] = bad[:8].view(torch.int32).flip(0)
        with pytest.raises(ValueError, match="increasing|fit"):
            codec.apply(D.INDEX, bad, into, 2)


def test_checksum_is_the_granules_sum():
    x = torch.tensor([0xFFFF, 1, 0x8000], dtype=torch.int32).to(torch.int16)
    assert D.checksum(x.view(torch.uint8), 2) == 0xFFFF + 1 + 0x8000
    y = torch.tensor([-1, -1], dtype=torch.int64)
    assert D.checksum(y.view(torch.uint8), 8) == -2              # 2 * (2**64 - 1) mod 2**64
    rows = np.array([[x.data_ptr(), 2], [x.data_ptr() + 2, 4]], dtype=np.int64)
    assert HOST.apply(D.SAME, None, rows, 2) == D.checksum(x.view(torch.uint8), 2)


@pytest.mark.gpu
def test_gpu_encoding_is_the_host_encoding():
    for fraction in (0.0, 0.001, 0.1, 1.0):
        base, new, _ = bucket(2 * 300_001, fraction, 5)
        host_base = base.clone()
        cpu = HOST.encode(new, host_base, torch.empty_like(new), 2, probe=False)
        gbase = base.cuda()
        gpu = TORCH.encode(new.cuda(), gbase, torch.empty_like(gbase), 2)
        assert torch.equal(gbase.cpu(), new)
        assert (gpu.kind, gpu.nbytes, gpu.check) == (cpu.kind, cpu.nbytes, cpu.check)
        if cpu.kind in (D.MASK, D.INDEX):
            assert torch.equal(gpu.payload.cpu(), cpu.payload)
            out = base.cuda()
            assert TORCH.apply(gpu.kind, gpu.payload, out, 2) == cpu.check
            assert torch.equal(out.cpu(), new)


# The CUDA kernel's own source compiled for the host: every block in turn, its threads as real
# threads meeting at __syncthreads (std::barrier), shared memory as statics, atomics as the
# compiler's builtins. Blocks run one after another, so a block's look-back always finds its
# predecessor's count complete (the GPU test runs them concurrently).
CUDA_SHIM = r"""
#include <atomic>
#include <barrier>
#include <cstdint>
#include <thread>
#include <vector>
struct Dim { unsigned int x; };
static thread_local Dim threadIdx;
static Dim blockIdx, blockDim;
static std::barrier<>* rr_barrier;
#define __global__
#define __device__
#define __shared__ static
#define __syncthreads() rr_barrier->arrive_and_wait()
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __ffs(unsigned int x) { return __builtin_ffs(x); }
%s
template <typename F> static void grid(long long blocks, int threads, F f) {
    std::barrier<> bar(threads);
    rr_barrier = &bar;
    blockDim.x = threads;
    for (long long b = 0; b < blocks; b++) {
        blockIdx.x = (unsigned int) b;
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; t++) ts.emplace_back([&, t] { threadIdx.x = t; f(); });
        for (auto& x : ts) x.join();
    }
}
#define RR_HOST(G, T)                                                                       \
static void enc_##G(long long blocks, int threads, void* a, void* b, void* out, long long n, \
        long long vo, long long cap, void* idx, long long idx_cap, void* state) {           \
    grid(blocks, threads, [&] { delta_encode_##G((const T*) a, (T*) b, (unsigned char*) out, \
        n, vo, cap, (int*) idx, idx_cap, (u64*) state); }); }                              \
static void app_##G(long long blocks, int threads, void* dst, void* payload, long long n,    \
        long long vo, long long n_vals, void* state) {                                     \
    grid(blocks, threads, [&] { delta_apply_##G((T*) dst, (const unsigned char*) payload,  \
        n, vo, n_vals, (u64*) state); }); }
RR_HOST(1, unsigned char)
RR_HOST(2, unsigned short)
RR_HOST(4, unsigned int)
RR_HOST(8, unsigned long long)
extern "C" void host_encode(int g, long long blocks, int threads, void* a, void* b, void* out,
        long long n, long long vo, long long cap, void* idx, long long idx_cap, void* state) {
    switch (g) {
    case 1: enc_1(blocks, threads, a, b, out, n, vo, cap, idx, idx_cap, state); break;
    case 2: enc_2(blocks, threads, a, b, out, n, vo, cap, idx, idx_cap, state); break;
    case 4: enc_4(blocks, threads, a, b, out, n, vo, cap, idx, idx_cap, state); break;
    case 8: enc_8(blocks, threads, a, b, out, n, vo, cap, idx, idx_cap, state); break;
    } }
extern "C" void host_apply(int g, long long blocks, int threads, void* dst, void* payload,
        long long n, long long vo, long long n_vals, void* state) {
    switch (g) {
    case 1: app_1(blocks, threads, dst, payload, n, vo, n_vals, state); break;
    case 2: app_2(blocks, threads, dst, payload, n, vo, n_vals, state); break;
    case 4: app_4(blocks, threads, dst, payload, n, vo, n_vals, state); break;
    case 8: app_8(blocks, threads, dst, payload, n, vo, n_vals, state); break;
    } }
"""


@pytest.fixture(scope="module")
def cuda_source_on_host(tmp_path_factory):
    import ctypes
    import shutil
    import subprocess

    from ray_reshard.execution import delta_cuda
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++ on PATH) to build the kernel for the host")
    d = tmp_path_factory.mktemp("delta_cuda")
    (d / "k.cpp").write_text(CUDA_SHIM % delta_cuda.SOURCE)
    subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-o",
                    str(d / "k.so"), str(d / "k.cpp")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(d / "k.so"))
    ll, vp = ctypes.c_longlong, ctypes.c_void_p
    lib.host_encode.argtypes = [ctypes.c_int, ll, ctypes.c_int, vp, vp, vp, ll, ll, ll, vp, ll,
                                vp]
    lib.host_apply.argtypes = [ctypes.c_int, ll, ctypes.c_int, vp, vp, ll, ll, ll, vp]

    def launch(name, blocks, threads, args):
        kind, g = name.rsplit("_", 1)
        (lib.host_encode if kind == "delta_encode" else lib.host_apply)(int(g), blocks, threads,
                                                                        *args)
    return launch


@pytest.mark.parametrize("threads", [1, 4, 8])
def test_cuda_kernel_source_on_the_host_equals_torch(cuda_source_on_host, threads):
    """The CUDA codec (its kernels run on the host, several blocks of `threads`) gives
    torch's kinds, payloads, baselines and checksums, and applies mask payloads exactly."""
    from ray_reshard.execution.delta_cuda import CudaCodec

    cuda = CudaCodec(launch=cuda_source_on_host, threads=threads)
    rng = random.Random(threads)
    kinds = set()
    for trial in range(50):
        g = rng.choice([1, 2, 4, 8])
        n = rng.randint(1, 3000)
        base, new, _ = bucket(n * g, rng.choice([0, 0.001, 0.02, 0.1, 0.5, 0.95, 1.0]), trial, g)
        a, b = base.clone(), base.clone()
        oa = torch.full((n * g,), 3, dtype=torch.uint8)
        ob = torch.full((n * g,), 4, dtype=torch.uint8)
        ea, eb = cuda.encode(new, a, oa, g), TORCH.encode(new, b, ob, g)
        assert torch.equal(a, new) and torch.equal(b, new)
        assert (ea.kind, ea.nbytes, ea.check) == (eb.kind, eb.nbytes, eb.check), trial
        kinds.add(ea.kind)
        if ea.kind in (D.MASK, D.INDEX):
            assert torch.equal(ea.payload, eb.payload)
            into = base.clone()
            assert cuda.apply(ea.kind, ea.payload, into, g) == ea.check
            assert torch.equal(into, new)
            if ea.kind == D.MASK:                   # a mask that does not match its values
                with pytest.raises(ValueError):
                    cuda.apply(D.MASK, ea.payload[:-g], base.clone(), g)
    assert kinds == {D.SAME, D.MASK, D.INDEX, D.DENSE}


@pytest.mark.gpu
def test_cuda_kernel_equals_the_host_kernel():
    from ray_reshard.execution import delta_cuda

    cuda = delta_cuda.codec()
    assert cuda is not None, delta_cuda.why_not()
    for fraction in (0.0, 0.001, 0.1, 0.95, 1.0):
        for g, n in ((2, 3_000_001), (4, 777_777), (1, 65_537), (8, 100_003)):
            base, new, _ = bucket(n * g, fraction, n, g)
            kept = base.clone()
            cpu = HOST.encode(new, kept, torch.empty_like(new), g, probe=False)
            gbase = base.cuda()
            gpu = cuda.encode(new.cuda(), gbase, torch.empty_like(gbase), g)
            assert torch.equal(gbase.cpu(), new)
            assert (gpu.kind, gpu.nbytes, gpu.check) == (cpu.kind, cpu.nbytes, cpu.check)
            if cpu.kind in (D.MASK, D.INDEX):
                assert torch.equal(gpu.payload.cpu(), cpu.payload)
                into = base.cuda()
                assert cuda.apply(gpu.kind, gpu.payload, into, g) == cpu.check
                assert torch.equal(into.cpu(), new)
