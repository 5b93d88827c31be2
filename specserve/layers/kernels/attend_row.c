/* One query row's attention over a bf16 (or int8) K/V cache on an AVX-512 CPU, in one pass over the slots.

   attend_row: q [Hkv, G, D] bf16 (the G query heads sharing each K/V head), K/V [Hkv, T, D] bf16 with
   contiguous rows (any head and row strides: the head-major cache read in place) -> out [Hkv, G, D] bf16.
   With `slots`, row t of K/V is row slots[t] of the whole cache: a paged context read in place, no gather.

   Why: torch's CPU attention for one row over a long bf16 context runs at a third of the memory bandwidth
   (scores as a [T, D] x [D, G] product leave 13 of 16 lanes idle at G = 3, softmax and the V product are
   two more passes over memory). Here the slots are cut into chunks of CHUNK; each chunk computes its scores
   (16 slots at a time, reduced across lanes by one transpose), its own max, exp and sum, and its part of
   probabilities x V (flash-decoding's partials); the partials are then combined in chunk order. The bits
   depend only on the inputs, not on the number of threads: a verify row and a decode row over the same slots
   get the same output, which greedy exactness relies on.

   Products in fp32 from bf16 inputs (vdpbf16ps where the CPU has AVX512-BF16, else the same pairs widened),
   softmax and accumulation in fp32, the output rounded to bf16 (nearest even).

   An int8 cache (`--kv-cache-dtype int8`): each slot's K and V of a head are D int8 values and one fp32 scale
   (layers/attention.py, quantize_kv). A chunk's 16 key rows are widened to bf16 (exact: |values| <= 127) and
   take the same products, each score then times its key's scale; each probability is multiplied by its value's
   scale before the V product. Half the bytes of a bf16 context are read. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 256

static inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                           _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
#endif
}

/* r[j] = the sum of the 16 lanes of a[j]: three rounds of pairwise unpack-and-add, then a 128-bit transpose */
static inline __m512 sum_lanes16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, 0x88), _mm512_shuffle_f32x4(f01, f23, 0xDD));
}

/* e^x for x <= 0 (Cephes' polynomial on x - n ln 2, then scaled by 2^n), within ~2 ulp */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

static inline __m512 load_bf16x16(const uint16_t *p) {        /* 16 bf16 -> 16 fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 int8 -> 16 fp32 */
static inline __m512 load_i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* a row of D int8 values -> D bf16 (integers of at most 127 are exact in bf16) */
static inline void widen_i8_row(const int8_t *src, uint16_t *dst, int D) {
    for (int d = 0; d < D; d += 16) {
        __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(load_i8x16(src + d)), 16);
        _mm256_storeu_si256((__m256i *)(dst + d), _mm512_cvtepi32_epi16(bits));
    }
}

/* The chunk's softmax pieces per query g: its scores' max m[g], the scores turned into e^(s - m[g]) in place, and
   their sum l[g] */
static inline __attribute__((always_inline)) void softmax_chunk(float *s, int n, const int G, float *m, float *l) {
    for (int g = 0; g < G; g++) {
        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int t0 = 0; t0 < n; t0 += 16) {
            __mmask16 live = n - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
            top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, s + g * CHUNK + t0));
        }
        float mg = _mm512_reduce_max_ps(top);
        top = _mm512_set1_ps(mg);
        for (int t0 = 0; t0 < n; t0 += 16) {
            __mmask16 live = n - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
            __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + g * CHUNK + t0), top)));
            _mm512_mask_storeu_ps(s + g * CHUNK + t0, live, p);
            sum = _mm512_add_ps(sum, p);
        }
        m[g] = mg;
        l[g] = _mm512_reduce_add_ps(sum);
    }
}

/* One chunk of one K/V head: scores of its n slots for the G queries, their max m[g], sum l[g] of e^(s - m)
   and acc[g][D] = sum of e^(s - m) V. s: scratch of G * CHUNK floats. Inlined with G and D constants (below),
   so that the accumulators of the V product stay in registers. */
