/* y [M, N] (+)= x [M, K] . W^T, with W [N, K] kept as the GGUF file's integer codes.

   W holds, per row and group of 32 along K, codes c (4 or 8 bits) with
   w = d * c + m (d, m float16). x is quantized per row and group of 32 to int8: q
   with scale dx = max|x| / 127, as llama.cpp quantizes activations. With two levels
   the remainder x - dx q (at most dx / 2) is quantized too, as r with scale
   dr = dx / 128, so x ~ dx q + dr r within dr / 2, 128x closer than one level. dr
   being dx / 128 exactly, a group's product is one integer dot product in units of dr:
       sum_i w_i x_i ~ d dr (128 sum_i c_i q_i + sum_i c_i r_i) + m (dx sum_i q_i + dr sum_i r_i)
   exact in int32 (|128 sum c q| < 2^28 for 8-bit codes); one level is the same with r = 0.
   The second level doubles the integer work: with AVX512-VNNI a one-row step hides it
   behind the weights' memory traffic, on AVX2 it is 1.6x the time of 8 rows. The caller
   picks per matmul (quant.py's build_linear): two levels where one is too coarse.
   The offset takes the quantized sum, not the exact one: then the error is
   sum_i w_i e_i (e = x - dx q - dr r), where with the exact sum it would be
   sum_i (w_i - m) e_i, and w - m is one-signed and about twice |w| (perplexity
   +2.1% instead of +0.2% on SmolLM2 Q4_1 with one level; llama.cpp's Q8_1 sums alike).
   levels 1 or 2 is a constant in each block call, so each compiles without the other's code.

   Layout (quant.py's Int8Weights writes it): rows in blocks of 16, one vector
   lane per row, so a block's 16 outputs come out of one register with no
   horizontal sums. For block b and group g, the codes are 16 * group_bytes bytes
   in chunks of 64: chunk c holds, for lane (row) i, 4 bytes at c*64 + 4*i:
     8 bits: codes k = 32g + 4c .. +3                                (8 chunks)
     4 bits: low nibbles k = 32g + 4c .. +3, high nibbles k + 16     (4 chunks)
   d and m are float16 [N/16, G, 16]. With AVX512-VNNI, one vpdpbusd (unsigned
   codes times 4 signed q broadcast to every lane) does 16 rows x 4 k. A block's
   group is unpacked into registers once for up to M_TILE rows of x, and every row
   then takes the same instructions whatever the tile, so a row computes alike in
   any batch (8 rows: 22% faster than tiles of 4 that unpacked per tile and
   broadcast q apart from the multiply).

   16-row blocks are split across OpenMP threads. The library links libgomp.so.1,
   the name torch's own copy is loaded under, so both share one thread pool
   (torch.set_num_threads sizes it). kernels.py builds this file at first use
   with -march=native. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SKIPPY_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SKIPPY_AVX2 1
#endif

#define GROUP 32
#define LANES 16 /* rows per block */
#define M_TILE 8 /* rows of x sharing one unpacking of a block's codes */
#define PREFETCH_GROUPS 8 /* AVX2 path: groups of a block fetched ahead */
#define VNNI_PREFETCH_GROUPS 24 /* AVX512-VNNI path: groups fetched ahead (a thread's blocks lie end to end) */
#define LOCKSTEP_ROWS 4 /* AVX2 path, 4-bit codes, 3 rows or more: rows of x in lockstep */

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

/* x [M, K] -> per group of 32 (r = row * K/32 + group): q int8 [r][64], the group's
   32 first-level codes then its 32 second-level ones; dx [r][2]: their scales;
   sx [r]: dx * sum(q) + dr * sum(r), the offset's multiplier; qs [r]: 128 sum(q) + sum(r),
   the same sums in units of dr, exact */
