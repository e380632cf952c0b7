/* Attention on a paged KV cache, for CPU serving: one call per layer.
 *
 * Every query row (a decode token, or one token of a prefill chunk, whose
 * context ends at its own position: causal without a mask) attends over its
 * sequence's context straight from the cache's own layout, [num_blocks,
 * block_size, kv_heads, head_dim], through its block table: no gather copy, no
 * padding, no per-sequence call. Rows go in tiles: up to TILE consecutive rows
 * of one sequence from one first position (a prefill chunk's tokens; a decode
 * token is a tile of its own). A tile's positions are walked block by block;
 * within a block, the scores one query head at a time and one row at a time,
 * the row's query held in registers across the block's rows, W positions'
 * dot products at a time kept in registers for their horizontal sums; the
 * values' weighted sums for BUNDLE (row, query head) pairs of one KV head at
 * a time, their running sums in registers across the block's rows and each
 * value vector loaded once for the bundle. The block's rows stay in L1 for
 * the tile's other rows and the GQA group's other heads. Each row's
 * arithmetic is the same, in the same order, whatever its tile and bundle.
 * The next block (blocks are scattered in memory) is prefetched a few cache
 * lines per row worked on, into L1 on CPUs with a large one, else into L2 (the
 * caller says which), and during the last block of the keys the first of the
 * values. The scores of the context go to a scratch row per query head, the
 * softmax subtracts their maximum (as SDPA does), and the weighted sum of the
 * values is accumulated in the compute type, position by position (so the
 * loop order changes no bit).
 *
 * Vectors are GCC/Clang vector extensions (16 or 8 floats, 4 doubles), so the
 * same source builds for AVX2, AVX-512 or NEON; head_dim must be a multiple of
 * 8 (the Python side checks). float32 computes over a float32, float16 or
 * bfloat16 cache (a narrow row is widened as it is read, with F16C where the
 * CPU has it) and takes e^x from a polynomial (within 1 ulp of expf); float64
 * over a float64 cache (the exact path) takes libm's exp.
 *
 * Tiles are shared out over `threads` OpenMP threads. Built with -fopenmp, the
 * library needs libgomp.so.1, which torch's CPU build has already loaded: the
 * kernel runs on torch's own thread pool, not a second one beside it (without
 * OpenMP the pragmas are ignored and it runs on the calling thread).
 *
 * Built by pagefleet/kernels/cpu_decode.py with the system C compiler on first
 * use, loaded through ctypes, which releases the GIL for the call.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

typedef _Float16 f16_t;
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define TILE 8 /* query rows of one sequence per K/V block read, at most */
#define SCORE_BYTES (768 * 1024) /* a tile's score rows, at most (one row always) */
#define MAX_CHUNKS 64 /* head_dim / lanes, at most (head_dim 256 in float64): stack arrays */
/* (row, query head) pairs whose weighted sums of one KV head's values are taken together:
 * 3 (a GQA group of 3, or 3 rows of a tile) keeps 12 sums of 16 lanes in registers at
 * head_dim 64, each value vector loaded once for the three (docs/benchmarks.md 14.9). */
#define BUNDLE 3

/* Keep vector `x` in a register: the compiler would otherwise load it again for each use
 * as a memory operand, which costs a load each (x86 with AVX, whose registers hold the
 * 32-byte vectors whole; elsewhere nothing). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) (void)(x)
#endif

static inline v8f load_v8f(const float *p) {
    v8f x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline v4d load_v4d(const double *p) {
    v4d x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline float hsum_v8f(v8f x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
static inline double hsum_v4d(v4d x) { return (x[0] + x[2]) + (x[1] + x[3]); }
/* The horizontal sums of 8 vectors at once, as one vector: lane i is hsum_v8f(d[i]),
 * added in the same order (so the same bits), for a third of the shuffles. */
static inline v8f hsums_v8f(const v8f *d) {
#define PAIR8(a, b) (__builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11) + \
                     __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15))
#define QUAD8(a, b) (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + \
                     __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
    const v8f b0 = QUAD8(PAIR8(d[0], d[1]), PAIR8(d[2], d[3]));
    const v8f b1 = QUAD8(PAIR8(d[4], d[5]), PAIR8(d[6], d[7]));
