/* Per-row pieces of a decode step: RMS norm (of rows, or of heads in place), RoPE, SwiGLU,
   GeGLU and one query row's
   attention over a session's KV cache. A decode step runs them on a single row,
   where torch's dispatch and thread wake-ups cost several times their arithmetic
   (docs/decisions.md, 2026-12-01). float32 rows, float16 or float32 caches; attention in AVX-512 or AVX2
   where the CPU has it (on an AVX2-only EPYC its plain C took half of a decode step),
   plain C that the compiler vectorizes elsewhere (`omp simd` lets it reorder a sum,
   as any vector kernel does). exp is glibc's vector expf where either is. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "skippy_kernels.h"

/* Rows are shared among threads past this many (a prompt's; a row computes alike either way):
   a long prompt's per-row work on one thread leaves the other cores idle, while a decode
   step's few rows cost less than waking the team */
#define PARALLEL_ROWS 16

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows r < rows of D */
void skippy_rms_norm(const float *x, int rows, int D, const float *w, float eps, float *out) {
    #pragma omp parallel for schedule(static) if (rows > PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *v = x + (size_t)r * D;
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int i = 0; i < D; i++) ss += v[i] * v[i];
        const float inv = 1.f / sqrtf(ss / (float)D + eps);
        float *o = out + (size_t)r * D;
        for (int i = 0; i < D; i++) o[i] = v[i] * inv * w[i];
    }
}

/* In place: RMS norm over each of heads [first, first + count) of every row of x
   [T, row_heads, hd] (the q or the k heads of a fused qkv row), all with one weight [hd] */
void skippy_head_rms_norm(float *x, int T, int row_heads, int first, int count, int hd, const float *w, float eps) {
    for (int t = 0; t < T; t++) {
        float *heads = x + ((size_t)t * row_heads + first) * hd;
        skippy_rms_norm(heads, count, hd, w, eps, heads); /* a row's sum is taken before it is written */
    }
}

#define MAX_HEAD_DIM 512

#if defined(__AVX512F__) && defined(__GLIBC__)
#include <immintrin.h>
#define SKIPPY_AVX512 1
__m512 _ZGVeN16v_expf(__m512); /* glibc's vector expf (libmvec), the one -ffast-math would pick */

/* dst[i] = exp(src[i]) for n floats, 16 at a time */
static void exp_n(const float *src, int n, float *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _ZGVeN16v_expf(_mm512_loadu_ps(src + i)));
    if (i < n) {
        const __mmask16 live = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(dst + i, live, _ZGVeN16v_expf(_mm512_maskz_loadu_ps(live, src + i)));
    }
}

/* 16 values of a cache row as float32 */
static inline __m512 load16(const void *base, int f16, size_t at) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at)));
    return _mm512_loadu_ps((const float *)base + at);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__GLIBC__)
#include <immintrin.h>
#define SKIPPY_AVX2 1
__m256 _ZGVdN8v_expf(__m256); /* glibc's AVX2 vector expf */

static void exp_n(const float *src, int n, float *dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _ZGVdN8v_expf(_mm256_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = expf(src[i]);
}

/* 8 values of a cache row as float32 */
static inline __m256 load8(const void *base, int f16, size_t at) {
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)));
    return _mm256_loadu_ps((const float *)base + at);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#else
static void exp_n(const float *src, int n, float *dst) {
    for (int i = 0; i < n; i++) dst[i] = expf(src[i]);
}
#endif

static inline float cache_value(const void *base, int f16, size_t at) {
    return f16 ? (float)((const _Float16 *)base)[at] : ((const float *)base)[at];
}

#if defined(SKIPPY_AVX512) || defined(SKIPPY_AVX2)
/* The attention below is written once over VL-float vectors: 16 with AVX-512, 8 with AVX2
   (one of the two is compiled in) */