static inline __attribute__((always_inline)) void quantize_group(int r, const float *x, int levels, int8_t *q,
                                                                  float *dx, float *sx, int32_t *qs) {
    const float *v = x + (size_t)r * GROUP;
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
    int8_t *out = q + (size_t)r * 2 * GROUP;
    _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qb));
    _mm_storeu_si128((__m128i *)(out + 32), _mm512_cvtsepi32_epi8(ra));
    _mm_storeu_si128((__m128i *)(out + 48), _mm512_cvtsepi32_epi8(rb));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    const int sum2 = _mm512_reduce_add_epi32(_mm512_add_epi32(ra, rb));
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
    __m256i qi[4], ri[4], qsum = _mm256_setzero_si256(), rsum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], s));
        ri[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_fnmadd_ps(_mm256_cvtepi32_ps(qi[i]), vd, a[i]), s2));
        qsum = _mm256_add_epi32(qsum, qi[i]), rsum = _mm256_add_epi32(rsum, ri[i]);
    }
    /* packs interleaves the 128-bit lanes: dwords come out as rows 0,2,4,6,1,3,5,7 of 4 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int8_t *out = q + (size_t)r * 2 * GROUP;
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order));
    _mm256_storeu_si256((__m256i *)(out + GROUP), _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(ri[0], ri[1]), _mm256_packs_epi32(ri[2], ri[3])), order));
    __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
    __m128i r4 = _mm_add_epi32(_mm256_castsi256_si128(rsum), _mm256_extracti128_si256(rsum, 1));
    q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0x4E)), r4 = _mm_add_epi32(r4, _mm_shuffle_epi32(r4, 0x4E));
    q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0xB1)), r4 = _mm_add_epi32(r4, _mm_shuffle_epi32(r4, 0xB1));
    const int sum = _mm_cvtsi128_si32(q4), sum2 = _mm_cvtsi128_si32(r4);
#else
    float amax = 0.f;
    for (int i = 0; i < GROUP; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const float d2 = d / 128.f, inv2 = d2 > 0.f && levels == 2 ? 1.f / d2 : 0.f;
    int8_t *out = q + (size_t)r * 2 * GROUP;
    int sum = 0, sum2 = 0;
    for (int i = 0; i < GROUP; i++) {
        const float level = rintf(v[i] * inv); /* ties to even */
        out[i] = (int8_t)(int)level;
        out[GROUP + i] = (int8_t)(int)rintf(fmaf(-level, d, v[i]) * inv2);
        sum += out[i], sum2 += out[GROUP + i];
    }
#endif
    dx[2 * r] = d, dx[2 * r + 1] = d2;
    sx[r] = d * (float)sum + d2 * (float)sum2;
    qs[r] = 128 * sum + sum2;
}

static void quantize_rows(const float *x, int M, int K, int levels, int8_t *q, float *dx, float *sx, int32_t *qs) {
    const int groups = M * (K / GROUP);
    #pragma omp parallel for schedule(static) if (M > 8)
    for (int r = 0; r < groups; r++) quantize_group(r, x, levels, q, dx, sx, qs);
}

#ifdef SKIPPY_VNNI
/* acc += codes . (4 signed bytes at q, in every lane), the bytes broadcast by the
   instruction's own memory operand: GCC emits a separate vpbroadcastd otherwise */
static inline __m512i dot4(__m512i acc, __m512i codes, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const int32_t *)q));
    return acc;
}

/* block b of W (its 16 rows) against every row of x: a group's codes are unpacked once
   into registers, then each row of x runs its 16 dot products over them */
