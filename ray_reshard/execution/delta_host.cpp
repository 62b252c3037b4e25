// The bucket's bytes are given as rows (address, bytes) in bucket order, each a whole number of
// granules: the regions of a part that are plain contiguous host memory in the wire dtype, or one
// packed buffer. Encoding reads each new granule and its baseline once: it writes the change
// bits, the changed values and, while an index payload may still be the smallest, their indices;
// it stores the changed granules into the baseline (which then holds the new bytes) and sums the
// new granules. It stops once the payload would not be smaller than the bucket (or most of the
// granules compared so far changed: probe_every, probe_from, mostly) and copies the rest
// of the new bytes into the baseline. AVX-512 (with VBMI2 for 1- and 2-byte granules) compacts
// with compress instructions, AVX2 compares 64 granules at a time, anything else runs plain C.

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512BW__)
#define RR_AVX512 1
#endif

template <typename T> struct Lanes;           // the change bits of 64 granules
#if RR_AVX512
template <> struct Lanes<uint8_t> {
    static inline uint64_t neq(const uint8_t* a, const uint8_t* b) {
        return _mm512_cmpneq_epi8_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b)); } };
template <> struct Lanes<uint16_t> {
    static inline uint64_t neq(const uint16_t* a, const uint16_t* b) {
        uint64_t lo = _mm512_cmpneq_epi16_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
        uint64_t hi = _mm512_cmpneq_epi16_mask(_mm512_loadu_si512(a + 32),
                                               _mm512_loadu_si512(b + 32));
        return lo | (hi << 32); } };
template <> struct Lanes<uint32_t> {
    static inline uint64_t neq(const uint32_t* a, const uint32_t* b) {
        uint64_t m = 0;
        for (int v = 0; v < 4; v++)
            m |= (uint64_t)_mm512_cmpneq_epi32_mask(_mm512_loadu_si512(a + 16 * v),
                                                    _mm512_loadu_si512(b + 16 * v)) << (16 * v);
        return m; } };
template <> struct Lanes<uint64_t> {
    static inline uint64_t neq(const uint64_t* a, const uint64_t* b) {
        uint64_t m = 0;
        for (int v = 0; v < 8; v++)
            m |= (uint64_t)_mm512_cmpneq_epi64_mask(_mm512_loadu_si512(a + 8 * v),
                                                    _mm512_loadu_si512(b + 8 * v)) << (8 * v);
        return m; } };
#elif defined(__AVX2__)
static inline __m256i ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
template <> struct Lanes<uint8_t> {
    static inline uint64_t neq(const uint8_t* a, const uint8_t* b) {
        uint64_t lo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(ld(a), ld(b)));
        uint64_t hi = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(ld(a + 32), ld(b + 32)));
        return ~(lo | (hi << 32)); } };
template <> struct Lanes<uint16_t> {
    static inline uint64_t neq(const uint16_t* a, const uint16_t* b) {
        uint64_t m = 0;
        for (int v = 0; v < 2; v++) {
            __m256i e0 = _mm256_cmpeq_epi16(ld(a + 32 * v), ld(b + 32 * v));
            __m256i e1 = _mm256_cmpeq_epi16(ld(a + 32 * v + 16), ld(b + 32 * v + 16));
            __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8);
            m |= (uint64_t)(uint32_t)_mm256_movemask_epi8(p) << (32 * v);
        }
        return ~m; } };
template <> struct Lanes<uint32_t> {
    static inline uint64_t neq(const uint32_t* a, const uint32_t* b) {
        uint64_t m = 0;
        for (int v = 0; v < 8; v++)
            m |= (uint64_t)_mm256_movemask_ps(_mm256_castsi256_ps(
                     _mm256_cmpeq_epi32(ld(a + 8 * v), ld(b + 8 * v)))) << (8 * v);
        return ~m; } };