static inline __attribute__((always_inline)) void attend_chunk(
        const uint16_t *q, const void *k, const void *v, const float *ks, const float *vs, const int64_t *slots,
        long row_stride, int n, const int G, const int D, float scale, float *s, float *m, float *l, float *acc) {
#define ROW(t) ((slots ? slots[t] : (long)(t)) * row_stride)
#define SLOT(t) (slots ? slots[t] : (long)(t))
    const uint16_t *k16 = k, *v16 = v;
    const int8_t *k8 = k, *v8 = v;
    uint16_t widened[ks ? 16 * D : 1];                       /* int8 cache: a block of 16 key rows in bf16 */
    for (int t0 = 0; t0 < n; t0 += 16) {                       /* 16 slots' rows stay in L1 for the G queries */
        __mmask16 live = n - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
        const uint16_t *krow[16];
        float kscale[16];
        for (int j = 0; j < 16; j++) {                         /* past the end: row n - 1 again, masked below */
            int t = t0 + j < n ? t0 + j : n - 1;
            if (ks) {
                widen_i8_row(k8 + ROW(t), widened + j * D, D);
                krow[j] = widened + j * D;
                kscale[j] = ks[SLOT(t)] * scale;
            } else {
                krow[j] = k16 + ROW(t);
            }
        }
        const __m512 factor = ks ? _mm512_loadu_ps(kscale) : _mm512_set1_ps(scale);
        for (int g = 0; g < G; g++) {
            __m512 a[16];
            for (int j = 0; j < 16; j++) {
                a[j] = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 32)
                    a[j] = dot_pairs(a[j], _mm512_loadu_si512(krow[j] + d), _mm512_loadu_si512(q + (long)g * D + d));
            }
            _mm512_mask_storeu_ps(s + g * CHUNK + t0, live, _mm512_mul_ps(sum_lanes16(a), factor));
        }
    }
    softmax_chunk(s, n, G, m, l);
    if (vs) {                                                  /* each probability times its value's scale */
        float vscale[CHUNK];
        for (int t = 0; t < n; t++)
            vscale[t] = vs[SLOT(t)];
        for (int g = 0; g < G; g++)
            for (int t = 0; t < n; t++)
                s[g * CHUNK + t] *= vscale[t];
    }
    if (G * D <= 16 * 16) {          /* every accumulator in a register: G * D / 16 independent FMA chains */
        __m512 r[16], vd[16];
        for (int i = 0; i < G * D / 16; i++)
            r[i] = _mm512_setzero_ps();
        for (int t = 0; t < n; t++) {
            for (int b = 0; b < D / 16; b++)
                vd[b] = vs ? load_i8x16(v8 + ROW(t) + 16 * b) : load_bf16x16(v16 + ROW(t) + 16 * b);
            for (int g = 0; g < G; g++) {
                __m512 p = _mm512_set1_ps(s[g * CHUNK + t]);
                for (int b = 0; b < D / 16; b++)
                    r[g * (D / 16) + b] = _mm512_fmadd_ps(p, vd[b], r[g * (D / 16) + b]);
            }
        }
        for (int i = 0; i < G * D / 16; i++)
            _mm512_storeu_ps(acc + 16 * i, r[i]);
        return;
    }
    for (int d = 0; d < D; d += 16) {                          /* G accumulators of 16 lanes per pass */
        __m512 r[16];
        for (int g = 0; g < G; g++)
            r[g] = _mm512_setzero_ps();
        for (int t = 0; t < n; t++) {
            __m512 vd = vs ? load_i8x16(v8 + ROW(t) + d) : load_bf16x16(v16 + ROW(t) + d);
            for (int g = 0; g < G; g++)
                r[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * CHUNK + t]), vd, r[g]);
        }
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(acc + g * D + d, r[g]);
    }
#undef ROW
#undef SLOT
}

#ifdef __AVX512VNNI__
/* sum_lanes16 over int32 lanes (the same shuffles, integer adds): exact */
static inline __m512i sum_lanes16_epi32(const __m512i a[16]) {
    __m512i b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
    __m512i f01 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x44), _mm512_shuffle_i32x4(c[0], c[1], 0xEE));
    __m512i f23 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], 0x44), _mm512_shuffle_i32x4(c[2], c[3], 0xEE));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(f01, f23, 0x88), _mm512_shuffle_i32x4(f01, f23, 0xDD));
}

