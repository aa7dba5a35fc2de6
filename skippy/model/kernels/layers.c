/* A decode step's whole layer range in one call: for every layer, the same kernels in
   the same order, on the same arguments, as StageModel.forward's loop calls them one by
   one from Python (RMS norm, fused q/k/v matmul, RoPE, cache write + attention, output
   matmul summed into the residual, RMS norm, gate/up matmul, SwiGLU, down matmul summed
   into the residual), so its rows are bit for bit the loop's. Each of those ~9 calls a
   layer costs a few microseconds of Python and ctypes, a large share of a small model's
   token, and the interpreter lock would stay with the worker thread between them. Here the lock is released once for the whole step.

   And the step is one OpenMP parallel region, where it was ~150 (each matmul and each
   attention its own): the team meets at barriers of its own between the pieces, spinning,
   and the workers go back to libgomp's pool only once the step is done. A region's start
   wakes workers that libgomp put to sleep after GOMP_SPINCOUNT pauses, and stages sharing
   a machine keep that spin short (model/threads.py) so a waiting stage leaves the cores to
   the computing one (docs/decisions.md, "The one-call step is one OpenMP parallel region").

   The model's layers are skippy_layer structures (skippy_kernels.h; qkernel.DecodeLayers
   builds them once per model). */

#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "skippy_kernels.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* a teammate this late has lost its core: let it have ours, rather than spin while it waits
   for the core we hold (docs/decisions.md, "Matmul blocks claimed four at a time") */
#define SPINS_BEFORE_YIELD 512
#define SHARED_QUANTIZE_ROWS 8  /* past this many rows the team shares the quantizing, as skippy_qmatmul does */
#define STEAL_BLOCKS 4 /* blocks of 16 rows a thread claims at a time (matmul_share) */

/* The team's meeting point between the step's pieces: it spins (see above: libgomp's own
   barriers sleep after GOMP_SPINCOUNT pauses) */
typedef struct {
    atomic_int arrived;
    atomic_int phase;
} Barrier;

/* a thread's next unclaimed block of the current matmul (matmul_share), alone on its line */
typedef struct {
    _Alignas(64) atomic_int next;
} Cursor;

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

/* y [M, w->rows] (=, or += with accumulate) x [M, w->cols] . W^T, x already quantized into
   scratch. Each thread owns one contiguous share of the 16-row blocks (a stream the
   prefetchers follow; dealing them out a few at a time from a shared counter made the step
   13% slower) and claims it STEAL_BLOCKS at a time from its own counter; a thread done with
   its share claims what is left of the others'. A teammate that loses its core to another
   process (the API loop, the other stage) then delays the step by the blocks it holds, not
   by its whole share. cursor: one counter a thread, each on its own cache line, set by its
   thread to its share's start ahead of the barrier that the matmul's input is quantized
   behind (cursor_reset). */
static void matmul_share(const void *scratch, int M, const skippy_matmul *w, float *y, int accumulate, int tid,
                         int team, Cursor *cursor) {
    const int blocks = w->rows / 16;
    for (int i = 0; i < team; i++) {
        const int owner = (tid + i) % team, end = (int)((int64_t)blocks * (owner + 1) / team);
        for (int b0; (b0 = atomic_fetch_add_explicit(&cursor[owner].next, STEAL_BLOCKS, memory_order_relaxed)) < end;)
            skippy_qmatmul_blocks(scratch, M, w, y, accumulate, b0, b0 + STEAL_BLOCKS < end ? b0 + STEAL_BLOCKS : end);
    }
}

/* Thread tid's counter to its share's start for the next matmul (N rows): called after
   the barrier that ends the matmul before and ahead of the one before the next, so that
   no thread claims from it in between */
static void cursor_reset(Cursor *cursor, int N, int tid, int team) {
    atomic_store_explicit(&cursor[tid].next, (int)((int64_t)(N / 16) * tid / team), memory_order_relaxed);
}

/* x [M, K], written by thread 0, quantized into scratch for the matmul whose fields start
   at w, then a barrier: past SHARED_QUANTIZE_ROWS rows the team shares the groups, else
   thread 0 quantizes them (a barrier costs more than the work) */
static void quantize_for(const float *x, int M, const skippy_matmul *w, void *scratch, int tid, int team,
                         Barrier *barrier) {
    const int K = w->cols, groups = M * (K / 32);
    if (M > SHARED_QUANTIZE_ROWS) {
        barrier_wait(barrier, team);
        skippy_qmatmul_quantize(x, M, K, w->levels, scratch, (int)((int64_t)groups * tid / team),
                                (int)((int64_t)groups * (tid + 1) / team));
    } else if (tid == 0) {
        skippy_qmatmul_quantize(x, M, K, w->levels, scratch, 0, groups);
    }
    barrier_wait(barrier, team);
}