static inline __attribute__((always_inline)) void block_vnni(int b, int M, int G, int bits, int levels, const uint8_t *w, const uint16_t *wd, const uint16_t *wm,
                       const int8_t *q, const float *dx, const float *sx, float *y, int N, int accumulate) {
    const int block_group_bytes = LANES * (bits == 4 ? 16 : 32);
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int m0 = 0; m0 < M; m0 += M_TILE) {
        const int MT = M - m0 < M_TILE ? M - m0 : M_TILE;
        __m512 acc[M_TILE];
        for (int j = 0; j < M_TILE; j++) acc[j] = _mm512_setzero_ps();
        const uint8_t *codes = w + (size_t)b * G * block_group_bytes;
        const uint16_t *bd = wd + (size_t)b * G * LANES, *bm = wm + (size_t)b * G * LANES;
        for (int g = 0; g < G; g++, codes += block_group_bytes) {
            /* the weights stream from memory once a step: fetch them well ahead, into every
               cache level (Intel Xeon with AVX512-VNNI, 2 threads, bundled model, one-row decode
               steps: none 283 tok/s, 8 groups ahead 343, 16 385, 24-32 394-396, 64 390;
               _MM_HINT_NTA, which suits the AVX2 path on a Zen 2 EPYC, 109 at 8 groups) */
            if (m0 == 0) /* later tiles of rows find the block's codes in L1 */
                for (int l = 0; l < block_group_bytes; l += 64)
                    _mm_prefetch((const char *)(codes + VNNI_PREFETCH_GROUPS * block_group_bytes + l), _MM_HINT_T0);
            if (m0 == 0 && (g & 1) == 0) { /* two groups' scales a line: +0.5-0.8% (3 interleaved runs) */
                _mm_prefetch((const char *)(bd + (g + VNNI_PREFETCH_GROUPS) * LANES), _MM_HINT_T0);
                _mm_prefetch((const char *)(bm + (g + VNNI_PREFETCH_GROUPS) * LANES), _MM_HINT_T0);
            }
            __m512i cw[8];
            if (bits == 4) {
                for (int c = 0; c < 4; c++) {
                    const __m512i raw = _mm512_loadu_si512(codes + c * 64);
                    cw[2 * c] = _mm512_and_si512(raw, low4);
                    cw[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                }
            } else {
                for (int c = 0; c < 8; c++) cw[c] = _mm512_loadu_si512(codes + c * 64);
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bd + g * LANES)));
            const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bm + g * LANES)));
            for (int j = 0; j < MT; j++) {
                const size_t r = (size_t)(m0 + j) * G + g;
                const int8_t *qg = q + r * 2 * GROUP;
                __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
                if (bits == 4) {
                    for (int c = 0; c < 4; c++) {
                        lo = dot4(lo, cw[2 * c], qg + 4 * c);
                        lo = dot4(lo, cw[2 * c + 1], qg + 16 + 4 * c);
                        if (levels == 2) {
                            hi = dot4(hi, cw[2 * c], qg + GROUP + 4 * c);
                            hi = dot4(hi, cw[2 * c + 1], qg + GROUP + 16 + 4 * c);
                        }
                    }
                } else {
                    for (int c = 0; c < 8; c++) {
                        lo = dot4(lo, cw[c], qg + 4 * c);
                        if (levels == 2) hi = dot4(hi, cw[c], qg + GROUP + 4 * c);
                    }
                }
                /* 128 lo + hi: the group's dot product in units of the second level, exact in int32 */
                const __m512i both = _mm512_add_epi32(_mm512_slli_epi32(lo, 7), hi);
                const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(both), d);
                acc[j] = _mm512_fmadd_ps(scaled, _mm512_set1_ps(dx[2 * r + 1]), acc[j]);
                acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r]), acc[j]);
            }
        }
        for (int j = 0; j < MT; j++) {
            float *out = y + (size_t)(m0 + j) * N + (size_t)b * LANES;
            __m512 r = acc[j];
            if (accumulate) r = _mm512_add_ps(r, _mm512_loadu_ps(out));
            _mm512_storeu_ps(out, r);
        }
    }
}
#endif