template <> struct Lanes<uint64_t> {
    static inline uint64_t neq(const uint64_t* a, const uint64_t* b) {
        uint64_t m = 0;
        for (int v = 0; v < 16; v++)
            m |= (uint64_t)_mm256_movemask_pd(_mm256_castsi256_pd(
                     _mm256_cmpeq_epi64(ld(a + 4 * v), ld(b + 4 * v)))) << (4 * v);
        return ~m; } };
#else
template <typename T> struct Lanes {
    static inline uint64_t neq(const T* a, const T* b) {
        uint64_t m = 0;
        for (int j = 0; j < 64; j++) m |= (uint64_t)(a[j] != b[j]) << j;
        return m; } };
#endif

template <typename T>
static inline uint64_t neq_tail(const T* a, const T* b, int k) {
    uint64_t m = 0;
    for (int j = 0; j < k; j++) m |= (uint64_t)(a[j] != b[j]) << j;
    return m;
}

template <typename T>
static inline uint64_t sum_tail(const T* a, int64_t k) {
    uint64_t s = 0;
    for (int64_t j = 0; j < k; j++) s += a[j];
    return s;
}

// The checksum: the sum of the granules as unsigned integers, modulo 2**64. 64 granules at a
// time: from memory (add64) or, with AVX-512, from the sizeof(T) vectors that hold them (addv).
#if RR_AVX512
template <typename T> struct Summer {
    __m512i acc = _mm512_setzero_si512(), acc32 = _mm512_setzero_si512();
    int n = 0;
    inline void flush() {
        acc = _mm512_add_epi64(acc, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(acc32)));
        acc = _mm512_add_epi64(acc, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(acc32, 1)));
        acc32 = _mm512_setzero_si512();
        n = 0; }
    inline void addv(const __m512i* v) {
        if (sizeof(T) == 1) {
            acc = _mm512_add_epi64(acc, _mm512_sad_epu8(v[0], _mm512_setzero_si512()));
        } else if (sizeof(T) == 2) {
            const __m512i lo = _mm512_set1_epi32(0xFFFF);
            __m512i s = _mm512_add_epi32(
                _mm512_add_epi32(_mm512_and_si512(v[0], lo), _mm512_srli_epi32(v[0], 16)),
                _mm512_add_epi32(_mm512_and_si512(v[1], lo), _mm512_srli_epi32(v[1], 16)));
            acc32 = _mm512_add_epi32(acc32, s);      // at most 4 * 65535 per lane per call
            if (++n == 4096) flush();
        } else if (sizeof(T) == 4) {
            for (int q = 0; q < 4; q++) {
                const __m512i x = v[q];
                acc = _mm512_add_epi64(acc, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(x)));
                acc = _mm512_add_epi64(acc,
                                       _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(x, 1)));
            }
        } else {
            for (int q = 0; q < 8; q++) acc = _mm512_add_epi64(acc, v[q]);
        } }
    inline void add64(const T* a) {
        __m512i v[sizeof(T)];
        for (unsigned q = 0; q < sizeof(T); q++)
            v[q] = _mm512_loadu_si512(a + q * (64 / sizeof(T)));
        addv(v); }
    inline uint64_t total() { flush(); return (uint64_t)_mm512_reduce_add_epi64(acc); }
};
#else
template <typename T> struct Summer {
    uint64_t s = 0;
    inline void add64(const T* a) { for (int j = 0; j < 64; j++) s += a[j]; }
    inline uint64_t total() { return s; }
};
#endif

// Change bits, little-endian: granule i is bit i % 8 of byte i / 8.
struct BitWriter {
    uint8_t* p; uint64_t acc; int fill;
    inline void put(uint64_t m, int k) {            // k in 1..64, m only in the low k bits
        if (fill == 0 && k == 64) { memcpy(p, &m, 8); p += 8; return; }
        acc |= m << fill;
        int f = fill + k;
        if (f >= 64) {
            memcpy(p, &acc, 8);
            p += 8;
            acc = fill ? (m >> (64 - fill)) : 0;
            f -= 64;
        }
        fill = f; }
    inline void flush() { int b = (fill + 7) / 8; memcpy(p, &acc, b); p += b; acc = 0; fill = 0; }
};

