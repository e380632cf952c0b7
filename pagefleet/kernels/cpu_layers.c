/* The decoder's elementwise layers for CPU serving, float32: RMSNorm, the MLP's
 * SiLU and gated product, and RoPE with the step's K/V write into the paged cache.
 *
 * In torch each is several passes over the step's rows, each pass a fresh
 * tensor (RMSNorm: square, mean, add, rsqrt, two products; the MLP: SiLU, then
 * the product; RoPE: two products, a negation, a concatenation and a sum, for q
 * and k apart, copies to make them contiguous, then the cache's `index_copy_`
 * of k and v). Here each is one pass that reads a row once and writes it once.
 *
 * Numbers: each layer gives torch's bits exactly. Every product, quotient and
 * sum is the operation torch performs, rounded once, in torch's order: this
 * file is compiled with contraction off (below), so the only fused
 * multiply-adds are those of torch's own exp (`sleef_expf`). RMSNorm adds its
 * squares in the order of torch's reduction (`torch_sum_squares`), and a
 * float16 cache row is rounded as torch rounds. A row's result never depends
 * on the rows beside it.
 *
 * Rows are shared out over `threads` OpenMP threads (torch's own pool, as in
 * cpu_decode.c). Built with cpu_decode.c into one library by
 * pagefleet/kernels/cpu_decode.py.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
/* No FP traps to keep: lets GCC vectorize SiLU's selects (the values are the same). */
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

typedef float v8f_l __attribute__((vector_size(32)));

/* A step's rows are shared out over the threads when there are two or more (a row stays on
 * one thread) holding PARALLEL_FLOATS floats of work or more. A decode step of 32 rows does
 * (RMSNorm's 18,432 floats, RoPE's 30,720, SiLU's 49,152): on two threads its C layers took
 * 1.4-1.6 ms a step of SmolLM2 against 2.1-2.2 on one (docs/benchmarks.md 14.10). Less work
 * stays on the calling thread, where waking another costs more than it saves. */
#define PARALLEL_FLOATS (16 * 1024)
#define SHARED_OUT(threads, rows, floats) ((threads) > 1 && (rows) > 1 && (floats) >= PARALLEL_FLOATS)
#define MAX_HEAD_DIM 1024 /* RoPE's stack row of a k head */

static inline v8f_l square8(const float *p) {
    v8f_l x;
    memcpy(&x, p, sizeof x);
    return x * x;
}

static inline int64_t ceil_log2(int64_t x) {
    int64_t bits = 1;
    while (x > 2 && ((int64_t)1 << bits) < x)
        bits++;
    return bits;
}

/* The sum of the squares of a row in torch's own order (ATen's cascade sum on the CPU, as
 * `x.pow(2).sum(-1)` adds a contiguous row; torch on several threads shares a single row of
 * 32,768 floats or more between them, in another order): 8-lane vectors, four accumulators over
 * consecutive vectors, their running sums carried up four levels every 2^level_power
 * vectors; then the leftover vectors into the first accumulator, the four accumulators
 * in order, and the row's scalar tail before the eight lanes, in order. */
static float torch_sum_squares(const float *row, int64_t width) {
    const int64_t vectors = width / 8, size = vectors / 4;
    const int64_t level_power = ceil_log2(size) / 4 > 4 ? ceil_log2(size) / 4 : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    v8f_l acc[4][4];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < 4; k++)
                acc[0][k] += square8(row + (i * 4 + k) * 8);
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = (v8f_l){0};
            }
            if ((i & (level_mask << (j * level_power))) != 0)
                break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++)
            acc[0][k] += square8(row + (i * 4 + k) * 8);
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            acc[0][k] += acc[j][k];
    v8f_l total = acc[0][0];
    for (int64_t v = size * 4; v < vectors; v++)
        total += square8(row + v * 8);
    for (int k = 1; k < 4; k++)
        total += acc[0][k];
    float sum = 0.0f;
    for (int64_t t = vectors * 8; t < width; t++)
        sum += row[t] * row[t];
    for (int lane = 0; lane < 8; lane++)
        sum += total[lane];
    return sum;
}

/* out[r] = weight * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))), as transformers' RMSNorm in
 * float32 computes it (the mean: torch's sum divided by `width`): torch's bits. */
