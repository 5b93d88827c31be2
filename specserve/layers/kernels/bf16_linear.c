/* y = x W^T + b for bf16 weights and activations by AVX512-BF16 dot products (vdpbf16ps: 16 lanes, each adding the
   two products of a pair of inputs to an fp32 sum), the weight streamed once for up to ROWS rows.

   Why: on some CPUs oneDNN's packed bf16 product runs far below the memory's bandwidth for the few rows of a
   decode or verify step (an Intel Xeon under KVM: 3.5 GB/s, ~1 ms for 576 -> 3072 at one row or at six;
   benchmarks/NOTES.md, session 15). The linear chooser (layers/linear.py) times this kernel beside oneDNN's and
   keeps whichever family of kernels is faster for the shape.

   Each output's sum is formed in the same order whatever the rows beside it or the threads (threads split the
   outputs, never the inputs), so a verify row is the row plain decoding computes: two fp32 accumulators per row
   and tile, the even and the odd pairs of inputs, added at the end; then the bias (fp32), then bf16 (round to
   nearest even).

   Packed layout, in tiles of 16 outputs (output n = 16 t + l; the last tile padded with zero rows): tile t, input
   pair p (inputs 2 p, 2 p + 1) is 64 bytes, lane l holding W[n, 2 p] in its low half and W[n, 2 p + 1] in its high
   one, as vdpbf16ps reads them. K even. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ROWS 8                  /* rows whose accumulators stay in registers while a tile's weights stream by */
#define PREFETCH 2048           /* bytes ahead in the weights, into L1; both lines of each 128 bytes a step takes */
#define PREFETCH_L2 8192        /* and further ahead into L2 (30 layers of SmolLM2's linears at one thread, one row
                                   14.1 -> 10.2 ms, six rows 17.6 -> 10.1: the six rows' products now hide under the
                                   weights' reads; one line in two at 1024 before; benchmarks/NOTES.md, session 42) */
#define AMX_PREFETCH 2048       /* the same for the AMX path: 3072x576 at one row 249 -> 199 us at 2 threads, ~18 GB/s
                                   (1 and 4 KB: 206 and 196 us; session 15) */
#define M_BLOCK 256             /* rows of a prompt chunk whose inputs every tile passes before the next rows' */

static inline __m512bh pair(const uint16_t *x) {              /* inputs 2 p, 2 p + 1 of a row, in all 16 lanes */
    int32_t v;
    memcpy(&v, x, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* Tile t (16 outputs) for rows [m0, m0 + rows) -> acc_out [rows][16] */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *packed, float *acc_out,
                                                        int m0, const int rows, int t, int K) {
    const int P = K / 2;
    const uint16_t *w = packed + (long)t * 16 * K;
    __m512 even[ROWS], odd[ROWS];
    for (int r = 0; r < rows; r++)
        even[r] = odd[r] = _mm512_setzero_ps();
    int p = 0;
    for (; p + 1 < P; p += 2) {
        const char *ahead = (const char *)(w + 32 * p);
        _mm_prefetch(ahead + PREFETCH, _MM_HINT_T0);
        _mm_prefetch(ahead + PREFETCH + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + PREFETCH_L2, _MM_HINT_T1);
        _mm_prefetch(ahead + PREFETCH_L2 + 64, _MM_HINT_T1);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 32 * p), w1 = (__m512bh)_mm512_loadu_si512(w + 32 * p + 32);
        for (int r = 0; r < rows; r++) {
            const uint16_t *xr = x + (long)(m0 + r) * K + 2 * p;
            even[r] = _mm512_dpbf16_ps(even[r], w0, pair(xr));
            odd[r] = _mm512_dpbf16_ps(odd[r], w1, pair(xr + 2));
        }
    }
    if (p < P) {                                               /* an odd number of pairs: the last one is even */
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 32 * p);
        for (int r = 0; r < rows; r++)
            even[r] = _mm512_dpbf16_ps(even[r], w0, pair(x + (long)(m0 + r) * K + 2 * p));
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(acc_out + 16 * r, _mm512_add_ps(even[r], odd[r]));
}

