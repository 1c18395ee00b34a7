/* Packed-weight matmuls for several activation rows on x86 CPUs with AVX512-BF16.
 *
 * Built and loaded by native/cpu.py; the weights stay in the layouts the rest of Paphos uses
 * (int8_group_cpu.py, int4pack_cpu.py). Each thread takes blocks of 16 weight rows, dequantizes a
 * block once into a buffer that stays in L1/L2 (fp32 math, rounded to bf16 as the dense path's
 * dequantizer does), then multiplies it with every activation row by `vdpbf16ps` (bf16 pairs,
 * fp32 sums). The weight is read once per call and never written back to memory in bf16, which is
 * what the dequantize-then-GEMM path pays for.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

int paphos_cpu_has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512bf16");
}

static uint16_t bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static void *buffer(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* y[M, N] = x[M, K] @ w[N, K]^T with w[n, k] = q[n, k] * scales[n, k / group]: q int8 row-major,
 * scales float32 [N, K / group], group 16 or 32, K a multiple of 32. x bf16; y float32 or bf16.
 *
 * Rows of q are dequantized row-major, so the 16 lanes of a vector are 16 activation rows (x is
 * first regrouped so that a vector holds the (k, k + 1) pairs of 16 rows) and each weight pair is
 * broadcast; a 16 x 16 tile of y is transposed on the way out. */
AVX512_BF16 void paphos_int8_group_mm(const int8_t *q, const float *scales, int64_t group,
                                      const uint16_t *x, void *y, int32_t y_is_bf16,
                                      int64_t M, int64_t N, int64_t K) {
    const int64_t pairs = K / 2, groups = K / group;
    const int64_t m_blocks = (M + 15) / 16, n_blocks = (N + 15) / 16;
    uint32_t *x_pairs = buffer((size_t)m_blocks * pairs * 16 * 4);
    for (int64_t mb = 0; mb < m_blocks; mb++)
        for (int64_t kp = 0; kp < pairs; kp++)
            for (int64_t i = 0; i < 16; i++) {
                const int64_t m = mb * 16 + i;
                uint32_t pair = 0;
                if (m < M) memcpy(&pair, x + m * K + 2 * kp, 4);
                x_pairs[(mb * pairs + kp) * 16 + i] = pair;
            }
#pragma omp parallel
    {
        uint16_t *w = buffer((size_t)16 * K * 2);
        float tile[16][16] __attribute__((aligned(64)));
        const __m512i tile_columns = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < n_blocks; nb++) {
            const int64_t n0 = nb * 16, rows = N - n0 < 16 ? N - n0 : 16;
            for (int64_t j = 0; j < rows; j++) {
                const int8_t *qr = q + (n0 + j) * K;
                const float *sr = scales + (n0 + j) * groups;
                uint16_t *wr = w + j * K;
                for (int64_t k = 0; k < K; k += 32, sr += 32 / group) {
                    const __m256i codes = _mm256_loadu_si256((const __m256i *)(qr + k));
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
                    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
                    const __m512 s_lo = _mm512_set1_ps(sr[0]), s_hi = _mm512_set1_ps(sr[group == 16]);
                    const __m512bh values = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo));
                    _mm512_storeu_si512((void *)(wr + k), (__m512i)values);
                }
            }
            if (rows < 16) memset(w + rows * K, 0, (size_t)(16 - rows) * K * 2);
            for (int64_t mb = 0; mb < m_blocks; mb++) {
                __m512 acc[16];
                for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
                const uint32_t *xp = x_pairs + mb * pairs * 16;
                for (int64_t kp = 0; kp < pairs; kp++) {
                    const __m512bh xv = (__m512bh)_mm512_load_si512((const void *)(xp + kp * 16));
#pragma GCC unroll 16
                    for (int j = 0; j < 16; j++) {
                        int32_t pair;
                        memcpy(&pair, w + j * K + 2 * kp, 4);
                        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(pair), xv);
                    }
                }
                for (int j = 0; j < 16; j++) _mm512_store_ps(tile[j], acc[j]);
                const int64_t m0 = mb * 16, m_rows = M - m0 < 16 ? M - m0 : 16;
                const __mmask16 columns = (__mmask16)((1u << rows) - 1);
                for (int64_t i = 0; i < m_rows; i++) {
                    /* Row i of y's block is column i of the tile. */
                    const __m512 row = _mm512_i32gather_ps(_mm512_add_epi32(tile_columns, _mm512_set1_epi32((int)i)),
                                                           &tile[0][0], 4);
                    if (y_is_bf16)
                        _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + i) * N + n0, columns,
                                                 (__m256i)_mm512_cvtneps_pbh(row));
                    else
                        _mm512_mask_storeu_ps((float *)y + (m0 + i) * N + n0, columns, row);
                }
            }
        }
        free(w);
    }
    free(x_pairs);
}

