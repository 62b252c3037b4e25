"""The delta codec on CUDA: one kernel launch encodes a bucket (compare, compaction, checksum,
the baseline kept), one applies a mask payload with the checksum; the same contract as the host
kernel (`delta_host`, see `delta` for the format). Built with cupy (the `gpu` extra);
`codec()` is None where it cannot run, and GPUs then use `delta.TorchCodec`.

Each block takes a tile of `blockDim.x * GPT` granules, each thread `GPT` (one 32-bit word of
change bits). A block counts its changed granules, publishes the count, and finds where its
values go by looking back over the tiles before it (decoupled look-back: a tile's flag holds
its count, then the count of everything up to it); tiles are numbered in the order blocks
start, so a block only waits on blocks already running. Counts and the checksum (the sum of the
granules modulo 2**64) are added up with atomics in `state`.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import delta as _delta

THREADS = 256
GPT = 32                                   # granules per thread: one word of change bits

SOURCE = r"""
#define GPT 32
#define MAX_THREADS 256
typedef unsigned long long u64;
typedef unsigned int u32;
#define ST_AGG (1ull << 62)
#define ST_PRE (2ull << 62)
#define FLAG_VALUE(f) ((long long) ((f) & ((1ull << 62) - 1)))

// This thread's exclusive prefix of `x` over the block; *total: the block's sum.
__device__ int block_scan(int x, int* total) {
    __shared__ int s[MAX_THREADS];
    const int t = threadIdx.x;
    s[t] = x;
    __syncthreads();
    for (int d = 1; d < (int) blockDim.x; d <<= 1) {
        int v = t >= d ? s[t - d] : 0;
        __syncthreads();
        s[t] += v;
        __syncthreads();
    }
    const int incl = s[t];
    *total = s[blockDim.x - 1];
    __syncthreads();
    return incl - x;
}

__device__ u64 block_sum(u64 x) {
    __shared__ u64 s[MAX_THREADS];
    const int t = threadIdx.x;
    s[t] = x;
    __syncthreads();
    for (int d = blockDim.x / 2; d > 0; d >>= 1) {
        if (t < d) s[t] += s[t + d];
        __syncthreads();
    }
    const u64 r = s[0];
    __syncthreads();
    return r;
}

// The tile's number, in the order blocks start (all threads).
__device__ long long tile_number(u64* state) {
    __shared__ long long tile;
    if (threadIdx.x == 0) tile = (long long) atomicAdd(&state[0], 1ull);
    __syncthreads();
    return tile;
}

// Thread 0: publish the tile's count, look back for the count of the tiles before it.
__device__ long long tile_prefix(u64* flags, long long tile, long long count) {
    long long before = 0;
    if (tile > 0) {
        atomicExch(&flags[tile], ST_AGG | (u64) count);
        for (long long j = tile - 1;;) {
            const u64 f = atomicAdd(&flags[j], 0ull);
            if (f == 0) continue;                       // not published yet
            before += FLAG_VALUE(f);
            if ((f >> 62) == 2) break;
            j--;
        }
    }
    __threadfence();
    atomicExch(&flags[tile], ST_PRE | (u64) (before + count));
    return before;
}

template <typename T>
__device__ void encode(const T* a, T* b, unsigned char* out, long long n, long long vo,
                       long long cap, int* idx, long long idx_cap, u64* state, u64* flags) {
    __shared__ long long first;
    const int t = threadIdx.x;
    const long long tile = tile_number(state);
    const long long g0 = (tile * blockDim.x + t) * GPT;
    int k = 0;
    u32 m = 0;
    u64 sum = 0;
    if (g0 < n) {
        k = n - g0 < GPT ? (int) (n - g0) : GPT;
        for (int j = 0; j < k; j++) {
            const T x = a[g0 + j];
            sum += (u64) x;
            if (x != b[g0 + j]) m |= 1u << j;
        }
        if (k == GPT) {
            *(u32*) (out + g0 / 8) = m;                 // bit i % 8 of byte i / 8
        } else {
            for (int byte = 0; byte * 8 < k; byte++) out[g0 / 8 + byte] = (m >> (8 * byte)) & 255;
        }
    }
    int count;
    const int mine = block_scan(__popc(m), &count);
    const u64 total = block_sum(sum);
    if (t == 0) {
        first = tile_prefix(flags, tile, count);
        atomicAdd(&state[1], total);
        atomicAdd(&state[2], (u64) count);
    }
    __syncthreads();
    T* vals = (T*) (out + vo);
    long long pos = first + mine;
    for (u32 mm = m; mm; mm &= mm - 1) {
        const long long gi = g0 + __ffs(mm) - 1;
        const T x = a[gi];
        if (pos < cap) vals[pos] = x;
        if (pos < idx_cap) idx[pos] = (int) gi;
        b[gi] = x;
        pos++;
    }
    if (t == 0 && (tile + 1) * blockDim.x * GPT >= n)
        for (long long p = (n + 7) / 8; p < vo; p++) out[p] = 0;   // the gap before the values
}

