/* A decode step's whole layer range in one call: for every layer, the same kernels in
   the same order, on the same arguments, as StageModel.forward's loop calls them one by
   one from Python (RMS norm, fused q/k/v matmul, RoPE, cache write + attention, output
   matmul summed into the residual, RMS norm, gate/up matmul, SwiGLU, down matmul summed
   into the residual), so its rows are bit for bit the loop's. Each of those ~9 calls a
   layer cost a few microseconds of Python and ctypes: with 30 layers that was a quarter
   of a token's time on 2 cores, and the interpreter lock stayed with the worker thread
   between them. Here the lock is released once for the whole step.

   desc: LAYER_FIELDS int64 per layer (see DecodeLayers in qkernel.py): the two norms'
   weights, then each matmul's codes, scales, offsets, bits and levels (q/k/v, output,
   gate/up, down), then the layer's attention window (0: all keys). */

#include <stdint.h>
#include <stdlib.h>

#define LAYER_FIELDS 23

int skippy_qmatmul(const float *x, int M, int K, const uint8_t *w, const uint16_t *wd, const uint16_t *wm,
                   int bits, int levels, int N, float *y, int accumulate);
void skippy_rms_norm(const float *x, int rows, int D, const float *w, float eps, float *out);
void skippy_rope(float *x, int T, int row_heads, int heads, int hd, const float *cos, const float *sin);
int skippy_decode_attention(const float *qkv, int S, int H, int KVH, int hd, void *const *k, void *const *v,
                            const int *capacity, const int *pos, int layer, int window, int f16, float scale,
                            float *out);
void skippy_swiglu(const float *gate_up, int T, int F, float *out);

/* y [M, N] (=, or += with accumulate) x [M, K] times the matmul whose five fields start at w */
static int matmul(const float *x, int M, int K, const int64_t *w, int N, float *y, int accumulate) {
    return skippy_qmatmul(x, M, K, (const uint8_t *)(intptr_t)w[0], (const uint16_t *)(intptr_t)w[1],
                          (const uint16_t *)(intptr_t)w[2], (int)w[3], (int)w[4], N, y, accumulate);
}

/* x [S, D]: one row per session, updated in place through num_layers layers; k, v,
   capacity, pos, f16: the sessions' caches as skippy_decode_attention takes them; cos,
   sin [S, hd]: RoPE at each row's position. Returns 0, or the first failing kernel's
   status (-2: out of memory). */
int skippy_decode_layers(float *x, int S, int D, int H, int KVH, int hd, int F, int num_layers,
                         const int64_t *desc, void *const *k, void *const *v, const int *capacity, const int *pos,
                         int f16, const float *cos, const float *sin, float eps, float scale) {
    const int row = (H + 2 * KVH) * hd;
    float *h = malloc(sizeof(float) * (size_t)S * ((size_t)D + row + (size_t)H * hd + 3 * (size_t)F));
    if (!h) return -2;
    float *qkv = h + (size_t)S * D, *attn = qkv + (size_t)S * row, *gate_up = attn + (size_t)S * H * hd,
          *act = gate_up + (size_t)S * 2 * F;
    int status = 0;
    for (int l = 0; l < num_layers && !status; l++) {
        const int64_t *d = desc + (size_t)l * LAYER_FIELDS;
        skippy_rms_norm(x, S, D, (const float *)(intptr_t)d[0], eps, h);
        if ((status = matmul(h, S, D, d + 2, row, qkv, 0))) break;
        skippy_rope(qkv, S, H + 2 * KVH, H + KVH, hd, cos, sin);
        if ((status = skippy_decode_attention(qkv, S, H, KVH, hd, k, v, capacity, pos, l, (int)d[22], f16, scale,
                                              attn))) break;
        if ((status = matmul(attn, S, H * hd, d + 7, D, x, 1))) break;
        skippy_rms_norm(x, S, D, (const float *)(intptr_t)d[1], eps, h);
        if ((status = matmul(h, S, D, d + 12, 2 * F, gate_up, 0))) break;
        skippy_swiglu(gate_up, S, F, act);
        status = matmul(act, S, F, d + 17, D, x, 1);
    }
    free(h);
    return status;
}
