/* qmatmul.c's block kernels on AVX512-VNNI, and on AMX tiles for 16 rows of x at a time
   (qmatmul.c has the layout and the arithmetic). */

#include "qmatmul.h"

#ifdef SKIPPY_VNNI
#include <immintrin.h>
#include <stdlib.h>
#ifdef SKIPPY_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define M_TILE 8 /* rows of x sharing one unpacking of a block's codes */
/* groups of a block fetched ahead, into L2: the hardware prefetchers alone leave the cores
   waiting at every new block, a non-temporal hint (the AVX2 path's) drops lines before a tile
   of rows is done with them, and fetching into L1 from further ahead evicts the lines the
   kernel is still reading (docs/decisions.md, "Weight prefetch into L2, 12 groups ahead");
   overridable for experiments */
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 12
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif

/* acc += codes . (4 signed bytes at q, in every lane), the bytes broadcast by the
   instruction's own memory operand: GCC emits a separate vpbroadcastd otherwise */
static inline __m512i dot4(__m512i acc, __m512i codes, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const int32_t *)q));
    return acc;
}

/* Q6K's top 2 bits of the codes in chunk c's bytes (bits 2c, 2c+1 of `top`), moved to bits 4-5 */
static inline __m512i top_bits(__m512i top, int c) {
    const __m512i shifted = c < 2 ? _mm512_slli_epi16(top, 4 - 2 * c) : c == 2 ? top : _mm512_srli_epi16(top, 2);
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x30));
}

/* A group's codes of the block's 16 rows in 8 registers, 4 of each row's codes a lane: cw[j]
   holds k = 4j .. 4j + 3 for SKIPPY_Q8; for the nibble formats cw[2c] holds k = 4c .. (the
   group's first half) and cw[2c + 1] k = 16 + 4c .. (its second half) */
static inline __attribute__((always_inline)) void unpack(const int format, const uint8_t *codes, __m512i cw[8]) {
    if (format == SKIPPY_Q8) {
        for (int c = 0; c < 8; c++) cw[c] = _mm512_loadu_si512(codes + c * 64);
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m512i raw = _mm512_loadu_si512(codes + c * 64);
        cw[2 * c] = _mm512_and_si512(raw, low4);
        cw[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if (format == SKIPPY_Q6K) {
        const __m512i first = _mm512_loadu_si512(codes + 256), second = _mm512_loadu_si512(codes + 320);
        for (int c = 0; c < 4; c++) {
            cw[2 * c] = _mm512_or_si512(cw[2 * c], top_bits(first, c));
            cw[2 * c + 1] = _mm512_or_si512(cw[2 * c + 1], top_bits(second, c));
        }
    }
}

/* where cw[j]'s 4 k start in the group */
static inline int k_of(const int format, int j) {
    return format == SKIPPY_Q8 ? 4 * j : 4 * (j / 2) + 16 * (j % 2);
}

/* Group g's scales per lane: d and the offset's m (Q4, Q8, Q4K), or each half's d (Q6K: d and m).
   The K formats' super-block factors are read at a super-block's first group into *sd, *sm. With
   one level (and not Q6K), d comes times 128: group_sum then skips shifting the sums (the same bits). */
static inline __attribute__((always_inline)) void group_scales(const int format, const int levels,
                                                               const skippy_part *p, int b, int G, int g, __m512 *sd,
                                                               __m512 *sm, __m512 *d, __m512 *m) {
    const size_t at = (size_t)b * G + g;
    const __m512 times = _mm512_set1_ps(levels == 1 && format != SKIPPY_Q6K ? 128.f : 1.f);
    if (format == SKIPPY_Q4 || format == SKIPPY_Q8) {
        *d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->scale + at * LANES))), times);
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->offset + at * LANES)));
        return;
    }
    const size_t super = (size_t)b * (G / GROUPS_PER_SUPER) + g / GROUPS_PER_SUPER;
    if (g % GROUPS_PER_SUPER == 0) {
        const int fields = format == SKIPPY_Q4K ? 2 : 1;
        *sd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->scale + super * fields * LANES)));
        if (format == SKIPPY_Q4K)
            *sm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p->scale + (super * 2 + 1) * LANES)));
    }
    const __m128i first = _mm_loadu_si128((const __m128i *)(p->sub + at * 2 * LANES));
    const __m128i second = _mm_loadu_si128((const __m128i *)(p->sub + at * 2 * LANES + LANES));
    if (format == SKIPPY_Q4K) {
        *d = _mm512_mul_ps(_mm512_mul_ps(*sd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first))), times);
        *m = _mm512_mul_ps(*sm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)));
    } else {
        *d = _mm512_mul_ps(*sd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)));
        *m = _mm512_mul_ps(*sd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)));
    }
}