#ifdef SKIPPY_AVX512
#define VL 16
typedef __m512 vec;
#define vload_cache load16
#define vloadu _mm512_loadu_ps
#define vstoreu _mm512_storeu_ps
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vmul _mm512_mul_ps
#define vfmadd _mm512_fmadd_ps
#define vmax _mm512_max_ps
#define vsum _mm512_reduce_add_ps
#define vtop _mm512_reduce_max_ps
#else
#define VL 8
typedef __m256 vec;
#define vload_cache load8
#define vloadu _mm256_loadu_ps
#define vstoreu _mm256_storeu_ps
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vmul _mm256_mul_ps
#define vfmadd _mm256_fmadd_ps
#define vmax _mm256_max_ps
#define vsum sum8
#define vtop max8
#endif

/* Rows g0 .. g0 + gt of a group, vectors c0 .. c0 + cn of each: the softmax-weighted sums of
   the values (probabilities sj [group, T]) into oj, unscaled */
static inline __attribute__((always_inline)) void values_vec(const int gt, const int cn, int n, int g0, int c0,
                                                              const float *sj, const void *v, int f16, int T,
                                                              float *oj) {
    vec o[3][4];
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < cn; i++) o[g][i] = vzero();
    for (int t = 0; t < T; t++) {
        vec p[3];
        for (int g = 0; g < gt; g++) p[g] = vset1(sj[(size_t)(g0 + g) * T + t]);
        for (int i = 0; i < cn; i++) {
            const vec row = vload_cache(v, f16, (size_t)t * (VL * n) + VL * (c0 + i));
            for (int g = 0; g < gt; g++) o[g][i] = vfmadd(p[g], row, o[g][i]);
        }
    }
    for (int g = 0; g < gt; g++)
        for (int i = 0; i < cn; i++) vstoreu(oj + (g0 + g) * (VL * n) + VL * (c0 + i), o[g][i]);
}

/* Scores of rows g0 .. g0 + gt of a group (queries qj [group, VL n]) against keys t .. t + kt:
   sj[g, t] = scale * (q_g . k_t), each dot product's vectors and lanes summed as one row
   and one key alone sum them */
static inline __attribute__((always_inline)) void scores_vec(const int gt, const int kt, int n, int g0, int t,
                                                              const float *qj, const void *k, int f16, int T,
                                                              float scale, float *sj) {
    vec dot[3][4];
    for (int g = 0; g < gt; g++) /* set by i == 0 below; said here for the compiler's sake */
        for (int j = 0; j < kt; j++) dot[g][j] = vzero();
    for (int i = 0; i < n; i++) {
        vec q[3];
        for (int g = 0; g < gt; g++) q[g] = vloadu(qj + (g0 + g) * (VL * n) + VL * i);
        for (int j = 0; j < kt; j++) {
            const vec key = vload_cache(k, f16, (size_t)(t + j) * (VL * n) + VL * i);
            for (int g = 0; g < gt; g++) dot[g][j] = i ? vfmadd(q[g], key, dot[g][j]) : vmul(q[g], key);
        }
    }
    for (int g = 0; g < gt; g++)
        for (int j = 0; j < kt; j++) sj[(size_t)(g0 + g) * T + t + j] = vsum(dot[g][j]) * scale;
}

/* The cache rows stream from memory (a step's other reads evicted them): on the first pass
   over the keys, fetch the keys KV_PREFETCH_ROWS ahead into L1 and the values of the rows
   at hand into L2 for the pass over the values. The hardware prefetchers alone left a
   512-key attention at ~11 GB/s on a 3B model (docs/decisions.md, "Attention's cache rows
   prefetched"). */
#ifndef KV_PREFETCH_ROWS
#define KV_PREFETCH_ROWS 16
#endif
static inline __attribute__((always_inline)) void prefetch_rows(const void *k, const void *v, size_t row_bytes,
                                                                int t, int T) {
    if (t + KV_PREFETCH_ROWS + 4 <= T)
        for (size_t at = 0; at < 4 * row_bytes; at += 64)
            _mm_prefetch((const char *)k + (t + KV_PREFETCH_ROWS) * row_bytes + at, _MM_HINT_T0);
    for (size_t at = 0; at < 4 * row_bytes; at += 64) _mm_prefetch((const char *)v + t * row_bytes + at, _MM_HINT_T1);
}