struct BitReader {
    const uint8_t* p; int64_t nbytes; int64_t pos;
    inline uint64_t get(int k) {                     // the next k (1..64) bits
        int64_t byte = pos >> 3;
        int sh = (int)(pos & 7);
        uint64_t w = 0;
        const int64_t avail = nbytes - byte;
        if (avail >= 8) memcpy(&w, p + byte, 8);
        else memcpy(&w, p + byte, (size_t) avail);
        w >>= sh;
        if (sh && sh + k > 64) w |= (uint64_t)p[byte + 8] << (64 - sh);
        pos += k;
        return k == 64 ? w : w & ((1ull << k) - 1); }
};

template <typename T>
static inline void take(const T* a, T* b, uint64_t m, int pc, T* vals, int64_t& c,
                        int64_t cap) {
#if RR_AVX512 && defined(__AVX512VBMI2__)
    if (sizeof(T) == 2) {
        const uint16_t* a16 = (const uint16_t*)a;
        uint16_t* b16 = (uint16_t*)b;
        uint16_t* v16 = (uint16_t*)vals;
        __m512i v0 = _mm512_loadu_si512(a16), v1 = _mm512_loadu_si512(a16 + 32);
        uint32_t m0 = (uint32_t)m, m1 = (uint32_t)(m >> 32);
        int64_t c1 = c + __builtin_popcount(m0);
        if (c1 + 32 <= cap) {                        // room for whole vectors
            _mm512_storeu_si512(v16 + c, _mm512_maskz_compress_epi16(m0, v0));
            _mm512_storeu_si512(v16 + c1, _mm512_maskz_compress_epi16(m1, v1));
        } else {
            _mm512_mask_compressstoreu_epi16(v16 + c, m0, v0);
            _mm512_mask_compressstoreu_epi16(v16 + c1, m1, v1);
        }
        _mm512_mask_storeu_epi16(b16, m0, v0);
        _mm512_mask_storeu_epi16(b16 + 32, m1, v1);
        c += pc;
        return;
    }
    if (sizeof(T) == 1) {
        __m512i v = _mm512_loadu_si512(a);
        if (c + 64 <= cap) _mm512_storeu_si512(vals + c, _mm512_maskz_compress_epi8(m, v));
        else _mm512_mask_compressstoreu_epi8(vals + c, m, v);
        _mm512_mask_storeu_epi8(b, m, v);
        c += pc;
        return;
    }
#endif
#if RR_AVX512
    if (sizeof(T) == 4) {
        for (int v = 0; v < 4; v++) {
            __mmask16 k = (__mmask16)(m >> (16 * v));
            __m512i x = _mm512_loadu_si512((const uint32_t*)a + 16 * v);
            _mm512_mask_compressstoreu_epi32((uint32_t*)vals + c, k, x);
            _mm512_mask_storeu_epi32((uint32_t*)b + 16 * v, k, x);
            c += __builtin_popcount(k);
        }
        return;
    }
    if (sizeof(T) == 8) {
        for (int v = 0; v < 8; v++) {
            __mmask8 k = (__mmask8)(m >> (8 * v));
            __m512i x = _mm512_loadu_si512((const uint64_t*)a + 8 * v);
            _mm512_mask_compressstoreu_epi64((uint64_t*)vals + c, k, x);
            _mm512_mask_storeu_epi64((uint64_t*)b + 8 * v, k, x);
            c += __builtin_popcount(k);
        }
        return;
    }
#endif
    while (m) {
        int j = __builtin_ctzll(m);
        m &= m - 1;
        vals[c++] = a[j];
        b[j] = a[j];
    }
}