/* the weights stream from memory once a step: fetch group g + PREFETCH_GROUPS's codes and scales */
static inline __attribute__((always_inline)) void prefetch_ahead(const int format, const skippy_part *p, int b,
                                                                 int G, int g, const uint8_t *codes) {
    const int bytes = skippy_group_bytes(format);
    if (PREFETCH_GROUPS == 0) return;
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(codes + PREFETCH_GROUPS * bytes + l), PREFETCH_HINT);
    if (g & 1) return; /* a line holds two groups' scales: +0.5-0.8% against one a group (3 interleaved runs) */
    const size_t ahead = (size_t)b * G + g + PREFETCH_GROUPS;
    if (format == SKIPPY_Q4 || format == SKIPPY_Q8) {
        _mm_prefetch((const char *)(p->scale + ahead * LANES), PREFETCH_HINT);
        _mm_prefetch((const char *)(p->offset + ahead * LANES), PREFETCH_HINT);
        return;
    }
    _mm_prefetch((const char *)(p->sub + ahead * 2 * LANES), PREFETCH_HINT);
    if (g % GROUPS_PER_SUPER == 0) {
        const size_t super = (size_t)b * (G / GROUPS_PER_SUPER) + (g + PREFETCH_GROUPS) / GROUPS_PER_SUPER;
        _mm_prefetch((const char *)(p->scale + super * (format == SKIPPY_Q4K ? 2 : 1) * LANES), PREFETCH_HINT);
    }
}

/* One row's group, its integer sums (qmatmul.c's) to float into acc, the same steps on every
   path: lo, hi [2]: the two levels' dot products per half of the group (halves summed but for
   Q6K); qg: the row's group in the scratch; r its index. */
static inline __attribute__((always_inline)) __m512 group_sum(const int format, const int levels, __m512 acc,
                                                              const __m512i lo[2], const __m512i hi[2], __m512 d,
                                                              __m512 m, const skippy_rows *x, size_t r) {
    const __m512 dr = _mm512_set1_ps(x->dx[2 * r + 1]);
    if (format == SKIPPY_Q6K) {
        __m512 t[2];
        for (int h = 0; h < 2; h++) {
            __m512i both = _mm512_slli_epi32(lo[h], 7);
            if (levels == 2) both = _mm512_add_epi32(both, hi[h]);
            t[h] = _mm512_cvtepi32_ps(_mm512_sub_epi32(both, _mm512_set1_epi32(32 * x->qh[2 * r + h])));
        }
        return _mm512_fmadd_ps(_mm512_fmadd_ps(t[1], m, _mm512_mul_ps(t[0], d)), dr, acc);
    }
    if (levels == 2) { /* 128 lo + hi: the dot product in units of dr, exact */
        const __m512i both = _mm512_add_epi32(_mm512_slli_epi32(lo[0], 7), hi[0]);
        acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(both), d), dr, acc);
    } else { /* d128 = 128 d: float(128 lo) d and float(lo) (128 d) are one and the same rounding */
        acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo[0]), d), dr, acc);
    }
    return _mm512_fmadd_ps(m, _mm512_set1_ps(x->sx[r]), acc);
}

/* block b of part p against rows [m0, m1): a group's codes are unpacked once into registers,
   then each row of x runs its dot products over them */