template <typename T>
__device__ void apply_mask(T* dst, const unsigned char* payload, long long n, long long vo,
                           long long n_vals, u64* state, u64* flags) {
    __shared__ long long first;
    const int t = threadIdx.x;
    const long long tile = tile_number(state);
    const long long g0 = (tile * blockDim.x + t) * GPT;
    int k = 0;
    u32 m = 0;
    if (g0 < n) {
        k = n - g0 < GPT ? (int) (n - g0) : GPT;
        if (k == GPT) {
            m = *(const u32*) (payload + g0 / 8);
        } else {
            for (int byte = 0; byte * 8 < k; byte++)
                m |= (u32) payload[g0 / 8 + byte] << (8 * byte);
            m &= (1u << k) - 1;
        }
    }
    int count;
    const int mine = block_scan(__popc(m), &count);
    if (t == 0) {
        first = tile_prefix(flags, tile, count);
        atomicAdd(&state[2], (u64) count);
    }
    __syncthreads();
    const T* vals = (const T*) (payload + vo);
    long long pos = first + mine;
    u64 sum = 0;
    for (int j = 0; j < k; j++) {
        if ((m >> j) & 1u) {
            if (pos < n_vals) dst[g0 + j] = vals[pos];
            pos++;
        }
        sum += (u64) dst[g0 + j];
    }
    const u64 total = block_sum(sum);
    if (t == 0) atomicAdd(&state[1], total);
}