static void tile_any(const uint16_t *x, const uint16_t *packed, float *acc_out, int m0, int rows, int t, int K) {
#define CASE(r) case r: tile(x, packed, acc_out, m0, r, t, K); return;
    switch (rows) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX: the same layout is the B operand of TDPBF16PS, 16 pairs (32 inputs) a tile load. Each output of a row is
   one tile product's element per 32 inputs, accumulated in order in the C tile: the same operations whatever the
   rows in the tile. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

int bf16_amx_init(void) {                   /* the process's permission to use AMX tile data (Linux) */
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
}

static void amx_configure(int rows) {       /* tmm0: C [rows x 16 fp32], tmm1: A [rows x 32 bf16], tmm2: B */
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = (uint8_t)rows;
    c.colsb[0] = c.colsb[1] = 64;
    c.rows[2] = 16;
    c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

static void amx_tile(const uint16_t *x, const uint16_t *packed, float *acc_out, int m0, int t, int K) {
    const uint16_t *w = packed + (long)t * 16 * K;
    _tile_zero(0);
    for (int k = 0; k < K; k += 32) {
        for (int line = 0; line < 1024; line += 64)          /* the B tile two loads ahead */
            _mm_prefetch((const char *)(w + 16 * k) + AMX_PREFETCH + line, _MM_HINT_T0);
        _tile_loadd(1, x + (long)m0 * K + k, 2 * K);
        _tile_loadd(2, w + 16 * k, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, acc_out, 64);
}

#define QUAD 64                     /* amx_configure's marker for the quad configuration (rows never reach it) */

static void amx_configure_quad(void) {      /* tmm0-3: C [16 x 16 fp32]; tmm4, 5: A [16 x 32 bf16]; tmm6, 7: B */
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* Tiles t, t + 1 for rows [m0, m0 + 32): four C tiles, so four tile products are in flight where amx_tile has one
   waiting on the last (a prompt chunk's many rows are compute-bound), and each A and B load serves two of them.
   Each element is the same chain of tile products as in amx_tile: the same bits. acc_out [4][16][16]: (rows m0,
   tile t), (m0, t + 1), (m0 + 16, t), (m0 + 16, t + 1). */
static void amx_quad(const uint16_t *x, const uint16_t *packed, float *acc_out, int m0, int t, int K, int prefetch) {
    const uint16_t *w0 = packed + (long)t * 16 * K, *w1 = w0 + 16 * K;
    const uint16_t *x0 = x + (long)m0 * K, *x1 = x0 + 16L * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        if (prefetch)                                            /* the first rows stream the weights in */
            for (int line = 0; line < 1024; line += 64) {
                _mm_prefetch((const char *)(w0 + 16 * k) + AMX_PREFETCH + line, _MM_HINT_T0);
                _mm_prefetch((const char *)(w1 + 16 * k) + AMX_PREFETCH + line, _MM_HINT_T0);
            }
        _tile_loadd(4, x0 + k, 2 * K);
        _tile_loadd(6, w0 + 16 * k, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + 16 * k, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, x1 + k, 2 * K);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc_out, 64);
    _tile_stored(1, acc_out + 256, 64);
    _tile_stored(2, acc_out + 512, 64);
    _tile_stored(3, acc_out + 768, 64);
}
#else
int bf16_amx_init(void) { return -1; }
#endif

/* Rows [m0, m0 + rows) of tile t's sums (out [rows][16]) plus the bias -> y, in bf16 */
static void store(uint16_t *y, const float *out, const float *bias, int m0, int rows, int t, int N) {
    const int width = N - 16 * t < 16 ? N - 16 * t : 16;                /* the last tile's real outputs */
    const __mmask16 live = (__mmask16)((1u << width) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(live, bias + 16 * t) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {        /* vcvtneps2bf16: round to nearest even */
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(out + 16 * r), bv));
        _mm256_mask_storeu_epi16(y + (size_t)(m0 + r) * N + 16 * t, live, h);
    }
}

/* Tile t for rows [m0, M), a block of `block` rows at a time (AMX: 16 in the C tile; else ROWS in registers) */
static void rows_of_tile(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int m0, int M,
                         int K, int N, int t, int block, int amx, int *configured) {
    float out[16 * 16];
    for (; m0 < M; m0 += block) {
        const int rows = M - m0 < block ? M - m0 : block;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx) {
            if (rows != *configured) {
                amx_configure(rows);
                *configured = rows;
            }
            amx_tile(x, packed, out, m0, t, K);
        } else
#endif
        tile_any(x, packed, out, m0, rows, t, K);
        store(y, out, bias, m0, rows, t, N);
    }
    (void)amx;
    (void)configured;
}

/* x [M, K] bf16 (rows contiguous) -> y [M, N] bf16, plus bias (fp32 [N] or NULL). K even (with `amx`, a multiple
   of 32, on a CPU with AMX-BF16 after bf16_amx_init); returns -1 otherwise. */
int bf16_linear(const uint16_t *x, const uint16_t *packed, const float *bias, uint16_t *y, int M, int K, int N,
                int num_threads, int amx) {
    if (K % 2 != 0 || N <= 0 || M <= 0)
        return -1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx && K % 32 != 0)
        return -1;
#else
    if (amx)
        return -1;
#endif
    const int tiles = (N + 15) / 16, block = amx ? 16 : ROWS;
    const int quads = amx && M >= 32;   /* a prompt chunk: pairs of tiles, 32 rows at a time in four C tiles (AMX) */
    /* pairs of tiles over row blocks of at most M_BLOCK: a block's inputs stay in the cache while every tile passes */
#pragma omp parallel num_threads(num_threads)
    {
    int configured = 0;                     /* what this thread's tile registers are set up for (AMX: rows or QUAD) */
    for (int mb = 0; mb < M; mb += M_BLOCK) {
        const int end = M - mb < M_BLOCK ? M : mb + M_BLOCK;
#pragma omp for schedule(static)
        for (int q = 0; q < (tiles + 1) / 2; q++) {
            const int t = 2 * q;
            int m0 = mb;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (quads && t + 1 < tiles) {
                float out[4 * 16 * 16];
                if (configured != QUAD) {
                    amx_configure_quad();
                    configured = QUAD;
                }
                for (; end - m0 >= 32; m0 += 32) {
                    amx_quad(x, packed, out, m0, t, K, m0 == mb);
                    store(y, out, bias, m0, 16, t, N);
                    store(y, out + 256, bias, m0, 16, t + 1, N);
                    store(y, out + 512, bias, m0 + 16, 16, t, N);
                    store(y, out + 768, bias, m0 + 16, 16, t + 1, N);
                }
            }
#endif
            for (int u = t; u < t + 2 && u < tiles; u++)        /* the rows left, and an unpaired last tile */
                rows_of_tile(x, packed, bias, y, m0, end, K, N, u, block, amx, &configured);
        }
    }
    }
    (void)quads;
    return 0;
}