#ifdef SKIPPY_AVX2
/* AVX2 (no VNNI): vpmaddubsw multiplies unsigned bytes by signed ones into pairs of
   saturating int16, vpmaddwd by ones widens them into the 4-byte sums vpdpbusd gives.
   Each 64-byte chunk is two registers: rows 0-7, rows 8-15.
   4-bit codes: a pair is at most 2 * 15 * 127, so a level's 8 products of a group add
   up in int16 (< 2^15) before one widening.
   8-bit codes would saturate a pair (2 * 255 * 127), so they are taken as c - 128
   (signed) in llama.cpp's way: |c - 128| times q with the sign of c - 128, a pair at
   most 2 * 128 * 127; the 128 * sum(q) that removing 128 takes away is added back once. */
static inline __m256i bcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void block_avx2(int b, int M, int G, int bits, int levels, const uint8_t *w, const uint16_t *wd, const uint16_t *wm,
                       const int8_t *q, const float *dx, const float *sx, const int32_t *qs, float *y, int N,
                       int accumulate) {
    const int block_group_bytes = LANES * (bits == 4 ? 16 : 32);
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int m0 = 0; m0 < M; m0 += M_TILE) {
        const int MT = M - m0 < M_TILE ? M - m0 : M_TILE;
        __m256 acc[M_TILE][2];
        for (int j = 0; j < M_TILE; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        const uint8_t *codes = w + (size_t)b * G * block_group_bytes;
        const uint16_t *bd = wd + (size_t)b * G * LANES, *bm = wm + (size_t)b * G * LANES;
        for (int g = 0; g < G; g++, codes += block_group_bytes) {
            /* the weights stream from memory once a step: fetch a few groups ahead (all 121
               matmuls of a SmolLM2 token, 2 threads, EPYC: 15.5 -> 12.3 ms, 8 groups ahead),
               non-temporally: read once, they need not pass through L2 and L3, where they evicted
               everything the step's Python runs on. On a Zen 2 EPYC the matmuls took the same time
               either way, and the Python between a stage's layers ran ~2x faster after them: between
               a 2-stage chain's layers 1.7 -> 0.9 ms a token, one process and 2 stages +7% decode */
            for (int l = 0; l < block_group_bytes; l += 64)
                _mm_prefetch((const char *)(codes + PREFETCH_GROUPS * block_group_bytes + l), _MM_HINT_NTA);
            __m256i cw[8][2], sg[8][2]; /* [k chunk][row half]: unsigned codes (8 bits: |c - 128|, sg: c - 128) */
            if (bits == 4) {
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 2; h++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + c * 64 + 32 * h));
                        cw[2 * c][h] = _mm256_and_si256(raw, low4);
                        cw[2 * c + 1][h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    }
            } else {
                for (int c = 0; c < 8; c++)
                    for (int h = 0; h < 2; h++) {
                        sg[c][h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + c * 64 + 32 * h)), flip);
                        cw[c][h] = _mm256_abs_epi8(sg[c][h]);
                    }
            }
            __m256 d[2], mw[2];
            for (int h = 0; h < 2; h++) {
                d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bd + g * LANES + 8 * h)));
                mw[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bm + g * LANES + 8 * h)));
            }
            for (int j = 0; j < MT; j++) {
                const size_t r = (size_t)(m0 + j) * G + g;
                const int8_t *qg = q + r * 2 * GROUP;
                int32_t offset = 0;
                __m256i lo[2], hi[2];
                if (bits == 4) {
                    for (int h = 0; h < 2; h++) {
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
                        lo[h] = _mm256_madd_epi16(l16, ones);
                        hi[h] = levels == 2 ? _mm256_madd_epi16(h16, ones) : _mm256_setzero_si256();
                    }
                } else {
                    for (int h = 0; h < 2; h++) lo[h] = hi[h] = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c++) {
                        const __m256i ql = bcast4(qg + 4 * c), qh = bcast4(qg + GROUP + 4 * c);
                        for (int h = 0; h < 2; h++) {
                            lo[h] = _mm256_add_epi32(lo[h], _mm256_madd_epi16(
                                _mm256_maddubs_epi16(cw[c][h], _mm256_sign_epi8(ql, sg[c][h])), ones));
                            if (levels == 2)
                                hi[h] = _mm256_add_epi32(hi[h], _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(cw[c][h], _mm256_sign_epi8(qh, sg[c][h])), ones));
                        }
                    }
                    offset = 128 * qs[r];
                }
                const __m256 dr = _mm256_set1_ps(dx[2 * r + 1]), srow = _mm256_set1_ps(sx[r]);
                for (int h = 0; h < 2; h++) {
                    /* 128 lo + hi: the group's dot product in units of the second level, exact in int32 */
                    const __m256i both = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(lo[h], 7), hi[h]),
                                                          _mm256_set1_epi32(offset));
                    const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(both), d[h]);
                    acc[j][h] = _mm256_fmadd_ps(scaled, dr, acc[j][h]);
                    acc[j][h] = _mm256_fmadd_ps(mw[h], srow, acc[j][h]);
                }
            }
        }
        for (int j = 0; j < MT; j++) {
            float *out = y + (size_t)(m0 + j) * N + (size_t)b * LANES;
            for (int h = 0; h < 2; h++) {
                __m256 r = acc[j][h];
                if (accumulate) r = _mm256_add_ps(r, _mm256_loadu_ps(out + 8 * h));
                _mm256_storeu_ps(out + 8 * h, r);
            }
        }
    }
}

