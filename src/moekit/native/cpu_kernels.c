/* moekit's native CPU kernels (compiled on first use by moekit/native/__init__.py): int8,
 * weight-only int4 / int8 and float products of rows grouped by expert.
 *
 * moekit_int8_gemm_segments: int8 products of rows grouped by expert, in one call,
 *
 *     out[j, r] = sum_k w[experts[s], r, k] * x[j * x_stride + k]     (exact int32)
 *
 * for the rows j of each segment s (starts[s] <= j < starts[s + 1]; starts NULL: segment s is
 * row s, a decode token's slots) and r < N output rows; w int8 [E, N, K] contiguous, x int8
 * rows (x_stride 0: one row shared by every segment). One OpenMP loop covers every segment's
 * weight rows in blocks of ROWS, so the weights of all the experts stream under one parallel
 * region, each weight row once, and each row group prefetches the rows PREFETCH_ROWS ahead of
 * it: with few rows an expert the products are bound by how many weight lines are in flight,
 * not by arithmetic. x is widened to int16 once and
 * multiplied by sign-extended weights into int32 lanes (pairs of products of at most 127 * 127
 * each), exact for K below 2^31 / 127^2.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif


#define ROWS 32          /* rows of one work item */
#define PREFETCH_ROWS 8  /* how far ahead a row group prefetches */

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MOEKIT_ISA "avx512_vnni"
#elif defined(__AVX512BW__)
#define MOEKIT_ISA "avx512"
#elif defined(__AVX2__)
#define MOEKIT_ISA "avx2"
#else
#define MOEKIT_ISA "scalar"
#endif

const char *moekit_isa(void) { return MOEKIT_ISA; }

int moekit_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static inline int32_t dot_tail(const int8_t *w, const int16_t *x, int64_t k0, int64_t K) {
    int32_t acc = 0;
    for (int64_t k = k0; k < K; k++) acc += (int32_t)w[k] * x[k];
    return acc;
}