/* x [n] -> int16 [n] and the returned scale: max |x| / 32767 (1 for zeros), each round(x / scale) */
static inline float quantize16(const float *x, int16_t *out, int n) {
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __mmask16 live = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(live, x + i)));
    }
    float amax = _mm512_reduce_max_ps(top), scale = amax > 0.0f ? amax / 32767.0f : 1.0f;
    const __m512 by = _mm512_set1_ps(scale);
    for (int i = 0; i < n; i += 16) {
        __mmask16 live = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(live, x + i), by),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_mask_storeu_epi16(out + i, live, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(r)));
    }
    return scale;
}

/* attend_chunk over an int8 cache with integer dot products (AVX512-VNNI's vpdpwssd, 16-bit x 16-bit pairs into
   32-bit sums): each query is quantized to 16 bits per (row, head, query) and each key row widened to 16 bits,
   so a score is one exact integer sum times three scales; for the V product each probability times its value's
   scale is quantized to 16 bits per chunk and query (its error ~1/65,000 of the chunk's largest), and pairs of
   value rows, interleaved, take vpdpwssd against pairs of those weights. A chunk of 256 slots cannot overflow
   (256 x 32767 x 127 < 2^31). */
static inline __attribute__((always_inline)) void attend_chunk_vnni(
        const uint16_t *q, const int8_t *k, const int8_t *v, const float *ks, const float *vs, const int64_t *slots,
        long row_stride, int n, const int G, const int D, float scale, float *s, float *m, float *l, float *acc) {
#define ROW(t) ((slots ? slots[t] : (long)(t)) * row_stride)
#define SLOT(t) (slots ? slots[t] : (long)(t))
    int16_t q16[G * D], keys[16 * D], w16[G * CHUNK];
    float qscale[G], row[D > 16 ? D : 16];
    for (int g = 0; g < G; g++) {
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(row + d, load_bf16x16(q + (long)g * D + d));
        qscale[g] = quantize16(row, q16 + g * D, D) * scale;
    }
    for (int t0 = 0; t0 < n; t0 += 16) {
        __mmask16 live = n - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
        float kscale[16];
        for (int j = 0; j < 16; j++) {                         /* past the end: row n - 1 again, masked below */
            int t = t0 + j < n ? t0 + j : n - 1;
            for (int d = 0; d < D; d += 32)
                _mm512_storeu_si512(keys + j * D + d, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(k + ROW(t) + d))));
            kscale[j] = ks[SLOT(t)];
        }
        const __m512 factor = _mm512_loadu_ps(kscale);
        for (int g = 0; g < G; g++) {
            __m512i a[16];
            for (int j = 0; j < 16; j++) {
                a[j] = _mm512_setzero_si512();
                for (int d = 0; d < D; d += 32)
                    a[j] = _mm512_dpwssd_epi32(a[j], _mm512_loadu_si512(keys + j * D + d), _mm512_loadu_si512(q16 + g * D + d));
            }
            __m512 sums = _mm512_cvtepi32_ps(sum_lanes16_epi32(a));
            _mm512_mask_storeu_ps(s + g * CHUNK + t0, live, _mm512_mul_ps(_mm512_mul_ps(sums, factor), _mm512_set1_ps(qscale[g])));
        }
    }
    softmax_chunk(s, n, G, m, l);
    float vscale[CHUNK], wscale[G];
    for (int t = 0; t < n; t++)
        vscale[t] = vs[SLOT(t)];
    for (int g = 0; g < G; g++) {                               /* the weights of query g */
        for (int t = 0; t < n; t++)
            s[g * CHUNK + t] *= vscale[t];
        wscale[g] = quantize16(s + g * CHUNK, w16 + g * CHUNK, n);
        if (n < CHUNK)
            w16[g * CHUNK + n] = 0;                             /* the pair of an odd last slot */
    }
    for (int d0 = 0; d0 < D; d0 += 32) {                        /* 32 of the D outputs of every query per pass */
        __m512i r[2 * G];
        for (int i = 0; i < 2 * G; i++)
            r[i] = _mm512_setzero_si512();
        for (int t = 0; t < n; t += 2) {                        /* slots t and t + 1 (an odd last one: weight 0) */
            const int8_t *r0 = v + ROW(t), *r1 = v + ROW(t + 1 < n ? t + 1 : t);
            __m512i x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r0 + d0)));
            __m512i x1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r1 + d0)));
            __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
            for (int g = 0; g < G; g++) {
                int32_t both;                                   /* weights t and t + 1, adjacent */
                memcpy(&both, w16 + g * CHUNK + t, 4);
                __m512i pair = _mm512_set1_epi32(both);
                r[2 * g] = _mm512_dpwssd_epi32(r[2 * g], lo, pair);
                r[2 * g + 1] = _mm512_dpwssd_epi32(r[2 * g + 1], hi, pair);
            }
        }
        for (int g = 0; g < G; g++) {                          /* lane 4L + i of lo is output 8L + i, of hi 8L + 4 + i */
            int32_t lo[16], hi[16];
            _mm512_storeu_si512(lo, r[2 * g]);
            _mm512_storeu_si512(hi, r[2 * g + 1]);
            for (int L = 0; L < 4; L++)
                for (int i = 0; i < 4; i++) {
                    acc[g * D + d0 + 8 * L + i] = (float)lo[4 * L + i] * wscale[g];
                    acc[g * D + d0 + 8 * L + 4 + i] = (float)hi[4 * L + i] * wscale[g];
                }
        }
    }
