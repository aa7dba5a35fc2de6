/* y [M, N] (+)= x [M, K] . W^T, with W [N, K] kept as the GGUF file's integer codes.

   W holds, per row and group of 32 along K, codes c with w = d * c + m. x is quantized
   per row and group of 32 to int8: q with scale dx = max|x| / 127, as llama.cpp quantizes
   activations. With two levels the remainder x - dx q (at most dx / 2) is quantized too,
   as r with scale dr = dx / 128, so x ~ dx q + dr r within dr / 2, 128x closer than one
   level. dr being dx / 128 exactly, a group's product is one integer dot product in units
   of dr:
       sum_i w_i x_i ~ d dr (128 sum_i c_i q_i + sum_i c_i r_i) + m (dx sum_i q_i + dr sum_i r_i)
   exact in int32 (|128 sum c q| < 2^28 for 8-bit codes); one level is the same with r = 0.
   The second level doubles the integer work: with AVX512-VNNI a one-row step hides it
   behind the weights' memory traffic, on AVX2 it is 1.6x the time of 8 rows. The caller
   picks per matmul (quant.py's build_linear): two levels where one is too coarse.
   The offset takes the quantized sum, not the exact one: then the error is
   sum_i w_i e_i (e = x - dx q - dr r), where with the exact sum it would be
   sum_i (w_i - m) e_i, and w - m is one-signed and about twice |w| (perplexity
   +2.1% instead of +0.2% on SmolLM2 Q4_1 with one level; llama.cpp's Q8_1 sums alike).

   Layout (quant.py writes it): rows in blocks of 16, one vector lane per row, so a
   block's 16 outputs come out of one register with no horizontal sums. For block b and
   group g, the codes are chunks of 64 bytes: chunk c holds, for lane (row) i, 4 bytes at
   c*64 + 4*i:
     SKIPPY_Q8:          codes k = 32g + 4c .. +3                         (8 chunks, 512 bytes)
     SKIPPY_Q4, Q4K:     low nibbles k = 32g + 4c .. +3, high ones k + 16 (4 chunks, 256 bytes)
     SKIPPY_Q6K:         the low 4 bits as Q4's 4 chunks, then 2 chunks of their top 2 bits:
                         chunk 4 + h, byte 4i + t, bits 2c..2c+1: code k = 32g + 16h + 4c + t
                         (384 bytes, 0.75 a weight: Q6_K's own size with its scales)
   and the scales (skippy_kernels.h, skippy_part):
     Q4, Q8:  d, m float16 per group [N/16, G, 16]
     Q4K:     Q4_K's: per super-block of 8 groups, float16 d and -dmin [N/16, S, 2, 16]; per
              group 6-bit scale and min [N/16, G, 2, 16]: d = d_s scale, m = -dmin_s min, exact
              in float32 (0.578 bytes a weight with the codes, Q4_K's 0.5625)
     Q6K:     Q6_K's: w = d_s scale_h (c - 32), d_s float16 per super-block [N/16, S, 16], scale_h
              int8 per half group (16 weights) [N/16, G, 2, 16]. The 32 comes off in integers:
              sum_half (c - 32)(128 q + r) = (128 sum c q + sum c r) - 32 qh, qh the half's sums.
   With AVX512-VNNI, one vpdpbusd (unsigned codes times 4 signed q broadcast to every lane)
   does 16 rows x 4 k. A block's group is unpacked into registers once for up to M_TILE
   rows of x, and every row then takes the same instructions whatever the tile, so a row
   computes alike in any batch. With AMX (qmatmul_avx512.c), 16 rows of x at a time take
   one tile multiply per group and level and then the same float steps: the same bits.

   16-row blocks are split across OpenMP threads. The library links libgomp.so.1,
   the name torch's own copy is loaded under, so both share one thread pool
   (torch.set_num_threads sizes it). qkernel.py builds this file at first use
   with -march=native. */

#include "qmatmul.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(SKIPPY_VNNI) || defined(SKIPPY_AVX2)
#include <immintrin.h>
#endif

#ifndef ROW_CHUNK
#define ROW_CHUNK 64 /* rows of x a pass over the weights takes (skippy_qmatmul) */
#endif