#undef PAIR8
#undef QUAD8
    return __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline v16f load_v16f(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline v8f halves_v16f(v16f x) {
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline float hsum_v16f(v16f x) { return hsum_v8f(halves_v16f(x)); }
/* Lane i is hsum_v16f(d[i]), in its order. */
static inline v16f hsums_v16f(const v16f *d) {
    v8f h[16];
    for (int i = 0; i < 16; i++) h[i] = halves_v16f(d[i]);
    const v8f a = hsums_v8f(h), b = hsums_v8f(h + 8);
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
/* Lane i is hsum_v4d(d[i]), in its order. */
static inline v4d hsums_v4d(const v4d *d) {
    const v4d a0 = __builtin_shufflevector(d[0], d[1], 0, 4, 1, 5) +
                   __builtin_shufflevector(d[0], d[1], 2, 6, 3, 7);
    const v4d a1 = __builtin_shufflevector(d[2], d[3], 0, 4, 1, 5) +
                   __builtin_shufflevector(d[2], d[3], 2, 6, 3, 7);
    return __builtin_shufflevector(a0, a1, 0, 1, 4, 5) + __builtin_shufflevector(a0, a1, 2, 3, 6, 7);
}
static inline v8f max_v8f(v8f a, v8f b) {
    const v8i keep = a >= b;
    return (v8f)(((v8i)a & keep) | ((v8i)b & ~keep));
}
static inline v16f max_v16f(v16f a, v16f b) {
    const v16i keep = a >= b;
    return (v16f)(((v16i)a & keep) | ((v16i)b & ~keep));
}
static inline v4d max_v4d(v4d a, v4d b) {
    const v4l keep = a >= b;
    return (v4d)(((v4l)a & keep) | ((v4l)b & ~keep));
}

/* e^x for x <= 0, per lane: Cephes' expf polynomial, within 1 ulp of expf; below
 * -87.3 (where e^x leaves float32's normal range, and for -inf) it gives 0. */
#define DEFINE_EXP(NAME, VF, VI)                                                              \
    static inline VF NAME(VF x) {                                                             \
        const VF lo = (VF){0} - 87.33654f, magic = (VF){0} + 12582912.0f; /* 1.5 * 2^23 */    \
        const VI under = x < lo;                                                              \
        x = (VF)(((VI)x & ~under) | ((VI)lo & under));                                        \
        const VF t = x * 1.44269504088896341f + magic;                                        \
        const VF n = t - magic; /* x / ln 2, rounded to the nearest integer */                \
        const VF r = x - n * 0.693359375f + n * 2.12194440e-4f;                               \
        VF p = (VF){0} + 1.9875691500e-4f;                                                    \
        p = p * r + 1.3981999507e-3f;                                                         \
        p = p * r + 8.3334519073e-3f;                                                         \
        p = p * r + 4.1665795894e-2f;                                                         \
        p = p * r + 1.6666665459e-1f;                                                         \
        p = p * r + 5.0000001201e-1f;                                                         \
        p = p * r * r + r + 1.0f;                                                             \
        const VI pow2 = (((VI)t - (VI)magic) + 127) << 23;                                    \
        return (VF)((VI)(p * (VF)pow2) & ~under);                                             \
    }
DEFINE_EXP(exp_v8f, v8f, v8i)
DEFINE_EXP(exp_v16f, v16f, v16i)
static inline v4d exp_v4d(v4d x) {
    for (int i = 0; i < 4; i++) x[i] = exp(x[i]);
    return x;
}

/* Ask for the next two cache lines of a run [p, end) still to prefetch, if any, into L1
 * (locality 3: prefetcht0 on x86) where `into_l1`, else into L2 (locality 2: prefetcht1).
 * The caller says which (`prefetch_l1`, by the size of L1): on an AVX-512 EPYC, likely a
 * 32 KB-L1 Zen 4, L1 prefetches made a step 1.6x slower than L2 ones; on a Zen 5 (48 KB)
 * they made it 1.3x faster. */
#define PREFETCH_STEP(p, end)                       \
    if ((p) < (end)) {                              \
        if (into_l1) {                              \
            __builtin_prefetch(p, 0, 3);            \
            __builtin_prefetch((p) + 64, 0, 3);     \
        } else {                                    \
            __builtin_prefetch(p, 0, 2);            \
            __builtin_prefetch((p) + 64, 0, 2);     \
        }                                           \
        (p) += 128;                                 \
    }

/* Widen `width` cache elements into `dst`. */
static inline void widen_f16(const f16_t *src, int64_t width, float *dst) {
    int64_t x = 0;
#ifdef __F16C__
    for (; x + 8 <= width; x += 8)
        _mm256_storeu_ps(dst + x, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + x))));
#endif
    for (; x < width; x++) dst[x] = (float)src[x];
}
static inline void widen_bf16(const uint16_t *src, int64_t width, float *dst) {
    for (int64_t x = 0; x < width; x++) {
        const uint32_t bits = (uint32_t)src[x] << 16; /* bfloat16 is float32's top half */
        memcpy(dst + x, &bits, sizeof bits);
    }
}
/* Not called: a cache of the compute type is read in place. */
static inline void widen_none(const void *src, int64_t width, void *dst) {
    (void)src, (void)width, (void)dst;
}