/* attend_group for hd = VL n. Scores: up to 3 rows of the group against 4 keys at a time,
   12 independent sums (one row against one key at a time chained each sum's multiply-adds
   on the one before, and widened a float16 key once a row); then each row's maximum in a
   pass of its own (a running maximum would chain every key on the last). Values: up to 3
   rows take each value vector as it is read, 4 vectors of a row at a time so the sums stay
   in registers. Every sum runs in the order one row and one key alone take, so these are the
   bits of the one-row-at-a-time loops they replaced (AVX2: 1 row, 9 heads of 64 over 1000
   keys 92 -> 77 us; AVX-512 45.7 -> 42.4 us). */
static inline __attribute__((always_inline)) void attend_group_vec(
    const int n, const float *qj, int group, const void *k, const void *v, int f16, int T, float scale,
    float *sj, float *oj) {
    const size_t row_bytes = (size_t)VL * n * (f16 ? 2 : 4);
    for (int g0 = 0; g0 < group; g0 += 3) {
        const int gt = group - g0 < 3 ? group - g0 : 3;
        int t = 0;
        for (; t + 4 <= T; t += 4) {
            if (g0 == 0) prefetch_rows(k, v, row_bytes, t, T);
            if (gt == 3) scores_vec(3, 4, n, g0, t, qj, k, f16, T, scale, sj);
            else scores_vec(gt, 4, n, g0, t, qj, k, f16, T, scale, sj);
        }
        for (; t < T; t++) scores_vec(gt, 1, n, g0, t, qj, k, f16, T, scale, sj);
    }
    for (int g = 0; g < group; g++) {
        float *s = sj + (size_t)g * T;
        vec top = vset1(-INFINITY);
        int t = 0;
        for (; t + VL <= T; t += VL) top = vmax(top, vloadu(s + t));
        float m = vtop(top);
        for (; t < T; t++) m = s[t] > m ? s[t] : m;
        for (t = 0; t < T; t++) s[t] -= m;
        exp_n(s, T, s);
    }
    for (int g0 = 0; g0 < group; g0 += 3) {
        const int gt = group - g0 < 3 ? group - g0 : 3;
        for (int c0 = 0; c0 < n; c0 += 4) {
            const int cn = n - c0 < 4 ? n - c0 : 4;
            if (gt == 3 && cn == 4) values_vec(3, 4, n, g0, c0, sj, v, f16, T, oj);
            else values_vec(gt, cn, n, g0, c0, sj, v, f16, T, oj);
        }
        for (int g = g0; g < g0 + gt; g++) {
            const float *s = sj + (size_t)g * T;
            float sum = 0.f;
            for (int t = 0; t < T; t++) sum += s[t];
            const vec inv = vset1(1.f / sum);
            for (int i = 0; i < n; i++) {
                float *o = oj + g * (VL * n) + VL * i;
                vstoreu(o, vmul(vloadu(o), inv));
            }
        }
    }
}
#endif

/* The `group` query rows qj [group, hd] sharing one KV head over its keys/values
   k, v [T, hd] (float16 when f16, else float32); scratch sj [group, T]; out oj [group, hd].
   Softmax in float32 after subtracting the row's maximum, as every attention kernel
   does. Each cached key row is read (and widened from float16) once for all of the group. */