/* 4-bit codes against 3 rows of x or more on AVX2. vpmaddubsw issues on one port of a
   Zen 2 core, one a cycle, and block_avx2 reached half that: its 16 code registers and
   16 accumulators overflow AVX2's 16 registers, and GCC, free to reassociate the int16
   sums, computed every product first, spilling each to the stack. Here a block is done
   half by half (8 rows, one register), a group's codes are unpacked one chunk at a time,
   and LOCKSTEP_ROWS rows of x take each chunk in turn, their sums pinned in registers
   (the empty asm) so each row's additions stay in order. The integer sums and the float
   steps after them are block_avx2's, in its order: a row's outputs are the same bits
   on either path, so a session computes alike in any batch. All 121 matmuls of a
   SmolLM2 token, 2 threads, Zen 2: 8 rows 12.6 -> 10.3 ms, 336 rows 484 -> 385 ms.
   One or two rows stay on block_avx2, whose single pass over the codes streams them
   best (one row: 3.0 against 4.8 ms). */
static inline __attribute__((always_inline)) void block_avx2_q4_lockstep(int b, int M, int G, int levels, const uint8_t *w,
                       const uint16_t *wd, const uint16_t *wm, const int8_t *q, const float *dx, const float *sx,
                       float *y, int N, int accumulate) {
    const int block_group_bytes = LANES * 16;
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const uint8_t *block_codes = w + (size_t)b * G * block_group_bytes;
    const uint16_t *bd = wd + (size_t)b * G * LANES, *bm = wm + (size_t)b * G * LANES;
    for (int m0 = 0; m0 < M; m0 += LOCKSTEP_ROWS) {
        const int MT = M - m0 < LOCKSTEP_ROWS ? M - m0 : LOCKSTEP_ROWS;
        for (int h = 0; h < 2; h++) {
            __m256 acc[LOCKSTEP_ROWS];
            for (int j = 0; j < LOCKSTEP_ROWS; j++) acc[j] = _mm256_setzero_ps();
            const uint8_t *codes = block_codes + 32 * h;
            for (int g = 0; g < G; g++, codes += block_group_bytes) {
                if (h == 0) /* the second half's bytes share the first's cache lines */
                    for (int l = 0; l < block_group_bytes; l += 64)
                        _mm_prefetch((const char *)(codes + PREFETCH_GROUPS * block_group_bytes + l), _MM_HINT_NTA);
                const int8_t *qg[LOCKSTEP_ROWS]; /* a short tile repeats its first row, whose sums go unused */
                for (int j = 0; j < LOCKSTEP_ROWS; j++) qg[j] = q + ((size_t)(m0 + (j < MT ? j : 0)) * G + g) * 2 * GROUP;
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
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bd + g * LANES + 8 * h)));
                const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bm + g * LANES + 8 * h)));
                for (int j = 0; j < MT; j++) {
                    const size_t r = (size_t)(m0 + j) * G + g;
                    const __m256i lo = _mm256_madd_epi16(l16[j], ones);
                    const __m256i hi = levels == 2 ? _mm256_madd_epi16(h16[j], ones) : _mm256_setzero_si256();
                    const __m256i both = _mm256_add_epi32(_mm256_slli_epi32(lo, 7), hi); /* 4-bit: no offset */
                    const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(both), d);
                    acc[j] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(dx[2 * r + 1]), acc[j]);
                    acc[j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r]), acc[j]);
                }
            }
            for (int j = 0; j < MT; j++) {
                float *out = y + (size_t)(m0 + j) * N + (size_t)b * LANES + 8 * h;
                __m256 r = acc[j];
                if (accumulate) r = _mm256_add_ps(r, _mm256_loadu_ps(out));
                _mm256_storeu_ps(out, r);
            }
        }
    }
}
#endif

