/* A decode step's whole layer range in one call: for every layer, the same kernels in
   the same order, on the same arguments, as StageModel.forward's loop calls them one by
   one from Python (RMS norm, fused q/k/v matmul, RoPE, cache write + attention, output
   matmul summed into the residual, RMS norm, gate/up matmul, SwiGLU, down matmul summed
   into the residual), so its rows are bit for bit the loop's. Each of those ~9 calls a
   layer cost a few microseconds of Python and ctypes: with 30 layers that was a quarter
   of a token's time on 2 cores, and the interpreter lock stayed with the worker thread
   between them. Here the lock is released once for the whole step.

   And the step is one OpenMP parallel region, where it was ~150 (each matmul and each
   attention its own): the team meets at barriers of its own between the pieces, spinning,
   and the workers go back to libgomp's pool only once the step is done. A region's start
   wakes workers that libgomp put to sleep after GOMP_SPINCOUNT pauses, and stages sharing
   a machine keep that spin short (model/threads.py) so a waiting stage leaves the cores to
   the computing one. The layers' call, A/B in the same decode steps (2 cores, bundled
   model, 3 ms between calls as in a 2-stage chain): 2958 against 3092 us at 1,000 spins,
   2817 against 2932 at the default; per layer in a 2-stage chain, slower than in one
   process (7-9%) where it had been 17-20%.

   desc: LAYER_FIELDS int64 per layer (see DecodeLayers in qkernel.py): the two norms'
   weights, then each matmul's codes, scales, offsets, bits and levels (q/k/v, output,
   gate/up, down), then the layer's attention window (0: all keys). */

#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define LAYER_FIELDS 23
#define SPINS_BEFORE_YIELD 4096 /* a teammate this late has lost its core: let it have ours */
#define SHARED_QUANTIZE_ROWS 8  /* past this many rows the team shares the quantizing, as skippy_qmatmul does */

int skippy_qmatmul_check(int M, int K, int bits, int levels, int N);
size_t skippy_qmatmul_scratch_bytes(int M, int K);
void skippy_qmatmul_quantize(const float *x, int M, int K, int levels, void *scratch, int r0, int r1);
void skippy_qmatmul_blocks(const void *scratch, int M, int K, const uint8_t *w, const uint16_t *wd,
                           const uint16_t *wm, int bits, int levels, int N, float *y, int accumulate, int b0, int b1);
void skippy_rms_norm(const float *x, int rows, int D, const float *w, float eps, float *out);
void skippy_rope(float *x, int T, int row_heads, int heads, int hd, const float *cos, const float *sin);
int skippy_decode_attention_span(int S, int H, int KVH, int hd, const int *capacity, const int *pos);
void skippy_decode_attention_task(int task, const float *qkv, int H, int KVH, int hd, void *const *k, void *const *v,
                                  const int *capacity, const int *pos, int layer, int window, int f16, float scale,
                                  float *scores, float *out);
void skippy_swiglu(const float *gate_up, int T, int F, float *out);

/* The team's meeting point between the step's pieces: it spins (see above: libgomp's own
   barriers sleep after GOMP_SPINCOUNT pauses) */
typedef struct {
    atomic_int arrived;
    atomic_int phase;
} Barrier;

static void barrier_wait(Barrier *b, int team) {
    if (team == 1) return;
    const int phase = atomic_load_explicit(&b->phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == team - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == phase; spins++) {
        if (spins < SPINS_BEFORE_YIELD) cpu_relax();
        else sched_yield();
    }
}

/* y [M, N] (=, or += with accumulate) x [M, K] times the matmul whose five fields start
   at w, x already quantized into scratch: thread `tid` of `team` runs one contiguous share
   of the 16-row blocks (a stream the prefetchers follow; dealing them out a few at a time
   from a shared counter made the step 13% slower) */
static void matmul_share(const void *scratch, int M, int K, const int64_t *w, int N, float *y, int accumulate,
                         int tid, int team) {
    const int blocks = N / 16, b0 = (int)((int64_t)blocks * tid / team), b1 = (int)((int64_t)blocks * (tid + 1) / team);
    skippy_qmatmul_blocks(scratch, M, K, (const uint8_t *)(intptr_t)w[0], (const uint16_t *)(intptr_t)w[1],
                          (const uint16_t *)(intptr_t)w[2], (int)w[3], (int)w[4], N, y, accumulate, b0, b1);
}

/* x [M, K], written by thread 0, quantized into scratch for the matmul whose fields start
   at w, then a barrier: past SHARED_QUANTIZE_ROWS rows the team shares the groups, else
   thread 0 quantizes them (a barrier costs more than the work) */
static void quantize_for(const float *x, int M, int K, const int64_t *w, void *scratch, int tid, int team,
                         Barrier *barrier) {
    const int groups = M * (K / 32);
    if (M > SHARED_QUANTIZE_ROWS) {
        barrier_wait(barrier, team);
        skippy_qmatmul_quantize(x, M, K, (int)w[4], scratch, (int)((int64_t)groups * tid / team),
                                (int)((int64_t)groups * (tid + 1) / team));
    } else if (tid == 0) {
        skippy_qmatmul_quantize(x, M, K, (int)w[4], scratch, 0, groups);
    }
    barrier_wait(barrier, team);
}

static int matmul_ok(int M, int K, const int64_t *w, int N) {
    return skippy_qmatmul_check(M, K, (int)w[3], (int)w[4], N) == 0;
}