static void attend_group(const float *qj, int group, int hd, const void *k, const void *v, int f16, int T,
                         float scale, float *sj, float *oj) {
#if defined(SKIPPY_AVX512) || defined(SKIPPY_AVX2)
    if (hd % VL == 0) {
        switch (hd) { /* constant sizes keep a row's vectors in registers */
        case 64: attend_group_vec(64 / VL, qj, group, k, v, f16, T, scale, sj, oj); return;
        case 128: attend_group_vec(128 / VL, qj, group, k, v, f16, T, scale, sj, oj); return;
        case 256: attend_group_vec(256 / VL, qj, group, k, v, f16, T, scale, sj, oj); return;
        default: attend_group_vec(hd / VL, qj, group, k, v, f16, T, scale, sj, oj); return;
        }
    }
#endif
    float best[group], total[group];
    for (int g = 0; g < group; g++) best[g] = -INFINITY, total[g] = 0.f;
    for (int g = 0; g < group; g++) {
        const float *qh = qj + (size_t)g * hd;
        float *s = sj + (size_t)g * T, *oh = oj + (size_t)g * hd;
        for (int t = 0; t < T; t++) {
            float dot = 0.f;
            #pragma omp simd reduction(+ : dot)
            for (int i = 0; i < hd; i++) dot += qh[i] * cache_value(k, f16, (size_t)t * hd + i);
            s[t] = dot * scale;
            best[g] = s[t] > best[g] ? s[t] : best[g];
        }
        for (int t = 0; t < T; t++) s[t] -= best[g];
        exp_n(s, T, s);
        for (int i = 0; i < hd; i++) oh[i] = 0.f;
        for (int t = 0; t < T; t++) {
            total[g] += s[t];
            for (int i = 0; i < hd; i++) oh[i] += s[t] * cache_value(v, f16, (size_t)t * hd + i);
        }
        for (int i = 0; i < hd; i++) oh[i] /= total[g];
    }
}

static inline const void *cache_at(const void *base, int f16, size_t at) {
    return f16 ? (const void *)((const uint16_t *)base + at) : (const void *)((const float *)base + at);
}

/* n consecutive query rows of one session, at positions start .. start + n - 1, each
   over the keys/values it sees (positions [0, its own], the last `window` of them when
   window > 0), by the same per-row arithmetic as skippy_decode_attention: a prompt chunk or verify window computes each row exactly as
   a decode step would, so a replayed or restored prefix continues as the decode did.
   q: the first H heads of each row of qkv [n, row_heads, hd]; k, v [KVH, stride, hd]
   with rows [0, start + n) written; out [n, H * hd]. */
int skippy_attend_rows(const float *qkv, int n, int row_heads, int H, int KVH, int hd, const void *k,
                       const void *v, int f16, int stride, int start, int window, float scale, float *out) {
    if (hd > MAX_HEAD_DIM || H % KVH || n < 1 || start < 0 || start + n > stride) return -1;
    const int group = H / KVH;
    int status = 0;
    #pragma omp parallel for schedule(guided) if (n > 1) reduction(| : status)
    for (int i = 0; i < n; i++) {
        const int T = start + i + 1, first = window > 0 && T > window ? T - window : 0;
        float *scores = malloc(sizeof(float) * group * T);
        if (!scores) {
            status |= 1;
            continue;
        }
        const float *q = qkv + (size_t)i * row_heads * hd;
        for (int j = 0; j < KVH; j++) {
            const size_t from = ((size_t)j * stride + first) * hd;
            attend_group(q + (size_t)j * group * hd, group, hd, cache_at(k, f16, from), cache_at(v, f16, from), f16,
                         T - first, scale, scores, out + (size_t)i * H * hd + (size_t)j * group * hd);
        }
        free(scores);
    }
    return status ? -2 : 0;
}

/* The longest span a session of skippy_decode_attention attends over (max pos[s] + 1),
   or -1 for arguments it refuses */
int skippy_decode_attention_span(const skippy_sessions *sessions, int H, int KVH, int hd) {
    if (hd > MAX_HEAD_DIM || KVH < 1 || H % KVH || sessions->count < 1) return -1;
    int max_t = 0;
    for (int s = 0; s < sessions->count; s++) {
        const int pos = sessions->pos[s];
        if (pos < 0 || pos >= sessions->capacity[s]) return -1;
        max_t = pos + 1 > max_t ? pos + 1 : max_t;
    }
    return max_t;
}