static inline __attribute__((always_inline)) void block(const int format, const int levels, const skippy_part *p,
                                                        int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                                                        int accumulate) {
    const int G = x->G, bytes = skippy_group_bytes(format);
    const int halves = format == SKIPPY_Q6K ? 2 : 1;
    for (int t0 = m0; t0 < m1; t0 += M_TILE) {
        const int MT = m1 - t0 < M_TILE ? m1 - t0 : M_TILE;
        __m512 acc[M_TILE];
        for (int j = 0; j < M_TILE; j++) acc[j] = _mm512_setzero_ps();
        const uint8_t *codes = p->codes + (size_t)b * G * bytes;
        __m512 sd = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
        for (int g = 0; g < G; g++, codes += bytes) {
            if (t0 == m0) prefetch_ahead(format, p, b, G, g, codes); /* later tiles find the codes in L1 */
            __m512i cw[8];
            unpack(format, codes, cw);
            __m512 d, m;
            group_scales(format, levels, p, b, G, g, &sd, &sm, &d, &m);
            for (int j = 0; j < MT; j++) {
                const size_t r = (size_t)(t0 + j) * G + g;
                const int8_t *qg = x->q + r * 2 * GROUP;
                __m512i lo[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, hi[2] = {lo[0], lo[0]};
                for (int c = 0; c < 8; c++) {
                    const int h = halves == 2 ? c % 2 : 0, k = k_of(format, c);
                    lo[h] = dot4(lo[h], cw[c], qg + k);
                    if (levels == 2) hi[h] = dot4(hi[h], cw[c], qg + GROUP + k);
                }
                acc[j] = group_sum(format, levels, acc[j], lo, hi, d, m, x, r);
            }
        }
        for (int j = 0; j < MT; j++) {
            float *out = y + (size_t)(t0 + j) * N;
            __m512 r = acc[j];
            if (accumulate) r = _mm512_add_ps(r, _mm512_loadu_ps(out));
            _mm512_storeu_ps(out, r);
        }
    }
}

/* format and levels as constants in each call: the compiler drops what they do not use */
#define EACH_FORMAT_AND_LEVEL(kernel, ...)                                                                       \
    switch (p->format * 2 + levels - 1) {                                                                        \
    case SKIPPY_Q4 * 2: kernel(SKIPPY_Q4, 1, __VA_ARGS__); break;                                              \
    case SKIPPY_Q4 * 2 + 1: kernel(SKIPPY_Q4, 2, __VA_ARGS__); break;                                          \
    case SKIPPY_Q8 * 2: kernel(SKIPPY_Q8, 1, __VA_ARGS__); break;                                              \
    case SKIPPY_Q8 * 2 + 1: kernel(SKIPPY_Q8, 2, __VA_ARGS__); break;                                          \
    case SKIPPY_Q4K * 2: kernel(SKIPPY_Q4K, 1, __VA_ARGS__); break;                                            \
    case SKIPPY_Q4K * 2 + 1: kernel(SKIPPY_Q4K, 2, __VA_ARGS__); break;                                        \
    case SKIPPY_Q6K * 2: kernel(SKIPPY_Q6K, 1, __VA_ARGS__); break;                                            \
    default: kernel(SKIPPY_Q6K, 2, __VA_ARGS__); break;                                                         \
    }

void skippy_block_vnni(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                       int accumulate, int levels) {
    EACH_FORMAT_AND_LEVEL(block, p, b, x, m0, m1, y, N, accumulate)
}

#ifdef SKIPPY_AMX
/* AMX: 16 rows of x against a block's 16 rows per tile multiply. A group's product is the
   same exact integer sums as vpdpbusd's (tdpbsud: signed activations times unsigned codes,
   K = 32 a group, or 16 a half group for Q6K's two scales), stored and taken through
   group_sum's float steps in the same order: the same bits as block(). The block's codes are
   unpacked once into bytes in the tiles' layout (row c of a group's B tile: k = 4c .. 4c + 3
   of each of the 16 rows), then every tile of 16 rows of x runs over them. */

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state; /* 0 not asked yet, 1 granted, -1 refused or turned off */

/* The OS hands out tile registers only to a process that asks (Linux 5.16+; each thread's
   first tile instruction then grows its saved state) */
int skippy_amx_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        unsigned long granted = 0;
        const char *off = getenv("SKIPPY_AMX");
        const int asked = !(off && off[0] == '0') && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
                          && syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) == 0;
        state = asked && (granted >> XFEATURE_XTILEDATA & 1) ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state == 1;
}

/* A buffer per thread (*buffer, *capacity: __thread variables) of at least `bytes` (a multiple
   of 64), grown as needed and kept: the threads are OpenMP's pool, alive as long as the process */
static void *thread_buffer(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *buffer = aligned_alloc(64, bytes);
        *capacity = *buffer ? bytes : 0;
    }
    return *buffer;
}

/* The unpacked codes of the block being multiplied */
static __thread void *tiles_buffer;
static __thread size_t tiles_capacity;

static uint8_t *unpacked_buffer(size_t bytes) { return thread_buffer(&tiles_buffer, &tiles_capacity, bytes); }

