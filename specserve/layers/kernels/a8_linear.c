/* y = x W^T for 4- or 8-bit weights and activations quantized to 8 bits on the fly, by integer dot products
   (AVX512-VNNI's vpdpbusd: 64 products of an unsigned and a signed byte an instruction), as llama.cpp computes
   its Q4_1 x Q8_1 and Q8_0 x Q8_0 products.

   Why: torch's CPU int4 and int8 kernels compute each row's product on its own (int4 widening every weight to
   fp32 first), so a verify step of 6 rows cost ~2.3x a decode step (benchmarks/NOTES.md), and speculation
   could not pay. Here a weight is read (and unpacked) once for all the rows of a step, and a row costs one
   vpdpbusd per 64 products.

   Activations: each row's groups of 32 as a = round(x / d) in [-127, 127] with d = max|x| / 127 (Q8_0).
   4-bit weights: groups of 32 inputs per output, w = q * scale + min with q in [0, 15] (GGUF's Q4_1), and
     y = sum over groups g, in order, of d[g] scale[g] dot(q, a) + min[g] (d[g] sum(a)).
   8-bit weights: w = q * scale with q in [-127, 127] (Q8_0); vpdpbusd takes the activations as the unsigned
     side, a + 128, so each group's sum starts at -128 sum(q) (exact, in int32), and
     y = sum over groups g, in order, of d[g] scale[g] dot(q, a).
   fp32, the same operations whatever the number of rows beside it or of threads, so a verify row is the row
   plain decoding computes.

   Packed layouts, in tiles of 16 outputs (row n = 16 t + l, l < 16; the last tile padded with zero rows), 64 bytes
   a step:
   4-bit: tile t, inputs 8 b .. 8 b + 7: byte 4 l + j holds q[n, 8 b + j] in its low nibble and q[n, 8 b + 4 + j]
     in its high one (j < 4): one load and two masks give vpdpbusd two 4-input steps of 16 outputs.
   8-bit: tile t, inputs 4 b .. 4 b + 3: byte 4 l + j holds q[n, 4 b + j].
   Scales: bf16 [N / 16, K / 32, 16]; aux, the same shape: the mins (bf16) for 4 bits, each group's sum(q)
   (int16) for 8. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 8                  /* rows whose accumulators stay in registers while a tile's weights stream by */
#define PREFETCH 1024           /* bytes ahead in the weights (a quarter of that in the scales): measured 10-20%
                                   faster than the hardware's prefetch alone over a model's weights, 1 and 6 rows */
#define PREFETCH_L2 8192        /* and further ahead into L2: 30 layers of SmolLM2's linears at one thread, int4 0.88x
                                   the time at one row, 0.87x at three, int8 0.85x / 0.87x; compute-bound from six
                                   rows, unchanged there (benchmarks/NOTES.md, session 42) */

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

/* Row m's groups: a [K] (int8, or a + 128 as uint8 where `unsigned_a`), d[g] its scales, c[g] = d[g] sum(a) */
static void quantize_row(const void *x, int bf16, int K, int unsigned_a, int8_t *a, float *d, float *c) {
    const __m128i flip = _mm_set1_epi8((char)0x80);
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
        __m128i b0 = _mm512_cvtsepi32_epi8(q0), b1 = _mm512_cvtsepi32_epi8(q1);
        if (unsigned_a) {
            b0 = _mm_xor_si128(b0, flip);
            b1 = _mm_xor_si128(b1, flip);
        }
        _mm_storeu_si128((__m128i *)(a + 32 * g), b0);
        _mm_storeu_si128((__m128i *)(a + 32 * g + 16), b1);
        d[g] = scale;
        c[g] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

static inline __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Tile t (16 outputs) for rows [m0, m0 + rows), 4-bit weights -> acc_out [rows][16] */
static inline __attribute__((always_inline)) void tile4(
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
        for (int b = 0; b < 4; b++) {               /* 4 steps of 8 inputs: 64 bytes each */
            const char *at = (const char *)(w + 64 * (4 * g + b));
            _mm_prefetch(at + PREFETCH, _MM_HINT_T0);
            _mm_prefetch(at + PREFETCH_L2, _MM_HINT_T1);
            __m512i v = _mm512_loadu_si512(at);
            __m512i q0 = _mm512_and_si512(v, low), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *ar = a + (long)(m0 + r) * K + 32 * g + 8 * b;
                dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], q0, broadcast4(ar));
                dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], q1, broadcast4(ar + 4));
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