// The baseline takes the bucket's granules from `from` on, as they are in the rows.
static void copy_rest(const int64_t* rows, int64_t n_rows, uint8_t* base, int64_t g,
                      int64_t from) {
    int64_t pos = 0;                                  // in granules
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t len = rows[2 * r + 1] / g;
        if (pos + len > from) {
            const int64_t skip = from > pos ? from - pos : 0;
            memcpy(base + (pos + skip) * g, (const uint8_t*) rows[2 * r] + skip * g,
                   (size_t) ((len - skip) * g));
        }
        pos += len;
    }
}

template <typename T>
static int64_t encode(const int64_t* rows, int64_t n_rows, T* base, uint8_t* out,
                      int64_t out_bytes, int64_t n, int64_t defer,
                      int64_t dense_at, int64_t probe_every, int64_t probe_from, double mostly,
                      uint64_t* res) {
    const int64_t head = (n + 7) / 8;
    const int64_t vo = (head + sizeof(T) - 1) / sizeof(T) * sizeof(T);
    T* vals = (T*)(out + vo);
    const int64_t cap = (out_bytes - vo) / (int64_t)sizeof(T);
    BitWriter bw{out, 0, 0};
    Summer<T> sum;
    uint64_t check = 0;
    int64_t c = 0, seen = 0;
    int64_t next_probe = probe_every > 0 ? probe_every : INT64_MAX;
    for (int64_t r = 0; r < n_rows; r++) {
        const T* src = (const T*)rows[2 * r];
        const int64_t len = rows[2 * r + 1] / (int64_t)sizeof(T);
        int64_t i = 0;
        while (i < len) {
            const T* a = src + i;
            T* b = base + seen;
            int64_t left = len - i, to_probe = next_probe - seen;
            int k = (int)(left < 64 ? left : 64);
            if (to_probe < k) k = (int)to_probe;
            uint64_t m;
            if (k == 64) {
                m = Lanes<T>::neq(a, b);
                sum.add64(a);
            } else {
                m = neq_tail(a, b, k);
                check += sum_tail(a, k);
            }
            if (k == 64) {                     // no branch on m: ~half the blocks of a
                const int pc = __builtin_popcountll(m);    // bucket 1% changed have a change
                if (c + pc > dense_at) goto dense;
                take(a, b, m, pc, vals, c, cap);
            } else if (m) {
                if (c + __builtin_popcountll(m) > dense_at) goto dense;
                for (uint64_t mm = m; mm; mm &= mm - 1) {
                    const int j = __builtin_ctzll(mm);
                    vals[c++] = a[j];
                    b[j] = a[j];
                }
            }
            bw.put(m, k);
            i += k;
            seen += k;
            if (seen == next_probe) {
                next_probe += probe_every;
                if (seen >= probe_from && (double)c > mostly * (double)seen) goto dense;
            }
        }
    }
    bw.flush();
    memset(out + head, 0, vo - head);
    res[0] = check + sum.total();
    res[1] = c;
    res[2] = 0;
    return 0;
dense:
    res[0] = 0;
    res[1] = c;
    res[2] = 1;
    res[3] = seen;
    if (!defer) copy_rest((const int64_t*) rows, n_rows, (uint8_t*) base, sizeof(T), seen);
    return 1;
}

template <typename T>
static uint64_t checksum_rows(const int64_t* rows, int64_t n_rows) {
    Summer<T> sum;
    uint64_t check = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        const T* a = (const T*)rows[2 * r];
        const int64_t len = rows[2 * r + 1] / (int64_t)sizeof(T);
        int64_t i = 0;
        for (; i + 64 <= len; i += 64) sum.add64(a + i);
        check += sum_tail(a + i, len - i);
    }
    return check + sum.total();
}