/* cursor_reset, quantize, share the blocks, barrier: one matmul of the step by the whole team */
static void team_matmul(const float *x, int M, const skippy_matmul *w, float *y, int accumulate, void *scratch,
                        int tid, int team, Barrier *barrier, Cursor *cursor) {
    cursor_reset(cursor, w->rows, tid, team);
    quantize_for(x, M, w, scratch, tid, team, barrier);
    matmul_share(scratch, M, w, y, accumulate, tid, team, cursor);
    barrier_wait(barrier, team);
}

/* The first index of the largest of x[0, n), a NaN counting as larger than any number
   (numpy's argmax, which the sampler's greedy pick is); *value is x at that index */
static int first_max(const float *x, int n, float *value) {
    int i = 0;
    float top = -INFINITY;
#ifdef __AVX2__
    __m256 tops = _mm256_set1_ps(-INFINITY), nans = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        tops = _mm256_max_ps(tops, v);
    }
    if (_mm256_movemask_ps(nans)) {
        for (int j = 0;; j++)
            if (x[j] != x[j]) return *value = x[j], j;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
#endif
    for (int j = i; j < n; j++) {
        if (x[j] != x[j]) {
            for (int f = 0;; f++) /* a NaN before i was ruled out above */
                if (x[f] != x[f]) return *value = x[f], f;
        }
        top = x[j] > top ? x[j] : top;
    }
    for (int j = 0; j < n; j++) /* -0 and +0 are equal, as in numpy: the first of either */
        if (x[j] == top) return *value = x[j], j;
    return *value = x[0], 0; /* every entry is -inf */
}

/* first_max of x[lo, hi) with vals[j] added at ids[j] (the ones within [lo, hi)), as
   float32 sums: the sampler's logits + logit_bias. x is patched in place for the scan and
   put back, so it keeps the raw logits; saved holds nb floats. Returns the index in x. */
static int pick_range(float *x, int lo, int hi, const int *ids, const float *vals, int nb, float *saved,
                      float *value) {
    for (int j = 0; j < nb; j++)
        if (ids[j] >= lo && ids[j] < hi) saved[j] = x[ids[j]], x[ids[j]] = x[ids[j]] + vals[j];
    const int at = lo + first_max(x + lo, hi - lo, value);
    for (int j = 0; j < nb; j++)
        if (ids[j] >= lo && ids[j] < hi) x[ids[j]] = saved[j];
    return at;
}

/* One row's greedy pick (tests, and the check the decode call's picks are held to) */
int skippy_greedy_pick(float *x, int n, const int *ids, const float *vals, int nb) {
    if (n < 1) return -1;
    for (int j = 0; j < nb; j++)
        if (ids[j] < 0 || ids[j] >= n) return -1;
    float *saved = malloc(sizeof(float) * (nb ? nb : 1)), value;
    if (!saved) return -2;
    const int at = pick_range(x, 0, n, ids, vals, nb, saved, &value);
    free(saved);
    return at;
}

static int matmul_ok(int M, const skippy_matmul *w, int K, int N) {
    return skippy_qmatmul_check(M, w) == 0 && w->cols == K && w->rows == N;
}

/* Checks everything the step's kernels would refuse, before x changes: 0 or -1 */
static int check_step(const skippy_decode_model *model, const skippy_sessions *sessions, const float *logits,
                      const skippy_picks *picks, int *most_biases) {
    const int S = sessions->count, D = model->hidden, H = model->heads, KVH = model->kv_heads, hd = model->head_dim;
    const int row = (H + 2 * KVH) * hd, F = model->ffn;
    if (skippy_decode_attention_span(sessions, H, KVH, hd) < 0 || model->num_layers < 0) return -1;
    for (int s = 0; s < S; s++)
        if (sessions->pos[s] >= model->table_rows) return -1;
    for (int l = 0; l < model->num_layers; l++) {
        const skippy_layer *layer = &model->layers[l];
        if (!matmul_ok(S, &layer->qkv, D, row) || !matmul_ok(S, &layer->out, H * hd, D)
            || !matmul_ok(S, &layer->gate_up, D, 2 * F) || !matmul_ok(S, &layer->down, F, D))
            return -1;
    }
    if (logits && (!model->head || !matmul_ok(S, model->head, D, model->head->rows))) return -1;
    *most_biases = 0;
    if (picks) {
        if (!logits || picks->from[0] != 0) return -1;
        for (int s = 0; s < S; s++) {
            const int nb = picks->from[s + 1] - picks->from[s];
            if (nb < 0) return -1;
            *most_biases = nb > *most_biases ? nb : *most_biases;
        }
        for (int j = 0; j < picks->from[S]; j++)
            if (picks->ids[j] < 0 || picks->ids[j] >= model->head->rows) return -1;
    }
    return 0;
}

