/* y = x W^T for 4-bit weights and activations quantized to 8 bits on the fly, by integer dot products
   (AVX512-VNNI's vpdpbusd: 64 products of an unsigned and a signed byte an instruction), as llama.cpp computes
   its Q4_1 x Q8_1 products.

   Why: torch's CPU int4 kernel widens every weight to fp32 and computes each row's product on its own, so a
   verify step of 6 rows costs ~2.3x a decode step (benchmarks/NOTES.md), and speculation cannot pay. Here a
   weight is read and unpacked once for all the rows of a step, and a row costs one vpdpbusd per 64 products.

   Weights: groups of 32 inputs per output, w = q * scale + min with q in [0, 15] (GGUF's Q4_1). Activations:
   each row's groups of 32 as a = round(x / d) in [-127, 127] with d = max|x| / 127 (Q8_0). Per row m and output
   n, y = sum over groups g, in order, of d[m,g] * scale[n,g] * dot(q, a) + min[n,g] * (d[m,g] * sum(a)): fp32,
   the same operations whatever the number of rows beside it or of threads, so a verify row is the row plain
   decoding computes.

   Packed layout, in tiles of 16 outputs: tile t, input block b of 8 holds 64 bytes; byte 4 l + j holds
   q[16 t + l, 8 b + j] in its low nibble and q[16 t + l, 8 b + 4 + j] in its high one (l < 16, j < 4): one
   load and two masks give vpdpbusd's operands for two 4-input steps of 16 outputs. Scales and mins: bf16
   [N / 16, K / 32, 16]. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 8                  /* rows whose accumulators stay in registers while a tile's weights stream by */
#define PREFETCH 1024           /* bytes ahead in the nibbles (a quarter of that in the scales): measured 10-20%
                                   faster than the hardware's prefetch alone over a model's weights, 1 and 6 rows */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float x) {                     /* round to nearest even (no NaNs here) */
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Row m's groups: a int8 [K], d[g] its scales and c[g] = d[g] * sum(a over g) */
static void quantize_row(const void *x, int bf16, int K, int8_t *a, float *d, float *c) {
    for (int g = 0; g < K / 32; g++) {
        __m512 v0, v1;
        if (bf16) {
            const uint16_t *p = (const uint16_t *)x + 32 * g;
            v0 = load_bf16x16(p);
            v1 = load_bf16x16(p + 16);
        } else {
            const float *p = (const float *)x + 32 * g;
            v0 = _mm512_loadu_ps(p);
            v1 = _mm512_loadu_ps(p + 16);
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));     /* nearest even */
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(a + 32 * g), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(a + 32 * g + 16), _mm512_cvtsepi32_epi8(q1));
        d[g] = scale;
        c[g] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* Tile t (16 outputs) for rows [m0, m0 + rows) */
static inline __attribute__((always_inline)) void tile(
        const int8_t *a, const float *d, const float *c, const uint8_t *packed, const uint16_t *scales,
        const uint16_t *mins, float *acc_out, int m0, const int rows, int t, int K) {
    const int G = K / 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const uint8_t *w = packed + (long)t * 16 * K / 2;
    const uint16_t *s = scales + (long)t * G * 16, *z = mins + (long)t * G * 16;
    __m512 acc[ROWS];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i dot[ROWS][2];
        for (int r = 0; r < rows; r++)
            dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        for (int b = 0; b < 4; b++) {               /* 4 blocks of 8 inputs: 64 bytes each */
            _mm_prefetch((const char *)(w + 64 * (4 * g + b)) + PREFETCH, _MM_HINT_T0);
            __m512i v = _mm512_loadu_si512(w + 64 * (4 * g + b));
            __m512i q0 = _mm512_and_si512(v, low), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *ar = a + (long)(m0 + r) * K + 32 * g + 8 * b;
                int32_t a0, a1;
                memcpy(&a0, ar, 4);
                memcpy(&a1, ar + 4, 4);
                dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], q0, _mm512_set1_epi32(a0));
                dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], q1, _mm512_set1_epi32(a1));
            }
        }
        _mm_prefetch((const char *)(s + 16 * g) + PREFETCH / 4, _MM_HINT_T0);
        _mm_prefetch((const char *)(z + 16 * g) + PREFETCH / 4, _MM_HINT_T0);
        __m512 sg = load_bf16x16(s + 16 * g), zg = load_bf16x16(z + 16 * g);
        for (int r = 0; r < rows; r++) {
            const long i = (long)(m0 + r) * G + g;
            __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][0], dot[r][1]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(p, _mm512_set1_ps(d[i])), sg, acc[r]);
            acc[r] = _mm512_fmadd_ps(zg, _mm512_set1_ps(c[i]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(acc_out + 16 * r, acc[r]);
}

static void tile_any(const int8_t *a, const float *d, const float *c, const uint8_t *packed, const uint16_t *scales,
                     const uint16_t *mins, float *acc_out, int m0, int rows, int t, int K) {
#define CASE(r) case r: tile(a, d, c, packed, scales, mins, acc_out, m0, r, t, K); return;
    switch (rows) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

/* x [M, K] (bf16 if x_bf16 else fp32, rows contiguous) -> y [M, N] in the same dtype, plus bias (fp32 [N] or
   NULL). N a multiple of 16, K of 32; returns -1 otherwise, or where memory runs out. */
int w4a8_linear(const void *x, int x_bf16, const uint8_t *packed, const uint16_t *scales, const uint16_t *mins,
                const float *bias, void *y, int M, int K, int N, int num_threads) {
    if (K % 32 != 0 || N % 16 != 0 || M <= 0)
        return -1;
    const int G = K / 32, esize = x_bf16 ? 2 : 4;
    int8_t *a = malloc((size_t)M * K + 2 * sizeof(float) * (size_t)M * G);
    if (a == NULL)
        return -1;
    float *d = (float *)(a + (size_t)M * K + (-(size_t)M * K & 3)), *c = d + (size_t)M * G;
    for (int m = 0; m < M; m++)
        quantize_row((const char *)x + (size_t)m * K * esize, x_bf16, K, a + (size_t)m * K, d + (size_t)m * G,
                     c + (size_t)m * G);
    const int tiles = N / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < tiles; t++) {
        float out[ROWS * 16];
        __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * t) : _mm512_setzero_ps();
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = M - m0 < ROWS ? M - m0 : ROWS;
            tile_any(a, d, c, packed, scales, mins, out, m0, rows, t, K);
            for (int r = 0; r < rows; r++) {
                __m512 v = _mm512_add_ps(_mm512_loadu_ps(out + 16 * r), bv);
                if (x_bf16) {
                    uint16_t *yr = (uint16_t *)y + (size_t)(m0 + r) * N + 16 * t;
                    float f[16];
                    _mm512_storeu_ps(f, v);
                    for (int i = 0; i < 16; i++)
                        yr[i] = to_bf16(f[i]);
                } else {
                    _mm512_storeu_ps((float *)y + (size_t)(m0 + r) * N + 16 * t, v);
                }
            }
        }
    }
    free(a);
    return 0;
}
