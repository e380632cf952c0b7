/* Decode attention on a paged KV cache, for CPU serving: one call per layer.
 *
 * Every decode token (one query row per sequence) attends over its sequence's
 * context straight from the cache's own layout, [num_blocks, block_size,
 * kv_heads, head_dim], through its block table: no gather copy, no padding, no
 * per-sequence call. Per (sequence, KV head), the GQA group's query heads share
 * each key and value row as it is read, the scores of the whole context go to a
 * scratch row, the softmax subtracts their maximum (as SDPA does), and the
 * weighted sum of the values is accumulated in the compute type.
 *
 * Built by pagefleet/kernels/cpu_decode.py with the system C compiler on first
 * use (-O3 -march=native -fopenmp-simd), loaded through ctypes, which releases
 * the GIL for the call. Compute types: float32 (over a float32, float16 or
 * bfloat16 cache) and float64 (over a float64 cache, the exact path).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

typedef _Float16 f16_t;


/* Widen `width` cache elements into `dst` (float); F16C converts 8 halves at once. */
static inline void widen_f16(const f16_t *src, int64_t width, float *dst) {
    int64_t x = 0;
#ifdef __F16C__
    for (; x + 8 <= width; x += 8)
        _mm256_storeu_ps(dst + x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + x))));
#endif
    for (; x < width; x++) dst[x] = (float)src[x];
}
static inline void widen_bf16(const uint16_t *src, int64_t width, float *dst) {
#pragma omp simd
    for (int64_t x = 0; x < width; x++) {
        const uint32_t bits = (uint32_t)src[x] << 16; /* bfloat16 is float32's top half */
        memcpy(dst + x, &bits, sizeof bits);
    }
}
/* Not called: the same-width instantiations use the cache row in place. */
static inline void widen_none(const void *src, int64_t width, void *dst) {
    (void)src, (void)width, (void)dst;
}

/* Arguments, shared by every instantiation:
 *   q            query rows; row r, head j at q + r * q_row_stride + j * head_dim
 *   k, v         caches; slot s, KV head h at k + s * slot_stride + h * head_dim
 *   rows[i]      the query row (and output row) of decode sequence i
 *   tables       block tables, int32; sequence i's row is tables + seq[i] * table_stride
 *   seq[i]       its row in the block tables
 *   start[i], ctx[i]  the positions it attends: [start, ctx)
 *   out          output rows, like q (out_row_stride)
 * Returns 0, or -1 when the scratch rows could not be allocated.
 *
 * The body is inlined once per common head_dim (64, 128) so that the row loops
 * have a constant trip count, and once for any other. A narrow cache row is
 * widened into a buffer first (one vector conversion), then used like a float
 * row. Positions are walked block by block: no division per position.
 */
#define MAX_ROW 4096 /* kv_heads * head_dim of one slot, at most */