#if defined(__AVX512BW__)
#define STEP 32
typedef __m512i vacc;
static inline vacc vzero(void) { return _mm512_setzero_si512(); }
static inline vacc vload_x(const int16_t *x) { return _mm512_loadu_si512((const void *)x); }
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w16, xv);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w16, xv));
#endif
}
static inline int32_t vsum(vacc a) { return _mm512_reduce_add_epi32(a); }
#elif defined(__AVX2__)
#define STEP 16
typedef __m256i vacc;
static inline vacc vzero(void) { return _mm256_setzero_si256(); }
static inline vacc vload_x(const int16_t *x) { return _mm256_loadu_si256((const __m256i *)x); }
static inline vacc vmadd(vacc acc, const int8_t *w, vacc xv) {
    __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w16, xv));
}
static inline int32_t vsum(vacc a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

#ifdef STEP
static inline void prefetch_line(const int8_t *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

/* Four rows w[0..3] (row stride K) against x; prefetches the four rows PREFETCH_ROWS ahead. */
static inline void rows4(const int8_t *w, int64_t K, const int16_t *x, int32_t *out) {
    const int64_t kv = K - K % STEP;
    const int8_t *ahead = w + PREFETCH_ROWS * K;
    vacc a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t k = 0; k < kv; k += STEP) {
        if ((k & 63) == 0) {
            prefetch_line(ahead + k);
            prefetch_line(ahead + K + k);
            prefetch_line(ahead + 2 * K + k);
            prefetch_line(ahead + 3 * K + k);
        }
        vacc xv = vload_x(x + k);
        a0 = vmadd(a0, w + k, xv);
        a1 = vmadd(a1, w + K + k, xv);
        a2 = vmadd(a2, w + 2 * K + k, xv);
        a3 = vmadd(a3, w + 3 * K + k, xv);
    }
    out[0] = vsum(a0) + dot_tail(w, x, kv, K);
    out[1] = vsum(a1) + dot_tail(w + K, x, kv, K);
    out[2] = vsum(a2) + dot_tail(w + 2 * K, x, kv, K);
    out[3] = vsum(a3) + dot_tail(w + 3 * K, x, kv, K);
}

static inline int32_t row1(const int8_t *w, int64_t K, const int16_t *x) {
    const int64_t kv = K - K % STEP;
    vacc a = vzero();
    for (int64_t k = 0; k < kv; k += STEP) a = vmadd(a, w + k, vload_x(x + k));
    return vsum(a) + dot_tail(w, x, kv, K);
}
#else
static inline void rows4(const int8_t *w, int64_t K, const int16_t *x, int32_t *out) {
    for (int j = 0; j < 4; j++) out[j] = dot_tail(w + j * K, x, 0, K);
}
static inline int32_t row1(const int8_t *w, int64_t K, const int16_t *x) { return dot_tail(w, x, 0, K); }
#endif

/* Rows of segment s: [starts[s], starts[s + 1]), or the one row s when starts is NULL. */
static inline int64_t seg_begin(const int64_t *starts, int64_t s) { return starts ? starts[s] : s; }

/* Work item `item` of a kernel's parallel loop (blocks of ROWS weight rows per segment): its
 * segment s, weight rows [r0, r1) and x / output rows [j0, j1). */
typedef struct { int64_t s, r0, r1, j0, j1; } work_item;
static inline work_item item_of(int64_t item, int64_t blocks, const int64_t *starts, int64_t N) {
    work_item it;
    it.s = item / blocks;
    it.r0 = (item % blocks) * ROWS;
    it.r1 = it.r0 + ROWS < N ? it.r0 + ROWS : N;
    it.j0 = seg_begin(starts, it.s);
    it.j1 = seg_begin(starts, it.s + 1);
    return it;
}

/* x_f32 [rows, K] fp32 -> x16 int16 values of the int8 quantization per row, as
 * moekit.quant.quantize_activation's "token" granularity does it: s = amax / 127 (1 where that
 * is not > 0), q = round half to even (x / s), clamped to [-127, 127]; scales[j] = s. */
static void quantize_rows(const float *x, int64_t x_stride, int64_t rows, int64_t K, int16_t *x16, float *scales) {
    for (int64_t j = 0; j < rows; j++) {
        const float *xj = x + j * x_stride;
        float amax = 0.0f;
        int nan = 0;
        for (int64_t k = 0; k < K; k++) {
            const float a = fabsf(xj[k]);
            nan |= a != a;
            amax = a > amax ? a : amax;
        }
        float s = nan ? NAN : amax / 127.0f;
        if (!(s > 0.0f)) s = 1.0f;
        scales[j] = s;
        for (int64_t k = 0; k < K; k++) {
            float q = nearbyintf(xj[k] / s);
            q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
            x16[j * K + k] = (int16_t)q;
        }
    }
}

/* x_int8 (or, when x_f32 is given, x_f32 quantized per row into scales) against w, into out
 * int32; or, with x_f32, w_scale [E, N] and out_f32, rescaled there as the backend does it:
 * (float(acc) * s_x) * s_w. Returns 0, or 1 when the scratch for the widened x cannot be
 * allocated. */
int moekit_int8_gemm_segments(const int8_t *w, const int64_t *experts, const int64_t *starts, int64_t segments,
                              const int8_t *x, const float *x_f32, float *scales, int64_t x_stride, int64_t N,
                              int64_t K, int32_t *out, const float *w_scale, float *out_f32, int threads) {
    const int64_t rows = seg_begin(starts, segments), x_rows = x_stride ? rows : 1;
    int16_t *x16 = (int16_t *)malloc((size_t)(x_rows * K) * sizeof(int16_t));
    if (x16 == NULL) return 1;
    if (x_f32 != NULL)
        quantize_rows(x_f32, x_stride, x_rows, K, x16, scales);
    else
        for (int64_t j = 0; j < x_rows; j++)
            for (int64_t k = 0; k < K; k++) x16[j * K + k] = x[j * x_stride + k];
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t item = 0; item < segments * blocks; item++) {
        const work_item it = item_of(item, blocks, starts, N);
        const int64_t s = it.s, r0 = it.r0, r1 = it.r1, j0 = it.j0, j1 = it.j1;
        const int8_t *ws = w + experts[s] * N * K;
        const float *sw = out_f32 ? w_scale + experts[s] * N : NULL;
        int64_t r = r0;
        int32_t acc[4];
        for (; r + 4 <= r1; r += 4)  /* four weight rows stay in L1 across the segment's x rows */
            for (int64_t j = j0; j < j1; j++) {
                if (!out_f32) {
                    rows4(ws + r * K, K, x16 + (x_stride ? j * K : 0), out + j * N + r);
                    continue;
                }
                rows4(ws + r * K, K, x16 + (x_stride ? j * K : 0), acc);
                const float sx = scales[x_stride ? j : 0];
                for (int i = 0; i < 4; i++) out_f32[j * N + r + i] = ((float)acc[i] * sx) * sw[r + i];
            }
        for (; r < r1; r++)
            for (int64_t j = j0; j < j1; j++) {
                const int32_t a = row1(ws + r * K, K, x16 + (x_stride ? j * K : 0));
                if (out_f32) out_f32[j * N + r] = ((float)a * scales[x_stride ? j : 0]) * sw[r];
                else out[j * N + r] = a;
            }
    }
    free(x16);
    (void)threads;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * moekit_wo_gemm_segments: weight-only (int4 / int8 with group scales) products of rows
 * grouped by expert (segments as above), in fp32:
 *
 *     out[j, r] = sum_k (q[e, r, k] - z[e, r, k / g]) * s[e, r, k / g] * x[j, k],  e = experts[s]
 *             = sum_groups s * (sum_k q x - z * sum_k x)
 *
 * wtype 0: int4 packed two per byte [E, N, K/2] (column 2j the low nibble), z = zero or 8;
 * wtype 1: int8 [E, N, K], z = 0; wtype 2: uint8 [E, N, K] with zero points. scale [E, N, K/g]
 * fp32, zero [E, N, K/g] uint8 or NULL. g is a multiple of 32. Same work split and prefetch as
 * the int8 kernel; the group sums of x are computed once per call.
 * ------------------------------------------------------------------------------------------- */
#if defined(__AVX512F__)
#define FSTEP 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
/* FSTEP consecutive bytes as floats: unsigned, signed; low and high nibbles of FSTEP bytes */
static inline vf vf_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vf_s8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline void vf_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__)
#define FSTEP 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline float vf_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}
static inline vf vf_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf vf_s8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline void vf_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#endif

