/* qmatmul.c's block kernels on AVX2 without AVX-512 (AMD before Zen 4, most Intel desktops).

   vpmaddubsw multiplies unsigned bytes by signed ones into pairs of saturating int16,
   vpmaddwd by ones widens them into the 4-byte sums vpdpbusd gives. Each 64-byte chunk
   is two registers: rows 0-7, rows 8-15.
   4-bit codes: a pair is at most 2 * 15 * 127, so a level's 8 products of a group add up
   in int16 (< 2^15) before one widening. 6-bit codes: a pair is at most 2 * 63 * 127, so
   two add up before a widening.
   8-bit codes would saturate a pair (2 * 255 * 127), so they are taken as c - 128
   (signed) in llama.cpp's way: |c - 128| times q with the sign of c - 128, a pair at
   most 2 * 128 * 127; the 128 * sum(q) that removing 128 takes away is added back once. */

#include "qmatmul.h"

#ifdef SKIPPY_AVX2
#include <immintrin.h>
#include <string.h>

#define M_TILE 8         /* rows of x sharing one unpacking of a block's codes */
#define PREFETCH_GROUPS 8 /* groups of a block fetched ahead */
#define LOCKSTEP_ROWS 4  /* 4-bit codes, 3 rows or more: rows of x in lockstep */

static inline __m256i bcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

/* Q6K's top 2 bits of the codes in chunk c's bytes (bits 2c, 2c+1 of `top`), moved to bits 4-5 */
static inline __m256i top_bits(__m256i top, int c) {
    const __m256i shifted = c < 2 ? _mm256_slli_epi16(top, 4 - 2 * c) : c == 2 ? top : _mm256_srli_epi16(top, 2);
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x30));
}

/* Group g's scales of lanes 8h .. 8h + 7: d and the offset's m, or each half group's d (Q6K) */
static inline __attribute__((always_inline)) void group_scales(const int format, const skippy_part *p, int b, int G,
                                                               int g, int h, __m256 *d, __m256 *m) {
    const size_t at = (size_t)b * G + g;
    if (format == SKIPPY_Q4 || format == SKIPPY_Q8) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->scale + at * LANES + 8 * h)));
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->offset + at * LANES + 8 * h)));
        return;
    }
    const size_t super = (size_t)b * (G / GROUPS_PER_SUPER) + g / GROUPS_PER_SUPER;
    const int fields = format == SKIPPY_Q4K ? 2 : 1;
    const __m256 sd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->scale + super * fields * LANES + 8 * h)));
    const __m128i first = _mm_loadl_epi64((const __m128i *)(p->sub + at * 2 * LANES + 8 * h));
    const __m128i second = _mm_loadl_epi64((const __m128i *)(p->sub + at * 2 * LANES + LANES + 8 * h));
    if (format == SKIPPY_Q4K) {
        const __m256 sm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p->scale + (super * 2 + 1) * LANES + 8 * h)));
        *d = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first)));
        *m = _mm256_mul_ps(sm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second)));
    } else {
        *d = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)));
        *m = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)));
    }
}

/* One row's group into acc (the float steps of qmatmul_avx512.c's group_sum, 8 lanes) */
static inline __attribute__((always_inline)) __m256 group_sum(const int format, __m256 acc, const __m256i both[2],
                                                              __m256 d, __m256 m, const skippy_rows *x, size_t r) {
    const __m256 dr = _mm256_set1_ps(x->dx[2 * r + 1]);
    if (format == SKIPPY_Q6K) {
        __m256 t[2];
        for (int h = 0; h < 2; h++)
            t[h] = _mm256_cvtepi32_ps(_mm256_sub_epi32(both[h], _mm256_set1_epi32(32 * x->qh[2 * r + h])));
        return _mm256_fmadd_ps(_mm256_fmadd_ps(t[1], m, _mm256_mul_ps(t[0], d)), dr, acc);
    }
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(both[0]), d), dr, acc);
    return _mm256_fmadd_ps(m, _mm256_set1_ps(x->sx[r]), acc);
}