/* One block of up to 16 activation rows against a block of 16 int4 weight rows: per group, the
 * exact sums of x * (q - 8) (bf16 products, fp32 sums, 16 independent accumulators to cover the
 * latency of `vdpbf16ps`), then * scale + sum(x) * zero into the totals, kept in L1. */
AVX512_BF16 static inline __attribute__((always_inline)) void int4_rows(
    const __m512i *codes, const __m512 *scale, const __m512 *zero, const uint16_t *x, const float *x_sums,
    uint16_t *y, int64_t rows, int64_t groups, int64_t group_pairs, int64_t N, int64_t K) {
    __m512 acc[16] __attribute__((aligned(64))), part[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        for (int i = 0; i < 16; i++) part[i] = _mm512_setzero_ps();
        for (int64_t kp = g * group_pairs; kp < (g + 1) * group_pairs; kp++) {
            const __m512bh wv = (__m512bh)codes[kp];
            for (int64_t i = 0; i < rows; i++) {
                int32_t pair;
                memcpy(&pair, x + i * K + 2 * kp, 4);
                part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)_mm512_set1_epi32(pair), wv);
            }
        }
        for (int64_t i = 0; i < rows; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[i * groups + g]), zero[g],
                                     _mm512_fmadd_ps(part[i], scale[g], acc[i]));
    }
    for (int64_t i = 0; i < rows; i++)
        _mm256_storeu_si256((__m256i *)(y + i * N), (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

/* y[M, N] (bf16) = x[M, K] (bf16) @ w[N, K]^T for torch's CPU int4pack layout: N a multiple of 64,
 * byte [n / 64, k, i] holds row n = 64 t + i in its low nibble and row 64 t + i + 32 in its high
 * one (i < 32); scale_zero bf16 [K / group, N, 2]; w[n, k] = (q - 8) * scale + zero.
 *
 * A block of 16 rows at the pair (k, k + 1) is 16 bytes of two consecutive k, interleaved, so
 * here the 16 lanes of a vector are 16 weight rows and each activation pair is broadcast. The
 * codes become bf16 (q - 8), exact, by one table lookup; scales and zero points apply per group
 * to the fp32 sums, so no product is rounded to bf16 before it is summed. */
AVX512_BF16 void paphos_int4pack_mm(const uint8_t *packed, const uint16_t *scale_zero, int64_t group,
                                    const uint16_t *x, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    const int64_t pairs = K / 2, groups = K / group, n_blocks = N / 16;
    float *x_sums = buffer((size_t)M * groups * 4);
    uint16_t minus_eight[32];
    for (int i = 0; i < 32; i++) minus_eight[i] = bf16_round((float)(i % 16) - 8.0f);
    const __m512i table = _mm512_loadu_si512((const void *)minus_eight);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < groups; g++) {
                float sum = 0.0f;
                for (int64_t k = g * group; k < (g + 1) * group; k++) {
                    const uint32_t bits = (uint32_t)x[m * K + k] << 16;
                    float value;
                    memcpy(&value, &bits, 4);
                    sum += value;
                }
                x_sums[m * groups + g] = sum;
            }
        __m512i *codes = buffer((size_t)pairs * 64);
        __m512 *scale = buffer((size_t)groups * 64), *zero = buffer((size_t)groups * 64);
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < n_blocks; nb++) {
            const int64_t n0 = nb * 16, sub = nb % 4;
            const uint8_t *tile = packed + (nb / 4) * K * 32 + (sub % 2) * 16;
            for (int64_t g = 0; g < groups; g++) {
                /* 16 rows' (scale, zero) bf16 pairs: one 32-bit lane per row. */
                const __m512i sz = _mm512_loadu_si512((const void *)(scale_zero + (g * N + n0) * 2));
                scale[g] = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
                zero[g] = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32((int)0xffff0000u)));
            }
            for (int64_t kp = 0; kp < pairs; kp++) {
                const __m128i a = _mm_loadu_si128((const __m128i *)(tile + 2 * kp * 32));
                const __m128i b = _mm_loadu_si128((const __m128i *)(tile + (2 * kp + 1) * 32));
                __m512i words = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
                if (sub >= 2) words = _mm512_srli_epi16(words, 4);
                codes[kp] = _mm512_permutexvar_epi16(words, table); /* low 5 bits index it: both halves alike */
            }
            /* Rows in blocks of 16, the rest in 8, 4, 2, 1: each a constant the compiler unrolls. */
            int64_t m0 = 0;
            for (int64_t block = 16; block >= 1; block /= 2)
                for (; m0 + block <= M; m0 += block) {
                    const uint16_t *xb = x + m0 * K;
                    const float *sb = x_sums + m0 * groups;
                    uint16_t *yb = y + m0 * N + n0;
                    switch (block) {
                    case 16: int4_rows(codes, scale, zero, xb, sb, yb, 16, groups, group / 2, N, K); break;
                    case 8: int4_rows(codes, scale, zero, xb, sb, yb, 8, groups, group / 2, N, K); break;
                    case 4: int4_rows(codes, scale, zero, xb, sb, yb, 4, groups, group / 2, N, K); break;
                    case 2: int4_rows(codes, scale, zero, xb, sb, yb, 2, groups, group / 2, N, K); break;
                    default: int4_rows(codes, scale, zero, xb, sb, yb, 1, groups, group / 2, N, K);
                    }
                }
        }
        free(codes);
        free(scale);
        free(zero);
    }
    free(x_sums);
}