/* One row's weight-only product: sum over groups of s * (sum_k q x - z * sum_k x). With
 * vectors, each group's products stay in lanes, scaled there, and the row reduces once. */
static inline float wo_row(int wtype, const uint8_t *q, const float *sc, const uint8_t *z, const float *x,
                           const float *xe, const float *xo, const float *xs, int64_t K, int64_t g) {
    const int64_t G = K / g;
    float corr = 0.0f;
    for (int64_t c = 0; c < G; c++) corr += sc[c] * (z ? (float)z[c] : (wtype == 0 ? 8.0f : 0.0f)) * xs[c];
#ifdef FSTEP
    vf acc = vf_zero();
    for (int64_t c = 0; c < G; c++) {
        vf a = vf_zero(), b = vf_zero();
        if (wtype == 0) {
            const uint8_t *qc = q + c * g / 2;
            const float *xec = xe + c * g / 2, *xoc = xo + c * g / 2;
            for (int64_t j = 0; j < g / 2; j += FSTEP) {  /* FSTEP bytes: FSTEP even and FSTEP odd columns */
                vf lo, hi;
                vf_nibbles(qc + j, &lo, &hi);
                a = vf_fma(lo, vf_load(xec + j), a);
                b = vf_fma(hi, vf_load(xoc + j), b);
            }
        } else {
            for (int64_t k = c * g; k < (c + 1) * g; k += 2 * FSTEP) {
                a = vf_fma(wtype == 1 ? vf_s8(q + k) : vf_u8(q + k), vf_load(x + k), a);
                b = vf_fma(wtype == 1 ? vf_s8(q + k + FSTEP) : vf_u8(q + k + FSTEP), vf_load(x + k + FSTEP), b);
            }
        }
        acc = vf_fma(vf_add(a, b), vf_set1(sc[c]), acc);
    }
    return vf_sum(acc) - corr;
#else
    float acc = 0.0f;
    for (int64_t c = 0; c < G; c++) {
        float d = 0.0f;
        if (wtype == 0) {
            for (int64_t j = c * g / 2; j < (c + 1) * g / 2; j++) d += (float)(q[j] & 15) * xe[j] + (float)(q[j] >> 4) * xo[j];
        } else {
            for (int64_t k = c * g; k < (c + 1) * g; k++) d += (wtype == 1 ? (float)(int8_t)q[k] : (float)q[k]) * x[k];
        }
        acc += sc[c] * d;
    }
    return acc - corr;
#endif
}

#ifdef FSTEP
/* wo_row for four consecutive rows at once (row stride row_bytes, G scales a row): four
 * independent accumulator chains hide the FMA latency, and x's lanes load once for four rows. */