/* Task `task` (session task / KVH, kv head task % KVH) of skippy_decode_attention in two
   parts, for a team to share one kv head's query rows: the store of the session's k and v
   rows at its position (ahead of every row), then query rows g0 .. g0 + rows of the head's
   group with `scores` [rows, its span], into out [S, H * hd]. A row's sums are the ones it
   has among its whole group's (attend_group sums every row alike), so the bits are the
   whole task's whichever thread runs which rows. */
void skippy_decode_attention_store(int task, const float *qkv, const skippy_sessions *sessions, int H, int KVH,
                                   int hd, int layer) {
    const int s = task / KVH, j = task % KVH;
    const float *q = qkv + (size_t)s * (H + 2 * KVH) * hd;
    const size_t at = (((size_t)layer * KVH + j) * sessions->capacity[s] + sessions->pos[s]) * hd;
    const float *kr = q + (size_t)(H + j) * hd, *vr = q + (size_t)(H + KVH + j) * hd;
    for (int i = 0; i < hd; i++) {
        if (sessions->f16) {
            ((_Float16 *)sessions->k[s])[at + i] = (_Float16)kr[i];
            ((_Float16 *)sessions->v[s])[at + i] = (_Float16)vr[i];
        } else {
            ((float *)sessions->k[s])[at + i] = kr[i];
            ((float *)sessions->v[s])[at + i] = vr[i];
        }
    }
}

void skippy_decode_attention_rows(int task, int g0, int rows, const float *qkv, const skippy_sessions *sessions,
                                  int H, int KVH, int hd, int layer, int window, float scale, float *scores,
                                  float *out) {
    const int s = task / KVH, j = task % KVH, group = H / KVH, pos = sessions->pos[s], f16 = sessions->f16;
    const float *q = qkv + (size_t)s * (H + 2 * KVH) * hd + (size_t)(j * group + g0) * hd;
    const int first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
    const size_t from = (((size_t)layer * KVH + j) * sessions->capacity[s] + first) * hd;
    attend_group(q, rows, hd, cache_at(sessions->k[s], f16, from), cache_at(sessions->v[s], f16, from), f16,
                 pos + 1 - first, scale, scores, out + (size_t)s * H * hd + (size_t)(j * group + g0) * hd);
}

/* The whole task: its store, then all of its group's rows, with `scores` [H / KVH, its span] */
void skippy_decode_attention_task(int task, const float *qkv, const skippy_sessions *sessions, int H, int KVH,
                                  int hd, int layer, int window, float scale, float *scores, float *out) {
    skippy_decode_attention_store(task, qkv, sessions, H, KVH, hd, layer);
    skippy_decode_attention_rows(task, 0, H / KVH, qkv, sessions, H, KVH, hd, layer, window, scale, scores, out);
}

/* A batch of decode rows, one per session, in one call: for session s, store row s's
   k and v heads of qkv [S, H + 2 KVH, hd] (q, k, v heads in that order, RoPE applied)
   at its position of layer `layer` in its cache (skippy_sessions), then attend its q heads
   over positions [0, pos[s]] exactly as skippy_attend_rows does (so a session's row is the
   same alone or batched); with a sliding `window` > 0, over the last `window` of them
   only. out [S, H * hd]. The float16 store rounds to nearest even, as torch's copy does. */
int skippy_decode_attention(const float *qkv, const skippy_sessions *sessions, int H, int KVH, int hd, int layer,
                            int window, float scale, float *out) {
    const int max_t = skippy_decode_attention_span(sessions, H, KVH, hd);
    if (max_t < 0) return -1;
    const int group = H / KVH, tasks = sessions->count * KVH;
    int status = 0;
    /* one task per (session, kv head): a lone decode row's heads split across the threads
       too (its attention had run on one thread while the others waited); each task's
       arithmetic is the same however they are dealt out */
    #pragma omp parallel for schedule(dynamic) if (tasks > 1) reduction(| : status)
    for (int task = 0; task < tasks; task++) {
        float *scores = malloc(sizeof(float) * group * max_t);
        if (!scores) {
            status |= 1;
            continue;
        }
        skippy_decode_attention_task(task, qkv, sessions, H, KVH, hd, layer, window, scale, scores, out);
        free(scores);
    }
    return status ? -2 : 0;
}