/* A group's tile multiplies for 16 rows of x on tile set (A, B, C0, C1): the codes' tile at
   `tile`, the rows' group at qg (rows `stride` apart). One level: C0 = q . codes; two: C1 = r . codes
   too; Q6K (one level): C0, C1 = each half group's q . codes. Tile numbers are immediates. */
#define ISSUE(A, B, C0, C1)                                                                                        \
    do {                                                                                                           \
        _tile_loadd(B, tile, 64);                                                                                  \
        _tile_loadd(A, qg, stride);                                                                                \
        _tile_zero(C0);                                                                                            \
        _tile_dpbsud(C0, A, B);                                                                                    \
        if (halves == 2) {                                                                                         \
            _tile_loadd(B, tile + 256, 64);                                                                        \
            _tile_loadd(A, qg + 16, stride);                                                                       \
            _tile_zero(C1);                                                                                        \
            _tile_dpbsud(C1, A, B);                                                                                \
        } else if (levels == 2) {                                                                                  \
            _tile_loadd(A, qg + GROUP, stride);                                                                    \
            _tile_zero(C1);                                                                                        \
            _tile_dpbsud(C1, A, B);                                                                                \
        }                                                                                                          \
    } while (0)

/* Two sets of tiles, (0, 1, 2, 3) and (4, 5, 6, 7): group g + 1's multiplies run on the tile
   unit while group g's sums go through the float steps. Q6K with two levels needs four sums
   a group, so it takes one set of six tiles (A 0, B 1, sums 2, 3, 6, 7) and no overlap. */
static inline __attribute__((always_inline)) void block_amx(const int format, const int levels, const skippy_part *p,
                                                            int b, const skippy_rows *x, int m0, int m1, float *y,
                                                            int N, int accumulate, uint8_t *unpacked) {
    const int G = x->G, bytes = skippy_group_bytes(format), halves = format == SKIPPY_Q6K ? 2 : 1;
    const int k_tile = GROUP / halves, overlap = !(halves == 2 && levels == 2);
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;      /* C */
    config.colsb[0] = config.colsb[4] = (uint16_t)k_tile;                        /* A */
    config.rows[1] = config.rows[5] = (uint8_t)(k_tile / 4);                     /* B */
    _tile_loadconfig(&config);
    const uint8_t *codes = p->codes + (size_t)b * G * bytes;
    for (int g = 0; g < G; g++, codes += bytes) {
        __m512i cw[8];
        unpack(format, codes, cw);
        for (int c = 0; c < 8; c++) _mm512_store_si512(unpacked + (size_t)g * 512 + k_of(format, c) / 4 * 64, cw[c]);
    }
    _Alignas(64) int32_t sums[2][4][16][16]; /* [set][C0, C1 (, Q6K's two levels: 2, 3)][row][lane] */
    const size_t stride = (size_t)G * 2 * GROUP;
    for (int t0 = m0; t0 + 16 <= m1; t0 += 16) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
        __m512 sd = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
        const int8_t *rows_q = x->q + (size_t)t0 * G * 2 * GROUP;
        if (overlap) {
            const uint8_t *tile = unpacked;
            const int8_t *qg = rows_q;
            ISSUE(0, 1, 2, 3);
        }
        for (int g = 0; g < G; g++) {
            const int set = overlap ? g & 1 : 0;
            if (overlap && g + 1 < G) {
                const uint8_t *tile = unpacked + (size_t)(g + 1) * 512;
                const int8_t *qg = rows_q + (size_t)(g + 1) * 2 * GROUP;
                if (set == 0) ISSUE(4, 5, 6, 7);
                else ISSUE(0, 1, 2, 3);
            }
            if (overlap) {
                if (set == 0) {
                    _tile_stored(2, sums[0][0], 64);
                    if (halves == 2 || levels == 2) _tile_stored(3, sums[0][1], 64);
                } else {
                    _tile_stored(6, sums[1][0], 64);
                    if (halves == 2 || levels == 2) _tile_stored(7, sums[1][1], 64);
                }
            } else { /* Q6K, two levels: each half group's q and r */
                const uint8_t *tile = unpacked + (size_t)g * 512;
                const int8_t *qg = rows_q + (size_t)g * 2 * GROUP;
                _tile_loadd(1, tile, 64);
                _tile_loadd(0, qg, stride);
                _tile_zero(2);
                _tile_dpbsud(2, 0, 1);
                _tile_loadd(0, qg + GROUP, stride);
                _tile_zero(6);
                _tile_dpbsud(6, 0, 1);
                _tile_loadd(1, tile + 256, 64);
                _tile_loadd(0, qg + 16, stride);
                _tile_zero(3);
                _tile_dpbsud(3, 0, 1);
                _tile_loadd(0, qg + GROUP + 16, stride);
                _tile_zero(7);
                _tile_dpbsud(7, 0, 1);
                _tile_stored(2, sums[0][0], 64);
                _tile_stored(3, sums[0][1], 64);
                _tile_stored(6, sums[0][2], 64);
                _tile_stored(7, sums[0][3], 64);
            }
            __m512 d, m;
            group_scales(format, levels, p, b, G, g, &sd, &sm, &d, &m);
            int32_t(*s)[16][16] = sums[set];
            for (int j = 0; j < 16; j++) {
                const __m512i zero = _mm512_setzero_si512();
                __m512i lo[2] = {_mm512_load_si512(s[0][j]), zero}, hi[2] = {zero, zero};
                if (halves == 2) lo[1] = _mm512_load_si512(s[1][j]);
                if (levels == 2 && halves == 1) hi[0] = _mm512_load_si512(s[1][j]);
                if (levels == 2 && halves == 2) hi[0] = _mm512_load_si512(s[2][j]), hi[1] = _mm512_load_si512(s[3][j]);
                acc[j] = group_sum(format, levels, acc[j], lo, hi, d, m, x, (size_t)(t0 + j) * G + g);
            }
        }
        for (int j = 0; j < 16; j++) {
            float *out = y + (size_t)(t0 + j) * N;
            __m512 r = acc[j];
            if (accumulate) r = _mm512_add_ps(r, _mm512_loadu_ps(out));
            _mm512_storeu_ps(out, r);
        }
    }
    _tile_release();
}

