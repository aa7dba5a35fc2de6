/* GGUF's K-quant blocks into the kernel's layouts (qmatmul.c: SKIPPY_Q4K, SKIPPY_Q6K), in C:
   the numpy conversion (quant.py, which tests hold these to bit for bit) packed ~60 MB of a
   GGUF a second, so a 2 GB model's first start spent half a minute there.

   raw: the tensor's rows of super-blocks, row_bytes apart (the memory-mapped file); rows:
   which source row each of the N output rows is (attn_q/attn_k unpermuted), or NULL for
   0 .. N - 1. N % 16 == 0, K % 256 == 0. Threads share the blocks of 16 rows. Returns 0, or
   -1 for a shape it does not take. */

#include <stdint.h>
#include <string.h>

#include "skippy_kernels.h"

#define Q4K_BYTES 144 /* d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of nibbles */
#define Q6K_BYTES 210 /* 128 bytes of low nibbles, 64 of top bits, 16 int8 scales, d (float16) */

static int shape_ok(int N, int K, int64_t row_bytes, int block_bytes) {
    return N > 0 && N % SKIPPY_LANES == 0 && K > 0 && K % SKIPPY_SUPER == 0
           && row_bytes >= (int64_t)(K / SKIPPY_SUPER) * block_bytes;
}

/* codes[256] of one super-block (0..15 or 0..63) into group j's place of the block's lane i:
   4-bit chunks c (low nibble k = 4c + t, high k + 16), then for Q6K the top-bits chunks */
static void place_group(const uint8_t *codes, int six, uint8_t *group, int lane) {
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            const int k = 4 * c + t;
            group[c * 64 + 4 * lane + t] = (uint8_t)((codes[k] & 15) | (codes[k + 16] & 15) << 4);
        }
    if (!six) return;
    for (int half = 0; half < 2; half++)
        for (int t = 0; t < 4; t++) {
            uint8_t top = 0;
            for (int c = 0; c < 4; c++) top |= (uint8_t)((codes[16 * half + 4 * c + t] >> 4) << (2 * c));
            group[(4 + half) * 64 + 4 * lane + t] = top;
        }
}

int skippy_pack_q4k(const uint8_t *raw, int64_t row_bytes, const int64_t *rows, int N, int K, uint8_t *codes,
                    uint16_t *scale, uint8_t *sub) {
    if (!shape_ok(N, K, row_bytes, Q4K_BYTES)) return -1;
    const int G = K / SKIPPY_GROUP, S = K / SKIPPY_SUPER;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < N / SKIPPY_LANES; b++)
        for (int lane = 0; lane < SKIPPY_LANES; lane++) {
            const int n = b * SKIPPY_LANES + lane;
            const uint8_t *row = raw + (rows ? rows[n] : n) * row_bytes;
            for (int s = 0; s < S; s++) {
                const uint8_t *block = row + (size_t)s * Q4K_BYTES;
                uint16_t d, dmin;
                memcpy(&d, block, 2);
                memcpy(&dmin, block + 2, 2);
                scale[(((size_t)b * S + s) * 2) * SKIPPY_LANES + lane] = d;
                scale[(((size_t)b * S + s) * 2 + 1) * SKIPPY_LANES + lane] = dmin ^ 0x8000; /* -dmin, exactly */
                for (int j = 0; j < 8; j++) {
                    const size_t g = (size_t)b * G + (size_t)s * 8 + j;
                    skippy_k_scale_min(block + 4, j, &sub[g * 2 * SKIPPY_LANES + lane],
                                  &sub[g * 2 * SKIPPY_LANES + SKIPPY_LANES + lane]);
                    uint8_t values[32]; /* sub-blocks 2p, 2p + 1: the low, then the high nibbles of 32 bytes */
                    const uint8_t *q = block + 16 + 32 * (j / 2);
                    for (int k = 0; k < 32; k++) values[k] = j % 2 ? q[k] >> 4 : q[k] & 15;
                    place_group(values, 0, codes + g * 256, lane);
                }
            }
        }
    return 0;
}

int skippy_pack_q6k(const uint8_t *raw, int64_t row_bytes, const int64_t *rows, int N, int K, uint8_t *codes,
                    uint16_t *scale, uint8_t *sub) {
    if (!shape_ok(N, K, row_bytes, Q6K_BYTES)) return -1;
    const int G = K / SKIPPY_GROUP, S = K / SKIPPY_SUPER;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < N / SKIPPY_LANES; b++)
        for (int lane = 0; lane < SKIPPY_LANES; lane++) {
            const int n = b * SKIPPY_LANES + lane;
            const uint8_t *row = raw + (rows ? rows[n] : n) * row_bytes;
            for (int s = 0; s < S; s++) {
                const uint8_t *block = row + (size_t)s * Q6K_BYTES, *ql = block, *qh = block + 128;
                const int8_t *scales = (const int8_t *)(block + 192);
                memcpy(&scale[((size_t)b * S + s) * SKIPPY_LANES + lane], block + 208, 2);
                uint8_t values[256]; /* llama.cpp's dequantize_row_q6_K, codes 0..63 (the value is d scale (c - 32)) */
                for (int n128 = 0; n128 < 2; n128++) {
                    const uint8_t *l = ql + 64 * n128, *h = qh + 32 * n128;
                    uint8_t *v = values + 128 * n128;
                    for (int i = 0; i < 32; i++) {
                        v[i] = (uint8_t)((l[i] & 15) | ((h[i] >> 0) & 3) << 4);
                        v[i + 32] = (uint8_t)((l[i + 32] & 15) | ((h[i] >> 2) & 3) << 4);
                        v[i + 64] = (uint8_t)((l[i] >> 4) | ((h[i] >> 4) & 3) << 4);
                        v[i + 96] = (uint8_t)((l[i + 32] >> 4) | ((h[i] >> 6) & 3) << 4);
                    }
                }
                for (int j = 0; j < 8; j++) {
                    const size_t g = (size_t)b * G + (size_t)s * 8 + j;
                    sub[g * 2 * SKIPPY_LANES + lane] = (uint8_t)scales[2 * j];
                    sub[g * 2 * SKIPPY_LANES + SKIPPY_LANES + lane] = (uint8_t)scales[2 * j + 1];
                    place_group(values + 32 * j, 1, codes + g * 384, lane);
                }
            }
        }
    return 0;
}