static inline void wo_rows4(int wtype, const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z,
                            const float *x, const float *xe, const float *xo, const float *xs, int64_t K, int64_t g,
                            float *out) {
    const int64_t G = K / g;
    vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
    float corr[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < 4; r++)
        for (int64_t c = 0; c < G; c++)
            corr[r] += sc[r * G + c] * (z ? (float)z[r * G + c] : (wtype == 0 ? 8.0f : 0.0f)) * xs[c];
    for (int64_t c = 0; c < G; c++) {
        vf a[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        if (wtype == 0) {
            for (int64_t j = c * g / 2; j < (c + 1) * g / 2; j += FSTEP) {
                const vf xev = vf_load(xe + j), xov = vf_load(xo + j);
                for (int r = 0; r < 4; r++) {
                    vf lo, hi;
                    vf_nibbles(q + r * row_bytes + j, &lo, &hi);
                    a[r] = vf_fma(hi, xov, vf_fma(lo, xev, a[r]));
                }
            }
        } else {
            for (int64_t k = c * g; k < (c + 1) * g; k += FSTEP) {
                const vf xv = vf_load(x + k);
                for (int r = 0; r < 4; r++)
                    a[r] = vf_fma(wtype == 1 ? vf_s8(q + r * row_bytes + k) : vf_u8(q + r * row_bytes + k), xv, a[r]);
            }
        }
        for (int r = 0; r < 4; r++) acc[r] = vf_fma(a[r], vf_set1(sc[r * G + c]), acc[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = vf_sum(acc[r]) - corr[r];
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* ---- weight-only products on AVX-512 VNNI: integer products against x in 16-bit fixed point ----
 * Widening every weight to an fp32 lane costs about as many instructions as streaming it
 * (int4: 55 us per million weights per core, a third of a decode token's time on two cores).
 * vpdpbusd instead multiplies 64 unsigned weight bytes by 64 signed bytes into 16 int32 lanes,
 * four products a lane, in one instruction. So each group of g columns of x goes to fixed point
 * once per call: X = round(x / 2^e), the step 2^e the smallest power of two with
 * max |x| < 2^(e + XBITS), and X = lo + 256 hi in two signed bytes. A 64-byte chunk of a weight
 * row (128 int4 columns: low and high nibbles; 64 uint8 columns; int8 ones as uint8 q + 128 with
 * zero point 128) takes two (uint8) or four (int4) vpdpbusd; the lanes' integer sums are exact,
 * and (256 sum q hi + sum q lo) 2^e times the lane's weight scale accumulates in fp32. The zero
 * points subtract s z sum_k X 2^e per group, so (q - z) multiplies the same rounded x.
 *
 * The only rounding beyond fp32 accumulation is x's to the step: |x - X 2^e| <= 2^-XBITS max|x|
 * of its group. That is finer than x's own rounding to bf16 (2^-9 |x|) except for the values
 * more than 2^5 below their group's largest, and over a group it stays under
 * sqrt(g) 2^-XBITS max|x| <= sqrt(g) 2^-XBITS ||x_group|| in norm (7e-4 ||x_group|| at g = 128,
 * against 2e-3 for bf16 rounding). A third byte (x to fp32 accuracy) cost 10 % more time at
 * decode (bench/NOTES-cpu.md). Rows whose x is not finite, or whose group maxima fall below
 * 2^-100 (where 2^e would leave fp32's normal range), take the fp32 path. */
#define WO_VNNI 1
#define XBITS 14            /* |X| <= 2^14: lo in [-128, 127], |hi| <= 64 */
#define L2_AHEAD 16384      /* weight bytes ahead a row group prefetches into L2 ... */
#define L1_AHEAD 2048       /* ... and into L1 (measured: one distance alone streamed 20-30 % slower) */

/* A call's x rows prepared for the VNNI products. Each row: lane_f [T][16] (T = K / C chunks
 * of C columns: 128 for int4, 64 else): 2^e of each lane's group; xsum [G]: the groups' sums
 * of X 2^e; lo [K], hi [K] int8 in the weight bytes' column order (int4: even columns, then odd
 * columns). */
typedef struct {
    int64_t C, T, per_row;
    int32_t *chunk_group;   /* [T]: the group of chunk t's first column */
    __m512i lane_group;     /* groups narrower than a chunk: lane l's group within its chunk */
    char *rows, *ok;        /* [x_rows * per_row] prepared rows; [x_rows] whether each could be */
} vnni_x;

static inline const float *vx_lane_f(const vnni_x *vx, int64_t j) { return (const float *)(vx->rows + j * vx->per_row); }

/* Prepares x row xj into row j of vx; returns 0 where it must take the fp32 path instead. */
static int vnni_prepare(const vnni_x *vx, int64_t j, int wtype, const float *xj, int64_t K, int64_t g) {
    const int64_t G = K / g, C = vx->C;
    float *lane_f = (float *)(vx->rows + j * vx->per_row), *xsum = lane_f + vx->T * 16;
    int8_t *lo = (int8_t *)(xsum + G), *hi = lo + K;
    const __m512 big = _mm512_set1_ps(3.4028235e38f);
    const __m512i b128 = _mm512_set1_epi32(128), b255 = _mm512_set1_epi32(255);
    /* int4: the even and the odd columns of 32 */
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    float gf[G];
    for (int64_t c = 0; c < G; c++) {
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = c * g; k < (c + 1) * g; k += 16) {
            const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xj + k));
            if (_mm512_cmp_ps_mask(a, big, _CMP_NLE_UQ)) return 0;  /* inf or nan */
            amax = _mm512_max_ps(amax, a);
        }
        const float m = _mm512_reduce_max_ps(amax);
        if (m > 0.0f && m < 0x1p-100f) return 0;
        int E = 0;
        if (m > 0.0f) frexpf(m, &E);  /* m < 2^E */
        const int e = m > 0.0f ? E - XBITS : 0;
        const __m512 inv = _mm512_set1_ps(ldexpf(1.0f, -e));
        gf[c] = ldexpf(1.0f, e);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = c * g; k < (c + 1) * g; k += 32) {
            __m512i X0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xj + k), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i X1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xj + k + 16), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            sum = _mm512_add_epi32(sum, _mm512_add_epi32(X0, X1));
            int64_t p0 = k, p1 = k + 16;
            if (wtype == 0) {  /* to the nibbles' order */
                const __m512i e16 = _mm512_permutex2var_epi32(X0, even, X1), o16 = _mm512_permutex2var_epi32(X0, odd, X1);
                X0 = e16, X1 = o16, p0 = k / 2, p1 = K / 2 + k / 2;
            }
            const __m512i l0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X0, b128), b255), b128);
            const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X1, b128), b255), b128);
            _mm_storeu_si128((__m128i *)(lo + p0), _mm512_cvtepi32_epi8(l0));
            _mm_storeu_si128((__m128i *)(lo + p1), _mm512_cvtepi32_epi8(l1));
            _mm_storeu_si128((__m128i *)(hi + p0), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(X0, l0), 8)));
            _mm_storeu_si128((__m128i *)(hi + p1), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(X1, l1), 8)));
        }
        xsum[c] = (float)((double)_mm512_reduce_add_epi32(sum) * gf[c]);
    }
    for (int64_t t = 0; t < vx->T; t++)
        for (int l = 0; l < 16; l++) lane_f[t * 16 + l] = gf[(t * C + l * (C / 16)) / g];
    return 1;
}

