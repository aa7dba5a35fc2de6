/* The CPU kernels' interface: every function qkernel.py calls through ctypes, and the
   structures it hands them. qkernel.py mirrors each structure as a ctypes.Structure;
   tests/test_kernel_build.py holds every mirror's field offsets and sizes to
   skippy_abi_offset's answers, and builds every vector path with -Wall -Wextra -Werror.

   Shapes: x [M, K] float32 rows; a matmul's weight W [N, K] (N out, K in) in blocks of
   SKIPPY_LANES rows and groups of SKIPPY_GROUP along K (qmatmul.c documents the layouts). */

#ifndef SKIPPY_KERNELS_H
#define SKIPPY_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define SKIPPY_GROUP 32     /* weights along K per activation scale (and per weight scale) */
#define SKIPPY_LANES 16     /* weight rows per block: one vector lane each */
#define SKIPPY_SUPER 256    /* weights along K per super-block of the K formats */
#define SKIPPY_MAX_PARTS 3  /* formats in one matmul (q, k, v may each have their own) */

/* How a part of a matmul's rows keeps its weights (quant.py packs each). */
enum skippy_format {
    SKIPPY_Q4 = 0,  /* 4-bit codes; float16 scale and offset per group: Q4_0, Q4_1, int4 */
    SKIPPY_Q8 = 1,  /* 8-bit codes; float16 scale and offset per group: Q5_0, Q5_1, Q8_0, Q5_K, int8 */
    SKIPPY_Q4K = 2, /* 4-bit codes; Q4_K's own scales: per super-block float16 d and -dmin, per group 6-bit ones */
    SKIPPY_Q6K = 3, /* 6-bit codes; Q6_K's own scales: per super-block float16 d, per 16 weights int8 ones */
};

/* Rows [first, first + rows) of a matmul's weight, in one format. Per block b (16 rows), with
   G = K / 32 groups and S = K / 256 super-blocks:
     codes   the codes, bytes_per_group(format) a group (qmatmul.c)
     scale   Q4, Q8: float16 [blocks, G, 16]; Q4K: float16 [blocks, S, 2, 16] (d, -dmin);
             Q6K: float16 [blocks, S, 16] (d)
     offset  Q4, Q8: float16 [blocks, G, 16]; else unused
     sub     Q4K: uint8 [blocks, G, 2, 16] (scale, min); Q6K: int8 [blocks, G, 2, 16] (the
             scale of each half of the group); else unused */
typedef struct skippy_part {
    const uint8_t *codes;
    const uint16_t *scale;
    const uint16_t *offset;
    const uint8_t *sub;
    int32_t format;
    int32_t rows;
} skippy_part;

/* y [M, rows] (+)= x [M, cols] . W^T: x rounded to int8 per group in `levels` levels (1, or 2:
   the remainder again, 128x finer), W's rows in num_parts parts one after another. */
typedef struct skippy_matmul {
    int32_t rows;
    int32_t cols;
    int32_t levels;
    int32_t num_parts;
    skippy_part part[SKIPPY_MAX_PARTS];
} skippy_matmul;

/* A llama block as the decode step runs it: norms float32 [hidden]; window 0: all keys. */
typedef struct skippy_layer {
    const float *attn_norm;
    const float *ffn_norm;
    skippy_matmul qkv;
    skippy_matmul out;
    skippy_matmul gate_up;
    skippy_matmul down;
    int32_t window;
} skippy_layer;

/* A stage's layers as skippy_decode_layers runs them, built once per model. cos, sin:
   RoPE [table_rows, head_dim] (sin's first half negated). With head (the final stage),
   the step goes on to the logits: RMS norm by out_norm, then the head's matmul. */
typedef struct skippy_decode_model {
    int32_t hidden;
    int32_t heads;
    int32_t kv_heads;
    int32_t head_dim;
    int32_t ffn;
    int32_t num_layers;
    int32_t table_rows;
    float eps;
    float scale;
    const skippy_layer *layers;
    const float *cos;
    const float *sin;
    const float *out_norm;
    const skippy_matmul *head;
} skippy_decode_model;

/* A decode step's sessions, one new row each: session s's cache k[s], v[s] [layers, kv_heads,
   capacity[s], head_dim] (float16 when f16, else float32), its row going to position pos[s]. */
typedef struct skippy_sessions {
    int32_t count;
    int32_t f16;
    void *const *k;
    void *const *v;
    const int32_t *capacity;
    const int32_t *pos;
} skippy_sessions;

/* Greedy picks made as the logits are written: each row s that asks gets the first index of
   its largest logit, ids[from[s] .. from[s+1]) with values added first (its logit_bias). */