#define DEFINE_DECODE(NAME, T, KV_T, WIDEN, EXP)                                              \
    static inline __attribute__((always_inline)) void NAME##_seq(                           \
        const T *qr, const KV_T *k, const KV_T *v, int64_t slot_stride,                     \
        const int32_t *table, int64_t lo, int64_t hi, int64_t block_size,                   \
        int64_t kv_heads, int64_t group, const int64_t head_dim, T s, T *scores,            \
        int64_t longest, T *acc, T *row_buf, T *o) {                                        \
        const int64_t n = hi - lo, heads = kv_heads * group, width = kv_heads * head_dim;   \
        for (int64_t b = lo / block_size, t = 0; t < n; b++) {                              \
            const int64_t base = (int64_t)table[b] * block_size;                            \
            for (int64_t j = t == 0 ? lo % block_size : 0; j < block_size && t < n;         \
                 j++, t++) {                                                                \
                const KV_T *kr = k + (base + j) * slot_stride;                              \
                const T *kw = (const T *)kr;                                                \
                if (sizeof(KV_T) != sizeof(T)) {                                            \
                    WIDEN(kr, width, row_buf);                                              \
                    kw = row_buf;                                                           \
                }                                                                           \
                for (int64_t h = 0; h < kv_heads; h++) {                                    \
                    for (int64_t g = 0; g < group; g++) {                                   \
                        const T *qg = qr + (h * group + g) * head_dim;                      \
                        const T *kh = kw + h * head_dim;                                    \
                        T dot = 0;                                                          \
                        _Pragma("omp simd reduction(+ : dot)")                              \
                        for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * kh[d];        \
                        scores[(h * group + g) * longest + t] = dot * s;                    \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int64_t r = 0; r < heads; r++) {                                               \
            T *row = scores + r * longest;                                                  \
            T top = row[0];                                                                 \
            for (int64_t t = 1; t < n; t++) top = row[t] > top ? row[t] : top;              \
            T sum = 0;                                                                      \
            for (int64_t t = 0; t < n; t++) {                                               \
                row[t] = EXP(row[t] - top);                                                 \
                sum += row[t];                                                              \
            }                                                                               \
            const T inv = (T)1 / sum;                                                       \
            for (int64_t t = 0; t < n; t++) row[t] *= inv;                                  \
        }                                                                                   \
        for (int64_t x = 0; x < heads * head_dim; x++) acc[x] = 0;                          \
        for (int64_t b = lo / block_size, t = 0; t < n; b++) {                              \
            const int64_t base = (int64_t)table[b] * block_size;                            \
            for (int64_t j = t == 0 ? lo % block_size : 0; j < block_size && t < n;         \
                 j++, t++) {                                                                \
                const KV_T *vr = v + (base + j) * slot_stride;                              \
                const T *vw = (const T *)vr;                                                \
                if (sizeof(KV_T) != sizeof(T)) {                                            \
                    WIDEN(vr, width, row_buf);                                              \
                    vw = row_buf;                                                           \
                }                                                                           \
                for (int64_t h = 0; h < kv_heads; h++) {                                    \
                    for (int64_t g = 0; g < group; g++) {                                   \
                        const T w = scores[(h * group + g) * longest + t];                  \
                        T *ag = acc + (h * group + g) * head_dim;                           \
                        const T *vh = vw + h * head_dim;                                    \
                        _Pragma("omp simd")                                                 \
                        for (int64_t d = 0; d < head_dim; d++) ag[d] += w * vh[d];          \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int64_t x = 0; x < heads * head_dim; x++) o[x] = acc[x];                       \
    }                                                                                       \
                                                                                            \
    int NAME(const T *q, int64_t q_row_stride, const KV_T *k, const KV_T *v,                \
             int64_t slot_stride, const int64_t *rows, const int32_t *tables,               \
             int64_t table_stride, const int64_t *seq, const int64_t *start,                \
             const int64_t *ctx, int64_t n_seqs, int64_t block_size, int64_t kv_heads,      \
             int64_t group, int64_t head_dim, double scale, T *out,                         \
             int64_t out_row_stride) {                                                      \
        if (kv_heads * head_dim > MAX_ROW) return -2;                                       \
        int64_t longest = 1;                                                                \
        for (int64_t i = 0; i < n_seqs; i++)                                                \
            if (ctx[i] - start[i] > longest) longest = ctx[i] - start[i];                   \
        const int64_t heads = kv_heads * group;                                             \
        T *scores = malloc(sizeof(T) * (size_t)(heads * longest + heads * head_dim));       \
        if (scores == NULL) return -1;                                                      \
        T *acc = scores + heads * longest;                                                  \
        T row_buf[MAX_ROW];                                                                 \
        const T s = (T)scale;                                                               \
        for (int64_t i = 0; i < n_seqs; i++) {                                              \
            const int32_t *table = tables + seq[i] * table_stride;                          \
            const T *qr = q + rows[i] * q_row_stride;                                       \
            T *o = out + rows[i] * out_row_stride;                                          \
            if (head_dim == 64)                                                             \
                NAME##_seq(qr, k, v, slot_stride, table, start[i], ctx[i], block_size,      \
                           kv_heads, group, 64, s, scores, longest, acc, row_buf, o);       \
            else if (head_dim == 128)                                                       \
                NAME##_seq(qr, k, v, slot_stride, table, start[i], ctx[i], block_size,      \
                           kv_heads, group, 128, s, scores, longest, acc, row_buf, o);      \
            else                                                                            \
                NAME##_seq(qr, k, v, slot_stride, table, start[i], ctx[i], block_size,      \
                           kv_heads, group, head_dim, s, scores, longest, acc, row_buf, o); \
        }                                                                                   \
        free(scores);                                                                       \
        return 0;                                                                           \
    }

DEFINE_DECODE(pf_decode_f32, float, float, widen_none, expf)
DEFINE_DECODE(pf_decode_f32_f16, float, f16_t, widen_f16, expf)
DEFINE_DECODE(pf_decode_f32_bf16, float, uint16_t, widen_bf16, expf)
DEFINE_DECODE(pf_decode_f64, double, double, widen_none, exp)