/* n (1 or 4) consecutive weight rows q (stride row_bytes; their scales sc and zero points z,
 * G a row) against prepared x row j, prefetching the rows L2_AHEAD and L1_AHEAD bytes ahead
 * when prefetch is set. */
static inline __attribute__((always_inline)) void vnni_rows_impl(
        const int n, const int wtype, const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z,
        const vnni_x *vx, int64_t j, int64_t K, int64_t g, int prefetch, float *out) {
    const int64_t G = K / g, C = vx->C, half = K / 2;
    const float *lane_f = vx_lane_f(vx, j), *xsum = lane_f + vx->T * 16;
    const int8_t *lo = (const int8_t *)(xsum + G), *hi = lo + K;
    const int64_t l2 = (L2_AHEAD + row_bytes - 1) / row_bytes * row_bytes, l1 = (L1_AHEAD + row_bytes - 1) / row_bytes * row_bytes;
    const __m512i nib = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    const __mmask16 gmask = (__mmask16)((1u << (g < C ? C / g : 1)) - 1);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t t = 0; t < vx->T; t++) {
        if (prefetch)
            for (int r = 0; r < n; r++) {
                _mm_prefetch((const char *)q + l2 + r * row_bytes + t * 64, _MM_HINT_T2);
                _mm_prefetch((const char *)q + l1 + r * row_bytes + t * 64, _MM_HINT_T0);
            }
        const __m512i xl = _mm512_loadu_si512((const void *)(lo + t * 64)), xh = _mm512_loadu_si512((const void *)(hi + t * 64));
        const __m512i xlo = wtype == 0 ? _mm512_loadu_si512((const void *)(lo + half + t * 64)) : xl;
        const __m512i xho = wtype == 0 ? _mm512_loadu_si512((const void *)(hi + half + t * 64)) : xh;
        const __m512 lf = _mm512_loadu_ps(lane_f + t * 16);
        for (int r = 0; r < n; r++) {
            const __m512i wb = _mm512_loadu_si512((const void *)(q + r * row_bytes + t * 64));
            __m512i al, ah;
            if (wtype == 0) {  /* even columns in the low nibbles, odd ones in the high */
                const __m512i we = _mm512_and_si512(wb, nib), wo = _mm512_and_si512(_mm512_srli_epi16(wb, 4), nib);
                al = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), we, xl), wo, xlo);
                ah = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), we, xh), wo, xho);
            } else {
                const __m512i wu = wtype == 1 ? _mm512_xor_si512(wb, flip) : wb;  /* int8: q + 128 */
                al = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xl);
                ah = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xh);
            }
            const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ah, 8), al));
            const float *scr = sc + r * G;
            const int32_t c0 = vx->chunk_group[t];
            const __m512 sv = g >= C ? _mm512_set1_ps(scr[c0])
                                     : _mm512_permutexvar_ps(vx->lane_group, _mm512_maskz_loadu_ps(gmask, scr + c0));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(f, lf), sv, acc[r]);
        }
    }
    for (int r = 0; r < n; r++) {
        float corr = 0.0f;
        for (int64_t c = 0; c < G; c++)
            corr += sc[r * G + c] * (z ? (float)z[r * G + c] : (wtype == 0 ? 8.0f : 128.0f)) * xsum[c];
        out[r] = _mm512_reduce_add_ps(acc[r]) - corr;
    }
}