/* exp in fp32 for x <= ~88: Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 Taylor
 * polynomial (relative error ~1e-7), scaled by 2^n. Inputs below -87 (and -inf) give ~0. */
AVX512_BF16 static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Causal self-attention of whole prompts: sequence s is rows starts[s] .. starts[s] + lens[s] - 1
 * of q [T, Hq, D], k and v [T, Hkv, D] (bf16, heads contiguous, rows `*_row` elements apart) and
 * attends to its own rows only; out [T, Hq, D] bf16 likewise. Query head h reads KV head
 * h / (Hq / Hkv). D even, at most 256.
 *
 * A task is 16 query rows of one head: the 16 lanes of a vector are those rows, each key's pair
 * (d, d + 1) is broadcast, so q.k sums exact bf16 products in fp32 (`vdpbf16ps`); the scores are
 * scaled, masked and softmaxed online in fp32 and the values summed in fp32 (flash attention's
 * recurrence, as in SDPA's CPU kernel). */
AVX512_BF16 void paphos_prefill_attention(const uint16_t *q, int64_t q_row, const uint16_t *k, int64_t k_row,
                                          const uint16_t *v, int64_t v_row, uint16_t *out, int64_t out_row,
                                          const int64_t *starts, const int64_t *lens, int64_t S, int64_t Hq,
                                          int64_t Hkv, int64_t D, float scale) {
    int64_t *first_task = malloc((size_t)(S + 1) * 8);
    first_task[0] = 0;
    for (int64_t s = 0; s < S; s++) first_task[s + 1] = first_task[s] + Hq * ((lens[s] + 15) / 16);
    const int64_t tasks = first_task[S], group = Hq / Hkv, pairs = D / 2;
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), scales = _mm512_set1_ps(scale);
#pragma omp parallel
    {
        uint32_t *q_pairs = buffer((size_t)pairs * 64);
        float *o = buffer((size_t)D * 64);
        float *values = buffer((size_t)16 * D * 4);
#pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t s = 0;
            while (t >= first_task[s + 1]) s++;
            const int64_t blocks = (lens[s] + 15) / 16, h = (t - first_task[s]) / blocks;
            const int64_t qb = (t - first_task[s]) % blocks, hk = h / group, i0 = qb * 16, base = starts[s];
            const int64_t rows = lens[s] - i0 < 16 ? lens[s] - i0 : 16;
            for (int64_t dp = 0; dp < pairs; dp++)
                for (int64_t r = 0; r < 16; r++) {
                    uint32_t pair = 0;
                    if (r < rows) memcpy(&pair, q + (base + i0 + r) * q_row + h * D + 2 * dp, 4);
                    q_pairs[dp * 16 + r] = pair;
                }
            memset(o, 0, (size_t)D * 64);
            __m512 row_max = neg_inf, row_sum = _mm512_setzero_ps();
            for (int64_t kb = 0; kb <= qb; kb++) {
                const int64_t j0 = kb * 16, cols = kb == qb ? rows : 16;
                const uint16_t *keys = k + (base + j0) * k_row + hk * D;
                __m512 score[16];
                for (int c = 0; c < 16; c++) score[c] = _mm512_setzero_ps();
                if (cols == 16) {
                    for (int64_t dp = 0; dp < pairs; dp++) {
                        const __m512bh qv = (__m512bh)_mm512_load_si512((const void *)(q_pairs + dp * 16));
#pragma GCC unroll 16
                        for (int c = 0; c < 16; c++) {
                            int32_t pair;
                            memcpy(&pair, keys + c * k_row + 2 * dp, 4);
                            score[c] = _mm512_dpbf16_ps(score[c], (__m512bh)_mm512_set1_epi32(pair), qv);
                        }
                    }
                } else {
                    for (int64_t dp = 0; dp < pairs; dp++) {
                        const __m512bh qv = (__m512bh)_mm512_load_si512((const void *)(q_pairs + dp * 16));
                        for (int64_t c = 0; c < cols; c++) {
                            int32_t pair;
                            memcpy(&pair, keys + c * k_row + 2 * dp, 4);
                            score[c] = _mm512_dpbf16_ps(score[c], (__m512bh)_mm512_set1_epi32(pair), qv);
                        }
                    }
                }
                __m512 block_max = row_max;
                for (int64_t c = 0; c < cols; c++) {
                    score[c] = _mm512_mul_ps(score[c], scales);
                    if (kb == qb) /* key c is in the future of rows r < c */
                        score[c] = _mm512_mask_mov_ps(score[c], (__mmask16)((1u << c) - 1), neg_inf);
                    block_max = _mm512_max_ps(block_max, score[c]);
                }
                const __m512 correction = exp_ps(_mm512_sub_ps(row_max, block_max));
                row_max = block_max;
                row_sum = _mm512_mul_ps(row_sum, correction);
                for (int64_t c = 0; c < cols; c++) {
                    score[c] = exp_ps(_mm512_sub_ps(score[c], row_max));
                    row_sum = _mm512_add_ps(row_sum, score[c]);
                }
                const uint16_t *vals = v + (base + j0) * v_row + hk * D;
                for (int64_t c = 0; c < cols; c++)
                    for (int64_t d = 0; d < D; d++) {
                        const uint32_t bits = (uint32_t)vals[c * v_row + d] << 16;
                        memcpy(values + c * D + d, &bits, 4);
                    }
                for (int64_t d = 0; d < D; d++) {
                    __m512 acc = _mm512_mul_ps(_mm512_load_ps(o + d * 16), correction);
                    for (int64_t c = 0; c < cols; c++)
                        acc = _mm512_fmadd_ps(score[c], _mm512_set1_ps(values[c * D + d]), acc);
                    _mm512_store_ps(o + d * 16, acc);
                }
            }
            const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), row_sum);
            for (int64_t d = 0; d < D; d++) _mm512_store_ps(o + d * 16, _mm512_mul_ps(_mm512_load_ps(o + d * 16), inverse));
            for (int64_t r = 0; r < rows; r++) {
                uint16_t *orow = out + (base + i0 + r) * out_row + h * D;
                for (int64_t d = 0; d < D; d++) orow[d] = bf16_round(o[d * 16 + r]);
            }
        }
        free(q_pairs);
        free(o);
        free(values);
    }
    free(first_task);
}