// 64 granules at dst take the next values where m is set; adds them to the checksum.
template <typename T>
static inline void place64(T* dst, uint64_t m, const T* vals, int64_t& c, int64_t n_vals,
                           Summer<T>& sum) {
#if RR_AVX512
#if defined(__AVX512VBMI2__)
    constexpr bool vec = true;
#else
    constexpr bool vec = sizeof(T) >= 4;
#endif
    if constexpr (vec) {
        constexpr int L = 64 / sizeof(T);
        __m512i v[sizeof(T)];
        for (unsigned q = 0; q < sizeof(T); q++) {
            const uint64_t mq = L == 64 ? m : (m >> (q * L)) & ((1ull << L) - 1);
            T* d = dst + q * L;
            __m512i old = _mm512_loadu_si512(d);
            const T* p = vals + c;
            const bool whole = c + L <= n_vals;      // a whole vector may be read
            __m512i x;                               // (no branch on mq: see encode)
            if constexpr (sizeof(T) == 1) {
#if defined(__AVX512VBMI2__)
                x = whole ? _mm512_mask_expand_epi8(old, mq, _mm512_loadu_si512(p))
                          : _mm512_mask_expandloadu_epi8(old, mq, p);
                _mm512_mask_storeu_epi8(d, mq, x);
#endif
            } else if constexpr (sizeof(T) == 2) {
#if defined(__AVX512VBMI2__)
                x = whole ? _mm512_mask_expand_epi16(old, (__mmask32)mq, _mm512_loadu_si512(p))
                          : _mm512_mask_expandloadu_epi16(old, (__mmask32)mq, p);
                _mm512_mask_storeu_epi16(d, (__mmask32)mq, x);
#endif
            } else if constexpr (sizeof(T) == 4) {
                x = whole ? _mm512_mask_expand_epi32(old, (__mmask16)mq, _mm512_loadu_si512(p))
                          : _mm512_mask_expandloadu_epi32(old, (__mmask16)mq, p);
                _mm512_mask_storeu_epi32(d, (__mmask16)mq, x);
            } else {
                x = whole ? _mm512_mask_expand_epi64(old, (__mmask8)mq, _mm512_loadu_si512(p))
                          : _mm512_mask_expandloadu_epi64(old, (__mmask8)mq, p);
                _mm512_mask_storeu_epi64(d, (__mmask8)mq, x);
            }
            v[q] = x;
            c += __builtin_popcountll(mq);
        }
        sum.addv(v);
        return;
    }
#endif
    for (uint64_t mm = m; mm; mm &= mm - 1) dst[__builtin_ctzll(mm)] = vals[c++];
    sum.add64(dst);
}

template <typename T>
static int64_t apply_mask(const int64_t* rows, int64_t n_rows, const uint8_t* payload,
                          int64_t size, int64_t n, uint64_t* res) {
    const int64_t head = (n + 7) / 8;
    const int64_t vo = (head + sizeof(T) - 1) / sizeof(T) * sizeof(T);
    if (size < vo || (size - vo) % (int64_t)sizeof(T)) return -1;
    const int64_t n_vals = (size - vo) / (int64_t)sizeof(T);
    int64_t total = 0;                                // set bits must match the values
    for (int64_t b = 0; b < n / 8; b++) total += __builtin_popcount(payload[b]);
    if (n % 8) total += __builtin_popcount(payload[n / 8] & ((1u << (n % 8)) - 1));
    if (total != n_vals) return -1;
    const T* vals = (const T*)(payload + vo);
    BitReader br{payload, head, 0};
    Summer<T> sum;
    uint64_t check = 0;
    int64_t c = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        T* dst = (T*)rows[2 * r];
        const int64_t len = rows[2 * r + 1] / (int64_t)sizeof(T);
        int64_t i = 0;
        for (; i + 64 <= len; i += 64) place64(dst + i, br.get(64), vals, c, n_vals, sum);
        if (i < len) {
            const int k = (int)(len - i);
            for (uint64_t mm = br.get(k); mm; mm &= mm - 1)
                dst[i + __builtin_ctzll(mm)] = vals[c++];
            check += sum_tail(dst + i, k);
        }
    }
    res[0] = check + sum.total();
    res[1] = c;
    return 0;
}