#define RR_KERNELS(G, T)                                                                   \
extern "C" __global__ void delta_encode_##G(const T* a, T* b, unsigned char* out,         \
        long long n, long long vo, long long cap, int* idx, long long idx_cap, u64* state) { \
    encode<T>(a, b, out, n, vo, cap, idx, idx_cap, state, state + 3);                     \
}                                                                                         \
extern "C" __global__ void delta_apply_##G(T* dst, const unsigned char* payload,           \
        long long n, long long vo, long long n_vals, u64* state) {                        \
    apply_mask<T>(dst, payload, n, vo, n_vals, state, state + 3);                         \
}
RR_KERNELS(1, unsigned char)
RR_KERNELS(2, unsigned short)
RR_KERNELS(4, unsigned int)
RR_KERNELS(8, unsigned long long)
"""

_CODEC: Optional["CudaCodec"] = None
_FAILED: Optional[str] = None

# bits set in each byte value (the apply's count check, before anything is written)
_POPCOUNT = [bin(i).count("1") for i in range(256)]


class CudaCodec:
    """`delta.HostCodec`'s contract on CUDA buckets (packed), one launch per bucket and pass:
    encode, and apply of a mask payload; index payloads and checksums of unchanged buckets are
    a few torch ops (they are small, or a plain sum)."""

    name = "cuda"

    def __init__(self, launch=None, threads: int = THREADS):
        """`launch(kernel name, blocks, threads, args)` runs a kernel (default: cupy's launch
        of this source on torch's current stream; the tests pass one that runs the same
        source compiled for the host, with fewer `threads` per block)."""
        self._launch_fn, self.threads = launch, threads
        if launch is None:
            import cupy
            self._cupy = cupy
            self._module = cupy.RawModule(code=SOURCE)
            for g in (1, 2, 4, 8):          # compiled now, not in the middle of a refit
                self._module.get_function(f"delta_encode_{g}")
            self._functions: dict = {}
            self._streams: dict = {}
        self._pop: dict = {}

    def _blocks(self, n: int) -> int:
        return max(1, -(-n // (self.threads * GPT)))

    def _launch(self, name: str, n: int, args: tuple, device: torch.device) -> None:
        blocks = self._blocks(n)
        if self._launch_fn is not None:
            self._launch_fn(name, blocks, self.threads, args)
            return
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._module.get_function(name)
        dev = device.index if device.index is not None else torch.cuda.current_device()
        current = torch.cuda.current_stream(dev)
        stream = self._streams.get((dev, current.cuda_stream))
        if stream is None:
            cuda = self._cupy.cuda
            stream = self._streams[(dev, current.cuda_stream)] = (
                cuda.Stream.from_external(current) if hasattr(cuda.Stream, "from_external")
                else cuda.ExternalStream(current.cuda_stream, dev))
        with self._cupy.cuda.Device(dev):
            fn((blocks,), (self.threads,), args, stream=stream)

    def encode(self, new: torch.Tensor, base: torch.Tensor, out: torch.Tensor, g: int,
               probe: bool = False) -> _delta.Encoded:
        """As `delta.HostCodec.encode`, on a packed CUDA bucket (`probe` is not supported: a
        bucket is compared whole)."""
        nbytes, n = new.numel(), new.numel() // g
        head = (n + 7) // 8
        vo = _delta._up(head, g)
        cap = (head + g) // _delta.INDEX_BYTES + 1
        state = torch.zeros(3 + self._blocks(n), dtype=torch.int64, device=new.device)
        idx = torch.empty(cap, dtype=torch.int32, device=new.device)
        self._launch(f"delta_encode_{g}", n, (
            new.data_ptr(), base.data_ptr(), out.data_ptr(), n, vo, (out.numel() - vo) // g,
            idx.data_ptr(), cap, state.data_ptr()), new.device)
        check, changed = (int(x) for x in state[1:3].tolist())
        if changed > _delta.dense_after(nbytes, g):
            return _delta.Encoded(_delta.DENSE, nbytes, changed)
        if changed == 0:
            return _delta.Encoded(_delta.SAME, 0, 0, _delta._signed(check))
        kind, size = _delta.encoded_bytes(nbytes, g, changed)
        if kind == _delta.INDEX:
            vals = out[vo:vo + changed * g].clone()
            at = changed * _delta.INDEX_BYTES
            out[:at].copy_(idx[:changed].view(torch.uint8))
            out[at:_delta._up(at, g)].zero_()
            out[_delta._up(at, g):size].copy_(vals)
        return _delta.Encoded(kind, size, changed, _delta._signed(check), out[:size])

    def apply(self, kind: int, payload: Optional[torch.Tensor], into: torch.Tensor,
              g: int) -> int:
        """As `delta.HostCodec.apply`, on a packed CUDA bucket."""
        if kind != _delta.MASK:
            return _delta.TorchCodec().apply(kind, payload, into, g)
        n = into.numel() // g
        head = (n + 7) // 8
        vo = _delta._up(head, g)
        if payload.numel() < vo or (payload.numel() - vo) % g:
            raise ValueError(f"a mask delta payload of {payload.numel()} bytes does not fit a "
                             f"{into.numel()}-byte bucket of {g}-byte granules")
        n_vals = (payload.numel() - vo) // g
        table = self._pop.get(into.device)
        if table is None:
            table = self._pop[into.device] = torch.tensor(_POPCOUNT, device=into.device)
        bits = payload[:head].long()
        if n % 8:
            bits[-1] &= (1 << (n % 8)) - 1
        placed = int(table[bits].sum())
        if placed != n_vals:
            raise ValueError(f"delta payload holds {n_vals} values, its mask {placed}")
        state = torch.zeros(3 + self._blocks(n), dtype=torch.int64, device=into.device)
        self._launch(f"delta_apply_{g}", n, (into.data_ptr(), payload.data_ptr(), n, vo,
                                             n_vals, state.data_ptr()), into.device)
        return _delta._signed(int(state[1]))


def codec() -> Optional[CudaCodec]:
    """The process's CUDA codec, or None (no CUDA, no cupy, or the kernel does not compile
    here: see `why_not`; GPUs then use torch ops, and a warning says why once)."""
    global _CODEC, _FAILED
    if _CODEC is None and _FAILED is None:
        if not torch.cuda.is_available():
            _FAILED = "CUDA is not available"
        else:
            try:
                _CODEC = CudaCodec()
            except ImportError as e:
                _FAILED = f"cupy is not installed (the gpu extra): {e}"
            except Exception as e:
                _FAILED = f"the delta kernel does not compile here: {type(e).__name__}: {e}"
            if _FAILED is not None:
                warnings.warn(f"ray_reshard: the delta codec runs torch ops on the GPU: "
                              f"{_FAILED}", RuntimeWarning, stacklevel=2)
    return _CODEC


def why_not() -> Optional[str]:
    codec()
    return _FAILED