int pf_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, int64_t rows,
                    int64_t width, double eps, float *out, int64_t out_stride, int64_t threads) {
    const float eps_f = (float)eps, width_f = (float)width;
#pragma omp parallel for num_threads(threads) if (SHARED_OUT(threads, rows, rows * width))
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        float *dst = out + r * out_stride;
        const float scale = 1.0f / sqrtf(torch_sum_squares(row, width) / width_f + eps_f);
        for (int64_t i = 0; i < width; i++)
            dst[i] = weight[i] * (row[i] * scale);
    }
    return 0;
}

/* e^d as torch's vectorized float32 exp computes it (SLEEF's expf, 1-ulp variant, with its
 * fused multiply-adds): d rounded to a multiple of ln 2, a degree-6 polynomial, then the power
 * of two in two halves; 0 below -104, infinity above 100, NaN for NaN. */
static inline float sleef_expf(float d) {
    const int32_t q = (int32_t)__builtin_rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = fmaf((float)q, -0.693145751953125f, d);
    s = fmaf((float)q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    const int32_t half_q = q >> 1, bits_a = (half_q + 127) << 23, bits_b = (q - half_q + 127) << 23;
    float pow_a, pow_b;
    memcpy(&pow_a, &bits_a, sizeof pow_a);
    memcpy(&pow_b, &bits_b, sizeof pow_b);
    u = u * pow_a * pow_b;
    u = d < -104.0f ? 0.0f : u;
    u = 100.0f < d ? INFINITY : u;
    return d != d ? d : u;
}

/* out[r] = silu(gate) * up, of one step's fused gate/up projection rows `gate_up` [rows,
 * 2 * inner] (gate, then up; row stride `stride`) into `out` [rows, inner], as torch computes
 * `F.silu(gate).mul_(up)`: gate / (1 + e^-gate) with SLEEF's exp in groups of 32 floats,
 * libm's expf for a row's last inner % 32 (torch's vector loop and its scalar tail). */
int pf_silu_mul_f32(const float *gate_up, int64_t stride, int64_t rows, int64_t inner,
                    float *out, int64_t threads) {
    const int64_t vec_end = inner - inner % 32;
#pragma omp parallel for num_threads(threads) if (SHARED_OUT(threads, rows, rows * inner))
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict gate = gate_up + r * stride, *restrict up = gate + inner;
        float *restrict dst = out + r * inner;
        for (int64_t i = 0; i < vec_end; i++)
            dst[i] = gate[i] / (1.0f + sleef_expf(-gate[i])) * up[i];
        for (int64_t i = vec_end; i < inner; i++)
            dst[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    return 0;
}

/* RoPE of one head: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). */
static inline void rotate_head(const float *restrict x, const float *restrict cos_row,
                               const float *restrict sin_row, int64_t half, float *restrict out) {
    for (int64_t i = 0; i < half; i++)
        out[i] = x[i] * cos_row[i] - x[i + half] * sin_row[i];
    for (int64_t i = half; i < 2 * half; i++)
        out[i] = x[i] * cos_row[i] + x[i - half] * sin_row[i];
}

/* One step's fused q/k/v projection rows, [rows, (q_heads + 2 kv_heads) * head_dim] with
 * row stride `qkv_stride`: RoPE of the q heads into `q_out` [rows, q_heads, head_dim]
 * (contiguous); RoPE of the k heads, and the v heads as they are, into the caches'
 * [num_slots, kv_heads, head_dim] rows at `slots` (-1: not written), rounded to the cache's
 * type as torch rounds (to nearest, ties to even). Each row's `cos`/`sin` [rows, head_dim]
 * have row stride `trig_stride`. A slot out of range writes nothing and returns 2. */
#define DEFINE_ROPE_WRITE(NAME, KV_T)                                                          \
    int NAME(const float *qkv, int64_t qkv_stride, const float *cos_, const float *sin_,      \
             int64_t trig_stride, int64_t rows, int64_t q_heads, int64_t kv_heads,            \
             int64_t head_dim, float *q_out, KV_T *k_cache, KV_T *v_cache,                   \
             const int64_t *slots, int64_t num_slots, int64_t threads) {                      \
        if (head_dim % 2 != 0 || head_dim > MAX_HEAD_DIM)                                     \
            return 1;                                                                         \
        for (int64_t r = 0; r < rows; r++)                                                    \
            if (slots[r] < -1 || slots[r] >= num_slots)                                       \
                return 2;                                                                     \
        const int64_t half = head_dim / 2, width = kv_heads * head_dim;                       \
        _Pragma("omp parallel for num_threads(threads) if (SHARED_OUT(threads, rows, rows * (q_heads + 2 * kv_heads) * head_dim))") \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const float *src = qkv + r * qkv_stride;                                          \
            const float *c = cos_ + r * trig_stride, *s = sin_ + r * trig_stride;             \
            for (int64_t h = 0; h < q_heads; h++)                                             \
                rotate_head(src + h * head_dim, c, s, half, q_out + (r * q_heads + h) * head_dim); \
            if (slots[r] < 0)                                                                 \
                continue;                                                                     \
            KV_T *k_row = k_cache + slots[r] * width, *v_row = v_cache + slots[r] * width;    \
            const float *v_src = src + (q_heads + kv_heads) * head_dim;                       \
            for (int64_t h = 0; h < kv_heads; h++) {                                          \
                float rotated[MAX_HEAD_DIM];                                                  \
                rotate_head(src + (q_heads + h) * head_dim, c, s, half, rotated);             \
                for (int64_t i = 0; i < head_dim; i++)                                        \
                    k_row[h * head_dim + i] = (KV_T)rotated[i];                               \
            }                                                                                 \
            for (int64_t i = 0; i < width; i++)                                               \
                v_row[i] = (KV_T)v_src[i];                                                    \
        }                                                                                     \
        return 0;                                                                             \
    }
DEFINE_ROPE_WRITE(pf_rope_write_f32, float)
DEFINE_ROPE_WRITE(pf_rope_write_f32_f16, _Float16)

typedef int32_t v8i_l __attribute__((vector_size(32)));

/* Each row's greedy token, as the sampler reads `logits.max(dim=-1)`: the index of the row's
 * first maximum, or -1 for a row that holds a NaN or +inf (it cannot be sampled). One pass:
 * the lanes of 4 vectors (32 floats a step, 4 chains of compares in flight) each keep their
 * largest value and where it first came (a strict comparison keeps the earliest of equal
 * ones), then the smallest index among the lanes holding the row's maximum. The rows are a
 * step's logits ([rows, vocab], row stride `stride`). */
int pf_greedy_f32(const float *logits, int64_t stride, int64_t rows, int64_t vocab,
                  int64_t *index_out, int64_t threads) {
    if (vocab < 1 || vocab > INT32_MAX)
        return 1;
#pragma omp parallel for num_threads(threads) if (SHARED_OUT(threads, rows, rows * vocab))
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * stride;
        v8f_l best[4];
        v8i_l where[4], nan = {0};
        for (int a = 0; a < 4; a++) {
            best[a] = (v8f_l){0} - INFINITY;
            where[a] = (v8i_l){0};
        }
        v8i_l lane = {0, 1, 2, 3, 4, 5, 6, 7};
        int64_t i = 0;
        for (; i + 32 <= vocab; i += 32, lane += 32) {
            for (int a = 0; a < 4; a++) {
                v8f_l x;
                memcpy(&x, row + i + 8 * a, sizeof x);
                const v8i_l above = x > best[a];
                best[a] = (v8f_l)(((v8i_l)x & above) | ((v8i_l)best[a] & ~above));
                where[a] = ((lane + 8 * a) & above) | (where[a] & ~above);
                nan |= x != x;
            }
        }
        float top = -INFINITY;
        int64_t at = 0, unsampled = 0;
        for (int a = 0; a < 4; a++)
            for (int k = 0; k < 8; k++) {
                unsampled |= nan[k];
                if (best[a][k] > top || (best[a][k] == top && where[a][k] < at)) {
                    top = best[a][k];
                    at = where[a][k];
                }
            }
        for (; i < vocab; i++) {
            unsampled |= row[i] != row[i];
            if (row[i] > top) {
                top = row[i];
                at = i;
            }
        }
        index_out[r] = unsampled || top == INFINITY ? -1 : at;
    }
    return 0;
}