typedef struct skippy_picks {
    const int32_t *from;
    const int32_t *ids;
    const float *values;
    int32_t *picked; /* in: nonzero where a pick is wanted; out: the token, or -1 */
} skippy_picks;

/* a float16's bits as float32 (the .c files share it) */
static inline float skippy_f16_to_f32(uint16_t bits) {
    _Float16 value;
    __builtin_memcpy(&value, &bits, 2);
    return (float)value;
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j from the super-block's 12 scale bytes q
   (llama.cpp's get_scale_min_k4; pack.c packs them, rows.c decodes embedding rows with them) */
static inline void skippy_k_scale_min(const uint8_t *q, int j, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = q[j] & 63, *min = q[j + 4] & 63;
    } else {
        *scale = (uint8_t)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *min = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* qmatmul.c */
int skippy_qmatmul_check(int M, const skippy_matmul *w);
size_t skippy_qmatmul_scratch_bytes(int M, int K);
void skippy_qmatmul_quantize(const float *x, int M, int K, int levels, void *scratch, int r0, int r1);
void skippy_qmatmul_blocks(const void *scratch, int M, const skippy_matmul *w, float *y, int accumulate, int b0,
                           int b1);
int skippy_qmatmul(const float *x, int M, const skippy_matmul *w, float *y, int accumulate);
int skippy_qmatmul_vector_path(void);
int skippy_qmatmul_amx(void);

/* qmatmul_avx512.c: the opt-in prompt path on AMX-BF16 tiles (--prefill-precision bf16): y as
   skippy_qmatmul's to bfloat16's precision, not its bits. Returns 0, -1 bad arguments, -2 out of
   memory, -3 not here (no AMX-BF16, or the OS refused tile data) */
int skippy_qmatmul_bf16(const float *x, int M, const skippy_matmul *w, float *y, int accumulate);
int skippy_qmatmul_bf16_ready(void);

/* pack.c */
int skippy_pack_q4k(const uint8_t *raw, int64_t row_bytes, const int64_t *rows, int N, int K, uint8_t *codes,
                    uint16_t *scale, uint8_t *sub);
int skippy_pack_q6k(const uint8_t *raw, int64_t row_bytes, const int64_t *rows, int N, int K, uint8_t *codes,
                    uint16_t *scale, uint8_t *sub);

/* rows.c */
void skippy_rms_norm(const float *x, int rows, int D, const float *w, float eps, float *out);
void skippy_head_rms_norm(float *x, int T, int row_heads, int first, int count, int hd, const float *w, float eps);
int skippy_attend_rows(const float *qkv, int n, int row_heads, int H, int KVH, int hd, const void *k,
                       const void *v, int f16, int stride, int start, int window, float scale, float *out);
int skippy_decode_attention_span(const skippy_sessions *sessions, int H, int KVH, int hd);
void skippy_decode_attention_store(int task, const float *qkv, const skippy_sessions *sessions, int H, int KVH,
                                   int hd, int layer);
void skippy_decode_attention_rows(int task, int g0, int rows, const float *qkv, const skippy_sessions *sessions,
                                  int H, int KVH, int hd, int layer, int window, float scale, float *scores,
                                  float *out);
void skippy_decode_attention_task(int task, const float *qkv, const skippy_sessions *sessions, int H, int KVH,
                                  int hd, int layer, int window, float scale, float *scores, float *out);
int skippy_decode_attention(const float *qkv, const skippy_sessions *sessions, int H, int KVH, int hd, int layer,
                            int window, float scale, float *out);
void skippy_rope(float *x, int T, int row_heads, int heads, int hd, const float *cos, const float *sin);
void skippy_swiglu(const float *gate_up, int T, int F, float *out);
void skippy_geglu(const float *gate_up, int T, int F, float *out);
int skippy_embed_rows(const uint8_t *raw, int64_t row_bytes, int64_t rows, int kind, const int64_t *ids, int n,
                      int cols, float *out);

/* layers.c */
int skippy_decode_layers(const skippy_decode_model *model, float *x, const skippy_sessions *sessions, float *logits,
                         const skippy_picks *picks);
int skippy_greedy_pick(float *x, int n, const int *ids, const float *vals, int nb);

/* probe.c */
uint64_t skippy_read_probe(const void *buffer, size_t bytes);

/* abi.c: offsetof(structure, field) by name (sizeof the structure for field ""), or (size_t)-1
   for a name it does not know; the number of fields a structure has */
size_t skippy_abi_offset(const char *structure, const char *field);
int skippy_abi_fields(const char *structure);

#endif