static inline __attribute__((always_inline)) void block(const int format, const int levels, const skippy_part *p,
                                                        int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                                                        int accumulate) {
    const int G = x->G, bytes = skippy_group_bytes(format);
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int t0 = m0; t0 < m1; t0 += M_TILE) {
        const int MT = m1 - t0 < M_TILE ? m1 - t0 : M_TILE;
        __m256 acc[M_TILE][2];
        for (int j = 0; j < M_TILE; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        const uint8_t *codes = p->codes + (size_t)b * G * bytes;
        for (int g = 0; g < G; g++, codes += bytes) {
            /* the weights stream from memory once a step: fetch a few groups ahead,
               non-temporally: read once, they need not pass through L2 and L3, where they would
               evict everything the step's Python runs on (docs/decisions.md, "Weight prefetch:
               non-temporal on AVX2, into L1 on AVX512-VNNI") */
            for (int l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)(codes + PREFETCH_GROUPS * bytes + l), _MM_HINT_NTA);
            __m256i cw[8][2], sg[8][2]; /* [k chunk][row half]: unsigned codes (8 bits: |c - 128|, sg: c - 128) */
            if (format == SKIPPY_Q8) {
                for (int c = 0; c < 8; c++)
                    for (int h = 0; h < 2; h++) {
                        sg[c][h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + c * 64 + 32 * h)), flip);
                        cw[c][h] = _mm256_abs_epi8(sg[c][h]);
                    }
            } else {
                for (int h = 0; h < 2; h++) {
                    __m256i top[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                    if (format == SKIPPY_Q6K)
                        for (int half = 0; half < 2; half++)
                            top[half] = _mm256_loadu_si256((const __m256i *)(codes + 256 + 64 * half + 32 * h));
                    for (int c = 0; c < 4; c++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + c * 64 + 32 * h));
                        cw[2 * c][h] = _mm256_and_si256(raw, low4);
                        cw[2 * c + 1][h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                        if (format == SKIPPY_Q6K) {
                            cw[2 * c][h] = _mm256_or_si256(cw[2 * c][h], top_bits(top[0], c));
                            cw[2 * c + 1][h] = _mm256_or_si256(cw[2 * c + 1][h], top_bits(top[1], c));
                        }
                    }
                }
            }
            __m256 d[2], m[2];
            for (int h = 0; h < 2; h++) group_scales(format, p, b, G, g, h, &d[h], &m[h]);
            for (int j = 0; j < MT; j++) {
                const size_t r = (size_t)(t0 + j) * G + g;
                const int8_t *qg = x->q + r * 2 * GROUP;
                __m256i both[2][2]; /* [row half][group half] */
                for (int h = 0; h < 2; h++) {
                    __m256i lo[2], hi[2];
                    if (format == SKIPPY_Q4 || format == SKIPPY_Q4K) {
                        __m256i l16 = _mm256_setzero_si256(), h16 = _mm256_setzero_si256();
                        for (int c = 0; c < 4; c++) {
                            l16 = _mm256_add_epi16(l16, _mm256_maddubs_epi16(cw[2 * c][h], bcast4(qg + 4 * c)));
                            l16 = _mm256_add_epi16(l16, _mm256_maddubs_epi16(cw[2 * c + 1][h], bcast4(qg + 16 + 4 * c)));
                            if (levels == 2) {
                                h16 = _mm256_add_epi16(h16, _mm256_maddubs_epi16(cw[2 * c][h], bcast4(qg + GROUP + 4 * c)));
                                h16 = _mm256_add_epi16(h16, _mm256_maddubs_epi16(cw[2 * c + 1][h],
                                                                                 bcast4(qg + GROUP + 16 + 4 * c)));
                            }
                        }
                        lo[0] = _mm256_madd_epi16(l16, ones);
                        hi[0] = levels == 2 ? _mm256_madd_epi16(h16, ones) : _mm256_setzero_si256();
                    } else if (format == SKIPPY_Q6K) {
                        for (int half = 0; half < 2; half++) { /* cw[2c + half]: the group's half `half` */
                            lo[half] = hi[half] = _mm256_setzero_si256();
                            for (int c = 0; c < 4; c += 2) {
                                const int k = 16 * half + 4 * c;
                                lo[half] = _mm256_add_epi32(lo[half], _mm256_madd_epi16(_mm256_add_epi16(
                                    _mm256_maddubs_epi16(cw[2 * c + half][h], bcast4(qg + k)),
                                    _mm256_maddubs_epi16(cw[2 * c + 2 + half][h], bcast4(qg + k + 4))), ones));
                                if (levels == 2)
                                    hi[half] = _mm256_add_epi32(hi[half], _mm256_madd_epi16(_mm256_add_epi16(
                                        _mm256_maddubs_epi16(cw[2 * c + half][h], bcast4(qg + GROUP + k)),
                                        _mm256_maddubs_epi16(cw[2 * c + 2 + half][h], bcast4(qg + GROUP + k + 4))),
                                        ones));
                            }
                        }
                    } else {
                        lo[0] = hi[0] = _mm256_setzero_si256();
                        for (int c = 0; c < 8; c++) {
                            const __m256i ql = bcast4(qg + 4 * c), qh = bcast4(qg + GROUP + 4 * c);
                            lo[0] = _mm256_add_epi32(lo[0], _mm256_madd_epi16(
                                _mm256_maddubs_epi16(cw[c][h], _mm256_sign_epi8(ql, sg[c][h])), ones));
                            if (levels == 2)
                                hi[0] = _mm256_add_epi32(hi[0], _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(cw[c][h], _mm256_sign_epi8(qh, sg[c][h])), ones));
                        }
                    }
                    /* 128 lo + hi: the group's dot product in units of the second level, exact in int32 */
                    const __m256i offset = _mm256_set1_epi32(format == SKIPPY_Q8 ? 128 * x->qs[r] : 0);
                    for (int half = 0; half < (format == SKIPPY_Q6K ? 2 : 1); half++)
                        both[h][half] = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(lo[half], 7), hi[half]),
                                                         offset);
                }
                for (int h = 0; h < 2; h++) acc[j][h] = group_sum(format, acc[j][h], both[h], d[h], m[h], x, r);
            }
        }
        for (int j = 0; j < MT; j++) {
            float *out = y + (size_t)(t0 + j) * N;
            for (int h = 0; h < 2; h++) {
                __m256 r = acc[j][h];
                if (accumulate) r = _mm256_add_ps(r, _mm256_loadu_ps(out + 8 * h));
                _mm256_storeu_ps(out + 8 * h, r);
            }
        }
    }
}

