// Each block takes a tile of blockDim.x * GPT granules, each thread GPT (one 32-bit word of
// change bits). A block counts its changed granules, publishes the count, and finds where its
// values go by looking back over the tiles before it (decoupled look-back: a tile's flag holds
// its count, then the count of everything up to it); tiles are numbered in the order blocks
// start, so a block only waits on blocks already running. Counts and the checksum (the sum of the
// granules modulo 2**64) are added up with atomics in state.

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