int skippy_block_amx(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                     int accumulate, int levels) {
    if (m1 - m0 < 16 || !skippy_amx_ready()) return m0;
    uint8_t *unpacked = unpacked_buffer((size_t)x->G * 512);
    if (!unpacked) return m0;
    EACH_FORMAT_AND_LEVEL(block_amx, p, b, x, m0, m1, y, N, accumulate, unpacked)
    return m0 + (m1 - m0) / 16 * 16;
}
#endif

#ifdef SKIPPY_AMX_BF16
/* An opt-in prompt path that is NOT bit-equal to the integer paths (--prefill-precision bf16):
   x rounded to bfloat16, each weight dequantized (its group's scale and offset folded in) and
   rounded to bfloat16, and the products summed in float32 over the whole of K inside the tile
   unit (tdpbf16ps), with no float step per group. The integer paths spend most of a prompt's
   time in those per-group steps (docs/decisions.md, "Prompt activations stay quantized per 32");
   here a tile multiply does 16 x 16 x 32 products and nothing else runs per group.

   Per thread and panel of BF16_PANEL weight blocks: the blocks' whole K is dequantized once into
   a thread-local buffer (K/32 B tiles of 1 KB a block: 256 KB at K = 8192, in L2), then every
   pair of 16-row tiles of x runs over it, two blocks at a time, with 4 sums in tile registers
   (2 x 2: C 0-3, A 4-5, B 6-7). x is rounded to bfloat16 once per matmul, its rows padded to a multiple of 16
   with zeros. A row's result depends on nothing but its own x and K's fixed order, so it is the
   same bits alone and in any batch on this path (not the integer paths' bits). */

#define BF16_TILE_BYTES 1024 /* a B tile: 16 pairs along K x 16 columns x 2 bfloat16 */
/* weight blocks a thread dequantizes at once (even): 4 x K 32 bytes (1 MB at K = 8192) with two
   row tiles of x (512 KB) stays within a 2 MB L2, and x's rows stream from L3 half as often as
   with one pair; overridable for experiments */
#ifndef BF16_PANEL
#define BF16_PANEL 4
#endif

/* 16 floats, a lane each, from byte t of every 32-bit lane of v */
static inline __m512 byte_lane_ps(__m512i v, int t) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * t), _mm512_set1_epi32(255)));
}

/* Block b of part p dequantized to bfloat16 B tiles (tdpbf16ps's layout): tile g holds group g,
   its row r the weights k = 32g + 2r, 2r + 1 of each of the block's 16 rows side by side
   (column n: a 32-bit pair). w = d c + m (Q4, Q8, Q4K), d_h (c - 32) (Q6K), in float32 as
   the integer paths' scales give them, then rounded to bfloat16 (nearest, ties to even). */