/* Half-rotation RoPE in place on the first `heads` heads of each row:
   x [T, row_heads, hd] float32 (q and k heads lead each row of the fused qkv
   projection), cos and signed sin [T, hd] (sin's first half negated):
   x = x * cos + swap_halves(x) * sin. */
void skippy_rope(float *x, int T, int row_heads, int heads, int hd, const float *cos, const float *sin) {
    const int half = hd / 2;
    #pragma omp parallel for schedule(static) if (T > PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)t * hd, *s = sin + (size_t)t * hd;
        for (int h = 0; h < heads; h++) {
            float *v = x + ((size_t)t * row_heads + h) * hd;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out [T, F] = silu(gate) * up, from gate_up [T, 2F] (gate first) */
void skippy_swiglu(const float *gate_up, int T, int F, float *out) {
    #pragma omp parallel for schedule(static) if (T > PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * F, *u = g + F;
        float *o = out + (size_t)t * F;
        for (int i = 0; i < F; i++) o[i] = -g[i];
        exp_n(o, F, o);
        for (int i = 0; i < F; i++) o[i] = g[i] / (1.f + o[i]) * u[i];
    }
}

/* out [T, F] = gelu_tanh(gate) * up, from gate_up [T, 2F] (gate first). gelu_tanh(x) =
   x (1 + tanh(y)) / 2 with y = sqrt(2/pi) (x + 0.044715 x^3), which is x / (1 + exp(-2y)):
   the same vector exp as SwiGLU, no tanh */
void skippy_geglu(const float *gate_up, int T, int F, float *out) {
    const float c = 2.f * 0.7978845608028654f; /* 2 sqrt(2/pi) */
    #pragma omp parallel for schedule(static) if (T > PARALLEL_ROWS)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * F, *u = g + F;
        float *o = out + (size_t)t * F;
        for (int i = 0; i < F; i++) o[i] = -c * (g[i] + 0.044715f * g[i] * g[i] * g[i]);
        exp_n(o, F, o);
        for (int i = 0; i < F; i++) o[i] = g[i] / (1.f + o[i]) * u[i];
    }
}

/* One super-block of 256 weights of Q4_K (144 bytes), Q5_K (176) or Q6_K (210) -> out [256], as
   quant.py's GroupAffine computes them: Q4_K/Q5_K (d sc) c + -(dmin m) per sub-block of 32,
   Q6_K (d sc) (c - 32) + 0 per sub-block of 16. The products d sc, dmin m and (d sc) c of
   Q4_K/Q5_K are exact in float32 (an 11-bit d times a 6-bit sc, times a 5-bit code), so a
   fused multiply-add gives the same; Q6_K's (d sc)(c - 32) rounds once either way. */
static void embed_super_block(const uint8_t *block, int kind, float *o) {
    uint16_t bits;
    if (kind == 210) {
        const uint8_t *ql = block, *qh = block + 128;
        const int8_t *sc = (const int8_t *)(block + 192);
        memcpy(&bits, block + 208, 2);
        const float d = skippy_f16_to_f32(bits);
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, o += 128, sc += 8)
            for (int i = 0; i < 32; i++) { /* elements i, i + 32, i + 64, i + 96 of the half */
                const int c[4] = {(ql[i] & 15) | ((qh[i] >> 0) & 3) << 4, (ql[i + 32] & 15) | ((qh[i] >> 2) & 3) << 4,
                                  (ql[i] >> 4) | ((qh[i] >> 4) & 3) << 4, (ql[i + 32] >> 4) | ((qh[i] >> 6) & 3) << 4};
                for (int k = 0; k < 4; k++) {
                    const int at = 32 * k + i;
                    o[at] = d * (float)sc[at / 16] * (float)(c[k] - 32) + 0.f;
                }
            }
        return;
    }
    memcpy(&bits, block, 2);
    const float d = skippy_f16_to_f32(bits);
    memcpy(&bits, block + 2, 2);
    const float dmin = skippy_f16_to_f32(bits);
    const uint8_t *sm = block + 4, *high = kind == 176 ? block + 16 : NULL, *qs = block + (kind == 176 ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        skippy_k_scale_min(sm, j, &sc, &m);
        const float scale = d * (float)sc, offset = -(dmin * (float)m);
        for (int i = 0; i < 32; i++) {
            const int c = (j & 1 ? qs[32 * (j / 2) + i] >> 4 : qs[32 * (j / 2) + i] & 15)
                          | (high ? ((high[i] >> j) & 1) << 4 : 0);
            o[32 * j + i] = scale * (float)c + offset;
        }
    }
}