#define VNNI_ROWS(NAME, N, WT)                                                                          \
    static void NAME(const uint8_t *q, int64_t row_bytes, const float *sc, const uint8_t *z, const vnni_x *vx, \
                     int64_t j, int64_t K, int64_t g, int prefetch, float *out) {                         \
        vnni_rows_impl(N, WT, q, row_bytes, sc, z, vx, j, K, g, prefetch, out);                           \
    }
VNNI_ROWS(vnni_rows4_int4, 4, 0)
VNNI_ROWS(vnni_row_int4, 1, 0)
VNNI_ROWS(vnni_rows4_int8, 4, 1)
VNNI_ROWS(vnni_row_int8, 1, 1)
VNNI_ROWS(vnni_rows4_uint8, 4, 2)
VNNI_ROWS(vnni_row_uint8, 1, 2)
typedef void (*vnni_rows_fn)(const uint8_t *, int64_t, const float *, const uint8_t *, const vnni_x *, int64_t,
                             int64_t, int64_t, int, float *);

/* Sets up vx for this call and prepares its x rows; 0 where the VNNI products do not fit this
 * call (chunks straddling groups) or the scratch cannot be allocated: the fp32 path runs. */
static int vnni_setup(vnni_x *vx, int wtype, const float *x, int64_t x_stride, int64_t x_rows, int64_t K, int64_t g) {
    const int64_t C = wtype == 0 ? 128 : 64, G = K / g;
    vx->rows = NULL;
    if (K % C || (g % C && C % g)) return 0;
    vx->C = C, vx->T = K / C, vx->per_row = 4 * (vx->T * 16 + G) + 2 * K;
    vx->rows = (char *)malloc((size_t)(x_rows * (vx->per_row + 1) + 4 * vx->T));
    if (vx->rows == NULL) return 0;
    vx->chunk_group = (int32_t *)(vx->rows + x_rows * vx->per_row);
    vx->ok = (char *)(vx->chunk_group + vx->T);
    for (int64_t t = 0; t < vx->T; t++) vx->chunk_group[t] = (int32_t)(t * C / g);
    int32_t idx[16];
    for (int l = 0; l < 16; l++) idx[l] = g < C ? (int32_t)(l * (C / 16) / g) : 0;
    vx->lane_group = _mm512_loadu_si512((const void *)idx);
    for (int64_t j = 0; j < x_rows; j++) vx->ok[j] = (char)vnni_prepare(vx, j, wtype, x + j * x_stride, K, g);
    return 1;
}
#endif

