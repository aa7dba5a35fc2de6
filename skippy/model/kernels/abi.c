/* The structures' layout as this compiler lays them out, by name: tests/test_kernel_build.py
   holds qkernel.py's ctypes mirrors to it field by field, so a field added on one side only,
   or moved, fails a test instead of reading the wrong bytes. */

#include <stddef.h>
#include <string.h>

#include "skippy_kernels.h"

#define FIELDS(X)                                                                                                    \
    X(skippy_part, codes) X(skippy_part, scale) X(skippy_part, offset) X(skippy_part, sub) X(skippy_part, format)     \
    X(skippy_part, rows)                                                                                             \
    X(skippy_matmul, rows) X(skippy_matmul, cols) X(skippy_matmul, levels) X(skippy_matmul, num_parts)              \
    X(skippy_matmul, part)                                                                                           \
    X(skippy_layer, attn_norm) X(skippy_layer, ffn_norm) X(skippy_layer, qkv) X(skippy_layer, out)                   \
    X(skippy_layer, gate_up) X(skippy_layer, down) X(skippy_layer, window)                                           \
    X(skippy_decode_model, hidden) X(skippy_decode_model, heads) X(skippy_decode_model, kv_heads)                    \
    X(skippy_decode_model, head_dim) X(skippy_decode_model, ffn) X(skippy_decode_model, num_layers)                  \
    X(skippy_decode_model, table_rows) X(skippy_decode_model, eps) X(skippy_decode_model, scale)                     \
    X(skippy_decode_model, layers) X(skippy_decode_model, cos) X(skippy_decode_model, sin)                           \
    X(skippy_decode_model, out_norm) X(skippy_decode_model, head)                                                    \
    X(skippy_sessions, count) X(skippy_sessions, f16) X(skippy_sessions, k) X(skippy_sessions, v)                    \
    X(skippy_sessions, capacity) X(skippy_sessions, pos)                                                             \
    X(skippy_picks, from) X(skippy_picks, ids) X(skippy_picks, values) X(skippy_picks, picked)

#define STRUCTURES(X) X(skippy_part) X(skippy_matmul) X(skippy_layer) X(skippy_decode_model) X(skippy_sessions) \
    X(skippy_picks)

size_t skippy_abi_offset(const char *structure, const char *field) {
#define OFFSET(s, f) if (!strcmp(structure, #s) && !strcmp(field, #f)) return offsetof(s, f);
#define SIZE(s) if (!strcmp(structure, #s) && !*field) return sizeof(s);
    FIELDS(OFFSET)
    STRUCTURES(SIZE)
    return (size_t)-1;
#undef OFFSET
#undef SIZE
}

int skippy_abi_fields(const char *structure) {
    int count = 0;
#define COUNT(s, f) count += !strcmp(structure, #s);
    FIELDS(COUNT)
#undef COUNT
    return count;
}