/* x [S, D]: one row per session, updated in place through num_layers layers; k, v,
   capacity, pos, f16: the sessions' caches as skippy_decode_attention takes them;
   cos_table, sin_table [table_rows, hd]: RoPE at every position, each row's read here at its
   position (slicing them in Python cost ~35 us a step, after a forward evicted the interpreter's
   caches). With `head` (the final stage), the region goes on to the output: RMS norm by
   out_norm, then the head's matmul (its five fields as a layer's) into logits [S, vocab], as
   compute_logits' two calls compute them. Its own region used to start ~60 us after this one
   ended: past the co-located stages' short spin, so it began by waking a sleeping worker.
   One parallel region for the whole step: one thread runs the row-sized pieces (norms,
   RoPE, SwiGLU, quantizing a matmul's input), the team shares each matmul's blocks and
   the attention's (session, kv head) tasks, every piece computing exactly as its
   standalone kernel does. Returns 0, -1 for arguments a kernel refuses (checked before x
   changes), -2 when out of memory. */
int skippy_decode_layers(float *x, int S, int D, int H, int KVH, int hd, int F, int num_layers,
                         const int64_t *desc, void *const *k, void *const *v, const int *capacity, const int *pos,
                         int f16, const float *cos_table, const float *sin_table, int table_rows, float eps,
                         float scale, const float *out_norm, const int64_t *head, int vocab, float *logits) {
    const int row = (H + 2 * KVH) * hd, max_t = skippy_decode_attention_span(S, H, KVH, hd, capacity, pos);
    if (max_t < 0 || num_layers < 0) return -1;
    for (int s = 0; s < S; s++)
        if (pos[s] < 0 || pos[s] >= table_rows) return -1;
    for (int l = 0; l < num_layers; l++) {
        const int64_t *d = desc + (size_t)l * LAYER_FIELDS;
        if (!matmul_ok(S, D, d + 2, row) || !matmul_ok(S, H * hd, d + 7, D) || !matmul_ok(S, D, d + 12, 2 * F)
            || !matmul_ok(S, F, d + 17, D))
            return -1;
    }
    if (head && !matmul_ok(S, D, head, vocab)) return -1;
    const int widest = D > H * hd ? (D > F ? D : F) : (H * hd > F ? H * hd : F);
    const int group = H / KVH, team_max = omp_get_max_threads();
    const size_t scores = (size_t)group * max_t;
    float *h = malloc(sizeof(float) * ((size_t)S * ((size_t)D + row + (size_t)H * hd + 3 * (size_t)F + 2 * (size_t)hd)
                                       + scores * team_max));
    void *scratch = malloc(skippy_qmatmul_scratch_bytes(S, widest));
    atomic_int *next = calloc((size_t)num_layers, sizeof(atomic_int)); /* each layer's next attention task */
    if (!h || !scratch || !next) {
        free(h), free(scratch), free(next);
        return -2;
    }
    float *qkv = h + (size_t)S * D, *attn = qkv + (size_t)S * row, *gate_up = attn + (size_t)S * H * hd,
          *act = gate_up + (size_t)S * 2 * F, *cos = act + (size_t)S * F, *sin = cos + (size_t)S * hd,
          *score_rows = sin + (size_t)S * hd;
    for (int s = 0; s < S; s++) {
        memcpy(cos + (size_t)s * hd, cos_table + (size_t)pos[s] * hd, sizeof(float) * hd);
        memcpy(sin + (size_t)s * hd, sin_table + (size_t)pos[s] * hd, sizeof(float) * hd);
    }
    Barrier barrier = {0, 0};
    #pragma omp parallel num_threads(team_max)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        float *my_scores = score_rows + scores * tid;
        for (int l = 0; l < num_layers; l++) {
            const int64_t *d = desc + (size_t)l * LAYER_FIELDS;
            if (tid == 0) skippy_rms_norm(x, S, D, (const float *)(intptr_t)d[0], eps, h);
            quantize_for(h, S, D, d + 2, scratch, tid, team, &barrier);
            matmul_share(scratch, S, D, d + 2, row, qkv, 0, tid, team);
            barrier_wait(&barrier, team);
            if (tid == 0) skippy_rope(qkv, S, H + 2 * KVH, H + KVH, hd, cos, sin);
            barrier_wait(&barrier, team);
            for (int task; (task = atomic_fetch_add_explicit(&next[l], 1, memory_order_relaxed)) < S * KVH;)
                skippy_decode_attention_task(task, qkv, H, KVH, hd, k, v, capacity, pos, l, (int)d[22], f16, scale,
                                             my_scores, attn);
            barrier_wait(&barrier, team);
            quantize_for(attn, S, H * hd, d + 7, scratch, tid, team, &barrier);
            matmul_share(scratch, S, H * hd, d + 7, D, x, 1, tid, team);
            barrier_wait(&barrier, team);
            if (tid == 0) skippy_rms_norm(x, S, D, (const float *)(intptr_t)d[1], eps, h);
            quantize_for(h, S, D, d + 12, scratch, tid, team, &barrier);
            matmul_share(scratch, S, D, d + 12, 2 * F, gate_up, 0, tid, team);
            barrier_wait(&barrier, team);
            if (tid == 0) skippy_swiglu(gate_up, S, F, act);
            quantize_for(act, S, F, d + 17, scratch, tid, team, &barrier);
            matmul_share(scratch, S, F, d + 17, D, x, 1, tid, team);
            barrier_wait(&barrier, team);
        }
        if (head) {
            if (tid == 0) skippy_rms_norm(x, S, D, out_norm, eps, h);
            quantize_for(h, S, D, head, scratch, tid, team, &barrier);
            matmul_share(scratch, S, D, head, vocab, logits, 0, tid, team);
        }
    }
    free(h), free(scratch), free(next);
    return 0;
}