#undef ROW
#undef SLOT
}
#endif

static void attend_chunk_any(const uint16_t *q, const void *k, const void *v, const float *ks, const float *vs,
                             const int64_t *slots, long row_stride, int n, int G, int D, float scale, float *s,
                             float *m, float *l, float *acc) {
    /* the head sizes and grouped-query widths of common models, as constants: loops unrolled, registers kept */
#ifdef __AVX512VNNI__
#define CHUNK_OF(g, d) if (ks) attend_chunk_vnni(q, k, v, ks, vs, slots, row_stride, n, g, d, scale, s, m, l, acc); \
                       else attend_chunk(q, k, v, ks, vs, slots, row_stride, n, g, d, scale, s, m, l, acc);
#else
#define CHUNK_OF(g, d) attend_chunk(q, k, v, ks, vs, slots, row_stride, n, g, d, scale, s, m, l, acc);
#endif
#define WIDTH(g, d) case g: CHUNK_OF(g, d) return;
#define WIDTHS(d) switch (G) { WIDTH(1, d) WIDTH(2, d) WIDTH(3, d) WIDTH(4, d) WIDTH(5, d) WIDTH(6, d) \
                                WIDTH(7, d) WIDTH(8, d) }
    if (D == 64)
        WIDTHS(64)
    else if (D == 128)
        WIDTHS(128)
#undef WIDTHS
#undef WIDTH
    CHUNK_OF(G, D)
#undef CHUNK_OF
}