/* Returns 0, 1 when the scratch cannot be allocated, 2 for a bad wtype or g. */
int moekit_wo_gemm_segments(int wtype, const uint8_t *w, const float *scale, const uint8_t *zero,
                            const int64_t *experts, const int64_t *starts, int64_t segments, const float *x,
                            int64_t x_stride, int64_t N, int64_t K, int64_t g, float *out, int threads) {
    if (wtype < 0 || wtype > 2 || g <= 0 || g % 32 || K % g) return 2;
    const int64_t rows = seg_begin(starts, segments), x_rows = x_stride ? rows : 1, G = K / g;
    const int64_t row_bytes = wtype == 0 ? K / 2 : K, per_x = 2 * K + G;
    /* per x row: its even and odd columns (int4), and its group sums */
    float *scratch = (float *)malloc((size_t)(x_rows * per_x) * sizeof(float));
    if (scratch == NULL) return 1;
    for (int64_t j = 0; j < x_rows; j++) {
        const float *xj = x + j * x_stride;
        float *xe = scratch + j * per_x, *xo = xe + K / 2, *xs = xe + K;
        for (int64_t c = 0; c < K / 2; c++) { xe[c] = xj[2 * c]; xo[c] = xj[2 * c + 1]; }
        for (int64_t c = 0; c < G; c++) {
            float t = 0.0f;
            for (int64_t k = c * g; k < (c + 1) * g; k++) t += xj[k];
            xs[c] = t;
        }
    }
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#ifdef WO_VNNI
    vnni_x vx;
    const int vnni = vnni_setup(&vx, wtype, x, x_stride, x_rows, K, g);
    const vnni_rows_fn rows4 = wtype == 0 ? vnni_rows4_int4 : (wtype == 1 ? vnni_rows4_int8 : vnni_rows4_uint8);
    const vnni_rows_fn row1 = wtype == 0 ? vnni_row_int4 : (wtype == 1 ? vnni_row_int8 : vnni_row_uint8);
#endif
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t item = 0; item < segments * blocks; item++) {
        const work_item it = item_of(item, blocks, starts, N);
        const int64_t r0 = it.r0, r1 = it.r1, j0 = it.j0, j1 = it.j1, e = experts[it.s];
        int64_t r = r0;
#ifdef WO_VNNI
        if (vnni)
            for (; r < r1; r += 4) {
                const int n = r1 - r < 4 ? (int)(r1 - r) : 4;
                const uint8_t *q = w + (e * N + r) * row_bytes;
                const float *sc = scale + (e * N + r) * G;
                const uint8_t *z = zero ? zero + (e * N + r) * G : NULL;
                for (int64_t j = j0; j < j1; j++) {  /* the weight rows stay in L1 across the segment's x rows */
                    const int64_t jx = x_stride ? j : 0;
                    if (vx.ok[jx]) {
                        if (n == 4) rows4(q, row_bytes, sc, z, &vx, jx, K, g, j == j0, out + j * N + r);
                        else
                            for (int i = 0; i < n; i++)
                                row1(q + i * row_bytes, row_bytes, sc + i * G, z ? z + i * G : NULL, &vx, jx, K, g,
                                     j == j0, out + j * N + r + i);
                        continue;
                    }
                    const float *xe = scratch + jx * per_x;
                    for (int i = 0; i < n; i++)
                        out[j * N + r + i] = wo_row(wtype, q + i * row_bytes, sc + i * G, z ? z + i * G : NULL,
                                                    x + jx * x_stride, xe, xe + K / 2, xe + K, K, g);
                }
            }
#endif
#ifdef FSTEP
        for (; r + 4 <= r1; r += 4) {
            const uint8_t *q = w + (e * N + r) * row_bytes;
            for (int64_t b = 0; b < 4 * row_bytes; b += 64) prefetch_line((const int8_t *)q + PREFETCH_ROWS * row_bytes + b);
            for (int64_t j = j0; j < j1; j++) {  /* the four weight rows stay in L1 across the segment's x rows */
                const float *xe = scratch + (x_stride ? j : 0) * per_x;
                wo_rows4(wtype, q, row_bytes, scale + (e * N + r) * G, zero ? zero + (e * N + r) * G : NULL,
                         x + (x_stride ? j * x_stride : 0), xe, xe + K / 2, xe + K, K, g, out + j * N + r);
            }
        }
#endif
        for (; r < r1; r++) {
            const uint8_t *q = w + (e * N + r) * row_bytes;
            const float *sc = scale + (e * N + r) * G;
            const uint8_t *z = zero ? zero + (e * N + r) * G : NULL;
            for (int64_t j = j0; j < j1; j++) {
                const float *xe = scratch + (x_stride ? j : 0) * per_x;
                out[j * N + r] = wo_row(wtype, q, sc, z, x + (x_stride ? j * x_stride : 0), xe, xe + K / 2, xe + K, K, g);
            }
        }
    }
    free(scratch);
#ifdef WO_VNNI
    free(vx.rows);