/* Inside DEFINE_DECODE's per-sequence body: run the statements given for every block
 * of the positions [lo, hi), with `t0` the block's first position (counted from lo), `m`
 * its number of positions and `rows` their slot rows (every KV head; consecutive,
 * slot_stride apart) in the compute type T (widened into blk_buf from a narrower KV_T).
 * The next block's rows are prefetched while a block is worked on (blocks are scattered
 * in memory); while the last one is, the first block of the same positions in `THEN`
 * (the values after the keys; NULL: none). */
#define FOR_EACH_BLOCK(T, KV_T, WIDEN, CACHE, THEN, ...)                                      \
    for (int64_t b = lo / block_size, t0 = 0; t0 < n; b++) {                                  \
        const int64_t j0 = t0 == 0 ? lo % block_size : 0;                                     \
        const int64_t m = block_size - j0 < n - t0 ? block_size - j0 : n - t0;                \
        /* The next block's rows, for the body to prefetch a little at a time: a burst        \
           of prefetches would overflow the core's queue of outstanding misses. */            \
        const int64_t ahead = n - t0 - m < block_size ? n - t0 - m : block_size;              \
        const char *pf = NULL, *pf_end = NULL;                                                \
        if (ahead > 0) {                                                                      \
            pf = (const char *)(CACHE + (int64_t)table[b + 1] * block_size * slot_stride);    \
            pf_end = pf + ahead * slot_stride * (int64_t)sizeof(KV_T);                        \
        } else if ((THEN) != NULL) {                                                          \
            const int64_t j1 = lo % block_size;                                               \
            const int64_t first = block_size - j1 < n ? block_size - j1 : n;                  \
            const int64_t slot = (int64_t)table[lo / block_size] * block_size + j1;           \
            pf = (const char *)((THEN) + slot * slot_stride);                                 \
            pf_end = pf + first * slot_stride * (int64_t)sizeof(KV_T);                        \
        }                                                                                     \
        const KV_T *raw = CACHE + ((int64_t)table[b] * block_size + j0) * slot_stride;        \
        const T *rows = (const T *)raw;                                                       \
        if (sizeof(KV_T) != sizeof(T)) {                                                      \
            WIDEN(raw, m * slot_stride, blk_buf);                                             \
            rows = blk_buf;                                                                   \
        }                                                                                     \
        __VA_ARGS__                                                                           \
        t0 += m;                                                                              \
    }

#define DECODE_PARAMS(T, KV_T)                                                                \
    const T *q, int64_t q_row_stride, const KV_T *k, const KV_T *v, int64_t slot_stride,      \
        const int64_t *rows, const int32_t *tables, int64_t table_stride, const int64_t *seq, \
        const int64_t *start, const int64_t *ctx, int64_t n_seqs, int64_t block_size,         \
        int64_t kv_heads, int64_t group, int64_t head_dim, double scale, T *out,              \
        int64_t out_row_stride, int64_t threads, int64_t prefetch_l1
#define DECODE_ARGS                                                                           \
    q, q_row_stride, k, v, slot_stride, rows, tables, table_stride, seq, start, ctx, n_seqs,  \
        block_size, kv_heads, group, head_dim, scale, out, out_row_stride, threads, prefetch_l1