static inline uint16_t to_bf16(float x) {                     /* round to nearest even (no NaNs here) */
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* One row's attention: its query [Hkv, G, D], K/V bases, their scales' bases (int8 cache; else NULL), slots (or
   NULL), T context entries, output */
typedef struct {
    const uint16_t *q;
    const char *k, *v;
    const float *ks, *vs;
    const int64_t *slots;
    int T;
    uint16_t *out;
} Row;

/* Every (row, K/V head, chunk) of a set of rows as one parallel loop, then every (row, head) combined: one fork
   for a whole step's rows, its items balanced over the threads. Each row's chunks and their combination are
   those of the row alone, whatever rows are beside it. Strides in elements of the cache (1 byte for int8, else
   2); scale_head_stride in floats. Returns 0, or -1 where memory runs out. */
static int attend_rows(const Row *rows, int n_rows, long k_head_stride, long v_head_stride, long row_stride,
                       long scale_head_stride, int Hkv, int G, int D, float scale, int num_threads) {
    int *first = malloc(sizeof(int) * (n_rows + 1));
    if (!first)
        return -1;
    first[0] = 0;
    for (int r = 0; r < n_rows; r++)
        first[r + 1] = first[r] + Hkv * ((rows[r].T + CHUNK - 1) / CHUNK);
    const int items = first[n_rows];
    float *m = malloc(sizeof(float) * items * G), *l = malloc(sizeof(float) * items * G);
    float *acc = malloc(sizeof(float) * (size_t)items * G * D);
    if (!m || !l || !acc) {
        free(first), free(m), free(l), free(acc);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        float s[16 * CHUNK];
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            int r = 0;
            while (first[r + 1] <= item)
                r++;
            const Row *row = rows + r;
            const long es = row->ks ? 1 : 2;                         /* bytes a cache element */
            int chunks = (row->T + CHUNK - 1) / CHUNK, local = item - first[r];
            int h = local / chunks, c = local % chunks, t0 = c * CHUNK, n = row->T - t0 < CHUNK ? row->T - t0 : CHUNK;
            long at = row->slots ? 0 : (long)t0;                      /* slots: row t is slots[t], read in place */
            attend_chunk_any(row->q + (long)h * G * D, row->k + es * (h * k_head_stride + at * row_stride),
                             row->v + es * (h * v_head_stride + at * row_stride),
                             row->ks ? row->ks + h * scale_head_stride + at : NULL,
                             row->vs ? row->vs + h * scale_head_stride + at : NULL,
                             row->slots ? row->slots + t0 : NULL, row_stride, n, G, D, scale, s, m + item * G,
                             l + item * G, acc + (long)item * G * D);
        }
#pragma omp for schedule(static)
        for (int rh = 0; rh < n_rows * Hkv; rh++) {
            int r = rh / Hkv, h = rh % Hkv, chunks = (rows[r].T + CHUNK - 1) / CHUNK, base = first[r] + h * chunks;
            for (int g = 0; g < G; g++) {
                float top = -INFINITY, total = 0.0f, o[D];
                for (int c = 0; c < chunks; c++)
                    top = m[(base + c) * G + g] > top ? m[(base + c) * G + g] : top;
                memset(o, 0, sizeof(o));
                for (int c = 0; c < chunks; c++) {
                    int item = base + c;
                    float w = expf(m[item * G + g] - top);
                    total += w * l[item * G + g];
                    const float *a = acc + ((long)item * G + g) * D;
                    for (int d = 0; d < D; d++)
                        o[d] += w * a[d];
                }
                for (int d = 0; d < D; d++)
                    rows[r].out[((long)h * G + g) * D + d] = to_bf16(o[d] / total);
            }
        }
    }
    free(first), free(m), free(l), free(acc);
    return 0;
}

/* One row. k/v: bf16, or int8 with their scales ks/vs ([Hkv] heads of scale_head_stride floats, one a slot;
   NULL for bf16). Returns 0, or -1 for a shape it does not handle (D not a multiple of 32, G above 16): the
   caller falls back. */
int attend_row(const uint16_t *q, const void *k, const void *v, const float *ks, const float *vs,
               const int64_t *slots, long k_head_stride, long v_head_stride, long row_stride, long scale_head_stride,
               int Hkv, int G, int T, int D, float scale, uint16_t *out, int num_threads) {
    if (D % 32 != 0 || G > 16 || T <= 0)
        return -1;
    Row row = {q, k, v, ks, vs, slots, T, out};
    return attend_rows(&row, 1, k_head_stride, v_head_stride, row_stride, scale_head_stride, Hkv, G, D, scale,
                       num_threads);
}

/* A row of D bf16 values -> D int8 and the returned scale: scale = max |x| / 127 (1 for a row of zeros), each value
   round(x / scale), ties to even: the same fp32 operations as layers/attention.py's quantize_kv, so the same bits */