/* The same for 8-bit weights (a holds a + 128, sums [N / 16, K / 32, 16] each group's sum(q)) */
static inline __attribute__((always_inline)) void tile8(
        const int8_t *a, const float *d, const int8_t *packed, const uint16_t *scales,
        const int16_t *sums, float *acc_out, int m0, const int rows, int t, int K) {
    const int G = K / 32;
    const int8_t *w = packed + (long)t * 16 * K;
    const uint16_t *s = scales + (long)t * G * 16;
    const int16_t *q = sums + (long)t * G * 16;
    __m512 acc[ROWS];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 16 * g))), 7));     /* -128 sum(q) */
        __m512i dot[ROWS][2];
        for (int r = 0; r < rows; r++) {
            dot[r][0] = start;
            dot[r][1] = _mm512_setzero_si512();
        }
        for (int b = 0; b < 8; b++) {               /* 8 steps of 4 inputs: 64 bytes each */
            const char *at = (const char *)(w + 64 * (8 * g + b));
            _mm_prefetch(at + PREFETCH, _MM_HINT_T0);
            _mm_prefetch(at + PREFETCH_L2, _MM_HINT_T1);
            __m512i v = _mm512_loadu_si512(at);
            for (int r = 0; r < rows; r++)
                dot[r][b & 1] = _mm512_dpbusd_epi32(dot[r][b & 1], broadcast4(a + (long)(m0 + r) * K + 32 * g + 4 * b), v);
        }
        _mm_prefetch((const char *)(s + 16 * g) + PREFETCH / 4, _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 16 * g) + PREFETCH / 4, _MM_HINT_T0);
        __m512 sg = load_bf16x16(s + 16 * g);
        for (int r = 0; r < rows; r++) {
            __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][0], dot[r][1]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(p, _mm512_set1_ps(d[(long)(m0 + r) * G + g])), sg, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(acc_out + 16 * r, acc[r]);
}

static void tile_any(int bits, const int8_t *a, const float *d, const float *c, const void *packed,
                     const uint16_t *scales, const void *aux, float *acc_out, int m0, int rows, int t, int K) {
#define CASE(r) case r: { if (bits == 4) tile4(a, d, c, packed, scales, aux, acc_out, m0, r, t, K); \
                          else tile8(a, d, packed, scales, aux, acc_out, m0, r, t, K); } return;
    switch (rows) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

/* x [M, K] (bf16 if x_bf16 else fp32, rows contiguous) -> y [M, N] in the same dtype, plus bias (fp32 [N] or
   NULL), for `bits` 4 or 8 in the layouts above, whose last tile is padded to 16 outputs. K a multiple of 32;
   returns -1 otherwise, or where memory runs out. */
int a8_linear(int bits, const void *x, int x_bf16, const void *packed, const uint16_t *scales, const void *aux,
              const float *bias, void *y, int M, int K, int N, int num_threads) {
    if (K % 32 != 0 || N <= 0 || M <= 0 || (bits != 4 && bits != 8))
        return -1;
    const int G = K / 32, esize = x_bf16 ? 2 : 4;
    int8_t *a = malloc((size_t)M * K + 2 * sizeof(float) * (size_t)M * G + 4);
    if (a == NULL)
        return -1;
    float *d = (float *)(a + (size_t)M * K + (-(size_t)M * K & 3)), *c = d + (size_t)M * G;
    for (int m = 0; m < M; m++)
        quantize_row((const char *)x + (size_t)m * K * esize, x_bf16, K, bits == 8, a + (size_t)m * K,
                     d + (size_t)m * G, c + (size_t)m * G);
    const int tiles = (N + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < tiles; t++) {
        float out[ROWS * 16];
        const int width = N - 16 * t < 16 ? N - 16 * t : 16;            /* the last tile's real outputs */
        const __mmask16 live = (__mmask16)((1u << width) - 1);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(live, bias + 16 * t) : _mm512_setzero_ps();
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = M - m0 < ROWS ? M - m0 : ROWS;
            tile_any(bits, a, d, c, packed, scales, aux, out, m0, rows, t, K);
            for (int r = 0; r < rows; r++) {
                __m512 v = _mm512_add_ps(_mm512_loadu_ps(out + 16 * r), bv);
                if (x_bf16) {
                    uint16_t *yr = (uint16_t *)y + (size_t)(m0 + r) * N + 16 * t;
                    float f[16];
                    _mm512_storeu_ps(f, v);
                    for (int i = 0; i < width; i++)
                        yr[i] = to_bf16(f[i]);
                } else {
                    _mm512_mask_storeu_ps((float *)y + (size_t)(m0 + r) * N + 16 * t, live, v);
                }
            }
        }
    }
    free(a);
    return 0;
}