/* DEFINE_DECODE's call of its tile body for tile i0's rows (TILE_ROWS of them), with the
 * head_dim given (a constant, for constant trip counts, or the argument). */
#define TILE_CALL(FN, T, HEAD_DIM, TILE_ROWS)                                                 \
    FN(qrs, outs, ctx + i0, TILE_ROWS, k, v, slot_stride, table, start[i0], block_size,       \
       kv_heads, group, HEAD_DIM, (T)scale, scores, longest, acc, dots, blk_buf, prefetch_l1 != 0)

/* Arguments, shared by every instantiation:
 *   q            query rows; row r, head j at q + r * q_row_stride + j * head_dim
 *   k, v         caches; slot s, KV head h at k + s * slot_stride + h * head_dim
 *   rows[i]      query row i (and its output row)
 *   tables       block tables, int32; sequence i's row is tables + seq[i] * table_stride
 *   seq[i]       its row in the block tables
 *   start[i], ctx[i]  the positions it attends: [start, ctx)
 *   out          output rows, like q (out_row_stride)
 *   prefetch_l1  nonzero: the next block is prefetched into L1, else into L2 (PREFETCH_STEP)
 * Returns 0; -1 when the scratch rows could not be allocated; -2 when head_dim
 * is no multiple of 8 or more than MAX_CHUNKS vectors.
 *
 * The tile body is inlined for head_dim 64 (one-row tiles and others), 128 and
 * any other, so the common loops have constant trip counts.
 */