static inline __attribute__((always_inline)) void dequantize_block(const int format, const skippy_part *p, int b,
                                                                   int G, uint16_t *out) {
    const int bytes = skippy_group_bytes(format);
    /* cvtne2ps_pbh puts the first pair member's 16 values in the low half: interleave them */
    _Alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_load_si512(pairs);
    const uint8_t *codes = p->codes + (size_t)b * G * bytes;
    __m512 sd = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
    for (int g = 0; g < G; g++, codes += bytes) {
        __m512i cw[8];
        unpack(format, codes, cw);
        __m512 d, m;
        group_scales(format, 2, p, b, G, g, &sd, &sm, &d, &m); /* levels 2: d as the file has it */
        uint16_t *tile = out + (size_t)g * (BF16_TILE_BYTES / 2);
        for (int j = 0; j < 8; j++) {
            __m512 w[4];
            for (int t = 0; t < 4; t++) {
                if (format == SKIPPY_Q6K) { /* each half group its own scale: d (j even), m (j odd) */
                    const __m512 c = _mm512_sub_ps(byte_lane_ps(cw[j], t), _mm512_set1_ps(32.f));
                    w[t] = _mm512_mul_ps(c, j % 2 ? m : d);
                } else {
                    w[t] = _mm512_fmadd_ps(byte_lane_ps(cw[j], t), d, m);
                }
            }
            const int row = k_of(format, j) / 2; /* tile rows row, row + 1: k, k + 1 and k + 2, k + 3 */
            for (int h = 0; h < 2; h++) {
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(w[2 * h + 1], w[2 * h]);
                _mm512_store_si512(tile + (size_t)(row + h) * 32, _mm512_permutexvar_epi16(order, both));
            }
        }
    }
}

#define EACH_FORMAT(kernel, ...)                                                                                 \
    switch (p->format) {                                                                                         \
    case SKIPPY_Q4: kernel(SKIPPY_Q4, __VA_ARGS__); break;                                                       \
    case SKIPPY_Q8: kernel(SKIPPY_Q8, __VA_ARGS__); break;                                                       \
    case SKIPPY_Q4K: kernel(SKIPPY_Q4K, __VA_ARGS__); break;                                                     \
    default: kernel(SKIPPY_Q6K, __VA_ARGS__); break;                                                             \
    }

/* The dequantized blocks of the panel being multiplied */
static __thread void *bf16_buffer;
static __thread size_t bf16_capacity;

static uint16_t *bf16_weights_buffer(size_t bytes) { return thread_buffer(&bf16_buffer, &bf16_capacity, bytes); }

/* C tile `tile`'s 16 x 16 sums into y's rows [t0, t0 + 16) below M, columns from `col`: stored
   whole, then only the rows that exist copied (or added) */
#define STORE_SUMS(tile, t0, col)                                                                                  \
    do {                                                                                                           \
        _tile_stored(tile, sums, 64);                                                                              \
        for (int j = 0; j < 16 && (t0) + j < M; j++) {                                                             \
            float *out = y + (size_t)((t0) + j) * N + (col);                                                       \
            __m512 r = _mm512_load_ps(sums[j]);                                                                    \
            if (accumulate) r = _mm512_add_ps(r, _mm512_loadu_ps(out));                                            \
            _mm512_storeu_ps(out, r);                                                                              \
        }                                                                                                          \
    } while (0)

/* x's bfloat16 rows [Mpad, K] (a) against the `count` dequantized blocks of a panel into y's
   columns from col0: per two row tiles (while two remain, then one), the panel's blocks two at a
   time, so those rows come from L3 once a panel and from L2 for its other pairs */
