// A copy table's single-row regions on host memory: region i copies nbytes[i] bytes from
// src[i] to dst[i]. One call runs a whole table, so a region costs its bytes and no
// interpreter call (see host_copy.py).

#include <stdint.h>
#include <string.h>

extern "C" void rr_copy_rows(int64_t n, const int64_t* dst, const int64_t* src,
                             const int64_t* nbytes) {
    for (int64_t i = 0; i < n; ++i)
        memmove(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                static_cast<size_t>(nbytes[i]));
}