/* Lane t of the result is the sum of the 16 lanes of v[t]: a transposing tree of adds (8 + 4 + 2 + 1
 * vector adds, each of two shuffles), lanes in a fixed order that one permutation puts right. */
AVX512_BF16 static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* [v_i's 8 partial sums | v_{i+8}'s] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit chunks of 4 partial sums: tokens i, i + 8, i + 4, i + 12 */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
    for (int i = 0; i < 2; i++) /* per chunk, 2 partial sums of x_i's token and 2 of x_{i+2}'s, interleaved */
        y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[i], x[i + 2]), _mm512_unpackhi_ps(x[i], x[i + 2]));
    /* per chunk, the totals of x_0's, x_2's, x_1's and x_3's tokens */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0), z);
}

/* One query head's scaled scores against up to 16 keys (rows[i] + offset, i < n; the other lanes
 * -inf), qh's D = 32 * chunks values. Inlined with constant chunks and n so that the 16 sums stay
 * in registers. */
AVX512_BF16 static inline __attribute__((always_inline)) __m512 key_scores(const uint16_t *const *rows, int64_t offset,
                                                                        const uint16_t *qh, int64_t chunks, int64_t n,
                                                                        __m512 scale) {
    __m512bh qv[8];
    for (int64_t c = 0; c < chunks; c++) qv[c] = (__m512bh)_mm512_loadu_si512((const void *)(qh + 32 * c));
    __m512 dots[16];
    for (int64_t i = 0; i < 16; i++) {
        __m512 acc = _mm512_setzero_ps();
        if (i < n)
            for (int64_t c = 0; c < chunks; c++)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(rows[i] + offset + 32 * c)), qv[c]);
        dots[i] = acc;
    }
    return _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << n) - 1), sum_lanes16(dots), scale);
}