/* the same arithmetic in plain C, for CPUs without AVX2 */
__attribute__((unused)) static void block_plain(int b, int M, int G, int bits, int levels, const uint8_t *w, const uint16_t *wd, const uint16_t *wm,
                        const int8_t *q, const float *dx, const float *sx, float *y, int N, int accumulate) {
    const int block_group_bytes = LANES * (bits == 4 ? 16 : 32);
    for (int m = 0; m < M; m++) {
        float total[LANES] = {0};
        for (int g = 0; g < G; g++) {
            const uint8_t *codes = w + ((size_t)b * G + g) * block_group_bytes;
            const size_t r = (size_t)m * G + g;
            for (int level = 0; level < levels; level++) {
                const int8_t *qg = q + r * 2 * GROUP + level * GROUP;
                int32_t dots[LANES] = {0};
                for (int c = 0; c < (bits == 4 ? 4 : 8); c++)
                    for (int i = 0; i < LANES; i++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t byte = codes[c * 64 + 4 * i + t];
                            if (bits == 4)
                                dots[i] += (byte & 15) * qg[4 * c + t] + (byte >> 4) * qg[16 + 4 * c + t];
                            else
                                dots[i] += byte * qg[4 * c + t];
                        }
                const size_t s = ((size_t)b * G + g) * LANES;
                for (int i = 0; i < LANES; i++) total[i] += f16_to_f32(wd[s + i]) * (float)dots[i] * dx[2 * r + level];
            }
            const size_t s = ((size_t)b * G + g) * LANES;
            for (int i = 0; i < LANES; i++) total[i] += f16_to_f32(wm[s + i]) * sx[r];
        }
        float *out = y + (size_t)m * N + (size_t)b * LANES;
        for (int i = 0; i < LANES; i++) out[i] = accumulate ? out[i] + total[i] : total[i];
    }
}

/* block b of y against x quantized into q, dx, sx, qs, on the vector path compiled in */
static inline __attribute__((always_inline)) void one_block(int b, int M, int G, int bits, int levels, const uint8_t *w,
                                                             const uint16_t *wd, const uint16_t *wm, const int8_t *q,
                                                             const float *dx, const float *sx, const int32_t *qs,
                                                             float *y, int N, int accumulate) {
    /* levels as a constant in each call: the compiler drops the second level's code */
#if defined(SKIPPY_VNNI)
    (void)qs;
    if (levels == 2) block_vnni(b, M, G, bits, 2, w, wd, wm, q, dx, sx, y, N, accumulate);
    else block_vnni(b, M, G, bits, 1, w, wd, wm, q, dx, sx, y, N, accumulate);
#elif defined(SKIPPY_AVX2)
    if (bits == 4 && M >= 3) {
        if (levels == 2) block_avx2_q4_lockstep(b, M, G, 2, w, wd, wm, q, dx, sx, y, N, accumulate);
        else block_avx2_q4_lockstep(b, M, G, 1, w, wd, wm, q, dx, sx, y, N, accumulate);
    } else if (levels == 2) block_avx2(b, M, G, bits, 2, w, wd, wm, q, dx, sx, qs, y, N, accumulate);
    else block_avx2(b, M, G, bits, 1, w, wd, wm, q, dx, sx, qs, y, N, accumulate);
#else
    (void)qs;
    block_plain(b, M, G, bits, levels, w, wd, wm, q, dx, sx, y, N, accumulate);
#endif
}