/* 4-bit codes against 3 rows of x or more. vpmaddubsw issues on one port of a Zen 2 core, one a
   cycle, and block() reached half that: its 16 code registers and 16 accumulators overflow
   AVX2's 16 registers, and GCC, free to reassociate the int16 sums, computed every product
   first, spilling each to the stack. Here a block is done half by half (8 rows, one register),
   a group's codes are unpacked one chunk at a time, and LOCKSTEP_ROWS rows of x take each chunk
   in turn, their sums pinned in registers (the empty asm) so each row's additions stay in order.
   The integer sums and the float steps after them are block()'s, in its order: a row's outputs
   are the same bits on either path, so a session computes alike in any batch. One or two rows
   stay on block(), whose single pass over the codes streams them best (docs/decisions.md,
   "Waves on co-located stages; the AVX2 lockstep matmul"). */
static inline __attribute__((always_inline)) void block_q4_lockstep(const int format, const int levels,
                                                                    const skippy_part *p, int b, const skippy_rows *x,
                                                                    int m0, int m1, float *y, int N, int accumulate) {
    const int G = x->G, bytes = skippy_group_bytes(format);
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const uint8_t *block_codes = p->codes + (size_t)b * G * bytes;
    for (int t0 = m0; t0 < m1; t0 += LOCKSTEP_ROWS) {
        const int MT = m1 - t0 < LOCKSTEP_ROWS ? m1 - t0 : LOCKSTEP_ROWS;
        for (int h = 0; h < 2; h++) {
            __m256 acc[LOCKSTEP_ROWS];
            for (int j = 0; j < LOCKSTEP_ROWS; j++) acc[j] = _mm256_setzero_ps();
            const uint8_t *codes = block_codes + 32 * h;
            for (int g = 0; g < G; g++, codes += bytes) {
                if (h == 0) /* the second half's bytes share the first's cache lines */
                    for (int l = 0; l < bytes; l += 64)
                        _mm_prefetch((const char *)(codes + PREFETCH_GROUPS * bytes + l), _MM_HINT_NTA);
                const int8_t *qg[LOCKSTEP_ROWS]; /* a short tile repeats its first row, whose sums go unused */
                for (int j = 0; j < LOCKSTEP_ROWS; j++) qg[j] = x->q + ((size_t)(t0 + (j < MT ? j : 0)) * G + g) * 2 * GROUP;
                __m256i l16[LOCKSTEP_ROWS], h16[LOCKSTEP_ROWS];
                for (int j = 0; j < LOCKSTEP_ROWS; j++) l16[j] = h16[j] = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + c * 64));
                    const __m256i lo4 = _mm256_and_si256(raw, low4), hi4 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    for (int j = 0; j < LOCKSTEP_ROWS; j++) {
                        l16[j] = _mm256_add_epi16(l16[j], _mm256_maddubs_epi16(lo4, bcast4(qg[j] + 4 * c)));
                        l16[j] = _mm256_add_epi16(l16[j], _mm256_maddubs_epi16(hi4, bcast4(qg[j] + 16 + 4 * c)));
                        if (levels == 2) {
                            h16[j] = _mm256_add_epi16(h16[j], _mm256_maddubs_epi16(lo4, bcast4(qg[j] + GROUP + 4 * c)));
                            h16[j] = _mm256_add_epi16(h16[j], _mm256_maddubs_epi16(hi4, bcast4(qg[j] + GROUP + 16 + 4 * c)));
                        }
                        __asm__("" : "+x"(l16[j]));
                        if (levels == 2) __asm__("" : "+x"(h16[j]));
                    }
                }
                __m256 d, m;
                group_scales(format, p, b, G, g, h, &d, &m);
                for (int j = 0; j < MT; j++) {
                    const size_t r = (size_t)(t0 + j) * G + g;
                    const __m256i lo = _mm256_madd_epi16(l16[j], ones);
                    const __m256i hi = levels == 2 ? _mm256_madd_epi16(h16[j], ones) : _mm256_setzero_si256();
                    const __m256i both[2] = {_mm256_add_epi32(_mm256_slli_epi32(lo, 7), hi), _mm256_setzero_si256()};
                    acc[j] = group_sum(format, acc[j], both, d, m, x, r);
                }
            }
            for (int j = 0; j < MT; j++) {
                float *out = y + (size_t)(t0 + j) * N + 8 * h;
                __m256 r = acc[j];
                if (accumulate) r = _mm256_add_ps(r, _mm256_loadu_ps(out));
                _mm256_storeu_ps(out, r);
            }
        }
    }
}