/* Scores of one query head (qh) against the keys rows[j] + offset, j < len, into dst (16-aligned,
 * padded to a multiple of 16); their max. */
AVX512_BF16 static inline __attribute__((always_inline)) float head_scores(const uint16_t *const *rows, int64_t offset,
                                                                        int64_t len, const uint16_t *qh,
                                                                        int64_t chunks, __m512 scale, float *dst) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t j0 = 0;
    for (; j0 + 16 <= len; j0 += 16) {
        const __m512 s = key_scores(rows + j0, offset, qh, chunks, 16, scale);
        _mm512_store_ps(dst + j0, s);
        top = _mm512_max_ps(top, s);
    }
    if (j0 < len) {
        const __m512 s = key_scores(rows + j0, offset, qh, chunks, len - j0, scale);
        _mm512_store_ps(dst + j0, s);
        top = _mm512_max_ps(top, s);
    }
    return _mm512_reduce_max_ps(top);
}

/* out[g] (bf16, D values, heads D apart) = sum over j < len of probs[g * padded + j] * value row j
 * (rows[j] + offset), for the `group` query heads of a KV head, 32 dimensions a pass: each value
 * load serves every head. Inlined with a constant group so that the sums stay in registers. */
AVX512_BF16 static inline __attribute__((always_inline)) void value_sums(const uint16_t *const *rows, int64_t offset,
                                                                      int64_t len, const float *probs, int64_t padded,
                                                                      int64_t group, int64_t D, uint16_t *out) {
    for (int64_t d = 0; d < D; d += 32) {
        __m512 lo[16], hi[16];
        for (int64_t g = 0; g < group; g++) lo[g] = hi[g] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; j++) {
            const uint16_t *v = rows[j] + offset + d;
            const __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)v));
            const __m512 b = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(v + 16)));
            for (int64_t g = 0; g < group; g++) {
                const __m512 p = _mm512_set1_ps(probs[g * padded + j]);
                lo[g] = _mm512_fmadd_ps(p, a, lo[g]);
                hi[g] = _mm512_fmadd_ps(p, b, hi[g]);
            }
        }
        for (int64_t g = 0; g < group; g++)
            _mm512_storeu_si512((void *)(out + g * D + d), (__m512i)_mm512_cvtne2ps_pbh(hi[g], lo[g]));
    }
}