static void bf16_tiles(const uint16_t *a, int M, int Mpad, int K, const uint16_t *panel, int count, float *y,
                       int N, int col0, int accumulate) {
    const int G = K / GROUP;
    const size_t stride = (size_t)K * 2;
    _Alignas(64) float sums[16][16];
    for (int t0 = 0; t0 < Mpad; t0 += 32) {
        for (int b = 0; b < count; b += 2) {
            const int two_rows = t0 + 16 < Mpad, col = col0 + b * LANES;
            const uint16_t *a0 = a + (size_t)t0 * K, *a1 = a0 + (size_t)16 * K;
            const uint16_t *w0 = panel + (size_t)b * G * (BF16_TILE_BYTES / 2);
            const uint16_t *w1 = b + 1 < count ? w0 + (size_t)G * (BF16_TILE_BYTES / 2) : NULL;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int g = 0; g < G; g++) {
                _tile_loadd(6, w0 + (size_t)g * 512, 64);
                _tile_loadd(4, a0 + (size_t)g * GROUP, stride);
                _tile_dpbf16ps(0, 4, 6);
                if (two_rows) {
                    _tile_loadd(5, a1 + (size_t)g * GROUP, stride);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (w1) {
                    _tile_loadd(7, w1 + (size_t)g * 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two_rows) _tile_dpbf16ps(3, 5, 7);
                }
            }
            STORE_SUMS(0, t0, col);
            if (w1) STORE_SUMS(1, t0, col + 16);
            if (two_rows) {
                STORE_SUMS(2, t0 + 16, col);
                if (w1) STORE_SUMS(3, t0 + 16, col + 16);
            }
        }
    }
}

/* 1 where skippy_qmatmul_bf16 runs: built for AMX-BF16 (-march=native: the CPU has it) and the
   OS granted tile data (skippy_amx_ready's request, the int8 tiles' own) */
int skippy_qmatmul_bf16_ready(void) { return skippy_amx_ready(); }

/* y [M, N] (+)= x [M, K] . W^T on the bfloat16 tiles above. Returns 0, -1 for bad arguments,
   -2 out of memory, -3 where AMX-BF16 cannot run (the caller stays on skippy_qmatmul). */
int skippy_qmatmul_bf16(const float *x, int M, const skippy_matmul *w, float *y, int accumulate) {
    if (skippy_qmatmul_check(M, w)) return -1;
    if (!skippy_amx_ready()) return -3;
    const int K = w->cols, G = K / GROUP, N = w->rows, blocks = N / LANES;
    const int panels = (blocks + BF16_PANEL - 1) / BF16_PANEL;
    const int Mpad = (M + 15) / 16 * 16;
    uint16_t *a = aligned_alloc(64, (size_t)Mpad * K * 2);
    if (!a) return -2;
    int failed = 0;
    #pragma omp parallel
    {
        /* x to bfloat16, 32 values at a time (K is a multiple of 32); the padding rows zero */
        #pragma omp for schedule(static)
        for (int m = 0; m < Mpad; m++) {
            uint16_t *row = a + (size_t)m * K;
            for (int k = 0; k < K; k += 32) {
                __m512i both = _mm512_setzero_si512();
                if (m < M) {
                    const float *v = x + (size_t)m * K + k;
                    both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v));
                }
                _mm512_store_si512(row + k, both);
            }
        }
        uint16_t *weights = bf16_weights_buffer((size_t)BF16_PANEL * G * BF16_TILE_BYTES);
        tile_config config = {0};
        config.palette = 1;
        for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
        if (weights) _tile_loadconfig(&config);
        else __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        #pragma omp for schedule(dynamic)
        for (int panel = 0; panel < panels; panel++) {
            if (!weights) continue;
            int count = 0;
            for (int b = panel * BF16_PANEL; b < (panel + 1) * BF16_PANEL && b < blocks; b++, count++) {
                int part = 0, first = 0; /* the part holding block b, and that part's first block */
                while (b >= first + w->part[part].rows / LANES) first += w->part[part++].rows / LANES;
                const skippy_part *p = &w->part[part];
                EACH_FORMAT(dequantize_block, p, b - first, G, weights + (size_t)count * G * (BF16_TILE_BYTES / 2))
            }
            bf16_tiles(a, M, Mpad, K, weights, count, y, N, panel * BF16_PANEL * LANES, accumulate);
        }
        if (weights) _tile_release();
    }
    free(a);
    return failed ? -2 : 0;
}
#endif

#ifndef SKIPPY_AMX
int skippy_amx_ready(void) { return 0; }

int skippy_block_amx(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                     int accumulate, int levels) {
    (void)p, (void)b, (void)x, (void)m1, (void)y, (void)N, (void)accumulate, (void)levels;
    return m0;
}
#endif
#endif

#ifndef SKIPPY_AMX_BF16
int skippy_qmatmul_bf16_ready(void) { return 0; }

int skippy_qmatmul_bf16(const float *x, int M, const skippy_matmul *w, float *y, int accumulate) {
    (void)x, (void)M, (void)w, (void)y, (void)accumulate;
    return -3;
}
#endif