#endif
    (void)threads;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * moekit_float_gemm_segments: 16-bit or fp32 weights against fp32 rows (segments as above):
 *
 *     out[j, r] = sum_k float(w[experts[s], r, k]) * x[j, k]       (fp32 accumulation)
 *
 * wtype 0: fp32, 1: bf16 (the upper half of an fp32: widened exactly by a shift), 2: fp16.
 * Four weight rows a pass, prefetching the rows PREFETCH_ROWS ahead, as the int8 kernel.
 * ------------------------------------------------------------------------------------------- */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);         /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);  /* normal */
    else if (man) {                                                 /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 1023) << 13);
    } else bits = sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float wload1(int wtype, const void *w, int64_t k) {
    if (wtype == 0) return ((const float *)w)[k];
    if (wtype == 2) return half_to_float(((const uint16_t *)w)[k]);
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[k] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float fdot_tail(int wtype, const void *w, const float *x, int64_t k0, int64_t K) {
    float acc = 0.0f;
    for (int64_t k = k0; k < K; k++) acc += wload1(wtype, w, k) * x[k];
    return acc;
}

#ifdef FSTEP
/* FSTEP weights from element k of a row, as floats */
static inline vf wload(int wtype, const void *w, int64_t k) {
#if defined(__AVX512F__)
    if (wtype == 0) return _mm512_loadu_ps((const float *)w + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
    if (wtype == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    if (wtype == 0) return _mm256_loadu_ps((const float *)w + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
#if defined(__F16C__)
    if (wtype == 2) return _mm256_cvtph_ps(h);
#else
    if (wtype == 2) {
        float f[8];
        for (int i = 0; i < 8; i++) f[i] = half_to_float(((const uint16_t *)w)[k + i]);
        return _mm256_loadu_ps(f);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}
#endif

static inline void frows4(int wtype, const char *w, int64_t row_bytes, int64_t K, const float *x, float *out) {
#ifdef FSTEP
    const int64_t kv = K - K % FSTEP, esize = row_bytes / K;
    const char *ahead = w + PREFETCH_ROWS * row_bytes;
    vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero();
    for (int64_t k = 0; k < kv; k += FSTEP) {
        if (((k * esize) & 63) == 0) {
            for (int j = 0; j < 4; j++) _mm_prefetch(ahead + j * row_bytes + k * esize, _MM_HINT_T0);
            if (esize == 4)
                for (int j = 0; j < 4; j++) _mm_prefetch(ahead + j * row_bytes + k * esize + 64, _MM_HINT_T0);
        }
        vf xv = vf_load(x + k);
        a0 = vf_fma(wload(wtype, w, k), xv, a0);
        a1 = vf_fma(wload(wtype, w + row_bytes, k), xv, a1);
        a2 = vf_fma(wload(wtype, w + 2 * row_bytes, k), xv, a2);
        a3 = vf_fma(wload(wtype, w + 3 * row_bytes, k), xv, a3);
    }
    out[0] = vf_sum(a0) + fdot_tail(wtype, w, x, kv, K);
    out[1] = vf_sum(a1) + fdot_tail(wtype, w + row_bytes, x, kv, K);
    out[2] = vf_sum(a2) + fdot_tail(wtype, w + 2 * row_bytes, x, kv, K);
    out[3] = vf_sum(a3) + fdot_tail(wtype, w + 3 * row_bytes, x, kv, K);
#else
    for (int j = 0; j < 4; j++) out[j] = fdot_tail(wtype, w + j * row_bytes, x, 0, K);
#endif
}

/* Returns 0, or 2 for a bad wtype. */
int moekit_float_gemm_segments(int wtype, const void *w, const int64_t *experts, const int64_t *starts,
                               int64_t segments, const float *x, int64_t x_stride, int64_t N, int64_t K,
                               float *out, int threads) {
    if (wtype < 0 || wtype > 2) return 2;
    const int64_t esize = wtype == 0 ? 4 : 2, row_bytes = K * esize;
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int64_t item = 0; item < segments * blocks; item++) {
        const work_item it = item_of(item, blocks, starts, N);
        const int64_t r0 = it.r0, r1 = it.r1, j0 = it.j0, j1 = it.j1;
        const char *ws = (const char *)w + experts[it.s] * N * row_bytes;
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4)
            for (int64_t j = j0; j < j1; j++)
                frows4(wtype, ws + r * row_bytes, row_bytes, K, x + (x_stride ? j * x_stride : 0), out + j * N + r);
        for (; r < r1; r++)
            for (int64_t j = j0; j < j1; j++)
                out[j * N + r] = fdot_tail(wtype, ws + r * row_bytes, x + (x_stride ? j * x_stride : 0), 0, K);
    }
    (void)threads;
    return 0;
}