/* Decode attention over the paged cache: one query row per sequence, attending to the sequence's
 * seq_lens[b] cached tokens. q [B, Hq, D] bf16 (rows q_row elements apart, heads contiguous);
 * cache [blocks, 2, block_size, Hkv, D] bf16 (keys at 0, values at 1); block_tables int32 [B,
 * table_row]; out [B, Hq, D] bf16 (rows out_row apart). D a multiple of 32, at most 256; at most
 * 16 query heads per KV head.
 *
 * A task is one sequence's KV head and its Hq / Hkv query heads. Scores: each key row times the
 * query by `vdpbf16ps` (exact bf16 products, fp32 sums), 16 keys' vectors reduced at once
 * (`sum_lanes16`); then softmax in fp32 and the values summed in fp32, every query head of the
 * group from the same value load. */
AVX512_BF16 void paphos_decode_attention(const uint16_t *q, int64_t q_row, const uint16_t *cache, int64_t block_size,
                                         const int32_t *block_tables, int64_t table_row, const int32_t *seq_lens,
                                         uint16_t *out, int64_t out_row, int64_t B, int64_t Hq, int64_t Hkv,
                                         int64_t D, float scale) {
    const int64_t group = Hq / Hkv, chunks = D / 32, token_stride = Hkv * D, value_offset = block_size * token_stride;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    const int64_t padded = (longest + 15) / 16 * 16;
    const __m512 scales = _mm512_set1_ps(scale);
#pragma omp parallel
    {
        float *probs = buffer((size_t)(group * padded + 1) * 4);
        const uint16_t **rows = buffer((size_t)(padded + 1) * sizeof(*rows));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < B * Hkv; t++) {
            const int64_t b = t / Hkv, hk = t % Hkv, len = seq_lens[b];
            const int32_t *table = block_tables + b * table_row;
            for (int64_t j = 0; j < len; j++)
                rows[j] = cache + ((int64_t)table[j / block_size] * 2 * block_size + j % block_size) * token_stride + hk * D;
            for (int64_t g = 0; g < group; g++) {
                const uint16_t *qh = q + b * q_row + (hk * group + g) * D;
                float *pg = probs + g * padded;
                float top;
                switch (chunks) {
                case 2: top = head_scores(rows, 0, len, qh, 2, scales, pg); break;
                case 4: top = head_scores(rows, 0, len, qh, 4, scales, pg); break;
                default: top = head_scores(rows, 0, len, qh, chunks, scales, pg);
                }
                const __m512 target = _mm512_set1_ps(top);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t j0 = 0; j0 < len; j0 += 16) {
                    const __mmask16 valid = len - j0 >= 16 ? 0xffff : (__mmask16)((1u << (len - j0)) - 1);
                    const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(_mm512_load_ps(pg + j0), target)));
                    _mm512_store_ps(pg + j0, e);
                    sum = _mm512_add_ps(sum, e);
                }
                const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
                for (int64_t j0 = 0; j0 < len; j0 += 16) _mm512_store_ps(pg + j0, _mm512_mul_ps(_mm512_load_ps(pg + j0), inverse));
            }
            uint16_t *o = out + b * out_row + hk * group * D;
            switch (group) {
            case 1: value_sums(rows, value_offset, len, probs, padded, 1, D, o); break;
            case 2: value_sums(rows, value_offset, len, probs, padded, 2, D, o); break;
            case 3: value_sums(rows, value_offset, len, probs, padded, 3, D, o); break;
            case 4: value_sums(rows, value_offset, len, probs, padded, 4, D, o); break;
            case 5: value_sums(rows, value_offset, len, probs, padded, 5, D, o); break;
            case 6: value_sums(rows, value_offset, len, probs, padded, 6, D, o); break;
            case 7: value_sums(rows, value_offset, len, probs, padded, 7, D, o); break;
            case 8: value_sums(rows, value_offset, len, probs, padded, 8, D, o); break;
            default: value_sums(rows, value_offset, len, probs, padded, group, D, o);
            }
        }
        free(probs);
        free(rows);
    }
}