int skippy_qmatmul_check(int M, int K, int bits, int levels, int N) {
    return K % GROUP || N % LANES || (bits != 4 && bits != 8) || (levels != 1 && levels != 2) || M < 1 ? -1 : 0;
}

/* x [M, K] quantized, for skippy_qmatmul_blocks: q int8 [M K/32][64], dx [M K/32][2],
   sx and qs [M K/32], one after the other in `scratch` (skippy_qmatmul_scratch_bytes) */
size_t skippy_qmatmul_scratch_bytes(int M, int K) {
    const size_t r = (size_t)M * (K / GROUP);
    return r * 2 * GROUP + r * sizeof(float) * 3 + r * sizeof(int32_t);
}

static void scratch_parts(void *scratch, int M, int K, int8_t **q, float **dx, float **sx, int32_t **qs) {
    const size_t r = (size_t)M * (K / GROUP);
    *q = scratch;
    *dx = (float *)(*q + r * 2 * GROUP);
    *sx = *dx + 2 * r;
    *qs = (int32_t *)(*sx + r);
}

/* groups [r0, r1) of x's quantization into scratch (rows are M x K/32 groups) */
void skippy_qmatmul_quantize(const float *x, int M, int K, int levels, void *scratch, int r0, int r1) {
    int8_t *q;
    float *dx, *sx;
    int32_t *qs;
    scratch_parts(scratch, M, K, &q, &dx, &sx, &qs);
    for (int r = r0; r < r1; r++) quantize_group(r, x, levels, q, dx, sx, qs);
}

/* blocks [b0, b1) of y [M, N] (+)= x . W^T, x quantized into scratch: each block computes
   alike whichever thread runs it (layers.c deals them out inside one parallel region) */
void skippy_qmatmul_blocks(const void *scratch, int M, int K, const uint8_t *w, const uint16_t *wd,
                           const uint16_t *wm, int bits, int levels, int N, float *y, int accumulate, int b0, int b1) {
    int8_t *q;
    float *dx, *sx;
    int32_t *qs;
    scratch_parts((void *)scratch, M, K, &q, &dx, &sx, &qs);
    const int G = K / GROUP;
    for (int b = b0; b < b1; b++) one_block(b, M, G, bits, levels, w, wd, wm, q, dx, sx, qs, y, N, accumulate);
}

/* bits 4 or 8; levels 1 or 2; N % 16 == 0; K % 32 == 0; accumulate: y += instead of y =.
   Returns 0, or -1 for bad arguments, -2 when out of memory. */
int skippy_qmatmul(const float *x, int M, int K, const uint8_t *w, const uint16_t *wd, const uint16_t *wm,
                   int bits, int levels, int N, float *y, int accumulate) {
    if (skippy_qmatmul_check(M, K, bits, levels, N)) return -1;
    const int G = K / GROUP;
    void *scratch = malloc(skippy_qmatmul_scratch_bytes(M, K));
    if (!scratch) return -2;
    int8_t *q;
    float *dx, *sx;
    int32_t *qs;
    scratch_parts(scratch, M, K, &q, &dx, &sx, &qs);
    quantize_rows(x, M, K, levels, q, dx, sx, qs);
    #pragma omp parallel for schedule(guided)
    for (int b = 0; b < N / LANES; b++) one_block(b, M, G, bits, levels, w, wd, wm, q, dx, sx, qs, y, N, accumulate);
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