/* x [M, K] -> group r's first- and second-level codes, scales and sums (skippy_rows) */
static inline __attribute__((always_inline)) void quantize_group(int r, const float *x, int levels, int8_t *q,
                                                                  float *dx, float *sx, int32_t *qs, int32_t *qh) {
    const float *v = x + (size_t)r * GROUP;
    int8_t *out = q + (size_t)r * 2 * GROUP;
    int sum[2], sum2[2]; /* per half of the group: first level, second level */
#ifdef SKIPPY_VNNI
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const float d2 = d / 128.f, inv2 = d2 > 0.f && levels == 2 ? 1.f / d2 : 0.f;
    const __m512 s = _mm512_set1_ps(inv), vd = _mm512_set1_ps(d), s2 = _mm512_set1_ps(inv2);
    /* cvtps rounds to nearest, ties to even */
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, s)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, s));
    const __m512 ea = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), vd, a), eb = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), vd, b);
    const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(ea, s2)), rb = _mm512_cvtps_epi32(_mm512_mul_ps(eb, s2));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qb));
    _mm_storeu_si128((__m128i *)(out + 32), _mm512_cvtsepi32_epi8(ra));
    _mm_storeu_si128((__m128i *)(out + 48), _mm512_cvtsepi32_epi8(rb));
    sum[0] = _mm512_reduce_add_epi32(qa), sum[1] = _mm512_reduce_add_epi32(qb);
    sum2[0] = _mm512_reduce_add_epi32(ra), sum2[1] = _mm512_reduce_add_epi32(rb);
#elif defined(SKIPPY_AVX2)
    /* the plain loop's arithmetic, 8 lanes at a time (cvtps rounds as rintf does); 336 rows
       of a SmolLM2 prompt spent ~5% of their matmuls' time in the loop */
    __m256 a[4], amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        a[i] = _mm256_loadu_ps(v + 8 * i);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.f), a[i]));
    }
    amax8 = _mm256_max_ps(amax8, _mm256_permute2f128_ps(amax8, amax8, 1));
    amax8 = _mm256_max_ps(amax8, _mm256_permute_ps(amax8, 0x4E));
    amax8 = _mm256_max_ps(amax8, _mm256_permute_ps(amax8, 0xB1));
    const float amax = _mm256_cvtss_f32(amax8);
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const float d2 = d / 128.f, inv2 = d2 > 0.f && levels == 2 ? 1.f / d2 : 0.f;
    const __m256 s = _mm256_set1_ps(inv), vd = _mm256_set1_ps(d), s2 = _mm256_set1_ps(inv2);
    __m256i qi[4], ri[4];
    for (int i = 0; i < 4; i++) {
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], s));
        ri[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_fnmadd_ps(_mm256_cvtepi32_ps(qi[i]), vd, a[i]), s2));
    }
    /* packs interleaves the 128-bit lanes: dwords come out as rows 0,2,4,6,1,3,5,7 of 4 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order));
    _mm256_storeu_si256((__m256i *)(out + GROUP), _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(ri[0], ri[1]), _mm256_packs_epi32(ri[2], ri[3])), order));
    for (int h = 0; h < 2; h++) {
        __m256i q8 = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]), r8 = _mm256_add_epi32(ri[2 * h], ri[2 * h + 1]);
        __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(q8), _mm256_extracti128_si256(q8, 1));
        __m128i r4 = _mm_add_epi32(_mm256_castsi256_si128(r8), _mm256_extracti128_si256(r8, 1));
        q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0x4E)), r4 = _mm_add_epi32(r4, _mm_shuffle_epi32(r4, 0x4E));
        q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0xB1)), r4 = _mm_add_epi32(r4, _mm_shuffle_epi32(r4, 0xB1));
        sum[h] = _mm_cvtsi128_si32(q4), sum2[h] = _mm_cvtsi128_si32(r4);
    }
#else
    float amax = 0.f;
    for (int i = 0; i < GROUP; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const float d2 = d / 128.f, inv2 = d2 > 0.f && levels == 2 ? 1.f / d2 : 0.f;
    sum[0] = sum[1] = sum2[0] = sum2[1] = 0;
    for (int i = 0; i < GROUP; i++) {
        const float level = rintf(v[i] * inv); /* ties to even */
        out[i] = (int8_t)(int)level;
        out[GROUP + i] = (int8_t)(int)rintf(fmaf(-level, d, v[i]) * inv2);
        sum[i / 16] += out[i], sum2[i / 16] += out[GROUP + i];
    }
#endif
    dx[2 * r] = d, dx[2 * r + 1] = d2;
    sx[r] = d * (float)(sum[0] + sum[1]) + d2 * (float)(sum2[0] + sum2[1]);
    qh[2 * r] = 128 * sum[0] + sum2[0], qh[2 * r + 1] = 128 * sum[1] + sum2[1];
    qs[r] = qh[2 * r] + qh[2 * r + 1];
}

/* x [M, K] quantized, for skippy_qmatmul_blocks: q int8 [M K/32][64], dx [M K/32][2], sx, qs
   [M K/32] and qh [M K/32][2], one after the other in `scratch` (skippy_qmatmul_scratch_bytes) */