void skippy_block_avx2(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                       int accumulate, int levels) {
    const int lockstep = m1 - m0 >= 3;
    switch (p->format * 2 + levels - 1) {
    case SKIPPY_Q4 * 2:
        if (lockstep) block_q4_lockstep(SKIPPY_Q4, 1, p, b, x, m0, m1, y, N, accumulate);
        else block(SKIPPY_Q4, 1, p, b, x, m0, m1, y, N, accumulate);
        break;
    case SKIPPY_Q4 * 2 + 1:
        if (lockstep) block_q4_lockstep(SKIPPY_Q4, 2, p, b, x, m0, m1, y, N, accumulate);
        else block(SKIPPY_Q4, 2, p, b, x, m0, m1, y, N, accumulate);
        break;
    case SKIPPY_Q4K * 2:
        if (lockstep) block_q4_lockstep(SKIPPY_Q4K, 1, p, b, x, m0, m1, y, N, accumulate);
        else block(SKIPPY_Q4K, 1, p, b, x, m0, m1, y, N, accumulate);
        break;
    case SKIPPY_Q4K * 2 + 1:
        if (lockstep) block_q4_lockstep(SKIPPY_Q4K, 2, p, b, x, m0, m1, y, N, accumulate);
        else block(SKIPPY_Q4K, 2, p, b, x, m0, m1, y, N, accumulate);
        break;
    case SKIPPY_Q8 * 2: block(SKIPPY_Q8, 1, p, b, x, m0, m1, y, N, accumulate); break;
    case SKIPPY_Q8 * 2 + 1: block(SKIPPY_Q8, 2, p, b, x, m0, m1, y, N, accumulate); break;
    case SKIPPY_Q6K * 2: block(SKIPPY_Q6K, 1, p, b, x, m0, m1, y, N, accumulate); break;
    default: block(SKIPPY_Q6K, 2, p, b, x, m0, m1, y, N, accumulate); break;
    }
}
#endif
