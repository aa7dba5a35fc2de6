/* The machine's memory read bandwidth, as a decode step meets it: the team of threads
   streams a buffer far larger than the last-level cache with 64-byte vector loads, each
   thread its own contiguous half, as a matmul's blocks are shared (bench/decode.py prints
   the floor a model's bytes per token imply). No software prefetch: on 2 MiB pages, as the
   probe's buffer and the weights are, the hardware prefetchers stream it fastest (they stop
   only at page boundaries; docs/decisions.md, "The decode floor, probed"). */

#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "skippy_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

uint64_t skippy_read_probe(const void *buffer, size_t bytes) {
    uint64_t total = 0;
    #pragma omp parallel reduction(^ : total)
    {
        const size_t lines = bytes / 64, tid = (size_t)omp_get_thread_num(), team = (size_t)omp_get_num_threads();
        const char *base = buffer;
        size_t line = lines * tid / team;
        const size_t end = lines * (tid + 1) / team;
#if defined(__AVX512F__)
        __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
        for (; line + 4 <= end; line += 4) {
            const char *p = base + line * 64;
            a = _mm512_xor_si512(a, _mm512_loadu_si512(p));
            b = _mm512_xor_si512(b, _mm512_loadu_si512(p + 64));
            c = _mm512_xor_si512(c, _mm512_loadu_si512(p + 128));
            d = _mm512_xor_si512(d, _mm512_loadu_si512(p + 192));
        }
        total ^= (uint64_t)_mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
#endif
        for (; line < end; line++) {
            uint64_t words[8];
            memcpy(words, base + line * 64, 64);
            for (int i = 0; i < 8; i++) total ^= words[i];
        }
    }
    return total;
}