size_t skippy_qmatmul_scratch_bytes(int M, int K) {
    const size_t r = (size_t)M * (K / GROUP);
    return r * 2 * GROUP + r * sizeof(float) * 3 + r * sizeof(int32_t) * 3;
}

static skippy_rows scratch_rows(const void *scratch, int M, int K) {
    const size_t r = (size_t)M * (K / GROUP);
    const int8_t *q = scratch;
    const float *dx = (const float *)(q + r * 2 * GROUP);
    const float *sx = dx + 2 * r;
    const int32_t *qs = (const int32_t *)(sx + r);
    return (skippy_rows){q, dx, sx, qs, qs + r, M, K / GROUP};
}

/* groups [r0, r1) of x's quantization into scratch (rows are M x K/32 groups) */
void skippy_qmatmul_quantize(const float *x, int M, int K, int levels, void *scratch, int r0, int r1) {
    const skippy_rows rows = scratch_rows(scratch, M, K);
    for (int r = r0; r < r1; r++)
        quantize_group(r, x, levels, (int8_t *)rows.q, (float *)rows.dx, (float *)rows.sx, (int32_t *)rows.qs,
                       (int32_t *)rows.qh);
}

/* code k (0..31) of lane i in group g of block b of part p, as the layout above keeps it */
static int code_at(const skippy_part *p, int G, int b, int g, int i, int k) {
    const uint8_t *group = p->codes + ((size_t)b * G + g) * skippy_group_bytes(p->format);
    if (p->format == SKIPPY_Q8) return group[(k / 4) * 64 + 4 * i + k % 4];
    const int half = k / 16, c = (k % 16) / 4, t = k % 4;
    const uint8_t byte = group[c * 64 + 4 * i + t];
    const int low = half ? byte >> 4 : byte & 15;
    if (p->format != SKIPPY_Q6K) return low;
    return low | ((group[(4 + half) * 64 + 4 * i + t] >> (2 * c)) & 3) << 4;
}

/* The same arithmetic in plain C, for CPUs without AVX2 (and the reference the tests hold
   the vector paths to): per group and lane, integer dot products per level (per half of
   the group for Q6K), then the scales */
__attribute__((unused)) static void block_plain(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                        int accumulate, int levels) {
    const int G = x->G, S = G / GROUPS_PER_SUPER;
    for (int m = m0; m < m1; m++) {
        float total[LANES] = {0};
        for (int g = 0; g < G; g++) {
            const size_t r = (size_t)m * G + g, s = (size_t)b * G + g, sb = (size_t)b * S + g / GROUPS_PER_SUPER;
            for (int i = 0; i < LANES; i++) {
                int32_t dot[2][2] = {{0, 0}, {0, 0}}; /* [level][half] */
                for (int level = 0; level < levels; level++)
                    for (int k = 0; k < GROUP; k++)
                        dot[level][k / 16] += code_at(p, G, b, g, i, k) * x->q[r * 2 * GROUP + level * GROUP + k];
                if (p->format == SKIPPY_Q6K) {
                    const float d = skippy_f16_to_f32(p->scale[sb * LANES + i]);
                    const int8_t *sub = (const int8_t *)p->sub + s * 2 * LANES;
                    int32_t t[2];
                    for (int h = 0; h < 2; h++) t[h] = 128 * dot[0][h] + dot[1][h] - 32 * x->qh[2 * r + h];
                    const float scaled = fmaf((float)t[1], d * (float)sub[LANES + i], (float)t[0] * (d * (float)sub[i]));
                    total[i] = fmaf(scaled, x->dx[2 * r + 1], total[i]);
                    continue;
                }
                float d, offset;
                if (p->format == SKIPPY_Q4K) {
                    d = skippy_f16_to_f32(p->scale[sb * 2 * LANES + i]) * (float)p->sub[s * 2 * LANES + i];
                    offset = skippy_f16_to_f32(p->scale[sb * 2 * LANES + LANES + i])
                             * (float)p->sub[s * 2 * LANES + LANES + i];
                } else {
                    d = skippy_f16_to_f32(p->scale[s * LANES + i]);
                    offset = skippy_f16_to_f32(p->offset[s * LANES + i]);
                }
                for (int level = 0; level < levels; level++)
                    total[i] += d * (float)(dot[level][0] + dot[level][1]) * x->dx[2 * r + level];
                total[i] += offset * x->sx[r];
            }
        }
        float *out = y + (size_t)m * N;
        for (int i = 0; i < LANES; i++) out[i] = accumulate ? out[i] + total[i] : total[i];
    }
}