template <typename T>
static int64_t apply_index(const int64_t* rows, int64_t n_rows, const uint8_t* payload,
                           int64_t size, int64_t n, uint64_t* res) {
    const int64_t count = size / (4 + (int64_t)sizeof(T));   // padding is under one granule
    const int64_t vo = (4 * count + sizeof(T) - 1) / sizeof(T) * sizeof(T);
    if (vo + count * (int64_t)sizeof(T) != size) return -1;
    const int32_t* idx = (const int32_t*)payload;
    const T* vals = (const T*)(payload + vo);
    int64_t prev = -1;
    for (int64_t k = 0; k < count; k++) {             // increasing, inside the bucket
        if (idx[k] <= prev || idx[k] >= n) return -1;
        prev = idx[k];
    }
    int64_t r = 0, start = 0, len = n_rows ? rows[1] / (int64_t)sizeof(T) : 0;
    for (int64_t k = 0; k < count; k++) {
        while (idx[k] >= start + len) {
            start += len;
            r++;
            len = rows[2 * r + 1] / (int64_t)sizeof(T);
        }
        ((T*)rows[2 * r])[idx[k] - start] = vals[k];
    }
    res[0] = checksum_rows<T>(rows, n_rows);
    res[1] = count;
    return 0;
}

#define RR_BY_GRANULE(g, call) \
    switch (g) { \
        case 1: { typedef uint8_t T; return call; } \
        case 2: { typedef uint16_t T; return call; } \
        case 4: { typedef uint32_t T; return call; } \
        case 8: { typedef uint64_t T; return call; } }

extern "C" {

int64_t rr_delta_encode(const int64_t* rows, int64_t n_rows, uint8_t* base, uint8_t* out,
                        int64_t out_bytes, int64_t g, int64_t n, int64_t defer,
                        int64_t dense_at, int64_t probe_every, int64_t probe_from,
                        double mostly, uint64_t* res) {
    RR_BY_GRANULE(g, encode<T>(rows, n_rows, (T*)base, out, out_bytes, n, defer,
                               dense_at, probe_every, probe_from, mostly, res))
    return -2;
}

void rr_delta_copy_rest(const int64_t* rows, int64_t n_rows, uint8_t* base, int64_t g,
                        int64_t from) {
    copy_rest(rows, n_rows, base, g, from);
}

// The indices of the set bits among the first n (at most `cap`); returns how many.
int64_t rr_delta_bits_to_index(const uint8_t* bits, int64_t n, int32_t* idx, int64_t cap) {
    int64_t c = 0;
    for (int64_t w = 0; w * 64 < n; w++) {
        uint64_t m = 0;
        const int64_t k = n - w * 64 < 64 ? n - w * 64 : 64;
        if (k == 64) {
            memcpy(&m, bits + 8 * w, 8);
        } else {
            memcpy(&m, bits + 8 * w, (size_t) ((k + 7) / 8));
            m &= (1ull << k) - 1;
        }
        for (; m && c < cap; m &= m - 1) idx[c++] = (int32_t) (w * 64 + __builtin_ctzll(m));
    }
    return c;
}

// kind 0: checksum only; 1: a mask payload; 2: an index payload. res[0]: the checksum.
int64_t rr_delta_apply(int64_t kind, const int64_t* rows, int64_t n_rows, const uint8_t* payload,
                       int64_t size, int64_t g, int64_t n, uint64_t* res) {
    if (kind == 0) {
        RR_BY_GRANULE(g, (res[0] = checksum_rows<T>(rows, n_rows), res[1] = 0, (int64_t)0))
    } else if (kind == 1) {
        RR_BY_GRANULE(g, apply_mask<T>(rows, n_rows, payload, size, n, res))
    } else if (kind == 2) {
        RR_BY_GRANULE(g, apply_index<T>(rows, n_rows, payload, size, n, res))
    }
    return -2;
}

}