/* 16 values of a bf16 or float32 row as fp32 (lanes outside `lanes`: 0). */
AVX512_BF16 static inline __m512 load_row(const void *x, int32_t is_bf16, int64_t at, __mmask16 lanes) {
    if (!is_bf16) return _mm512_maskz_loadu_ps(lanes, (const float *)x + at);
    const __m256i bits = _mm256_maskz_loadu_epi16(lanes, (const uint16_t *)x + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Per row of x [R, V] (bf16 or float32, rows `row` elements apart): the max, the first index holding it and
 * the logsumexp, in fp32 (torch's amax / argmax / logsumexp of the row in float32). A row with a
 * NaN gets NaN and the first NaN's index, as torch's do. */
AVX512_BF16 void paphos_row_stats(const void *x, int32_t is_bf16, int64_t row, int64_t R, int64_t V, float *max_out,
                                  int64_t *argmax_out, float *lse_out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const char *xr = (const char *)x + r * row * (is_bf16 ? 2 : 4);
        __m512 top = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        int64_t v = 0;
        for (; v + 16 <= V; v += 16) {
            const __m512 values = load_row(xr, is_bf16, v, 0xffff);
            nan |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
            top = _mm512_max_ps(top, values);
        }
        const __mmask16 tail = (__mmask16)((1u << (V - v)) - 1);
        if (tail) {
            const __m512 values = load_row(xr, is_bf16, v, tail);
            nan |= _mm512_mask_cmp_ps_mask(tail, values, values, _CMP_UNORD_Q);
            top = _mm512_mask_max_ps(top, tail, top, values);
        }
        const float best = _mm512_reduce_max_ps(top);
        const __m512 target = _mm512_set1_ps(best);
        int64_t first = 0;
        for (v = 0; v < V; v += 16) {
            const __mmask16 lanes = V - v >= 16 ? 0xffff : (__mmask16)((1u << (V - v)) - 1);
            const __m512 values = load_row(xr, is_bf16, v, lanes);
            const __mmask16 hits = nan ? _mm512_mask_cmp_ps_mask(lanes, values, values, _CMP_UNORD_Q)
                                       : _mm512_mask_cmp_ps_mask(lanes, values, target, _CMP_EQ_OQ);
            if (hits) {
                first = v + __builtin_ctz(hits);
                break;
            }
        }
        argmax_out[r] = first;
        if (nan) {
            max_out[r] = lse_out[r] = NAN;
            continue;
        }
        max_out[r] = best;
        if (best == -INFINITY || best == INFINITY) {
            lse_out[r] = best;
            continue;
        }
        __m512 sum = _mm512_setzero_ps();
        for (v = 0; v < V; v += 16) {
            const __mmask16 lanes = V - v >= 16 ? 0xffff : (__mmask16)((1u << (V - v)) - 1);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(lanes, exp_ps(_mm512_sub_ps(load_row(xr, is_bf16, v, lanes), target))));
        }
        lse_out[r] = best + logf(_mm512_reduce_add_ps(sum));
    }
}