/* block b of part p against rows [m0, m1) of x on the fastest path compiled in */
static void one_block(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                      int accumulate, int levels) {
#if defined(SKIPPY_VNNI)
    m0 = skippy_block_amx(p, b, x, m0, m1, y, N, accumulate, levels);
    if (m0 < m1) skippy_block_vnni(p, b, x, m0, m1, y, N, accumulate, levels);
#elif defined(SKIPPY_AVX2)
    skippy_block_avx2(p, b, x, m0, m1, y, N, accumulate, levels);
#else
    block_plain(p, b, x, m0, m1, y, N, accumulate, levels);
#endif
}

int skippy_qmatmul_check(int M, const skippy_matmul *w) {
    if (M < 1 || w->cols % GROUP || (w->levels != 1 && w->levels != 2) || w->num_parts < 1
        || w->num_parts > SKIPPY_MAX_PARTS)
        return -1;
    int rows = 0;
    for (int i = 0; i < w->num_parts; i++) {
        const skippy_part *p = &w->part[i];
        if (p->rows < LANES || p->rows % LANES || p->format < SKIPPY_Q4 || p->format > SKIPPY_Q6K || !p->codes
            || !p->scale)
            return -1;
        if ((p->format == SKIPPY_Q4K || p->format == SKIPPY_Q6K) && (w->cols % SKIPPY_SUPER || !p->sub)) return -1;
        if ((p->format == SKIPPY_Q4 || p->format == SKIPPY_Q8) && !p->offset) return -1;
        rows += p->rows;
    }
    return rows == w->rows ? 0 : -1;
}

/* blocks [b0, b1) against rows [m0, m1) of x (skippy_qmatmul_blocks for every row) */
static void blocks_rows(const skippy_rows *x, const skippy_matmul *w, float *y, int accumulate, int b0, int b1,
                        int m0, int m1) {
    int part = 0, first = 0; /* the part holding block b0, and that part's first block */
    for (int b = b0; b < b1; b++) {
        while (b >= first + w->part[part].rows / LANES) first += w->part[part++].rows / LANES;
        one_block(&w->part[part], b - first, x, m0, m1, y + (size_t)b * LANES, w->rows, accumulate, w->levels);
    }
}

/* blocks [b0, b1) of y [M, w->rows] (+)= x . W^T (blocks count across the parts), x
   quantized into scratch: each block computes alike whichever thread runs it (layers.c
   deals them out inside one parallel region) */
void skippy_qmatmul_blocks(const void *scratch, int M, const skippy_matmul *w, float *y, int accumulate, int b0,
                           int b1) {
    const skippy_rows x = scratch_rows(scratch, M, w->cols);
    blocks_rows(&x, w, y, accumulate, b0, b1, 0, M);
}

/* Returns 0, or -1 for bad arguments (skippy_qmatmul_check), -2 when out of memory.
   Many rows (a prompt) go ROW_CHUNK at a time past every block: a block takes its rows of x from
   the scratch, which for all of a 512-row prompt is up to 8 MB (ffn_down of a 3B model) and came
   from L3 for every block; a chunk's stays in L2, and the weights are read once a chunk. */
int skippy_qmatmul(const float *x, int M, const skippy_matmul *w, float *y, int accumulate) {
    if (skippy_qmatmul_check(M, w)) return -1;
    const int K = w->cols, groups = M * (K / GROUP), blocks = w->rows / LANES;
    void *scratch = malloc(skippy_qmatmul_scratch_bytes(M, K));
    if (!scratch) return -2;
    const skippy_rows rows = scratch_rows(scratch, M, K);
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < groups; r++) skippy_qmatmul_quantize(x, M, K, w->levels, scratch, r, r + 1);
        for (int m0 = 0; m0 < M; m0 += ROW_CHUNK) {
            const int m1 = M - m0 < ROW_CHUNK ? M : m0 + ROW_CHUNK;
            #pragma omp for schedule(guided)
            for (int b = 0; b < blocks; b++) blocks_rows(&rows, w, y, accumulate, b, b + 1, m0, m1);
        }
    }
    free(scratch);
    return 0;
}

/* the vector path compiled in: 1 AVX512-VNNI, 2 AVX2, 0 none (plain C) */
int skippy_qmatmul_vector_path(void) {
#if defined(SKIPPY_VNNI)
    return 1;
#elif defined(SKIPPY_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* 1 when many-row matmuls run on AMX tiles here (built for it, and the OS let us use them) */
int skippy_qmatmul_amx(void) {
#if defined(SKIPPY_VNNI)
    return skippy_amx_ready();
#else
    return 0;
#endif
}
