/* What qmatmul.c shares with its block kernels for one instruction set each
   (qmatmul_avx512.c: AVX512-VNNI and AMX; qmatmul_avx2.c). Each of those compiles to
   nothing where the compiler's target lacks its instructions. */

#ifndef SKIPPY_QMATMUL_H
#define SKIPPY_QMATMUL_H

#include "skippy_kernels.h"

#define GROUP SKIPPY_GROUP
#define LANES SKIPPY_LANES
#define GROUPS_PER_SUPER (SKIPPY_SUPER / SKIPPY_GROUP)

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SKIPPY_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define SKIPPY_AMX 1
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SKIPPY_AMX_BF16 1 /* the opt-in bfloat16 prompt path (skippy_qmatmul_bf16) */
#endif
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SKIPPY_AVX2 1
#endif

/* x [M, K] quantized per group of 32 (row r = m * G + g of the M G groups) */
typedef struct skippy_rows {
    const int8_t *q;   /* [r][64]: the group's 32 first-level codes, then its 32 second-level ones */
    const float *dx;   /* [r][2]: their scales dx and dr = dx / 128 */
    const float *sx;   /* [r]: dx sum(q) + dr sum(r), the offset's multiplier */
    const int32_t *qs; /* [r]: 128 sum(q) + sum(r), the same sums in units of dr, exact */
    const int32_t *qh; /* [r][2]: qs over each half of the group (16 values), for Q6K's two scales */
    int M, G;
} skippy_rows;

/* bytes of one group (32 codes) of one block (16 rows) */
static inline int skippy_group_bytes(int format) {
    return format == SKIPPY_Q8 ? 512 : format == SKIPPY_Q6K ? 384 : 256;
}

/* Block b of part p (its 16 rows) against rows [m0, m1) of x into y (the block's first
   column; rows of y are N apart), y = or, with accumulate, y +=. Every row computes alike
   in any range: a session's row is the same bits alone and in a batch. */
void skippy_block_vnni(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                       int accumulate, int levels);
void skippy_block_avx2(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                       int accumulate, int levels);
/* Whole tiles of 16 rows of x in [m0, m1) on AMX tiles, bit for bit skippy_block_vnni;
   returns the first row it left (a multiple of 16 from m0), or m0 when AMX is not there. */
int skippy_block_amx(const skippy_part *p, int b, const skippy_rows *x, int m0, int m1, float *y, int N,
                     int accumulate, int levels);
int skippy_amx_ready(void);

#endif