static float quantize_row(const uint16_t *x, int8_t *out, int D) {
    float amax = 0.0f;
    for (int d = 0; d < D; d++) {
        uint32_t u = (uint32_t)x[d] << 16;
        float f;
        memcpy(&f, &u, 4);
        amax = fabsf(f) > amax ? fabsf(f) : amax;
    }
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int d = 0; d < D; d++) {
        uint32_t u = (uint32_t)x[d] << 16;
        float f;
        memcpy(&f, &u, 4);
        out[d] = (int8_t)nearbyintf(f / scale);
    }
    return scale;
}

/* A forward's decode and verify rows for one layer, in one call (the Python around a row cost more than its
   attention at short contexts: ~100 us a layer against a few us of work). Writes the new tokens' K/V into the
   cache first (an int8 cache: quantized, with their scales), then attends every row over its prefix in one
   parallel loop (attend_rows), each row's bits those of the row attended alone.

   seqs [n_seqs, 5] int64: each sequence's first flat row, number of new rows, cached tokens before them, the
   first cache slot of its context when that context is one run of slots (else -1), and the offset in `slots`
   of its context's slot numbers (used when it is not one run). Row r of a sequence is token start + r: it sees
   context entries [0, start + r]. q/k/v: rows of q_row / k_row / v_row elements, heads of D elements each;
   kc/vc: the layer's K and V caches [Hkv, S, D] (head stride head_stride, rows of D); ks/vs: their scales
   [Hkv, S] (head stride scale_head_stride) for an int8 cache, else NULL. out [N, Hkv * G, D]. */
int attend_chains(const int64_t *seqs, int n_seqs, const int64_t *slots, const uint16_t *q, long q_row,
                  const uint16_t *k, long k_row, const uint16_t *v, long v_row, void *kc, void *vc,
                  float *ks, float *vs, long head_stride, long scale_head_stride, int Hkv, int G, int D,
                  float scale, uint16_t *out, int num_threads) {
    if (D % 32 != 0 || G > 16)                                 /* before any write: the caller falls back whole */
        return -1;
    for (int i = 0; i < n_seqs; i++) {
        const int64_t *s = seqs + 5 * i;
        for (long r = 0; r < s[1]; r++) {
            long row = s[0] + r, slot = s[3] >= 0 ? s[3] + s[2] + r : slots[s[4] + s[2] + r];
            for (int h = 0; h < Hkv; h++) {
                const uint16_t *kn = k + row * k_row + (long)h * D, *vn = v + row * v_row + (long)h * D;
                if (ks) {
                    ks[h * scale_head_stride + slot] = quantize_row(kn, (int8_t *)kc + h * head_stride + slot * D, D);
                    vs[h * scale_head_stride + slot] = quantize_row(vn, (int8_t *)vc + h * head_stride + slot * D, D);
                } else {
                    memcpy((uint16_t *)kc + h * head_stride + slot * D, kn, sizeof(uint16_t) * D);
                    memcpy((uint16_t *)vc + h * head_stride + slot * D, vn, sizeof(uint16_t) * D);
                }
            }
        }
    }
    int n_rows = 0;
    for (int i = 0; i < n_seqs; i++)
        n_rows += (int)seqs[5 * i + 1];
    Row *rows = malloc(sizeof(Row) * (n_rows > 0 ? n_rows : 1));
    if (!rows)
        return -1;
    const long es = ks ? 1 : 2;
    for (int i = 0, at = 0; i < n_seqs; i++) {
        const int64_t *s = seqs + 5 * i;
        for (long r = 0; r < s[1]; r++) {
            long row = s[0] + r, first = s[3] >= 0 ? s[3] : 0;
            rows[at++] = (Row){q + row * q_row, (const char *)kc + es * first * D, (const char *)vc + es * first * D,
                               ks ? ks + first : NULL, vs ? vs + first : NULL, s[3] >= 0 ? NULL : slots + s[4],
                               (int)(s[2] + r + 1), out + row * (long)Hkv * G * D};
        }
    }
    int status = attend_rows(rows, n_rows, head_stride, head_stride, D, scale_head_stride, Hkv, G, D, scale,
                             num_threads);
    free(rows);
    return status;
}