/* Rows `ids` [n] of a GGUF embedding in the file's legacy blocks of 32 (raw: the memory-mapped
   tensor, row_bytes a row) -> out [n, cols] float32, each value as the file's decoder gives it
   and as quant.py's GroupAffine computes it: d c + m, with c the block's unsigned code (a Q8_0
   byte plus 128, Q4 and Q5 codes as stored), m the block's minimum (Q4_1, Q5_1) or -d times
   the codes' middle. d c is exact in float32 (an 11-bit d times a code below 2^8), so a fused
   multiply-add gives the same. kind: the block's size (18 Q4_0, 20 Q4_1, 22 Q5_0, 24 Q5_1,
   34 Q8_0), or the K-quants' super-blocks of 256 (embed_super_block: 144 Q4_K, 176 Q5_K, 210
   Q6_K). Reading a step's few rows here took ~20 us where numpy's dozen calls took
   40 us hot and 150 cold, on stage 0's path from a token to its layers (a Q6_K row of 3072:
   ~400 us in numpy). Returns 0, or -1 for a kind it does not know or an id outside [0, rows). */
int skippy_embed_rows(const uint8_t *raw, int64_t row_bytes, int64_t rows, int kind, const int64_t *ids, int n,
                      int cols, float *out) {
    const int super = kind == 144 || kind == 176 || kind == 210;
    if (kind != 18 && kind != 20 && kind != 22 && kind != 24 && kind != 34 && !super) return -1;
    if (cols % (super ? 256 : 32) || row_bytes != (int64_t)cols / (super ? 256 : 32) * kind) return -1;
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows) return -1;
    if (super) {
        for (int r = 0; r < n; r++)
            for (int b = 0; b < cols / 256; b++)
                embed_super_block(raw + ids[r] * row_bytes + (int64_t)b * kind, kind, out + (size_t)r * cols + 256 * b);
        return 0;
    }
    const int has_min = kind == 20 || kind == 24, five = kind == 22 || kind == 24;
    for (int r = 0; r < n; r++) {
        const uint8_t *block = raw + ids[r] * row_bytes;
        float *o = out + (size_t)r * cols;
        for (int b = 0; b < cols / 32; b++, block += kind, o += 32) {
            uint16_t bits;
            memcpy(&bits, block, 2);
            const float d = skippy_f16_to_f32(bits);
            if (kind == 34) {
                const float m = -128.f * d;
                for (int i = 0; i < 32; i++) o[i] = d * (float)((int)(int8_t)block[2 + i] + 128) + m;
                continue;
            }
            float m;
            if (has_min) {
                memcpy(&bits, block + 2, 2);
                m = skippy_f16_to_f32(bits);
            } else {
                m = (five ? -16.f : -8.f) * d;
            }
            const uint8_t *qs = block + 2 + 2 * has_min + 4 * five;
            uint32_t high = 0;
            if (five) memcpy(&high, block + 2 + 2 * has_min, 4);
            for (int i = 0; i < 16; i++) {
                const int lo = qs[i] & 15, hi = qs[i] >> 4;
                const int c0 = lo | (five ? (int)((high >> i) & 1) << 4 : 0);
                const int c1 = hi | (five ? (int)((high >> (i + 16)) & 1) << 4 : 0);
                o[i] = d * (float)c0 + m;
                o[i + 16] = d * (float)c1 + m;
            }
        }
    }
    return 0;
}