#define DEFINE_DECODE(NAME, T, VT, W, KV_T, WIDEN, LOAD, HSUM, HSUMS, VMAX, VEXP)             \
    static inline __attribute__((always_inline)) void NAME##_tile(                            \
        const T *const *qrs, T *const *outs, const int64_t *his, int64_t tile,                \
        const KV_T *k, const KV_T *v, int64_t slot_stride, const int32_t *table, int64_t lo,  \
        int64_t block_size, int64_t kv_heads, int64_t group, const int64_t head_dim, T scale, \
        T *scores, int64_t longest, VT *acc, VT *dots, T *blk_buf, const int into_l1) {       \
        const int64_t heads = kv_heads * group, chunks = head_dim / W;                        \
        int64_t hi = his[0];                                                                  \
        for (int64_t x = 1; x < tile; x++) hi = his[x] > hi ? his[x] : hi;                    \
        const int64_t n = hi - lo;                                                            \
        /* Scores, a block at a time, one query head at a time, each row of the tile in       \
           turn (its query in registers; the head's keys stay in L1 across the rows):         \
           each score's dot product is kept as a vector until W positions have one;           \
           their sums are then taken together. A whole group of W positions keeps its         \
           dot products in registers (the scores about 1.5x faster than through `dots`); a    \
           group cut by a block's end or the row's last position goes through `dots`. */      \
        FOR_EACH_BLOCK(T, KV_T, WIDEN, k, v,                                                  \
            for (int64_t r = 0; r < heads; r++) {                                             \
                const T *kh = rows + r / group * head_dim; /* its KV head's keys */           \
                for (int64_t x = 0; x < tile; x++) {                                          \
                    const int64_t nx = his[x] - lo; /* the row's positions */                 \
                    const int64_t mx = nx - t0 < m ? nx - t0 : m;                             \
                    VT qv[MAX_CHUNKS];                                                        \
                    const T *qr = qrs[x] + r * head_dim;                                      \
                    for (int64_t c = 0; c < chunks; c++) qv[c] = LOAD(qr + W * c);            \
                    VT *d = dots + (x * heads + r) * W;                                       \
                    T *srow = scores + (x * heads + r) * longest;                             \
                    for (int64_t j = 0; j < mx;) {                                            \
                        const int64_t t = t0 + j;                                             \
                        if (t % W == 0 && j + W <= mx) {                                      \
                            VT dd[W];                                                         \
                            _Pragma("GCC unroll 16")                                          \
                            for (int y = 0; y < W; y++) {                                     \
                                const T *kr = kh + (j + y) * slot_stride;                     \
                                PREFETCH_STEP(pf, pf_end);                                    \
                                VT dot = qv[0] * LOAD(kr);                                    \
                                for (int64_t c = 1; c < chunks; c++)                          \
                                    dot += qv[c] * LOAD(kr + W * c);                          \
                                dd[y] = dot;                                                  \
                            }                                                                 \
                            const VT s = HSUMS(dd) * scale;                                   \
                            memcpy(srow + t, &s, sizeof s);                                   \
                            j += W;                                                           \
                            continue;                                                         \
                        }                                                                     \
                        const T *kr = kh + j * slot_stride;                                   \
                        PREFETCH_STEP(pf, pf_end);                                            \
                        VT dot = qv[0] * LOAD(kr);                                            \
                        for (int64_t c = 1; c < chunks; c++) dot += qv[c] * LOAD(kr + W * c); \
                        d[t % W] = dot;                                                       \
                        if (t % W == W - 1 || t == nx - 1) {                                  \
                            for (int64_t y = t % W + 1; y < W; y++) d[y] = (VT){0}; /* > nx */\
                            const VT s = HSUMS(d) * scale;                                    \
                            memcpy(srow + t - t % W, &s, sizeof s);                           \
                        }                                                                     \
                        j++;                                                                  \
                    }                                                                         \
                }                                                                             \
            })                                                                                \
        /* Softmax per row and query head, over score rows padded to W lanes with -inf        \
           (weight 0). */                                                                     \
        for (int64_t x = 0; x < tile; x++) {                                                  \
            const int64_t nx = his[x] - lo, padded = (nx + W - 1) / W * W;                    \
            for (int64_t r = 0; r < heads; r++) {                                             \
                T *row = scores + (x * heads + r) * longest;                                  \
                for (int64_t t = nx; t < padded; t++) row[t] = -INFINITY;                     \
                VT top = LOAD(row);                                                           \
                for (int64_t t = W; t < padded; t += W) top = VMAX(top, LOAD(row + t));       \
                T peak = top[0];                                                              \
                for (int i = 1; i < W; i++) peak = top[i] > peak ? top[i] : peak;             \
                VT sum = {0};                                                                 \
                for (int64_t t = 0; t < padded; t += W) {                                     \
                    const VT e = VEXP(LOAD(row + t) - peak);                                  \
                    sum += e;                                                                 \
                    memcpy(row + t, &e, sizeof e);                                            \
                }                                                                             \
                const T inv = (T)1 / HSUM(sum);                                               \
                for (int64_t t = 0; t < nx; t++) row[t] *= inv;                               \
            }                                                                                 \
        }                                                                                     \
        /* Weighted sum of the values, a block at a time, one KV head at a time, its (row,    \
           query head) pairs BUNDLE at a time (their sums in registers across the block,      \
           each value vector loaded once for them) as far as all of them go; each pair        \
           then on its own to its row's last position, and a last short bundle too. */        \
        for (int64_t y = 0; y < tile * heads * chunks; y++) acc[y] = (VT){0};                 \
        FOR_EACH_BLOCK(T, KV_T, WIDEN, v, (const KV_T *)NULL,                                 \
            for (int64_t h = 0; h < kv_heads; h++) {                                          \
                const T *vh = rows + h * head_dim; /* this KV head's values */                \
                const int64_t pairs = tile * group;                                           \
                for (int64_t p0 = 0; p0 < pairs; p0 += BUNDLE) {                              \
                    const int64_t np = pairs - p0 < BUNDLE ? pairs - p0 : BUNDLE;             \
                    const T *w[BUNDLE];                                                       \
                    VT *ar[BUNDLE];                                                           \
                    int64_t mx[BUNDLE], joint = m;                                            \
                    for (int64_t i = 0; i < np; i++) {                                        \
                        const int64_t x = (p0 + i) / group, r = h * group + (p0 + i) % group; \
                        const int64_t nx = his[x] - lo;                                       \
                        mx[i] = nx - t0 < m ? nx - t0 : m;                                    \
                        joint = mx[i] < joint ? mx[i] : joint; /* <= 0: a row ended before */ \
                        w[i] = scores + (x * heads + r) * longest + t0;                       \
                        ar[i] = acc + (x * heads + r) * chunks;                               \
                    }                                                                         \
                    if (np < BUNDLE || joint < 0) joint = 0;                                  \
                    if (joint > 0) {                                                          \
                        VT a[BUNDLE][MAX_CHUNKS];                                             \
                        for (int64_t i = 0; i < BUNDLE; i++)                                  \
                            for (int64_t c = 0; c < chunks; c++) a[i][c] = ar[i][c];          \
                        for (int64_t j = 0; j < joint; j++) {                                 \
                            const T *vr = vh + j * slot_stride;                               \
                            /* As many prefetches per value row as the pairs one at a time */ \
                            for (int64_t i = 0; i < BUNDLE; i++) PREFETCH_STEP(pf, pf_end);   \
                            for (int64_t c = 0; c < chunks; c++) {                            \
                                VT vv = LOAD(vr + W * c);                                     \
                                IN_REGISTER(vv);                                              \
                                for (int64_t i = 0; i < BUNDLE; i++) a[i][c] += w[i][j] * vv; \
                            }                                                                 \
                        }                                                                     \
                        for (int64_t i = 0; i < BUNDLE; i++)                                  \
                            for (int64_t c = 0; c < chunks; c++) ar[i][c] = a[i][c];          \
                    }                                                                         \
                    for (int64_t i = 0; i < np; i++) {                                        \
                        if (joint >= mx[i]) continue;                                         \
                        VT a[MAX_CHUNKS];                                                     \
                        for (int64_t c = 0; c < chunks; c++) a[c] = ar[i][c];                 \
                        for (int64_t j = joint; j < mx[i]; j++) {                             \
                            const T *vr = vh + j * slot_stride;                               \
                            PREFETCH_STEP(pf, pf_end);                                        \
                            for (int64_t c = 0; c < chunks; c++)                              \
                                a[c] += w[i][j] * LOAD(vr + W * c);                           \
                        }                                                                     \
                        for (int64_t c = 0; c < chunks; c++) ar[i][c] = a[c];                 \
                    }                                                                         \
                }                                                                             \
            })                                                                                \
        for (int64_t x = 0; x < tile; x++)                                                    \
            memcpy(outs[x], acc + x * heads * chunks, sizeof(VT) * (size_t)(heads * chunks)); \
    }                                                                                         \
                                                                                              \
    static int NAME(DECODE_PARAMS(T, KV_T)) {                                                 \
        if (head_dim % 8 != 0 || head_dim % W != 0 || head_dim / W > MAX_CHUNKS) return -2;   \
        int64_t longest = 1;                                                                  \
        for (int64_t i = 0; i < n_seqs; i++)                                                  \
            if (ctx[i] - start[i] > longest) longest = ctx[i] - start[i];                     \
        longest = (longest + W - 1) / W * W;                                                  \
        const int64_t heads = kv_heads * group;                                               \
        /* Tiles: runs of consecutive rows of one sequence from one first position (a         \
           prefill chunk's tokens), which share every K/V block read: up to TILE rows,        \
           fewer where their score rows would outgrow SCORE_BYTES (at an 8,192-token          \
           context, 8-row tiles and their 2.4 MB of score rows were slower than none). */     \
        int64_t most = SCORE_BYTES / (int64_t)(sizeof(T) * (size_t)(heads * longest));        \
        most = most < 1 ? 1 : most > TILE ? TILE : most;                                      \
        int64_t *tiles = malloc(sizeof(int64_t) * (size_t)(n_seqs + 1));                      \
        if (tiles == NULL) return -1;                                                         \
        int64_t n_tiles = 0, widest = 1; /* the longest tile: the scratch rows' count */      \
        for (int64_t i = 0; i < n_seqs; i++) {                                                \
            if (i == 0 || i - tiles[n_tiles - 1] == most || seq[i] != seq[i - 1] ||           \
                start[i] != start[i - 1])                                                     \
                tiles[n_tiles++] = i;                                                         \
            if (i - tiles[n_tiles - 1] + 1 > widest) widest = i - tiles[n_tiles - 1] + 1;     \
        }                                                                                     \
        tiles[n_tiles] = n_seqs;                                                              \
        int failed = 0;                                                                       \
        /* Tiles are shared out one at a time (their contexts differ in length), each         \
           thread with scratch rows of its own. */                                            \
        _Pragma("omp parallel num_threads(threads) if (threads > 1 && n_tiles > 1)")          \
        {                                                                                     \
            T *scores = malloc(sizeof(T) * (size_t)(widest * heads * longest));               \
            /* Vectors are 32-byte aligned: malloc promises 16 only. */                       \
            VT *acc = aligned_alloc(64, sizeof(VT) * (size_t)(widest * heads * head_dim / W));\
            VT *dots = aligned_alloc(64, sizeof(VT) * (size_t)(widest * heads * W));          \
            T *blk_buf = malloc(sizeof(T) * (size_t)(block_size * kv_heads * head_dim));      \
            const int ok = scores != NULL && acc != NULL && dots != NULL && blk_buf != NULL;  \
            if (!ok) {                                                                        \
                _Pragma("omp atomic write")                                                   \
                failed = 1;                                                                   \
            }                                                                                 \
            _Pragma("omp for schedule(dynamic, 1)")                                           \
            for (int64_t b = 0; b < n_tiles; b++) {                                           \
                if (!ok) continue;                                                            \
                const int64_t i0 = tiles[b], tile = tiles[b + 1] - i0;                        \
                const T *qrs[TILE];                                                           \
                T *outs[TILE];                                                                \
                for (int64_t x = 0; x < tile; x++) {                                          \
                    qrs[x] = q + rows[i0 + x] * q_row_stride;                                 \
                    outs[x] = out + rows[i0 + x] * out_row_stride;                            \
                }                                                                             \
                const int32_t *table = tables + seq[i0] * table_stride;                       \
                if (head_dim == 64 && tile == 1) /* a decode token */                         \
                    TILE_CALL(NAME##_tile, T, 64, 1);                                         \
                else if (head_dim == 64)                                                      \
                    TILE_CALL(NAME##_tile, T, 64, tile);                                      \
                else if (head_dim == 128)                                                     \
                    TILE_CALL(NAME##_tile, T, 128, tile);                                     \
                else                                                                          \
                    TILE_CALL(NAME##_tile, T, head_dim, tile);                                \
            }                                                                                 \
            free(scores);                                                                     \
            free(acc);                                                                        \
            free(dots);                                                                       \
            free(blk_buf);                                                                    \
        }                                                                                     \
        free(tiles);                                                                          \
        return failed ? -1 : 0;                                                               \
    }

/* float32: 16 lanes where the CPU has AVX-512 and head_dim is a multiple of 16 (half
 * the instructions of 8 lanes), else 8. The lanes set the order of each score's sum, so
 * the two give scores a rounding apart; a node runs one of them for every request. */
#ifdef __AVX512F__
#define DEFINE_F32(NAME, KV_T, WIDEN)                                                         \
    DEFINE_DECODE(NAME##_w8, float, v8f, 8, KV_T, WIDEN, load_v8f, hsum_v8f, hsums_v8f,       \
                  max_v8f, exp_v8f)                                                           \
    DEFINE_DECODE(NAME##_w16, float, v16f, 16, KV_T, WIDEN, load_v16f, hsum_v16f, hsums_v16f, \
                  max_v16f, exp_v16f)                                                         \
    int NAME(DECODE_PARAMS(float, KV_T)) {                                                    \
        return head_dim % 16 == 0 ? NAME##_w16(DECODE_ARGS) : NAME##_w8(DECODE_ARGS);         \
    }
#else
#define DEFINE_F32(NAME, KV_T, WIDEN)                                                         \
    DEFINE_DECODE(NAME##_w8, float, v8f, 8, KV_T, WIDEN, load_v8f, hsum_v8f, hsums_v8f,       \
                  max_v8f, exp_v8f)                                                           \
    int NAME(DECODE_PARAMS(float, KV_T)) { return NAME##_w8(DECODE_ARGS); }
#endif

DEFINE_F32(pf_decode_f32, float, widen_none)
DEFINE_F32(pf_decode_f32_f16, f16_t, widen_f16)
DEFINE_F32(pf_decode_f32_bf16, uint16_t, widen_bf16)
DEFINE_DECODE(pf_decode_f64_impl, double, v4d, 4, double, widen_none, load_v4d, hsum_v4d,
              hsums_v4d, max_v4d, exp_v4d)
int pf_decode_f64(DECODE_PARAMS(double, double)) { return pf_decode_f64_impl(DECODE_ARGS); }