/* x [S, hidden]: one row per session (or a verify window's rows, each a "session" of its own
   position in the one cache), updated in place through the model's layers; the
   sessions' caches as skippy_decode_attention takes them; RoPE read from the model's tables
   at each row's position (slicing them in Python is slow after a forward has evicted the
   interpreter's caches). With `logits` [S, vocab] (a model with a head: the final stage),
   the region goes on to the output: RMS norm by out_norm, then the head's matmul, as
   compute_logits' two calls compute them. A region of its own would start after the
   co-located stages' short spin has ended, and so begin by waking a sleeping worker.
   One parallel region for the whole step: one thread runs the row-sized pieces (norms,
   RoPE, SwiGLU, quantizing a matmul's input), the team shares each matmul's blocks and
   the attention's (session, kv head) tasks (or their query rows), every piece computing
   exactly as its standalone kernel does. With `picks`, the rows that ask get their greedy
   token (the sampler's: first_max of the logits plus the bias), the others -1. Returns 0,
   -1 for arguments a kernel refuses (checked before x changes), -2 when out of memory. */
int skippy_decode_layers(const skippy_decode_model *model, float *x, const skippy_sessions *sessions, float *logits,
                         const skippy_picks *picks) {
    int most_biases;
    if (check_step(model, sessions, logits, picks, &most_biases)) return -1;
    const int S = sessions->count, D = model->hidden, H = model->heads, KVH = model->kv_heads, hd = model->head_dim;
    const int F = model->ffn, row = (H + 2 * KVH) * hd, vocab = logits ? model->head->rows : 0;
    const int max_t = skippy_decode_attention_span(sessions, H, KVH, hd);
    const float eps = model->eps, scale = model->scale;
    const int widest = D > H * hd ? (D > F ? D : F) : (H * hd > F ? H * hd : F);
    const int group = H / KVH, team_max = omp_get_max_threads();
    const size_t scores = (size_t)group * max_t;
    /* the greedy picks: each thread's (index, value) per row, and room to patch in a row's biases */
    const size_t pick_parts = picks ? (size_t)team_max * S : 0;
    float *h = malloc(sizeof(float) * ((size_t)S * ((size_t)D + row + (size_t)H * hd + 3 * (size_t)F + 2 * (size_t)hd)
                                       + scores * team_max));
    void *scratch = malloc(skippy_qmatmul_scratch_bytes(S, widest));
    atomic_int *next = calloc((size_t)model->num_layers + 1, sizeof(atomic_int)); /* each layer's next attention task */
    Cursor *cursor = aligned_alloc(64, sizeof(Cursor) * (size_t)team_max);
    int *part_at = malloc(sizeof(int) * (pick_parts + 1));
    float *part_value = malloc(sizeof(float) * (pick_parts + (size_t)team_max * most_biases + 1));
    if (!h || !scratch || !next || !cursor || !part_at || !part_value) {
        free(h), free(scratch), free(next), free(cursor), free(part_at), free(part_value);
        return -2;
    }
    /* rows of one session at consecutive positions (a verify window): a row attends over its
       window's earlier rows, so every row's keys and values are stored before any row attends */
    int window_rows = 0;
    for (int s = 1; s < S && !window_rows; s++)
        for (int t = 0; t < s && !window_rows; t++) window_rows = sessions->k[s] == sessions->k[t];
    int team_used = 1;
    float *qkv = h + (size_t)S * D, *attn = qkv + (size_t)S * row, *gate_up = attn + (size_t)S * H * hd,
          *act = gate_up + (size_t)S * 2 * F, *cos = act + (size_t)S * F, *sin = cos + (size_t)S * hd,
          *score_rows = sin + (size_t)S * hd;
    for (int s = 0; s < S; s++) {
        memcpy(cos + (size_t)s * hd, model->cos + (size_t)sessions->pos[s] * hd, sizeof(float) * hd);
        memcpy(sin + (size_t)s * hd, model->sin + (size_t)sessions->pos[s] * hd, sizeof(float) * hd);
    }
    Barrier barrier = {0, 0};
    #pragma omp parallel num_threads(team_max)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        /* the attention's (session, kv head) tasks beyond a whole number per thread are each
           split by their query rows among the team, after the others (their stores first, on
           thread 0): whole, 3 kv heads of one row on 2 threads take two heads' time. Splitting a
           row's keys instead would read the head's keys and values once per part
           (docs/decisions.md, "Uneven attention tasks split by query rows"). */
        const int whole = team > 1 && group > 1 ? S * KVH - (S * KVH) % team : S * KVH,
                  parts = group < team ? group : team, tasks = whole + (S * KVH - whole) * parts;
        float *my_scores = score_rows + scores * tid;
        for (int l = 0; l < model->num_layers; l++) {
            const skippy_layer *layer = &model->layers[l];
            if (tid == 0) skippy_rms_norm(x, S, D, layer->attn_norm, eps, h);
            team_matmul(h, S, &layer->qkv, qkv, 0, scratch, tid, team, &barrier, cursor);
            if (tid == 0) {
                skippy_rope(qkv, S, H + 2 * KVH, H + KVH, hd, cos, sin);
                for (int task = window_rows ? 0 : whole; task < S * KVH; task++)
                    skippy_decode_attention_store(task, qkv, sessions, H, KVH, hd, l);
            }
            barrier_wait(&barrier, team);
            for (int task; (task = atomic_fetch_add_explicit(&next[l], 1, memory_order_relaxed)) < tasks;) {
                if (task < whole && window_rows)
                    skippy_decode_attention_rows(task, 0, group, qkv, sessions, H, KVH, hd, l, layer->window, scale,
                                                 my_scores, attn);
                else if (task < whole)
                    skippy_decode_attention_task(task, qkv, sessions, H, KVH, hd, l, layer->window, scale, my_scores,
                                                 attn);
                else {
                    const int part = (task - whole) % parts, g0 = group * part / parts;
                    skippy_decode_attention_rows(whole + (task - whole) / parts, g0, group * (part + 1) / parts - g0,
                                                 qkv, sessions, H, KVH, hd, l, layer->window, scale, my_scores, attn);
                }
            }
            barrier_wait(&barrier, team);
            team_matmul(attn, S, &layer->out, x, 1, scratch, tid, team, &barrier, cursor);
            if (tid == 0) skippy_rms_norm(x, S, D, layer->ffn_norm, eps, h);
            team_matmul(h, S, &layer->gate_up, gate_up, 0, scratch, tid, team, &barrier, cursor);
            if (tid == 0) skippy_swiglu(gate_up, S, F, act);
            team_matmul(act, S, &layer->down, x, 1, scratch, tid, team, &barrier, cursor);
        }
        if (logits) {
            if (tid == 0) skippy_rms_norm(x, S, D, model->out_norm, eps, h);
            /* its barrier: a teammate may still write blocks it took from this thread's share */
            team_matmul(h, S, model->head, logits, 0, scratch, tid, team, &barrier, cursor);
            if (picks) {
                /* each thread picks within the logits it just wrote, while its caches hold them:
                   read once more after the call, a row's 192 KiB came from the other core's caches
                   and from memory, ~130 us of a one-row step's sampling */
                const int blocks = vocab / 16, lo = 16 * (int)((int64_t)blocks * tid / team),
                          hi = 16 * (int)((int64_t)blocks * (tid + 1) / team);
                float *saved = part_value + pick_parts + (size_t)tid * most_biases;
                for (int s = 0; s < S; s++) {
                    const size_t part = (size_t)tid * S + s;
                    part_at[part] = -1;
                    if (picks->picked[s] && lo < hi)
                        part_at[part] = pick_range(logits + (size_t)s * vocab, lo, hi, picks->ids + picks->from[s],
                                                   picks->values + picks->from[s], picks->from[s + 1] - picks->from[s],
                                                   saved, &part_value[part]);
                }
                if (tid == 0) team_used = team;
            }
        }
    }
    for (int s = 0; picks && s < S; s++) {
        if (!picks->picked[s]) {
            picks->picked[s] = -1;
            continue;
        }
        /* the threads' ranges in order: the first NaN, else the first of the largest */
        int at = -1;
        float top = 0.f;
        for (int t = 0; t < team_used; t++) {
            const size_t part = (size_t)t * S + s;
            const float value = part_value[part];
            if (part_at[part] < 0) continue;
            if (at < 0 || (value != value && top == top) || (top == top && value > top)) at = part_at[part], top = value;
        }
        picks->picked[s] = at;
    }
    free(h), free(scratch), free(next), free(cursor), free(part_at), free(part_value);
    return 0;
}
